"""bench/, the harness (`python -m bench COMMAND`): every command runs on a tiny shape in seconds and writes
its results file (the command line, commit, device, versions, each measurement's repeats); a ratio is
the median of the repeats' own ratios, the variants alternated A B B A; a variant's flags reach the
script after the workload's; the rows of a length distribution have each row's own token counts; the
sweep draws its curves with the memory model's peak beside the measured one; the GPU command's CPU
subset runs each section, the race first, and a budget spent skips the rest naming the command; TRL's
check names the package that is missing; and the docs' tables are their results files', rendered."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from test_plots import check_png

import dpo
import grpo
import tasks
from bench import __main__ as bench
from bench import gpu, harness, steps
from bench import trl_side as bench_trl
from plumbing import cli

TINY = ["--model", "tiny", "--rows", "2", "--group_size", "2", "--prompt_len", "12", "--response_len", "6",
        "--steps", "1", "--in_process"]


def results(path):
    with open(path) as f:
        return json.load(f)


def test_help_lists_the_commands_and_each_its_flags(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"    {c} " in out for c in bench.COMMANDS), out
    for command, flag in [("steps", "--sweep"), ("rollout", "--dtype"), ("dispatch", "--training"), ("micro", "-k"),
                          ("report", "--check"), ("memory", "--validate"), ("gpu", "--budget_s")]:
        with pytest.raises(SystemExit):
            bench.main([command, "--help"])
        assert flag in capsys.readouterr().out, command


def test_a_ratio_is_the_median_of_the_repeats_ratios_and_runs_alternate():
    r = harness.ratio([30, 20, 12], [10, 20, 3])
    assert r["repeats"] == [3, 1, 4] and r["median"] == 3 and (r["min"], r["max"]) == (1, 4)  # medians' ratio: 2
    with pytest.raises(ValueError):  # a repeat missing on one side is an error, not a shorter list
        harness.ratio([1, 2, 3], [1, 2])
    order = []
    runs = harness.alternate(["a", "b", "c"], 3, lambda n, rep: order.append(n) or (n, rep))
    assert order == list("abccbaabc") and runs["b"] == [("b", 0), ("b", 1), ("b", 2)]
    variants = {"a": {"tokens_per_s": [4, 6], "peak_gib": [1, 0]}, "b": {"tokens_per_s": [2, 2], "peak_gib": [2, 1]}}
    (r,) = harness.ratios(variants, [("a", "b")])
    assert r["tokens_per_s"]["repeats"] == [2, 3] and "peak_gib" not in r  # a peak of 0 measured nothing


@pytest.mark.parametrize("script", [grpo, dpo])
def test_a_variants_flags_reach_the_script_after_the_workloads(script, tmp_path):
    name = script.__name__
    w = dict(script=name, model="m", data="rows.jsonl", steps=2, prompt_len=40, response_len=8, rows=2, group_size=2,
             lr=1e-4, beta=0.04)
    side, flags = steps.parse_variant("ours --no-shared_prompt --beta 0.5 --padding_free")
    argv = steps.ours_argv(w, flags, str(tmp_path))
    cfg = cli.parse_config(script.Config, argv[1:])
    assert argv[0] == f"{name}.py" and side == "ours" and cfg.steps == 3  # one warm-up step more
    assert (cfg.shared_prompt, cfg.padding_free, cfg.beta, cfg.max_prompt_len) == (False, True, 0.5, 40)
    for bad in ("theirs", "ours' --x", ""):
        with pytest.raises(SystemExit, match="--variant"):
            steps.parse_variant(bad)
    with pytest.raises(SystemExit, match="--compile"):
        steps.parse_variant("ours --lora", "rollout")
    with pytest.raises(SystemExit, match="TRL's side takes"):  # a flag TRL's side would drop
        steps.parse_variant("trl --no-shared_prompt")
    assert steps.parse_variant("trl --precompute_ref") == ("trl", ["--precompute_ref"])


def test_rows_have_each_rows_own_token_lengths(tmp_path):
    tok = tasks.char_tokenizer()
    want = harness.row_lengths("tldr", 16, seed=3)
    path = harness.make_data(str(tmp_path / "rows.jsonl"), want, alphabet=harness.exact_alphabet(tok))
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rows = [json.loads(line) for line in open(path)]
    assert [(n(r["prompt"]), n(r["chosen"]) + 1, n(r["rejected"]) + 1) for r in rows] == [(p, r, r) for p, r in want]


def test_length_distributions():
    rows = harness.row_lengths("tldr", 2000, seed=0)
    P, R = [p for p, _ in rows], [r for _, r in rows]
    assert 100 <= min(P) and max(P) <= 500 and 10 <= min(R) and max(R) <= 60
    assert sorted(P)[1000] < sum(P) / len(P) and sorted(R)[1000] < sum(R) / len(R)  # median < mean: a long tail
    assert rows[:50] == harness.row_lengths("tldr", 50, seed=0) != harness.row_lengths("tldr", 50, seed=1)
    assert harness.padding_share(rows, 8) > 0.3
    with open(harness.ARITH) as f:
        recorded = {tuple(p) for p in json.load(f)["pairs"]}
    arith = harness.row_lengths("arith", 100, seed=0)
    assert set(arith) <= recorded and len(set(arith)) > 10
    # one batch of 2: prompts padded to 4, responses to 2: 2 x 6 = 12 slots, 3 + 2 + 4 + 1 = 10 real tokens
    assert harness.padding_share([(3, 2), (4, 1)], 2) == pytest.approx(1 - 10 / 12)
    assert harness.padding_share(harness.row_lengths("fixed", 8, 5, 7), 4) == 0


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo"])
def test_equal_rows_cost_what_fixed_lengths_cost(script):
    shape = (2, 16, 5000, 100)  # layers, width, block parameters, vocabulary
    fixed = harness.step_flops(script, 4, 2, [(40, 24)], shape)
    assert harness.step_flops(script, 4, 2, [(40, 24)] * 3, shape) == pytest.approx(fixed)
    if script != "grpo":  # rows of the same mean length, unequal: attention grows with the square of each row's
        assert harness.step_flops(script, 4, 2, [(30, 24), (50, 24)], shape)[1] > fixed[1]
    # by hand: SFT, 4 rows of 64 tokens, 6 x 5000 + 12 x 2 x 16 x 64 a token, the head 6 x 16 x 100 at 24 of them
    assert harness.step_flops("sft", 4, 1, [(40, 24)], shape) == (256, 4 * (64 * (30000 + 24576) + 24 * 9600))
    # DPO: a pair's prompt is work once, 40 + 2 x 24 tokens attending over 64; a GRPO group's once in its update
    assert harness.step_flops("dpo", 4, 1, [(40, 24)], shape) == (512, 4 * (88 * (30000 + 24576) + 2 * 24 * 9600))
    rollout = 4 * 40 * (2 * 5000 + 4 * 2 * 16 * 40) + 8 * 24 * (2 * 5000 + 4 * 2 * 16 * 64 + 2 * 16 * 100)
    assert harness.step_flops("grpo", 4, 2, [(40, 24)], shape) == pytest.approx(
        (512, 4 * (88 * (30000 + 24576) + 2 * 24 * 9600) * 4 / 3 + rollout))


def test_steps_runs_ours_at_two_flag_sets_alternated(tmp_path, capsys):
    """GRPO on the tiny model at its defaults and without shared prompts, 2 repeats: each variant's
    figures a list of 2, the ratio per repeat, the memory model's peak beside; the file says what ran."""
    bench.main(["steps", "--script", "grpo", *TINY, "--variant", "ours", "--variant", "ours --no-shared_prompt",
                "--results", str(tmp_path)])
    res = results(tmp_path / "steps-cpu.json")
    assert res["command"] == "steps" and res["argv"].startswith("python -m bench steps --script grpo")
    assert set(res["versions"]) == {"torch", "transformers", "trl"} and res["device_kind"] == "cpu" and res["commit"]
    (m,) = res["measurements"]
    ours = m["variants"]["ours"]
    assert list(m["variants"]) == ["ours", "ours --no-shared_prompt"] and len(ours["tokens_per_s"]) == 2
    assert ours["what_ran"]["shared_prompt"]["value"] is True and ours["predicted_peak_gib"][0] > 0
    (r,) = m["ratios"]
    assert (r["a"], r["b"]) == ("ours", "ours --no-shared_prompt") and len(r["tokens_per_s"]["repeats"]) == 2


