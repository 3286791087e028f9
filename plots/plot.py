"""Plots of the metrics.jsonl that every run writes (sft.py, reward.py, dpo.py, grpo.py).

    python plots/plot.py RUN_DIR [RUN_DIR ...]             # a figure per kind of run, the runs overlaid
    python plots/plot.py --kl_compare RUN_DIR ...          # KL estimators side by side
    python plots/plot.py                                   # the README's figures from runs/results.json

Every figure goes to --out (default runs/plots/, beside the runs and ignored by git: no command
rewrites a committed file unless told to with --out). A figure of runs is named after them: the
shortest end of each run's path that tells it from the others (its label in the legends,
`a/run+b/run` as `a-run+b-run`), the kind, and 8 hex digits of the runs' absolute paths, so that
runs whose folders share a name never write the same file, and plotting the same runs again
redraws theirs.

The README's figures (plots/*.png, copies of what this draws) come from pipeline.py's
runs/results.json (the summary; with --kl_compare and --overopt, the KL estimators and
over-optimisation curves over the seeds; from runs/variants.json, with --variants, the variants
side by side). The benchmarks draw their own (`python -m bench steps --sweep`, docs/bench/).

A run's kind (sft, rm, dpo, grpo) is read from the metric keys it logged, or from its
run_config.json; each figure is a grid of panels, and panels whose metrics are absent are
left out. Train metrics are drawn as thin lines (plus a moving average with --smooth N),
eval metrics as markers, and eval/bayes_accuracy as a dashed ceiling: the best accuracy any
model can reach against the noisy annotator's labels. With several runs, each run has a colour
and line style of its own (tab10's ten colours, then the next dash pattern: 80 runs apart), each
panel shows one metric, and one legend of the runs stands beside the panels, outside them.
"""
import argparse
import hashlib
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DPI = 120
PANEL_SIZE = (5.2, 3.6)  # inches per panel
OUT = os.path.join("runs", "plots")  # the default --out: ignored by git, beside the runs
# several runs: run i has colour C(i mod 10) and the (i // 10)-th dash pattern, so 80 runs are told apart
RUN_DASHES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2, 1, 2)), (0, (1, 1)))
LEGEND_ROW = 0.2  # inches a row of the runs' legend takes (font size 8)


def run_style(i):
    """The (colour, line style) of the i-th of several runs: tab10's ten colours, each next ten runs
    with the next of RUN_DASHES; pairs repeat only past 80 runs (plot_runs says so)."""
    return f"C{i % 10}", RUN_DASHES[(i // 10) % len(RUN_DASHES)]

# -----------------------------------------------------------------------------
# reading


def read_metrics(path):
    """The rows of a metrics.jsonl (a file, or a run dir holding one), as a list of dicts. A last
    line that is not JSON is a row torn by a kill (or being written by a running run): skipped,
    with a note; such a line anywhere else is an error naming it."""
    if not str(path).endswith(".jsonl"):  # a run dir
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file: {path}")
    rows = []
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    for i, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == lines[-1][0]:
                print(f"note: {path}, line {i}: not a complete row (a run stopped while writing it?); skipped",
                      file=sys.stderr)
                break
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
        ("Implicit reward margin", "beta log(pi/pi_ref), chosen - rejected", [("rewards/margins", "margin")], None),
        ("Policy log-probs", "log pi(y | x), summed over the response",
         [("logps/chosen", "chosen"), ("logps/rejected", "rejected")], None),
        ("Loss", "DPO loss", [("loss", "train")], None),
    ],
    "grpo": [
        ("Reward", "mean reward of sampled completions",
         [("reward", "train samples"), ("eval/reward", "eval (held-out, sampled)"),
          ("eval/greedy/reward", "eval (held-out, greedy)")], None),
        ("Each reward", "mean of the function's rewards (None left out)", "rewards/*/mean", None),
        ("KL to the reference", "KL(pi || pi_ref) per token",
         [("kl", "k3 estimate (monitor)"), ("kl/optimized", "{kl_estimator} (the loss's estimator)")], None),
        ("Clipped tokens", "fraction of tokens clipped",
         [("clip_ratio/low", "low (rho < 1 - eps, A < 0)"), ("clip_ratio/high", "high (rho > 1 + eps, A > 0)")], None),
        ("Eval preference accuracy (implicit reward)", "share of pairs ranked right",
         [ACC_EVAL, ACC_EVAL_GRPO], "eval/bayes_accuracy"),
        GENERATIONS,
        ("Completion length", "mean tokens per completion", [("completions/mean_length", "mean length")], None),
        ("Entropy", "mean token entropy (nats)", [("entropy", "entropy")], None),
        ("Reward spread within groups", "std of a group's rewards (mean)", [("reward_std", "reward_std")], None),
        ("Groups without signal", "share of groups of equal rewards",
         [("frac_reward_zero_std", "frac_reward_zero_std")], None),
        ("Loss", "GRPO loss (mean over the step's updates)", [("loss", "train")], None),
        ("Gradient norm", "||grad|| before clipping (step's mean)", [("grad_norm", "grad norm")], None),
        ("Learning rate", "lr (the step's last update)", [("lr", "lr")], None),
    ],
}


