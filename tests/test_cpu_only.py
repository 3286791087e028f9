"""The suite runs on the CPU where a GPU is visible too (tests/conftest.py): in this process and in
every process the tests launch, `python` and torchrun alike."""
import os
import sys

import torch

from helpers import SUBPROCESS_ENV, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, run_script


def test_tests_and_the_processes_they_launch_see_no_gpu():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert visible == ""
    assert not torch.cuda.is_available()
    for env in (SUBPROCESS_ENV, SUBPROCESS_ENV_NO_TOKENIZER_THREADS):  # built at import, from os.environ
        assert env.get("CUDA_VISIBLE_DEVICES") == ""
    # one write(2) of a short line: the two ranks share the pipe, and print's separate writes of
    # each item could interleave between them
    show = ["-c", "import os, torch; v = repr(os.environ.get('CUDA_VISIBLE_DEVICES')); "
                  "os.write(1, f'{v} {torch.cuda.device_count()}\\n'.encode())"]
    one = run_script(show, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines() == ["'' 0"]
    two = run_script(["--no-python", sys.executable, *show], nproc=2,  # each torchrun rank
                     env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    assert two.returncode == 0, two.stderr
    assert two.stdout.splitlines() == ["'' 0"] * 2
