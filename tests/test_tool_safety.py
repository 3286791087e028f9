"""Nothing a tool does can hang or end a run (tools.py's worker processes): tools
(tests/misbehaving_tools.py) that hang, sleep, ignore signals, kill their thread or process, call
sys.exit or os._exit, raise KeyboardInterrupt or BaseException, or return a non-string are ended
and answered with an error text, and the tool answers again after; 10 MB of text is cut before it
is tokenized; a module that fails at import is refused naming --tools when the run starts; one
rank's tool hanging under torchrun; a Ctrl-C while a tool is blocked ends the run with 130 and
leaves no process behind."""
import concurrent.futures
import os
import re
import signal

import pytest
from helpers import (HANG_GUARD_S, ROOT, SUBPROCESS_ENV, TWO_RANK_RUNS, injected_clock, read_metrics, run_here,
                     start_as_a_terminal_does, wait_until)
from test_grpo import grpo_argv, write_digits_prompts
from test_grpo_tools import tool_flags

import tools
from plumbing import workers


def gone(pid):
    """Whether no process has this pid any more (a zombie still has one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def marked(folder, name):
    """The pids of the workers that wrote NAME-PID files into folder (misbehaving_tools.mark)."""
    return [int(f.rsplit("-", 1)[1]) for f in os.listdir(folder) if f.rsplit("-", 1)[0] == name]


def test_a_tool_that_exits_kills_its_process_or_raises_anything_is_answered_with_an_error_text(tmp_path, monkeypatch):
    """Each call of one turn does another thing, all at once on as many workers: each is answered
    with the error text of what it did, the workers that ended are gone, and the tool then answers
    every call of a new turn from fresh workers."""
    monkeypatch.setenv("TOOL_TEST_DIR", str(tmp_path))
    cases = {"sys_exit": "error: SystemExit: 0", "end_its_thread": "error: SystemExit",
             "os_exit": "error: the tool ended its process (exit status 0)",
             "kill_its_process": "error: the tool ended its process (killed by SIGKILL)",
             "keyboard_interrupt": "error: KeyboardInterrupt", "base_exception": "error: BaseException: a tool's own",
             "not_a_string": "error: the tool returned an object of type int, not a str", "12 * 3": "36"}
    tool = tools.load_tool("misbehaving_tools:misbehaves", workers=len(cases))
    assert tools.call_tools(tool, list(cases)) == list(cases.values())
    for name in ("os_exit", "kill_its_process"):
        assert all(gone(pid) for pid in marked(tmp_path, name)) and marked(tmp_path, name)
    assert tools.call_tools(tool, [f"{k} * 7" for k in range(len(cases))]) == [str(k * 7) for k in range(len(cases))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the channel through /proc")
def test_a_tool_writing_to_descriptors_or_onto_its_channel_cannot_jam_the_trainer():
    """A tool that writes a line to descriptors 3-11 and the one its worker was started with (where
    the channel to the trainer was, /dev/null now) is answered with its text, every time; one that
    finds the channel and writes onto it is answered with an error text saying so (its worker
    replaced, as the next call's answer shows). Before: the line was read as a message's length,
    without a deadline, and the run hung."""
    tool = tools.load_tool("misbehaving_tools:misbehaves", workers=1)
    assert tools.call_tools(tool, ["write_to_descriptors"] * 2 + ["6 * 7"]) == ["written", "written", "42"]
    answer, after = tools.call_tools(tool, ["write_onto_its_channel", "6 * 7"])
    assert answer.startswith("error: the tool wrote b'a line a tool writes\\n") and answer.endswith(
        "onto its worker's channel to the trainer") and after == "42", answer


def test_a_tool_that_hangs_sleeps_or_ignores_signals_is_ended_at_its_time_limit(tmp_path, monkeypatch):
    """A call that never returns (blocked, asleep, SIGTERM and SIGINT ignored, its thread gone) is
    answered `took longer` after the tool's time limit, its worker killed (SIGKILL after the grace
    when SIGTERM is ignored) and replaced: the tool answers the next turn. The limit is read on an
    injected clock that moves once every call has marked that it runs (helpers.injected_clock): on
    the real one a loaded machine could reach 0.2 s before a worker took its call."""
    monkeypatch.setenv("TOOL_TEST_DIR", str(tmp_path))
    monkeypatch.setattr(workers, "KILL_GRACE_S", 0.1)
    texts = ["hang", "sleep", "ignore_signals", "kill_its_thread"]
    tool = tools.load_tool("misbehaving_tools:misbehaves", timeout_s=0.2, workers=len(texts))
    with injected_clock(lambda: all(marked(tmp_path, name) for name in texts)):
        assert tools.call_tools(tool, texts) == ["error: the tool took longer than 0.2 s"] * len(texts)
    assert all(len(marked(tmp_path, name)) == 1 and gone(marked(tmp_path, name)[0]) for name in texts)
    assert tools.call_tools(tool, ["2 ** 10", "7 - 9"], timeout_s=10) == ["1024", "-2"]


MODULES = {  # module text, what the error says after "cannot load it: "
    "syntax_error_at_import": ("def f(text):\n    return (\n", r"importing module 'syntax_error_at_import' failed: "
                               r"SyntaxError: .*syntax_error_at_import\.py, line 2"),
    "raises_at_import": ("raise RuntimeError('no GPU here')\n", r"importing module 'raises_at_import' failed: "
                         r"RuntimeError: no GPU here \(.*raises_at_import\.py:1\)"),
    "missing_dependency": ("import no_such_dependency_xyz\n", r"importing module 'missing_dependency' failed: "
                           r"ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    "exits_at_import": ("import sys\nsys.exit(3)\n", r"importing module 'exits_at_import' failed: SystemExit: 3"),
    "os_exits_at_import": ("import os\nos._exit(0)\n", r"importing it ended its worker process \(exit status 0\)"),
    "no_such_function": ("def g(text):\n    return text\n", r"module 'no_such_function' \(/\S*/no_such_function\.py\) "
                         r"has no 'f'$"),  # the file it imported
}


def test_a_tool_module_that_fails_at_import_is_refused_naming_the_flag_when_the_run_starts(tmp_path, monkeypatch):
    """Each way a module can fail at import (or lack the function) is a ValueError naming --tools,
    the module and the cause, raised by load_tool, so by grpo.py before its first step (no
    metrics written; before: the module's own traceback, a SyntaxError or RuntimeError naming no
    flag); one whose import never ends is refused after START_TIMEOUT_S."""
    for name, (text, _) in MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    (tmp_path / "hangs_at_import.py").write_text("import threading\nthreading.Event().wait()\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def refusal(name):
        with pytest.raises(ValueError) as e:
            tools.load_tool(f"{name}:f")
        return str(e.value)

    with concurrent.futures.ThreadPoolExecutor(len(MODULES)) as pool:  # their workers import side by side
        refusals = dict(zip(MODULES, pool.map(refusal, MODULES)))
    for name, (_, why) in MODULES.items():
        assert re.match(re.escape(f"--tools '{name}:f': cannot load it: ") + why, refusals[name]), refusals[name]
    with monkeypatch.context() as patched, pytest.raises(ValueError, match="import:f'.*not start within 0.2 s"):
        patched.setattr(workers, "START_TIMEOUT_S", 0.2)
        tools.load_tool("hangs_at_import:f")
    prompts = write_digits_prompts(tmp_path / "prompts.jsonl", 8)  # not the embedded task's 100k prompts
    proc = run_here(grpo_argv(tmp_path / "run", "--dataset", prompts, "--tools", "raises_at_import:f"))
    last = proc.stderr.strip().splitlines()[-1]
    want = r"grpo.py: --tools 'raises_at_import:f': cannot load it: " + MODULES["raises_at_import"][1]
    assert proc.returncode == 1 and re.fullmatch(want, last), proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ten_megabytes_from_a_tool_are_cut_to_the_rows_room_before_the_tokenizer_sees_them(monkeypatch):
    """A tool returning 10 MB: its worker sends what the row's remaining tokens can hold in
    characters (tokens x the longest token's characters), and the tokenizer is given that, never
    the 10 MB; the result tokens are the first tokens of the whole reply's (checked on the same
    text cut independently, short enough to tokenize whole)."""
    import common
    import sampling
    from test_tool_rollout import scripted_policy, tool_tokenizer

    tok = tool_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call = enc(f"{tools.CALL_OPEN}ten_megabytes{tools.CALL_CLOSE}")
    room = 60 - len(call)
    want = enc(tools.RESULT_OPEN + "0123456789" * 100)[:room]
    bound = len(tools.RESULT_OPEN + tools.RESULT_CLOSE) + room * max(map(len, tok.get_vocab()))
    model, _ = scripted_policy(monkeypatch, [call], tok)
    seen, encode = [], tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    ids, mask = common.pad([enc("a =")], tok.pad_token_id, side="left")
    r_ids, r_mask, _, tool_mask = sampling.generate_with_tools(
        model, ids, mask, 60, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, tokenizer=tok,
        tool=tools.load_tool("misbehaving_tools:misbehaves"), temperature=0.0)
    assert r_ids[0].tolist() == call + want and tool_mask[0].tolist() == [0] * len(call) + [1] * room
    assert seen and max(seen) <= bound < 1000, seen


TWO_RANK_RUNS["grpo_tool_hangs_on_rank_1"] = lambda folder, models: grpo_argv(
    folder / "run", *tool_flags(folder, models), "--tools", "misbehaving_tools:hangs_on_rank_1", "--steps", "1",
    "--max_tool_calls", "1")


def test_a_tool_that_never_returns_on_one_rank_is_ended_and_both_ranks_finish(two_ranks):
    """torchrun, 2 ranks: rank 1's calls block forever (misbehaving_tools.hangs_on_rank_1, time
    limit 0.3 s), rank 0's are the calculator's. Both ranks end with exit status 0 (the fixture
    checks), the step is logged with its calls, and it took at least the time limit (rank 0 waited
    in the update's collectives while rank 1's calls ran out their time) and far less than one
    call's default limit of 10 s. Before: each hung call took its 10 s in turn once four had filled
    the pool (a 50 s step here), and under a torchrun of its own the process never exited."""
    rows = [r for r in read_metrics(two_ranks("grpo_tool_hangs_on_rank_1") / "run") if "loss" in r]
    assert len(rows) == 1 and rows[0]["tools/call_frequency"] > 0 and 0.3 <= rows[0]["time/step"] < 10


def our_processes(marker):
    """The pids of the processes whose environment holds marker (a NAME=VALUE of this test's)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:  # gone meanwhile, or not ours
            pass
    return pids


@pytest.fixture(scope="module")
def blocked_grpo(tmp_path_factory, user_models):
    """`python grpo.py --tools misbehaving_tools:blocks` in a session of its own, as a terminal
    runs it, with SIGINT at its default (a suite run as `cmd &` has it ignored, and an ignored
    signal stays ignored in a child; a Python handler does not). Yields the process and its
    folder; killed (SIGKILL to its group) if the test did not end it."""
    tmp = tmp_path_factory.mktemp("blocked_grpo")
    (tmp / "markers").mkdir()
    env = {**SUBPROCESS_ENV, "TOOL_TEST_DIR": str(tmp / "markers"), "PYTHONPATH": os.path.join(ROOT, "tests")}
    argv = grpo_argv(tmp / "run", *tool_flags(tmp, user_models), "--tools", "misbehaving_tools:blocks")
    proc = start_as_a_terminal_does(argv, env, tmp)
    yield proc, tmp
    if proc.poll() is None:  # the Ctrl-C test did not run, or failed
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
def test_ctrl_c_while_a_tool_is_blocked_ends_the_run_with_130_and_leaves_no_process(blocked_grpo):
    """Once the tool of `python grpo.py --tools misbehaving_tools:blocks` is blocked (SIGTERM and
    SIGINT ignored; the worker's marker file, not a time, says so), SIGINT to the run's whole
    process group, as Ctrl-C sends it. The worker is not in that group; the run ends with the
    usual line and status 130, and no process started with this test's environment is left (the
    trainer killed its workers as it exited). Before: the line was printed, and the process never
    exited (its pool thread, blocked in the tool, is joined at exit)."""
    proc, tmp = blocked_grpo
    markers = tmp / "markers"
    wait_until(lambda: marked(markers, "blocked"), proc, "the tool's marker")
    worker = marked(markers, "blocked")[0]
    assert os.getpgid(worker) != os.getpgid(proc.pid)  # out of the terminal's reach
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=HANG_GUARD_S) == 130, (tmp / "err").read_text()[-3000:]
    lines = (tmp / "err").read_text().strip().splitlines()
    assert lines[-1].startswith("interrupted before its first resumable checkpoint") and "Traceback" not in "".join(lines)
    assert our_processes(f"TOOL_TEST_DIR={markers}") == [] and gone(worker)
