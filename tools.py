"""Tools a policy may call in the middle of a rollout (grpo.py --tools): the built-in calculator and
a user's own Python function named `module:function` (a module on the Python path or a .py file:
`my_tools.py:search`). A tool takes the text the model wrote between
the call tags and returns text.

A tool runs in worker processes of its own (`load_tool`), never in the trainer: whatever it does
(hang, sleep, ignore signals, kill its thread or process, call sys.exit or os._exit, raise
KeyboardInterrupt, return something other than text), its call is answered with an error text for
the model to read, the worker is ended and replaced, and the run goes on; a Ctrl-C ends the run and
its workers with it.

    python -c "import tools; print(tools.calculator('12 * (3 + 4)'))"    # 84
"""
import ast
import functools
import json
import math
import multiprocessing.connection
import operator
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref

from plumbing import user_code

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the tag pair of a model without a tool-call format
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

TIMEOUT_S = 10.0
"""the time limit of one call, unless the tool's function sets its own: `fn.timeout_s = 30`"""
WORKERS = 4
"""worker processes per tool, the calls of one turn that run at once, unless the function sets `fn.workers`"""
START_TIMEOUT_S = 120.0
"""the time limit of a worker's start: the interpreter and the import of the tool's module (torch takes seconds)"""
KILL_GRACE_S = 1.0
"""the time a worker has to end after SIGTERM before it is sent SIGKILL"""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 100  # a result longer than this is refused (9**9**9 would take the host's memory)


def _power(left, right):
    """left ** right, refused before it is computed when it is an integer of more than MAX_DIGITS
    digits (its digits are right * log10|left|: exact integer powers grow without bound, so 9**9**9
    would take minutes and the host's memory). A float power is computed at once: it is one
    machine operation and too large a float raises OverflowError."""
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * math.log10(abs(left)) > MAX_DIGITS + 1:
            raise ValueError("the result is too large")
    return left ** right


def _value(node):
    """The value of an arithmetic expression tree: numbers, + - * / // % **, unary signs, brackets;
    anything else (names, calls, attributes, strings) is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        return _power(left, right) if isinstance(node.op, ast.Pow) else _OPS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def calculator(expression):
    """The value of an arithmetic expression as text: `12 * (3 + 4)` -> `84`, `7 / 2` -> `3.5`;
    evaluated from its syntax tree (never `eval`), so only arithmetic runs."""
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    text = str(value)
    return text if len(text) <= MAX_DIGITS else "error: the result is too large"


def call_argument(text):
    """The text a tool gets from a call: the call's text itself, or from a call in the JSON of
    Qwen2.5's (Hermes) template, {"name": ..., "arguments": {"expression": "12 * 3"}}, its one
    argument's value (the name is not checked: one tool is loaded)."""
    try:
        call = json.loads(text)
    except ValueError:
        return text
    args = call.get("arguments") if isinstance(call, dict) else None
    return str(next(iter(args.values()))) if isinstance(args, dict) and len(args) == 1 else text


# ---- the worker process: `python tools.py --worker FD`, started by _Worker ----

def _failure(e, where=False):
    """An exception as one line: its type, its message and, with where, the file and line it was
    raised at (a SyntaxError's message has them)."""
    try:
        frame = traceback.extract_tb(e.__traceback__)[-1] if where and e.__traceback__ else None
        at = f" ({frame.filename}:{frame.lineno})" if frame and not isinstance(e, SyntaxError) else ""
        return f"{type(e).__name__}: {e}{at}" if str(e) else f"{type(e).__name__}{at}"
    except BaseException:  # an exception whose str() raises
        return type(e).__name__


def _import(spec):
    """The function a spec names (`calculator` is this module's), with its own time limit and
    worker count if it sets them; or the reason it cannot be used."""
    if spec == "calculator":
        return calculator, {}
    module, name = user_code.split(spec)
    try:
        fn = getattr(user_code.import_module(module), name, None)
    except BaseException as e:  # SyntaxError, a missing dependency, SystemExit: anything the module's code does
        raise ValueError(f"importing module {module!r} failed: {_failure(e, where=True)}") from None
    if fn is None:
        raise ValueError(f"module {module!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{module}.{name} is not a function")
    return fn, {k: getattr(fn, k) for k in ("timeout_s", "workers") if hasattr(fn, k)}


