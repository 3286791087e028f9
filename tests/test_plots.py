"""Tests of plots/plot.py on small synthetic metrics.jsonl files, one per kind of run."""
import json
import math
import os
import re
import sys

import matplotlib.image as mpimg
import pytest

from helpers import ROOT, run_script, write_jsonl

sys.path.insert(0, os.path.join(ROOT, "plots"))
import plot  # noqa: E402

STEPS = 30
EVAL_EVERY = 10


@pytest.fixture(autouse=True)
def low_dpi(monkeypatch):
    monkeypatch.setattr(plot, "DPI", 80)  # same figures, fewer pixels to rasterise: keeps the file fast


def curve(step, start, end, wiggle=0.05, phase=0.0):
    """A smooth, slightly noisy-looking curve from start to end over STEPS steps."""
    t = step / STEPS
    return start + (end - start) * (1 - math.exp(-4 * t)) + wiggle * math.sin(1.7 * step + phase)


def train_keys(kind, step, scale=1.0):
    if kind == "sft":
        return {"loss": curve(step, 4.6, 0.8 * scale), "grad_norm": curve(step, 13, 2), "lr": 1e-3 * min(1, step / 5)}
    if kind == "rm":
        return {"loss": curve(step, 0.69, 0.4 * scale), "accuracy": curve(step, 0.5, 0.8), "margin": curve(step, 0, 1),
                "rewards/chosen": curve(step, 0, 1.2 * scale), "rewards/rejected": curve(step, 0, -0.8 * scale)}
    if kind == "dpo":
        return {"loss": curve(step, 0.69, 0.3), "rewards/chosen": curve(step, 0, 0.5 * scale),
                "rewards/rejected": curve(step, 0, -1.5 * scale), "rewards/accuracies": curve(step, 0.5, 0.85),
                "rewards/margins": curve(step, 0, 2), "logps/chosen": curve(step, -20, -15),
                "logps/rejected": curve(step, -20, -35)}
    if kind == "grpo":
        return {"reward": curve(step, 0.3, 0.8 * scale), "reward_std": curve(step, 0.2, 0.1),
                "frac_reward_zero_std": curve(step, 0.1, 0.5), "kl": curve(step, 0, 0.05 * scale, 0.005),
                "kl/optimized": curve(step, 0, 0.04 * scale, 0.005), "clip_ratio/low": curve(step, 0, 0.02, 0.005),
                "clip_ratio/high": curve(step, 0, 0.03, 0.005), "entropy": curve(step, 1.5, 0.7),
                "completions/mean_length": curve(step, 12, 16, 0.5)}
    raise ValueError(kind)


def eval_keys(kind, step):
    gen = {"eval/exact_match": curve(step, 0, 0.6), "eval/gold_reward": curve(step, 0.2, 0.9)}
    acc = {"eval/accuracy": curve(step, 0.5, 0.78, 0.01), "eval/bayes_accuracy": 0.83}
    return {"sft": {"eval/loss": curve(step, 4.6, 0.9), **gen}, "rm": acc, "dpo": {**acc, **gen},
            "grpo": {**gen, "eval/pref_accuracy": curve(step, 0.5, 0.7, 0.01), "eval/bayes_accuracy": 0.83}}[kind]


def write_run(run_dir, kind, scale=1.0, config=None):
    os.makedirs(run_dir, exist_ok=True)
    rows = []
    for step in range(STEPS + 1):
        row = {"step": step, "time": 0.3 * step}
        if step > 0:
            row |= train_keys(kind, step, scale)
        if step % EVAL_EVERY == 0:
            row |= eval_keys(kind, step)
        rows.append(row)
    write_jsonl(os.path.join(run_dir, "metrics.jsonl"), rows)
    if config is not None:
        with open(os.path.join(run_dir, "run_config.json"), "w") as f:
            json.dump(config, f)
    return str(run_dir)


