"""Checkpoints that survive kills, resume that reproduces, failures that never hang, bad input
that is named. Each script runs for real in a subprocess, on the tiny model."""
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

import sft

from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, adam_drift, assert_runs_agree,
                     checkpoint_config, checkpoint_weights, ctrl_c_after_first_save, free_port, max_abs_diff,
                     read_metrics, run_here, run_script, wait_until, write_jsonl)
from plumbing import checkpoints, logs, models, rundir

# a few fast steps of each script on the tiny model (no warmup: many runs are of 1 or 2 steps, which a
# warmup of as many steps would never get past, and cli.check_schedule refuses)
FAST = {
    "sft.py": ["--n_train", "256", "--n_eval", "8", "--batch_size", "8", "--max_response_len", "20",
               "--warmup_steps", "0", "--eval_every", "100"],
    "reward.py": ["--model", "tiny", "--n_train", "64", "--batch_size", "8", "--warmup_steps", "0", "--n_eval", "8",
                  "--eval_every", "100", "--n_normalize", "8", "--max_response_len", "20"],
    "dpo.py": ["--model", "tiny", "--n_train", "48", "--batch_size", "8", "--warmup_steps", "0", "--lr", "1e-3",
               "--n_eval", "8", "--n_eval_prompts", "4", "--max_response_len", "16", "--eval_every", "100"],
    "grpo.py": ["--model", "tiny", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8",
                "--n_eval", "8", "--n_eval_pairs", "8", "--eval_every", "100", "--lr", "1e-3", "--warmup_steps", "2",
                "--entropy_coef", "0.01"],  # a gradient although the random policy's rewards are all 0
}


def run_fast(script, args, nproc=1, crash=None, timeout=HANG_GUARD_S):
    """A few fast steps of script (FAST) with ARGS: in this process (helpers.run_here), or in
    processes of their own for several ranks or under tests/crash.py CRASH."""
    if nproc == 1 and crash is None:
        return run_here([script, *FAST[script], *args])
    return run_script([*(["tests/crash.py", crash] if crash else []), script, *FAST[script], *args], nproc, timeout,
                      env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)


def steps_logged(out_dir):
    return [m["step"] for m in read_metrics(out_dir)]


@pytest.mark.parametrize("script, extra", [(s, []) for s in FAST] + [("grpo.py", ["--ref_refresh_every", "2"])],
                         ids=[*FAST, "grpo.py-ref_refresh"])
