"""Run every test, and every process a test launches, on the CPU.

The tests compare runs to 1e-5 (one process against two, a script against a reference), which
holds on CPU in fp32 with gloo but not under bf16 autocast and NCCL; and a two-process torchrun
on a one-GPU machine would put rank 1 on a cuda:1 that does not exist. Hiding CUDA here, at
import, comes before any test imports torch (pytest loads conftest.py first), and the
subprocess environments the tests build from os.environ inherit it. Timings and memory on a GPU
are bench/'s job (bench/steps.py).
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
