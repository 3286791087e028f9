"""Constants and helpers shared by the test files: where the repository is, the environment of
the processes the tests launch, running a script, and reading and writing what scripts read
and write. Fixtures are in conftest.py.

A plain module, imported as `from helpers import ...` (pytest puts tests/ on sys.path, as it
does for `import test_dpo`). Not conftest.py: pytest loads that file itself, under the module
name `conftest` that every conftest.py outside a package shares, and under
--import-mode=importlib it is not importable at all.
"""
import contextlib
import json
import math
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""the repository root: every script a test runs is run from here"""

SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
"""the environment of the scripts the tests launch: this process's, with CUDA hidden (conftest.py
runs before this module is imported) and one OpenMP thread: on a shared 2-core machine a tiny
model runs 2-3x faster without OpenMP's thread hand-offs"""

SUBPROCESS_ENV_NO_TOKENIZER_THREADS = {**SUBPROCESS_ENV, "TOKENIZERS_PARALLELISM": "false"}
"""the same, with the tokenizers library's thread pool off too (the sft.py and tests/crash.py
runs, and the sampler's torchrun)"""


HANG_GUARD_S = 900.0
"""how long a test waits for an event (a file, a line, a process's end) before it calls the wait a
hang: the end of a test that would otherwise wait for ever, never a bound on how fast anything must
be (on a loaded 2-core machine a pipeline's first stage took 108 s to start)"""


def wait_until(done, proc=None, what="the event", guard_s=HANG_GUARD_S):
    """Wait for done() (a file written, a process gone): checked every 50 ms; an AssertionError if
    proc (a Popen) ends first, or after guard_s seconds (a hang guard)."""
    start = time.monotonic()
    while not done():
        assert proc is None or proc.poll() is None, f"the process ended (status {proc.returncode}) before {what}"
        assert time.monotonic() - start < guard_s, f"no {what} after {guard_s:g} s: a hang"
        time.sleep(0.05)


class InjectedClock:
    """plumbing/workers.py's clock (its `time` module) at a time of the test's, so that a time limit is
    read, not raced against the machine's load: `now` moves only while the trainer waits for a reply
    (multiprocessing.connection.wait, which Connection.poll calls too), and only by the whole wait,
    once blocked() says that the calls it waits for will never reply (a marker file a function
    writes as it blocks); until then the wait is real, and a reply ends it with `now` unmoved. So a
    call that blocks is stopped exactly its time limit after it was sent, and one that replies never
    is, however slowly the machine runs. A call whose limit is not read on this clock (its waits
    bypassed: the clock read again and again) fails after `readings` readings instead of hanging."""

    def __init__(self, blocked, readings=1000):
        self.now, self.blocked, self.readings, self.unwaited = 0.0, blocked, readings, 0
        self.real_wait = multiprocessing.connection.wait

    def monotonic(self):
        self.unwaited += 1
        assert self.unwaited < self.readings, "the call's time limit is not read on the injected clock"
        return self.now

    def wait(self, objects, timeout=None):
        self.unwaited = 0
        while True:
            ready = self.real_wait(objects, 0.01)
            if ready:
                return ready
            if timeout is not None and self.blocked():
                self.now += timeout
                return []

    def __getattr__(self, name):  # the rest of the time module, as it is
        return getattr(time, name)


@contextlib.contextmanager
def injected_clock(blocked):
    """plumbing/workers.py timing its calls on an InjectedClock(blocked) inside the block; yields it."""
    from plumbing import workers

    clock = InjectedClock(blocked)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workers, "time", clock)
        mp.setattr(multiprocessing.connection, "wait", clock.wait)
        yield clock


