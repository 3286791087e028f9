"""TRL's flag names on every script (plumbing/trl_flags.py): an alias parses to the Config its
own name does, a TRL flag that means something else here is refused with what to pass, an
unknown flag gets a "did you mean", --help and docs/usage.md show the same table the parser reads."""
import dataclasses
import json
import os
import typing

import pytest

import dpo
import grpo
import reward
import sft
from helpers import ROOT, chat_rows, run_here, write_jsonl
from plumbing import cli, trl_flags

SCRIPTS = {"sft": sft, "reward": reward, "dpo": dpo, "grpo": grpo}


def other_value(cls, flag):
    """A value for --flag, as text, that is not its default (a bool: not handled here)."""
    tp, default = typing.get_type_hints(cls)[flag], getattr(cls(), flag)
    tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if type(None) in typing.get_args(tp) else tp
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
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
        if trl == "report_to":
            cases = [(["--report_to", "wandb"], ["--wandb"]), (["--report_to=WANDB"], ["--wandb"])]
            assert parse(module, ["--wandb", "--report_to", "none"]) == module.Config()
        elif ours in bools:
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
    ("reward", ["--warmup_ratio", "0.1"], "pass --warmup_steps = ceil(ratio x --steps)"),
    ("grpo", ["--epsilon", "0.1"], "pass --epsilon_low X --epsilon_high X"),
    ("sft", ["--report_to", "tensorboard"], "sft.py: --report_to tensorboard: only wandb here (--wandb), or none"),
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
