"""Which changes move the pipeline's numbers: one stage (sft.py, its defaults) run under several
conditions, each compared with the first.

    python -m studies.reproducibility                       # sft.py, 5 runs, about 15 minutes on 2 cores
    python -m studies.reproducibility --script reward.py --args "--model runs/sft"

Conditions: the same command twice (2 threads); 1 thread; 2 threads with
torch.use_deterministic_algorithms(True); torchrun on 2 processes of 1 thread each (the
yardstick, another seed, is pipeline.py --seeds). For each: the first step whose logged loss differs from the
first run's (bit for bit), the largest weight difference at the end, and the final held-out
figures. CPU kernels pick their blocking, and so the order of their float sums, by the thread
count, so a change of threads or processes changes the last bits of the first step's loss; over
hundreds of steps such differences grow as a change of seed does.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

import platform
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DETERMINISTIC = ("import sys, runpy, torch; torch.use_deterministic_algorithms(True); "
                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def conditions(script):
    """(name, threads, argv prefix, extra flags) of each run."""
    py = [sys.executable]
    return [("2 threads", 2, py + [script], []),
            ("2 threads, again", 2, py + [script], []),
            ("1 thread", 1, py + [script], []),
            ("2 threads, deterministic algorithms", 2, py + ["-c", DETERMINISTIC, script], []),
            ("2 processes (torchrun) x 1 thread", 1,
             [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script], [])]


def read_rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def weights(out_dir):
    ckpt = os.path.join(out_dir, "checkpoint")
    return {k: v for f in sorted(os.listdir(ckpt)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(ckpt, f)).items()}


def compare(base, rows, base_w, w):
    losses = [(r["step"], r.get("loss")) for r in rows if "loss" in r]
    base_losses = dict((r["step"], r.get("loss")) for r in base if "loss" in r)
    first = next((s for s, v in losses if base_losses.get(s) != v), None)
    diff = max((w[k] - base_w[k]).abs().max().item() for k in base_w)
    return first, diff


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="sft.py")
    p.add_argument("--args", default="", help="extra flags for every run of the script")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = p.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="repro_")
    results, base = [], None
    for i, (name, threads, argv, extra) in enumerate(conditions(args.script)):
        run_dir = os.path.join(out, f"run{i}")
        cmd = argv + shlex.split(args.args) + extra + ["--out_dir", run_dir, "--overwrite"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        print(f"== {name}: OMP_NUM_THREADS={threads} {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        rows, w = read_rows(run_dir), weights(run_dir)
        if base is None:
            base = (rows, w)
        first, diff = compare(base[0], rows, base[1], w)
        final = {k: v for r in rows for k, v in r.items() if k.startswith("eval/")}
        results.append({"condition": name, "first_step_differing": first, "max_weight_diff": diff, "final": final})
    keys = sorted({k for r in results for k in r["final"] if k != "eval/bayes_accuracy"})
    print(f"\n{args.script} {args.args} on {platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    print("| condition | first step whose loss differs | largest weight difference at the end | "
          + " | ".join(keys) + " |")
    print("|---" * (3 + len(keys)) + "|")
    for r in results:
        first = "none" if r["first_step_differing"] is None else str(r["first_step_differing"])
        print(f"| {r['condition']} | {first} | {r['max_weight_diff']:.2e} | "
              + " | ".join(f"{r['final'].get(k, float('nan')):.4f}" for k in keys) + " |")
    path = os.path.join(ROOT, "studies", "results", f"reproducibility-{os.path.splitext(os.path.basename(args.script))[0]}"
                        "-cpu.json")
    with open(path, "w") as f:
        json.dump({"device": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "time": time.strftime("%Y-%m-%d %H:%M"), "script": args.script, "args": args.args,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