def expand_panels(panels, rows):
    """The panels with a pattern in place of their keys ("rewards/*/mean": one line per reward
    function a run logged, TRL's names) given the keys the rows hold, in the order first seen."""
    out = []
    for title, ylabel, keys, ceiling in panels:
        if isinstance(keys, str):
            head, _, tail = keys.partition("*")
            found = dict.fromkeys(k for row in rows for k in row if k.startswith(head) and k.endswith(tail))
            keys = [(k, k[len(head):len(k) - len(tail)]) for k in found]
        out.append((title, ylabel, keys, ceiling))
    return out


def moving_average(values, n):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def split_panels(panels):
    """For several runs: each panel of several metrics as one panel per metric ("Loss: train",
    "Loss: eval"), so that a line's colour and style name its run alone."""
    out = []
    for title, ylabel, keys, ceiling in panels:
        for key, label in keys:
            out.append((f"{title}: {label}" if len(keys) > 1 else title, ylabel, [(key, label)], ceiling))
    return out


def draw_panel(ax, runs, title, ylabel, keys, ceiling, smooth=0):
    """Draw one panel of runs [(label, rows, config), ...]; False (and nothing drawn) when none of
    its keys has data. One run: a colour per metric, and a legend of them; several: each run its
    run_style, one metric a panel (split_panels), no legend (plot_panels draws the runs' one)."""
    drawn, several = 0, len(runs) > 1
    ceilings = set()
    for r, (run_label, rows, config) in enumerate(runs):
        for j, (key, label) in enumerate(keys):
            steps, values = series(rows, key)
            if not steps:
                continue
            label = label.format(kl_estimator=config.get("kl_estimator", "estimator"))
            color, ls = run_style(r) if several else (f"C{drawn}", "-")
            label = run_label if several else label
            if key.startswith("eval/") or len(steps) <= 12:  # sparse: markers show where the points are
                ax.plot(steps, values, marker="o", ls=ls, color=color, ms=4, lw=1.2, label=label, zorder=3)
            elif smooth > 1 and len(steps) > smooth and key != "lr":  # lr is a schedule: nothing to smooth
                ax.plot(steps, values, color=color, ls=ls, lw=0.8, alpha=0.35)
                ax.plot(steps, moving_average(values, smooth), color=color, ls=ls, lw=1.6,
                        label=f"{label} (avg {smooth})")
            else:
                ax.plot(steps, values, color=color, ls=ls, lw=1.2, label=label)
            drawn += 1
        _, best = series(rows, ceiling) if ceiling else ([], [])
        if best and best[-1] not in ceilings:  # the same data's ceiling once
            ceilings.add(best[-1])
            ax.axhline(best[-1], color="k", ls="--", lw=1, label=f"Bayes ceiling ({best[-1]:.3f})")
    if not drawn:
        return False
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))  # lr-sized values as 1e-3 x ..., not 0.0010
    ax.grid(True, alpha=0.3)
    if not several:
        ax.legend(fontsize=8)
    elif ceilings:  # the ceilings' values, where the runs' legend cannot say them
        ax.set_title(f"{title}\n(dashed: Bayes ceiling {', '.join(f'{c:.3f}' for c in sorted(ceilings))})", fontsize=10)
    return True


