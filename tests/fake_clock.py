"""Run a training script with rundir.clock (what --save_minutes reads) advanced a fixed number of
minutes at each optimizer step, each rank its own, and a line on stdout at each resumable save
(rank 0's):

    torchrun --nproc_per_node 2 tests/fake_clock.py 4,0 sft.py ARGS   # rank 0's clock: 4 min a step; rank 1's: 0

so that a test drives checkpoints by the clock by steps, not by sleeping."""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from plumbing import checkpoints, rundir  # noqa: E402

rank = int(os.environ.get("RANK", 0))
minutes = float(sys.argv[1].split(",")[rank])
script, args = sys.argv[2], sys.argv[3:]
now = [0.0]
step, save = common.optimizer_step, checkpoints.save_checkpoint


def timed_step(*a, **kw):
    now[0] += 60 * minutes
    return step(*a, **kw)


def saving(*a, **kw):
    path = save(*a, **kw)
    if kw.get("step") and rank == 0:  # rank 0 alone: two ranks' lines on one pipe can interleave
        os.write(1, f"saved at step {kw['step']} on rank 0\n".encode())  # one write, not print's two
    return path


rundir.clock = lambda: now[0]
common.optimizer_step = timed_step
checkpoints.save_checkpoint = saving
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
