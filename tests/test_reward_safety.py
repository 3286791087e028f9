"""Nothing a reward function does can hang a run or end it without a word (reward_fns.RewardCaller,
each function in a worker process of its own, plumbing/workers.py): functions
(tests/misbehaving_rewards.py) that exit, os._exit, kill their process or raise anything stop
the run naming themselves and the row; ones that never return (sync or async, asleep, signals
ignored) are stopped at --reward_fn_timeout naming their rows; Ctrl-C and SIGTERM while one
never returns end the run with its line and its last checkpoint, and no process left; a thread
it starts does not keep the run alive; signal.alarm works in it, as in TRL's main thread; it
gets objects of its own at every call; under torchrun, the rank whose function ends its process
is named."""
import os
import re
import signal

import pytest
from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV, injected_clock, run_here, run_script,
                     start_as_a_terminal_does, wait_until, write_jsonl)
from test_tool_safety import gone, marked, our_processes

import data
import reward_fns
import tasks
from plumbing import checkpoints, workers

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
        r"ValueError: --reward_fn hangs_from_the_second_call ran past --reward_fn_timeout 0.5 s on .*q\.jsonl rows "
        r"\d+, \d+ \(its worker was killed\): raise the flag .*", last), proc.stderr[-3000:]
    assert checkpoints.trainer_state(str(tmp_path / "a" / "run" / "checkpoint"))["step"] == 1
    argv = grpo_reward_argv(tmp_path / "b", "misbehaving_rewards:misbehaves")
    rows = tmp_path / "b" / "q.jsonl"
    rows.write_text(rows.read_text().replace('"ok"', '"keyboard_interrupt"'))
    proc = run_here(argv)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and re.fullmatch(
        r"ValueError: --reward_fn misbehaves raised on .*q\.jsonl row \d+: KeyboardInterrupt", last), proc.stderr[-3000:]


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
    assert re.search(r"ValueError: --reward_fn exits_on_rank_1 \(rank 1\) ended its worker process \(exit status 0\) "
                     r"on \S*q\.jsonl row \d+\n", proc.stderr), proc.stderr[-3000:]
