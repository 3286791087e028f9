"""The suite split over two pytest processes, one for each core of the 2-core machines it runs on.

Every test, and every process a test launches, runs torch on one thread (conftest.one_torch_thread,
helpers.SUBPROCESS_ENV: models this small gain nothing from a second), and a launched script spends
its first 6-8 s importing torch and transformers on one core. So one pytest process keeps a 2-core
machine 50-65% busy (its user + system time over wall time: 1.03 cores through
tests/test_robustness.py, 1.3 through test_distributed.py and test_memory_model.py).

When pytest collects tests from more than one file, this hands some of the files to a second pytest
process, started right after collection with the same arguments, runs the others itself, waits for
the second, prints its report after its own, and exits with a failure if either failed. The split
is by file and the same on every run: which tests share a process, and in which order they run,
never depends on timing. Files that use a costly session fixture (SHARED) stay in one process, so it
is built once (a file that asks for one by name, request.getfixturevalue, says so with
`pytestmark = pytest.mark.session_fixtures("smollm2")`); then each file (or group of files) goes to
the process with fewer expected seconds (SECONDS). RLHF_TEST_PROCESSES=1 runs everything in one
process, as does a machine of one core. Given --junitxml, the second writes its XML apart and the
first merges it into its own (both writing the one file, the last to end would keep only its tests).
pytest's cache, which both would write too (`--lf`), is off (pyproject.toml: -p no:cacheprovider).
"""
import atexit
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree

import pytest

FILES_ENV = "RLHF_TEST_FILES"  # set in the second process: the test files it runs, joined by os.pathsep
SHARED = ("two_ranks", "smollm2")  # one torchrun of every 2-rank run; the GGUF conversion (~40 s)
MIN_SECONDS = 60  # a second process costs one more collection (~12 s): not below this much work
# Seconds each file takes on the 2-core AMD EPYC (Zen 4), both processes running (`--durations=0`, summed
# by file; a session fixture's time goes to the first file that asks for it), to balance them; a file not listed
# counts 1 s.
SECONDS = {
    "test_distributed.py": 110, "test_robustness.py": 103, "test_docs_commands.py": 67, "test_memory_model.py": 55,
    "test_gpu_path.py": 54, "test_exact.py": 48, "test_first_day.py": 46, "test_families.py": 42, "test_bench.py": 40,
    "test_generation_micro_batch.py": 36, "test_plots.py": 35, "test_edge_cases.py": 33, "test_reward_safety.py": 29,
    "test_dispatch.py": 27, "test_sampler.py": 24, "test_common.py": 18, "test_packing.py": 17, "test_dpo.py": 10,
    "test_cpu_only.py": 9, "test_grpo.py": 9, "test_two_processes.py": 9, "test_smollm2.py": 8, "test_speed.py": 7,
    "test_reward.py": 7, "test_tool_safety.py": 6, "test_variants.py": 5,
    "test_tool_cache.py": 5, "test_reward_fns.py": 4, "test_frozen_bf16.py": 4, "test_user_path.py": 3,
    "test_lora.py": 3, "test_sft.py": 2, "test_layout.py": 2,
}


def split(items, seconds=SECONDS):
    """(files of this process, files of the second) for the collected items: files that use one of
    the SHARED fixtures grouped (a group shares each such fixture its files use), then the groups,
    heaviest first, each to the process with fewer expected seconds so far."""
    groups = []  # [(shared fixtures used, [files])], in the order of collection
    for item in items:
        marked = [a for m in item.iter_markers("session_fixtures") for a in m.args]
        file, used = _file(item), {f for f in SHARED if f in item.fixturenames or f in marked}
        mine = [g for g in groups if file in g[1] or g[0] & used]
        merged = (set(used).union(*(g[0] for g in mine)), [f for g in mine for f in g[1]])
        if file not in merged[1]:
            merged[1].append(file)
        groups = [g for g in groups if g not in mine] + [merged]
    weight = {id(g): sum(seconds.get(os.path.basename(f), 1) for f in g[1]) for g in groups}
    load, parts = [0, 0], ([], [])
    for g in sorted(groups, key=lambda g: -weight[id(g)]):
        k = 0 if load[0] <= load[1] else 1
        load[k] += weight[id(g)]
        parts[k].extend(g[1])
    return parts, load


