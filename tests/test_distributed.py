"""Distributed runs past one device: what every rank must agree on, checked with torchrun on the
CPU (gloo). The workers are in tests/dist_worker.py."""
import time

from helpers import SUBPROCESS_ENV_NO_TOKENIZER_THREADS, run_script


def run_worker(name, *args, nproc=2, timeout=180):
    return run_script(["tests/dist_worker.py", name, *map(str, args)], nproc, timeout,
                      env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)


def test_ranks_that_see_different_out_dirs_stop_with_one_error_not_a_hang(tmp_path):
    """Node-local folders: rank 0 finds a checkpoint to resume, rank 1 none. Both stop at once,
    each naming what every rank saw, instead of one resuming and the run hanging at its first
    mismatched collective."""
    t0 = time.time()
    r = run_worker("out_dir_seen_differently", tmp_path)
    assert r.returncode != 0 and time.time() - t0 < 60
    for rank in (0, 1):
        assert f"rank {rank} stopped: the ranks see different contents in --out_dir" in r.stdout, r.stdout + r.stderr
    assert "rank 0 on " in r.stdout and ": a checkpoint at step 4; rank 1 on " in r.stdout
    assert "put out_dir on a file system all nodes share" in r.stdout
