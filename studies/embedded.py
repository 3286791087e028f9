"""The studies on the embedded task, run by stages.py's flags: the KL estimators in GRPO's loss
(--kl_compare), over-optimising a learned reward (--overopt), the variants side by side
(--variants) and on-policy distillation (--distill). Each run is a script run as stages.py runs
the five stages (runner.run_stages), from seed 0's SFT model and reward model; the tables come out
beside the five stages' (docs/results.md, docs/variants.md)."""
import json
import os

import torch

import common
import sampling
import tasks
from studies import runner

KL_RUNS = ("none", "k1", "k2", "k3", "ratio_k1")  # the KL term in the loss of each comparison run


# the variants compared (stages.py --variants): the flags of each beside the scripts' defaults
VARIANTS = {
    "grpo": {
        "grpo": [],
        "dr_grpo": ["--loss_agg", "constant", "--scale_rewards", "none"],
        "gspo": ["--importance_sampling_level", "sequence", "--loss_agg", "seq_mean_token_mean",
                 "--epsilon_low", "3e-4", "--epsilon_high", "4e-4"],  # GSPO's clip range (Sec. 5.1)
        "cispo": ["--loss_type", "cispo", "--epsilon_high", "5"],  # the IS weight capped at 5 (ScaleRL's, TRL's)
        "sapo": ["--loss_type", "sapo", "--loss_agg", "token_mean"],  # as measured: TRL's sapo averages per sequence
        "rloo": ["--adv_estimator", "rloo", "--scale_rewards", "none"],
        "dppo_tv": ["--loss_type", "dppo_tv", "--epsilon_low", "0.15", "--epsilon_high", "0.15"],  # verl's DPPO recipe
        "dppo_kl": ["--loss_type", "dppo_kl", "--epsilon_low", "0.05", "--epsilon_high", "0.05"],
        "maxrl": ["--adv_estimator", "maxrl", "--scale_rewards", "none"],
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


def kl_curves(cfg):
    """Per estimator: every seed's measured KL (the k3 monitor `kl`) at each step, and its final evaluation."""
    out = {}
    for est in KL_RUNS:
        dirs = [kl_dir(cfg.runs, est, s) for s in range(cfg.study_seeds)]
        rows = [runner.read_rows(d) for d in dirs]
        out[est] = {"beta": 0 if est == "none" else cfg.kl_beta,
                    "steps": [r["step"] for r in rows[0] if "kl" in r],
                    "kl_by_seed": [[r["kl"] for r in rs if "kl" in r] for rs in rows],
                    "eval_by_seed": [runner.last_eval(d) for d in dirs], "dirs": dirs}
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
        lines.append(f"| {est} | {c['beta']} | {runner.cell(c['kl_last_half'], 4)} | "
                     f"{runner.cell([e['eval/exact_match'] for e in evs])} | {runner.cell([e['eval/gold_reward'] for e in evs])} | "
                     f"{runner.seconds(times, c['dirs'], cfg.runs)} |")
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
        runs = [runner.read_rows(d) for d in dirs]
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
        lines.append(f"| {beta} | {runner.cell([s[0] for s in c['eval_gold_by_seed']])} -> {gold[peak]:.3f} "
                     f"(step {c['eval_steps'][peak]}, {sqrt_kl[peak]:.2f}) -> {runner.cell(ends)} | "
                     f"{runner.cell([s[-1] for s in c['eval_sqrt_kl_by_seed']], 2)} | {runner.cell(first(c['rm_by_seed']), 2)} -> "
                     f"{runner.cell(last(c['rm_by_seed']), 2)} | {runner.cell(first(c['gold_by_seed']))} -> "
                     f"{runner.cell(last(c['gold_by_seed']))} | {runner.seconds(times, c['dirs'], cfg.runs)} |")
    return "\n".join(lines)


def policy_kl(policy, reference, n=VARIANT_KL_PROMPTS, new_tokens=32):
    """KL(pi || pi_ref) per response of a trained policy to its start, on n held-out prompts of
    the sort task, one sample each at temperature 1 (seeded): the k3 estimate summed over each
    response's tokens (unbiased for the sequence KL), averaged. One measure for every variant,
    where the scripts' own monitors differ (GRPO's is per token on its rollouts; DPO has none)."""
    tok, pi = runner.load_trained(policy)
    ref = runner.load_trained(reference)[1]
    prompts = [r["prompt"] for r in tasks.prompt_rows(n, split="test")]
    p_ids, p_mask = common.pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id, side="left")
    r_ids, r_mask = sampling.generate(pi, p_ids, p_mask, new_tokens, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                      temperature=1.0, uniforms=sampling.rollout_uniforms(n, new_tokens, 0))
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
            evs, kls = [runner.last_eval(d) for d in dirs], [cached_kl(d, sft) for d in dirs]
            out.setdefault(algo, {})[name] = {"flags": flags, "eval_by_seed": evs, "kl_by_seed": kls, "dirs": dirs}
            col = lambda key: runner.cell([e.get(key) for e in evs])  # noqa: E731
            cols = [col("eval/gold_reward"), col("eval/exact_match")] if algo == "grpo" else \
                [col("eval/accuracy"), col("eval/accuracy_over_bayes"), col("eval/gold_reward")]
            lines.append(f"| {name} | {' '.join(flags) or '(defaults)'} | {' | '.join(cols)} | {runner.cell(kls, 2)} | "
                         f"{runner.seconds(times, dirs, cfg.runs)} |")
        tables.append("\n".join(lines))
    return tables, out


DISTILL_RUNS = ("distill", "grpo_gold")  # on-policy distillation from the GRPO model; GRPO with the gold reward


def distill_dir(runs, kind, seed):
    return os.path.join(runs, "distill", kind, f"seed{seed}")


def distill_curves(cfg):
    """Per kind: every seed's greedy exact-match and gold reward at each evaluation, time per step,
    and (distillation) the reverse KL to the teacher per sequence; the teacher's own evaluation."""
    out = {"teacher": runner.last_eval(os.path.join(cfg.runs, "grpo_gold"))}
    for kind in DISTILL_RUNS:
        dirs = [distill_dir(cfg.runs, kind, s) for s in range(cfg.study_seeds)]
        rows = [[r for r in runner.read_rows(d)] for d in dirs]
        evals = [[r for r in rs if "eval/exact_match" in r] for rs in rows]
        out[kind] = {"steps": [r["step"] for r in evals[0]], "dirs": dirs,
                     "exact_by_seed": [[r["eval/exact_match"] for r in e] for e in evals],
                     "gold_by_seed": [[r["eval/gold_reward"] for r in e] for e in evals],
                     "step_time_by_seed": [sum(r["time/step"] for r in rs if r["step"] > 1) /
                                           max(1, sum(r["step"] > 1 for r in rs)) for rs in rows],
                     "reverse_kl_by_seed": [[r.get("distill/reverse_kl") for r in rs if r["step"] > 0] for rs in rows]}
    return out


def distill_table(cfg, curves, times):
    """Greedy exact-match and gold reward at each evaluation (mean +- std over the seeds), then the
    time per step of each side (steps after the first: compilation and warm-up left out)."""
    teacher = curves["teacher"]
    lines = ["| step | distillation: exact-match | gold reward | GRPO, gold reward: exact-match | gold reward |",
             "|---|---|---|---|---|"]
    d, g = curves["distill"], curves["grpo_gold"]
    for i, step in enumerate(d["steps"]):
        col = lambda c, key: runner.cell([v[i] for v in c[key]])  # noqa: E731
        lines.append(f"| {step} | {col(d, 'exact_by_seed')} | {col(d, 'gold_by_seed')} | {col(g, 'exact_by_seed')} | "
                     f"{col(g, 'gold_by_seed')} |")
    lines.append(f"| the teacher (seed 0's GRPO, {runner.read_rows(os.path.join(cfg.runs, 'grpo_gold'))[-1]['step']} "
                 f"steps; its own 500 held-out prompts) | "
                 f"{teacher['eval/exact_match']:.3f} | {teacher['eval/gold_reward']:.3f} | | |")
    ratio = [a / b for a, b in zip(d["step_time_by_seed"], g["step_time_by_seed"])]
    lines.append(f"\nSeconds per step: distillation {runner.cell(d['step_time_by_seed'], 3)}, GRPO "
                 f"{runner.cell(g['step_time_by_seed'], 3)}, ratio {runner.cell(ratio, 2)} (the same seed's "
                 f"two runs, one after the other; wall time per run: {runner.seconds(times, d['dirs'], cfg.runs)} s "
                 f"and {runner.seconds(times, g['dirs'], cfg.runs)} s).")
    return "\n".join(lines)


def stages(cfg):
    """(group, argv) of every study run the flags ask for, in order; the group is what --redo names."""
    out = []
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
    for seed in range(cfg.study_seeds) if cfg.distill else ():
        every = ["--steps", str(cfg.distill_steps), "--eval_every", "2", "--n_eval", "200", "--n_eval_pairs", "200",
                 "--seed", str(seed)]
        out.append(("distill", ["grpo.py", "--model", sft, "--teacher", os.path.join(cfg.runs, "grpo_gold"),
                                "--reward_weights", "rule:0", "--beta", "0", "--out_dir",
                                distill_dir(cfg.runs, "distill", seed), *every]))
        out.append(("distill", ["grpo.py", "--model", sft, "--out_dir", distill_dir(cfg.runs, "grpo_gold", seed),
                                *every]))
    return out


def tables(cfg, times, results):
    """The studies' tables, below the five stages' (their curves into `results`)."""
    table = ""
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
    if cfg.distill:
        curves = distill_curves(cfg)
        table += (f"\n\nOn-policy distillation (grpo.py --teacher, the task reward off, beta 0) from the GRPO model "
                  f"against GRPO with the gold reward, {cfg.distill_steps} steps ({study}; greedy answers to 200 "
                  f"held-out prompts):\n\n" + distill_table(cfg, curves, times))
        results["distill"] = curves
    if cfg.variants:  # a file of its own: a --variants run need not redo the tables above with all their seeds
        (grpo_t, dpo_t), curves = variants_results(cfg, times)
        variants = (f"GRPO variants, gold reward, {cfg.variant_steps} steps x 16 prompts x 8 samples ({study}):\n\n"
                    f"{grpo_t}\n\nDPO variants, {5 * cfg.variant_steps} steps x 64 pairs ({study}):\n\n{dpo_t}")
        table += "\n\n" + variants
        with open(os.path.join(cfg.runs, "variants.md"), "w") as f:
            f.write(variants + "\n")
        with open(os.path.join(cfg.runs, "variants.json"), "w") as f:
            json.dump({"variants": curves, "variant_steps": cfg.variant_steps, "wall_time_s": times}, f, indent=1)
    return table
