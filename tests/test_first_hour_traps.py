"""What stopped a new user in their first hour, each refused before anything is written or
answered with what to do: a warmup the run never gets past, --wandb without wandb (and a start
that fails after out_dir was made), `python -m plumbing export --help` and the export of a
finished run, and the --help texts of --model and --dataset."""
import os
import sys

import pytest

from helpers import chat_rows, read_metrics, run_here, write_jsonl
from plumbing import cli
from test_edge_cases import run_cli


@pytest.mark.parametrize("script, argv, total", [
    ("sft.py", ["--steps", "3", "--warmup_steps", "3"], "--steps 3 optimizer steps"),
    ("grpo.py", ["--steps", "1", "--warmup_steps", "4", "--num_iterations", "2", "--num_mini_batches", "2"],
     "--steps 1 x --num_iterations 2 x --num_mini_batches 2 = 4"),
])
def test_a_warmup_the_run_never_gets_past_is_refused_before_anything_is_written(tmp_path, user_models, script, argv,
                                                                               total):
    """`--warmup_steps 3 --steps 3` trained every step below --lr (the first at lr 0) without a
    word. Refused at the start, naming both flags and the numbers (GRPO: its optimizer steps,
    steps x num_iterations x num_mini_batches), and out_dir is never made. One step fewer of
    warmup runs, and its last step is at the peak: the schedule's own lr, read from the log."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(16, "sft" if script == "sft.py" else "prompt"))
    out = tmp_path / "run"
    small = {"sft.py": ["--batch_size", "4", "--n_eval", "2"],
             "grpo.py": ["--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4", "--n_eval", "2"]}[script]
    base = [script, "--model", user_models["llama"], "--dataset", data, "--lr", "1e-3", "--out_dir", str(out), *small]
    r = run_here([*base, *argv])
    assert r.returncode == 1 and f"--warmup_steps {argv[3]} is not shorter than the run ({total}" in r.stderr, \
        r.stderr[-2000:]
    assert "never reach --lr 0.001" in r.stderr and not out.exists()
    fits = int(argv[3]) - 1
    r = run_here([*base, *argv[:3], str(fits), *argv[4:]])
    assert r.returncode == 0, r.stderr[-2000:]
    lrs = [row["lr"] for row in read_metrics(out) if "lr" in row]
    assert lrs[-1] == pytest.approx(1e-3)  # the peak, reached at the last optimizer step (GRPO logs it)


def test_a_default_warmup_longer_than_the_run_is_cut_with_a_line():
    """sft.py's default warmup (50 steps, for its 700) on a 4-step run kept the lr below 6% of
    --lr to the end; left at its default it is cut to a tenth of the run, and the banner says so.
    A value given is kept (and refused if too long: above)."""
    import sft

    cfg = sft.Config(steps=4)
    line = cli.fill_defaults(cfg)
    assert cfg.warmup_steps == 0 and "--warmup_steps 50, the default, is not shorter than the run's 4" in line
    cfg = sft.Config(steps=200)
    assert cli.fill_defaults(cfg) == "" or "warmup" not in cli.fill_defaults(cfg)
    assert cfg.warmup_steps == 50


def test_wandb_without_wandb_is_refused_at_the_start_with_the_pip_line(tmp_path, user_models):
    """`--wandb` without the package failed at `import wandb` after the model loaded and the run
    folder was written. Refused before the model loads, naming the pip line; out_dir not made."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    r = run_here(["sft.py", "--model", user_models["llama"], "--dataset", write_jsonl(tmp_path / "d.jsonl", chat_rows(16, "sft")),
                  "--steps", "1", "--batch_size", "4", "--wandb", "--out_dir", str(out)])
    assert r.returncode == 1 and "--wandb needs the package wandb, which is not installed: pip install wandb" in r.stderr
    assert "Loading" not in r.stdout and "parameters" not in r.stdout and not out.exists()


def test_a_start_that_fails_after_out_dir_was_written_leaves_it_as_a_retry_accepts(tmp_path, user_models, monkeypatch):
    """wandb installed but not logged in: `wandb.init` raises after the run folder got its
    run_config.json and metrics.jsonl, and the same command without --wandb was refused for a
    folder that "is not empty". A fresh run that fails before its first logged row takes back
    what it wrote (a real module named wandb whose init raises, as wandb's does offline)."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "wandb.py").write_text("def init(**kw):\n    raise RuntimeError('api_key not configured (no-tty)')\n")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    out = tmp_path / "run"
    argv = ["sft.py", "--model", user_models["llama"], "--dataset", write_jsonl(tmp_path / "d.jsonl", chat_rows(16, "sft")),
            "--steps", "1", "--batch_size", "4", "--n_eval", "2", "--out_dir", str(out)]
    r = run_here([*argv, "--wandb"])
    assert r.returncode == 1 and "api_key not configured" in r.stderr, r.stderr[-2000:]
    assert not out.exists()
    r = run_here(argv)
    assert r.returncode == 0, r.stderr[-2000:]


def test_export_help_prints_usage_and_a_finished_run_says_where_its_model_is(tmp_path):
    """`python -m plumbing export --help` answered "--help holds no resumable checkpoint"; export of a
    finished run said it "holds no checkpoint". --help prints the usage; a finished run's export
    is refused naming its checkpoint folder, a Hugging Face folder already."""
    r = run_cli(["export", "--help"])
    assert r.returncode == 0 and "usage: python -m plumbing export [-h] OUT_DIR [DEST]" in r.stdout, r.stderr
    out = tmp_path / "run"
    assert run_here(["sft.py", "--model", "tiny", "--steps", "1", "--n_train", "64", "--n_eval", "4", "--batch_size", "4",
                     "--out_dir", str(out)]).returncode == 0
    r = run_cli(["export", out])
    assert r.returncode == 1 and f"its checkpoint {out / 'checkpoint'} is already a Hugging Face folder" in r.stderr, \
        r.stderr[-2000:]
    assert "nothing to export" in r.stderr and "Traceback" not in r.stderr
    assert not any(n.startswith("export-step") for n in os.listdir(out))


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py", "grpo.py"])
def test_help_names_every_kind_of_model_and_sfts_data_formats(script):
    """--model's help named neither `smollm2` nor GGUF files, which models.py loads; sft's --dataset
    help never said `messages`."""
    r = run_here([script, "--help"])
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    model = flat.split("--model STR ")[1].split(" --")[0]
    assert all(w in model for w in ("tiny", "smollm2", ".gguf", "hub id", "checkpoint")), model
    if script == "sft.py":
        dataset = flat.split("--dataset STR ")[1].split(" --")[0]
        assert all(w in dataset for w in ("prompt", "completion", "messages", ".jsonl")), dataset
