"""Run a training script as `python` or torchrun would, but make this process fail at a chosen point.

    python tests/crash.py after_save:N    sft.py ARGS   # die (os._exit) right after the N-th checkpoint is written
    python tests/crash.py at_rename:N     sft.py ARGS   # die at the N-th os.rename of a run file (checkpoints.RUN_FILES:
                                                        # checkpoint folders, metrics): a kill while a checkpoint is
                                                        # written (the renames inside torch.distributed.checkpoint's
                                                        # own writing are not counted)
    python tests/crash.py raise_on_rank:R sft.py ARGS   # rank R raises at its first optimizer step: a failing rank
    python tests/crash.py block_at_step:N sft.py ARGS   # the N-th optimizer step blocks in C for ever (a step that
                                                        # takes minutes in one call), saying "blocked" on stderr
    python tests/crash.py hold_save:N     sft.py ARGS   # the N-th checkpoint's write, once begun, waits until a
                                                        # process opens the FIFO $HOLD_FIFO for writing (a save that
                                                        # takes minutes), saying "holding the save" on stderr

os._exit skips every cleanup handler, like a SIGKILL. The scripts carry no test hooks: the
failure is patched in from here.
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from plumbing import checkpoints  # noqa: E402

mode, n = sys.argv[1].split(":")
n = int(n)
script, args = sys.argv[2], sys.argv[3:]
calls = {"count": 0}

if mode == "after_save":
    original = checkpoints.save_checkpoint

    def save_then_die(*a, **kw):
        path = original(*a, **kw)
        calls["count"] += 1
        if calls["count"] == n:
            os._exit(9)
        return path

    checkpoints.save_checkpoint = save_then_die
elif mode == "at_rename":
    rename = os.rename

    def rename_or_die(src, dst):
        name = os.path.basename(os.path.normpath(dst))
        if name not in checkpoints.RUN_FILES and ".replaced-" not in name:
            return rename(src, dst)
        calls["count"] += 1
        if calls["count"] == n:
            os._exit(9)
        return rename(src, dst)

    os.rename = rename_or_die
elif mode == "raise_on_rank":
    clip = common.clip_grad_norm

    def clip_or_raise(*a, **kw):
        if int(os.environ.get("RANK", 0)) == n:
            raise RuntimeError(f"injected failure on rank {n}")
        return clip(*a, **kw)

    common.clip_grad_norm = clip_or_raise
elif mode == "block_at_step":
    import ctypes

    step = common.optimizer_step

    def step_or_block(*a, **kw):
        calls["count"] += 1
        if calls["count"] == n:
            libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
            libc.pthread_mutex_lock(mutex)
            print("blocked", file=sys.stderr, flush=True)
            libc.pthread_mutex_lock(mutex)  # never returns, and no signal interrupts it; ctypes releases the GIL
        return step(*a, **kw)

    common.optimizer_step = step_or_block
elif mode == "hold_save":
    write = checkpoints._write_export  # inside save_checkpoint, after the sharded state is written

    def held(*a, **kw):
        calls["count"] += 1
        if calls["count"] == n:
            print("holding the save", file=sys.stderr, flush=True)
            with open(os.environ["HOLD_FIFO"]):  # blocks until a writer opens it; a signal's handler runs meanwhile
                pass
        return write(*a, **kw)

    checkpoints._write_export = held
else:
    raise SystemExit(f"unknown mode {mode}")

sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