def check_png(path, min_w=500, min_h=300):
    assert os.path.isfile(path), path
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, (path, img.shape)
    assert img[..., :3].std() > 0.1, f"{path} looks blank"  # empty axes alone give ~0.08
    rgb = (img[..., :3] * 255).astype("uint8").reshape(-1, 3)
    assert len({tuple(p) for p in rgb[:: max(1, len(rgb) // 20000)]}) > 20, f"{path}: too few distinct colours"
    return img


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo", "grpo"])
def test_plot_run_each_kind(tmp_path, kind):
    config = {"kl_estimator": "k3", "beta": 0.04} if kind == "grpo" else {"beta": 0.1}
    run = write_run(tmp_path / f"run_{kind}", kind, config=config)
    rows = plot.read_metrics(run)
    assert plot.detect_kind(rows, plot.read_config(run)) == kind
    paths = plot.plot_run(run, tmp_path / "out")
    assert [os.path.basename(p)[:-len("_12345678.png")] for p in paths] == [f"run_{kind}_{kind}"]
    check_png(paths[0])


def test_different_data_gives_different_image(tmp_path):
    a = plot.plot_run(write_run(tmp_path / "a" / "run", "dpo"), tmp_path / "out_a")[0]
    b = plot.plot_run(write_run(tmp_path / "b" / "run", "dpo", scale=3.0), tmp_path / "out_b")[0]
    img_a, img_b = mpimg.imread(a), mpimg.imread(b)
    assert img_a.shape == img_b.shape
    assert (img_a != img_b).any(axis=-1).mean() > 0.001


def test_series_keeps_only_rows_with_the_key(tmp_path):
    rows = plot.read_metrics(write_run(tmp_path / "run", "sft"))
    steps, values = plot.series(rows, "eval/loss")
    assert steps == [0, 10, 20, 30] and len(values) == 4
    steps, _ = plot.series(rows, "loss")
    assert steps == list(range(1, STEPS + 1))
    assert plot.series(rows, "missing") == ([], [])


def test_missing_panels_are_skipped(tmp_path):
    run = tmp_path / "partial"
    run.mkdir()
    rows = [{"step": s, "time": s, "reward": 0.1 * s, "kl": 0.01 * s} for s in range(1, 6)]
    write_jsonl(run / "metrics.jsonl", rows)
    check_png(plot.plot_run(str(run), tmp_path / "out")[0], min_w=400, min_h=250)


def test_kl_compare(tmp_path):
    runs = [write_run(tmp_path / f"grpo_{e}", "grpo", scale=1 + i, config={"kl_estimator": e, "beta": 0.04})
            for i, e in enumerate(["k1", "k2", "k3", "ratio_k1"])]
    runs.append(write_run(tmp_path / "grpo_none", "grpo", scale=5, config={"kl_estimator": "k3", "beta": 0}))
    path = plot.plot_kl_compare(runs, tmp_path / "out")
    assert os.path.basename(path).startswith("grpo_k1+grpo_k2+grpo_k3+grpo_ratio_k1+grpo_none_kl_estimators_")
    check_png(path)


def test_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty_run.*metrics.jsonl"):
        plot.plot_run(str(empty), tmp_path / "out")
    bad = tmp_path / "bad_run"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": \n{"step": 3, "loss": 0.5}\n')
    with pytest.raises(ValueError, match=r"bad_run.*metrics.jsonl, line 2"):
        plot.read_metrics(str(bad))


def test_a_torn_last_line_is_skipped_with_a_note(tmp_path, capsys):
    """A run killed while writing its metrics (or one still writing them, plotted live) leaves a
    torn last line, with or without its newline: the run could not be plotted. It is skipped with a
    note naming it; the rows before it are plotted as they are."""
    run_dir = write_run(tmp_path / "sft_run", "sft")
    path = os.path.join(run_dir, "metrics.jsonl")
    whole, text = plot.read_metrics(run_dir), open(path).read()
    for torn in ('{"step": 31, "loss": 0.', '{"step": 31, "lo\n'):
        with open(path, "w") as f:
            f.write(text + torn)
        assert plot.read_metrics(run_dir) == whole
        assert capsys.readouterr().err == (f"note: {path}, line {STEPS + 2}: not a complete row (a run stopped while "
                                           f"writing it?); skipped\n")
    (png,) = plot.plot_run(run_dir, tmp_path / "out")
    check_png(png)


def test_cli(tmp_path, capsys):
    sft = write_run(tmp_path / "sft_run", "sft")
    rm = write_run(tmp_path / "rm_run", "rm")
    out = tmp_path / "out"
    r = run_script(["plots/plot.py", sft, rm, "--out", str(out), "--smooth", "5"],
                   env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, r.stderr
    assert sorted(name[:-len("_12345678.png")] for name in os.listdir(out)) == ["rm_run_rm", "sft_run_sft"]
    with pytest.raises(SystemExit) as e:  # a missing run dir: exit 1 with one line naming the file
        plot.main([str(tmp_path / "nope"), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "nope" in err and "metrics.jsonl" in err and "Traceback" not in err


def test_summary_of_pipeline_results(tmp_path):
    evals = {"sft": {"eval/exact_match": 0.33, "eval/gold_reward": 0.63},
             "rm": {"eval/accuracy": 0.70, "eval/bayes_accuracy": 0.75},
             "dpo": {"eval/accuracy": 0.68, "eval/bayes_accuracy": 0.75, "eval/exact_match": 0.6,
                     "eval/gold_reward": 0.8},
             "grpo_gold": {"eval/pref_accuracy": 0.6, "eval/exact_match": 0.9, "eval/gold_reward": 0.95}}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"eval": evals, "wall_time_s": {}}))
    img = check_png(plot.plot_summary(str(results), str(tmp_path / "out")), min_w=800)
    evals["dpo"]["eval/exact_match"] = 0.1  # different numbers, different bars
    results.write_text(json.dumps({"eval": evals, "wall_time_s": {}}))
    other = mpimg.imread(plot.plot_summary(str(results), str(tmp_path / "out2")))
    assert (img != other).any(axis=-1).mean() > 0.001


def pipeline_results(scale=1.0):
    """A results.json as `pipeline.py --seeds 3 --kl_compare --overopt` writes it (pipeline.py's
    own tables are tested in test_pipeline.py)."""
    by_seed = {stage: [{"eval/exact_match": 0.3 * scale + 0.02 * s, "eval/gold_reward": 0.6 + 0.01 * s,
                        "eval/accuracy": 0.65 + 0.01 * s, "eval/bayes_accuracy": 0.75} for s in range(3)]
               for stage in ("sft", "rm", "dpo", "grpo_rm", "grpo_gold")}
    steps = list(range(1, 21))
    kl = {est: {"beta": 0 if est == "none" else 0.5, "steps": steps,
                "kl_by_seed": [[k * t * (1 + 0.1 * s) * scale for t in steps] for s in range(3)],
                "eval_by_seed": by_seed["grpo_gold"]}
          for est, k in (("none", 0.01), ("k1", 0.012), ("k2", 0.004), ("k3", 0.004), ("ratio_k1", 0.003))}
    overopt = {beta: {"steps": steps, "sqrt_kl_by_seed": [[(b * t) ** 0.5 for t in steps] for s in range(3)],
                      "rm_by_seed": [[0.1 * t * scale + 0.01 * s for t in steps] for s in range(3)],
                      "gold_by_seed": [[0.6 + 0.03 * t - 0.002 * b * t * t for t in steps] for s in range(3)],
                      "eval_steps": steps[::3],
                      "eval_sqrt_kl_by_seed": [[(b * t) ** 0.5 for t in steps[::3]] for s in range(3)],
                      "eval_gold_by_seed": [[0.6 + 0.03 * t - 0.002 * b * t * t * scale for t in steps[::3]]
                                            for s in range(3)]}
               for beta, b in (("0.04", 3.0), ("1.0", 0.3))}
    return {"seeds": 3, "eval_by_seed": by_seed, "eval": {k: v[0] for k, v in by_seed.items()}, "kl": kl,
            "overopt": overopt, "wall_time_s": {}}


def test_readme_figures_from_pipeline_results(tmp_path):
    """`python plots/plot.py` draws the README's figures from runs/results.json: the summary with the
    seeds' spread, the KL bands, the over-optimisation curves."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "results.json").write_text(json.dumps(pipeline_results()))
    paths = plot.figures(str(tmp_path / "runs"), str(tmp_path / "out"))
    names = ["summary.png", "kl_estimators.png", "overoptimisation.png"]
    assert [os.path.basename(p) for p in paths] == names
    images = [check_png(p, min_w=800) for p in paths]
    (tmp_path / "runs" / "results.json").write_text(json.dumps(pipeline_results(scale=2.0)))
    for name, img in zip(names, images):  # other numbers, other pictures
        other = mpimg.imread(os.path.join(plot.figures(str(tmp_path / "runs"), str(tmp_path / "out2"))[0]).replace(
            "summary.png", name))
        assert img.shape == other.shape and (img != other).any(axis=-1).mean() > 0.001, name
    with pytest.raises(FileNotFoundError, match="pipeline.py --runs"):
        plot.figures(str(tmp_path / "nothing"), str(tmp_path / "out"))


def test_the_smollm2_figure_from_the_real_model_pipeline(tmp_path):
    """pipeline.py --smollm2's results.json (the committed run's, plots/smollm2/) draws
    smollm2_arith.png, and other accuracies draw another picture."""
    with open(os.path.join(ROOT, "plots", "smollm2", "results.json")) as f:
        results = json.load(f)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps(results))
    (path,) = plot.figures(str(tmp_path / "a"), str(tmp_path / "out"))
    assert os.path.basename(path) == "smollm2_arith.png"
    img = check_png(path)
    c = results["smollm2"]
    c["grpo_by_seed"] = [[v * 0.5 for v in seed] for seed in c["grpo_by_seed"]]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(results))
    other = mpimg.imread(plot.figures(str(tmp_path / "b"), str(tmp_path / "out2"))[0])
    assert img.shape == other.shape and (img != other).any(axis=-1).mean() > 0.001


def test_the_variants_figure_from_pipeline_variants_json(tmp_path):
    """pipeline.py --variants' variants.json draws variants.png beside the README's other figures;
    other KLs draw another picture."""
    def variants(shift):
        return {"variants": {algo: {name: {"eval_by_seed": [{"eval/gold_reward": 0.5 + 0.05 * i, "eval/accuracy": 0.6,
                                                             "eval/bayes_accuracy": 0.75}] * 3,
                                           "kl_by_seed": [shift + i, shift + i + 0.5, shift + i + 1.0]}
                                    for i, name in enumerate(("a", "b", "c"))} for algo in ("grpo", "dpo")}}
    for name, shift in (("one", 0.0), ("two", 3.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(pipeline_results()))
        (tmp_path / name / "variants.json").write_text(json.dumps(variants(shift)))
    paths = plot.figures(str(tmp_path / "one"), str(tmp_path / "out1"))
    assert "variants.png" in [os.path.basename(p) for p in paths]
    img = check_png(os.path.join(tmp_path / "out1", "variants.png"), min_w=800)
    plot.figures(str(tmp_path / "two"), str(tmp_path / "out2"))
    other = mpimg.imread(os.path.join(tmp_path / "out2", "variants.png"))
    assert img.shape == other.shape and (img != other).any(axis=-1).mean() > 0.001


# -----------------------------------------------------------------------------
# several runs in one figure set, labelled by folder; names that never collide; the panels of each
# script; no documented command rewriting a committed file


def legend_labels(runs, kind, title):
    """The legend of one panel of PANELS[kind], drawn from runs [(label, run_dir)]."""
    import matplotlib.pyplot as plt

    panel = next(p for p in plot.PANELS[kind] if p[0] == title)
    fig, ax = plt.subplots()
    drawn = plot.draw_panel(ax, [(label, plot.read_metrics(d), plot.read_config(d)) for label, d in runs], *panel)
    labels = ax.get_legend_handles_labels()[1] if drawn else []
    plt.close(fig)
    return labels


def several(runs, kind):
    """The figure of runs [(label, run_dir)] of one kind (plot.figure_panels, not saved): the runs'
    legend's labels and the panels' titles."""
    import matplotlib.pyplot as plt

    fig = plot.figure_panels([(label, plot.read_metrics(d), plot.read_config(d)) for label, d in runs],
                             plot.PANELS[kind], kind)
    labels, titles = [t.get_text() for t in fig.legends[0].get_texts()], [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    return labels, titles


def test_run_labels_are_the_shortest_distinguishing_path_ends(tmp_path):
    assert plot.run_labels(["x/a/run", "y/a/run", "z/b"]) == ["x/a/run", "y/a/run", "b"]
    assert plot.run_labels(["runs/grpo", "runs/dpo"]) == ["grpo", "dpo"]
    assert plot.run_labels([str(tmp_path / "run"), "elsewhere/run"]) == [f"{tmp_path.name}/run", "elsewhere/run"]
    with pytest.raises(ValueError, match="the same run given twice"):
        plot.run_labels(["runs/a", "runs/./a"])


def test_several_runs_overlay_labelled_by_folder_and_never_share_a_file(tmp_path, capsys):
    """Two DPO runs whose folders share a name (a/run, b/run) and a reward-model run: one DPO
    figure with both runs, its legends `a/run` and `b/run` (where they were labelled alike), an
    RM figure; each run alone, plotted into the same folder, gets a file of its own, and the two
    pictures differ; the same run plotted again redraws its own file."""
    a = write_run(tmp_path / "a" / "run", "dpo", config={"beta": 0.1})
    b = write_run(tmp_path / "b" / "run", "dpo", scale=3.0, config={"beta": 0.1})
    rm = write_run(tmp_path / "c" / "rm_run", "rm")
    plot.main([a, b, rm, "--out", str(tmp_path / "out")])
    paths = capsys.readouterr().out.split()
    assert [os.path.basename(p)[:-len("_12345678.png")] for p in paths] == ["a-run+b-run_dpo", "rm_run_rm"]
    for p in paths:
        check_png(p)
    labels, titles = several([("a/run", a), ("b/run", b)], "dpo")
    assert labels == ["a/run", "b/run"]  # one legend, of the runs
    assert "Implicit rewards: chosen" in titles and "Implicit rewards: rejected" in titles and "Loss" in titles
    alone = [plot.plot_run(d, tmp_path / "same")[0] for d in (a, b)]
    assert len(set(alone)) == 2 and sorted(os.listdir(tmp_path / "same")) == sorted(map(os.path.basename, alone))
    img_a, img_b = (mpimg.imread(p) for p in alone)
    assert img_a.shape == img_b.shape and (img_a != img_b).any(axis=-1).mean() > 0.001
    assert plot.plot_run(a, tmp_path / "same") == alone[:1]


def test_kl_compare_labels_runs_of_one_estimator_by_folder(tmp_path):
    """Two k3 runs were both labelled "k3"; now each estimator that repeats carries its folder."""
    import matplotlib.pyplot as plt

    runs = [write_run(tmp_path / s / "run", "grpo", scale=1 + i, config={"kl_estimator": "k3", "beta": 0.04})
            for i, s in enumerate(("x", "y"))]
    runs.append(write_run(tmp_path / "z", "grpo", config={"kl_estimator": "k1", "beta": 0.04}))
    seen = []
    real = plt.Axes.legend

    def spy(ax, *args, **kw):
        seen.append(ax.get_legend_handles_labels()[1])
        return real(ax, *args, **kw)

    plt.Axes.legend = spy
    try:
        plot.plot_kl_compare(runs, tmp_path / "out")
    finally:
        plt.Axes.legend = real
    assert seen == [["k3: x/run", "k3: y/run", "k1"]]


def test_each_script_s_panels_are_drawn(tmp_path):
    """GRPO: loss, grad norm, lr, reward std and the zero-std share beside the others; DPO: the
    margins and the policy's log-probs of chosen and rejected (dpo_loss's metric names)."""
    grpo = write_run(tmp_path / "grpo", "grpo")
    with open(os.path.join(grpo, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    write_jsonl(os.path.join(grpo, "metrics.jsonl"),
                [r | ({"loss": 0.1 * r["step"], "grad_norm": 1.0 + r["step"], "lr": 1e-6} if r["step"] else {})
                 for r in rows])
    for title, want in (("Loss", ["train"]), ("Gradient norm", ["grad norm"]), ("Learning rate", ["lr"]),
                        ("Reward spread within groups", ["reward_std"]),
                        ("Groups without signal", ["frac_reward_zero_std"])):
        assert legend_labels([("grpo", grpo)], "grpo", title) == want, title
    dpo = write_run(tmp_path / "dpo", "dpo")
    assert legend_labels([("dpo", dpo)], "dpo", "Implicit reward margin") == ["margin"]
    assert legend_labels([("dpo", dpo)], "dpo", "Policy log-probs") == ["chosen", "rejected"]


def documented_plot_commands():
    """Every `python plots/plot.py ...` command in the README, docs/ and plot.py's docstring, as
    argument lists (placeholders such as RUN_DIR and `...` dropped)."""
    found = []
    for path in [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "plots", "plot.py"),
                 *(os.path.join(ROOT, "docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs"))) if n.endswith(".md"))]:
        with open(path) as f:
            text = f.read()
        for m in re.finditer(r"python plots/plot\.py([^`#]*?)(?=`|#|\n\n|\n {4}python|$)", text):  # may wrap
            argv = [a for a in m[1].split() if a not in ("...", "[RUN_DIR") and not a.endswith("...]")]
            found.append((os.path.relpath(path, ROOT), argv))
    return found


def test_no_documented_command_writes_where_git_keeps_files():
    """`python plots/plot.py` as documented rewrote plots/summary.png, a committed file: every
    documented command's --out (the default, runs/plots/, where none is given) holds no file git
    tracks."""
    import subprocess

    commands = documented_plot_commands()
    assert len(commands) >= 5, commands
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for where, argv in commands:
        _, args = plot.parse_args(argv)
        out = os.path.normpath(args.out)
        assert not [t for t in tracked if os.path.dirname(t) == out], (where, argv, out)


def test_each_reward_function_gets_its_line_under_its_own_name():
    """GRPO's "Each reward" panel holds one line per `rewards/<name>/mean` a run logged (TRL's
    names; a name with a slash kept whole), in the order first seen, and nothing else."""
    rows = [{"step": 1, "reward": 1.0, "rewards/accuracy/mean": 0.5, "rewards/accuracy/std": 0.1},
            {"step": 2, "rewards/my/len/mean": -0.2, "rewards/accuracy/mean": 0.7, "reward/rule": 1.0}]
    (panel,) = [p for p in plot.expand_panels(plot.PANELS["grpo"], rows) if p[0] == "Each reward"]
    assert panel[2] == [("rewards/accuracy/mean", "accuracy"), ("rewards/my/len/mean", "my/len")]


def test_fifty_runs_each_have_their_own_colour_and_style_and_the_legend_covers_no_panel(tmp_path):
    """50 DPO runs in one figure: tab10's colours alone repeated from the 11th run on, in the same line
    style, and the legend of 50 lines inside a panel covered it. Now each run's lines, in every panel,
    have one (colour, dash pattern) pair and no two runs share one; the runs' legend lists all 50 and
    its box, measured by matplotlib on the drawn figure, overlaps no panel's axes."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    dirs = [write_run(tmp_path / f"r{i:02d}", "dpo", scale=1 + i / 10) for i in range(50)]
    runs = [(f"r{i:02d}", plot.read_metrics(d), {}) for i, d in enumerate(dirs)]
    fig = plot.figure_panels(runs, plot.PANELS["dpo"], "DPO")
    fig.canvas.draw()
    pairs = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label().startswith("r"):  # a run's line (not a ceiling)
                # _unscaled_dash_pattern: the dash pattern as given ("--" and (0, (5, 1)) both read "--" otherwise)
                pairs.setdefault(line.get_label(), set()).add((to_hex(line.get_color()), line._unscaled_dash_pattern))
    assert sorted(pairs) == [label for label, _, _ in runs]
    assert all(len(p) == 1 for p in pairs.values())  # one look per run, in every panel
    assert len({next(iter(p)) for p in pairs.values()}) == 50  # no two runs alike
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [label for label, _, _ in runs]
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    plt.close(fig)
    check_png(plot.plot_runs(dirs, tmp_path / "out")[0])
