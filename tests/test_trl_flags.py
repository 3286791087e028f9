"""TRL's flag names on every script (plumbing/trl_flags.py): an alias parses to the Config its
own name does, a TRL flag that means something else here is refused with what to pass, an
unknown flag gets a "did you mean", --help and docs/usage.md show the same table the parser reads."""
import dataclasses
import json
import math
import os
import re
import typing

import pytest
import torch

import common
import dpo
import grpo
import reward
import sft
from helpers import ROOT, chat_rows, read_metrics, run_here, write_jsonl
from plumbing import cli, trl_defaults, trl_flags

SCRIPTS = {"sft": sft, "reward": reward, "dpo": dpo, "grpo": grpo}


def other_value(cls, flag):
    """A value for --flag, as text, that is not its default (a bool: not handled here)."""
    tp, default = typing.get_type_hints(cls)[flag], getattr(cls(), flag)
    tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if type(None) in typing.get_args(tp) else tp
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    if bool in typing.get_args(tp):  # a speed flag: bool | "auto"
        return "false" if default is not False else "true"
    return {int: "77", float: "0.375", str: "somewhere/else"}[tp]


def parse(module, argv, capsys=None):
    """cli.parse_config of the script's Config; (exit status, stderr) where it exits."""
    try:
        return cli.parse_config(module.Config, argv)
    except SystemExit as e:
        return e.code, capsys.readouterr().err if capsys else ""


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_trl_alias_parses_to_the_config_its_own_name_does(script):
    """For every alias of the script, in each form a TRL user writes it (`--x v`, `--x=v`; a
    bool bare or with true/false), the Config equals the one its own name gives, which differs
    from the default (so a name parsed to nothing, or to another flag, fails)."""
    module = SCRIPTS[script]
    aliases = {trl: ours for trl, (ours, note) in trl_flags.rows(script).items() if not note}
    assert {"learning_rate", "output_dir", "model_name_or_path", "gradient_accumulation_steps"} <= aliases.keys()
    bools = {f.name for f in dataclasses.fields(module.Config) if f.type in (bool, "bool")}
    for trl, ours in aliases.items():
        if ours in bools:
            flip = "false" if getattr(module.Config(), ours) else "true"
            own = [f"--{ours}"] if flip == "true" else [f"--no-{ours}"]
            cases = [([f"--{trl}", flip], own), ([f"--{trl}={flip.upper()}"], own)]
            if flip == "true":
                cases.append(([f"--{trl}"], own))
        else:
            v = other_value(module.Config, ours)
            cases = [([f"--{trl}", v], [f"--{ours}", v]), ([f"--{trl}={v}"], [f"--{ours}={v}"])]
        for theirs, own in cases:
            got = parse(module, theirs)
            assert got == parse(module, own) and got != module.Config(), (script, theirs)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_table_names_flags_each_script_has(script):
    fields = {f.name for f in dataclasses.fields(SCRIPTS[script].Config)}
    named = {ours for ours, _ in trl_flags.rows(script).values() if ours}
    same = {n for n, scripts in trl_flags.SAME_NAME if script in scripts}
    assert named | same <= fields, (named | same) - fields


@pytest.mark.parametrize("script, argv, says", [
    ("grpo", ["--max_steps", "10"], "grpo.py: --max_steps is TRL's flag, and means something else here: --steps here "
     "counts rollouts"),
    ("grpo", ["--epsilon", "0.1"], "pass --epsilon_low X --epsilon_high X"),
])
def test_a_trl_flag_that_means_something_else_here_is_refused_with_what_to_pass(script, argv, says, capsys):
    code, err = parse(SCRIPTS[script], argv, capsys)
    assert code == 2 and says in err, err


def test_every_refused_flag_is_refused_on_every_script_it_names(capsys):
    """Every TRL flag with a note, given a value the note does not accept (trl_flags.ACCEPTED: those
    that set nothing here run with the note; tests/test_first_day.py), is refused with it."""
    for trl, scripts, ours, note in trl_flags.TRL_FLAGS:
        if trl in trl_flags.COMPUTED:  # translated at the start: test_trls_computed_flags_...
            continue
        ok = trl_flags.ACCEPTED.get((scripts[0], trl), trl_flags.ACCEPTED.get(trl, ()))
        accepted = ours is None and ok is None
        value = "false" if ours is None and ok == trl_flags.TRUE else "true" if ok == trl_flags.FALSE else "1"
        value = "0.5" if trl == "loss_weights" else value  # a weight of 1 on the one loss is the loss itself
        for script in scripts if note and not accepted else ():
            code, err = parse(SCRIPTS[script], [f"--{trl}", value], capsys)
            assert code == 2 and note in err, (script, trl, err)