def test_resume_ends_with_the_same_weights(tmp_path, script, extra):
    """Killed right after the step-2 checkpoint, then --resume: the same final weights as an
    uninterrupted run (optimizer, scheduler, RNG, data position and, for DPO and GRPO, the
    original reference all restored; with --ref_refresh_every, the reference of step 2)."""
    args = ["--steps", "4", "--save_every", "2", *extra]
    full = run_fast(script, args + ["--out_dir", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr
    if extra:  # a Ctrl-C right after the first save, in this process: what is resumed is the same
        with ctrl_c_after_first_save():
            killed = run_fast(script, args + ["--out_dir", str(tmp_path / "resumed")])
        assert killed.returncode == 130, killed.stderr
    else:  # killed (tests/crash.py: os._exit(9) after the first save)
        killed = run_fast(script, args + ["--out_dir", str(tmp_path / "resumed")], crash="after_save:1")
        assert killed.returncode == 9, killed.stderr
    assert steps_logged(tmp_path / "resumed")[-1] == 2
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.12')  # a row torn by the kill: dropped with a note, not a crash
    resumed = run_fast(script, args + ["--out_dir", str(tmp_path / "resumed"), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "line 4 is not a complete row" in resumed.stdout
    # exact: the resumed run repeats the uninterrupted one's float operations in their order (the same
    # process layout and thread count, every state restored bit for bit)
    assert max_abs_diff(checkpoint_weights(tmp_path / "full"), checkpoint_weights(tmp_path / "resumed")) == 0
    assert steps_logged(tmp_path / "resumed") == steps_logged(tmp_path / "full")  # no step twice, none missing
    for a, b in zip(read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")):
        assert a.get("kl", 0) == b.get("kl", 0), (a, b)  # the same reference


@pytest.mark.parametrize("nth_rename, left", [(2, "checkpoint"), (3, "checkpoint.old")])
def test_kill_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, nth_rename, left):
    """Saves at steps 2 and 4: rename 1 publishes the first; the second save renames the old one
    aside (rename 2) and its temporary folder into place (rename 3). Die at either."""
    out = tmp_path / "run"
    r = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(out)],
                 crash=f"at_rename:{nth_rename}")
    assert r.returncode == 9, r.stderr
    assert os.path.isdir(out / left)
    AutoModelForCausalLM.from_pretrained(checkpoints.export(out / left, tmp_path / "export"))  # exports, loadable
    resumed = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint"]


def test_a_save_every_checkpoint_is_the_sharded_state_and_exports_on_demand(tmp_path, monkeypatch):
    """--save_every writes the resumable state only (sharded/, with the config and tokenizer):
    a Hugging Face export gathers the whole model to rank 0 while the others wait (32 GB at 8B),
    so only the end writes one. `python -m plumbing export` writes it on demand: the weights of the
    step it was saved at, exactly; a script given the unexported folder as --model says so."""
    import shutil

    import torch

    out, kept, gathered = tmp_path / "run", {}, []
    save, gather = checkpoints.save_checkpoint, checkpoints.full_state_dict

    def saving(model, tokenizer, out_dir, d, **kw):
        path = save(model, tokenizer, out_dir, d, **kw)
        if kw.get("step") == 2:  # the periodic checkpoint, before the final one replaces it
            kept["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            shutil.copytree(path, tmp_path / "step2")
        return path

    monkeypatch.setattr(checkpoints, "save_checkpoint", saving)
    monkeypatch.setattr(checkpoints, "full_state_dict", lambda *a: gathered.append(1) or gather(*a))
    assert run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out)]).returncode == 0
    assert len(gathered) == 1  # the final export's; none at the step-2 save
    files = set(os.listdir(tmp_path / "step2"))
    assert {"sharded", "training_state.pt", "trainer_state.json", "config.json", "tokenizer.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)
    r = run_script(["-m", "plumbing", "export", str(tmp_path / "step2"), str(tmp_path / "export")],
                   timeout=HANG_GUARD_S, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    assert r.returncode == 0 and "exported" in r.stdout, r.stderr[-2000:]
    exported = checkpoint_weights(tmp_path, "export")
    assert all(torch.equal(exported[k], kept["weights"][k]) for k in exported)
    refused = run_fast("sft.py", ["--model", str(tmp_path / "step2"), "--steps", "1", "--out_dir", str(tmp_path / "b")])
    assert refused.returncode != 0 and "python -m plumbing export" in refused.stderr, refused.stderr[-2000:]


def test_a_failing_rank_ends_the_whole_job(tmp_path):
    """Rank 1 raises at its first step: the job ends with rank 1's error, not when rank 0's collective
    times out (--timeout_minutes 60 by default, past the test's hang guard) and not by a time of its own."""
    r = run_fast("sft.py", ["--steps", "50", "--out_dir", str(tmp_path)], nproc=2, crash="raise_on_rank:1",
                 timeout=HANG_GUARD_S)
    assert r.returncode != 0
    assert "injected failure on rank 1" in r.stderr and "Timed out" not in r.stderr + r.stdout, r.stderr[-3000:]


def _files(out_dir):
    """Every file of a run folder (the lock aside) with its bytes."""
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_overwrite_moves_the_old_run_aside_whole_and_deletes_nothing(tmp_path):
    """A run without --overwrite or --resume never touches a finished one. --overwrite used to move
    the old run's files one by one into out_dir/.replaced/, delete them at the new run's first
    checkpoint, and "restore" them after a kill mid-move by deleting the checkpoint. Now nothing is
    written before the run begins (a bad data file, a context too long for the model: out_dir byte
    for byte as it was, and no sibling), then ONE rename moves the whole old run to a sibling
    out_dir.replaced-<time>, which nothing deletes: killed at that rename or at the new run's first
    checkpoint, the old run is whole, in one place or the other."""
    out = tmp_path / "run"
    assert run_fast("sft.py", ["--steps", "1", "--out_dir", str(out)]).returncode == 0
    old = _files(out)
    siblings = lambda: sorted(p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-"))  # noqa: E731
    try:  # in-process: the same main, without a second interpreter's start-up
        with pytest.raises(FileExistsError, match="already holds a checkpoint.*--resume.*--overwrite"):
            sft.main(sft.Config(steps=2, lr=0.1, out_dir=str(out)))
    finally:
        rundir.release()  # the lock this process took
    assert _files(out) == old
    with pytest.raises(FileNotFoundError, match="typo.jsonl does not exist"):
        sft.main(sft.Config(steps=2, out_dir=str(out), overwrite=True, dataset=str(tmp_path / "typo.jsonl")))
    assert _files(out) == old
    fails = run_fast("sft.py", ["--steps", "2", "--out_dir", str(out), "--overwrite", "--max_prompt_len", "120"])
    assert fails.returncode != 0 and "exceeds the model's context of 128" in fails.stderr
    assert _files(out) == old and not siblings()
    killed = run_fast("sft.py", ["--steps", "2", "--out_dir", str(out), "--overwrite"], crash="at_rename:1")
    assert killed.returncode == 9 and _files(out) == old and not siblings()  # died before the move
    killed = run_fast("sft.py", ["--steps", "2", "--out_dir", str(out), "--overwrite"], crash="at_rename:2")
    assert killed.returncode == 9 and len(siblings()) == 1  # died at the new run's first checkpoint
    assert _files(siblings()[0]) == old and not (out / "checkpoint").exists()
    forced = run_fast("sft.py", ["--steps", "2", "--out_dir", str(out), "--overwrite"])
    assert forced.returncode == 0, forced.stderr
    assert "is now in " + str(tmp_path / "run.replaced-") in forced.stdout
    assert steps_logged(out) == [0, 1, 2] and len(siblings()) == 2 and _files(siblings()[0]) == old


def test_a_folder_holding_anything_else_is_refused_without_overwrite(tmp_path):
    """A folder with notes in checkpoint/ and a metrics.jsonl that no run wrote: a fresh run
    deleted both and exited 0. Now it stops, naming what the folder holds and what to do, and
    leaves it as it was; with --overwrite both are kept whole in the sibling."""
    out = tmp_path / "x"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "notes.txt").write_text("notes")
    (out / "metrics.jsonl").write_text("{}")
    before = _files(out)
    r = run_fast("sft.py", ["--steps", "1", "--out_dir", str(out)])
    assert r.returncode != 0 and "is not empty (it holds checkpoint, metrics.jsonl) and has no checkpoint" in r.stderr
    assert _files(out) == before and sorted(os.listdir(out)) == ["checkpoint", "metrics.jsonl"]  # no .lock left
    r = run_fast("sft.py", ["--steps", "1", "--out_dir", str(out), "--overwrite"])
    assert r.returncode == 0, r.stderr
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("x.replaced-")]
    assert _files(aside) == before


@pytest.mark.parametrize("change, what", [
    ("deleted", "was deleted or moved away by step 2, while the run went on: what the run wrote there (run_config.json, "
                "metrics.jsonl (to step 1)) is not in it. Stopping, rather than training on into a folder that is not "
                "the run's; start the run again"),
    ("replaced", "was replaced by another folder by step 2, while the run went on: what the run wrote there "
                 "(run_config.json, metrics.jsonl (to step 1)) is not in it. Stopping, rather than training on into a "
                 "folder that is not the run's; start the run again"),
    ("lock_deleted", "lost this run's lock by step 2 (its .lock was deleted or replaced): another run could start "
                     "there. Stopping, rather than training on beside it; what the run wrote there (run_config.json, "
                     "metrics.jsonl (to step 1)) is as it was: run it again with --resume to go on from its last "
                     "checkpoint")], ids=["deleted", "replaced", "lock_deleted"])
def test_an_out_dir_that_goes_or_changes_mid_run_stops_it_naming_what_it_wrote(tmp_path, monkeypatch, change, what):
    """sft.py --save_every 2 whose out_dir, right after step 1 is logged, is deleted (`rm -rf`),
    replaced by a new folder of that name, or loses its .lock: the run stops at step 2, before it
    writes there (its step-2 checkpoint), with exit status 1 and one line naming the folder, what
    happened and what the run had written there; nothing is written into the folder that is now
    there, nor is a deleted one made again, nor are the files of one that lost its lock touched.
    Before: the run went on with exit status 0, its metrics written into a file no folder held and
    its checkpoint into out_dir made anew (checkpoint/ alone: metrics.jsonl, run_config.json and the
    lock gone)."""

    out, log = tmp_path / "run", logs.Logger.log

    def logging(self, step, metrics, **kw):
        log(self, step, metrics, **kw)
        if step == 1:
            {"deleted": lambda: shutil.rmtree(out), "lock_deleted": lambda: os.remove(out / ".lock"),
             "replaced": lambda: (os.rename(out, tmp_path / "away"), out.mkdir())}[change]()

    monkeypatch.setattr(logs.Logger, "log", logging)
    r = run_fast("sft.py", ["--steps", "4", "--save_every", "2", "--out_dir", str(out)])
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == f"sft.py: --out_dir {out} {what}"
    left = {"deleted": None, "replaced": [], "lock_deleted": ["metrics.jsonl", "run_config.json"]}[change]
    assert (sorted(os.listdir(out)) if out.exists() else None) == left


def test_pipeline_resumes_an_interrupted_stage(tmp_path, monkeypatch):
    """The pipeline said it resumed an interrupted stage, but its stages wrote no checkpoint
    before the end. Each stage now saves every SAVE_EVERY steps; the flags each state gets:"""
    import pipeline
    from studies import runner

    cfg = pipeline.Config(runs=str(tmp_path))
    assert all(argv[argv.index("--save_every") + 1] == str(pipeline.SAVE_EVERY) for _, argv in pipeline.stages(cfg))
    launched = []

    class Done:
        def __init__(self, cmd, **kw):
            launched.append(cmd)

        wait = poll = lambda self, **kw: 0

    monkeypatch.setattr(pipeline.subprocess, "Popen", Done)
    states = {"new": [], "interrupted": ["checkpoint/config.json", "checkpoint/training_state.pt"],
              "failed": ["metrics.jsonl"]}
    for state, files in states.items():
        (tmp_path / state / "checkpoint").mkdir(parents=True)
        for f in files:
            (tmp_path / state / f).write_text("")
        if state == "new":
            (tmp_path / state / "checkpoint").rmdir()
        assert runner.state_of(str(tmp_path / state)) == state
        runner.run_stage(state, ["sft.py", "--out_dir", str(tmp_path / state)], cfg, {})
    extra = [cmd[4:] for cmd in launched]
    assert extra == [[], ["--resume"], ["--overwrite"]]


def test_non_finite_loss_stops_with_the_step(tmp_path):
    r = run_fast("sft.py", ["--steps", "20", "--lr", "1e30", "--out_dir", str(tmp_path)])
    assert r.returncode != 0
    assert "loss is nan" in r.stderr or "loss is inf" in r.stderr
    assert "Last good checkpoint: none written yet" in r.stderr
    assert not os.path.exists(tmp_path / "checkpoint")


def test_bad_data_file_is_named_on_stderr(tmp_path):
    """The script's own error reaches the user naming the file and line (the cases of bad files
    and rows are tests/test_common.py's test_load_data_*, in-process)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    r = run_fast("sft.py", ["--dataset", str(data), "--steps", "1", "--out_dir", str(tmp_path / "o")])
    assert r.returncode != 0 and re.search(r"data\.jsonl line 2: not valid JSON", r.stderr), r.stderr[-2000:]


@pytest.mark.parametrize("script, row, missing", [
    ("sft", {"prompt": "a"}, "completion"),
    ("reward", {"prompt": "a", "chosen": "b"}, "rejected"),
    ("dpo", {"prompt": "a", "rejected": "b"}, "chosen"),
    ("grpo", {"text": "a"}, "prompt")])
def test_missing_columns_are_named_and_nothing_is_written(tmp_path, script, row, missing):
    """Every script reads its data before it touches out_dir or loads a model."""
    module = importlib.import_module(script)
    data = write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(ValueError, match=rf"missing column\(s\) \[[^]]*'{missing}'") as e:
        module.main(module.Config(dataset=data, steps=1, out_dir=str(tmp_path / "o")))
    assert data in str(e.value)
    assert not os.path.exists(tmp_path / "o")


def test_two_nodes_match_one_process(tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 1 with a c10d rendezvous on 127.0.0.1: two 'nodes'."""
    args = ["--steps", "2", "--grad_accum", "1"]
    one = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=twonode",
                               "sft.py", *FAST["sft.py"], *args, "--out_dir", str(tmp_path / "two")],
                              cwd=ROOT, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in nodes:
        _, err = p.communicate(timeout=HANG_GUARD_S)
        assert p.returncode == 0, err[-3000:]
    # within float32's rounding of the layouts and Adam's drift (helpers.assert_runs_agree, adam_drift)
    one, two = ([r for r in read_metrics(tmp_path / run) if "loss" in r] for run in ("one", "two"))
    lr = max(r["lr"] for r in one)
    assert_runs_agree(one, two, checkpoint_config(tmp_path / "one"), length=64 + 20, lr=lr)
    assert max_abs_diff(checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "two")) <= adam_drift(lr, 2)


