"""tests/two_processes.py: the suite split over two pytest processes runs every test exactly once,
keeps the files of a costly session fixture together, and fails when either process fails."""
import os
import subprocess
import sys
import types
import xml.etree.ElementTree

import two_processes
from helpers import ROOT


def fake_item(file, *fixtures, marked=()):
    """A collected test of `file` using `fixtures`; marked: the names of its session_fixtures mark."""
    marks = [types.SimpleNamespace(args=tuple(marked))] if marked else []
    return types.SimpleNamespace(nodeid=f"tests/{file}::test_x", fixturenames=["tmp_path", *fixtures],
                                 iter_markers=lambda name: marks if name == "session_fixtures" else [])


def test_files_sharing_a_costly_fixture_stay_together_and_the_rest_balance():
    """Hand case: a (100 s), b (60 s) and d (10 s) sharing two_ranks, c (50 s), e (unlisted: 1 s)
    sharing smollm2 with nothing else. Groups a = 100, {b, d} = 70, c = 50, e = 1: a to the first
    process, {b, d} to the second (70 < 100), c to the second (120), e to the first (101)."""
    items = [fake_item("a.py"), fake_item("b.py", "two_ranks"), fake_item("c.py"), fake_item("b.py", "two_ranks"),
             fake_item("d.py", "two_ranks", "user_models"), fake_item("e.py", "smollm2")]
    seconds = {"a.py": 100, "b.py": 60, "c.py": 50, "d.py": 10}
    (mine, theirs), load = two_processes.split(items, seconds)
    assert (mine, theirs) == (["tests/a.py", "tests/e.py"], ["tests/b.py", "tests/d.py", "tests/c.py"])
    assert load == [101, 120]


def test_a_file_using_both_shared_fixtures_joins_their_groups():
    """b uses two_ranks, c smollm2, d both: b, c and d are one group (3 s), whatever the order, and
    a (5 s) goes first."""
    items = [fake_item("b.py", "two_ranks"), fake_item("c.py", "smollm2"), fake_item("a.py"),
             fake_item("d.py", "smollm2", "two_ranks")]
    (mine, theirs), load = two_processes.split(items, {"a.py": 5})
    assert (mine, theirs, load) == (["tests/a.py"], ["tests/b.py", "tests/c.py", "tests/d.py"], [5, 3])


def test_a_file_marked_as_asking_for_a_shared_fixture_by_name_joins_its_users():
    """c asks for smollm2 by name (request.getfixturevalue: not among its fixturenames), marked so:
    it joins e, which uses smollm2, and a goes alone (2 s each). Unmarked, c and e part."""
    items = [fake_item("a.py"), fake_item("c.py", marked=["smollm2"]), fake_item("e.py", "smollm2")]
    seconds = {"a.py": 2, "c.py": 2, "e.py": 2}
    assert two_processes.split(items, seconds)[0] == (["tests/c.py", "tests/e.py"], ["tests/a.py"])
    items[1] = fake_item("c.py")
    assert two_processes.split(items, seconds)[0] == (["tests/a.py", "tests/e.py"], ["tests/c.py"])


CONFTEST = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
import two_processes
from two_processes import pytest_collection_modifyitems, pytest_sessionfinish, pytest_unconfigure
two_processes.MIN_SECONDS = 0
"""
TEST_FILE = """
import os
def test_{name}_{i}():
    with open(os.environ["RAN"], "a") as f:
        f.write(f"{name}_{i} {{os.getpid()}}\\n")
    assert {ok}
"""


def run_pytest(folder, *args, **env):
    (folder / "ran.txt").write_text("")
    outer = {k: v for k, v in os.environ.items() if k not in (two_processes.FILES_ENV, "RLHF_TEST_PROCESSES")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "--rootdir", str(folder),
                           "-c", str(folder / "pytest.ini"), str(folder)], cwd=folder, capture_output=True, text=True,
                          timeout=120, env={**outer, "RAN": str(folder / "ran.txt"), **env})
    ran = [line.split() for line in (folder / "ran.txt").read_text().splitlines()]
    return proc, sorted(name for name, _ in ran), {pid for _, pid in ran}


def test_every_test_runs_once_and_a_failure_in_the_second_process_fails_the_run(tmp_path):
    """Two files (1 s each, unlisted): test_a.py's two tests in this process, test_b.py's in the
    second, where one fails: each test ran exactly once, in two processes; the exit status is 1 and
    the failure is reported. RLHF_TEST_PROCESSES=1: the same tests in one process."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a.py").write_text("".join(TEST_FILE.format(name="a", i=i, ok=True) for i in range(2)))
    (tmp_path / "test_b.py").write_text(TEST_FILE.format(name="b", i=0, ok=True)
                                        + TEST_FILE.format(name="b", i=1, ok="1 == 2"))
    proc, ran, pids = run_pytest(tmp_path)
    out = proc.stdout + proc.stderr
    assert ran == ["a_0", "a_1", "b_0", "b_1"] and len(pids) == 2, (ran, pids, out)
    assert proc.returncode == 1, out
    assert "2 tests of 1 files run in a second pytest process" in out and "the second pytest process" in out, out
    assert "FAILED test_b.py::test_b_1" in out and "2 passed, 2 deselected" in out, out

    proc, ran, pids = run_pytest(tmp_path, RLHF_TEST_PROCESSES="1")
    assert ran == ["a_0", "a_1", "b_0", "b_1"] and len(pids) == 1 and proc.returncode == 1, proc.stdout
    assert "second pytest process" not in proc.stdout


def test_a_failure_in_this_process_fails_the_run_after_the_second_ends(tmp_path):
    """The failing test in the first process: exit status 1, and the second process's tests still ran."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a.py").write_text(TEST_FILE.format(name="a", i=0, ok="1 == 2"))
    (tmp_path / "test_b.py").write_text(TEST_FILE.format(name="b", i=0, ok=True))
    proc, ran, pids = run_pytest(tmp_path)
    assert ran == ["a_0", "b_0"] and len(pids) == 2 and proc.returncode == 1, proc.stdout


SLOW_TEST_FILE = """
import os, time
def test_{name}_0():
    time.sleep({sleep})
    assert {ok}
def test_{name}_1():
    pass
"""


def test_a_junitxml_file_holds_both_processes_tests_whichever_ends_last(tmp_path):
    """--junitxml, which each process would write, the last to end over the other's: test_a.py runs
    here, test_b.py in the second, a test of each fails; the second process ends last, then this
    one. Both times the XML holds all 4 tests and both failures; then all pass: 4 tests, 0 failures."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for ok, slow in ((False, "b"), (False, "a"), (True, "a")):
        for name in "ab":
            (tmp_path / f"test_{name}.py").write_text(SLOW_TEST_FILE.format(name=name, ok=ok,
                                                                            sleep=1.5 if name == slow else 0))
        proc = run_pytest(tmp_path, "--junitxml", "out.xml")[0]
        assert proc.returncode == (0 if ok else 1) and "the second pytest process (1 files)" in proc.stdout, proc.stdout
        suite = xml.etree.ElementTree.parse(tmp_path / "out.xml").getroot().find("testsuite")
        assert sorted(c.get("name") for c in suite.iter("testcase")) == ["test_a_0", "test_a_1", "test_b_0", "test_b_1"]
        assert (suite.get("tests"), suite.get("failures")) == ("4", "0" if ok else "2"), (slow, suite.attrib)