@pytest.mark.parametrize("script, argv, says", [
    ("grpo", ["--lerning_rate", "1e-6"], "grpo.py: unknown flag --lerning_rate; did you mean --lr (TRL: "
     "--learning_rate)? (--help lists every flag)\n"),
    ("grpo", ["--num_generation", "4"], "grpo.py: unknown flag --num_generation; did you mean --group_size (TRL: "
     "--num_generations)? (--help"),
    ("sft", ["--eval_evry", "4"], "sft.py: unknown flag --eval_evry; did you mean --eval_every (TRL: --eval_steps)? "
     "(--help"),
    ("dpo", ["--zzz"], "dpo.py: unknown flag --zzz (--help lists every flag)"),
    ("grpo", ["--lora_rank", "8"], "grpo.py: unknown flag --lora_rank (--help lists every flag)"),  # 3 edits from lora_r
    ("grpo", ["--rs_mod", "x"], "grpo.py: unknown flag --rs_mod; did you mean --rs_mode?"),
])
def test_an_unknown_flag_is_answered_with_the_closest_flags(script, argv, says, capsys):
    code, err = parse(SCRIPTS[script], argv, capsys)
    assert code == 2 and says in err, err


def test_help_says_which_flags_are_trls_and_which_trl_names_mean_something_else(capsys):
    with pytest.raises(SystemExit):
        cli.parse_config(grpo.Config, ["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone
    assert "(TRL: --learning_rate)" in out and "(TRL: --num_generations)" in out
    assert "(not TRL's --max_steps: --steps here counts rollouts" in out


def test_the_docs_trl_table_is_the_parsers():
    with open(os.path.join(ROOT, "docs", "usage.md")) as f:
        assert trl_flags.docs_table() in f.read()


def test_sft_runs_on_trl_s_flag_names(tmp_path, user_models):
    """A TRL user's command, names and all, on the Qwen2-shaped folder: the run records the flags
    under this project's names."""
    rows = write_jsonl(tmp_path / "rows.jsonl", chat_rows(8, "sft"))
    out = str(tmp_path / "run")
    r = run_here(["sft.py", "--model_name_or_path", user_models["qwen2"], "--dataset_name", rows, "--learning_rate",
                  "3e-5", "--output_dir", out, "--max_steps", "1", "--gradient_accumulation_steps", "2",
                  "--max_prompt_length", "64", "--report_to", "none", "--batch_size", "4", "--warmup_steps", "0",
                  "--eval_steps", "5", "--eval_dataset", rows])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "run_config.json")) as f:
        config = json.load(f)
    assert (config["lr"], config["out_dir"], config["model"], config["dataset"]) == (3e-5, out, user_models["qwen2"], rows)
    assert (config["steps"], config["grad_accum"], config["max_prompt_len"], config["wandb"]) == (1, 2, 64, False)


def test_a_bool_of_the_same_name_takes_trls_true_or_false():
    """TRL's parser reads `--vllm_importance_sampling_correction false` (a bool with its value); a
    bool flag here spelled as TRL spells it takes the value too, either way and with `=`."""
    for argv, want in ((["--vllm_importance_sampling_correction", "false"], False),
                       (["--vllm_importance_sampling_correction", "True"], True),
                       (["--vllm_importance_sampling_correction=1"], True),
                       (["--mask_truncated_completions=no"], None), (["--vllm_importance_sampling_correction"], True)):
        cfg = cli.parse_config(grpo.Config, argv)
        if want is None:
            assert cfg.mask_truncated_completions is False
        else:
            assert cfg.vllm_importance_sampling_correction is want, argv
    with pytest.raises(SystemExit):
        cli.parse_config(grpo.Config, ["--vllm_importance_sampling_correction=maybe"])


def test_report_to_is_trls_flag_and_its_values_trls_integrations():
    """--report_to is TRL's flag: its configs subclass transformers' TrainingArguments, whose
    `report_to` field (default none) names the integrations by the keys of transformers'
    INTEGRATION_TO_CALLBACK; every value accepted here is one of those keys, and the default the same."""
    import dataclasses

    from transformers import TrainingArguments
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from plumbing import logs

    field = {f.name: f for f in dataclasses.fields(TrainingArguments)}["report_to"]
    assert set(logs.REPORTERS) <= set(INTEGRATION_TO_CALLBACK), set(logs.REPORTERS) - set(INTEGRATION_TO_CALLBACK)
    assert field.default == cli.SharedConfig.report_to == "none"


