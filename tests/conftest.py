"""Run every test, and every process a test launches, on the CPU.

The tests compare runs to 1e-5 (one process against two, a script against a reference), which
holds on CPU in fp32 with gloo but not under bf16 autocast and NCCL; and a two-process torchrun
on a one-GPU machine would put rank 1 on a cuda:1 that does not exist. Hiding CUDA here, at
import, comes before any test imports torch (pytest loads conftest.py first), and the
subprocess environments the tests build from os.environ inherit it. Timings and memory on a GPU
are bench/'s job (bench/steps.py).

Fixtures shared by several test files are below; constants and plain helpers are in
tests/helpers.py (`from helpers import ...`: conftest.py is loaded by pytest, not imported).
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests, restored afterwards; a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`. Models this small gain nothing
    from a second thread, and on a shared 2-core machine OpenMP threads wait on each other
    (2-3x slower, 100x while other jobs ran)."""
    import torch  # here, not at the top: CUDA is hidden before torch is first imported

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
