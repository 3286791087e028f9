"""The studies of pipeline.py, run by its flags: the KL estimators in GRPO's loss (--kl_compare),
over-optimising a learned reward (--overopt), the variants side by side (--variants), and the
real-model pipeline on SmolLM2-135M-Instruct (--smollm2), that model with a calculator
(--smollm2_tools) and distilled from its GRPO model (--smollm2_distill). Each run is a script run as
pipeline.py runs the five stages (pipeline.run_stages), from seed 0's SFT model and reward model;
the tables come out beside the five stages' (docs/results.md, docs/variants.md, docs/smollm2.md).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import common
import data
import pipeline
import run
import sampling
import tasks

KL_RUNS = ("none", "k1", "k2", "k3", "ratio_k1")  # the KL term in the loss of each comparison run


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
        rows = [pipeline.read_rows(d) for d in dirs]
        out[est] = {"beta": 0 if est == "none" else cfg.kl_beta,
                    "steps": [r["step"] for r in rows[0] if "kl" in r],
                    "kl_by_seed": [[r["kl"] for r in rs if "kl" in r] for rs in rows],
                    "eval_by_seed": [pipeline.last_eval(d) for d in dirs], "dirs": dirs}
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
        lines.append(f"| {est} | {c['beta']} | {pipeline.cell(c['kl_last_half'], 4)} | "
                     f"{pipeline.cell([e['eval/exact_match'] for e in evs])} | {pipeline.cell([e['eval/gold_reward'] for e in evs])} | "
                     f"{pipeline.seconds(times, c['dirs'], cfg.runs)} |")
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
        runs = [pipeline.read_rows(d) for d in dirs]
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
        lines.append(f"| {beta} | {pipeline.cell([s[0] for s in c['eval_gold_by_seed']])} -> {gold[peak]:.3f} "
                     f"(step {c['eval_steps'][peak]}, {sqrt_kl[peak]:.2f}) -> {pipeline.cell(ends)} | "
                     f"{pipeline.cell([s[-1] for s in c['eval_sqrt_kl_by_seed']], 2)} | {pipeline.cell(first(c['rm_by_seed']), 2)} -> "
                     f"{pipeline.cell(last(c['rm_by_seed']), 2)} | {pipeline.cell(first(c['gold_by_seed']))} -> "
                     f"{pipeline.cell(last(c['gold_by_seed']))} | {pipeline.seconds(times, c['dirs'], cfg.runs)} |")
    return "\n".join(lines)


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
            evs, kls = [pipeline.last_eval(d) for d in dirs], [cached_kl(d, sft) for d in dirs]
            out.setdefault(algo, {})[name] = {"flags": flags, "eval_by_seed": evs, "kl_by_seed": kls, "dirs": dirs}
            col = lambda key: pipeline.cell([e.get(key) for e in evs])  # noqa: E731
            cols = [col("eval/gold_reward"), col("eval/exact_match")] if algo == "grpo" else \
                [col("eval/accuracy"), col("eval/accuracy_over_bayes"), col("eval/gold_reward")]
            lines.append(f"| {name} | {' '.join(flags) or '(defaults)'} | {' | '.join(cols)} | {pipeline.cell(kls, 2)} | "
                         f"{pipeline.seconds(times, dirs, cfg.runs)} |")
        tables.append("\n".join(lines))
    return tables, out


DISTILL_RUNS = ("distill", "grpo_gold")  # on-policy distillation from the GRPO model; GRPO with the gold reward


def distill_dir(runs, kind, seed):
    return os.path.join(runs, "distill", kind, f"seed{seed}")


def distill_curves(cfg):
    """Per kind: every seed's greedy exact-match and gold reward at each evaluation, time per step,
    and (distillation) the reverse KL to the teacher per sequence; the teacher's own evaluation."""
    out = {"teacher": pipeline.last_eval(os.path.join(cfg.runs, "grpo_gold"))}
    for kind in DISTILL_RUNS:
        dirs = [distill_dir(cfg.runs, kind, s) for s in range(cfg.study_seeds)]
        rows = [[r for r in pipeline.read_rows(d)] for d in dirs]
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
    lines = [f"| step | distillation: exact-match | gold reward | GRPO, gold reward: exact-match | gold reward |",
             "|---|---|---|---|---|"]
    d, g = curves["distill"], curves["grpo_gold"]
    for i, step in enumerate(d["steps"]):
        col = lambda c, key: pipeline.cell([v[i] for v in c[key]])  # noqa: E731
        lines.append(f"| {step} | {col(d, 'exact_by_seed')} | {col(d, 'gold_by_seed')} | {col(g, 'exact_by_seed')} | "
                     f"{col(g, 'gold_by_seed')} |")
    lines.append(f"| the teacher (seed 0's GRPO, {pipeline.read_rows(os.path.join(cfg.runs, 'grpo_gold'))[-1]['step']} "
                 f"steps; its own 500 held-out prompts) | "
                 f"{teacher['eval/exact_match']:.3f} | {teacher['eval/gold_reward']:.3f} | | |")
    ratio = [a / b for a, b in zip(d["step_time_by_seed"], g["step_time_by_seed"])]
    lines.append(f"\nSeconds per step: distillation {pipeline.cell(d['step_time_by_seed'], 3)}, GRPO "
                 f"{pipeline.cell(g['step_time_by_seed'], 3)}, ratio {pipeline.cell(ratio, 2)} (the same seed's "
                 f"two runs, one after the other; wall time per run: {pipeline.seconds(times, d['dirs'], cfg.runs)} s "
                 f"and {pipeline.seconds(times, g['dirs'], cfg.runs)} s).")
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


