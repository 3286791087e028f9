"""The suite runs on the CPU where a GPU is visible too (tests/conftest.py): in this process and in
every process the tests launch, `python` and torchrun alike."""
import os
import sys

import torch

import test_dpo
import test_reward
import test_robustness
import test_sft


def test_tests_and_the_processes_they_launch_see_no_gpu():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert visible == ""
    assert not torch.cuda.is_available()
    for env in (test_dpo.ENV, test_reward.ENV, test_robustness.ENV):  # built at import, from os.environ
        assert env.get("CUDA_VISIBLE_DEVICES") == ""
    show = ["-c", "import os, torch; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"]
    one = test_sft.run(show)
    assert one.returncode == 0, one.stderr
    assert one.stdout.split() == ["''", "0"]
    two = test_sft.run(["--no-python", sys.executable, *show], nproc=2)  # each torchrun rank
    assert two.returncode == 0, two.stderr
    assert two.stdout.split() == ["''", "0"] * 2
