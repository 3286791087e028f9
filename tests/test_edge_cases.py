"""What a careless user does, and what a run on many GPUs meets: each case either works or stops
with a message that names the flag, file or row, and nothing is written first, lost, or run from
a checkpoint folder. Each test failed before its fix (the report's case is in its docstring)."""
import dataclasses
import importlib
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import typing

import pytest
import torch

import common
import data
import environment
import grpo
import reward_fns
import tasks
from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, chat, checkpoint_weights, read_metrics,
                     run_here, wait_until, write_jsonl)
from test_robustness import FAST, _files, run_fast
from plumbing import checkpoints, cli, rundir

# -----------------------------------------------------------------------------
# checkpoints: never named good with NaN weights; safe to read; a full disk said so


def _nan_at_update(monkeypatch, n):
    """The n-th optimizer step writes NaN into a weight: the loss of that step, computed before
    the update, is still finite."""
    step, calls = common.optimizer_step, []

    def poisoned(model, *a, **kw):
        out = step(model, *a, **kw)
        calls.append(1)
        if len(calls) == n:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(common, "optimizer_step", poisoned)


_STOPPED = {}  # the interrupted run's exit code and output, for the test of its signal


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """An sft.py run of 3 steps ended at step 3 by a SIGHUP (its terminal closed), in this process:
    its folder holds the resumable step-2 checkpoint (--save_every 2). Tests copy it (`resumable`)."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    step, calls = common.optimizer_step, []

    def hang_up_at_step_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            if signal.getsignal(signal.SIGHUP) in (signal.SIG_DFL, signal.SIG_IGN):  # it would end pytest itself
                raise AssertionError("the run installed no SIGHUP handler")
            os.kill(os.getpid(), signal.SIGHUP)
        return step(*a, **kw)

    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (a suite run under nohup ignores it)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(common, "optimizer_step", hang_up_at_step_3)
            _STOPPED["sighup"] = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out)])
    finally:
        signal.signal(signal.SIGHUP, old)
    assert (out / "checkpoint" / "sharded" / ".metadata").exists(), _STOPPED["sighup"].stderr[-2000:]
    return out


def resumable(interrupted, tmp_path):
    """A copy of the interrupted run's folder (its checkpoint at step 2 of 3) to resume."""
    import shutil

    return shutil.copytree(interrupted, tmp_path / "run")


def test_a_checkpoint_with_nan_weights_is_never_written_nor_named_good(tmp_path, monkeypatch):
    """`sft.py --lr inf --warmup_steps 0 --save_every 1 --steps 3` named as the last good checkpoint
    one whose every weight was NaN: the finiteness check read the loss of the step before the
    update, and the checkpoint was written after it. Now the weights are checked before any save:
    with NaN after step 2, the step-1 checkpoint stays, finite, and the error names it. (inf is
    refused as a flag; 1e30 gives weights of 1e30 and NaN outputs, refused likewise.)"""
    out = tmp_path / "run"
    _nan_at_update(monkeypatch, 2)
    r = run_fast("sft.py", ["--steps", "4", "--save_every", "1", "--out_dir", str(out)])
    assert r.returncode != 0 and "step 2: the weights hold NaN or inf" in r.stderr, r.stderr[-2000:]
    assert f"Last good checkpoint: {out / 'checkpoint'}" in r.stderr
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    assert all(torch.isfinite(w).all() for w in checkpoint_weights(out).values())
    r = run_fast("sft.py", ["--lr", "1e30", "--warmup_steps", "0", "--save_every", "1", "--steps", "3", "--out_dir",
                            str(tmp_path / "big")])
    assert r.returncode != 0 and "Last good checkpoint: none written yet" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "big" / "checkpoint").exists()


