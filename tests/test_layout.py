"""The house's shape, checked so that it cannot drift: imports run one way (no cycle among the
project's modules, no project module imported inside a function, common.py on torch and the
standard library alone, with lm_head.py), each module within its size (a bigger one is several jobs: split it by
job), a GRPO step that reads no plumbing but what starts, logs and checkpoints a run, main()s that
read top to bottom, every knob passed by keyword, and the README's file table true.

    python tests/test_layout.py      # the import graph: modules, edges, cycles, function-level imports
"""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"grpo.py": 850, "sft.py": 400, "reward.py": 400, "dpo.py": 400}  # the most lines each script may have
MODULE_LINES = 650  # any other module: past this it is several jobs
MAIN = {"grpo.py": 150, "sft.py": 80, "reward.py": 80, "dpo.py": 80}
PLUMBING = "plumbing"


def project_files():
    """Every module of the project (the scripts, the shared modules, plumbing/ and studies/), by
    module name: tests, benchmarks and plots use it and are not part of it."""
    out = {}
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("tests", "bench", "plots", "runs", "docs")
                   and "site-packages" not in x]
        for f in files:
            if f.endswith(".py"):
                name = f[:-3] if rel == "." else f"{rel.replace(os.sep, '.')}.{f[:-3]}"
                out[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def tree(path):
    with open(path) as f:
        return ast.parse(f.read())


def import_graph():
    """{module: the project modules it imports}, and the imports made inside functions."""
    files = project_files()
    edges, inner = {m: set() for m in files}, []
    for module, path in files.items():
        t = tree(path)
        in_function = {id(n) for f in ast.walk(t) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        for node in ast.walk(t):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from plumbing import cli`: plumbing.cli
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                target = next((name[:i] for i in sorted({len(name), *(k for k, c in enumerate(name) if c == ".")},
                                                         reverse=True) if name[:i] in files), None)
                if target and target != module:
                    edges[module].add(target)
                    if id(node) in in_function:
                        inner.append(f"{path[len(ROOT) + 1:]}:{node.lineno} imports {target}")
    return edges, inner


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_imports_run_one_way():
    edges, inner = import_graph()
    assert not cycles(edges), cycles(edges)
    assert not inner, inner


def test_the_graph_check_finds_a_cycle_and_a_function_level_import():
    """The check itself: a cycle of three and an import inside a function are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module, allowed", [("common.py", {"torch", "lm_head"}), ("lm_head.py", {"torch"})])
def test_common_imports_only_torch_and_the_standard_library(module, allowed):
    """common.py on torch, the standard library and lm_head.py (the LM head, on torch alone)."""
    roots = {(a.name if isinstance(n, ast.Import) else n.module).split(".")[0]
             for n in ast.walk(tree(os.path.join(ROOT, module))) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in (n.names if isinstance(n, ast.Import) else n.names[:1])}
    assert roots <= set(sys.stdlib_module_names) | allowed, roots


@pytest.mark.parametrize("module", sorted(project_files()))
def test_each_module_is_one_job_within_its_size(module):
    """A module's first line says its job (its docstring); past MODULE_LINES it is several."""
    path = project_files()[module]
    with open(path) as f:
        n = f.read().count("\n")
    assert n <= SCRIPTS.get(os.path.relpath(path, ROOT), MODULE_LINES), (module, n)
    assert ast.get_docstring(tree(path)), module


def test_a_grpo_step_reads_no_plumbing_but_the_run_log_and_clock():
    """The loop of grpo.py's main reaches the plumbing only through `job` (the run's log and
    checkpoints) and `clock` (its phases' times): every module it names is one a step reads."""
    main = next(n for n in tree(os.path.join(ROOT, "grpo.py")).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    named = {n.value.id for n in ast.walk(loop) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    modules = named & (set(project_files()) | {"cli", "rundir", "checkpoints", "models", "logs"})
    assert modules <= {"common", "environment", "sampling", "shared_prompt", "tasks"}, modules


@pytest.mark.parametrize("name", MAIN)
def test_main_reads_top_to_bottom(name):
    main = next(n for n in tree(os.path.join(ROOT, name)).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= MAIN[name]
    inner = [n.name for n in ast.walk(main) if isinstance(n, ast.FunctionDef) and n is not main]
    assert not inner, inner


@pytest.mark.parametrize("module", sorted(project_files()))
def test_knobs_are_passed_by_keyword(module):
    """No call passes more than 5 arguments by position (a call's knobs are named where it is made)."""
    long = [f"{module}:{n.lineno}" for n in ast.walk(tree(project_files()[module]))
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
    assert {"grpo.py", "common.py", "sampling.py", "environment.py", "sft.py", "reward.py", "dpo.py"} <= set(stated)
    for name, n in stated.items():
        with open(os.path.join(ROOT, name)) as f:
            assert f.read().count("\n") == n, name


if __name__ == "__main__":
    graph, functions = import_graph()
    for m in sorted(graph):
        print(f"{m:22s} -> {', '.join(sorted(graph[m])) or '-'}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges, cycles {cycles(graph) or 'none'}, "
          f"function-level project imports {functions or 'none'}")
