"""Plots of the metrics.jsonl that every run writes (sft.py, reward.py, dpo.py, grpo.py).

    python plots/plot.py RUN_DIR [RUN_DIR ...] --out DIR          # one figure per run
    python plots/plot.py --kl_compare RUN_DIR ... --out DIR       # KL estimators side by side

A run's kind (sft, rm, dpo, grpo) is read from the metric keys it logged, or from its
run_config.json; each figure is a grid of panels, and panels whose metrics are absent are
left out. Train metrics are drawn as thin lines (plus a moving average with --smooth N),
eval metrics as markers, and eval/bayes_accuracy as a dashed ceiling: the best accuracy any
model can reach against the noisy annotator's labels.
"""
import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DPI = 120
PANEL_SIZE = (5.2, 3.6)  # inches per panel

# -----------------------------------------------------------------------------
# reading


def read_metrics(path):
    """The rows of a metrics.jsonl (a file, or a run dir holding one), as a list of dicts."""
    if not str(path).endswith(".jsonl"):  # a run dir
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file: {path}")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {i}: not JSON ({e.msg}): {line.strip()[:80]!r}") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{path}, line {i}: expected a JSON object with a 'step' key")
            rows.append(row)
    return rows


def series(rows, key):
    """(steps, values) of the rows that hold key, skipping null and non-finite values."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def read_config(run_dir):
    path = os.path.join(run_dir, "run_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def detect_kind(rows, config=None):
    keys = set().union(*rows) if rows else set()
    config = config or {}
    if keys & {"kl", "clip_ratio/low", "reward_std"} or "kl_estimator" in config:
        return "grpo"
    if keys & {"rewards/accuracies", "rewards/margins", "logps/chosen"}:
        return "dpo"
    if keys & {"rewards/chosen", "accuracy", "margin"}:
        return "rm"
    if keys & {"loss", "eval/loss", "eval/exact_match"}:
        return "sft"
    raise ValueError(f"cannot tell the kind of run from its metric keys: {sorted(keys)}")


# -----------------------------------------------------------------------------
# panels: (title, y label, [(key, legend label), ...], ceiling key or None)

ACC_EVAL = ("eval/accuracy", "eval (held-out pairs)")
ACC_EVAL_GRPO = ("eval/pref_accuracy", "eval (held-out pairs)")  # grpo.py's name for it
GENERATIONS = ("Eval generations (greedy)", "score in [0, 1]",
               [("eval/gold_reward", "gold reward"), ("eval/exact_match", "exact match")], None)

PANELS = {
    "sft": [
        ("Loss", "cross-entropy (nats / response token)", [("loss", "train"), ("eval/loss", "eval")], None),
        GENERATIONS,
        ("Gradient norm", "||grad|| before clipping", [("grad_norm", "grad norm")], None),
        ("Learning rate", "lr", [("lr", "lr")], None),
    ],
    "rm": [
        ("Reward-model scores", "mean score r(x, y)",
         [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")], None),
        ("Preference accuracy", "P(r(chosen) > r(rejected))", [("accuracy", "train batch"), ACC_EVAL],
         "eval/bayes_accuracy"),
        ("Loss", "-log sigmoid(r_c - r_r)", [("loss", "train")], None),
    ],
    "dpo": [
        ("Implicit rewards", "beta * log(pi / pi_ref)",
         [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")], None),
        ("Preference accuracy", "share of pairs ranked right", [("rewards/accuracies", "train batch"), ACC_EVAL],
         "eval/bayes_accuracy"),
        GENERATIONS,
        ("Loss", "DPO loss", [("loss", "train")], None),
    ],
    "grpo": [
        ("Reward", "mean reward of sampled completions", [("reward", "train samples")], None),
        ("KL to the reference", "KL(pi || pi_ref) per token",
         [("kl", "k3 estimate (monitor)"), ("kl/optimized", "{kl_estimator} (the loss's estimator)")], None),
        ("Clipped tokens", "fraction of tokens clipped",
         [("clip_ratio/low", "low (rho < 1 - eps, A < 0)"), ("clip_ratio/high", "high (rho > 1 + eps, A > 0)")], None),
        ("Eval preference accuracy (implicit reward)", "share of pairs ranked right",
         [ACC_EVAL, ACC_EVAL_GRPO], "eval/bayes_accuracy"),
        GENERATIONS,
        ("Completion length", "mean tokens per completion", [("completions/mean_length", "mean length")], None),
        ("Entropy", "mean token entropy (nats)", [("entropy", "entropy")], None),
    ],
}


def moving_average(values, n):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def draw_panel(ax, rows, title, ylabel, keys, ceiling, smooth=0):
    """Draw one panel; False (and nothing drawn) when none of its keys has data."""
    drawn = 0
    for key, label in keys:
        steps, values = series(rows, key)
        if not steps:
            continue
        color = f"C{drawn}"
        if key.startswith("eval/") or len(steps) <= 12:  # sparse: markers show where the points are
            ax.plot(steps, values, "o-", color=color, ms=4, lw=1.2, label=label, zorder=3)
        elif smooth > 1 and len(steps) > smooth and key != "lr":  # lr is a schedule: nothing to smooth
            ax.plot(steps, values, color=color, lw=0.8, alpha=0.35)
            ax.plot(steps, moving_average(values, smooth), color=color, lw=1.6, label=f"{label} (avg {smooth})")
        else:
            ax.plot(steps, values, color=color, lw=1.2, label=label)
        drawn += 1
    if not drawn:
        return False
    if ceiling:
        _, best = series(rows, ceiling)
        if best:
            ax.axhline(best[-1], color="k", ls="--", lw=1, label=f"Bayes ceiling ({best[-1]:.3f})")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))  # lr-sized values as 1e-3 x ..., not 0.0010
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return True


def plot_panels(rows, panels, title, path, smooth=0):
    """A grid of the panels that have data, saved to path."""
    full = [p for p in panels if any(series(rows, k)[0] for k, _ in p[2])]
    if not full:
        raise ValueError(f"{title}: none of the plotted metrics is in the file")
    ncols = len(full) if len(full) <= 3 else 2 if len(full) == 4 else 3
    nrows = math.ceil(len(full) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_SIZE[0] * ncols, PANEL_SIZE[1] * nrows + 0.4),
                             squeeze=False)
    flat = axes.ravel()
    for ax, panel in zip(flat, full):
        draw_panel(ax, rows, *panel, smooth=smooth)
    for ax in flat[len(full):]:
        ax.remove()
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def run_name(run_dir):
    return os.path.basename(os.path.normpath(os.path.abspath(run_dir)))


def plot_run(run_dir, out_dir, smooth=0, kind=None):
    """The figure(s) of one run dir; returns the paths written."""
    rows, config = read_metrics(run_dir), read_config(run_dir)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not rows:
        raise ValueError(f"{metrics_path} holds no rows")
    kind = kind or detect_kind(rows, config)
    name = run_name(run_dir)
    title = f"{name} ({kind.upper()})"
    if kind == "grpo" and config:
        title += f": kl_estimator={config.get('kl_estimator', '?')}, beta={config.get('beta', '?')}"
    elif kind == "dpo" and "beta" in config:
        title += f": beta={config['beta']}"
    panels = [(t, y, [(k, label.format(kl_estimator=config.get("kl_estimator", "estimator"))) for k, label in keys], c)
              for t, y, keys, c in PANELS[kind]]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_{kind}.png")
    try:
        return [plot_panels(rows, panels, title, path, smooth)]
    except ValueError as e:
        raise ValueError(f"{metrics_path}: {e}") from None


def plot_kl_compare(run_dirs, out_dir, smooth=0):
    """Measured KL (the k3 monitor, logged as 'kl') of several GRPO runs, one line per run."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    configs = [read_config(d) for d in run_dirs]
    for i, (run_dir, config) in enumerate(zip(run_dirs, configs)):
        steps, values = series(read_metrics(run_dir), "kl")
        if not steps:
            raise ValueError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no 'kl' rows (not a GRPO run?)")
        nonzero = {c.get("beta") for c in configs if c.get("beta") != 0}
        if config.get("beta") == 0:  # the baseline: no KL term at all
            label = "none (beta=0)"
        else:
            label = config.get("kl_estimator", run_name(run_dir))
            if "beta" in config and len(nonzero) > 1:
                label += f" (beta={config['beta']})"
        if smooth > 1 and len(steps) > smooth:
            ax.plot(steps, values, color=f"C{i}", lw=0.8, alpha=0.3)
            ax.plot(steps, moving_average(values, smooth), color=f"C{i}", lw=1.8, label=f"{label} (avg {smooth})")
        else:
            ax.plot(steps, values, color=f"C{i}", lw=1.5, marker="o" if len(steps) <= 12 else None, ms=4,
                    label=label)
    betas = {c.get("beta") for c in configs if c.get("beta") != 0}
    title = "Measured KL by KL estimator in the loss"
    if len(betas) == 1 and None not in betas:
        title += f" (beta={betas.pop()})"
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("KL(pi || pi_ref), k3 estimate per token")
    ax.grid(True, alpha=0.3)
    ax.legend(title="kl_estimator")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "kl_estimators.png")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