def test_the_sweep_draws_tokens_per_second_and_memory_with_the_model(tmp_path):
    bench.main(["steps", "--script", "dpo", *TINY, "--sweep", "response_len=4,8", "--repeats", "1", "--results",
                str(tmp_path), "--plots", str(tmp_path), "--variant", "ours --no-precompute_ref"])
    res = results(tmp_path / "steps-cpu.json")
    assert [m["x"] for m in res["measurements"]] == [{"response_len": 4}, {"response_len": 8}] and res["sweep"]
    assert [m["workload"]["response_len"] for m in res["measurements"]] == [4, 8]
    check_png(str(tmp_path / "sweep-dpo-tiny-response_len-cpu.png"), min_w=800)


def test_rollout_against_generate_on_the_tiny_model(tmp_path):
    bench.main(["rollout", "--model", "tiny", "--rows", "2", "--group_size", "2", "--prompt_len", "10",
                "--response_len", "6", "--repeats", "2", "--results", str(tmp_path)])
    (m,) = results(tmp_path / "rollout-cpu.json")["measurements"]
    assert set(m["variants"]) == {"ours", "generate"} and len(m["variants"]["ours"]["tokens_per_s"]) == 2
    assert m["variants"]["ours"]["greedy"] == {"identical_rows": 1.0, "real_divergences": 0}  # fp32: identical
    assert m["ratios"][0]["tokens_per_s"]["median"] > 0