def _run(fn, text, max_chars):
    """fn(call_argument(text)) cut to max_chars characters, or the error text of what went wrong."""
    try:
        out = fn(call_argument(text))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the tool's failure, not the worker's
        return f"error: {_failure(e)}"
    if not isinstance(out, str):
        return f"error: the tool returned an object of type {type(out).__name__}, not a str"
    return str.__getitem__(out, slice(None, max_chars))


def _exit_with_parent(fd):
    """Wait for EOF on fd, the read end of a pipe only the trainer holds open; it comes when the
    trainer exits, however it ends (SIGKILL included); then end this worker and its process group."""
    while os.read(fd, 1):
        pass
    if os.getpgrp() == os.getpid():  # the leader of its own group: the tool's children go too
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _serve(fd):
    """A worker's life: read the spec and the trainer's sys.path, import the tool, say so (or why
    not), then answer calls, [text, max_chars] -> text, one at a time, until the trainer hangs up.
    Messages are JSON: the trainer never unpickles what a tool's process sends."""
    conn = multiprocessing.connection.Connection(fd)
    lifeline = os.dup(0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a tool reading stdin reads nothing
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    spec, sys.path[:] = json.loads(conn.recv_bytes())
    try:
        fn, declared = _import(spec)
    except ValueError as e:
        conn.send_bytes(json.dumps({"failed": str(e)}).encode())
        return
    conn.send_bytes(json.dumps({"ready": declared}, default=repr).encode())
    while True:
        try:
            text, max_chars = json.loads(conn.recv_bytes())
        except EOFError:
            return
        conn.send_bytes(json.dumps(_run(fn, text, max_chars)).encode())


# ---- the trainer's side ----

class _Worker:
    """A worker process for one tool: a Python interpreter running this file, in a session of its
    own (a terminal's Ctrl-C goes to the trainer's process group only; the trainer then ends it),
    started with fork+exec by subprocess (safe in a process with threads, unlike multiprocessing's
    fork), importing only this module, plumbing/user_code.py and the tool's (multiprocessing's spawn
    would import the trainer's script, torch and all). Its stdin is a pipe the trainer never writes: EOF on it tells
    the worker that the trainer is gone."""

    def __init__(self, spec):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(theirs.fileno())],
                                     stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self.conn.send_bytes(json.dumps([spec, [str(p) for p in sys.path]]).encode())
        self.declared = None  # what the tool's function set (timeout_s, workers), once it has loaded

    def ready(self):
        """None once the tool is imported, else why it cannot be (the worker is then stopped)."""
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
    """At exit or when its Tool is collected: end every worker still running, at once."""
    if os.getpid() == owner:  # not in a child forked from the trainer
        for w in workers:
            w.stop(grace_s=0)
        workers.clear()


class Tool:
    """A tool that load_tool loaded, called as tool(text) -> text (call_tool) or tools.call_tools:
    its spec, the time limit of one call, and up to `workers` worker processes that run it."""

    def __init__(self, spec, timeout_s=None, workers=None):
        self.spec, self.timeout_s, self.workers = spec, timeout_s, workers
        self.idle, self.live = [], []  # idle: ready or starting; live: every worker not yet stopped
        weakref.finalize(self, _stop_all, self.live, os.getpid())

    def __repr__(self):
        return f"Tool({self.spec!r}, timeout_s={self.timeout_s}, workers={self.workers})"

    def __call__(self, text):
        return call_tool(self, text)

    def start(self):
        """A new worker, idle; its import runs while the trainer goes on."""
        w = _Worker(self.spec)
        self.live.append(w)
        self.idle.append(w)
        return w

    def retire(self, worker, replace=True):
        """Stop a worker that overran or died (SIGKILL at once unless replace), and start its
        replacement, whose import then overlaps the sampler's next turn."""
        worker.stop(grace_s=None if replace else 0)
        self.live.remove(worker)
        if replace:
            self.start()