def launcher(nproc=1):
    """The command that starts a Python script: `python`, or torchrun with nproc processes on
    this machine (a standalone rendezvous on a free port)."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_script(args, nproc=1, timeout=HANG_GUARD_S, env=SUBPROCESS_ENV):
    """Run `python ARGS` (torchrun with nproc processes when nproc > 1) in ROOT; return the
    CompletedProcess, its stdout and stderr as text. env=None: this process's environment.

    A run past its timeout, or a Ctrl-C, stops it and raises. torchrun starts each rank in a
    session of its own, out of reach of a kill aimed at torchrun, and stops them on SIGTERM; so
    SIGTERM first, SIGKILL only a minute later: ranks left behind would sit in a collective for
    its whole timeout."""
    p = subprocess.Popen(launcher(nproc) + list(args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:  # a run that hangs, or Ctrl-C
        p.terminate()
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_here(args, cwd=ROOT):
    """`python SCRIPT ARGS` run in this process, as run_script returns it: the script's
    `cli.script(main, Config)` under sys.argv = [SCRIPT, *ARGS], from `cwd` (the working directory
    its relative paths land in; ROOT), on one torch thread,
    with its stdout and stderr captured; returncode 0, a SystemExit's code, or 1 with the
    traceback on stderr. It saves the 6-8 s a new interpreter spends importing torch and
    transformers. What only a process of its own shows (a kill, a signal, torchrun's ranks, an
    environment) stays with run_script."""
    import contextlib
    import importlib
    import io
    import traceback

    import torch

    from plumbing import cli, rundir

    script, *rest = args
    module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, old_cwd, threads = sys.argv, os.getcwd(), torch.get_num_threads()
    sys.argv = [script, *rest]
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.script(module.main, module.Config)
            except SystemExit as e:  # argparse's errors, Ctrl-C's 130
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
            finally:
                rundir.release()  # the process group and the out_dir lock of the run
    finally:
        sys.argv = argv
        os.chdir(old_cwd)
        torch.set_num_threads(threads)
        rundir.INTERRUPTED = None  # a Ctrl-C the run took ends with it, as it would with its process
    return subprocess.CompletedProcess([sys.executable, *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def ctrl_c_after_first_save():
    """A Ctrl-C (KeyboardInterrupt) right after a run in this process writes its first checkpoint:
    the run ends with 130 and the checkpoint is what a resume starts from."""
    from plumbing import checkpoints

    save = checkpoints.save_checkpoint

    def saving(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(checkpoints, "save_checkpoint", saving)
        yield


def start_as_a_terminal_does(argv, env, folder):
    """`python ARGV` started in a session of its own with SIGINT at its default, as a terminal starts
    it (a suite run as `cmd &` has SIGINT ignored, and an ignored signal stays ignored in a child);
    its output to FOLDER/out and FOLDER/err. Returns the Popen."""
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
            return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=out, stderr=err,
                                    start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, sigint)


def run_many(runs, results, nproc=2, timeout=HANG_GUARD_S):
    """Several script runs, [NAME, SCRIPT, ARGS...] each, in one torchrun of nproc processes
    (tests/multi_run.py): one start of torchrun and its interpreters for all of them. Returns the
    CompletedProcess and {NAME: exit code} of the runs that ended (results: the JSON file)."""
    argv = ["tests/multi_run.py", str(results)]
    for r in runs:
        argv += ["--", *map(str, r)]
    proc = run_script(argv, nproc, timeout, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    codes = json.load(open(results)) if os.path.exists(results) else {}
    return proc, codes


TWO_RANK_RUNS = {}
"""NAME -> fn(folder, models) -> [SCRIPT, ARGS...] (models: conftest.py's `user_models`): the 2-rank side of a "2 processes = 1 process" test,
registered by its test file when pytest imports it; conftest.py's `two_ranks` runs them all in
one torchrun of 2 processes (run_many), once a session, each writing into its folder."""


def read_metrics(out_dir):
    """The rows of a run's metrics.jsonl, one dict per logged step."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def write_jsonl(path, rows):
    """Write rows (dicts, or strings written as they are) one a line; return the path as a string."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def checkpoint_weights(out_dir, name="checkpoint"):
    """The tensors of out_dir/name/model.safetensors, by name; of a resumable checkpoint (sharded/
    state only: --save_every's), those of its export (checkpoints.export, into a temporary folder)."""
    import tempfile

    from safetensors.torch import load_file  # here: test files without torch need not load it

    folder = os.path.join(out_dir, name)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return load_file(os.path.join(folder, "model.safetensors"))
    from plumbing import checkpoints

    with tempfile.TemporaryDirectory() as tmp:
        return load_file(os.path.join(checkpoints.export(folder, tmp), "model.safetensors"))


def max_abs_diff(a, b):
    """The largest absolute difference between two checkpoints' tensors, which must have the same names."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -----------------------------------------------------------------------------
# how far two float computations of one value may lie apart: bounds derived from the arithmetic,
# never a constant that held on one machine (the suite runs on Intel Xeons and AMD Zen 3 and Zen 4,
# whose kernels block their sums differently)

U32 = 2.0 ** -24
"""float32's unit roundoff: rounding to nearest moves a result by at most this share of its size"""

U64 = 2.0 ** -53
"""float64's unit roundoff"""


def gamma(k, u=U32):
    """Higham's gamma_k = k u / (1 - k u) (Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    2002, Lemma 3.1 and Eq. 3.5): a sum or dot product of k floating-point terms, added in any order
    (a kernel's blocking, a rank's share first), lies within gamma_k x (the sum of the terms'
    magnitudes) of the exact value; two computations of it, within twice that of each other."""
    return k * u / (1 - k * u)


LAMBDA = 8.0
"""how many standard deviations of rounding error fp32_rtol allows: Higham and Mary's bound is
exceeded with probability at most 2 exp(-LAMBDA^2 / 2) = 2.5e-14 per sum"""


def fp32_rtol(lengths):
    """How far apart, relative to its size, two float32 computations of one value may lie when they
    add the same terms in other orders (another batch shape, padding or packing, a prompt shared,
    another rank's share, a compiled kernel), the value computed through sums or dot products of
    these lengths (forward_lengths, gradient_lengths). A sum of k terms, its rounding errors taken
    as independent random variables (as a blocked, vectorised kernel's are), lies within
    LAMBDA sqrt(k) u of the sum of its terms' magnitudes (Higham and Mary, SIAM J. Sci. Comput.
    41(5), 2019, Thm 3.1; gamma's worst case is k u); the sums' errors add up in quadrature, each
    reaching the value with a gain of at most 1 (norms and the softmax keep a relative error
    relative: a random or lightly trained model has no ill-conditioned step); and each of the two
    computations is off by that much: 2 LAMBDA u sqrt(sum of the lengths). About 5e-5 for the
    tests' models (helpers.build_user_models' at 150 tokens: 4.3e-5; the embedded model at 40: 7.9e-5)."""
    return 2 * LAMBDA * U32 * math.sqrt(sum(lengths))


def forward_lengths(config, length):
    """The lengths of the sums on one token's way through a decoder of this transformers config
    (Llama, Qwen2, GPT-2; a reward model's) at `length` tokens of context: per layer the q, k, v
    and output projections, the MLP's up and gate projections (the hidden size each), its down
    projection (the intermediate size), the attention's scores (the head size) and weighted values
    (the context) and 2 norms (the hidden size); then the final norm, the head (the hidden size)
    and the log-softmax's sum (the vocabulary)."""
    c = config.get_text_config()
    h = c.hidden_size
    ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * h
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    return ([h] * 6 + [ff, head, length, h, h]) * c.num_hidden_layers + [h, h, c.vocab_size]


def gradient_lengths(config, length, tokens, norm_terms=None):
    """The sums behind a gradient norm: the forward's (forward_lengths) and their transposes in the
    backward, each weight's gradient summed over the `tokens` of a micro-batch, and the norm's sum
    of squares where the two runs add them in other orders: under FSDP each rank sums its shard of
    each tensor first (norm_terms None: the largest tensor's elements, an embedding's or the MLP's);
    0 where both sum the same tensors alike (one process each: the same kernel on the same shapes).
    (torch's vector_norm adds in blocks, not a cascade: 5e-5 relative error at 1e7 positive terms.)"""
    c = config.get_text_config()
    ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    if norm_terms is None:
        norm_terms = c.hidden_size * max(c.vocab_size, ff)
    forward = forward_lengths(config, length)
    return forward + forward + [tokens, norm_terms]


def adam_drift(lr, steps, betas=(0.9, 0.95), t0=0):
    """The most one weight of two AdamW runs can differ by after `steps` optimizer steps at peak
    learning rate `lr` (common.make_optimizer's betas), from equal weights and moments, whatever
    float noise their gradients differ by. A step moves a weight by lr_t (m_hat / (sqrt(v_hat) +
    eps) + wd w): the decay shrinks a difference, and by Cauchy-Schwarz |m_hat| / sqrt(v_hat) <=
    B_t = (1 - b1) / (1 - b1^t) sqrt((1 - b2^t) / (1 - b2)) sqrt(sum_{j<t} (b1^2 / b2)^j) (1 at
    t = 1, 1.0003 at t = 2, never above 1.17): whatever the gradient, about lr. So noise in a
    gradient near 0 (terms that cancel), which can flip its sign, moves the two runs' weight apart
    by up to 2 lr B_t a step: Adam normalises noise into lr-sized steps, and no tighter bound holds
    weight by weight. Summed over the steps (Adam's t0 + 1 to t0 + steps: t0 those both runs took
    alike, a resumed checkpoint's), with float32's rounding of each updated weight (|w| < 4 here)."""
    b1, b2 = betas
    out = 0.0
    for t in range(t0 + 1, t0 + steps + 1):
        s = sum((b1 * b1 / b2) ** j for j in range(t))
        out += 2 * lr * (1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2) * s) + 2 * 4 * U32
    return out


def drift_atol(lr, steps, grad_norm, t0=0):
    """How far apart two runs' losses may lie once their weights have drifted apart (adam_drift
    after `steps` optimizer steps): to first order the loss moves by g . dw, g its gradient (norm
    grad_norm, the run's log). The drift is float noise that Adam scaled up, its signs independent of
    g, so g . dw is a sum of independent terms each within |g_i| adam_drift, and by Hoeffding's
    inequality it stays within LAMBDA adam_drift |g| (exceeded with probability 2 exp(-LAMBDA^2 / 2)).
    A systematic difference (other rows, another learning rate, a rank's shard not stepped) moves
    the loss by about lr |g|_1, sqrt(n_params) times more: the bound keeps its teeth."""
    return LAMBDA * adam_drift(lr, steps, t0=t0) * grad_norm


def assert_runs_agree(one, two, config, length, lr, keys=("loss", "grad_norm"), updates=1, tokens=1024,
                      norm_terms=None, scales=None, start_keys=(), start=0):
    """Two runs' logged rows (metrics.jsonl) step for step (1 process and N, packed and padded,
    prompts shared or not, a reference precomputed or live), within bounds derived from the
    arithmetic, for a model of this config at `length` tokens trained at peak learning rate lr with
    `updates` optimizer steps a step:
    - a key whose forwards all ran on the weights both runs started from (step 0's evaluation; step
      1's training metrics where one optimizer step follows them, updates == 1; `start_keys`, measured
      before a step's first update, as a GRPO rollout's rewards, at step 1; every key at lr 0) within
      fp32_rtol of its size (scales: KEY -> keys whose sizes, or numbers that bound the sizes of the
      terms it is computed from: a margin's log-probs, a policy loss's advantages), a grad_norm
      within that of its sums (gradient_lengths; tokens: a micro-batch's at most; norm_terms 0 for
      two runs of one process each);
    - once either run has stepped, the weights may differ by adam_drift: the loss alone, within its
      rounding plus drift_atol of the runs' grad norm (a step's largest at most `updates` times the
      logged mean); no other key has a bound short of the weights themselves (a sampled token can
      flip, a near-tie of the eval's order), and none is compared;
    - the learning rate of every step, exactly: the same schedule.
    start: the step after which both runs' weights were equal (a checkpoint both resumed from)."""
    assert [r["step"] for r in one] == [r["step"] for r in two]
    forward = fp32_rtol(forward_lengths(config, length))
    gradient = fp32_rtol(gradient_lengths(config, length, tokens, norm_terms))
    compared = 0
    for a, b in zip(one, two):
        assert a.get("lr") == b.get("lr"), (a["step"], a.get("lr"), b.get("lr"))
        for key in (k for k in keys if k in a):
            step = a["step"] - start
            if key.startswith(("eval/", "normalize/")):  # after the step's updates
                after = step * updates
            else:  # before the step's first update, or through its last
                after = (step - 1) * updates if key in start_keys else step * updates - 1
            size = max(abs(a[key]), abs(b[key]),
                       *(abs(a[k]) if isinstance(k, str) else k for k in (scales or {}).get(key, ())))
            if after <= 0 or lr == 0:  # every forward behind it on the starting weights
                bound = (gradient if key == "grad_norm" else forward) * size
            elif key == "loss":
                bound = forward * size + drift_atol(lr, after, updates * max(a["grad_norm"], b["grad_norm"]),
                                                    t0=start * updates)
            else:
                continue
            assert abs(a[key] - b[key]) <= bound, (a["step"], key, a[key], b[key], bound)
            compared += 1
    assert compared, "no key was compared"


def logit_size(model):
    """The most the magnitudes of any logit's (or score's) terms can add up to: the head's row w_v
    dotted with the final norm's output h, sum_i |w_vi h_i| <= |w_v| |h| (Cauchy-Schwarz), and a
    normalised vector has RMS 1, so |h| <= sqrt(hidden) max_i (|gain_i| + |bias_i|), read off the
    norm's output for +-1 and -+1 (mean 0, RMS 1: LayerNorm's, RMSNorm's and Gemma's 1 + w alike)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else model.score
    norm = [m for m in model.modules() if "norm" in type(m).__name__.lower()][-1]  # the last: the final norm
    H = model.config.get_text_config().hidden_size
    x = torch.ones(1, H)
    x[:, 1::2] = -1
    with torch.no_grad():
        gain = torch.stack([norm(x), norm(-x)]).abs().max().item()
    bias = head.bias.abs().max().item() if head.bias is not None else 0.0
    return head.weight.norm(dim=1).max().item() * H ** 0.5 * gain + bias


def logprob_size(model, temperature=1.0):
    """The most the magnitudes of a log-prob's terms can add up to at temperature T: the token's logit
    and the log-sum-exp, which lies within ln V of the largest logit: 2 logit_size / T + ln V."""
    return 2 * logit_size(model) / temperature + math.log(model.config.get_text_config().vocab_size)


def assert_layouts_agree(got, want, rtol, size, what=""):
    """Two layouts' float32 results of one computation (log-probs, scores, a loss), each within
    rtol x size of the other: size bounds the magnitudes of each value's terms (logprob_size)."""
    err = (got - want).abs().max().item()
    assert err <= rtol * size, (what, err, rtol * size)


def assert_gradients_agree(got, want, rtol, what=""):
    """Two layouts' gradients (flattened), in norm: within rtol of the larger norm (fp32_rtol's
    errors add up in quadrature over the elements as over the sums)."""
    err, norm = (got - want).norm().item(), max(got.norm().item(), want.norm().item())
    assert err <= rtol * norm, (what, err, rtol * norm)


def checkpoint_config(out_dir, name="checkpoint"):
    """The transformers config of out_dir/name (a run's export or resumable checkpoint)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.join(out_dir, name))


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(*turns):
    """("user", "hi"), ("assistant", "hello") -> TRL's conversational messages."""
    return [{"role": r, "content": c} for r, c in turns]


def question(i):
    """A system and a user turn asking for i + 7: the prompt of the conversational test rows."""
    return chat(("system", "Answer with a number."), ("user", f"What is {i} + 7?"))


CORPUS = ["sort 3 1 2 = 1 2 3", "what is 12 + 7? 19", "hello world, this is a test", "the quick brown fox",
          "user assistant system", "Reply with the number only."] * 4


def family_tokenizer(kind, vocab_size=300, chat=False):
    """A small trained tokenizer of a model family's kind, built with `tokenizers` (no files):
    "bpe": byte-level BPE, no BOS, no pad (GPT-2, Qwen); "bos": byte-level BPE whose post-
    processor adds BOS (Llama-3, Gemma); "bos_eos": a post-processor that adds BOS and appends
    EOS (some SentencePiece set-ups); "metaspace": SentencePiece-style pieces with BOS
    (Llama-2, Mistral), whose decoder drops the leading space of a text. chat: True or "chatml":
    ChatML special tokens and template, with <|im_end|> as EOS; "llama3" or "gemma": that family's template,
    which writes BOS into the text and ends a turn with a token that is not the EOS (the model's
    generation_config lists both, as the instruct checkpoints do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<s>", "</s>"
    tok = Tokenizer(models.BPE(unk_token=None if kind != "metaspace" else "<unk>"))
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        specials = ["<unk>", bos, eos]
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = [bos, eos]
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind != "metaspace" else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    single = {"bpe": "$A", "bos": f"{bos} $A", "bos_eos": f"{bos} $A {eos}", "metaspace": f"{bos} $A"}[kind]
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in (bos, eos)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                  unk_token="<unk>" if kind == "metaspace" else None)
    out.pad_token = out.eos_token  # pad == eos, as the scripts set it for tokenizers without one
    if chat in (True, "chatml"):  # as Qwen and SmolLM2 use it: <|im_end|> ends a turn and is the EOS
        out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        out.eos_token = "<|im_end|>"
        out.chat_template = CHATML
    elif chat:
        out.add_special_tokens({"additional_special_tokens": TURN_TOKENS[chat]})
        out.chat_template = TEMPLATES[chat]
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEMPLATES = {
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
              "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
              "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
"""chat templates in the style of Llama-3 and Gemma instruct: BOS written into the text, a turn
ended by a token of its own"""

TURN_TOKENS = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "gemma": ["<start_of_turn>", "<end_of_turn>"]}
"""the special tokens of each template in TEMPLATES; the last one ends a turn"""


# -----------------------------------------------------------------------------
# the models users start from, as folders: what every script's "1 process == 2 processes" test
# loads (conftest.py's `user_models`), so that the path users take (a checkpoint folder read by
# rank 0 and broadcast, a BPE tokenizer, a chat template) is the path the distributed tests take

USER_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=2048, attention_dropout=0.1)
"""RoPE, GQA (4 query heads over 2 key-value heads) and an attention dropout of 0.1, which every
forward of the scripts must leave out (models.no_dropout): a run that kept it would differ
between 1 and 2 processes, and from its reference at lr 0"""


def user_tokenizer(kind="bos", template="llama3"):
    """A trained byte-level BPE tokenizer (family_tokenizer) with a chat template, and the tool
    call tags (tools.py) as tokens of their own."""
    import tools

    tok = family_tokenizer(kind, chat=template)
    tok.add_tokens([tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE])
    return tok


def save_model(model, tok, folder):
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def build_user_models(root):
    """The folders of a session's user models, {name: folder}, built from configs with random
    weights (seeded): `llama` (Llama-3-shaped: BOS added by the tokenizer and written by the
    template, <|eot_id|> ending a turn beside the EOS in generation_config.json, an untied head),
    `qwen2` (Qwen2-shaped: no BOS, ChatML, <|im_end|> the EOS, tied embeddings), `llama_rm` (a
    Llama reward model, LlamaForSequenceClassification), `llama_teacher` (another Llama with the
    same tokenizer) and `llama_calculator` (a Llama that calls the calculator, calculator_llama)."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig,
                              Qwen2Config)

    tok = user_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    llama = LlamaConfig(**USER_SHAPE, **ids, tie_word_embeddings=False)
    folders = {}
    for name, seed in (("llama", 0), ("llama_teacher", 1)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(llama)
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
        folders[name] = save_model(model, tok, os.path.join(root, name))
    torch.manual_seed(2)
    folders["llama_rm"] = save_model(AutoModelForSequenceClassification.from_config(LlamaConfig(
        **USER_SHAPE, **ids, num_labels=1)), tok, os.path.join(root, "llama_rm"))
    folders["llama_calculator"] = calculator_llama(os.path.join(root, "llama_calculator"), tok, llama)
    qtok = user_tokenizer("bpe", "chatml")
    torch.manual_seed(3)
    qwen2 = Qwen2Config(**USER_SHAPE, vocab_size=len(qtok), eos_token_id=qtok.eos_token_id,
                        pad_token_id=qtok.pad_token_id, tie_word_embeddings=True)
    folders["qwen2"] = save_model(AutoModelForCausalLM.from_config(qwen2), qtok, os.path.join(root, "qwen2"))
    return folders


def calculator_llama(folder, tok, config):
    """A Llama that calls the calculator often (tasks.calculator_gpt2's lean, on RoPE, GQA and
    RMSNorm): the embeddings' first component is 1 and no layer writes to it (the first row of
    every o_proj and down_proj is 0), so after the final RMSNorm it is ~sqrt(hidden) for every
    token; the head's first column turns it into a lean to digits, '+', the call tags and EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    import tools

    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config)
    scale = config.hidden_size ** -0.5
    lean = {tools.CALL_OPEN: 2.5, tools.CALL_CLOSE: 3.0, "+": 2.5, tok.eos_token: 1.5, **{str(k): 2.5 for k in range(10)}}
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = -2 * scale  # a 300-token vocabulary: the others pushed further down
        for text, logit in lean.items():
            model.lm_head.weight[tok.convert_tokens_to_ids(text), 0] = logit * scale
    return save_model(model, tok, folder)


def chat_rows(n, kind):
    """n conversational rows in TRL's formats about i + 7: `sft` (messages), `preference` (prompt,
    chosen, rejected: the right sum against a wrong one) or `prompt` (prompt and the digits rule,
    under which a random policy's samples vary)."""
    rows = []
    for i in range(n):
        if kind == "sft":
            rows.append({"messages": question(i) + chat(("assistant", str(i + 7)))})
        elif kind == "preference":
            rows.append({"prompt": question(i), "chosen": chat(("assistant", str(i + 7))),
                         "rejected": chat(("assistant", f"{i + 8} I think"))})
        else:
            rows.append({"prompt": question(i), "reward_fn": "digits"})
    return rows


def dynamo_eager(monkeypatch, gpu=False):
    """The sampler's compiled decode steps traced by dynamo and run by its eager backend: the graphs
    and guards are dynamo's whatever compiles them, in seconds instead of inductor's tens; gpu: the
    GPU's path taken on the CPU (sampling._gpu: no shared prompts, a host read every 8 steps)."""
    monkeypatch.setattr(sampling, "_compiled", {})
    monkeypatch.setattr(sampling, "_compile", lambda fn, gpu_path: torch.compile(fn, backend="eager", dynamic=False))
    if gpu:
        monkeypatch.setattr(sampling, "_gpu", lambda device: True)


def failed_run_ends():
    """What cli.script does when a run that main raised out of ends (a test calls main alone): each
    run abandoned (its Logger and heartbeat closed), the process group left and out_dir let go."""
    from plumbing import logs, rundir

    for r in rundir.RUNS:
        r.abandon()
    rundir.RUNS.clear()
    logs.end_heartbeat()
    rundir.release()


class OpOutputs(TorchDispatchMode):
    """`with OpOutputs() as ops:` records each op dispatched inside it as (op, is_view, [(shape, dtype)
    of each tensor it returned]) in ops.seen, in order, keeping no tensor alive: what a pass computes,
    for tests that bound it (the largest tensor made, a copy of the logits, an fp32 weight-sized cast)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves(out)
        self.seen.append((func, func.is_view, [(t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor)]))
        return out

    def largest(self, keep=lambda shape, dtype: True, views=True):
        """The most elements of a floating tensor an op returned (views too unless views=False) among those keep
        takes."""
        return max([0, *[shape.numel() for _, is_view, outs in self.seen if views or not is_view
                         for shape, dtype in outs if dtype.is_floating_point and keep(shape, dtype)]])