def test_memory_and_dispatch_write_their_tables(tmp_path, monkeypatch):
    assert bench.main(["memory", "--table", "--readme", "--results", str(tmp_path)]) == 0
    table = results(tmp_path / "memory-cpu-readme.json")
    assert table["header"][:2] == ["model", "script"] and len(table["rows"]) == 4
    bench.main(["dispatch", "--layers", "2", "--results", str(tmp_path)])
    (decode,) = results(tmp_path / "dispatch-cpu.json")["rows"]
    assert "ops" in decode[1] and "model.generate" in decode[2]
    monkeypatch.setattr(harness, "RESULTS", str(tmp_path))
    for name in ("memory-cpu-readme", "dispatch-cpu"):
        table = bench.render([name])
        assert table.startswith("| ") and "Made by `python -m bench" in table, table


def test_micro_runs_the_benchmarks_each_checked_against_its_twin(tmp_path):
    """`python -m bench micro -k draw`: pytest-benchmark over bench/test_micro.py's draw (sample_token's
    inverse CDF checked against a per-row plain one first), its group a measurement, the ratio against
    the plain twin (multinomial)."""
    bench.main(["micro", "-k", "draw", "--results", str(tmp_path)])
    (m,) = results(tmp_path / "micro-cpu.json")["measurements"]
    assert list(m["variants"]) == ["draw[inverse_cdf]", "draw[multinomial]"] and m["variants"]["draw[multinomial]"]["seconds"][0] > 0
    assert [(r["a"], r["b"]) for r in m["ratios"]] == [("draw[inverse_cdf]", "draw[multinomial]")]


def test_every_micro_benchmark_agrees_with_its_plain_twin():
    """Each benchmark of bench/test_micro.py, run once untimed (--benchmark-disable): its check against its
    plain twin holds, and it runs with each of the parameters it is measured at (every DPO loss type)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                          os.path.join(ROOT, "bench", "test_micro.py")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_trl_check_names_the_missing_package(monkeypatch):
    """bench.trl_side.check builds a one-step trainer: a package missing beneath TRL (here datasets, as pyarrow
    would be on a GPU image) is named, not reported as TRL missing."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ModuleNotFoundError
    res = bench_trl.check()
    assert res["ok"] is False and res["missing"] == "datasets", res


def test_trl_defaults_are_trls_own(tmp_path):
    """`trl-defaults` leaves TRL's checkpointing, optimizer and schedule to TRL; `trl` matches ours.
    Where TRL is importable, its 1.16 defaults are the pinned ones the docs quote."""
    spec = dict(out_dir=str(tmp_path), steps=2, lr=1e-6, dtype="fp32", flags=[], defaults=True)
    assert not {"gradient_checkpointing", "optim", "adam_beta2"} & set(bench_trl.config_args(spec))
    matched = bench_trl.config_args(spec | {"defaults": False})
    assert (matched["gradient_checkpointing"], matched["optim"], matched["adam_beta2"]) == (False, "adamw_torch_fused", 0.95)
    assert bench_trl.config_args(spec | {"defaults": False, "flags": ["--activation_checkpointing"]})["gradient_checkpointing"]
    pinned = dict(gradient_checkpointing=True, optim="adamw_torch_fused", adam_beta2=0.999, beta=0.0)
    trl = pytest.importorskip("trl", reason="TRL is not installed (CI): the pinned table stands")
    assert trl.__version__ == "1.16.0"
    cfg = trl.GRPOConfig(**bench_trl.config_args(spec))
    assert {k: getattr(cfg, k) for k in pinned} == pinned


