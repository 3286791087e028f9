"""Tools that misbehave, for tests/test_tool_safety.py: `misbehaving_tools:NAME` in --tools or
tools.load_tool. A worker process imports this module, so it imports the standard library and
tools.py only (a worker starts in tens of milliseconds). A tool that is to be waited for writes
a file NAME-PID into $TOOL_TEST_DIR first: a test waits for that file, never for a time."""
import ctypes
import os
import signal
import sys
import threading
import time

import tools


def mark(name):
    """An empty file named NAME-PID (this worker's pid) in $TOOL_TEST_DIR, when that is set."""
    if os.environ.get("TOOL_TEST_DIR"):
        open(os.path.join(os.environ["TOOL_TEST_DIR"], f"{name}-{os.getpid()}"), "w").close()


def hang():
    threading.Event().wait()


def ignore_signals_and_hang():
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    hang()


def raise_(exc):
    raise exc


BEHAVIOURS = {
    "hang": hang,
    "sleep": lambda: time.sleep(3600),
    "ignore_signals": ignore_signals_and_hang,
    "kill_its_thread": lambda: ctypes.CDLL(None).pthread_exit(None),  # the worker's thread that runs the tool
    "end_its_thread": lambda: raise_(SystemExit()),  # what _thread.exit() does
    "kill_its_process": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "sys_exit": lambda: sys.exit(0),
    "os_exit": lambda: os._exit(0),
    "raise": lambda: raise_(RuntimeError("no such city")),
    "keyboard_interrupt": lambda: raise_(KeyboardInterrupt()),
    "base_exception": lambda: raise_(BaseException("a tool's own")),
    "not_a_string": lambda: 42,
    "ten_megabytes": lambda: "0123456789" * 1_000_000,
}


def write_to(descriptors):
    """A line written to each of descriptors (those open); 'written'."""
    for fd in descriptors:
        try:
            os.write(fd, b"a line a tool writes\n")
        except OSError:
            pass
    return "written"


def sockets():
    """This process's sockets (/proc/self/fd): the channel to the trainer is one of them."""
    return [int(n) for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")
            and os.readlink(f"/proc/self/fd/{n}").startswith("socket:")]


BEHAVIOURS |= {  # 3-11 and the descriptor its worker was started with, where the channel was; the channel itself
    "write_to_descriptors": lambda: write_to([*range(3, 12), int(sys.argv[sys.argv.index("--worker") + 1])]),
    "write_onto_its_channel": lambda: write_to(sockets()),
}


def misbehaves(text):
    """Does what its text names (BEHAVIOURS), marking it first; any other text is the calculator's."""
    mark(text)
    return BEHAVIOURS[text]() if text in BEHAVIOURS else tools.calculator(text)


def blocks(text):
    """Marks `blocked`, then waits forever with SIGTERM, SIGINT and SIGHUP ignored."""
    mark("blocked")
    ignore_signals_and_hang()


blocks.timeout_s = 600  # blocked until the test's Ctrl-C, however slow the machine


def hangs_on_rank_1(text):
    """Waits forever on the rank 1 of torchrun (its RANK, which the worker inherits), else the
    calculator: one rank's rows call a tool that never returns."""
    if os.environ.get("RANK") == "1":
        hang()
    return tools.calculator(text)


hangs_on_rank_1.timeout_s = 0.3
hangs_on_rank_1.workers = 8  # a turn's calls at once: each turn waits one time limit
