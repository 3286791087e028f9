"""The stage runner and the table helpers pipeline.py and the studies share: each stage a script
run in a subprocess (skipped when finished, resumed when interrupted, redone on --redo, ended with
the pipeline), and a finished run's rows, its last evaluation and the mean +- std cells of the
tables."""
import json
import os
import signal
import subprocess
import sys
import time

from plumbing import models


def seed_dir(runs, seed):
    """Seed 0 is the default run (RUNS/sft is every script's default --model); seed k > 0 lives in RUNS/seed<k>."""
    return runs if seed == 0 else os.path.join(runs, f"seed{seed}")


def state_of(out_dir):
    """'done', 'interrupted' (a resumable checkpoint), 'failed' (files of a run that ended before
    its first checkpoint) or 'new' (an empty or absent folder)."""
    ckpt = models.resolve_checkpoint(out_dir)
    if os.path.isfile(os.path.join(ckpt, "config.json")):
        return "interrupted" if os.path.isfile(os.path.join(ckpt, "training_state.pt")) else "done"
    held = set(os.listdir(out_dir)) - {".lock"} if os.path.isdir(out_dir) else set()
    return "failed" if held else "new"


def load_times(path):
    """The wall times of the stages an earlier invocation ran ({} if none)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def redo(cfg, name):
    """Whether --redo names this stage (or is `all`)."""
    return cfg.redo == "all" or name in cfg.redo.split(",")


class Terminated(KeyboardInterrupt):
    """A SIGTERM of the pipeline (`kill PID`, a scheduler's), raised as Ctrl-C's KeyboardInterrupt is
    (terminated): the running stage is ended the same way, and the pipeline ends with its line."""


def terminated(signum, frame):
    raise Terminated


def run_stage(name, argv, cfg, times):
    out_dir = argv[argv.index("--out_dir") + 1]
    redo_it = redo(cfg, name)
    state = state_of(out_dir)
    if state == "done" and not redo_it:
        print(f"== {name}: done already ({out_dir}), skipped", flush=True)
        return
    # a failed stage's files are moved aside (out_dir.replaced-<time>) by --overwrite, never deleted
    extra = ["--overwrite"] if redo_it or state == "failed" else (["--resume"] if state == "interrupted" else [])
    cmd = [sys.executable, *argv, *extra]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    # the stage ends with the pipeline: on SIGTERM or Ctrl-C (below), and on SIGKILL through the
    # kernel's parent-death signal (Linux), so a rerun never finds it still running
    proc = subprocess.Popen(cmd, preexec_fn=_end_with_parent)
    try:
        rc = proc.wait()
    except KeyboardInterrupt as e:  # a terminal's Ctrl-C (a group's SIGTERM) reaches the stage too, which
        sig = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT  # ends with its own line: wait for
        old = signal.signal(sig, signal.SIG_IGN)  # it, a second signal ignored; passed on if the stage still runs
        try:  # after 10 s (a `kill PID` of the pipeline alone)
            _stop(proc, sig, grace=10)
        finally:
            signal.signal(sig, old)
        raise
    finally:
        _stop(proc, signal.SIGTERM, grace=0)
    if rc != 0:
        raise SystemExit(f"stage {name} failed: {' '.join(cmd)}")
    times[os.path.relpath(out_dir, cfg.runs)] = round(time.time() - t0, 1)


def run_stages(stage_list, cfg, times, times_path):
    """run_stage for each, the wall times written after each (a later invocation keeps them)."""
    for name, argv in stage_list:
        run_stage(name, argv, cfg, times)
        with open(times_path, "w") as f:
            json.dump(times, f, indent=1)


def _stop(proc, sig, grace):
    """End proc if it still runs: `grace` seconds to end on its own, then sig, then SIGKILL 30 s later."""
    for send, wait in ((None, grace), (sig, 30), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        if send is not None:
            proc.send_signal(send)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def _end_with_parent():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: SIGTERM and Ctrl-C still end the stage
        pass


def read_rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_eval(out_dir):
    """The last value of every eval/* metric of a run."""
    found = {}
    for row in read_rows(out_dir):
        found |= {k: v for k, v in row.items() if k.startswith("eval/")}
        if row["step"] == 0:
            found |= {f"start/{k}": v for k, v in row.items() if k.startswith("eval/")}
    return found


def stats(values):
    """mean, sample std (0 for one value), min, max of a list of numbers."""
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def cell(values, digits=3):
    """A table cell: the value of one seed, or mean +- std of several."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    s = stats(values)
    return f"{s['mean']:.{digits}f}" if s["n"] == 1 else f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def seconds(times, dirs, runs):
    """Mean wall time of the runs in dirs (those this folder has times for)."""
    found = [times[k] for k in (os.path.relpath(d, runs) for d in dirs) if k in times]
    return f"{sum(found) / len(found):.0f}" if found else ""


def load_trained(name):
    """The tokenizer and the model (eval mode) of a checkpoint folder, a run's out_dir or a packaged model."""
    tok = models.load_tokenizer(name)
    return tok, models.load_model(name, tok).eval()
