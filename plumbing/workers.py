"""Worker processes that run a user's function outside the trainer: tools.py's tools and
reward_fns.py's reward functions. Whatever the function does (hang, sleep, ignore signals, kill its
thread or process, call sys.exit or os._exit, raise KeyboardInterrupt, start threads that never
end, mutate what it is given, use signal.alarm), the trainer gets an answer for each call: the
function's value, what it raised, how its process ended, or that it ran past its time limit (its
worker then killed); a Ctrl-C ends the run and its workers with it.

A worker is a Python interpreter running this file, started with fork+exec by subprocess (safe in
a process with threads, unlike multiprocessing's fork) in a session of its own (a terminal's Ctrl-C
goes to the trainer's process group only; the trainer then ends it). It imports only the standard
library, plumbing/user_code.py and the function's module (multiprocessing's spawn would import the
trainer's script, torch and all), from the trainer's sys.path, and answers calls one at a time in
its main thread (where Python runs signal handlers), kept alive between calls. What the trainer
sends is pickled without pickle's memo (request), so the function gets objects of its own at
every call and in every row, as TRL passes them; what a worker sends back is JSON and raw floats:
the trainer never unpickles what a user's code could have written. Its
stdin is a pipe the trainer never writes: EOF on it tells the worker that the trainer is gone."""
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
import subprocess
import sys
import threading
import time
import weakref

if __name__ == "__main__":  # a worker, started as a script: sys.path[0] is plumbing/, the project's root above it
    sys.path[0] = os.path.dirname(sys.path[0])
from plumbing import user_code  # noqa: E402

START_TIMEOUT_S = 120.0
"""the time limit of a worker's start: the interpreter and the import of the function's module (torch takes seconds)"""
KILL_GRACE_S = 1.0
"""the time a worker has to end after SIGTERM before it is sent SIGKILL"""


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


def _call(fn, args, kwargs, reply, loop):
    """fn(*args, **kwargs), awaited on the worker's event loop (kept for its life, as TRL keeps one)
    if it returns an awaitable, as the reply the trainer reads: ["text", max_chars] a str cut to
    max_chars characters; ["rewards", n] _rewards'. [{"raised": text}, b""] if anything raised
    (SystemExit and KeyboardInterrupt too: the function's failure, not the worker's)."""
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
        return [{"raised": user_code.describe(e)}, b""]


