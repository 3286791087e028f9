"""Tools a policy may call in the middle of a rollout (grpo.py --tools, issue 32): the built-in
calculator and a user's own Python function named `module:function`. A tool takes the text the
model wrote between the call tags and returns text; one that raises or runs past its time limit
returns an error text for the model to read, never an exception for the run.

    python -c "import tools; print(tools.calculator('12 * (3 + 4)'))"    # 84
"""
import ast
import concurrent.futures
import importlib
import json
import operator

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the tag pair of a model without a tool-call format
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 100  # a result longer than this is refused (9**9**9 would take the host's memory)


def _value(node):
    """The value of an arithmetic expression tree: numbers, + - * / // % **, unary signs, brackets;
    anything else (names, calls, attributes, strings) is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(int(left)))) > MAX_DIGITS:
            raise ValueError("the result is too large")
        return _OPS[type(node.op)](left, right)
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


def load_tool(spec):
    """`calculator`, or `module:function` (a module on the Python path, a function of one string
    returning a string), named by the --tools flag in every error."""
    if spec == "calculator":
        return calculator
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--tools {spec!r}: expected `calculator` or `module:function`")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--tools {spec!r}: cannot load it ({e})") from e
    if not callable(fn):
        raise ValueError(f"--tools {spec!r}: {module}.{name} is not a function")
    return fn


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool")


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


def call_tool(fn, text, timeout_s=10.0):
    """fn(its argument: call_argument(text)) as text; an exception or a call past timeout_s becomes
    an error text (a thread that overruns is left to finish in the background: Python cannot stop it)."""
    future = _POOL.submit(fn, call_argument(text))
    try:
        return str(future.result(timeout=timeout_s))
    except concurrent.futures.TimeoutError:
        return f"error: the tool took longer than {timeout_s:g} s"
    except Exception as e:  # the model reads what went wrong; the run goes on
        return f"error: {type(e).__name__}: {e}"
