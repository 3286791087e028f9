"""Nothing a reward function does can hang a run or end it without a word (reward_fns.RewardCaller,
each file's functions in a worker process of their own, plumbing/workers.py): functions
(tests/misbehaving_rewards.py) that exit, os._exit, kill their process or raise anything stop
the run naming themselves and the row; ones that never return (sync or async, asleep, signals
ignored) are stopped at --reward_fn_timeout naming their rows; Ctrl-C and SIGTERM while one
never returns end the run with its line and its last checkpoint, and no process left; a thread
it starts does not keep the run alive; signal.alarm works in it, as in TRL's main thread; it
gets objects of its own at every call; under torchrun, the rank whose function ends its process
is named. Nor can it jam the channel to the trainer (writing to descriptors, onto the channel,
part of a message); the functions of a file share its state, as in TRL; a raise shows the
function's own frames; a shadowed module, a weighted sum beyond float32 and a reward timeout
that torchrun's would outrun are named."""
import json
import os
import re
import signal
from dataclasses import replace

import misbehaving_rewards
import pytest
import torch
from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV, injected_clock, read_metrics, run_here, run_script,
                     start_as_a_terminal_does, wait_until, write_jsonl)
from test_tool_safety import gone, marked, our_processes

import common
import data
import grpo
import reward_fns
import tasks
from plumbing import checkpoints, cli, conflicts, workers

PROMPTS, COMPLETIONS, IDS, ROWS = ["p1", "p2", "p3"], ["a", "bb", "ccc"], [[1], [2], [3]], [4, 9, 11]


def caller(name, *timeout_s):
    """The RewardCaller of misbehaving_rewards:NAME (timeout_s: its time limit, else the default)."""
    return reward_fns.RewardCaller(reward_fns.load_reward_fns(f"misbehaving_rewards:{name}"), *timeout_s)


def call(c, behaviour):
    """c on three rows (data set rows 4, 9, 11 of d.jsonl), each doing what `behaviour` names."""
    return c(PROMPTS, COMPLETIONS, IDS, {"behaviour": behaviour}, rows=ROWS, source="d.jsonl")


def test_a_function_that_exits_kills_its_process_or_raises_anything_stops_the_run_naming_it_and_the_row(
        tmp_path, monkeypatch):
    """Row 9's call exits, ends or kills its process, raises SystemExit, KeyboardInterrupt or
    BaseException: each is a ValueError naming the function, what it did and the row (found by
    calling it again row by row), the worker that ended is gone, and the function answers the next
    batch from a fresh worker. Before: SystemExit and KeyboardInterrupt came out of the call as
    the run's own (exit status 0 with no word; "interrupted", as a Ctrl-C), and os._exit ended the
    trainer."""
    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))
    cases = {"sys_exit": "raised on d.jsonl row 9: SystemExit: 0",
             "system_exit_3": "raised on d.jsonl row 9: SystemExit: 3",
             "keyboard_interrupt": "raised on d.jsonl row 9: KeyboardInterrupt",
             "base_exception": "raised on d.jsonl row 9: BaseException: a reward's own",
             "os_exit": "ended its worker process (exit status 0) on d.jsonl row 9",
             "kill_its_process": "ended its worker process (killed by SIGKILL) on d.jsonl row 9"}
    c = caller("misbehaves")
    for behaviour, what in cases.items():
        with pytest.raises(ValueError) as e:
            call(c, ["ok", behaviour, "ok"])
        assert str(e.value) == f"--reward_fn misbehaves {what}"
    assert all(gone(pid) for name in ("os_exit", "kill_its_process") for pid in marked(tmp_path, name))
    assert len(marked(tmp_path, "os_exit")) == 2  # the batch's call and row 9's alone, each in a worker of its own
    assert call(c, ["ok"] * 3) == {"misbehaves": [1.0, 2.0, 3.0]}


