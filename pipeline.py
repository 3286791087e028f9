"""The whole RLHF pipeline on the embedded sort task in one command, then its results table.

    SFT -> reward model -> DPO -> GRPO with the learned reward -> GRPO with the gold reward
    -> the KL-estimator comparison: short GRPO runs with k1, k2, k3, ratio*k1 and no KL term

Each stage is its own script run in a subprocess with its default flags (the defaults are
tuned for this task), writing into runs/<stage>/ and a resumable checkpoint every
SAVE_EVERY steps. A stage whose final checkpoint exists is skipped; an interrupted stage
resumes from its last checkpoint (--resume, with the same flags). At the end the
results table (held-out pairwise accuracy with the Bayes ceiling, greedy exact-match and gold
reward, and the measured KL of each estimator) is printed and written to runs/results.md, and
the plots to runs/plots/.

    python pipeline.py                      # about 7.5 minutes on 2 CPU cores
    python pipeline.py --redo dpo,grpo_rm   # run these stages again (or --redo all)
    python pipeline.py --no-kl_compare      # without the KL-estimator runs
"""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import common


@dataclass
class Config:
    runs: str = "runs"
    """folder that holds one sub-folder per stage"""
    redo: str = ""
    """comma-separated stages to run again even if finished (sft, rm, dpo, grpo_rm, grpo_gold, kl), or `all`"""
    kl_compare: bool = True
    """run the KL-estimator comparison: short GRPO runs optimising k1, k2, k3, ratio*k1 at one beta, and none"""
    kl_beta: float = 0.5
    """beta of the KL-estimator comparison runs [> 0]"""
    kl_steps: int = 20
    """steps of each KL-estimator comparison run [>= 1]"""
    plots: bool = True
    """write the PNG plots (plots/plot.py) after the table"""


SAVE_EVERY = 50  # steps between the resumable checkpoints of every stage (~0.1 s each for the tiny model)
KL_RUNS = ("none", "k1", "k2", "k3", "ratio_k1")  # the KL term in the loss of each comparison run


def stages(cfg):
    r = lambda name: os.path.join(cfg.runs, name)  # noqa: E731
    out = [
        ("sft", ["sft.py", "--out_dir", r("sft")]),
        ("rm", ["reward.py", "--model", r("sft"), "--out_dir", r("rm")]),
        ("dpo", ["dpo.py", "--model", r("sft"), "--out_dir", r("dpo")]),
        # beta 1.0: at the default 0.04 the policy over-optimises the learned reward within 10 steps
        # (longer answers score higher; the gold reward falls), see README
        ("grpo_rm", ["grpo.py", "--model", r("sft"), "--reward_model", r("rm"), "--beta", "1.0",
                     "--out_dir", r("grpo_rm")]),
        ("grpo_gold", ["grpo.py", "--model", r("sft"), "--out_dir", r("grpo_gold")]),
    ]
    if cfg.kl_compare:  # one pass per rollout, so rho = 1 and the estimators differ only by their gradients
        for est in KL_RUNS:
            beta = "0" if est == "none" else str(cfg.kl_beta)
            out.append((f"kl_{est}", ["grpo.py", "--model", r("sft"), "--out_dir", r(f"kl_{est}"), "--kl_estimator",
                                      "k3" if est == "none" else est, "--beta", beta, "--steps", str(cfg.kl_steps),
                                      "--prompts_per_step", "16", "--num_iterations", "1", "--num_mini_batches", "1",
                                      "--lr", "3e-4", "--eval_every", str(cfg.kl_steps), "--n_eval", "200",
                                      "--n_eval_pairs", "200"]))
    return [(name, argv + ["--save_every", str(SAVE_EVERY)]) for name, argv in out]


def state_of(out_dir):
    """'done', 'interrupted' (a resumable checkpoint), 'replacing' (a --redo that ended before its
    first checkpoint, the old run aside in .replaced/) or 'new'."""
    if os.path.isdir(os.path.join(out_dir, ".replaced")):
        return "replacing"
    ckpt = common.resolve_checkpoint(out_dir)
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        return "new"
    return "interrupted" if os.path.isfile(os.path.join(ckpt, "training_state.pt")) else "done"


def run_stage(name, argv, cfg, times):
    out_dir = argv[argv.index("--out_dir") + 1]
    redo = cfg.redo == "all" or name in cfg.redo.split(",") or (name.startswith("kl_") and "kl" in cfg.redo.split(","))
    state = state_of(out_dir)
    if state == "done" and not redo:
        print(f"== {name}: done already ({out_dir}), skipped", flush=True)
        return
    extra = ["--overwrite"] if redo or state == "replacing" else (["--resume"] if state == "interrupted" else [])
    cmd = [sys.executable, *argv, *extra]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    # the stage ends with the pipeline: on SIGTERM or Ctrl-C (the finally below), and on SIGKILL
    # through the kernel's parent-death signal (Linux), so a rerun never finds it still running
    proc = subprocess.Popen(cmd, preexec_fn=_end_with_parent)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if rc != 0:
        raise SystemExit(f"stage {name} failed: {' '.join(cmd)}")
    times[name] = round(time.time() - t0, 1)