def plot_panels(runs, panels, title, path, smooth=0):
    """A grid of the panels that have data in any of runs [(label, rows, config), ...], saved to path."""
    fig = figure_panels(runs, panels, title, smooth)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # "tight": the runs' legend, right of the panels, included
    plt.close(fig)
    return path


def figure_panels(runs, panels, title, smooth=0):
    """The figure of plot_panels, not saved: a grid of the panels that have data in any of runs; with
    several runs one metric a panel and the runs' legend to the right of the grid, in as many
    columns as its rows need to fit the figure's height."""
    if len(runs) > 1:
        estimators = {config.get("kl_estimator", "estimator") for _, _, config in runs}
        shown = estimators.pop() if len(estimators) == 1 else "each run's estimator"
        panels = [(t.replace("{kl_estimator}", shown), *rest) for t, *rest in split_panels(panels)]
    full = [p for p in panels if any(series(rows, k)[0] for _, rows, _ in runs for k, _ in p[2])]
    if not full:
        raise ValueError(f"{title}: none of the plotted metrics is in the file")
    ncols = len(full) if len(full) <= 3 else 2 if len(full) == 4 else 3
    nrows = math.ceil(len(full) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_SIZE[0] * ncols, PANEL_SIZE[1] * nrows + 0.4),
                             squeeze=False)
    flat = axes.ravel()
    for ax, panel in zip(flat, full):
        draw_panel(ax, runs, *panel, smooth=smooth)
    for ax in flat[len(full):]:
        ax.remove()
    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # the title above the panels' titles
    if len(runs) > 1:  # after the layout, beside it: the legend never covers a panel
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=c, ls=ls, lw=1.5) for c, ls in map(run_style, range(len(runs)))]
        rows_fit = max(4, int((fig.get_figheight() - 0.6) / LEGEND_ROW))
        fig.legend(handles, [label for label, _, _ in runs], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                   ncol=math.ceil(len(runs) / rows_fit), fontsize=8, title=f"{len(runs)} runs", frameon=False)
    return fig


def save(fig, out_dir, name, tight=False):
    """Write fig to out_dir/name (laid out, at DPI; tight: grown to hold a legend outside the axes) and
    close it; returns the path."""
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=DPI, bbox_inches="tight" if tight else None)
    plt.close(fig)
    return path


def run_labels(run_dirs):
    """Each run's label: the shortest end of its absolute path that no other run's path ends with
    (`x/a/run`, `y/a/run`, `z/b` -> `x/a/run`, `y/a/run`, `b`). A run given twice is an error."""
    paths = [tuple(os.path.normpath(os.path.abspath(d)).split(os.sep)) for d in run_dirs]
    for d, p in zip(run_dirs, paths):
        if paths.count(p) > 1:
            raise ValueError(f"{d}: the same run given twice ({run_dirs[paths.index(p)]})")
    labels = []
    for i, p in enumerate(paths):
        k = 1
        while k < len(p) and any(q[-k:] == p[-k:] for j, q in enumerate(paths) if j != i):
            k += 1
        labels.append("/".join(p[-k:]) or os.sep)
    return labels


def figure_name(run_dirs, labels, kind):
    """`<labels>_<kind>_<8 hex digits of the runs' absolute paths>.png`: two sets of runs never
    share a name, however their folders are named, and the same runs keep theirs."""
    digest = hashlib.sha256("\n".join(os.path.normpath(os.path.abspath(d)) for d in run_dirs).encode()).hexdigest()
    stem = "+".join(label.strip(os.sep).replace(os.sep, "-") for label in labels)
    return f"{stem[:80]}_{kind}_{digest[:8]}.png"


def run_name(run_dir):
    return os.path.basename(os.path.normpath(os.path.abspath(run_dir)))