class _Payload:
    """A pickle that creates a file when unpickled: what a crafted checkpoint could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_folder_runs_no_code_on_resume(interrupted, tmp_path):
    """torch.distributed.checkpoint reads sharded/.metadata with pickle.load: a .metadata whose
    __reduce__ runs code ran it on --resume, before failing. Now it is read with an unpickler that
    knows only the classes of checkpoint metadata: nothing runs, and the message names the file.
    The non-tensor values of the shards (read by torch.load(weights_only=False) in torch's
    planner) are read with weights_only=True first: the same payload there is refused too."""
    out = resumable(interrupted, tmp_path)
    metadata, marker = out / "checkpoint" / "sharded" / ".metadata", tmp_path / "ran"
    real = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Payload(str(marker))))
    r = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert r.returncode != 0 and f"{metadata} is not a checkpoint's metadata" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()
    metadata.write_bytes(real)
    import io

    planner = checkpoints._safe_load_planner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, io.BytesIO(pickle.dumps(_Payload(str(marker)))))
    assert not marker.exists()
    assert run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"]).returncode == 0


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


@pytest.mark.parametrize("python", ["3.11.2", "3.11.7"])
def test_the_metadata_guard_reads_real_metadata_pickled_by_each_python(tmp_path, python):
    """On Debian 12's /usr/bin/python3 (3.11.2) no run could resume: that Python pickles DCP's
    _MEM_FORMAT_ENCODING enum member as builtins.getattr(_MEM_FORMAT_ENCODING, name), which the
    guard refused ("builtins.getattr is not part of a checkpoint's metadata"). The .metadata of
    a model's and its optimizer's state, as each Python pickled it (tests/fixtures/
    make_dcp_metadata.py), is read by the guard into what a plain pickle.load reads."""
    (tmp_path / ".metadata").write_bytes(open(os.path.join(FIXTURES, f"dcp_metadata-{python}.pickle"), "rb").read())
    with open(tmp_path / ".metadata", "rb") as f:
        uses_getattr = b"getattr" in f.read()
        f.seek(0)
        expected = pickle.load(f)  # our own fixture: safe to read unguarded
    assert uses_getattr == (python == "3.11.2")
    read = checkpoints._check_metadata(str(tmp_path))
    assert read.state_dict_metadata == expected.state_dict_metadata and read.storage_data == expected.storage_data
    formats = {m.properties.memory_format for m in read.state_dict_metadata.values() if hasattr(m, "properties")}
    assert formats == {torch.contiguous_format}, formats  # the enum member, mapped back by TensorProperties


def _getattr_chain(marker):
    """A pickle of builtins.getattr calls alone (beside an allowed function) that reaches the os
    module and makes the folder `marker`: getattr(_get_layout, "__globals__").get("os").mkdir."""
    def getattr_(obj, name):
        return b"cbuiltins\ngetattr\n(" + obj + b"V" + name + b"\ntR"

    os_module = getattr_(getattr_(b"ctorch.serialization\n_get_layout\n", b"__globals__"), b"get") + b"(Vos\ntR"
    return getattr_(os_module, b"mkdir") + b"(V" + marker.encode() + b"\ntR."


@pytest.mark.parametrize("case", ["getattr_to_os", "getattr_not_a_member", "global_outside"])
def test_the_metadata_guard_admits_getattr_for_an_enum_member_alone(tmp_path, case):
    """builtins.getattr is admitted only as Python 3.11.2 uses it, a member of an allowed enum by
    name: a getattr chain that reaches os from an allowed function (it runs under pickle.load,
    seen here), a getattr on the allowed enum for anything but a member, and a global outside the
    allow-list are each refused, naming what, and nothing runs."""
    marker = tmp_path / "ran"
    payload = {
        "getattr_to_os": _getattr_chain(str(marker)),
        "getattr_not_a_member": b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                                b"V__class__\ntR.",
        "global_outside": pickle.dumps(os.system),
    }[case]
    if case == "getattr_to_os":  # the payload is live: an unguarded load runs it
        pickle.loads(payload)
        assert marker.is_dir()
        marker.rmdir()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(ValueError) as e:
        checkpoints._check_metadata(str(folder))
    named = {"getattr_to_os": "builtins.getattr(_get_layout, '__globals__') is not an enum member",
             "getattr_not_a_member": "builtins.getattr(_MEM_FORMAT_ENCODING, '__class__') is not an enum member",
             "global_outside": "posix.system is not part of a checkpoint's metadata"}[case]
    assert str(e.value).startswith(f"{folder / '.metadata'} is not a checkpoint's metadata ({named}"), str(e.value)
    assert str(e.value).endswith("refusing to read it, as it could run code"), str(e.value)
    assert not marker.exists()


def test_a_full_disk_is_named_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    """A disk that filled up during the sharded save ended in `unexpected pos 704 vs 598` (torch's
    zip writer). The message now says that no space is left, what was written where, and that the
    last checkpoint is untouched (here the step-2 one, while step 4's was written); the partial
    checkpoint.tmp is removed (it holds the space that ran out)."""
    import shutil

    out = tmp_path / "run"
    save, usage = torch.save, shutil.disk_usage

    def full(*a, **kw):
        if (out / "checkpoint").exists():  # the disk fills up after the first checkpoint
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(*a, **kw)

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=2**20))
    r = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(out)])
    assert r.returncode != 0 and ("no space left on the device: writing the checkpoint of step 4 failed while writing "
                                  f"the sharded model and optimizer state into {out / 'checkpoint.tmp' / 'sharded'} "
                                  "(CheckpointException") in r.stderr, r.stderr[-2000:]
    assert "1 MiB are free there" in r.stderr
    assert f"The last checkpoint, {out / 'checkpoint'} (step 2), is untouched" in r.stderr
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    assert not (out / "checkpoint.tmp").exists()


def test_a_damaged_trainer_state_is_named(interrupted, tmp_path):
    out = resumable(interrupted, tmp_path)
    (out / "checkpoint" / "trainer_state.json").write_text('{"step": 2, "conf')
    r = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert r.returncode != 0 and "trainer_state.json is damaged" in r.stderr and "Traceback" not in r.stderr[-300:]


# -----------------------------------------------------------------------------
# the run directory


def test_nothing_is_written_before_a_run_can_start(tmp_path):
    """run_config.json was written, and out_dir made, before a bad chat template or a model too
    short for the prompts stopped the run. Now a run that stops before it begins leaves no
    trace: the folder it made goes again."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }")
    for args, message in [(["--chat_template", str(template)], "not a valid Jinja template"),
                          (["--max_prompt_len", "120"], "exceeds the model's context of 128"),
                          (["--seed", str(10**23)], "--seed 100000000000000000000000 is out of range"),
                          (["--out_dir", ""], "--out_dir is empty")]:
        out = tmp_path / "never"
        r = run_fast("sft.py", ["--steps", "1", "--out_dir", str(out), *args])
        assert r.returncode != 0 and message in r.stderr, (args, r.stderr[-2000:])
        assert not out.exists(), args