def _end_with_parent():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: SIGTERM and Ctrl-C still end the stage
        pass


# -----------------------------------------------------------------------------
# the results table


def last_eval(out_dir):
    """The last value of every eval/* metric of a run."""
    found = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            found |= {k: v for k, v in row.items() if k.startswith("eval/")}
            if row["step"] == 0:
                found |= {f"start/{k}": v for k, v in row.items() if k.startswith("eval/")}
    return found


def results_table(cfg, times):
    rows = [("SFT", "sft"), ("Reward model", "rm"), ("DPO", "dpo"), ("GRPO, learned reward", "grpo_rm"),
            ("GRPO, gold reward", "grpo_gold")]
    fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| stage | pairwise accuracy (held-out) | Bayes ceiling | accuracy / ceiling | greedy exact-match | "
             "gold reward | wall time (s) |", "|---|---|---|---|---|---|---|"]
    data = {}
    for label, name in rows:
        ev = last_eval(os.path.join(cfg.runs, name))
        data[name] = ev
        acc, bayes = ev.get("eval/accuracy"), ev.get("eval/bayes_accuracy")
        ratio = acc / bayes if acc is not None and bayes else None
        lines.append(f"| {label} | {fmt(acc)} | {fmt(bayes)} | {fmt(ratio)} | {fmt(ev.get('eval/exact_match'))} | "
                     f"{fmt(ev.get('eval/gold_reward'))} | {times.get(name, '')} |")
    return "\n".join(lines), data


def kl_table(cfg, times):
    """The KL-estimator runs: measured KL (the k3 monitor `kl`) averaged over the second half of
    the steps, and the gold reward of the greedy answers at the end."""
    lines = ["| KL term in the loss | beta | measured KL, mean of the last half of the steps | greedy exact-match | "
             "gold reward | wall time (s) |", "|---|---|---|---|---|---|"]
    for est in KL_RUNS:
        out_dir = os.path.join(cfg.runs, f"kl_{est}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        kls = [r["kl"] for r in rows if "kl" in r and r["step"] > cfg.kl_steps // 2]
        ev = last_eval(out_dir)
        label, beta = ("none", 0) if est == "none" else (est, cfg.kl_beta)
        lines.append(f"| {label} | {beta} | {sum(kls) / len(kls):.4f} | {ev['eval/exact_match']:.3f} | "
                     f"{ev['eval/gold_reward']:.3f} | {times.get(f'kl_{est}', '')} |")
    return "\n".join(lines)


def main(cfg):
    common.check_ranges(cfg)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running stage is ended
    os.makedirs(cfg.runs, exist_ok=True)
    times_path = os.path.join(cfg.runs, "pipeline_times.json")
    times = json.load(open(times_path)) if os.path.isfile(times_path) else {}
    t0 = time.time()
    for name, argv in stages(cfg):
        run_stage(name, argv, cfg, times)
        with open(times_path, "w") as f:
            json.dump(times, f, indent=1)
    table, data = results_table(cfg, times)
    kl_runs = [os.path.join(cfg.runs, f"kl_{e}") for e in KL_RUNS]
    has_kl = all(os.path.isfile(os.path.join(p, "metrics.jsonl")) for p in kl_runs)
    if has_kl:
        table += f"\n\nKL estimators, GRPO with the gold reward, {cfg.kl_steps} steps:\n\n" + kl_table(cfg, times)
    with open(os.path.join(cfg.runs, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(cfg.runs, "results.json"), "w") as f:
        json.dump({"eval": data, "wall_time_s": times}, f, indent=1)
    if cfg.plots:
        runs = [os.path.join(cfg.runs, n) for n in ("sft", "rm", "dpo", "grpo_rm", "grpo_gold")]
        cmd = [sys.executable, "plots/plot.py", *runs, "--summary", os.path.join(cfg.runs, "results.json"),
               "--out", os.path.join(cfg.runs, "plots")]
        subprocess.run(cmd, check=True)
        if has_kl:
            subprocess.run([sys.executable, "plots/plot.py", "--kl_compare", *kl_runs, "--out",
                            os.path.join(cfg.runs, "plots")], check=True)
    print(f"\nResults on the embedded sort task ({time.time() - t0:.0f} s this invocation; runs in {cfg.runs}/):\n")
    print(table)


if __name__ == "__main__":
    main(common.parse_config(Config))