def plot_runs(run_dirs, out_dir, smooth=0, kind=None):
    """A figure per kind of run (sft, rm, dpo, grpo) among run_dirs, overlaying the runs of that
    kind, each labelled by its shortest distinguishing path (run_labels); returns the paths written."""
    labels, by_kind = run_labels(run_dirs), {}
    for run_dir, label in zip(run_dirs, labels):
        rows, config = read_metrics(run_dir), read_config(run_dir)
        if not rows:
            raise ValueError(f"{os.path.join(run_dir, 'metrics.jsonl')} holds no rows")
        by_kind.setdefault(kind or detect_kind(rows, config), []).append((run_dir, label, rows, config))
    paths = []
    for k, runs in by_kind.items():
        if len(runs) == 1:
            (run_dir, _, rows, config), label = runs[0], run_name(runs[0][0])
            title = f"{label} ({k.upper()})"
            if k == "grpo" and config:
                title += f": kl_estimator={config.get('kl_estimator', '?')}, beta={config.get('beta', '?')}"
            elif k == "dpo" and "beta" in config:
                title += f": beta={config['beta']}"
        else:
            names = ", ".join(label for _, label, _, _ in runs)
            title = f"{k.upper()}: {names}" if len(names) <= 100 else f"{k.upper()}: {len(runs)} runs"
            if len(runs) > 10 * len(RUN_DASHES):
                print(f"note: {len(runs)} {k} runs in one figure: past {10 * len(RUN_DASHES)} their colour and line "
                      f"style repeat; plot them in groups", file=sys.stderr)
        path = os.path.join(out_dir, figure_name([r[0] for r in runs], [r[1] for r in runs], k))
        try:
            paths.append(plot_panels([(label, rows, config) for _, label, rows, config in runs],
                                     expand_panels(PANELS[k], [row for r in runs for row in r[2]]), title, path, smooth))
        except ValueError as e:
            raise ValueError(f"{', '.join(os.path.join(r[0], 'metrics.jsonl') for r in runs)}: {e}") from None
    return paths


def plot_run(run_dir, out_dir, smooth=0, kind=None):
    """The figure of one run dir; returns the paths written."""
    return plot_runs([run_dir], out_dir, smooth, kind)