def _file(item):
    return item.nodeid.split("::")[0]


def _keep(config, items, files):
    """Deselect the items outside `files`, as -k does; returns how many."""
    files = set(files)
    dropped = [i for i in items if _file(i) not in files]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [i for i in items if _file(i) in files]
    return len(dropped)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    if os.environ.get(FILES_ENV):  # the second process: its share
        _keep(config, items, os.environ[FILES_ENV].split(os.pathsep))
        return
    if (os.environ.get("RLHF_TEST_PROCESSES") == "1" or (os.cpu_count() or 1) < 2 or config.option.collectonly
            or config.getoption("usepdb", False)):
        return
    (mine, theirs), load = split(items)
    if not theirs or min(load) < MIN_SECONDS:
        return
    args, xml = list(config.invocation_params.args), None
    if config.option.basetemp:  # the two processes' tmp_path folders apart
        args += ["--basetemp", f"{config.option.basetemp}-second"]
    if getattr(config.option, "xmlpath", None):  # the last --junitxml counts: the second's XML apart
        xml = tempfile.TemporaryDirectory(prefix="pytest-second-")
        args += ["--junitxml", os.path.join(xml.name, "junit.xml")]
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=config.invocation_params.dir,
                            env={**os.environ, FILES_ENV: os.pathsep.join(theirs)}, stdout=out, stderr=subprocess.STDOUT,
                            text=True)
    atexit.register(lambda: proc.poll() is None and proc.kill())
    config.stash[_SECOND] = (proc, out, len(theirs), xml)
    n = _keep(config, items, mine)
    config.get_terminal_writer().line(f"{n} tests of {len(theirs)} files run in a second pytest process "
                                      f"(tests/two_processes.py); its report follows this one's")


_SECOND, _FIRST = pytest.StashKey(), pytest.StashKey()


def pytest_sessionfinish(session, exitstatus):
    """Wait for the second process (end it when this one stops early: -x, Ctrl-C) and fail if it failed."""
    second = session.config.stash.get(_SECOND, None)
    if second is None:
        return
    proc = second[0]
    if session.shouldfail or session.shouldstop or exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.terminate()
    code = proc.wait()
    session.config.stash[_FIRST] = int(session.exitstatus)
    if code != 0 and session.exitstatus == 0:
        session.exitstatus = code


def merge_junit(path, other):
    """The second process's test cases and counts into this one's --junitxml file (one testsuite each)."""
    tree = xml.etree.ElementTree.parse(path)
    mine, theirs = tree.getroot().find("testsuite"), xml.etree.ElementTree.parse(other).getroot().find("testsuite")
    for key in ("tests", "errors", "failures", "skipped"):
        mine.set(key, str(int(mine.get(key, 0)) + int(theirs.get(key, 0))))
    mine.set("time", str(max(float(mine.get("time", 0)), float(theirs.get("time", 0)))))  # they ran side by side
    mine.extend(theirs.findall("testcase"))
    tree.write(path, encoding="utf-8", xml_declaration=True)


def pytest_unconfigure(config):
    """The second process's --junitxml merged into this one's, and its report after this one's last line."""
    second = config.stash.get(_SECOND, None)
    if second is None:
        return
    proc, out, files, xml = second
    if xml is not None:
        if os.path.exists(os.path.join(xml.name, "junit.xml")):  # not when -x or Ctrl-C ended it first
            merge_junit(os.path.join(config.invocation_params.dir, config.option.xmlpath),
                        os.path.join(xml.name, "junit.xml"))
        xml.cleanup()
    out.seek(0)
    writer = config.get_terminal_writer()
    writer.sep("=", f"the second pytest process ({files} files), exit status {proc.returncode}")
    writer.write(out.read())
    first, second = config.stash.get(_FIRST, None), proc.returncode
    writer.sep("=", f"exit status {first} here, {second} in the second process: "
                    + ("all passed" if first == second == 0 else "FAILED"), red=bool(first or second),
               green=not (first or second))
    writer.flush()
