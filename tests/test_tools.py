"""tools.py: the calculator against Python's own arithmetic on random expressions, what it refuses,
and tools that raise, overrun or cannot be loaded (each an error text or a named flag)."""
import random
import sys
import time

import pytest

import tools


def random_expression(rng, depth=3):
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    op = rng.choice(["+", "-", "*", "//", "%", "/"])
    return f"({random_expression(rng, depth - 1)} {op} {random_expression(rng, depth - 1)})"


def test_the_calculator_agrees_with_python_on_random_expressions():
    """500 random expressions of 3-digit numbers: the calculator's text is Python's value (computed
    here with eval on text this test built), integers without a decimal point; division by zero an
    error text."""
    rng = random.Random(0)
    checked = 0
    for _ in range(500):
        expr = random_expression(rng)
        try:
            want = eval(expr)  # noqa: S307 - the test's own arithmetic, the independent computation
        except ZeroDivisionError:
            assert tools.calculator(expr).startswith("error:")
            continue
        got = tools.calculator(expr)
        if isinstance(want, float) and not want.is_integer():
            assert float(got) == want, expr
        else:
            assert got == str(int(want)), expr
        checked += 1
    assert checked > 400
    assert tools.calculator(" 12 * (3 + 4) ") == "84" and tools.calculator("7 / 2") == "3.5"
    assert tools.calculator("-2 ** 3") == "-8" and tools.calculator("123 * 456") == "56088"


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "x + 1", "(1).__class__", "'a' * 3",
                                  "[1, 2]", "9 ** 9 ** 9", "1 +", "", "lambda: 1"])
def test_the_calculator_runs_arithmetic_only(text):
    """Names, calls, attributes, strings, lists, a power whose result would take the host's memory
    and bad syntax: an error text, nothing evaluated."""
    assert tools.calculator(text).startswith("error:")


def raises(text):
    raise RuntimeError("no such city")


def sleeps(text):
    time.sleep(2)
    return "late"


def test_a_tool_that_raises_or_overruns_returns_an_error_text():
    assert tools.call_tool(tools.calculator, "2 + 2") == "4"
    assert tools.call_tool(raises, "x") == "error: RuntimeError: no such city"
    t0 = time.time()
    assert tools.call_tool(sleeps, "x", timeout_s=0.2) == "error: the tool took longer than 0.2 s"
    assert time.time() - t0 < 1.5


def test_a_users_tool_loads_by_module_and_name_and_bad_names_are_refused_naming_the_flag():
    assert tools.load_tool("calculator") is tools.calculator
    assert tools.load_tool(f"{__name__}:raises") is sys.modules[__name__].raises
    for spec, why in [("no_such_module:f", "cannot load"), (f"{__name__}:nothing", "cannot load"),
                      (f"{__name__}:random", "not a function"), ("calculator2", "expected")]:
        with pytest.raises(ValueError, match=f"--tools '{spec}': .*{why}"):
            tools.load_tool(spec)


def test_a_json_call_in_qwens_format_gives_the_tool_its_one_argument():
    """Qwen2.5's template asks for {"name": ..., "arguments": {...}} inside the call tags: the tool
    gets the one argument's value; plain text, other JSON and several arguments pass as written."""
    assert tools.call_tool(tools.calculator, '{"name": "calculator", "arguments": {"expression": "12 * 34"}}') == "408"
    assert tools.call_tool(tools.calculator, "12 * 34") == "408"
    assert tools.call_argument('{"arguments": {"a": "1", "b": "2"}}') == '{"arguments": {"a": "1", "b": "2"}}'
    assert tools.call_argument("[1, 2]") == "[1, 2]" and tools.call_argument("7") == "7"