def _serve(fd):
    """A worker's life: read the spec and the trainer's sys.path, import the function, say so (or
    why not), then answer calls, pickled (args, kwargs, reply) -> _call's header (JSON) and bytes,
    one at a time, until the trainer hangs up."""
    conn = multiprocessing.connection.Connection(fd)
    lifeline = os.dup(0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a function reading stdin reads nothing
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    spec, sys.path[:] = json.loads(conn.recv_bytes())
    try:
        fn = user_code.load_function(spec)
    except ValueError as e:
        conn.send_bytes(json.dumps({"failed": str(e)}).encode())
        return
    declared = {k: getattr(fn, k) for k in ("timeout_s", "workers") if hasattr(fn, k)}
    conn.send_bytes(json.dumps({"ready": declared}, default=repr).encode())
    loop = asyncio.new_event_loop()
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            return
        try:
            args, kwargs, reply = pickle.loads(payload)
        except Exception as e:  # a class of the inputs' that this process cannot import
            header, data = {"raised": f"reading its inputs: {user_code.describe(e)}"}, b""
        else:
            header, data = _call(fn, args, kwargs, reply, loop)
        conn.send_bytes(json.dumps(header).encode() + b"\n" + data)  # JSON has no raw newline


# ---- the trainer's side ----

def request(args, kwargs, reply):
    """A call for a worker: (args, kwargs, reply) pickled without the memo (Pickler.fast), so that an
    object the trainer passes in several places (a prompt's messages, in each of its G rows) is
    written, and unpickled, once for each: each row gets its own, as TRL gives it (a function that
    appends to prompts[i] changes row i alone). Costs the repeats' bytes; a cycle is a ValueError."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True
    pickler.dump((args, kwargs, reply))
    return buffer.getvalue()


class Worker:
    """A worker process for one function (spec: `module:function`, plumbing/user_code.py)."""

    def __init__(self, spec):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(theirs.fileno())],
                                     stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self.conn.send_bytes(json.dumps([spec, [str(p) for p in sys.path]]).encode())
        self.declared = None  # what the function set (timeout_s, workers), once it has loaded

    def ready(self):
        """None once the function is imported, else why it cannot be (the worker is then stopped)."""
        if self.declared is not None:
            return None
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                self.stop()
                return f"its worker did not start within {START_TIMEOUT_S:g} s (the import hangs?)"
            status = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            self.stop()
            return f"importing it ended its worker process ({self.ended()})"
        if "failed" in status:
            self.stop()
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
        self.conn.close()
        self.proc.stdin.close()


def _stop_all(workers, owner):
    """At exit or when its Pool is collected: end every worker still running, at once."""
    if os.getpid() == owner:  # not in a child forked from the trainer
        for w in workers:
            w.stop(grace_s=0)
        workers.clear()


class Pool:
    """Up to `workers` worker processes of one function (spec): idle, ready or starting; live,
    every worker not yet stopped (all of them are stopped at exit, or when the Pool is collected)."""

    def __init__(self, spec, workers=1):
        self.spec, self.workers = spec, workers
        self.idle, self.live = [], []
        weakref.finalize(self, _stop_all, self.live, os.getpid())

    def start(self):
        """A new worker, idle; its import runs while the trainer goes on."""
        w = Worker(self.spec)
        self.live.append(w)
        self.idle.append(w)
        return w

    def load(self):
        """Start the first worker and wait for the function's import: None, or why it failed."""
        return self.start().ready()

    def retire(self, worker, replace=True):
        """Stop a worker that overran or died (SIGKILL at once unless replace), and start its
        replacement, whose import then overlaps what the trainer does next."""
        worker.stop(grace_s=None if replace else 0)
        self.live.remove(worker)
        if replace:
            self.start()


def call_all(calls, timeout_s):
    """Run calls, [(pool, payload)] (payload: request's), each on
    a worker of its pool, up to pool.workers of a pool at once, all pools side by side; returns, per
    call, [header, bytes] as _call makes them, or [{"ended": how}, b""] (its process ended, or could
    not be started again: "unstarted"), or [{"timeout": timeout_s}, b""] (it ran past timeout_s
    seconds: its worker killed and replaced). An exception in the trainer (Ctrl-C) kills the
    workers it interrupted."""
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
                    results[i] = _send(pool, worker, payload)
                    if results[i] is None:
                        busy[worker.conn] = (pool, worker, i, time.monotonic() + timeout_s)
            if busy:
                first = min(deadline for _, _, _, deadline in busy.values())
                for conn in multiprocessing.connection.wait(list(busy), timeout=max(first - time.monotonic(), 0)):
                    pool, worker, i, _ = busy.pop(conn)
                    results[i] = _receive(pool, worker)
                for conn, (pool, worker, i, deadline) in list(busy.items()):
                    if time.monotonic() >= deadline:
                        del busy[conn]
                        pool.retire(worker)
                        results[i] = [{"timeout": timeout_s}, b""]
    except BaseException:
        for pool, worker, _, _ in busy.values():  # a reply it sends later would answer the next call
            pool.retire(worker, replace=False)
        raise
    return results


def _send(pool, worker, payload):
    """Give a worker a call: None, or the call's result if the worker cannot take it (it could not
    be started again, or it died while idle)."""
    failure = worker.ready()
    if failure:  # this call fails; the next one tries a fresh worker
        pool.retire(worker)
        return [{"unstarted": failure}, b""]
    try:
        worker.conn.send_bytes(payload)
    except OSError:
        pool.retire(worker)
        return [{"ended": worker.ended(), "idle": True}, b""]
    return None


def _receive(pool, worker):
    """The reply of a worker that has one, or how it ended if it died mid-call."""
    try:
        header, _, data = worker.conn.recv_bytes().partition(b"\n")
        header = json.loads(header)
    except (EOFError, OSError, ValueError):  # it died mid-call, or wrote on the channel itself
        pool.retire(worker)
        return [{"ended": worker.ended()}, b""]
    pool.idle.append(worker)
    return [header, data]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _serve(int(sys.argv[2]))