# -----------------------------------------------------------------------------
# the real-model pipeline (--smollm2)


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
    tok = data.load_tokenizer(name)
    return tok, common.load_model(name, tok).eval()


def answers(tok, model, rows, temperature=0.0, seed=0, batch_size=64):
    """The model's answers to arith chat `rows` (rendered with its template): greedy at
    temperature 0, else sampled with the rows' own draws."""
    import datasets

    prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "arith")[0]["prompt"]
    stops = data.stop_token_ids(tok, model)
    u = sampling.rollout_uniforms(len(prompts), REAL_NEW_TOKENS, seed) if temperature else None
    texts = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            texts += data.respond(model, tok, prompts[i:i + batch_size], REAL_PROMPT_LEN, REAL_NEW_TOKENS, stops,
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
    if all(os.path.isfile(os.path.join(out, f"{s}.jsonl")) for s in ("train", "test")) and not pipeline.redo(cfg, "pairs"):
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
    if os.path.isfile(path) and not pipeline.redo(cfg, "eval"):
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
    grpo = [pipeline.read_rows(real_dir(cfg.runs, "grpo", f"seed{s}")) for s in range(cfg.real_seeds)]
    evals = [[r for r in rows if "eval/gold_reward" in r] for rows in grpo]
    before, after = [e[0]["eval/gold_reward"] for e in evals], [e[-1]["eval/gold_reward"] for e in evals]
    rm_run = [r for r in pipeline.read_rows(real_dir(cfg.runs, "grpo_rm")) if "eval/gold_reward" in r]
    ev = real_eval(cfg)
    rm, dpo = pipeline.last_eval(real_dir(cfg.runs, "rm")), pipeline.last_eval(real_dir(cfg.runs, "dpo"))
    t = lambda *parts: pipeline.seconds(times, [real_dir(cfg.runs, *parts)], cfg.runs)  # noqa: E731
    grpo_t = pipeline.seconds(times, [real_dir(cfg.runs, "grpo", f"seed{s}") for s in range(cfg.real_seeds)], cfg.runs)
    lines = ["| stage | held-out pairwise accuracy | greedy accuracy, before -> after | wall time (s) |",
             "|---|---|---|---|",
             f"| reward model (full fine-tune) | {pipeline.cell([rm.get('eval/accuracy')])} | | {t('rm')} |",
             f"| DPO (full fine-tune) | {pipeline.cell([dpo.get('eval/accuracy')])} | {before[0]:.3f} -> "
             f"{ev['dpo_accuracy']:.3f} | {t('dpo')} |",
             f"| GRPO, verifier reward (LoRA; seeds 0-{cfg.real_seeds - 1}) | | {pipeline.cell(before)} -> {pipeline.cell(after)} "
             f"(gain {pipeline.cell([a - b for a, b in zip(after, before)])}) | {grpo_t} |",
             f"| GRPO, learned reward (LoRA; seed 0) | | {rm_run[0]['eval/gold_reward']:.3f} -> "
             f"{rm_run[-1]['eval/gold_reward']:.3f} | {t('grpo_rm')} |"]
    curves = {"steps": [r["step"] for r in evals[0]],
              "grpo_by_seed": [[r["eval/gold_reward"] for r in e] for e in evals],
              "grpo_rm": [r["eval/gold_reward"] for r in rm_run], "rm_steps": [r["step"] for r in rm_run],
              "dpo_accuracy": ev["dpo_accuracy"]}
    shown = "\n".join(f"- {e['question']} (answer {e['answer']})\n  - before: {e['before']!r}\n  - after: "
                      f"{e['after']!r}" for e in ev["examples"])
    return "\n".join(lines), curves, shown


def real_study(cfg, flag, folder, prepare, stages, results, title):
    """A real-model study: the model's package checked, prepare(cfg, times) (data, a base model),
    the stages, then results(cfg, times) -> (table, curves or None, what to show after it),
    written to folder/results.{md,json}, plotted (plots/plot.py --figures) and printed."""
    try:
        run.gguf_file(REAL)  # the package and its reader are there, or the pip line to get them
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise SystemExit(f"{flag}: {e}") from None
    os.makedirs(folder, exist_ok=True)
    times_path = os.path.join(folder, "times.json")
    times = pipeline.load_times(times_path)
    t0 = time.time()
    prepare(cfg, times)
    pipeline.run_stages(stages(cfg), cfg, times, times_path)
    table, curves, shown = results(cfg, times)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(table + "\n\n" + shown + "\n")
    if curves is not None:
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump({**curves, "wall_time_s": times}, f, indent=1)
        if cfg.plots:
            subprocess.run([sys.executable, "plots/plot.py", "--figures", folder, "--out",
                            os.path.join(cfg.runs, "plots")], check=True)
    print(f"\n{title} ({time.time() - t0:.0f} s this invocation; runs in {folder}/):\n\n{table}\n\n{shown}")


def run_real(cfg):
    """--smollm2: the real-model pipeline, its table, plot and examples (RUNS/smollm2/)."""
    def results(cfg, times):
        table, curves, shown = real_results(cfg, times)
        return table, {"smollm2": curves}, f"Greedy answers before and after GRPO (seed 0):\n{shown}"
    real_study(cfg, "--smollm2", real_dir(cfg.runs), real_pairs, real_stages, results, "SmolLM2-135M-Instruct on arith")


# -----------------------------------------------------------------------------
# tool calls on the real model (--smollm2_tools): the calculator, a short SFT on demonstrations, GRPO


TOOL_DEMOS, TOOL_SHARE = 400, 0.5  # SFT demonstrations, and the share of them that call the calculator


TOOL_NEW_TOKENS, TOOL_PROMPT_LEN, TOOL_N_EVAL = 40, 128, 100  # call + result + answer: 25-35 tokens


TOOL_SFT_FLAGS = ["--max_prompt_len", str(TOOL_PROMPT_LEN), "--max_response_len", str(TOOL_NEW_TOKENS), "--steps", "32",
                  "--batch_size", "8", "--lr", "5e-4", "--warmup_steps", "2", "--eval_every", "100", "--n_eval", "8"]


TOOL_GRPO_FLAGS = ["--tools", "calculator", "--max_prompt_len", str(TOOL_PROMPT_LEN), "--max_new_tokens",
                   str(TOOL_NEW_TOKENS), *REAL_GRPO_FLAGS[:1], "--prompts_per_step", "6", "--group_size", "8",
                   "--temperature", "0.7", "--num_iterations", "1", "--num_mini_batches", "2", "--lr", "5e-4",
                   "--warmup_steps", "0"]


def tool_dir(runs, *parts):
    return real_dir(runs, "tools", *parts)


def tool_base(cfg, times):
    """The instruct model with the two tag pairs as tokens of their own (the sampler stops at the
    closing tag like at an end of turn), each new embedding the mean of its text's tokens' so that
    it starts near what the system prompt's text of it means (transformers' default draws them
    around the mean of all embeddings), and the demonstrations (tasks.calculator_rows), written once."""
    out = tool_dir(cfg.runs, "base")
    if os.path.isfile(os.path.join(out, "config.json")) and not pipeline.redo(cfg, "base"):
        return
    t0 = time.time()
    tok, model = load_policy(REAL)
    add_tool_tags(tok, model)
    shutil.rmtree(out + ".tmp", ignore_errors=True)  # written beside, then renamed: a kill leaves no half model
    model.save_pretrained(out + ".tmp")
    tok.save_pretrained(out + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(out + ".tmp", out)
    rows = tasks.calculator_rows(TOOL_DEMOS, seed=0, tool_share=TOOL_SHARE)
    path = tool_dir(cfg.runs, "demos.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)
    times[os.path.relpath(out, cfg.runs)] = round(time.time() - t0, 1)


def add_tool_tags(tok, model):
    """The four tags (tools.py) as tokens of their own, each embedding the mean of the embeddings of
    the tokens its text was (the head is tied to them in SmolLM2)."""
    import tools

    tags = [tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE]
    pieces = [tok.encode(t, add_special_tokens=False) for t in tags]
    tok.add_tokens(tags)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for tag, ids in zip(tags, pieces):
            emb[tok.convert_tokens_to_ids(tag)] = emb[ids].mean(0)


def tool_stages(cfg):
    """(group, argv) of each seed's SFT on the demonstrations and GRPO with the calculator from it."""
    r = lambda *parts: tool_dir(cfg.runs, *parts)  # noqa: E731
    out = []
    for s in range(cfg.real_seeds):
        out.append(("sft", ["sft.py", "--model", r("base"), "--dataset", r("demos.jsonl"), *TOOL_SFT_FLAGS,
                            "--seed", str(s), "--out_dir", r("sft", f"seed{s}")]))
        out.append(("grpo", ["grpo.py", "--model", r("sft", f"seed{s}", "checkpoint"), "--dataset", r("demos.jsonl"),
                             *TOOL_GRPO_FLAGS, "--steps", str(cfg.tool_steps), "--seed", str(s),
                             "--out_dir", r("grpo", f"seed{s}")]))
    return out


def tool_answers(folder, rows, with_tool):
    """Greedy answers of a model to calculator rows: their accuracy (the `math` rule), the share
    that call the tool (a result in the answer; without the tool, an opening tag written), and two
    answers as examples."""
    import datasets
    import tools

    tok, model = load_policy(folder)
    prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "calculator")[0]["prompt"]
    with torch.no_grad():
        texts = data.respond(model, tok, prompts, TOOL_PROMPT_LEN, TOOL_NEW_TOKENS, data.stop_token_ids(tok, model),
                             model.device, tool=tools.calculator if with_tool else None)
    mark = tools.RESULT_OPEN if with_tool else tools.CALL_OPEN
    return {"accuracy": sum(tasks.math_reward(None, t, r["answer"]) for t, r in zip(texts, rows)) / len(rows),
            "calls": sum(mark in t for t in texts) / len(rows), "examples": texts[:2]}


def tool_eval(cfg):
    """Every model's greedy answers to TOOL_N_EVAL held-out problems, with the calculator
    described and run, and alone (the question only, nothing run); cached in eval.json."""
    path = tool_dir(cfg.runs, "eval.json")
    found = {}
    if os.path.isfile(path) and not pipeline.redo(cfg, "eval"):
        with open(path) as f:
            found = json.load(f)
    models = {"instruct": tool_dir(cfg.runs, "base"), **{f"{k}/seed{s}": tool_dir(cfg.runs, k, f"seed{s}", "checkpoint")
                                   for k in ("sft", "grpo") for s in range(cfg.real_seeds)}}
    for name, folder in models.items():
        if name in found:
            continue
        found[name] = {}
        for with_tool in (True, False):
            rows = tasks.calculator_rows(TOOL_N_EVAL, seed=0, split="test", system=with_tool)
            found[name]["tool" if with_tool else "alone"] = tool_answers(folder, rows, with_tool)
        print(f"eval {name}: " + ", ".join(f"{k} {v['accuracy']:.2f} right, {v['calls']:.2f} calling"
                                            for k, v in found[name].items()), flush=True)
        with open(path + ".tmp", "w") as f:
            json.dump(found, f, indent=1)
        os.replace(path + ".tmp", path)
    return found


def tool_results(cfg, times):
    """The table (greedy accuracy and share calling, with the tool and alone, mean +- std over
    the seeds), GRPO's curves (sampled accuracy and calls per answer against steps) and examples."""
    ev = tool_eval(cfg)
    seeds = range(cfg.real_seeds)
    cell = lambda kind, mode, key: pipeline.cell([ev[f"{kind}/seed{s}"][mode][key] for s in seeds])  # noqa: E731
    lines = ["| model | with the calculator: right | calling | alone: right | wall time (s) |", "|---|---|---|---|---|",
             f"| SmolLM2-135M-Instruct (the tags added as tokens) | {ev['instruct']['tool']['accuracy']:.3f} | {ev['instruct']['tool']['calls']:.3f} | "
             f"{ev['instruct']['alone']['accuracy']:.3f} | |"]
    for kind, name in (("sft", f"+ SFT on {TOOL_DEMOS} demonstrations, {TOOL_SHARE:.0%} calling"),
                       ("grpo", f"+ GRPO with the calculator, {cfg.tool_steps} steps")):
        dirs = [tool_dir(cfg.runs, kind, f"seed{s}") for s in seeds]
        lines.append(f"| {name} | {cell(kind, 'tool', 'accuracy')} | {cell(kind, 'tool', 'calls')} | "
                     f"{cell(kind, 'alone', 'accuracy')} | {pipeline.seconds(times, dirs, cfg.runs)} |")
    rows = [[r for r in pipeline.read_rows(tool_dir(cfg.runs, "grpo", f"seed{s}")) if "reward" in r] for s in seeds]
    curves = {"steps": [r["step"] for r in rows[0]], "reward_by_seed": [[r["reward"] for r in rs] for rs in rows],
              "calls_by_seed": [[r["tools/call_frequency"] for r in rs] for rs in rows],
              "eval": {k: {m: {"accuracy": v["accuracy"], "calls": v["calls"]} for m, v in e.items()}
                       for k, e in ev.items()}}
    shown = "\n".join(f"- {name}: {ev[name]['tool']['examples'][0]!r}" for name in ("instruct", "sft/seed0", "grpo/seed0"))
    return "\n".join(lines), curves, shown


def run_tools(cfg):
    """--smollm2_tools: SmolLM2 with a calculator (RUNS/smollm2/tools/): its table, plot, examples."""
    def results(cfg, times):
        table, curves, shown = tool_results(cfg, times)
        return table, {"smollm2_tools": curves}, f"Greedy answers with the calculator (seed 0):\n{shown}"
    real_study(cfg, "--smollm2_tools", tool_dir(cfg.runs), tool_base, tool_stages, results,
               "SmolLM2-135M-Instruct with a calculator")


# -----------------------------------------------------------------------------
# on-policy distillation on the real model (--smollm2_distill)


def real_distill_stages(cfg):
    """(group, argv): the teacher, GRPO seed 0 with the verifier (the --smollm2 pipeline's run,
    reused where it exists), then the instruct model distilled from it (--teacher, the task
    reward off), --real_seeds seeds."""
    r = lambda *parts: real_dir(cfg.runs, *parts)  # noqa: E731
    grpo = ["grpo.py", "--model", REAL, "--dataset", "arith", *REAL_LEN, *REAL_GRPO_FLAGS]
    out = [("grpo", [*grpo, "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1)),
                     "--seed", "0", "--out_dir", r("grpo", "seed0")])]
    out += [("distill", [*grpo, "--teacher", r("grpo", "seed0", "checkpoint"), "--reward_weights", "rule:0",
                         "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1)),
                         "--seed", str(s), "--out_dir", r("distill", f"seed{s}")]) for s in range(cfg.real_seeds)]
    return out


def real_distill_results(cfg, times):
    """The table of greedy accuracy before and after distillation (mean +- std over the seeds)
    beside the teacher's, the reverse KL to the teacher, and the seconds per step of each."""
    step_time = lambda rows: statistics.mean(r["time/step"] for r in rows if r["step"] > 1 and "time/step" in r)  # noqa: E731
    teacher = pipeline.read_rows(real_dir(cfg.runs, "grpo", "seed0"))
    runs = [pipeline.read_rows(real_dir(cfg.runs, "distill", f"seed{s}")) for s in range(cfg.real_seeds)]
    evals = [[r for r in rows if "eval/gold_reward" in r] for rows in runs]
    t_evals = [r for r in teacher if "eval/gold_reward" in r]
    kl = [[r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r] for rows in runs]
    lines = ["| | greedy accuracy, 100 held-out arith prompts: before -> after | reverse KL to the teacher per "
             "answer, first -> last step | seconds per step |", "|---|---|---|---|",
             f"| the teacher: GRPO with the verifier, seed 0, {t_evals[-1]['step']} steps | "
             f"{t_evals[0]['eval/gold_reward']:.3f} -> {t_evals[-1]['eval/gold_reward']:.3f} | | {step_time(teacher):.1f} |",
             f"| the instruct model distilled from it (`--teacher`, task reward off; seeds 0-{cfg.real_seeds - 1}, "
             f"{cfg.real_steps} steps) | {pipeline.cell([e[0]['eval/gold_reward'] for e in evals])} -> "
             f"{pipeline.cell([e[-1]['eval/gold_reward'] for e in evals])} | {pipeline.cell([k[0] for k in kl])} -> "
             f"{pipeline.cell([k[-1] for k in kl])} | {pipeline.cell([step_time(rows) for rows in runs], 1)} |"]
    return "\n".join(lines), None, ""


def run_real_distill(cfg):
    """--smollm2_distill: SmolLM2 distilled from its GRPO model (RUNS/smollm2/distill/): the table."""
    real_study(cfg, "--smollm2_distill", real_dir(cfg.runs, "distill"), lambda cfg, times: None, real_distill_stages,
               real_distill_results, "SmolLM2-135M-Instruct distilled from its GRPO model")