def test_a_function_that_never_returns_is_stopped_at_its_time_limit_naming_it_and_its_rows(tmp_path, monkeypatch):
    """A call that blocks, sleeps, ignores SIGTERM and SIGINT, or awaits forever (`async def`) is
    a ValueError at the time limit naming the function, the flag and the call's rows; its worker
    is killed (SIGKILL after the grace when SIGTERM is ignored), and the function answers again
    from a fresh one. Before: no limit; the heartbeat printed "running" for ever. The limit is read
    on an injected clock that moves once the function has marked that it blocks
    (helpers.injected_clock): on the real one, a loaded machine could reach 0.3 s before the
    function ignored its signals, and the test would pass without testing that."""
    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))
    monkeypatch.setattr(workers, "KILL_GRACE_S", 0.1)
    for name, behaviour, mark in (("misbehaves", "hang", "hang"), ("misbehaves", "sleep", "sleep"),
                                  ("misbehaves", "ignore_signals", "ignore_signals"),
                                  ("hangs_async", "hang", "hang_async")):
        c = caller(name, 0.3)
        with pytest.raises(ValueError) as e, injected_clock(lambda: marked(tmp_path, mark)):
            call(c, ["ok", behaviour, "ok"])
        assert str(e.value) == (f"--reward_fn {name} ran past --reward_fn_timeout 0.3 s on d.jsonl rows 4, 9, 11 "
                                f"(its worker was killed): raise the flag for a slow function; one that can hang on "
                                f"a row can bound itself (signal.alarm) and return None for it")
        c.timeout_s = 600  # the next call is not timed: a fresh worker answers
        assert call(c, ["ok"] * 3) == {name: [1.0, 2.0, 3.0]}
    for behaviour in ("hang", "sleep", "ignore_signals", "hang_async"):
        assert len(marked(tmp_path, behaviour)) == 1 and gone(marked(tmp_path, behaviour)[0]), behaviour


def test_a_call_is_stopped_once_its_time_limit_has_passed_on_the_clock_not_later(tmp_path, monkeypatch):
    """The time limit read on an injected clock (helpers.InjectedClock: it moves only once the call
    has blocked): a call that never returns is stopped when the clock has moved exactly
    --reward_fn_timeout past its start. On the real clock a test can only bound the stop from below
    (load makes it later, never earlier); this one reads the time. Planted and failing here: the
    deadline at twice the limit, which the test above passed."""
    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))
    monkeypatch.setattr(workers, "KILL_GRACE_S", 0.1)
    c = caller("misbehaves", 7.0)  # its worker started and its module imported on the real clock
    with injected_clock(lambda: marked(tmp_path, "hang")) as clock:
        with pytest.raises(ValueError, match=r"ran past --reward_fn_timeout 7 s on d\.jsonl rows 4, 9, 11"):
            call(c, ["ok", "hang", "ok"])
    assert clock.now == 7.0


