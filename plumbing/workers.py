"""Worker processes that run a user's functions outside the trainer: tools.py's tools and
reward_fns.py's reward functions. Whatever a function does (hang, sleep, ignore signals, kill its
thread or process, call sys.exit or os._exit, raise KeyboardInterrupt, start threads that never
end, mutate what it is given, use signal.alarm, write to file descriptors it did not open), the
trainer gets an answer for each call: the function's value, what it raised (with its own frames),
how its process ended, that it wrote onto the channel, or that it ran past its time limit (its
worker then killed); a Ctrl-C ends the run and its workers with it.

A worker is a Python interpreter running this file, started with fork+exec by subprocess (safe in
a process with threads, unlike multiprocessing's fork) in a session of its own (a terminal's Ctrl-C
goes to the trainer's process group only; the trainer then ends it). It imports only the standard
library, plumbing/user_code.py and the functions' module (multiprocessing's spawn would import the
trainer's script, torch and all), from the trainer's sys.path, and answers calls of any of the
functions it loaded, one at a time in its main thread (where Python runs signal handlers), kept
alive between calls: the functions of one module share its state, as in TRL's one process. What the
trainer sends is pickled without pickle's memo (request), so a function gets objects of its own at
every call and in every row, as TRL passes them; what a worker sends back is JSON and raw floats:
the trainer never unpickles what a user's code could have written.

The channel, a socket pair, cannot be jammed by a function: in the worker it sits at a random high
descriptor (close-on-exec, /dev/null at its old number: _hide), and every message is framed (a magic
number, its length, at most MAX_MESSAGE, and a CRC-32 of its bytes), so bytes a function writes there
are never read as a message; the trainer reads what comes without blocking, each call within its
deadline, and sends within it. Its stdin is a pipe the trainer never writes: EOF on it tells the
worker that the trainer is gone."""
import array
import asyncio
import io
import inspect
import json
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
import zlib

if __name__ == "__main__":  # a worker, started as a script: sys.path[0] is plumbing/, the project's root above it
    sys.path[0] = os.path.dirname(sys.path[0])
from plumbing import user_code  # noqa: E402

START_TIMEOUT_S = 120.0
"""the time limit of a worker's start: the interpreter and the import of the function's module (torch takes seconds)"""
KILL_GRACE_S = 1.0
"""the time a worker has to end after SIGTERM before it is sent SIGKILL"""

# ---- the channel: framed messages on a socket pair ----

MAGIC = b"\x93rlhf-w1"  # the first bytes of every message
FRAME = struct.Struct("!8sQI")  # MAGIC, the message's length, the CRC-32 of its bytes
MAX_MESSAGE = 2**30
"""the longest message (bytes): a length above it is bytes a function wrote, not a message"""


def frame(payload):
    """A message as it goes on the channel: FRAME, then its bytes."""
    return FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


class Garbled(Exception):
    """Bytes on a channel that are not a message (a function wrote on it)."""


class Channel:
    """The trainer's end of a worker's channel: a message is sent whole within a time limit (send),
    and read as its bytes come, without blocking (read): a worker (or a function in it) that writes
    part of a message, a huge length or garbage never holds the trainer past its deadline."""

    def __init__(self, sock):
        self.sock, self.buffer = sock, bytearray()
        sock.setblocking(False)

    def fileno(self):  # for multiprocessing.connection.wait
        return self.sock.fileno()

    def send(self, payload, timeout_s):
        """Send one message; TimeoutError if the worker does not take it within timeout_s seconds."""
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(frame(payload))
        finally:
            self.sock.setblocking(False)

    def read(self):
        """The next message once it is whole, else None (what came so far is kept). EOFError when the
        worker's end is closed (its process ended); Garbled when what came cannot be a message."""
        try:
            chunk = self.sock.recv(2**20)
        except BlockingIOError:
            chunk = None
        if chunk == b"" and len(self.buffer) < FRAME.size:
            raise EOFError
        self.buffer += chunk or b""
        head = bytes(self.buffer[:FRAME.size])
        if not MAGIC.startswith(head[:len(MAGIC)]):
            raise Garbled(bytes(self.buffer[:80]))
        if len(head) < FRAME.size:
            return None
        _, n, crc = FRAME.unpack(head)
        if n > MAX_MESSAGE:
            raise Garbled(bytes(self.buffer[:80]))
        if len(self.buffer) < FRAME.size + n:
            if chunk == b"":
                raise EOFError
            return None
        payload = bytes(self.buffer[FRAME.size:FRAME.size + n])
        del self.buffer[:FRAME.size + n]
        if zlib.crc32(payload) != crc:
            raise Garbled(payload[:80])
        return payload

    def close(self):
        self.sock.close()