def test_gpu_cpu_subset_runs_the_race_first_then_every_section(tmp_path):
    assert gpu.main(["--cpu", "--results", str(tmp_path)]) == 0
    res = results(tmp_path / "gpu-cpu.json")
    sections = [r[0] for r in res["rows"]]
    assert sections.index("race") < sections.index("compile") < sections.index("decode") < sections.index("qwen")
    whats = " ".join(r[1] for r in res["rows"])
    for want in ("a one-step GRPO and DPO trainer", "`ours --no-precompute_ref`",
                 "profile of 16 decode steps", "ours / generate", "wall time"):
        assert want in whats, (want, res["rows"])
    assert not any(r[1] == "FAILED" for r in res["rows"]), res["rows"]
    race = results(tmp_path / "steps-cpu-gpu-race.json")["measurements"]
    assert [m["script"] for m in race] == ["grpo", "dpo"] and all(len(v["step_s"]) == 2 for v in race[1]["variants"].values())


def test_gpu_skips_the_sections_past_its_budget(tmp_path):
    assert gpu.main(["--cpu", "--only", "race,decode", "--budget_s", "1", "--results", str(tmp_path)]) == 0
    rows = results(tmp_path / "gpu-cpu.json")["rows"]
    assert [r[1] for r in rows[:2]] == ["skipped", "skipped"] and rows[0][3] == "python -m bench gpu --only race"


def test_gpu_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA GPU.*--cpu"):
        gpu.main([])


def test_the_docs_tables_are_their_results_files():
    """Every table between `<!-- bench: ... -->` markers in README.md and docs/ is what `python -m bench
    report` renders from bench/results/: no figure typed by hand, none left behind its file."""
    assert bench.report(check=True) == 0
    text = open(os.path.join(ROOT, "docs", "performance.md")).read()
    assert text.count("<!-- bench: ") >= 5


def test_a_results_file_holds_the_command_as_it_can_be_run_again(tmp_path):
    """The command line a results file names (and the docs' tables print) is quoted as a shell reads it:
    a variant of two words stays one argument."""
    argv = ["steps", "--variant", "ours --no-shared_prompt", "--variant", "trl", "--tag", "x"]
    path = harness.save("steps", torch.device("cpu"), "x", {"measurements": []}, argv=argv, folder=str(tmp_path))
    assert shlex.split(results(path)["argv"]) == ["python", "-m", "bench", *argv]


# A table that shows the code as it was before a change, kept beside the one after it on purpose.
PAST = {"dispatch-cpu-before"}


def test_every_cpu_table_in_the_docs_is_made_by_a_line_of_regenerate_sh():
    """bench/regenerate.sh measures every CPU figure again: each CPU results file the docs' tables render
    was made by one of its lines (GPU files are `python -m bench gpu`'s or carried over). A row whose
    command is not there would not be regenerated, and a line the files never ran would print a table
    nothing measured."""
    with open(os.path.join(ROOT, "bench", "regenerate.sh")) as f:
        lines = [shlex.split(m, comments=True) for m in re.findall(r"^\s*\$B (.*)$", f.read(), re.M)]
    names = set()
    for path in bench.pages():
        with open(path) as f:
            names |= {n for m in bench.MARK.finditer(f.read()) for n in m[2].split()}
    cpu = [n for n in sorted(names - PAST) if results(os.path.join(harness.RESULTS, n + ".json"))["device_kind"] == "cpu"]
    assert len(cpu) >= 15
    for name in cpu:
        argv = shlex.split(results(os.path.join(harness.RESULTS, name + ".json"))["argv"])
        assert argv[:3] == ["python", "-m", "bench"] and argv[3:] in lines, f"{name}: {argv} not in regenerate.sh"
