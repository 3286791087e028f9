"""tools.py: the calculator against Python's own arithmetic on random expressions and on powers,
what it refuses, and tools that raise, overrun or cannot be loaded (each an error text or a named
flag). Tools that hang, exit or kill their process: test_tool_safety.py."""
import random
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


def test_the_calculators_powers_are_pythons_and_only_huge_integers_are_refused():
    """Float powers are small numbers however large the exponent (1.0001**1000 = 1.105..., 0.5**200
    = 6.2e-61): the calculator's value equals Python's, each a different number. An integer power of
    more than 100 digits is refused before it is computed (2**10**9 would take minutes of this
    thread's CPU: refused in well under a second of it, which load does not stretch, as it does the
    wall clock), as is a float power past the float range."""
    for expr in ["1.0001 ** 1000", "0.5 ** 200", "1.5 ** 0.5", "2 ** -10", "0.999 ** 12345", "(-1.5) ** 3",
                 "7.25 ** 300", "2 ** 0.5 ** 2", "3 ** 200", "(-7) ** 117", "1 ** 10 ** 9", "0 ** 10 ** 9"]:
        want = eval(expr)  # noqa: S307 - Python's own arithmetic on the test's own text
        got = tools.calculator(expr)
        assert not got.startswith("error"), (expr, got)
        assert (int(got) == want) if isinstance(want, int) else (float(got) == want), (expr, got, want)
    t0 = time.thread_time()
    for expr in ["9 ** 9 ** 9", "2 ** 10 ** 9", "10 ** 101", "(-3) ** 10 ** 8", "1.5 ** 10 ** 6", "10.0 ** 400"]:
        assert tools.calculator(expr).startswith("error:"), expr
    assert time.thread_time() - t0 < 0.5


def test_a_tool_that_raises_or_overruns_returns_an_error_text():
    """A loaded tool's exception or overrun is an error text (every other way a tool can fail:
    test_tool_safety.py); a module-level function given to call_tool runs in a worker process too,
    which imports it by name (tools.calculator, as studies/smollm2.py passes it)."""
    tool = tools.load_tool("misbehaving_tools:misbehaves")
    assert tools.call_tool(tool, "raise") == "error: RuntimeError: no such city"
    assert tools.call_tool(tool, "sleep", timeout_s=0.2) == "error: the tool took longer than 0.2 s"
    assert tools.call_tool(tool, "6 * 7") == "42" and tools.call_tool(tools.calculator, "2 + 2") == "4"
    with pytest.raises(ValueError, match="imports it by name"):
        tools.call_tool(lambda text: text, "x")


def test_a_users_tool_loads_by_module_and_name_and_bad_names_are_refused_naming_the_flag():
    """A loaded tool answers as its function would; a bad spec is a ValueError naming the flag and
    the module (failures at import: test_tool_safety.py)."""
    assert tools.load_tool("calculator")("12 * (3 + 4)") == "84"
    for spec, why in [("no_such_module:f", "importing module 'no_such_module' failed: ModuleNotFoundError"),
                      ("misbehaving_tools:nothing", r"module 'misbehaving_tools' \(\S*/tests/misbehaving_tools\.py\) has "
                                                    r"no 'nothing'"),
                      ("misbehaving_tools:BEHAVIOURS", "misbehaving_tools.BEHAVIOURS is not a function"),
                      ("calculator2", "expected"), ("misbehaving_tools:", "expected")]:
        with pytest.raises(ValueError, match=f"--tools '{spec}': .*{why}"):
            tools.load_tool(spec)


def test_a_users_tool_loads_from_a_file_path_as_a_reward_function_does(tmp_path, monkeypatch):
    """`--tools path/to/my_tools.py:shout` loads the file in the tool's worker (as --reward_fn takes
    `examples/rewards.py:accuracy`), and so does `my_tools:shout` with my_tools.py in the working
    directory and no such module on the path; the function's own answer comes back."""
    (tmp_path / "my_tools.py").write_text("def shout(text):\n    return text.upper() + '!'\n")
    assert tools.call_tool(tools.load_tool(f"{tmp_path / 'my_tools.py'}:shout"), "abc") == "ABC!"
    monkeypatch.chdir(tmp_path)
    assert tools.call_tool(tools.load_tool("my_tools:shout"), "x y") == "X Y!"
    with pytest.raises(ValueError, match="--tools 'nowhere.py:shout': .*importing module 'nowhere.py' failed"):
        tools.load_tool("nowhere.py:shout")


def test_a_json_call_in_qwens_format_gives_the_tool_its_one_argument():
    """Qwen2.5's template asks for {"name": ..., "arguments": {...}} inside the call tags: the tool
    gets the one argument's value; plain text, other JSON and several arguments pass as written."""
    assert tools.call_tool(tools.calculator, '{"name": "calculator", "arguments": {"expression": "12 * 34"}}') == "408"
    assert tools.call_tool(tools.calculator, "12 * 34") == "408"
    assert tools.call_argument('{"arguments": {"a": "1", "b": "2"}}') == '{"arguments": {"a": "1", "b": "2"}}'
    assert tools.call_argument("[1, 2]") == "[1, 2]" and tools.call_argument("7") == "7"