# ---- the worker process: `python plumbing/workers.py --worker FD`, started by Worker ----

def _exit_with_parent(fd):
    """Wait for EOF on fd, the read end of a pipe only the trainer holds open; it comes when the
    trainer exits, however it ends (SIGKILL included); then end this worker and its process group."""
    while os.read(fd, 1):
        pass
    if os.getpgrp() == os.getpid():  # the leader of its own group: the function's children go too
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _rewards(out, n):
    """A reward function's value as [header, floats]: n float64 (NaN for None and NaN), and a JSON
    header naming each item that is not a real number or None ({row index: repr}), or the type and
    length of a value that is not one item per row. A 0-d tensor or array counts as its number
    (iterating a 1-D tensor gives those; TRL's torch.tensor takes them)."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != n:
        return [{"not": type(out).__name__, "length": len(out) if hasattr(out, "__len__") else None}, b""]
    if all(type(v) is float or type(v) is int for v in out):  # the common case, at C speed
        return [{}, array.array("d", out).tobytes()]
    values, bad = array.array("d", bytes(8 * n)), {}
    for i, v in enumerate(out):
        if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
            v = v.item()
        if v is None:
            values[i] = float("nan")
        elif isinstance(v, numbers.Real):
            values[i] = float(v)
        else:
            bad[i] = repr(v)[:200]
    return [{"bad": bad} if bad else {}, values.tobytes()]


def _frames(e):
    """The traceback of what a function raised, as Python prints it, without this file's frames and
    the event loop's (the worker's, not the function's): "Traceback (most recent call last):\n  File
    ...\n" ("" when none is left)."""
    ours = (os.path.abspath(__file__), os.path.dirname(asyncio.__file__) + os.sep)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames[-20:])]) if frames else ""


def _call(fn, args, kwargs, reply, loop):
    """fn(*args, **kwargs), awaited on the worker's event loop (kept for its life, as TRL keeps one)
    if it returns an awaitable, as the reply the trainer reads: ["text", max_chars] a str cut to
    max_chars characters; ["rewards", n] _rewards'. [{"raised": text, "frames": its traceback}, b""]
    if anything raised (SystemExit and KeyboardInterrupt too: the function's failure, not the
    worker's)."""
    try:
        out = fn(*args, **kwargs)
        if inspect.isawaitable(out):
            out = loop.run_until_complete(out)
        if reply[0] == "rewards":
            return _rewards(out, reply[1])
        if not isinstance(out, str):
            return [{"not": type(out).__name__}, b""]
        return [{"value": str.__getitem__(out, slice(None, reply[1]))}, b""]
    except BaseException as e:
        return [{"raised": user_code.describe(e), "frames": _frames(e)}, b""]


def _hide(fd):
    """The channel's descriptor moved where a function cannot stumble on it: to the lowest free one
    at or above a random number in the upper half of the process's limit (up to 65536), close-on-exec
    (a function's subprocesses do not inherit it), with /dev/null put at its old number (a function
    that writes to descriptors 3, 4, ... writes nowhere). One that searches every descriptor can
    still write there: the framing (Channel) makes that an error named, never a message. Returns the
    new descriptor."""
    import fcntl
    import random
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = min(2**16, limit if limit != resource.RLIM_INFINITY else 2**16)
    low = random.SystemRandom().randrange(top // 2, top - 64) if top > 256 else 3
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, fd, inheritable=False)
    os.close(null)
    return new


def _read(sock, n):
    """n bytes from the socket (blocking: the trainer sends whole messages); EOFError at its end."""
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(min(n - len(got), 2**20))
        if not chunk:
            raise EOFError
        got += chunk
    return bytes(got)


def _receive_call(sock):
    """The trainer's next message (frame's). Bytes that are not one (a function read part of a message
    off the channel) end the worker, as its end of the channel would: EOFError."""
    magic, n, crc = FRAME.unpack(_read(sock, FRAME.size))
    if magic != MAGIC or n > MAX_MESSAGE:
        raise EOFError
    payload = _read(sock, n)
    if zlib.crc32(payload) != crc:
        raise EOFError
    return payload