def test_a_model_inside_out_dir_is_refused(tmp_path):
    """`--model X --out_dir X --overwrite` moved the model away from under the run reading it."""
    out = tmp_path / "run"
    assert run_fast("sft.py", ["--steps", "1", "--out_dir", str(out)]).returncode == 0
    for model in (out, out / "checkpoint"):
        r = run_fast("sft.py", ["--steps", "1", "--model", str(model), "--out_dir", str(out), "--overwrite"])
        assert r.returncode != 0 and f"--model {model} is inside --out_dir {out}" in r.stderr, r.stderr[-2000:]
    assert (out / "checkpoint" / "config.json").exists()


def test_resuming_past_the_last_step_is_refused(interrupted, tmp_path):
    """`--resume --steps 20` on a step-105 checkpoint saved the step-105 weights as the final
    checkpoint and dropped the resumable state without a word."""
    out = resumable(interrupted, tmp_path)
    for steps in ("1", "2"):
        r = run_fast("sft.py", ["--steps", steps, "--save_every", "2", "--out_dir", str(out), "--resume"])
        assert r.returncode != 0 and f"is at step 2, and --steps {steps} ends there or before" in r.stderr, r.stderr[-2000:]
    assert (out / "checkpoint" / "training_state.pt").exists()


def test_an_empty_eval_dataset_means_none(tmp_path):
    """`--eval_dataset ""` trained and evaluated on the same rows; "" now means what None does:
    the file's hash split."""
    rows = [{"prompt": f"sort {i % 10} {i // 10 % 10} 3 =", "completion": " 1"} for i in range(200)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = run_here(["sft.py", *FAST["sft.py"], "--dataset", data, "--eval_dataset", "", "--steps", "1",
                  "--out_dir", str(tmp_path / "o")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "are kept for evaluation, not trained on" in r.stdout


# -----------------------------------------------------------------------------
# data smaller than a batch, on every script and world size


SMALL = {"sft.py": ({"prompt": "sort 3 1 =", "completion": " 1 3"}, ["--batch_size", "8"], "--batch_size 8"),
         "reward.py": ({"prompt": "sort 3 1 =", "chosen": " 1 3", "rejected": " 3"}, ["--batch_size", "8"],
                       "--batch_size 8"),
         "dpo.py": ({"prompt": "sort 3 1 =", "chosen": " 1 3", "rejected": " 3"}, ["--batch_size", "8"],
                    "--batch_size 8"),
         "grpo.py": ({"prompt": "sort 3 1 2 =", "reward_fn": "sort"}, ["--prompts_per_step", "8"], "--prompts_per_step 8")}


@pytest.mark.parametrize("script", SMALL)
def test_a_data_set_smaller_than_a_batch_is_refused(tmp_path, script):
    """dpo.py with 3 pairs and --batch_size 8 trained each step on 3 pairs divided by 8 (loss
    ln2 x 3/8, accuracy 0.1875); reward.py the same; sft.py died on rank 1 of 2 (`max() arg is an
    empty sequence`); grpo.py crashed on a shape. Every script refuses, naming the file and the
    flag, before it loads a model or writes anything."""
    row, flags, flag = SMALL[script]
    data = write_jsonl(tmp_path / "small.jsonl", [row] * 3)
    r = run_fast(script, ["--dataset", data, "--eval_dataset" if script != "grpo.py" else "--n_eval", data if script != "grpo.py" else "4",
                          *flags, "--out_dir", str(tmp_path / "o")])
    assert r.returncode != 0 and f"--dataset {data} has 3 training rows, fewer than one batch ({flag})" in r.stderr, \
        r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_data_set_smaller_than_a_batch_is_refused_on_every_rank(tmp_path):
    """Under torchrun every rank meets it: the message once (each rank printed it under its
    traceback, about 60 lines with torchrun's report), no frame of ours, then torchrun's report."""
    row, flags, flag = SMALL["sft.py"]
    data = write_jsonl(tmp_path / "small.jsonl", [row] * 3)
    r = run_fast("sft.py", ["--dataset", data, "--eval_dataset", data, *flags, "--out_dir", str(tmp_path / "o")], nproc=2)
    assert r.returncode != 0 and r.stderr.count("has 3 training rows, fewer than one batch") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"sft.py: --dataset {data} has 3 training rows") and "data.py" not in r.stderr, r.stderr


# -----------------------------------------------------------------------------
# signals: SIGTERM where Ctrl-C is ignored; the command that resumes


def test_a_background_run_ends_cleanly_on_sigterm(tmp_path):
    """A run started as a background job (`cmd &` in a script, nohup, a scheduler) has SIGINT
    ignored: a Ctrl-C never reaches it, as the shell intends. What it does get, SIGTERM (a
    scheduler's, or torchrun's as it stops), ends it as a Ctrl-C would: one line naming the last
    checkpoint and the command to resume, exit 143, no traceback."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "sft.py", *FAST["sft.py"], "--steps", "500", "--save_every", "2",
                             "--out_dir", str(out)], cwd=ROOT, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_until((out / "checkpoint" / "training_state.pt").exists, proc, "a checkpoint")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    assert f"terminated (SIGTERM). Last checkpoint: {out / 'checkpoint'} (step " in err
    assert "continue with: python sft.py" in err and err.rstrip().endswith("--resume")


def test_the_resume_command_is_the_launchers(monkeypatch):
    """Under torchrun the resume hint said `python ...`."""
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--lr", "1e-6", "--overwrite"])
    assert cli._command() == "python grpo.py --lr 1e-6"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert cli._command() == "torchrun --nproc_per_node 8 grpo.py --lr 1e-6"
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert cli._command() == "torchrun --nnodes 2 --nproc_per_node 8 grpo.py --lr 1e-6"


# -----------------------------------------------------------------------------
# conversational rows read by rule rewards, end to end


def test_rule_rewards_read_the_rows_own_conversation(tmp_path, monkeypatch):
    """`"prompt": [{"role": "user", "content": "sort 4 5 8 ="}], "reward_fn": "sort"` crashed at
    load (a list where the rule expected text). Rules now get the row's own prompt, as TRL passes
    it: the sort rule reads the user's message, the math rule the row's answer (a JSON number
    here). Completions are fixed, every other one right, so the rule reward is exactly 0.5."""
    import tasks

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    rows = [{"prompt": chat(("user", "sort 4 5 8 =")), "reward_fn": "sort", "answer": None},
            {"prompt": chat(("user", "What is 3 + 4?")), "reward_fn": "math", "answer": 7}] * 4
    right = {"sort 4 5 8 =": " 4 5 8", "What is 3 + 4?": " 7"}
    seen = []

    def fixed(tokenizer, r_ids, r_mask, prompt_ids=None):
        texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        seen.extend(texts)
        users = [t.split("user: ")[1].split("\n")[0] for t in texts]
        return [right[u] if k % 2 == 0 else " 0" for k, u in enumerate(users)]

    monkeypatch.setattr(grpo.sampling, "decode_responses", fixed)
    grpo.main(grpo.Config(model="tiny", dataset=write_jsonl(tmp_path / "c.jsonl", rows), chat_template=str(template),
                          out_dir=str(tmp_path / "g"), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4,
                          eval_every=100, n_eval_pairs=4, warmup_steps=0))
    assert seen and all(t.startswith("user: ") for t in seen)  # the sampler saw the rendered template
    assert [r["reward/rule"] for r in read_metrics(tmp_path / "g")] == [0.5, 0.5]
    assert tasks.REWARD_FNS["sort"](rows[0]["prompt"], " 4 5 8") == 1.0


def test_every_models_context_is_checked_before_the_first_step(tmp_path):
    """A reward model whose context is shorter than prompt + response failed at step 1 with an
    IndexError in reward_scores; the policy's context error named --max_response_len, a flag
    grpo.py does not have. Both are refused up front, naming grpo.py's own flags."""
    import tasks
    from transformers import AutoModelForSequenceClassification

    tok = tasks.char_tokenizer()
    rm = AutoModelForSequenceClassification.from_config(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2,
                                                                               n_positions=64, num_labels=1))
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    base = ["grpo.py", "--model", "tiny", "--out_dir", str(tmp_path / "o"), "--steps", "1", "--prompts_per_step", "4"]
    r = run_here(base + ["--reward_model", str(tmp_path / "rm")])
    assert r.returncode != 0 and re.search(r"--max_prompt_len 64 \+ --max_new_tokens \(\+1\) 25 = 89 tokens exceeds "
                                           r"--reward_model .*/rm's context of 64", r.stderr), r.stderr[-2000:]
    r = run_here(base + ["--max_prompt_len", "120", "--max_new_tokens", "24"])  # given: a default is cut to fit instead
    assert r.returncode != 0 and "--max_prompt_len 120 + --max_new_tokens 24 = 144 tokens exceeds" in r.stderr
    assert not (tmp_path / "o").exists()


def test_the_log_is_one_line_per_step_without_transformers_bars_or_reports(tmp_path):
    """Each save printed transformers' "Writing model shards" bar, each load its "Loading weights"
    bar, and reward.py's start its LOAD REPORT of the new score head, all between the step lines.
    A checkpoint saved every step, then loaded with a new score head and saved again: nothing but
    the scripts' own lines (transformers' warnings are caught at its logger, which writes to the
    terminal, not to the captured stderr)."""
    import logging

    reports = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = reports.append
    logging.getLogger("transformers").addHandler(catch)
    try:
        sft = run_fast("sft.py", ["--model", "tiny", "--steps", "2", "--save_every", "1", "--out_dir", str(tmp_path / "sft")])
        rm = run_fast("reward.py", ["--model", str(tmp_path / "sft"), "--steps", "2", "--save_every", "1",
                                    "--out_dir", str(tmp_path / "rm")])
    finally:
        logging.getLogger("transformers").removeHandler(catch)
    assert not [r.getMessage()[:200] for r in reports if "LOAD REPORT" in r.getMessage()]
    for r, out in ((sft, "sft"), (rm, "rm")):
        assert r.returncode == 0, r.stderr[-2000:]
        noise = [line for line in (r.stdout + r.stderr).splitlines()
                 if re.search("Writing model shards|Loading weights|LOAD REPORT|it/s]", line)]
        assert not noise, noise[:3]
        steps = [int(m[1]) for m in re.finditer(r"^step (\d+)/\d+ \|", r.stdout, re.M)]
        assert steps == [row["step"] for row in read_metrics(tmp_path / out)], r.stdout


# -----------------------------------------------------------------------------
# what a careless user still broke: exports over models, checkpoints named good with NaN
# outputs, flags of any size, files that disagree or are damaged, a closed terminal


def run_cli(argv):
    """`python -m plumbing ARGV` (its __main__ module) in this process, as helpers.run_here returns a
    script's run: exit code, stdout, stderr (a traceback, when one ends it, on stderr)."""
    import contextlib
    import io
    import runpy
    import traceback

    out, err, code = io.StringIO(), io.StringIO(), 0
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        m.setattr(sys, "argv", ["plumbing", *map(str, argv)])
        try:
            runpy.run_module("plumbing", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_export_refuses_a_folder_that_holds_a_model_or_a_run(interrupted, tmp_path):
    """`python -m plumbing export RUN some/model` wrote over the model's weights without a word; into a
    finished run's out_dir, its files made `--model out_dir` load the export instead of the run's
    checkpoint. Both are refused, naming the folder and what it holds, and nothing is written."""
    out = resumable(interrupted, tmp_path)  # a run's folder: checkpoint/, metrics.jsonl, run_config.json
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"the user's weights")
    for dest, held in ((model, "config.json, model.safetensors"), (out, "checkpoint, metrics.jsonl, run_config.json")):
        before = _files(dest)
        r = run_cli(["export", out, dest])
        assert r.returncode == 1 and f"{dest} already holds a {'model' if dest == model else 'run'} ({held})" in r.stderr, \
            r.stderr[-2000:]
        assert "Traceback" not in r.stderr and _files(dest) == before


def test_export_refuses_a_folder_of_the_users_tokenizer_files(interrupted, tmp_path):
    """`python -m plumbing export RUN DEST`, DEST holding the user's tokenizer.json,
    tokenizer_config.json and chat_template.jinja (no weights): tokenizer.json was overwritten
    without a word, and the export's tokenizer then loaded the stray chat_template.jinja as its
    own. Refused, naming the folder and its files; nothing in it changes."""
    out = resumable(interrupted, tmp_path)
    dest = tmp_path / "mine"
    dest.mkdir()
    files = {"chat_template.jinja": "{{ 'MY TEMPLATE' }}", "tokenizer.json": "{\"mine\": 1}",
             "tokenizer_config.json": "{}"}
    for name, text in files.items():
        (dest / name).write_text(text)
    r = run_cli(["export", out, dest])
    assert r.returncode == 1 and (f"{dest} already holds files (chat_template.jinja, tokenizer.json, "
                                  f"tokenizer_config.json): an export writes a whole Hugging Face folder") in r.stderr, \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr and {p.name: p.read_text() for p in dest.iterdir()} == files


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    """A CSV whose header is `prompt,completion,completion` trained on the second completion
    column without a word (a row became a dict, the last of equal keys kept). Refused, naming the
    file, the column and where it stands."""
    path = tmp_path / "d.csv"
    path.write_text("prompt,completion,completion\nq,first,second\n")
    with pytest.raises(ValueError) as e:
        data.load_data(str(path), "train", ["prompt", "completion"])
    assert str(e.value) == (f"{path}: the header names column 'completion' more than once (columns 2, 3); give each "
                            f"column its own name")
    path.write_text("prompt,completion,note\nq,first,second\n")  # distinct names read as before
    assert data.load_data(str(path), "train", ["prompt", "completion"]).to_list() == [
        {"prompt": "q", "completion": "first", "note": "second"}]


def test_answers_4_and_text_4_in_one_file_are_one_answer_to_the_math_rule(tmp_path, capsys):
    """Answers 4 and "4" in one file were refused for the `math` rule ("field 'answer' is str,
    while earlier rows hold int"), though the rule reads both. The column is read as text, with a
    note, and each row scores as the rule scores the value as written in the file; a prompt
    column mixing them is still refused, naming the row."""
    answers = [4, "4", 2.5, "#### 7", -3]
    rows = [{"prompt": f"q{i}", "answer": a} for i, a in enumerate(answers)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds, _ = environment.load_prompts(grpo.Config(dataset=path, reward_fn="math"), rules=True)
    read = ds["answer"][:]
    assert read == ["4", "4", "2.5", "#### 7", "-3"]
    assert f"note: {path}: column 'answer' holds both numbers and text; its numbers are read as text" in \
        capsys.readouterr().out
    for completion in ("4", "2.5", "7", "-3", "5"):
        scores = [tasks.math_reward("", completion, a) for a in read]
        assert scores == [tasks.math_reward("", completion, a) for a in answers], completion
    assert [tasks.math_reward("", "4", a) for a in read] == [1.0, 1.0, 0.0, 0.0, 0.0]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "completion": "c"}, {"prompt": 4, "completion": "c"}])
    with pytest.raises(ValueError, match=rf"^{path} row 2: field 'prompt' is int, while earlier rows hold str$"):
        data.load_data(path, "train", ["prompt", "completion"])