# -----------------------------------------------------------------------------
# TRL 1.16.0's defaults: pinned (plumbing/trl_defaults.py), checked against TRL where it is installed, and every value
# the scripts call TRL's checked against the pinned table (CI has no TRL)


def test_the_pinned_defaults_are_trl_1_16s_own():
    """Each pinned field is the default of TRL 1.16.0's config class (a default_factory's value for
    DPO's loss_type), read from the installed TRL: here 256 completion tokens and 512 prompt tokens
    were called GRPOConfig's, which has 512 and no prompt limit."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (CI has none): the pinned table is checked by the "
                                            "tests below alone")
    if trl.__version__ != trl_defaults.TRL_VERSION:
        pytest.skip(f"TRL {trl.__version__} is installed; the pinned table is {trl_defaults.TRL_VERSION}'s")
    for name, pinned in trl_defaults.TRL_DEFAULTS.items():
        fields = {f.name: f for f in dataclasses.fields(getattr(trl, name))}
        for field, value in pinned.items():
            f = fields[field]
            theirs = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert theirs == value and isinstance(theirs, bool) == isinstance(value, bool), (name, field, theirs, value)
    assert "max_prompt_length" not in {f.name for f in dataclasses.fields(trl.GRPOConfig)}


# what each script's "trl" preset holds that TRL has no one value for: GRPO's prompt (TRL 1.16 cuts none) and the
# offline scripts' two lengths, whose sum is TRL's max_length
NOT_TRLS_ALONE = {"sft": {"max_prompt_len", "max_response_len"}, "reward": {"max_prompt_len", "max_response_len"},
                  "dpo": {"max_prompt_len", "max_response_len"}, "grpo": {"max_prompt_len"}}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_default_called_trls_is_the_pinned_one(script):
    """The values a model of your own gets (the Config's "trl" preset), --help's "TRL's" beside
    them, and every "TRL's default N" in a flag's --help are TRL 1.16.0's, as pinned; a value TRL
    has none of alone (GRPO's prompt limit, SFT's/DPO's/the reward model's two lengths) is not
    called TRL's, and the two lengths add up to TRL's max_length. Fails on the tree where grpo.py's
    256 completion tokens and 512 prompt tokens were called TRL's."""
    Config = SCRIPTS[script].Config
    preset = Config.DEFAULTS["trl"]
    for flag, value in preset.items():
        theirs = trl_defaults.preset_trl(script, flag)
        if flag in NOT_TRLS_ALONE[script]:
            assert theirs is None and "TRL's" not in trl_defaults.preset_note(script, flag, preset).replace(
                "TRL's max_length", ""), flag
        else:
            assert theirs is not None and value == theirs, (flag, value, theirs)
            assert trl_defaults.preset_note(script, flag, preset) == ", TRL's"
    if script != "grpo":
        assert preset["max_prompt_len"] + preset["max_response_len"] == trl_defaults.trl_default(script, "max_length")
    docs = cli._field_docs(Config)
    for flag, doc in docs.items():
        for said in re.findall(r"TRL's default (?:is )?(-?[0-9][0-9.e-]*)", doc):
            theirs = trl_defaults.preset_trl(script, flag) if flag in preset else trl_defaults.trl_default(script, flag)
            assert float(said) == theirs, (flag, said)
        if "TRL's name and default" in doc or "TRL's name, values and default" in doc:
            assert getattr(Config(), flag) == trl_defaults.trl_default(script, flag), flag


def test_every_trl_value_the_plumbing_and_docs_state_is_pinned():
    """"TRL's save_steps 500" (plumbing/cli.py), "TRL's max_length of 1024" (the docs): every TRL
    field and value said in the plumbing, the README and docs/usage.md is the pinned one."""
    fields = {k: v for table in trl_defaults.TRL_DEFAULTS.values() for k, v in table.items()}
    said = []
    for path in ("plumbing/cli.py", "plumbing/trl_flags.py", "plumbing/trl_defaults.py", "README.md", "docs/usage.md"):
        with open(os.path.join(ROOT, path)) as f:
            said += re.findall(r"TRL's ([a-z_]+) (?:of )?(-?[0-9][0-9.e-]*)", " ".join(f.read().split()))
    said = [(field, value) for field, value in said if field in fields]
    assert {"save_steps", "max_length"} <= {field for field, _ in said}
    for field, value in said:
        assert float(value.rstrip(".")) == fields[field], (field, value)
    assert "TRL's default): name yours so" in dict((t, n) for t, _, _, n in trl_flags.TRL_FLAGS)["dataset_text_field"]
    assert trl_defaults.trl_default("sft", "dataset_text_field") == "text"


def test_the_readme_and_usage_give_trls_defaults_as_pinned():
    """The README's and docs/usage.md's defaults for a model of your own are the pinned ones."""
    grpo_len = trl_defaults.trl_default("grpo", "max_completion_length")
    for doc in ("README.md", os.path.join("docs", "usage.md")):
        with open(os.path.join(ROOT, doc)) as f:
            text = " ".join(f.read().split())
        assert f"{grpo_len} completion tokens" in text and "TRL 1.16 cuts no prompt" in text, doc
        assert "256 completion tokens" not in text, doc


# every default of a script that is not TRL 1.16's, for a model of your own on one process, stated by hand: the
# flag (and value) that gives TRL's
NOT_TRLS = {"sft": ["--per_device_train_batch_size 8", "--num_train_epochs 3", "--warmup_steps 0",
                    "--lr_scheduler_type linear", "--activation_checkpointing", "--seed 42", "TRL's 0.999"]}
NOT_TRLS["reward"] = NOT_TRLS["sft"]
NOT_TRLS["dpo"] = NOT_TRLS["sft"] + ["--no-precompute_ref", "--beta 0.1"]
NOT_TRLS["grpo"] = NOT_TRLS["sft"] + ["--vllm_importance_sampling_correction", "TRL 1.16 cuts none"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_banner_names_each_default_that_is_not_trls_with_the_flag_for_trls(script):
    """A run on a model and data of your own says which of its defaults are not TRL 1.16's, each with
    the flag that gives TRL's (NOT_TRLS, written out by hand); a flag given TRL's value leaves the
    line, and the flags of a step's size compare with TRL's per-device batch on the world size.
    Fails on the tree where none was said (a GRPO step of 32 x 8 against TRL's 1 prompt x 8)."""
    Config = SCRIPTS[script].Config
    line = next(l for l in cli.fill_defaults(Config(model="mine", dataset="mine.jsonl")).split("\n")
                if l.startswith("not TRL 1.16's defaults"))
    entries = line.split(": ", 1)[1].split("; ")
    for want in NOT_TRLS[script]:
        assert sum(want in e for e in entries) == 1, (want, line)
    assert len(entries) == len(NOT_TRLS[script]), line  # and nothing else
    given = Config(model="mine", dataset="mine.jsonl", seed=42, warmup_steps=0, lr_scheduler_type="linear",
                   activation_checkpointing=True)
    assert not {"--seed", "--warmup_steps", "--lr_scheduler_type", "--activation_checkpointing"} & set(
        cli.fill_defaults(given).split())
    with_lora = cli.fill_defaults(Config(model="mine", dataset="mine.jsonl", lora=True))
    assert "--lora_dropout 0 (TRL's --lora_dropout 0.05)" in with_lora and "peft's modules" in with_lora
    assert "not TRL 1.16's" not in cli.fill_defaults(Config(model="tiny", dataset="mine.jsonl"))  # the embedded task's


def test_adamws_betas_are_what_the_banner_says():
    optimizer, _ = common.make_optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3, 0.0, 0, 10)
    beta2 = optimizer.param_groups[0]["betas"][1]
    assert f"beta2 {beta2:g} (TRL's {trl_defaults.trl_default('sft', 'adam_beta2'):g}" in trl_defaults.ADAM


# -----------------------------------------------------------------------------
# TRL's flags whose value here follows from the world size, the accumulation and the rows


@pytest.mark.parametrize("world", [1, 2])
def test_trls_per_device_batch_becomes_the_same_micro_batch_on_any_world_size(world, monkeypatch, capsys):
    """--per_device_train_batch_size P is TRL's rows a process computes at once; here each script's
    own batch arithmetic (cli.micro_batch; grpo.py's rollout split into --num_mini_batches x
    --grad_accum micro-batches a process) must give P again, on 1 and on 2 processes. The note
    says which flag it became. Refused on the tree that refused the flag."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    d = common.Dist(world_size=world)
    for script in ("sft", "reward", "dpo"):
        cfg = parse(SCRIPTS[script], ["--per_device_train_batch_size", "6", "--gradient_accumulation_steps", "2"])
        assert cli.micro_batch(cfg.batch_size, cfg.grad_accum, d) == 6 and cfg.batch_size == 6 * 2 * world
        assert f"--per_device_train_batch_size 6 (TRL's) on {world} process" in capsys.readouterr().out
    for argv in ([], ["--num_mini_batches", "2", "--grad_accum", "2"], ["--group_size", "4"]):
        cfg = cli.with_defaults(parse(grpo, ["--model", "mine", "--dataset", "d.jsonl",
                                             "--per_device_train_batch_size", "8", *argv]))
        rows_local = cfg.prompts_per_step // world * cfg.group_size  # grpo.py's main
        assert rows_local // cfg.num_mini_batches // cfg.grad_accum == 8, argv
        assert cfg.prompts_per_step % world == 0  # whole groups on each process (conflicts.grpo)
    code, err = parse(grpo, ["--model", "mine", "--dataset", "d.jsonl", "--per_device_train_batch_size", "4"], capsys)
    assert code == 2 and "are not whole groups of --group_size 8: a group stays on one process here" in err, err
    code, err = parse(sft, ["--per_device_train_batch_size", "4", "--batch_size", "8"], capsys)
    assert code == 2 and "sets --batch_size here, which the command gives too: pass one" in err, err


def test_trls_warmup_ratio_is_ceil_of_its_share_of_the_optimizer_steps(capsys):
    """TRL 1.16 reads `--warmup_steps 0.1` as a ratio of the run's optimizer steps, rounded up
    (transformers' get_warmup_steps), and older TRL's `--warmup_ratio` the same: here the steps they
    give, on grpo.py counting each rollout's --num_iterations x --num_mini_batches updates. Refused
    (an int expected; a flag meaning something else) on the old tree."""
    assert parse(sft, ["--warmup_steps", "0.1", "--steps", "95"]).warmup_steps == 10  # ceil(9.5)
    assert parse(dpo, ["--warmup_ratio", "0.05"]).warmup_steps == math.ceil(0.05 * dpo.Config().steps)
    assert "--warmup_steps 0.05 (TRL's ratio of the run's 250 optimizer steps): --warmup_steps 13" in \
        capsys.readouterr().out
    cfg = parse(grpo, ["--model", "mine", "--dataset", "d.jsonl", "--warmup_steps=0.1", "--steps", "10",
                       "--num_mini_batches", "4"])
    assert cfg.warmup_steps == 4 and cli.optimizer_steps(cli.with_defaults(cfg)) == 40
    assert parse(sft, ["--warmup_steps", "3"]).warmup_steps == 3
    for argv, says in ((["--warmup_ratio", "0.1", "--warmup_steps", "3"], "pass one or the other"),
                       (["--warmup_ratio", "1.5"], "give a ratio in [0, 1)"),
                       (["--warmup_steps", "0.1", "--num_train_epochs", "2"], "give --warmup_steps in steps")):
        code, err = parse(sft, argv, capsys)
        assert code == 2 and says in err, (argv, err)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_trl_name_here_is_trl_1_16s_or_said_to_be_older(script):
    """Every TRL name the table and SAME_NAME give for a script is a field of TRL 1.16.0's config
    class for it (or its ModelConfig, ScriptArguments, GRPO's script arguments), and every one that is
    not is in OLDER, which --help and the docs' table call older TRL's (max_prompt_length,
    warmup_ratio, torch_dtype...); read from the installed TRL."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (CI has none)")
    if trl.__version__ != trl_defaults.TRL_VERSION:
        pytest.skip(f"TRL {trl.__version__} is installed; the table is {trl_defaults.TRL_VERSION}'s")
    from trl.scripts.grpo import GRPOScriptArguments

    classes = [getattr(trl, trl_defaults.CONFIG_OF[script]), trl.ModelConfig, trl.ScriptArguments]
    fields = {f.name for c in classes + [GRPOScriptArguments] * (script == "grpo") for f in dataclasses.fields(c)}
    names = {trl_name for trl_name, scripts, _, _ in trl_flags.TRL_FLAGS if script in scripts}
    names |= {n for n, scripts in trl_flags.SAME_NAME if script in scripts}
    older = {n for n, scripts in trl_flags.OLDER.items() if script in scripts}
    assert names - older <= fields, names - older - fields
    assert not older & fields, older & fields
    assert "max_prompt_length, older TRL's" in trl_flags.help_note(script, "max_prompt_len")


def test_trls_max_length_splits_as_the_defaults_do_or_around_the_length_given(capsys):
    """--max_length N (TRL's prompt + completion) gives --max_prompt_len + --max_response_len = N,
    split in the proportion of the lengths the run would take (512 : 512 for a model of your own,
    the embedded task's 64 : 32), or around the one given; refused with both given, or none left."""
    mine = ["--model", "mine", "--dataset", "d.jsonl"]
    cases = [(mine, "1000", (500, 500)), (["--model", "tiny", "--dataset", "d.jsonl"], "90", (60, 30)),
             ([*mine, "--max_prompt_length", "100"], "1000", (100, 900)), ([*mine, "--max_response_len", "24"], "64", (40, 24))]
    for script in ("sft", "reward", "dpo"):
        for argv, n, want in cases:
            cfg = parse(SCRIPTS[script], [*argv, "--max_length", n])
            assert (cfg.max_prompt_len, cfg.max_response_len) == want, (script, argv)
    assert "--max_length 64 (TRL's, prompt + completion): --max_prompt_len 40 (cut from the left) + --max_response_len " \
           "24" in capsys.readouterr().out
    code, err = parse(dpo, ["--max_length", "64", "--max_prompt_len", "8", "--max_response_len", "8"], capsys)
    assert code == 2 and "sets --max_prompt_len and --max_response_len here, which the command gives too" in err
    code, err = parse(dpo, ["--max_length", "64", "--max_prompt_len", "64"], capsys)
    assert code == 2 and "leaves no tokens for the completion" in err


def test_trls_num_train_epochs_sets_the_steps_once_the_rows_are_known(capsys):
    """--num_train_epochs E: --steps = ceil(E x the whole batches of one pass), the default warmup
    cut to fit the new length and a warmup given that does not fit refused, as at the start; with
    --steps too it is refused (TRL's max_steps would silently win)."""
    cfg = cli.with_defaults(parse(sft, ["--num_train_epochs", "2.5", "--batch_size", "8"]))
    cli.steps_from_epochs(cfg, 43)  # 5 whole batches a pass, 3 rows sit each one out
    out = capsys.readouterr().out
    assert cfg.steps == 13 and cfg.warmup_steps == 1 and "--steps 13" in out and "3 rows sit each pass out" in out
    cfg = cli.with_defaults(parse(grpo, ["--num_train_epochs", "1", "--prompts_per_step", "4"]))
    cli.steps_from_epochs(cfg, 10)
    assert cfg.steps == 2 and "2 prompts sit each pass out" in capsys.readouterr().out
    cfg = cli.with_defaults(parse(dpo, ["--num_train_epochs", "1", "--batch_size", "8", "--warmup_steps", "9"]))
    with pytest.raises(ValueError, match="--warmup_steps 9 is not shorter than the run"):
        cli.steps_from_epochs(cfg, 40)
    cfg = parse(sft, [])
    cli.steps_from_epochs(cfg, 43)
    assert cfg.steps == 700  # without the flag: --steps decides
    code, err = parse(sft, ["--num_train_epochs", "1", "--max_steps", "5"], capsys)
    assert code == 2 and "--num_train_epochs sets --steps once the rows are loaded" in err


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_sets_its_steps_from_epochs_once_its_rows_are_loaded(script):
    """The call site: main() calls cli.steps_from_epochs(cfg, len(train)) after the data order is
    drawn (the rows known) and before the run opens (which records the flags)."""
    import ast

    with open(os.path.join(ROOT, f"{script}.py")) as f:
        main = next(n for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [ast.unparse(n.func) for n in ast.walk(main) if isinstance(n, ast.Call)]
    lines = {ast.unparse(n.func): n.lineno for n in ast.walk(main) if isinstance(n, ast.Call)}
    assert "cli.steps_from_epochs" in calls
    hook = next(n for n in ast.walk(main) if isinstance(n, ast.Call) and ast.unparse(n.func) == "cli.steps_from_epochs")
    assert ast.unparse(hook) == "cli.steps_from_epochs(cfg, len(train))"
    assert lines["data.DataOrder"] < hook.lineno < lines["rundir.Run"]


def test_trls_reward_funcs_are_reward_fns_own(capsys):
    """TRL's --reward_funcs (a list): a rule or `file.py:fn` as it is, TRL's dotted path as
    module:function, TRL's own functions by name from TRL with a note; unknown on the old tree."""
    cfg = parse(grpo, ["--reward_funcs", "my_lib.rewards.fn", "examples/rewards.py:brevity", "think_format_reward",
                       "math"])
    assert cfg.reward_fn == "my_lib.rewards:fn,examples/rewards.py:brevity,trl.rewards:think_format_reward,math"
    assert "--reward_funcs think_format_reward is TRL's own function, called from TRL" in capsys.readouterr().out
    assert parse(grpo, ["--reward_funcs=math"]).reward_fn == "math"
    code, err = parse(grpo, ["--reward_funcs", "get_soft_overlong_punishment"], capsys)
    assert code == 2 and "--overlong_buffer_len 256 --overlong_penalty_factor 1" in err
    code, err = parse(grpo, ["--reward_funcs", "math", "--reward_fn", "math"], capsys)
    assert code == 2 and "pass one" in err


# -----------------------------------------------------------------------------
# dpo.py's TRL loss names, the TRL flags left, did-you-mean, --log_completions alone


@pytest.mark.parametrize("name", ["exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "discopop",
                                  "apo_down", "sft"])
def test_a_trl_dpo_loss_not_here_is_refused_naming_it(name, capsys):
    """Each of TRL 1.16's DPO loss types without an equal here gets its note (what it is, what is
    here), not argparse's `invalid choice`; TRL's own names of ours pass as they are."""
    code, err = parse(dpo, ["--loss_type", name], capsys)
    assert code == 2 and f"--loss_type {name} is TRL's, with no equal here: " in err and "invalid choice" not in err
    for ours in ("sigmoid", "sigmoid_norm", "ipo", "hinge", "robust", "apo_zero"):
        assert parse(dpo, ["--loss_type", ours]).loss_type == ours


def test_trls_list_of_dpo_losses_with_sft_is_rpo(capsys):
    """TRL's `--loss_type sigmoid sft` (RPO) is --loss_type sigmoid --rpo_alpha W (W the sft weight
    of --loss_weights, 1 without), with a note; a weighted sum with no equal here is refused."""
    cfg = parse(dpo, ["--loss_type", "sigmoid", "sft"])
    assert (cfg.loss_type, cfg.rpo_alpha) == ("sigmoid", 1.0)
    assert "--loss_type sigmoid sft (TRL's) is --loss_type sigmoid --rpo_alpha 1 here" in capsys.readouterr().out
    cfg = parse(dpo, ["--loss_weights", "1", "0.25", "--loss_type", "ipo", "sft", "--steps", "3"])
    assert (cfg.loss_type, cfg.rpo_alpha, cfg.steps) == ("ipo", 0.25, 3)
    for argv in (["--loss_type", "sigmoid", "sft", "--loss_weights", "2", "1"], ["--loss_type", "sigmoid", "ipo"],
                 ["--loss_type", "sigmoid", "sft", "--loss_weights", "1"]):
        code, err = parse(dpo, argv, capsys)
        assert code == 2 and "--loss_type sigmoid" in err, argv


def test_rpo_alpha_is_trls_sft_term_where_chosen_responses_have_one_length():
    """TRL's [sigmoid, sft] with weights [1, w] is the sigmoid loss plus w x the chosen tokens'
    mean NLL over the micro-batch; --rpo_alpha w adds each pair's per-token NLL, averaged over
    pairs: equal where every chosen response has the same length, apart otherwise (the note)."""
    torch.manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, dtype=torch.float64) * 5 - 20 for _ in range(4))
    base, _ = dpo.dpo_loss(pc, pr, rc, rr, n_pairs=6, beta=0.1, lengths=(torch.full((6,), 7.0),) * 2)
    for lengths, equal in ((torch.full((6,), 7.0), True), (torch.tensor([3.0, 9, 4, 12, 5, 6]), False)):
        rpo, _ = dpo.dpo_loss(pc, pr, rc, rr, n_pairs=6, beta=0.1, rpo_alpha=0.5, lengths=(lengths, lengths))
        trl = base + 0.5 * (-pc.sum() / lengths.sum())  # TRL: -chosen token log-probs' mean over the micro-batch
        assert bool(torch.isclose(rpo, trl, rtol=1e-12, atol=0)) is equal, lengths


@pytest.mark.parametrize("script, argv, ok, says", [
    ("grpo", ["--vllm_mode", "colocate"], True, "there is no vLLM server or colocated vLLM here"),
    ("sft", ["--torch_dtype", "bfloat16"], True, "older TRL's name of --dtype"),
    ("dpo", ["--dtype", "float32"], True, "precision is chosen here"),
    ("grpo", ["--sync_ref_model", "true"], False, "--ref_refresh_every N copies the policy into the reference"),
    ("dpo", ["--sync_ref_model"], False, "the reference here stays the starting policy"),
    ("dpo", ["--sync_ref_model", "false"], True, "the reference here stays the starting policy"),
    ("reward", ["--disable_dropout", "true"], True, "dropout is always off here"),
    ("grpo", ["--disable_dropout", "false"], False, "dropout is always off here"),
    ("dpo", ["--ref_adapter_name", "ref"], False, "adapters are not chosen by name"),
    ("dpo", ["--model_adapter_name", "policy"], False, "adapters are not chosen by name"),
    ("grpo", ["--shuffle_dataset", "false"], False, "an order seeded by --seed"),
    ("sft", ["--shuffle_dataset", "false"], True, "TRL's SFT batches are drawn in a random order either way"),
])
def test_trls_flags_left_get_their_note_not_a_guess(script, argv, ok, says, capsys):
    """TRL's flags without a counterpart here run with their note or are refused with it; none is
    answered with an unrelated flag (today --vllm_mode got --rs_mode, --torch_dtype --loss_type)."""
    got = parse(SCRIPTS[script], argv, capsys)
    out = capsys.readouterr().out if ok else got[1]
    assert (not isinstance(got, tuple)) is ok and says in out and "did you mean" not in out, (got, out)


def test_did_you_mean_offers_only_near_misspellings():
    """Within 2 edits (1 for a name of up to 5 letters), closest first; the edit distance itself on
    hand cases (a swap of neighbours is one edit)."""
    assert [trl_flags.edit_distance(a, b) for a, b in [("kitten", "sitting"), ("ab", "ba"), ("", "abc"),
                                                       ("vllm_mode", "rs_mode"), ("lr", "lr")]] == [3, 1, 3, 4, 0]
    table, flags = trl_flags.rows("grpo"), {f.name for f in dataclasses.fields(grpo.Config)}
    assert trl_flags.did_you_mean("torch_dtype", flags, table) == ""
    assert trl_flags.did_you_mean("sync_ref_modl", flags, table) == ""  # a TRL name: its own row answers it
    assert trl_flags.did_you_mean("lerning_rate", flags, table) == "; did you mean --lr (TRL: --learning_rate)?"
    assert trl_flags.did_you_mean("betta", flags, table) == "; did you mean --beta?"


def test_log_completions_alone_is_trls_true(capsys):
    """TRL's `--log_completions` (a bool, bare) logs completions: 8 a step here; refused as
    `expected one argument` on the old tree. A number and TRL's false keep their meaning."""
    assert parse(grpo, ["--log_completions"]).log_completions == 8
    assert parse(grpo, ["--log_completions", "--steps", "3"]).log_completions == 8
    assert parse(grpo, ["--log_completions", "3"]).log_completions == 3
    assert parse(grpo, ["--log_completions", "false"]).log_completions == 0


def test_a_run_on_trls_batch_length_epochs_and_schedule_flags_takes_the_values_they_gave(tmp_path):
    """sft.py with TRL's flags: --per_device_train_batch_size 4 x --gradient_accumulation_steps 2 is
    --batch_size 8; --max_length 48 is 32 + 16 (the embedded task's 64 : 32); --num_train_epochs 2 is
    2 passes of 38 // 8 = 4 whole batches (38 rows after the 5% held out): 8 steps; --lr_scheduler_type
    linear decays to 0 by the hand formula. Refused, or unknown, on the old tree."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"sort {i % 10} {i // 10} =", "completion": " 1 2"}
                                                 for i in range(40)])
    out = tmp_path / "run"
    r = run_here(["sft.py", "--model", "tiny", "--dataset", rows, "--per_device_train_batch_size", "4",
                  "--gradient_accumulation_steps", "2", "--max_length", "48", "--num_train_epochs", "2",
                  "--lr_scheduler_type", "linear", "--warmup_steps", "0", "--learning_rate", "1e-3",
                  "--eval_every", "100", "--n_eval", "4", "--output_dir", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(out / "run_config.json") as f:
        config = json.load(f)
    n_train = sum(1 for line in open(rows) if not sft.data.held_out(json.loads(line)["prompt"]))
    steps = 2 * (n_train // 8)
    assert (config["batch_size"], config["grad_accum"], config["max_prompt_len"], config["max_response_len"],
            config["steps"], config["lr_scheduler_type"]) == (8, 2, 32, 16, steps, "linear")
    lrs = [m["lr"] for m in read_metrics(out) if m["step"] > 0]
    assert lrs == pytest.approx([1e-3 * (steps - s) / steps for s in range(steps)], abs=1e-15)
    assert f"--steps {steps}" in r.stdout and "--batch_size 8" in r.stdout
