"""Several script runs, one after another, in one interpreter per rank and, under torchrun, one
process group for all of them:

    torchrun --nproc_per_node 2 tests/multi_run.py RESULTS.json -- NAME SCRIPT ARGS -- NAME SCRIPT ARGS ...

Each run is the script's own `cli.script(main, Config)`, as `python SCRIPT ARGS` runs it, without
the 3-4 s of imports of an interpreter of its own and the start of a torchrun for each. RESULTS.json
(rank 0's) gets each run's exit code as it ends; the first run that fails ends the job, since a rank
left waiting in a collective would wait out its timeout. helpers.run_many launches it.
"""
import importlib
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
from plumbing import cli, rundir  # noqa: E402


def runs_of(argv):
    """[NAME, SCRIPT, ARGS...] for each run of `-- NAME SCRIPT ARGS -- ...`."""
    runs = []
    for a in argv:
        if a == "--":
            runs.append([])
        else:
            runs[-1].append(a)
    return runs


def main(results, runs):
    leave = common.cleanup_distributed
    # torchrun's store hosts one process group: a second init after a destroy would wait forever
    common.cleanup_distributed = lambda: None
    codes = {}
    try:
        for name, script, *args in runs:
            module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
            sys.argv, code = [script, *args], 0
            try:
                cli.script(module.main, module.Config)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:  # a crash: its traceback, then out at once (below)
                traceback.print_exc()
                code = 1
            codes[name] = code
            if int(os.environ.get("RANK", 0)) == 0:
                with open(results, "w") as f:
                    json.dump(codes, f)
            if code:  # no barrier on the way out: the other ranks may sit in a collective the crash left
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # torchrun then stops them
            rundir.release()
    finally:
        common.cleanup_distributed = leave
        common.cleanup_distributed()


if __name__ == "__main__":
    os.chdir(ROOT)
    main(sys.argv[1], runs_of(sys.argv[2:]))
    # every run's code is written: skip the interpreter's finalisation, where gloo's threads can
    # std::terminate the process after the group is destroyed (tests/dist_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