SUMMARY_STAGES = [("sft", "SFT"), ("rm", "reward\nmodel"), ("dpo", "DPO"), ("grpo_rm", "GRPO\nlearned RM"),
                  ("grpo_gold", "GRPO\ngold reward")]


def plot_summary(results_path, out_dir):
    """The pipeline's results (pipeline.py's results.json) as two bar charts: held-out pairwise
    accuracy against the Bayes ceiling, and greedy exact-match and gold reward per stage."""
    with open(results_path) as f:
        evals = json.load(f)["eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [(k, label) for k, label in SUMMARY_STAGES if k in evals]
    acc = [(label, evals[k].get("eval/accuracy", evals[k].get("eval/pref_accuracy"))) for k, label in names]
    acc = [(label, v) for label, v in acc if v is not None]
    ax1.bar([label for label, _ in acc], [v for _, v in acc], color="tab:blue")
    bayes = [evals[k]["eval/bayes_accuracy"] for k, _ in names if "eval/bayes_accuracy" in evals[k]]
    if bayes:
        ax1.axhline(bayes[0], color="black", linestyle="--", label=f"Bayes ceiling {bayes[0]:.3f}")
        ax1.legend(loc="lower right")
    ax1.axhline(0.5, color="grey", linewidth=0.8)
    for i, (_, v) in enumerate(acc):
        ax1.text(i, v + 0.01, f"{v:.3f}", ha="center")
    ax1.set_ylim(0.4, 1.0)
    ax1.set_ylabel("accuracy on held-out preference pairs")
    ax1.set_title("Which completion is preferred? (RM score; DPO/GRPO: beta log pi/pi_ref)")
    gen = [(label, evals[k]) for k, label in names if "eval/exact_match" in evals[k]]
    xs = range(len(gen))
    for off, key, label in ((-0.2, "eval/exact_match", "greedy exact-match"), (0.2, "eval/gold_reward", "gold reward")):
        vals = [e[key] for _, e in gen]
        ax2.bar([x + off for x in xs], vals, width=0.4, label=label)
        for x, v in zip(xs, vals):
            ax2.text(x + off, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    ax2.set_xticks(list(xs), [label for label, _ in gen])
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("on held-out prompts (SFT, DPO: 200; GRPO: 500)")
    ax2.set_title("Greedy answers: exact-match and gold reward")
    ax2.legend(loc="upper left")
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.png")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="*", help="run out_dirs, each holding metrics.jsonl (and run_config.json)")
    p.add_argument("--summary", help="also draw pipeline.py's results.json as summary.png")
    p.add_argument("--out", default="plots/out", help="folder for the PNGs")
    p.add_argument("--kl_compare", action="store_true", help="one KL-estimator comparison figure of all runs")
    p.add_argument("--kind", choices=sorted(PANELS), help="override the detected kind of run")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window over train metrics (0: off)")
    args = p.parse_args(argv)
    try:
        if args.kl_compare:
            paths = [plot_kl_compare(args.run_dirs, args.out, args.smooth)]
        else:
            paths = [path for d in args.run_dirs for path in plot_run(d, args.out, args.smooth, args.kind)]
        if args.summary:
            paths.append(plot_summary(args.summary, args.out))
    except (OSError, ValueError) as e:  # a missing or broken metrics file: one clear line, no traceback
        p.exit(1, f"plot.py: error: {e}\n")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