def test_the_corrections_mode_and_bounds_without_the_correction_are_refused(tmp_path):
    """`--vllm_importance_sampling_mode token_mask --vllm_importance_sampling_clip_min 0.5` without
    `--vllm_importance_sampling_correction` was saved in run_config.json and ignored: the policy
    term was not weighted. Refused before anything is written, naming each flag set and the one
    missing; with the correction they pass, and so do the defaults without it."""
    from plumbing import conflicts

    out = tmp_path / "run"
    r = run_here(["grpo.py", "--vllm_importance_sampling_mode", "token_mask", "--vllm_importance_sampling_clip_min",
                  "0.5", "--steps", "1", "--out_dir", str(out)])
    assert r.returncode != 0 and ("--vllm_importance_sampling_mode token_mask and --vllm_importance_sampling_clip_min "
                                  "0.5 shape the sampler-trainer correction, which is off: pass "
                                  "--vllm_importance_sampling_correction too, or drop them") in r.stderr, r.stderr[-2000:]
    assert not out.exists()
    cfg = cli.with_defaults(grpo.Config())
    conflicts.grpo(cfg, common.Dist())  # the defaults, correction off
    with pytest.raises(ValueError, match=r"^--vllm_importance_sampling_clip_max none shapes .* or drop it$"):
        conflicts.grpo(dataclasses.replace(cfg, vllm_importance_sampling_clip_max=None), common.Dist())
    conflicts.grpo(dataclasses.replace(cfg, vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=0.5,
                                       vllm_importance_sampling_mode="token_mask"), common.Dist())


