"""Tools a policy may call in the middle of a rollout (grpo.py --tools): the built-in calculator and
a user's own Python function named `module:function` (a module on the Python path or a .py file:
`my_tools.py:search`). A tool takes the text the model wrote between
the call tags and returns text.

A tool runs in worker processes of its own (`load_tool`, plumbing/workers.py), never in the
trainer: whatever it does (hang, sleep, ignore signals, kill its thread or process, call sys.exit
or os._exit, raise KeyboardInterrupt, return something other than text), its call is answered
with an error text for the model to read, the worker is ended and replaced, and the run goes on; a
Ctrl-C ends the run and its workers with it.

    python -c "import tools; print(tools.calculator('12 * (3 + 4)'))"    # 84
"""
import ast
import functools
import json
import math
import operator
import os

from plumbing import user_code, workers

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the tag pair of a model without a tool-call format
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

TIMEOUT_S = 10.0
"""the time limit of one call, unless the tool's function sets its own: `fn.timeout_s = 30`"""
WORKERS = 4
"""worker processes per tool, the calls of one turn that run at once, unless the function sets `fn.workers`"""

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


# ---- the tool's calls, each in a worker process of its own (plumbing/workers.py) ----

class Tool(workers.Pool):
    """A tool that load_tool loaded, called as tool(text) -> text (call_tool) or tools.call_tools:
    its spec, the time limit of one call, and up to `workers` worker processes that run it."""

    def __init__(self, spec, timeout_s=None, workers=None):
        # the calculator by this file's path: a `tools.py` of the user's working directory is not this one
        module, self.function = user_code.split(f"{os.path.abspath(__file__)}:calculator" if spec == "calculator" else spec)
        super().__init__(module, [self.function], workers)
        self.name, self.timeout_s = spec, timeout_s

    def __repr__(self):
        return f"Tool({self.name!r}, timeout_s={self.timeout_s}, workers={self.workers})"

    def __call__(self, text):
        return call_tool(self, text)


def load_tool(spec, timeout_s=None, workers=None):
    """The Tool `calculator` or `module:function` (on the Python path, a function of one string
    returning a string) names, its first worker started and the function imported there, so that a
    module that fails at import (any exception, a missing dependency), a missing or non-callable
    name, is a ValueError naming the --tools flag when the run starts. timeout_s (seconds per call)
    and workers: the function's `timeout_s` and `workers` attributes, else TIMEOUT_S and WORKERS."""
    if spec != "calculator" and not all(user_code.split(spec)):
        raise ValueError(f"--tools {spec!r}: expected `calculator` or `module:function`")
    tool = Tool(spec)
    failure = tool.load()
    if failure:
        raise ValueError(f"--tools {spec!r}: cannot load it: {failure}")
    declared = tool.idle[0].declared[tool.function]
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


def _answer(header, limit):
    """A call's reply (workers.call_all's) as the text the model reads: the tool's, or an error text."""
    if "value" in header:
        return header["value"]
    if "raised" in header:
        return f"error: {header['raised']}"
    if "not" in header:
        return f"error: the tool returned an object of type {header['not']}, not a str"
    if "timeout" in header:
        return f"error: the tool took longer than {limit:g} s"
    if "unstarted" in header:
        return f"error: the tool's worker could not be started again: {header['unstarted']}"
    if "garbled" in header:
        return f"error: the tool wrote {header['garbled']} onto its worker's channel to the trainer"
    if header.get("idle"):
        return f"error: the tool's process ended between calls ({header['ended']})"
    return f"error: the tool ended its process ({header['ended']})"


def call_tools(tool, texts, max_chars=None, timeout_s=None):
    """tool(call_argument(text)) for each text, as text (each cut to max_chars characters by the
    worker, before it is sent), run at once on up to tool.workers workers (workers.call_all). A call
    that raises (any exception), returns anything but a str, ends its worker's process, or runs
    past timeout_s (the tool's) is answered with an error text and its worker replaced; an
    exception in the trainer (Ctrl-C) kills the workers it interrupted."""
    tool = as_tool(tool)
    limit = timeout_s or tool.timeout_s
    calls = [(tool, workers.request(tool.function, (call_argument(text),), {}, ["text", max_chars])) for text in texts]
    return [_answer(header, limit) for header, _ in workers.call_all(calls, limit)]


def call_tool(tool, text, timeout_s=None):
    """One call: call_tools(tool, [text])'s reply. tool: a Tool (load_tool) or a module-level function."""
    return call_tools(tool, [text], timeout_s=timeout_s)[0]


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
