"""Reward functions that misbehave, for tests/test_reward_safety.py: `misbehaving_rewards:NAME` in
--reward_fn or reward_fns.load_reward_fns, called as TRL calls a reward function. A worker
process imports this module, so it imports the standard library only. A function that is to be
waited for writes a file NAME-PID into $REWARD_TEST_DIR first: a test waits for that file, never
for a time."""
import asyncio
import os
import signal
import sys
import threading
import time


def mark(name):
    """An empty file named NAME-PID (this worker's pid) in $REWARD_TEST_DIR, when that is set."""
    if os.environ.get("REWARD_TEST_DIR"):
        open(os.path.join(os.environ["REWARD_TEST_DIR"], f"{name}-{os.getpid()}"), "w").close()


def raise_(exc):
    raise exc


def hang():
    threading.Event().wait()


def ignore_signals_and_hang():
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    hang()


BEHAVIOURS = {  # what a row's `behaviour` column makes misbehaves do
    "raise": lambda: raise_(RuntimeError("cannot score this")),
    "sys_exit": lambda: sys.exit(0),
    "system_exit_3": lambda: raise_(SystemExit(3)),
    "os_exit": lambda: os._exit(0),
    "kill_its_process": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "keyboard_interrupt": lambda: raise_(KeyboardInterrupt()),
    "base_exception": lambda: raise_(BaseException("a reward's own")),
    "hang": hang,
    "sleep": lambda: time.sleep(3600),
    "ignore_signals": ignore_signals_and_hang,
}


def misbehaves(prompts, completions, behaviour, **kwargs):
    """Does what a row's `behaviour` names (BEHAVIOURS), marking it first; else each completion's length."""
    for b in behaviour:
        if b in BEHAVIOURS:
            mark(b)
            BEHAVIOURS[b]()
    return [float(len(c)) for c in completions]


async def hangs_async(prompts, completions, behaviour, **kwargs):
    """An `async def` that never returns where a row's `behaviour` is `hang`."""
    if "hang" in behaviour:
        mark("hang_async")
        await asyncio.Event().wait()
    return [float(len(c)) for c in completions]


CALLS = []  # this worker's calls so far


def hangs_from_the_second_call(prompts, completions, **kwargs):
    """1.0 per completion at its first call (step 1), then marks `hung` and never returns."""
    CALLS.append(len(completions))
    if len(CALLS) > 1:
        mark("hung")
        hang()
    return [1.0] * len(completions)


async def hangs_async_from_the_second_call(prompts, completions, **kwargs):
    """hangs_from_the_second_call as an `async def`: awaits forever from its second call."""
    CALLS.append(len(completions))
    if len(CALLS) > 1:
        mark("hung")
        await asyncio.Event().wait()
    return [1.0] * len(completions)


def starts_a_thread(prompts, completions, **kwargs):
    """Starts a thread that is not a daemon and never ends, once per worker; 1.0 per completion."""
    if not CALLS:
        threading.Thread(target=hang, daemon=False).start()
        mark("thread")
    CALLS.append(len(completions))
    return [1.0] * len(completions)


def bounds_itself(prompts, completions, behaviour, **kwargs):
    """A verifier that bounds each row with signal.alarm's interval timer (main thread only): a row
    whose work (`sleep`) overruns 1 s is cut short and gets None; the others 1.0 (their work takes
    microseconds: a loaded machine does not stretch it to 1 s)."""
    def overran(signum, frame):
        raise TimeoutError

    old, out = signal.signal(signal.SIGALRM, overran), []
    try:
        for b in behaviour:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            try:
                if b == "sleep":
                    time.sleep(3600)
                out.append(1.0)
            except TimeoutError:
                out.append(None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return out


def mutates(prompts, completions, completion_ids, solution, **kwargs):
    """Appends to everything it is given, then returns how many messages each prompt has: 2 for a
    prompt of one message that is its row's own (TRL passes each row fresh objects)."""
    for p, c, ids, s in zip(prompts, completions, completion_ids, solution):
        p.append({"role": "assistant", "content": "mine"})
        c.append({"role": "user", "content": "mine"})
        ids.append(0)
        s.append("mine")
    return [float(len(p)) for p in prompts]


def exits_on_rank_1(prompts, completions, **kwargs):
    """os._exit(0) on torchrun's rank 1 (its RANK, which the worker inherits), else 1.0 each."""
    if os.environ.get("RANK") == "1":
        os._exit(0)
    return [1.0] * len(completions)


def returns(prompts, completions, value, **kwargs):
    """Each row's `value` column as its reward (None, NaN, 1e39: what a function may return)."""
    return list(value)


def writes_to_descriptors(prompts, completions, **kwargs):
    """Writes a line to each of the descriptors 3 to 11 and to the one its worker was started with
    (`--worker FD` in its sys.argv), where the channel to the trainer was (those open); 1.0 per
    completion."""
    for fd in [*range(3, 12), int(sys.argv[sys.argv.index("--worker") + 1])]:
        try:
            os.write(fd, b"a line a function writes\n")
        except OSError:
            pass
    return [1.0] * len(completions)


def sockets():
    """The descriptors of this process's sockets (/proc/self/fd): a function that searches for the
    channel finds it among them."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.append(int(name))
        except OSError:
            pass
    return found


def write_to_sockets(data):
    for fd in sockets():
        try:
            os.write(fd, data)
        except OSError:  # a socket of the event loop's that is full
            pass


def writes_onto_its_channel(prompts, completions, **kwargs):
    """Writes a line onto every socket of its process, the channel to the trainer among them; 1.0 per
    completion."""
    write_to_sockets(b"a line a function writes\n")
    return [1.0] * len(completions)


def writes_half_a_message_and_hangs(prompts, completions, header, **kwargs):
    """Writes the start of a message (the first row's `header` column: a message's framing, its
    length and no bytes after it) onto every socket of its process, then never returns: the trainer
    holds part of a message."""
    write_to_sockets(header[0])
    mark("half")
    hang()


SEEN = {}  # what `sets` saw last, in this worker


def sets(prompts, completions, **kwargs):
    """Keeps the completions it is given (a parse, a cache another function reads); 0.0 each."""
    SEEN["completions"] = list(completions)
    return [0.0] * len(completions)


def gets(prompts, completions, **kwargs):
    """1.0 for each completion `sets` was given last in this process, else 0.0: 1.0 where the two
    share their module's state and `sets` ran first, as under TRL's one process."""
    return [float(c == s) for c, s in zip(completions, SEEN.get("completions", [None] * len(completions)))]


def helper_that_raises(completion):
    raise RuntimeError(f"cannot score {completion!r}")


def raises_in_a_helper(prompts, completions, **kwargs):
    """Scores each completion with a helper of this file that raises."""
    return [helper_that_raises(c) for c in completions]