def _serve(fd):
    """A worker's life: move the channel away (_hide), read the module, its function names and the
    trainer's sys.path, import them, say so (or why not, naming the function), then answer calls,
    pickled (name, args, kwargs, reply) -> _call's header (JSON) and bytes, one at a time, until the
    trainer hangs up."""
    sock = socket.socket(fileno=_hide(fd))
    lifeline = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a function reading stdin reads nothing
    os.close(null)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    module, names, sys.path[:] = json.loads(_receive_call(sock))
    try:
        fns = user_code.load_functions(module, names)
    except user_code.LoadError as e:
        sock.sendall(frame(json.dumps({"failed": str(e), "name": e.name}).encode()))
        return
    declared = {name: {k: getattr(fn, k) for k in ("timeout_s", "workers") if hasattr(fn, k)} for name, fn in fns.items()}
    sock.sendall(frame(json.dumps({"ready": declared}, default=repr).encode()))
    loop = asyncio.new_event_loop()
    while True:
        try:
            payload = _receive_call(sock)
        except (EOFError, OSError):
            return
        try:
            name, args, kwargs, reply = pickle.loads(payload)
        except Exception as e:  # a class of the inputs' that this process cannot import
            header, data = {"raised": f"reading its inputs: {user_code.describe(e)}", "frames": ""}, b""
        else:
            header, data = _call(fns[name], args, kwargs, reply, loop)
        sock.sendall(frame(json.dumps(header).encode() + b"\n" + data))  # JSON has no raw newline


# ---- the trainer's side ----

def request(name, args, kwargs, reply):
    """A call of the worker's function `name`: (name, args, kwargs, reply) pickled without the memo
    (Pickler.fast), so that an object the trainer passes in several places (a prompt's messages, in
    each of its G rows) is written, and unpickled, once for each: each row gets its own, as TRL gives
    it (a function that appends to prompts[i] changes row i alone). Costs the repeats' bytes; a cycle
    is a ValueError."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True
    pickler.dump((name, args, kwargs, reply))
    return buffer.getvalue()


def _garbled(data):
    """What a worker's channel held that is not a message, for a message: `b'abc'...`."""
    return f"{data[:40]!r}{'...' * (len(data) > 40)}"


class Worker:
    """A worker process for the functions `names` of one module (plumbing/user_code.py)."""

    def __init__(self, module, names):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(theirs.fileno())],
                                     stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.chan = Channel(ours)
        self.chan.send(json.dumps([module, list(names), [str(p) for p in sys.path]]).encode(), START_TIMEOUT_S)
        self.declared = None  # what each function set (timeout_s, workers), once they have loaded
        self.failed = None  # the function whose import failed, when one did

    def ready(self):
        """None once the functions are imported, else why they cannot be (the worker is then stopped;
        self.failed names the function, where one is to blame)."""
        if self.declared is not None:
            return None
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            status = None
            while status is None:
                if not multiprocessing.connection.wait([self.chan], max(deadline - time.monotonic(), 0)):
                    self.stop()
                    return f"its worker did not start within {START_TIMEOUT_S:g} s (the import hangs?)"
                status = self.chan.read()
            status = json.loads(status)
        except Garbled as e:
            self.stop()
            return (f"importing it wrote {_garbled(e.args[0])} onto its worker's channel to the trainer, which a "
                    f"module must not touch")
        except (EOFError, OSError, ValueError):
            self.stop()
            return f"importing it ended its worker process ({self.ended()})"
        if "failed" in status:
            self.stop()
            self.failed = status["name"]
            return status["failed"]
        self.declared = status["ready"]
        return None

    def ended(self):
        """How the process ended, in words."""
        code = self.proc.wait()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def stop(self, grace_s=None):
        """End the worker's process group: SIGTERM, then SIGKILL after grace_s (KILL_GRACE_S) if it
        is still there; wait for it."""
        grace_s = KILL_GRACE_S if grace_s is None else grace_s
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s else (signal.SIGKILL,):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s if sig == signal.SIGTERM else None)
                break
            except subprocess.TimeoutExpired:
                continue
        self.chan.close()
        self.proc.stdin.close()


def _stop_all(workers, owner):
    """At exit or when its Pool is collected: end every worker still running, at once."""
    if os.getpid() == owner:  # not in a child forked from the trainer
        for w in workers:
            w.stop(grace_s=0)
        workers.clear()


