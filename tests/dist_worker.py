"""Workers that tests/test_distributed.py runs under torchrun: `python -m torch.distributed.run
--nproc_per_node N tests/dist_worker.py NAME ARGS...`. Each prints one line per rank that the
test reads back, and exits non-zero on failure."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402


def out_dir_seen_differently(base):
    """Node-local folders, simulated: each rank is given its own out_dir, and only rank 0's holds
    a checkpoint. Every rank must stop with the same error, not resume alone and hang."""
    import sft

    d = common.setup_distributed(timeout_minutes=1.0)
    out = os.path.join(base, f"node{d.rank}")
    ckpt = os.path.join(out, "checkpoint")
    os.makedirs(ckpt, exist_ok=True)
    if d.rank == 0:
        for name, text in (("config.json", "{}"), ("trainer_state.json", '{"step": 4, "config": {}}')):
            with open(os.path.join(ckpt, name), "w") as f:
                f.write(text)
    try:
        common.prepare_out_dir(sft.Config(out_dir=out, resume=True), d)
    except RuntimeError as e:
        print(f"rank {d.rank} stopped: {e}", flush=True)
        common.cleanup_distributed()
        sys.exit(3)
    common.cleanup_distributed()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