def grpo_reward_argv(folder, fn, *extra):
    """grpo.py on the tiny model for 2 steps of 2 prompts x 2, 8 prompts of the embedded task none of
    which hash into the held-out share (no evaluation calls the function), scored by fn alone."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for r in tasks.prompt_rows(40) if not data.held_out(r["prompt"])][:8]
    path = write_jsonl(folder / "q.jsonl", [{"prompt": r["prompt"], "behaviour": "ok"} for r in rows])
    return ["grpo.py", "--model", "tiny", "--dataset", path, "--reward_fn", fn, "--steps", "2", "--prompts_per_step",
            "2", "--group_size", "2", "--max_new_tokens", "4", "--eval_every", "1000", "--out_dir",
            str(folder / "run"), *extra]


def test_grpo_stops_at_reward_fn_timeout_and_a_keyboard_interrupt_of_a_function_is_not_a_ctrl_c(tmp_path):
    """grpo.py --reward_fn_timeout 0.5 with a function that never returns from its second call
    (step 2, after step 1's checkpoint): the run stops with exit status 1 and the error naming the
    function, the flag and the rows, its checkpoint of step 1 kept. A function raising
    KeyboardInterrupt: exit status 1, the error naming it and the row, not "interrupted" and 130
    (a Ctrl-C's). Before: the flag did not exist (the run hung); the KeyboardInterrupt was taken
    for the user's Ctrl-C."""
    (tmp_path / "markers").mkdir()
    with pytest.MonkeyPatch.context() as mp, injected_clock(lambda: marked(tmp_path / "markers", "hung")):
        mp.setenv("REWARD_TEST_DIR", str(tmp_path / "markers"))  # 0.5 s on a clock that moves once it hangs
        proc = run_here(grpo_reward_argv(tmp_path / "a", "misbehaving_rewards:hangs_from_the_second_call",
                                         "--reward_fn_timeout", "0.5", "--save_every", "1"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and re.fullmatch(
        r"grpo.py: --reward_fn hangs_from_the_second_call ran past --reward_fn_timeout 0.5 s on .*q\.jsonl rows "
        r"\d+, \d+ \(its worker was killed\): raise the flag .*", last), proc.stderr[-3000:]
    assert checkpoints.trainer_state(str(tmp_path / "a" / "run" / "checkpoint"))["step"] == 1
    argv = grpo_reward_argv(tmp_path / "b", "misbehaving_rewards:misbehaves")
    rows = tmp_path / "b" / "q.jsonl"
    rows.write_text(rows.read_text().replace('"ok"', '"keyboard_interrupt"'))
    proc = run_here(argv)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and re.fullmatch(
        r"grpo.py: --reward_fn misbehaves raised on .*q\.jsonl row \d+: KeyboardInterrupt", last), proc.stderr[-3000:]


def start_grpo(tmp, argv):
    """`python grpo.py ARGV` as a terminal starts it (helpers.start_as_a_terminal_does); its
    environment names $REWARD_TEST_DIR (tmp/markers, where its function marks what it
    does) and puts tests/ on the path. Returns the process and its environment's marker."""
    (tmp / "markers").mkdir()
    marker = f"REWARD_TEST_DIR={tmp / 'markers'}"
    env = {**SUBPROCESS_ENV, "REWARD_TEST_DIR": str(tmp / "markers"), "PYTHONPATH": os.path.join(ROOT, "tests")}
    return start_as_a_terminal_does(argv, env, tmp), marker


@pytest.fixture
def grpo_process():
    """start_grpo, the processes it started killed (SIGKILL to the group) if the test did not end them."""
    started = []
    yield lambda tmp, argv: started.append(start_grpo(tmp, argv)) or started[-1]
    for proc, _ in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
@pytest.mark.parametrize("fn, sig, code, what", [
    ("hangs_from_the_second_call", signal.SIGINT, 130, "interrupted"),
    ("hangs_async_from_the_second_call", signal.SIGTERM, 143, r"terminated \(SIGTERM\)")])
def test_ctrl_c_or_sigterm_while_a_function_never_returns_ends_the_run_naming_its_last_checkpoint(
        tmp_path, grpo_process, fn, sig, code, what):
    """`python grpo.py --save_every 1` whose function (sync, or async) never returns from its
    second call (step 2): once it is stuck (its marker file, not
    a time, says so), SIGINT to the run's process group, as Ctrl-C sends it (the worker is not in
    that group), or SIGTERM to the run, as a scheduler sends it. The run ends with its status
    (130, 143), its one line naming step 1's checkpoint and the command that resumes, and no
    process started with this test's environment is left. Before: the line was printed, and the
    process stayed (its pool's thread, blocked in the function, is joined at exit)."""
    proc, marker = grpo_process(tmp_path, grpo_reward_argv(tmp_path, f"misbehaving_rewards:{fn}", "--save_every", "1",
                                                           "--steps", "3"))
    wait_until(lambda: marked(tmp_path / "markers", "hung"), proc, "the function's marker")
    worker = marked(tmp_path / "markers", "hung")[0]
    outside = os.getpgid(worker) != os.getpgid(proc.pid)  # out of the terminal's reach
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    assert proc.wait(timeout=HANG_GUARD_S) == code, (tmp_path / "err").read_text()[-3000:]
    lines = (tmp_path / "err").read_text().strip().splitlines()
    assert re.fullmatch(what + r"\. Last checkpoint: \S+ \(step 1\); continue with: python grpo\.py .* --resume", lines[-1])
    assert "Traceback" not in "".join(lines)
    assert outside and our_processes(marker) == [] and gone(worker)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
def test_a_thread_a_function_starts_does_not_keep_the_run_alive(tmp_path, grpo_process):
    """A function that starts a thread that is not a daemon and never ends: the run ends by itself
    with exit status 0, and no process of it is left. Before: the thread ran in the trainer, which
    printed its summary and never exited."""
    proc, marker = grpo_process(tmp_path, grpo_reward_argv(tmp_path, "misbehaving_rewards:starts_a_thread"))
    assert proc.wait(timeout=HANG_GUARD_S) == 0, (tmp_path / "err").read_text()[-3000:]
    assert marked(tmp_path / "markers", "thread") and our_processes(marker) == []


def test_signal_alarm_bounds_a_row_inside_a_function_as_in_trls_main_thread():
    """A verifier that bounds each row with signal.setitimer (SIGALRM, which Python delivers to the
    main thread only): the row that overruns gets None (NaN), the others 1.0. Before: the function
    ran in a thread of the trainer, where signal.signal raises ValueError ("signal only works in
    main thread"), and the run stopped."""
    out = call(caller("bounds_itself"), ["ok", "sleep", "ok"])["bounds_itself"]
    assert out[0] == 1.0 and out[1] != out[1] and out[2] == 1.0


def test_every_call_gets_objects_of_its_own_as_trl_passes_them():
    """A function that appends to every prompt, completion, id list and column value it gets: the
    caller's objects are as they were, each row's prompt is its own (two rows of a group share one
    list in the trainer, as a prompt's G completions do: 2 messages each, not 3), and a second call
    on the same objects sees them unchanged. Before: the env's own message lists grew across rows
    and calls (completions.jsonl logged 5-message prompts by step 3)."""
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    prompts = [a, a, b, b]  # groups of 2, as environment.score_texts passes them
    completions = [[{"role": "assistant", "content": str(i)}] for i in range(4)]
    ids, solution = [[1], [2], [3], [4]], [["7"], ["7"], ["8"], ["8"]]
    before = repr((prompts, completions, ids, solution))
    c = caller("mutates")
    for _ in range(2):
        out = c(prompts, completions, ids, {"solution": solution}, rows=[1, 1, 2, 2], source="d.jsonl")
        assert out == {"mutates": [2.0] * 4}
    assert repr((prompts, completions, ids, solution)) == before


def test_a_function_ending_its_process_on_rank_1_is_named_with_the_rank(tmp_path):
    """torchrun, 2 ranks: rank 1's function calls os._exit(0) (misbehaving_rewards.exits_on_rank_1,
    by its file's path). The job fails, and rank 1's error names the function, the rank, what it
    did and the row. Before: rank 1 ended at once with no word, and rank 0 reported only gloo's
    "Connection reset by peer"."""
    fn = os.path.join(ROOT, "tests", "misbehaving_rewards.py") + ":exits_on_rank_1"
    proc = run_script(grpo_reward_argv(tmp_path, fn, "--steps", "1"), nproc=2)
    assert proc.returncode != 0
    assert re.search(r"grpo.py: --reward_fn exits_on_rank_1 \(rank 1\) ended its worker process \(exit status 0\) "
                     r"on \S*q\.jsonl row \d+\n", proc.stderr), proc.stderr[-3000:]


# -----------------------------------------------------------------------------
# the channel between the trainer and a worker


def test_a_function_writing_to_the_low_descriptors_does_not_reach_the_trainer():
    """A function that writes a line to descriptors 3-11 and to the one its worker was started with
    (where its channel to the trainer was: workers._hide moved it to a random high one and put
    /dev/null there) scores as it returns, at every call. Before: the line went onto the channel,
    and the trainer read its first 4 bytes as the length of a 1.7 GB message, outside any deadline:
    the run hung."""
    c = caller("writes_to_descriptors")
    for _ in range(2):
        assert call(c, ["ok"] * 3) == {"writes_to_descriptors": [1.0, 1.0, 1.0]}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the channel through /proc")
def test_bytes_a_function_writes_onto_the_channel_are_never_read_as_a_message():
    """A function that finds the channel (every socket of its process) and writes a line onto it: a
    ValueError naming the function, what it wrote and its row (its worker killed). Before: the run
    hung, as above."""
    c = caller("writes_onto_its_channel")
    with pytest.raises(ValueError) as e:
        call(c, ["ok"] * 3)
    assert re.fullmatch(re.escape("--reward_fn writes_onto_its_channel wrote b'a line a function writes\\n") + ".*"
                        + re.escape(" onto its worker's channel to the trainer on d.jsonl row 4 (its worker was killed): "
                                    "a function must write only to files and descriptors it opened"), str(e.value)), e.value


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the channel through /proc")
def test_part_of_a_message_on_the_channel_is_waited_for_within_the_deadline(tmp_path, monkeypatch):
    """A function that writes the start of a message (its framing, announcing 100 bytes) onto the
    channel and never returns: the trainer holds part of a message, waits for the rest only until
    --reward_fn_timeout, and the run stops naming the function and its rows; its worker is gone.
    Every read has the deadline. Before: the read of a message's bytes had none (the run hung)."""
    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))
    monkeypatch.setattr(workers, "KILL_GRACE_S", 0.1)
    c = caller("writes_half_a_message_and_hangs", 0.5)
    header = workers.FRAME.pack(workers.MAGIC, 100, 0)
    with pytest.raises(ValueError, match=r"--reward_fn writes_half_a_message_and_hangs ran past --reward_fn_timeout "
                                         r"0.5 s on d.jsonl rows 4, 9, 11 \(its worker was killed\)"):
        c(PROMPTS, COMPLETIONS, IDS, {"header": [header] * 3}, rows=ROWS, source="d.jsonl")
    assert len(marked(tmp_path, "half")) == 1 and gone(marked(tmp_path, "half")[0])


@pytest.mark.parametrize("order, want", [("sets,gets", [1.0, 1.0, 1.0]), ("gets,sets", [0.0, 0.0, 0.0])])
def test_the_functions_of_one_file_share_its_state_called_in_order(order, want):
    """`--reward_fn rf.py:sets,rf.py:gets`: the functions of one module run in one worker, its module
    state shared, as in TRL's one process (gets scores 1.0 the completions sets kept), called in the
    order given, as TRL calls its reward_funcs (gets first: sets has kept nothing yet). Before: each
    function ran in a worker of its own, and gets saw nothing (0.0)."""
    c = reward_fns.RewardCaller(reward_fns.load_reward_fns(",".join(f"misbehaving_rewards:{n}" for n in order.split(","))))
    assert call(c, ["ok"] * 3)["gets"] == want


def test_grpo_with_functions_that_write_to_descriptors_and_share_state_runs_through(tmp_path):
    """grpo.py --reward_fn with three functions of one file, the first writing to descriptors 3-11 and
    its worker's first one, the other two sharing a cache (as in the issue's commands): the run ends
    with exit status 0, every completion scored 1.0 by the function that reads what the other kept.
    Before: the run hung at step 1; and gets scored 0.0."""
    fns = ",".join(f"misbehaving_rewards:{n}" for n in ("writes_to_descriptors", "sets", "gets"))
    proc = run_here(grpo_reward_argv(tmp_path, fns, "--steps", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = read_metrics(tmp_path / "run")[-1]
    assert row["rewards/gets/mean"] == row["rewards/writes_to_descriptors/mean"] == 1.0, row


def test_a_function_that_raises_shows_its_own_frames_and_none_of_the_trainers(tmp_path):
    """A function whose helper raises: the error names it, the row and the exception, and carries the
    function's own traceback (its file, its lines, the helper's frame), none of the worker's;
    grpo.py prints those frames and the error, and none of the trainer's (grpo.py, environment.py,
    reward_fns.py). Before: the type and message under 20 lines of the trainer's frames, never the
    function's file and line."""
    with pytest.raises(ValueError) as e:
        call(caller("raises_in_a_helper"), ["ok"] * 3)
    assert str(e.value) == "--reward_fn raises_in_a_helper raised on d.jsonl row 4: RuntimeError: cannot score 'a'"
    frames = e.value.frames.splitlines()
    here = os.path.join(ROOT, "tests", "misbehaving_rewards.py")
    assert frames[0] == "Traceback (most recent call last):" and frames[-2:] == [
        f'  File "{here}", line {helper_line()}, in helper_that_raises',
        '    raise RuntimeError(f"cannot score {completion!r}")'], e.value.frames
    assert "workers.py" not in e.value.frames and "asyncio" not in e.value.frames
    proc = run_here(grpo_reward_argv(tmp_path, "misbehaving_rewards:raises_in_a_helper", "--steps", "1"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and re.fullmatch(r"grpo.py: --reward_fn raises_in_a_helper raised on \S*q\.jsonl "
                                                 r"row \d+: RuntimeError: cannot score .*", lines[-1]), proc.stderr
    assert "\n".join(frames[-2:]) + "\n" + lines[-1] in proc.stderr, proc.stderr  # its frames, then the error
    assert not any(f in proc.stderr for f in ("grpo.py\"", "environment.py\"", "reward_fns.py\"", "cli.py\"")), proc.stderr


def helper_line():
    """The line of misbehaving_rewards.helper_that_raises's raise."""
    return misbehaving_rewards.helper_that_raises.__code__.co_firstlineno + 1


def test_a_module_the_standard_library_shadows_is_named_with_the_file_imported(tmp_path, monkeypatch):
    """A user's json.py beside the command, named `json:fn`: `import json` finds the standard
    library's json (which the worker imports before it): the error names the file imported, says the
    user's json.py is shadowed, and how to name it; named by its path, it loads. Before: "module
    'json' has no 'fn'", the standard library's, naming no file."""

    (tmp_path / "json.py").write_text("def fn(prompts, completions, **kw):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        reward_fns.load_reward_fns("json:fn")
    assert str(e.value) == (f"--reward_fn json:fn: cannot load it: module 'json' ({json.__file__}) has no 'fn': that "
                            f"is the standard library's json, not json.py in the working directory, which it shadows; "
                            f"rename your file, or name it by its path: json.py:fn")
    assert call(reward_fns.RewardCaller(reward_fns.load_reward_fns("json.py:fn")), ["ok"] * 3) == {"fn": [2.0] * 3}


def test_a_weighted_sum_beyond_float32_names_the_rewards_and_their_weights(tmp_path):
    """check_weighted_sum: each reward finite in float32 (check_rewards), but 1e38 x weight 10, or
    two rewards of 2e38, sum past its range; the error names the row, each reward, its value and its
    weight (NaN, a None, left out); 1e37 x 10 passes. grpo.py --reward_weights big:10 with a
    function returning 1e38 stops so at step 1. Before: "loss is nan, kl is nan", naming neither."""
    nan = float("nan")
    parts = {"big": torch.tensor([1.0, 1e38]), "rule": torch.tensor([1.0, nan])}
    with pytest.raises(ValueError, match=r"^the rewards of d.jsonl row 9, weighted \(--reward_weights\) and summed in "
                                         r"float32, leave its range \(\|x\| < 3.4e38\): big 1e\+38 x weight 10; scale"):
        reward_fns.check_weighted_sum(parts, {"big": 10.0, "rule": 1.0}, [4, 9], "d.jsonl")
    with pytest.raises(ValueError, match=r"row 4, .*: a 2e\+38 x weight 1, model 2e\+38 x weight 1; scale"):
        reward_fns.check_weighted_sum({"a": torch.tensor([2e38]), "model": torch.tensor([2e38])},
                                      {"a": 1.0, "model": 1.0}, [4], "d.jsonl")
    reward_fns.check_weighted_sum(parts, {"big": 1.0, "rule": 1.0}, [4, 9], "d.jsonl")
    reward_fns.check_weighted_sum({"big": torch.tensor([1e37, nan])}, {"big": 10.0}, [4, 9], "d.jsonl")
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": f"p{i}", "value": 1e38} for i in range(8)])
    proc = run_here(["grpo.py", "--model", "tiny", "--dataset", path, "--reward_fn", "misbehaving_rewards:returns",
                     "--reward_weights", "returns:10", "--steps", "1", "--prompts_per_step", "2", "--group_size", "2",
                     "--max_new_tokens", "4", "--eval_every", "1000", "--out_dir", str(tmp_path / "run")])
    assert proc.returncode == 1 and re.search(r"grpo.py: the rewards of \S*v\.jsonl row \d+, weighted .*: returns "
                                              r"1e\+38 x weight 10; scale", proc.stderr), proc.stderr[-3000:]


@pytest.mark.parametrize("minutes, seconds, refused", [(1, 600, True), (20, 600, False), (10, 300, False),
                                                       (10, 301, True)])
def test_a_reward_timeout_the_collective_timeout_would_outrun_is_refused_under_torchrun(minutes, seconds, refused):
    """Under torchrun a rank whose function hangs is named after --reward_fn_timeout while the other
    ranks wait in a collective for --timeout_minutes: unless that is at least twice as long, the job
    would end in gloo's timeout naming neither the rank nor the function, so the pair is refused at
    the start, saying what to pass. One process, or rules alone (no worker), take any pair. Before:
    both were accepted (a hung function on rank 1 ended as an anonymous gloo timeout)."""
    cfg = replace(cli.with_defaults(grpo.Config()), timeout_minutes=minutes, reward_fn_timeout=seconds,
                  reward_fn="rf.py:fn")
    two = common.Dist(rank=0, world_size=2, torchrun=True)
    if refused:
        with pytest.raises(ValueError, match=rf"--reward_fn_timeout {seconds} s with --timeout_minutes {minutes}: .* "
                                             rf"pass --timeout_minutes {-(-seconds // 30)} or a --reward_fn_timeout of "
                                             rf"at most {30 * minutes}$"):
            conflicts.grpo(cfg, two)
    else:
        conflicts.grpo(cfg, two)
    conflicts.grpo(cfg, common.Dist())  # one process: no collective
    conflicts.grpo(replace(cfg, reward_fn="math"), two)  # a rule runs in the trainer