def load_tool(spec, timeout_s=None, workers=None):
    """The Tool `calculator` or `module:function` (on the Python path, a function of one string
    returning a string) names, its first worker started and the function imported there, so that a
    module that fails at import (any exception, a missing dependency), a missing or non-callable
    name, is a ValueError naming the --tools flag when the run starts. timeout_s (seconds per call)
    and workers: the function's `timeout_s` and `workers` attributes, else TIMEOUT_S and WORKERS."""
    if spec != "calculator" and not all(user_code.split(spec)):
        raise ValueError(f"--tools {spec!r}: expected `calculator` or `module:function`")
    tool = Tool(spec)
    failure = tool.start().ready()
    if failure:
        raise ValueError(f"--tools {spec!r}: cannot load it: {failure}")
    declared = tool.idle[0].declared
    tool.timeout_s = timeout_s or declared.get("timeout_s", TIMEOUT_S)
    tool.workers = workers or declared.get("workers", WORKERS)
    if type(tool.timeout_s) not in (int, float) or not 0 < tool.timeout_s < math.inf:
        raise ValueError(f"--tools {spec!r}: its timeout_s is {tool.timeout_s!r}, not a positive number of seconds")
    if type(tool.workers) is not int or tool.workers < 1:
        raise ValueError(f"--tools {spec!r}: its workers is {tool.workers!r}, not a positive integer")
    return tool


_OF_FUNCTION = {}  # spec -> Tool, for a function given to call_tool directly


def as_tool(tool):
    """A Tool as it is; a module-level function (tools.calculator, mymodule.fn) as the Tool that
    load_tool makes of its spec, once per process."""
    if isinstance(tool, Tool):
        return tool
    module, name = getattr(tool, "__module__", None), getattr(tool, "__qualname__", "<none>")
    spec = "calculator" if tool is calculator else f"{module}:{name}"
    if module in (None, "__main__") or "<" in name or "." in name:
        raise ValueError(f"{tool!r}: a tool runs in a worker process, which imports it by name: give a function "
                         f"defined at the top level of a module (tools.load_tool('module:function'))")
    if spec not in _OF_FUNCTION:
        _OF_FUNCTION[spec] = load_tool(spec)
    return _OF_FUNCTION[spec]


def call_tools(tool, texts, max_chars=None, timeout_s=None):
    """tool(call_argument(text)) for each text, as text (each cut to max_chars characters by the
    worker, before it is sent), run at once on up to tool.workers workers. A call that raises (any
    exception), returns anything but a str, ends its worker's process, or runs past timeout_s
    (the tool's) is answered with an error text and its worker replaced; an exception in the
    trainer (Ctrl-C) kills the workers it interrupted."""
    tool = as_tool(tool)
    limit = timeout_s or tool.timeout_s
    replies, todo, busy = [None] * len(texts), list(range(len(texts)))[::-1], {}
    try:
        while len(tool.idle) < min(tool.workers, len(texts)) and len(tool.live) < tool.workers:
            tool.start()  # the workers this turn needs, importing side by side
        while todo or busy:
            while todo and len(busy) < tool.workers:
                if not tool.idle:  # one retired without a replacement (an interrupted call before)
                    tool.start()
                i, worker = todo.pop(), tool.idle.pop(0)
                replies[i] = _send(tool, worker, texts[i], max_chars)
                if replies[i] is None:
                    busy[worker.conn] = (worker, i, time.monotonic() + limit)
            if busy:
                first = min(deadline for _, _, deadline in busy.values())
                for conn in multiprocessing.connection.wait(list(busy), timeout=max(first - time.monotonic(), 0)):
                    worker, i, _ = busy.pop(conn)
                    replies[i] = _receive(tool, worker)
                for conn, (worker, i, deadline) in list(busy.items()):
                    if time.monotonic() >= deadline:
                        del busy[conn]
                        tool.retire(worker)
                        replies[i] = f"error: the tool took longer than {limit:g} s"
    except BaseException:
        for worker, _, _ in busy.values():  # a reply it sends later would answer the next call
            tool.retire(worker, replace=False)
        raise
    return replies