def test_the_last_good_checkpoint_gives_finite_outputs(tmp_path):
    """`--lr 1e10`: an update leaves weights near 1e10, every one finite, whose logits are NaN; the
    run saved them and, when the next loss was NaN, named that checkpoint the last good one. A save
    now runs the model on a fixed batch first. Warm-up makes step 1's lr 0: its checkpoint is good;
    step 2's update is refused, and the checkpoint named is step 1's, whose logits are finite."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    r = run_fast("sft.py", ["--lr", "1e10", "--warmup_steps", "2", "--save_every", "1", "--steps", "4",
                            "--out_dir", str(out)])
    assert r.returncode != 0 and "step 2: the model's outputs on a fixed batch are NaN or inf" in r.stderr, r.stderr[-2000:]
    assert f"no checkpoint written. Last good checkpoint: {out / 'checkpoint'}" in r.stderr
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    model = AutoModelForCausalLM.from_pretrained(checkpoints.export(out / "checkpoint", tmp_path / "export"))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits).all()


def test_reward_weights_name_each_reward_once_and_train_something(tmp_path):
    """`--reward_weights rule:1,rule:2` trained with weight 2 without a word; `rule:0` without a
    --teacher trained on advantages that are all 0. Both are refused before anything loads."""
    assert reward_fns.parse_weights("rule:0", False, has_teacher=True) == {"rule": 0.0}  # on-policy distillation alone
    assert reward_fns.parse_weights("rule:0,model:1", True) == {"rule": 0.0, "model": 1.0}
    with pytest.raises(ValueError, match=r"--reward_weights 'rule:0,model:0' gives every reward weight 0 and there is no "
                                         r"--teacher: nothing would be trained"):
        reward_fns.parse_weights("rule:0,model:0", True)
    for spec, message in (("rule:1,rule:2", "--reward_weights 'rule:1,rule:2' names rule twice"),
                          ("rule:0", "--reward_weights 'rule:0' gives every reward weight 0")):
        r = run_here(["grpo.py", "--reward_weights", spec, "--out_dir", str(tmp_path / "o")])
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def _float_fields(config):
    hints = typing.get_type_hints(config)
    return [f.name for f in dataclasses.fields(config) if hints[f.name] in (float, typing.Optional[float])]


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo"])
def test_every_float_flag_is_finite(script):
    """`--teacher_coef inf` was accepted, as was inf for every float flag bounded only below (and
    1e39, finite for Python, inf in the float32 the flags reach the loss in). Every float field of
    every script's Config is walked, so a new flag is covered as it is added; --timeout_minutes,
    whose timedelta overflows, is bounded by a week."""
    config = importlib.import_module(script).Config
    names = _float_fields(config)
    assert "lr" in names and "timeout_minutes" in names
    for name in names:
        for value in (math.inf, -math.inf, math.nan, 1e39):
            with pytest.raises(ValueError, match=rf"--{name} {re.escape(str(value))} is "):
                cli.check_ranges(config(**{name: value}))
    with pytest.raises(ValueError, match=r"--timeout_minutes 1e\+30 is out of range \(0, 10080\]"):
        cli.check_ranges(config(timeout_minutes=1e30))
    cli.check_ranges(config(timeout_minutes=10080.0))


def test_a_non_finite_flag_is_refused_before_anything_is_written(tmp_path):
    r = run_here(["grpo.py", "--teacher_coef", "inf", "--out_dir", str(tmp_path / "o")])
    assert r.returncode != 0 and "--teacher_coef inf is not a finite number" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_trainer_state_that_disagrees_with_the_training_state_is_refused(interrupted, tmp_path):
    """A trainer_state.json at step 1 beside a training_state.pt of step 2 (a file copied from
    another checkpoint) was trusted: metrics.jsonl was cut to step 1, then training went on from
    step 3, and step 2's row was lost. Now --resume refuses, naming both files and their steps,
    before metrics.jsonl is touched."""
    out = resumable(interrupted, tmp_path)
    ckpt = out / "checkpoint"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "step": 1}))
    metrics = (out / "metrics.jsonl").read_bytes()
    r = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert r.returncode != 0 and (f"{ckpt / 'trainer_state.json'} is at step 1 but {ckpt / 'training_state.pt'} at "
                                  f"step 2") in r.stderr, r.stderr[-2000:]
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_a_pickle_in_the_training_state_is_named_and_never_run(interrupted, tmp_path):
    """A training_state.pt holding a pickled object ended in torch's advice to pass
    weights_only=False, naming no file. The file is named, nothing in it runs."""
    out, marker = resumable(interrupted, tmp_path), tmp_path / "ran"
    path = out / "checkpoint" / "training_state.pt"
    torch.save({**torch.load(path, weights_only=True), "scheduler": _Payload(str(marker))}, path)
    r = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert r.returncode != 0 and (f"{path} holds something other than tensors and plain Python values (io.open): "
                                  f"refusing to unpickle it") in r.stderr, r.stderr[-2000:]
    assert "weights_only=False" not in r.stderr and not marker.exists()


def test_out_dir_is_a_folder_of_its_own(tmp_path, monkeypatch):
    """`--out_dir .` in the repository was refused as "not empty" after writing a .lock there, and with
    --overwrite the run loaded its model, then died renaming '.' (Errno 16). Any folder holding files
    no run writes would have been moved aside whole by --overwrite. Both are refused, naming the
    flag, before anything is written."""
    import sft

    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for extra in ({}, {"overwrite": True}):
        try:
            with pytest.raises(ValueError, match=rf"--out_dir \. is the folder this command runs in \({work}\)"):
                sft.main(sft.Config(out_dir=".", steps=1, n_train=64, n_eval=8, **extra))
        finally:
            rundir.release()
    assert sorted(os.listdir(work)) == ["notes.txt"]
    r = run_fast("sft.py", ["--steps", "1", "--out_dir", str(work), "--overwrite"])
    assert r.returncode != 0 and f"--out_dir {work} holds files no run writes (notes.txt)" in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(work)) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["work"]


@pytest.mark.parametrize("damage", ["truncated_shard", "overwritten_shard", "no_metadata"])
def test_a_damaged_sharded_checkpoint_is_named(interrupted, tmp_path, damage):
    """A .distcp cut short (an interrupted copy) ended --resume and `python -m plumbing export` in torch's
    "failed finding central directory", naming no file; a missing .metadata in the refusal meant for
    a crafted pickle ("it could run code"). Each now names the file and says what is wrong; a shard
    of the right length whose last bytes were overwritten names the folder it was read from."""
    out = resumable(interrupted, tmp_path)
    sharded = out / "checkpoint" / "sharded"
    (shard,) = sharded.glob("*.distcp")
    if damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
        message = f"{shard} is cut short ({shard.stat().st_size} bytes"
    elif damage == "overwritten_shard":
        shard.write_bytes(shard.read_bytes()[:-4096] + bytes(4096))
        message = f"reading {sharded} failed (RuntimeError: PytorchStreamReader failed"
    else:
        (sharded / ".metadata").unlink()
        message = f"{sharded} is not a complete checkpoint: it has no .metadata"
    resumed = run_fast("sft.py", ["--steps", "3", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert resumed.returncode != 0 and message in resumed.stderr and "could run code" not in resumed.stderr, \
        resumed.stderr[-2000:]
    if damage != "overwritten_shard":  # its last bytes hold optimizer state, which an export does not read
        exported = run_cli(["export", out, tmp_path / "export"])
        assert exported.returncode == 1 and message in exported.stderr and "Traceback" not in exported.stderr
        assert not (tmp_path / "export").exists()


def test_resume_sees_a_changed_byte_anywhere_in_a_large_data_file(tmp_path, monkeypatch):
    """A data file above 256 MiB was fingerprinted by 64 sampled blocks: --resume accepted it after a
    byte between them changed. Data files are now hashed whole (300 MiB: 0.2 s); the threshold and
    block are made small here, and the byte changed is one no block covers."""
    monkeypatch.setattr(rundir, "SAMPLE_ABOVE", 1024)
    monkeypatch.setattr(rundir, "SAMPLED_BLOCK", 16)
    rows = [{"prompt": f"sort {i % 10} {i // 10 % 10} 3 =", "completion": " 3"} for i in range(200)]
    path = tmp_path / "d.jsonl"
    write_jsonl(path, rows)
    text, size = path.read_bytes(), path.stat().st_size
    sampled = {o + k for i in range(rundir.SAMPLED_BLOCKS) for o in [i * (size - 16) // (rundir.SAMPLED_BLOCKS - 1)]
               for k in range(16)}
    at = next(i + 1 for i in range(len(text)) if text[i:i + 3] == b' 3"' and i + 1 not in sampled)
    out = tmp_path / "run"
    step, calls = common.optimizer_step, []

    def ctrl_c_at_step_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **kw)

    args = ["--dataset", str(path), "--steps", "3", "--save_every", "2", "--out_dir", str(out)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "optimizer_step", ctrl_c_at_step_3)
        assert run_fast("sft.py", args).returncode == 130
    path.write_bytes(text[:at] + b"4" + text[at + 1:])  # one completion " 3" -> " 4": a valid file, other rows
    r = run_fast("sft.py", args + ["--resume"])
    assert r.returncode != 0 and f"--resume: --dataset {path} no longer holds what the run started" in r.stderr, \
        r.stderr[-2000:]


def test_sighup_ends_a_run_like_sigterm(interrupted):
    """A closed terminal (SIGHUP) ended a run at once: no resume line, and the kernel's exit status.
    It now ends as SIGTERM does: one line naming the last checkpoint and the command that resumes
    it, exit 128 + 1. (The run is the `interrupted` fixture's: SIGHUP at step 3.)"""
    r = _STOPPED["sighup"]
    assert r.returncode == 129 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"hung up (SIGHUP). Last checkpoint: {interrupted / 'checkpoint'} (step 2); continue with: python sft.py" \
        in r.stderr and r.stderr.rstrip().endswith("--resume")