def test_killing_the_pipeline_ends_its_running_stage(tmp_path, how=signal.SIGKILL):
    """A killed pipeline used to leave its stage running, and a rerun started a second run on the
    same folder. Now the stage ends with it, also on SIGKILL, which no handler sees: the kernel's
    parent-death signal ends it (on Linux; SIGTERM and Ctrl-C also go through the pipeline's
    handler, which ends the stage where that signal does not exist)."""
    pipe = subprocess.Popen([sys.executable, "pipeline.py", "--runs", str(tmp_path)], cwd=ROOT,
                            env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = tmp_path / "sft" / ".lock"
    wait_until(lambda: lock.exists() and lock.read_text().startswith("pid"), pipe, "the SFT stage's lock")
    stage = int(lock.read_text().split()[1])
    pipe.send_signal(how)
    pipe.wait(timeout=HANG_GUARD_S)
    wait_until(lambda: not _alive(stage), what=f"the end of stage pid {stage} after the pipeline's")


def test_ctrl_c_during_a_pipeline_stage_ends_with_its_line_and_the_pipelines(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the pipeline and its stage, one process group) during a
    stage: the stage printed its resume line, then the pipeline a full KeyboardInterrupt
    traceback. Now the pipeline waits for the stage's line and ends with its own, the command that
    continues, exit status 130, no traceback; the stage has ended."""
    def terminal():  # a process group of its own, as a terminal's foreground job, and Ctrl-C not ignored
        os.setpgrp()
        _ctrl_c_as_in_a_terminal()

    pipe = subprocess.Popen([sys.executable, "pipeline.py", "--runs", str(tmp_path)], cwd=ROOT,
                            env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=terminal)
    lock = tmp_path / "sft" / ".lock"  # written once the SFT stage runs, its handlers set
    wait_until(lambda: lock.exists() and lock.read_text().startswith("pid"), pipe, "the SFT stage's lock")
    stage = int(lock.read_text().split()[1])
    os.killpg(pipe.pid, signal.SIGINT)
    _, err = pipe.communicate(timeout=HANG_GUARD_S)
    assert pipe.returncode == 130 and "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] == (f"pipeline interrupted; continue with: python pipeline.py --runs {tmp_path} (finished stages "
                         f"are skipped, an interrupted one resumes from its last checkpoint)"), err[-3000:]
    assert lines[-3].startswith("interrupted") and lines[-2] == "", err[-3000:]  # the stage's own line
    assert not _alive(stage)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _ctrl_c_as_in_a_terminal():
    """A shell without job control starts `cmd &` with SIGINT ignored, and children inherit that:
    a suite run in the background would see the script ignore the Ctrl-C (as it should there)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_with_one_line_naming_the_checkpoint_and_the_resume_command(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "sft.py", "--model", "tiny", "--steps", "500", "--save_every", "2",
                             "--n_train", "64", "--eval_every", "500", "--n_eval", "8", "--batch_size", "8",
                             "--out_dir", str(out)],
                            cwd=ROOT, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    wait_until((out / "checkpoint" / "training_state.pt").exists, proc, "a checkpoint")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert f"interrupted. Last checkpoint: {out / 'checkpoint'} (step " in err
    assert "continue with: python sft.py --model tiny" in err and err.rstrip().endswith("--resume")


def test_save_dtype_exports_bf16_while_resume_keeps_the_fp32_state(tmp_path):
    """--save_dtype bfloat16: the export is the fp32 run's weights cast to bf16, loads with
    AutoModelForCausalLM and says bfloat16 in its config; a run killed after its step-2
    checkpoint and resumed continues from the fp32 state (sharded/), not from the rounded
    export: steps 3 and 4 log the uninterrupted run's losses to 1e-6."""
    import json

    import torch

    args = ["--steps", "4", "--save_every", "2"]
    fp32 = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "fp32")])
    bf16 = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "bf16"), "--save_dtype", "bfloat16"])
    assert fp32.returncode == 0 and bf16.returncode == 0, fp32.stderr + bf16.stderr
    want, got = checkpoint_weights(tmp_path / "fp32"), checkpoint_weights(tmp_path / "bf16")
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    with open(tmp_path / "bf16" / "checkpoint" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "checkpoint").dtype == torch.bfloat16
    out = ["--out_dir", str(tmp_path / "resumed"), "--save_dtype", "bfloat16"]
    assert run_fast("sft.py", args + out, crash="after_save:1").returncode == 9
    resumed = run_fast("sft.py", args + out + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr
    for a, b in zip(read_metrics(tmp_path / "fp32")[-2:], read_metrics(tmp_path / "resumed")[-2:]):
        assert b["loss"] == a["loss"], (a, b)  # exact: the fp32 state resumed, the same float operations


def test_ctrl_c_inside_a_sharded_save_ends_like_any_ctrl_c(tmp_path, monkeypatch):
    """torch.distributed.checkpoint wraps whatever its workers raise, a KeyboardInterrupt too, in
    a CheckpointException: a Ctrl-C that struck while a checkpoint was written ended in a
    traceback and exit 1. It now ends as any Ctrl-C does: exit 130 and the line naming the last
    whole checkpoint (step 2; the one of step 4 was being written)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    plan, calls = FileSystemWriter.prepare_local_plan, []

    def interrupted_at_the_second_save(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return plan(self, *a, **kw)

    monkeypatch.setattr(FileSystemWriter, "prepare_local_plan", interrupted_at_the_second_save)
    r = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"interrupted. Last checkpoint: {tmp_path / 'run' / 'checkpoint'} (step 2)" in r.stderr


def test_ctrl_c_that_a_writer_turns_into_another_error_ends_like_any_ctrl_c(tmp_path, monkeypatch):
    """A real SIGINT while a shard file is written, whose writer's __exit__ then fails ("unexpected
    pos", as torch.save's zip writer did when a Ctrl-C cut its write): the KeyboardInterrupt is
    replaced by a RuntimeError, which torch.distributed.checkpoint wraps. It ends as a Ctrl-C: exit
    130 and the line naming the last whole checkpoint (step 2), no traceback."""
    import torch.distributed.checkpoint.filesystem as fs

    plan, write, saves = fs.FileSystemWriter.prepare_local_plan, fs._write_item, []

    def counted(self, *a, **kw):
        saves.append(1)
        return plan(self, *a, **kw)

    def cut_by_ctrl_c(*a, **kw):
        if len(saves) < 2:
            return write(*a, **kw)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the run's handler raises KeyboardInterrupt here
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(fs.FileSystemWriter, "prepare_local_plan", counted)
    monkeypatch.setattr(fs, "_write_item", cut_by_ctrl_c)
    # as in a terminal: a suite started as a background job (`pytest &` in a script) inherits SIGINT
    # ignored, the run then rightly leaves it so, and the Ctrl-C this test sends would never arrive
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        r = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGINT, old)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"interrupted. Last checkpoint: {tmp_path / 'run' / 'checkpoint'} (step 2)" in r.stderr


# -----------------------------------------------------------------------------
# a save is never lost to a signal; the last step is saved before what follows it; a failed export keeps the weights


def test_a_signal_during_a_checkpoints_write_lets_it_end_and_the_heartbeat_names_it(tmp_path, monkeypatch):
    """A Ctrl-C a second after `step 2/8 |`, while step 2's checkpoint was written (the heartbeat
    said `step 3/8: running`), ended the run "interrupted before its first resumable checkpoint":
    the save was lost. Here a SIGINT strikes in the middle of step 2's write (the sharded state
    written, the config and tokenizer not yet): the write ends, and then the run, naming that
    checkpoint; 41 s into the write with nothing printed, the heartbeat names the save."""
    out, write, beats = tmp_path / "run", checkpoints._write_export, []

    def signalled(*a, **kw):
        if not beats:  # step 2's checkpoint, the first
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C: its handler runs in this thread, here
            log = rundir.RUNS[-1].logger
            log.t_said -= 41
            logs.innermost().t0 -= 41
            beats.append(log.beat())
        return write(*a, **kw)

    monkeypatch.setattr(checkpoints, "_write_export", signalled)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see the test above)
    try:
        r = run_fast("sft.py", ["--steps", "4", "--save_every", "2", "--out_dir", str(out)])
    finally:
        signal.signal(signal.SIGINT, old)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"interrupted. Last checkpoint: {out / 'checkpoint'} (step 2); continue with: " in r.stderr, r.stderr[-3000:]
    assert beats == ["step 2/4: saving checkpoint, 41s"]
    assert checkpoints.trainer_state(out / "checkpoint")["step"] == 2 and not (out / "checkpoint.tmp").exists()
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]


def test_a_second_signal_cuts_the_save_short_and_the_line_names_the_checkpoint_left(tmp_path):
    """A save that takes long (here step 4's, held by tests/crash.py until a FIFO is opened, which
    never happens): the first SIGTERM is answered at once, saying that the run ends once the
    checkpoint is written; a second cuts the write short, and the line says so and names the
    checkpoint that remains (step 2's) with the command that resumes it. Each step of the test waits
    for a line of the run's stderr."""
    out, fifo = tmp_path / "run", tmp_path / "hold"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "tests/crash.py", "hold_save:2", "sft.py", *FAST["sft.py"], "--steps", "6",
                             "--save_every", "2", "--out_dir", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**SUBPROCESS_ENV_NO_TOKENIZER_THREADS, "HOLD_FIFO": str(fifo)})
    seen = []

    def until(text):
        """stderr's lines up to the first holding text; False if the run's output ends first."""
        for line in proc.stderr:
            seen.append(line)
            if text in line:
                return True
        return False

    try:
        assert until("holding the save"), "".join(seen)[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert until("SIGTERM: the checkpoint of step 4 is being written; the run ends once it is (a second signal "
                     "cuts it short)"), "".join(seen)[-3000:]
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=HANG_GUARD_S) == 143, rest[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (f"terminated (SIGTERM) again while the checkpoint of step 4 was written: that save was cut short. Last "
            f"checkpoint: {out / 'checkpoint'} (step 2); continue with: python sft.py ") in rest, rest[-3000:]
    assert checkpoints.trainer_state(models.resolve_checkpoint(str(out)))["step"] == 2


# the phase after the last step of each script, its function (module, name), and the flags that make it run
AFTER_THE_LAST_STEP = {"sft.py": ("sft", "evaluate", []), "reward.py": ("reward", "normalize", ["--normalize"]),
                       "dpo.py": ("dpo", "evaluate", []), "grpo.py": ("environment", "evaluate", [])}


@pytest.mark.parametrize("script", AFTER_THE_LAST_STEP)
def test_a_kill_after_the_last_step_loses_nothing(tmp_path, monkeypatch, script):
    """reward.py's --normalize pass over 512 samples ran 12 minutes after the last step with no
    checkpoint of it: a kill there lost the run (and so did one in any script's final evaluation
    or export). Every script now writes a resumable checkpoint at the last step before what follows
    it: a Ctrl-C in the final evaluation (reward.py: the normalisation) ends naming the step-2
    checkpoint, and --resume runs only what follows the steps, to the uninterrupted run's metrics
    (their times aside) and exported weights, exactly."""
    module, name, extra = AFTER_THE_LAST_STEP[script]
    args = ["--steps", "2", *extra]
    full = run_fast(script, args + ["--out_dir", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr[-3000:]
    target = importlib.import_module(module)
    phase = getattr(target, name)

    def after_the_last_step(*a, **kw):
        run = rundir.RUNS[-1]
        if run.logger is not None and run.logger.step == run.cfg.steps:
            raise KeyboardInterrupt
        return phase(*a, **kw)

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(target, name, after_the_last_step)
        stopped = run_fast(script, args + ["--out_dir", str(out)])
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"interrupted. Last checkpoint: {out / 'checkpoint'} (step 2); continue with: " in stopped.stderr
    resumed = run_fast(script, args + ["--out_dir", str(out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "its 2 steps are done: what follows them (the final evaluation, the export) runs now" in resumed.stdout
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]  # noqa: E731
    assert untimed(read_metrics(out)) == untimed(read_metrics(tmp_path / "full"))
    assert max_abs_diff(checkpoint_weights(out), checkpoint_weights(tmp_path / "full")) == 0


@pytest.mark.parametrize("error, flags", [("KeyError", []), ("PermissionError", ["--save_minutes", "0"])],
                         ids=["state_dict_error", "permission_without_checkpoints"])
def test_a_final_export_that_fails_keeps_the_weights_and_says_what_failed(tmp_path, monkeypatch, error, flags):
    """A final save that failed (LoRA on a tied head: a KeyError in the state dict; a full disk; a
    folder that cannot be written) said "N MiB are free there. The last checkpoint (RUN/checkpoint)
    is untouched" where there was none, and left checkpoint.tmp. Now the error names the exception
    and the path, while doing what, claims only the checkpoint there is, and removes checkpoint.tmp;
    the trained weights are kept: in the last step's checkpoint, or, where the run writes none
    (--save_minutes 0), in one written then, which `python -m plumbing export` exports to the
    weights the export was given, exactly."""
    import torch

    out, write, given = tmp_path / "run", checkpoints._write_export, {}
    tmp = out / "checkpoint.tmp"
    failure = {"KeyError": KeyError("base_model.model.lm_head.base_layer.weight"),
               "PermissionError": PermissionError(13, "Permission denied", str(tmp / "model.safetensors"))}[error]

    def failing(model, tokenizer, folder, state, dtype, weights=True):
        if weights:  # the export's
            given.update({k: v.clone() for k, v in state.items()})
            raise failure
        return write(model, tokenizer, folder, state, dtype, weights=weights)

    monkeypatch.setattr(checkpoints, "_write_export", failing)
    r = run_fast("sft.py", ["--steps", "2", "--out_dir", str(out), *flags])
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"writing the final export failed while writing the weights, config and tokenizer into {tmp} "
            f"({error}: {failure})") in r.stderr, r.stderr[-3000:]
    assert "MiB are free" not in r.stderr and "no space left" not in r.stderr
    if flags:  # no checkpoint before the export: none claimed, one written
        assert f"{out} held no checkpoint before it" in r.stderr and "untouched" not in r.stderr
        written = " (written after the export failed)"
    else:
        assert f"The last checkpoint, {out / 'checkpoint'} (step 2), is untouched" in r.stderr
        written = ""
    assert (f"The trained weights are kept in {out / 'checkpoint'}, the checkpoint of the last step 2{written}: `python -m "
            f"plumbing export {out}` writes their export") in r.stderr, r.stderr[-3000:]
    assert not tmp.exists()
    monkeypatch.setattr(checkpoints, "_write_export", write)
    exported = checkpoints.export(str(out))
    assert exported == str(out / "export-step-2")
    loaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert given and all(torch.equal(loaded[k], v) for k, v in given.items())


def test_sigterm_ends_the_pipeline_with_the_line_that_continues_it(tmp_path):
    """`python pipeline.py` ended by SIGTERM (a scheduler's, to its process group) printed no
    "continue with" line, where Ctrl-C's printed one. Now it ends as Ctrl-C does: the stage's own
    line, then the pipeline's, exit status 143, no traceback; the stage has ended."""
    pipe = subprocess.Popen([sys.executable, "pipeline.py", "--runs", str(tmp_path)], cwd=ROOT,
                            env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lock = tmp_path / "sft" / ".lock"
    wait_until(lambda: lock.exists() and lock.read_text().startswith("pid"), pipe, "the SFT stage's start (its lock)")
    stage = int(lock.read_text().split()[1])
    os.killpg(pipe.pid, signal.SIGTERM)
    _, err = pipe.communicate(timeout=HANG_GUARD_S)
    assert pipe.returncode == 143 and "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] == (f"pipeline terminated (SIGTERM); continue with: python pipeline.py --runs {tmp_path} "
                         f"(finished stages are skipped, an interrupted one resumes from its last checkpoint)"), err[-3000:]
    assert lines[-3].startswith("terminated (SIGTERM)") and lines[-2] == "", err[-3000:]
    assert not _alive(stage)