def plot_kl_compare(run_dirs, out_dir, smooth=0):
    """Measured KL (the k3 monitor, logged as 'kl') of several GRPO runs, one line per run, named
    by its estimator, and by its folder (run_labels) where estimators repeat."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    configs, folders = [read_config(d) for d in run_dirs], run_labels(run_dirs)
    nonzero = {c.get("beta") for c in configs if c.get("beta") != 0}
    labels = []
    for config, folder in zip(configs, folders):
        if config.get("beta") == 0:  # the baseline: no KL term at all
            label = "none (beta=0)"
        else:
            label = config.get("kl_estimator", folder)
            if "beta" in config and len(nonzero) > 1:
                label += f" (beta={config['beta']})"
        labels.append(label)
    labels = [f"{label}: {folder}" if labels.count(label) > 1 else label for label, folder in zip(labels, folders)]
    for i, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        steps, values = series(read_metrics(run_dir), "kl")
        if not steps:
            raise ValueError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no 'kl' rows (not a GRPO run, or one at "
                             f"--beta 0 without --reference?)")
        color, ls = run_style(i)
        if smooth > 1 and len(steps) > smooth:
            ax.plot(steps, values, color=color, ls=ls, lw=0.8, alpha=0.3)
            ax.plot(steps, moving_average(values, smooth), color=color, ls=ls, lw=1.8, label=f"{label} (avg {smooth})")
        else:
            ax.plot(steps, values, color=color, ls=ls, lw=1.5, marker="o" if len(steps) <= 12 else None, ms=4,
                    label=label)
    title = "Measured KL by KL estimator in the loss"
    if len(nonzero) == 1 and None not in nonzero:
        title += f" (beta={next(iter(nonzero))})"
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("KL(pi || pi_ref), k3 estimate per token")
    ax.grid(True, alpha=0.3)
    many = len(run_dirs) > 10  # beside the axes, not over the curves
    ax.legend(title="kl_estimator", **(dict(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8) if many else {}))
    return save(fig, out_dir, figure_name(run_dirs, folders, "kl_estimators"), tight=many)


SUMMARY_STAGES = [("sft", "SFT"), ("rm", "reward\nmodel"), ("dpo", "DPO"), ("grpo_rm", "GRPO\nlearned RM"),
                  ("grpo_gold", "GRPO\ngold reward")]


def _by_seed(results, stage, *keys):
    """Every seed's value of the first of keys that a stage's evaluation holds (results.json of
    pipeline.py; a file without eval_by_seed counts as one seed)."""
    evals = results.get("eval_by_seed", {}).get(stage) or [results["eval"][stage]]
    for key in keys:
        vals = [e[key] for e in evals if e.get(key) is not None]
        if vals:
            return vals
    return []


def _mean_std(vals):
    mean = sum(vals) / len(vals)
    return mean, (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0


def plot_summary(results_path, out_dir):
    """The pipeline's results (pipeline.py's results.json) as two bar charts: held-out pairwise
    accuracy against the Bayes ceiling, and greedy exact-match and gold reward per stage; with
    several seeds, bars are means, whiskers one std, dots the seeds."""
    with open(results_path) as f:
        results = json.load(f)
    evals = results["eval"]
    n_seeds = results.get("seeds", 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [(k, label) for k, label in SUMMARY_STAGES if k in evals]

    def bars(ax, x, vals, **kw):
        mean, std = _mean_std(vals)
        ax.bar(x, mean, yerr=std if len(vals) > 1 else None, capsize=4, **kw)
        if len(vals) > 1:
            ax.plot([x] * len(vals), vals, "k.", ms=4, zorder=3)
        return mean, std

    acc = [(label, _by_seed(results, k, "eval/accuracy", "eval/pref_accuracy")) for k, label in names]
    acc = [(label, v) for label, v in acc if v]
    for i, (_, vals) in enumerate(acc):
        mean, std = bars(ax1, i, vals, color="tab:blue")
        ax1.text(i, mean + std + 0.01, f"{mean:.3f}", ha="center")
    ax1.set_xticks(range(len(acc)), [label for label, _ in acc])
    bayes = [v for k, _ in names for v in _by_seed(results, k, "eval/bayes_accuracy")]
    if bayes:
        b = sum(bayes) / len(bayes)
        ax1.axhline(b, color="black", linestyle="--", label=f"Bayes ceiling {b:.3f}" + (" (mean)" if n_seeds > 1 else ""))
        ax1.legend(loc="lower right")
    ax1.axhline(0.5, color="grey", linewidth=0.8)
    ax1.set_ylim(0.4, 1.0)
    ax1.set_ylabel("accuracy on held-out preference pairs")
    ax1.set_title("Held-out pairs ranked right (RM score; DPO, GRPO: beta log pi/pi_ref)", fontsize=10)
    gen = [(k, label) for k, label in names if _by_seed(results, k, "eval/exact_match")]
    for off, key, label in ((-0.2, "eval/exact_match", "greedy exact-match"), (0.2, "eval/gold_reward", "gold reward")):
        for x, (k, _) in enumerate(gen):
            mean, std = bars(ax2, x + off, _by_seed(results, k, key), width=0.4, color=f"C{0 if off < 0 else 1}",
                             label=label if x == 0 else None)
            ax2.text(x + off, mean + std + 0.01, f"{mean:.2f}", ha="center", fontsize=8)
    ax2.set_xticks(range(len(gen)), [label for _, label in gen])
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("on held-out prompts (SFT, DPO: 200; GRPO: 500)")
    ax2.set_title("Greedy answers: exact-match and gold reward")
    ax2.legend(loc="upper left")
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    if n_seeds > 1:
        fig.suptitle(f"Mean over {n_seeds} seeds (whiskers: one std; dots: the seeds)")
    return save(fig, out_dir, "summary.png")


def _band(ax, xs, by_seed, color, label, lw=1.8):
    """The mean over the seeds as a line and their min-max as a band."""
    cols = list(zip(*by_seed))
    mean = [sum(c) / len(c) for c in cols]
    ax.plot(xs, mean, color=color, lw=lw, label=label)
    if len(by_seed) > 1:
        ax.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=color, alpha=0.18, lw=0)


def plot_kl_bands(results, out_dir):
    """The KL-estimator comparison of pipeline.py --kl_compare: measured KL over the steps (mean
    over the seeds, band min-max) and the greedy answers at the end."""
    kl = results["kl"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.6, 1]})
    n = len(next(iter(kl.values()))["kl_by_seed"])
    for i, (est, c) in enumerate(kl.items()):
        label = "none (beta=0)" if c["beta"] == 0 else f"{est} (beta={c['beta']})"
        _band(ax1, c["steps"], c["kl_by_seed"], f"C{i}", label)
    ax1.set_title(f"Measured KL by the KL term in the loss ({n} seeds: mean, band min-max)", fontsize=10)
    ax1.set_xlabel("step")
    ax1.set_ylabel("KL(pi || pi_ref), k3 estimate per token")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    for j, (key, label) in enumerate((("eval/gold_reward", "gold reward"), ("eval/exact_match", "exact-match"))):
        for i, c in enumerate(kl.values()):
            vals = [e[key] for e in c["eval_by_seed"]]
            mean, std = _mean_std(vals)
            x = i + (j - 0.5) * 0.4
            ax2.bar(x, mean, width=0.4, yerr=std, capsize=3, color=f"C{i}", alpha=1.0 if j == 0 else 0.5,
                    label=label if i == 0 else None, edgecolor="k", lw=0.5)
            ax2.plot([x] * len(vals), vals, "k.", ms=3)
    ax2.set_xticks(range(len(kl)), list(kl))
    ax2.set_ylim(0, 1)
    ax2.set_title("Greedy answers at the end\n(dark: gold reward, light: exact-match)", fontsize=10)
    ax2.grid(axis="y", alpha=0.3)
    return save(fig, out_dir, "kl_estimators.png")


def centred_average(values, window=3):
    h = window // 2
    return [sum(values[max(0, i - h):i + h + 1]) / len(values[max(0, i - h):i + h + 1]) for i in range(len(values))]


def plot_overopt(results, out_dir):
    """Reward over-optimisation (Gao, Schulman and Hilton 2022, arXiv:2210.10760) against sqrt(KL)
    to the start, one colour per beta: the gold reward of the greedy answers on held-out prompts
    (thin: each seed; thick: their mean at each evaluation), and the learned reward model's score
    of the policy's samples (the mean over the seeds at each step, a centred 3-step average)."""
    runs = results["overopt"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, (beta, c) in enumerate(runs.items()):
        for xs, ys in zip(c["eval_sqrt_kl_by_seed"], c["eval_gold_by_seed"]):
            ax1.plot(xs, ys, color=f"C{i}", lw=0.7, alpha=0.35)
        mean = lambda by_seed: [sum(col) / len(col) for col in zip(*by_seed)]  # noqa: E731
        ax1.plot(mean(c["eval_sqrt_kl_by_seed"]), mean(c["eval_gold_by_seed"]), "o-", color=f"C{i}", lw=2, ms=4,
                 label=f"beta={beta}")
        for xs, ys in zip(c["sqrt_kl_by_seed"], c["rm_by_seed"]):
            ax2.plot(xs, ys, color=f"C{i}", lw=0.5, alpha=0.25)
        ax2.plot(centred_average(mean(c["sqrt_kl_by_seed"])), centred_average(mean(c["rm_by_seed"])), color=f"C{i}",
                 lw=2, label=f"beta={beta}")
    n = len(next(iter(runs.values()))["eval_gold_by_seed"])
    ax1.set_title(f"Gold reward of greedy answers (what we want), {n} seeds")
    ax1.set_ylabel("gold reward, 200 held-out prompts")
    ax2.set_title("Reward model's score of the samples (what GRPO maximises)")
    ax2.set_ylabel("reward-model score (normalised at the start)")
    for ax in (ax1, ax2):
        ax.set_xlabel("sqrt(KL(pi || pi_start)), KL summed over a response's tokens")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Over-optimising a learned reward: GRPO on the pipeline's reward model")
    return save(fig, out_dir, "overoptimisation.png")


def plot_variants(variants, out_dir):
    """The variants comparison of pipeline.py --variants: each variant's held-out figures (GRPO:
    gold reward of the greedy answers; DPO: pairwise accuracy, and the gold reward of its greedy
    answers) against its KL to the SFT model, the seeds' mean with one std each way and every seed
    as a dot. DPO's KL spans two orders of magnitude (IPO to SimPO): a log axis."""
    panels = (("grpo", "eval/gold_reward", "gold reward of greedy answers"),
              ("dpo", "eval/accuracy", "held-out pairwise accuracy"),
              ("dpo", "eval/gold_reward", "gold reward of greedy answers"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (algo, key, ylabel) in zip(axes, panels):
        for i, (name, c) in enumerate(variants[algo].items()):
            ys, xs = [e[key] for e in c["eval_by_seed"]], c["kl_by_seed"]
            (my, sy), (mx, sx) = _mean_std(ys), _mean_std(xs)
            ax.errorbar(mx, my, xerr=sx, yerr=sy, fmt="o", color=f"C{i}", capsize=3, ms=7)
            ax.plot(xs, ys, ".", color=f"C{i}", alpha=0.5, ms=4)
            ax.annotate(name, (mx, my), textcoords="offset points", xytext=(6, 6 - 11 * (i % 3)), fontsize=8,
                        color=f"C{i}")
        n = len(next(iter(variants[algo].values()))["kl_by_seed"])
        ax.set_title(f"{algo.upper()} variants ({n} seeds: mean ± std, dots the seeds)", fontsize=10)
        ax.set_xlabel("KL(pi || pi_SFT) per response, nats (200 held-out prompts)")
        ax.set_ylabel(ylabel)
        if algo == "dpo":
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3, which="both")
    first = next(iter(variants["dpo"].values()))["eval_by_seed"][0]
    if "eval/bayes_accuracy" in first:
        axes[1].axhline(first["eval/bayes_accuracy"], color="k", ls="--", lw=1, label="Bayes ceiling")
        axes[1].legend(fontsize=8, loc="lower right")
    return save(fig, out_dir, "variants.png")


def plot_real(results, out_dir):
    """pipeline.py --smollm2: greedy accuracy on held-out arith prompts over GRPO's steps (the
    verifier reward and the learned reward model: mean over the seeds with a min-max band, thin
    lines each seed), and where DPO's models end (mean, the bar their range)."""
    c = results["smollm2"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for key, color, name in (("grpo_by_seed", "C0", "verifier reward"), ("grpo_rm_by_seed", "C1", "learned reward model")):
        for ys in c[key]:
            ax.plot(c["steps"], ys, color=color, lw=0.7, alpha=0.4)
        _band(ax, c["steps"], c[key], color, f"GRPO, {name} ({len(c[key])} seeds)")
    dpo = c["dpo_accuracy"]
    mean = sum(dpo) / len(dpo)
    ax.errorbar([c["steps"][-1]], [mean], yerr=[[mean - min(dpo)], [max(dpo) - mean]], fmt="D", color="C2", ms=8,
                capsize=4, label=f"DPO on the on-policy pairs: its final models ({len(dpo)} seeds)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("greedy accuracy, 100 held-out prompts")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M-Instruct on arith (2 CPU cores)", fontsize=10)
    return save(fig, out_dir, "smollm2_arith.png")


def plot_tools(results, out_dir):
    """pipeline.py --smollm2_tools: left, GRPO's sampled accuracy (the reward) and calls per answer
    against steps (thin: each seed; thick: their mean); right, greedy accuracy on held-out
    problems with the calculator and alone, and the share of answers calling it, per model (bars:
    the mean over the seeds, dots: each seed)."""
    c = results["smollm2_tools"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, (key, name) in enumerate((("reward_by_seed", "sampled answers right (the reward)"),
                                     ("calls_by_seed", "calls per sampled answer"))):
        for ys in c[key]:
            ax1.plot(c["steps"], ys, color=f"C{i}", lw=0.7, alpha=0.4)
        ax1.plot(c["steps"], [sum(col) / len(col) for col in zip(*c[key])], "o-", color=f"C{i}", lw=2, ms=4,
                 label=f"{name}, {len(c[key])} seeds")
    ax1.set_xlabel("GRPO step")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    ax1.set_title("GRPO --tools calculator, from the SFT model (temperature 0.7)", fontsize=10)
    groups = [("instruct", "instruct")] + [(k, k.upper()) for k in ("sft", "grpo")]
    bars = (("tool", "accuracy", "right, with the calculator"), ("tool", "calls", "calling it"),
            ("alone", "accuracy", "right, alone"))
    for g, (kind, label) in enumerate(groups):
        evs = [v for k, v in c["eval"].items() if k == kind or k.startswith(kind + "/")]
        for b, (mode, key, name) in enumerate(bars):
            ys = [e[mode][key] for e in evs]
            x = g + (b - 1) * 0.27
            ax2.bar(x, sum(ys) / len(ys), width=0.25, color=f"C{b + 2}", label=name if g == 0 else None)
            ax2.plot([x] * len(ys), ys, "k.", ms=4)
    ax2.set_xticks(range(len(groups)), [label for _, label in groups])
    ax2.set_ylabel("share of 100 held-out problems (greedy)")
    ax2.set_ylim(0, 1.05)
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=8)
    ax2.set_title("SmolLM2-135M-Instruct, 3-digit sums and products", fontsize=10)
    return save(fig, out_dir, "smollm2_tools.png")


def plot_distill(results, out_dir):
    """On-policy distillation against GRPO with the gold reward, from the same SFT model: greedy
    exact-match and gold reward on held-out prompts against steps (thin: each seed; thick: their
    mean), the teacher's level dashed."""
    c = results["distill"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, key, teacher_key, label in ((axes[0], "exact_by_seed", "eval/exact_match", "greedy exact-match"),
                                        (axes[1], "gold_by_seed", "eval/gold_reward", "gold reward")):
        for i, (kind, name) in enumerate((("distill", "distillation (--teacher)"), ("grpo_gold", "GRPO, gold reward"))):
            steps = c[kind]["steps"]
            for ys in c[kind][key]:
                ax.plot(steps, ys, color=f"C{i}", lw=0.7, alpha=0.35)
            mean = [sum(col) / len(col) for col in zip(*c[kind][key])]
            ax.plot(steps, mean, "o-", color=f"C{i}", lw=2, ms=4, label=f"{name}, {len(c[kind][key])} seeds")
        ax.axhline(c["teacher"][teacher_key], color="k", ls="--", lw=1, label="the teacher (seed 0's GRPO model, on its 500 held-out prompts)")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{label}, 200 held-out prompts")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("On-policy distillation from the GRPO model against GRPO itself, from the same SFT start")
    return save(fig, out_dir, "distill.png")


def figures(runs, out_dir):
    """The README's figures: from RUNS/results.json (pipeline.py) the summary, and where that run
    made them the KL-estimator comparison and the over-optimisation curves."""
    results_path = os.path.join(runs, "results.json")
    if not os.path.isfile(results_path):
        raise FileNotFoundError(f"no {results_path}: run `python pipeline.py --runs {runs}` first")
    with open(results_path) as f:
        results = json.load(f)
    if "smollm2" in results:  # pipeline.py --smollm2
        return [plot_real(results, out_dir)]
    if "smollm2_tools" in results:  # pipeline.py --smollm2_tools
        return [plot_tools(results, out_dir)]
    paths = [plot_summary(results_path, out_dir)]
    if os.path.isfile(os.path.join(runs, "variants.json")):  # pipeline.py --variants
        with open(os.path.join(runs, "variants.json")) as f:
            paths.append(plot_variants(json.load(f)["variants"], out_dir))
    if "kl" in results:
        paths.append(plot_kl_bands(results, out_dir))
    if "overopt" in results:
        paths.append(plot_overopt(results, out_dir))
    if "distill" in results:
        paths.append(plot_distill(results, out_dir))
    return paths


def parse_args(argv=None):
    """The command line, --out filled (OUT: never a folder git tracks files in)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="*", help="run out_dirs, each holding metrics.jsonl (and run_config.json); "
                   "several are overlaid, a figure per kind of run")
    p.add_argument("--summary", help="also draw pipeline.py's results.json as summary.png")
    p.add_argument("--out", default=OUT, help=f"folder for the PNGs (default: {OUT})")
    p.add_argument("--figures", metavar="RUNS", help="the README's figures from RUNS/results.json (pipeline.py) "
                   "(the default when no run dir is given: --figures runs)")
    p.add_argument("--kl_compare", action="store_true", help="one KL-estimator comparison figure of all runs")
    p.add_argument("--kind", choices=sorted(PANELS), help="override the detected kind of run")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window over train metrics (0: off)")
    args = p.parse_args(argv)
    if not args.run_dirs and not args.summary and not args.figures:
        args.figures = "runs"
    return p, args


def main(argv=None):
    p, args = parse_args(argv)
    try:
        if args.figures:
            paths = figures(args.figures, args.out)
        elif args.kl_compare:
            paths = [plot_kl_compare(args.run_dirs, args.out, args.smooth)]
        else:
            paths = plot_runs(args.run_dirs, args.out, args.smooth, args.kind)
        if args.summary and not args.figures:
            paths.append(plot_summary(args.summary, args.out))
    except (OSError, ValueError) as e:  # a missing or broken metrics file: one clear line, no traceback
        p.exit(1, f"plot.py: error: {e}\n")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