class Pool:
    """Up to `workers` worker processes of the functions `names` of one module: idle, ready or
    starting; live, every worker not yet stopped (all of them are stopped at exit, or when the Pool
    is collected). spec: the module, for messages."""

    def __init__(self, module, names, workers=1):
        self.spec, self.names, self.workers = module, list(names), workers
        self.idle, self.live = [], []
        weakref.finalize(self, _stop_all, self.live, os.getpid())

    def start(self):
        """A new worker, idle; its import runs while the trainer goes on."""
        w = Worker(self.spec, self.names)
        self.live.append(w)
        self.idle.append(w)
        return w

    def load(self):
        """Start the first worker and wait for the functions' import: None, or why it failed."""
        return self.start().ready()

    def retire(self, worker, replace=True):
        """Stop a worker that overran or died (SIGKILL at once unless replace), and start its
        replacement, whose import then overlaps what the trainer does next."""
        worker.stop(grace_s=None if replace else 0)
        self.live.remove(worker)
        if replace:
            self.start()


def call_all(calls, timeout_s):
    """Run calls, [(pool, payload)] (payload: request's), each on a worker of its pool, up to
    pool.workers of a pool at once, in the order given (the calls of a pool with one worker one
    after the other, as TRL calls its functions), all pools side by side; returns, per call, [header,
    bytes] as _call makes them, or [{"ended": how}, b""] (its process ended, or could not be started
    again: "unstarted"), [{"garbled": the bytes}, b""] (bytes that are not a message came, which a
    function wrote: its worker killed and replaced), or [{"timeout": timeout_s}, b""] (it was not sent, or did not answer,
    within timeout_s seconds: its worker killed and replaced). Every send and every read is bound by
    the call's deadline. An exception in the trainer (Ctrl-C) kills the workers it interrupted."""
    results, todo, busy = [None] * len(calls), list(range(len(calls))), {}
    try:
        for pool in {id(p): p for p, _ in calls}.values():  # the workers these calls need, importing side by side
            n = sum(p is pool for p, _ in calls)
            while len(pool.idle) < min(pool.workers, n) and len(pool.live) < pool.workers:
                pool.start()
        while todo or busy:
            for i in list(todo):
                pool, payload = calls[i]
                if sum(p is pool for p, _, _, _ in busy.values()) < pool.workers:
                    todo.remove(i)
                    if not pool.idle:  # one retired without a replacement (an interrupted call before)
                        pool.start()
                    worker = pool.idle.pop(0)
                    results[i] = _send(pool, worker, payload, timeout_s)
                    if results[i] is None:
                        busy[worker.chan] = (pool, worker, i, time.monotonic() + timeout_s)
            if busy:
                first = min(deadline for _, _, _, deadline in busy.values())
                for chan in multiprocessing.connection.wait(list(busy), timeout=max(first - time.monotonic(), 0)):
                    pool, worker, i, _ = busy[chan]
                    results[i] = _receive(pool, worker)
                    if results[i] is not None:  # else part of a message: it waits, within its deadline
                        del busy[chan]
                for chan, (pool, worker, i, deadline) in list(busy.items()):
                    if time.monotonic() >= deadline:
                        del busy[chan]
                        pool.retire(worker)
                        results[i] = [{"timeout": timeout_s}, b""]
    except BaseException:
        for pool, worker, _, _ in busy.values():  # a reply it sends later would answer the next call
            pool.retire(worker, replace=False)
        raise
    return results


def _send(pool, worker, payload, timeout_s):
    """Give a worker a call: None, or the call's result if the worker cannot take it (it could not
    be started again, died while idle, or does not take the call within timeout_s)."""
    failure = worker.ready()
    if failure:  # this call fails; the next one tries a fresh worker
        pool.retire(worker)
        return [{"unstarted": failure}, b""]
    try:
        worker.chan.send(payload, timeout_s)
    except TimeoutError:
        pool.retire(worker)
        return [{"timeout": timeout_s}, b""]
    except OSError:
        pool.retire(worker)
        return [{"ended": worker.ended(), "idle": True}, b""]
    return None


def _receive(pool, worker):
    """The reply of a worker whose channel has bytes to read: [header, bytes]; None while the
    message is not whole; how it ended if it died mid-call, or what it wrote that is not a message
    (either way the worker is replaced)."""
    try:
        message = worker.chan.read()
        if message is None:
            return None
        header, _, data = message.partition(b"\n")
        try:
            header = json.loads(header)
        except ValueError:  # a frame a function forged
            raise Garbled(message) from None
    except Garbled as e:
        pool.retire(worker)
        return [{"garbled": _garbled(e.args[0])}, b""]
    except (EOFError, OSError):  # it died mid-call
        pool.retire(worker)
        return [{"ended": worker.ended()}, b""]
    pool.idle.append(worker)
    return [header, data]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _serve(int(sys.argv[2]))