def _send(tool, worker, text, max_chars):
    """Give a worker a call: None, or the call's error text if the worker cannot take it (it could
    not be started again, or it died while idle)."""
    failure = worker.ready()
    if failure:  # this call fails; the next one tries a fresh worker
        tool.retire(worker)
        return f"error: the tool's worker could not be started again: {failure}"
    try:
        worker.conn.send_bytes(json.dumps([text, max_chars]).encode())
    except OSError:
        tool.retire(worker)
        return f"error: the tool's process ended between calls ({worker.ended()})"
    return None


def _receive(tool, worker):
    """The reply of a worker that has one, or the error text of a worker that ended mid-call."""
    try:
        reply = json.loads(worker.conn.recv_bytes())
    except (EOFError, OSError, ValueError):  # it died mid-call, or wrote on the channel itself
        tool.retire(worker)
        return f"error: the tool ended its process ({worker.ended()})"
    tool.idle.append(worker)
    return reply


def call_tool(tool, text, timeout_s=None):
    """One call: call_tools(tool, [text])'s reply. tool: a Tool (load_tool) or a module-level function."""
    return call_tools(tool, [text], timeout_s=timeout_s)[0]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _serve(int(sys.argv[2]))


# -----------------------------------------------------------------------------
# a call and its result as tokens (sampling.generate_with_tools)


def closing_tag_id(tokenizer, flag="--tools"):
    """The id of CALL_CLOSE, which must be one token (Qwen2.5's tokenizer has it; for others
    add the tag pairs as tokens, tokenizer.add_tokens, and resize the embeddings) so that the
    sampler can stop at it like at an end-of-turn id."""
    ids = tokenizer.encode(CALL_CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{flag}: {CALL_CLOSE!r} is {len(ids)} tokens for this tokenizer: add the tags "
                         f"({CALL_OPEN}, {CALL_CLOSE}, {RESULT_OPEN}, {RESULT_CLOSE}) as tokens")
    return ids[0]


@functools.lru_cache(maxsize=16)
def longest_token(tokenizer, vocab_size):
    """The most characters one token of the tokenizer stands for (its longest vocabulary entry: a
    byte-level entry has one character per byte, so at least as many as it decodes to); cached
    per tokenizer and vocabulary size, since a 150k vocabulary takes tens of ms to list."""
    return max(map(len, tokenizer.get_vocab()))


def call_text(tokenizer, written_ids):
    """The text of a row's last call: what the row wrote after its last opening tag, closing tag
    left out."""
    text = tokenizer.decode(written_ids)
    return text.rsplit(CALL_OPEN, 1)[-1].replace(CALL_CLOSE, "").strip()


def results_tokens(tokenizer, written, tool, rooms):
    """The tokens of the result tag pair of each row's last call (written: each row's own tokens),
    at most rooms[k] of them: the tool runs on call_text of every row at once (call_tools;
    an error text if it fails or overruns), its text cut, before it is tokenized, to the
    characters rooms[k] tokens can hold (longest_token each), so a tool that returns 10 MB costs
    no more than one that returns what fits."""
    if not written:
        return []
    width = longest_token(tokenizer, len(tokenizer))
    texts = [call_text(tokenizer, ids) for ids in written]
    replies = call_tools(tool, texts, max_chars=max(rooms) * width)
    return [tokenizer.encode(RESULT_OPEN + reply[:room * width] + RESULT_CLOSE,
                             add_special_tokens=False)[:room] for reply, room in zip(replies, rooms)]


def result_tokens(tokenizer, written_ids, tool, room=None):
    """The tokens of the result tag pair for one row's last call: results_tokens for one row,
    room: the tokens the row has left (None: no limit)."""
    if room is None:
        return tokenizer.encode(RESULT_OPEN + call_tool(tool, call_text(tokenizer, written_ids))
                                + RESULT_CLOSE, add_special_tokens=False)
    return results_tokens(tokenizer, [written_ids], tool, [room])[0]
