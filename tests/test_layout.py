"""The layout the reading path keeps (issue 30), checked so that it cannot drift again: the line
budgets of the files a reader of the algorithms reads, main()s that read top to bottom (no
function defined inside them, at most 150 lines for grpo.py's and 80 for the others), every
knob passed by keyword (no call with more than 5 positional arguments in the scripts and the
modules they share), and the README a landing page."""
import ast
import os

import pytest

from helpers import ROOT

SCRIPTS = ("sft.py", "reward.py", "dpo.py", "grpo.py")
SHARED = ("common.py", "sampling.py", "data.py", "run.py", "tasks.py")
BUDGETS = {"common.py": 600, "grpo.py": 800, "README.md": 300}
READING_PATH = ("grpo.py", "common.py", "sampling.py")
MAIN = {"grpo.py": 150, "sft.py": 80, "reward.py": 80, "dpo.py": 80}


def lines(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read().count("\n")


def tree(name):
    with open(os.path.join(ROOT, name)) as f:
        return ast.parse(f.read())


@pytest.mark.parametrize("name", BUDGETS)
def test_file_budgets(name):
    assert lines(name) <= BUDGETS[name], (name, lines(name))


def test_the_reading_path_of_grpo_is_under_1700_lines():
    assert sum(lines(n) for n in READING_PATH) <= 1700, {n: lines(n) for n in READING_PATH}


@pytest.mark.parametrize("name", MAIN)
def test_main_reads_top_to_bottom(name):
    main = next(n for n in tree(name).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= MAIN[name]
    inner = [n.name for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not main
             and not isinstance(n, ast.Lambda)]
    assert not inner, inner


@pytest.mark.parametrize("name", SCRIPTS + SHARED)
def test_knobs_are_passed_by_keyword(name):
    """No call passes more than 5 arguments by position (a call's knobs are named where it is made)."""
    long = [f"{name}:{n.lineno}" for n in ast.walk(tree(name))
            if isinstance(n, ast.Call) and sum(not isinstance(a, ast.Starred) for a in n.args) > 5]
    assert not long, long


def test_the_readme_counts_the_lines_a_reader_reads():
    """The README's table of files states each one's lines: they are the files' own counts."""
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = [line.strip().strip("|").split("|") for line in f if line.startswith("| `")]
    stated = {}
    for cells in rows:
        names = [c.strip("` ") for c in cells[0].split(",")]
        counts = [c.strip() for c in cells[-1].split(",") if c.strip()]
        if counts:
            stated |= dict(zip(names, map(int, counts), strict=True))
    assert {"grpo.py", "common.py", "sampling.py", "sft.py", "reward.py", "dpo.py"} <= set(stated)
    assert stated == {name: lines(name) for name in stated}
