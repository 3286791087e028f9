"""What every bench command shares: the models and rows both sides read, a script (ours or TRL's) run
in a process of its own, the one timing helper (variants alternated A B B A, each ratio the median of
the repeats' own ratios with their range), the one memory helper, a step's model FLOPs, and the
results file (bench/results/<command>-<device>-<tag>.json)."""
import contextlib
import importlib.metadata
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
sys.path.insert(0, ROOT)
import common  # noqa: E402
import dpo  # noqa: E402
import grpo  # noqa: E402
import lm_head  # noqa: E402, F401  (bench's modules reach it as harness.lm_head)
import reward  # noqa: E402
import sft  # noqa: E402
import tasks  # noqa: E402
from plumbing import cli, models, rundir  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()  # each load's bars, as the scripts switch them off

SCRIPTS = {"sft": sft, "reward": reward, "dpo": dpo, "grpo": grpo}

# -----------------------------------------------------------------------------
# models: config-built shapes with seeded random weights and the character tokenizer (throughput does not
# depend on the weights; the vocabulary is the real one), `calculator` (tasks.calculator_gpt2: a tiny GPT-2
# that calls the calculator), `smollm2` (the pip package's real weights), or any hub id or folder

SHAPES = {  # name -> (architecture, config)
    "tiny": ("gpt2", {}),  # tasks.TINY_GPT2, 0.8M parameters
    "gpt2-small-random": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)),
    "gpt2-large-random": ("gpt2", dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257)),
    "smollm2-random": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                     max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                                     vocab_size=49152)),  # SmolLM2-135M-Instruct's architecture
    "qwen2.5-0.5b-random": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                          max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen2-tiny": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)),
}


def random_model(shape, seed=0):
    """(tokenizer, model) of SHAPES[shape] with seeded random weights and the character tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok, (arch, cfg) = tasks.char_tokenizer(), SHAPES[shape]
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = tasks.char_gpt2_config(tok, **cfg) if arch == "gpt2" else \
        {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**cfg, **ids)
    torch.manual_seed(seed)
    return tok, AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_folder(name, work):
    """A folder both sides load `name` from: a shape or `calculator` saved into `work`, `smollm2`
    converted once (plumbing.models), or the hub id or folder itself."""
    folder = os.path.join(work, name)
    if name == "calculator":
        return folder if os.path.isdir(folder) else tasks.calculator_gpt2(folder)
    if name not in SHAPES:
        return models.model_folder(name, kind="causal") if name == "smollm2" else name
    if not os.path.isdir(folder):
        tok, model = random_model(name)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def model_shape(folder):
    """(layers, attention width, block parameters, vocabulary) of a saved model, counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    body = sum(p.numel() for block in common.transformer_blocks(model) for p in block.parameters())
    width = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return config.num_hidden_layers, width * config.num_attention_heads, body, config.vocab_size


# -----------------------------------------------------------------------------
# rows: each row's (prompt, response) token counts, fixed or drawn from a distribution, written as rows of
# characters that are one token each (exact_alphabet), so that the counts are exact on both sides

LENGTHS = ("fixed", "arith", "tldr", "tldr-small", "task")
ARITH = os.path.join(RESULTS, "lengths-arith.json")  # SmolLM2's arithmetic chat prompts and its own replies' lengths


def row_lengths(kind, n, prompt_len=64, response_len=32, seed=0):
    """[(prompt tokens, response tokens)] of n rows (the response's EOS included):
    fixed: prompt_len + response_len; arith: the recorded pairs of SmolLM2's arithmetic chat task;
    tldr: TL;DR's shape, prompts log-normal about 220 cut to [100, 500], responses about 24 cut to [10, 60];
    tldr-small: prompts log-uniform in [25, 125], responses 3 + an exponential of mean 3 cut at 15;
    task: the embedded task's own prompts (their lengths set by the text, `response_len` new tokens)."""
    rng = random.Random(seed)
    lognormal = lambda median, sigma, lo, hi: int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))  # noqa: E731
    if kind in ("fixed", "task"):
        return [(prompt_len, response_len)] * n
    if kind == "tldr":
        return [(lognormal(220, 0.45, 100, 500), lognormal(24, 0.5, 10, 60)) for _ in range(n)]
    if kind == "tldr-small":
        return [(int(math.exp(rng.uniform(math.log(25), math.log(125)))), min(15, 3 + int(rng.expovariate(1 / 3))))
                for _ in range(n)]
    if kind == "arith":
        with open(ARITH) as f:
            pairs = [tuple(p) for p in json.load(f)["pairs"]]
        return [rng.choice(pairs) for _ in range(n)]
    raise ValueError(f"--lengths {kind!r}: one of {', '.join(LENGTHS)}")


def prompts_batch(tok, n_prompts, G, device, lengths=None, seed=0):
    """(ids, mask): n_prompts prompts, each repeated G times in a row (as grpo.py lays them out),
    left-padded: the embedded task's test prompts, or random tokens of the given (prompt, _) lengths."""
    if lengths is None:
        prompts = [tok(row["prompt"])["input_ids"] for row in tasks.prompt_rows(n_prompts, split="test")]
    else:
        g, specials = torch.Generator().manual_seed(seed), len(tok.all_special_ids)
        prompts = [torch.randint(specials, len(tok), (p,), generator=g).tolist() for p, _ in lengths[:n_prompts]]
    ids, mask = common.pad([p for p in prompts for _ in range(G)], tok.pad_token_id, side="left")
    return ids.to(device), mask.to(device)


def padding_share(lengths, batch, seed=0):
    """The share of padding in batches of `batch` rows drawn in a shuffled order, each padded to its
    longest prompt and longest response (the scripts' layout: prompts left-padded, responses right)."""
    rows = list(lengths)
    random.Random(seed).shuffle(rows)
    real = padded = 0
    for i in range(0, len(rows) - batch + 1, batch):
        b = rows[i:i + batch]
        real += sum(p + r for p, r in b)
        padded += batch * (max(p for p, _ in b) + max(r for _, r in b))
    return 1 - real / padded


def exact_alphabet(tokenizer):
    """Characters that tokenize to one token each in any order: letters, digits and spaces for the
    character tokenizer, digits alone for those that split numbers into digits (SmolLM2, Llama-3, Qwen)."""
    for alphabet in ("abcdefghij 0123456789", "0123456789"):
        sample = "".join(random.Random(0).choice(alphabet) for _ in range(200))
        if len(tokenizer(sample, add_special_tokens=False)["input_ids"]) == len(sample):
            return alphabet
    raise SystemExit(f"{type(tokenizer).__name__}: no alphabet tokenizes to one token per character")


def make_data(path, lengths, alphabet="abcdefghij 0123456789", seed=0, task=False):
    """Rows of every column the scripts read, of the given (prompt, response) lengths in tokens (EOS
    included in the response); task: the embedded task's prompts instead (tasks.prompt_rows)."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice(alphabet) for _ in range(k))  # noqa: E731
    prompts = [r["prompt"] for r in tasks.prompt_rows(len(lengths))] if task else [text(p) for p, _ in lengths]
    with open(path, "w") as f:
        for prompt, (_, r) in zip(prompts, lengths):
            f.write(json.dumps({"prompt": prompt, "completion": text(r - 1), "chosen": text(r - 1),
                                "rejected": text(r - 1), "reward_fn": "digits"}) + "\n")
    return path


# -----------------------------------------------------------------------------
# timing: one helper for every command


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(fn, device):
    """(seconds, fn's output) of one call, between two device syncs."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def alternate(names, repeats, run):
    """{name: [run(name, repeat) for each repeat]}, the variants in order and then reversed, repeat after
    repeat (A B B A A B ...): a slow spell of a shared machine, or a drift, weighs on every side alike."""
    runs = {n: [] for n in names}
    for rep in range(repeats):
        for n in (names if rep % 2 == 0 else names[::-1]):
            runs[n].append(run(n, rep))
    return runs


def ratio(a, b):
    """a[i] / b[i] for each repeat i (runs side by side), and their median and range: the figure is a
    median of ratios, never a ratio of medians."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} repeats against {len(b)}: a ratio needs both sides of every repeat")
    per = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(per), "min": min(per), "max": max(per), "repeats": per}


def ratios(variants, pairs, keys=("tokens_per_s", "peak_gib")):
    """[{"a", "b", key: ratio(...)}] of each pair (a, b) of variants, for each metric key both measured
    (a peak of 0: nothing above what was held before, as a warm CPU process may show, is not a figure)."""
    out = []
    for a, b in pairs:
        r = {"a": a, "b": b}
        for k in keys:
            if all(None not in variants[v].get(k, [None]) and 0 not in variants[v][k] for v in (a, b)):
                r[k] = ratio(variants[a][k], variants[b][k])
        out.append(r)
    return out


# -----------------------------------------------------------------------------
# memory: one helper for every command, in this process (the peak above what was held before) or of a child


def _rss(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


@contextlib.contextmanager
def peak_memory(device):
    """Yields a dict whose "bytes" is, on exit, the peak memory added while inside: on a GPU
    torch.cuda.max_memory_allocated above what was allocated before; on a CPU the peak resident set
    (VmHWM, reset by /proc/self/clear_refs) above the resident set before."""
    out = {}
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield out
        sync(device)
        out["bytes"] = torch.cuda.max_memory_allocated(device) - before
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss("VmRSS")
    yield out
    out["bytes"] = max(0, _rss("VmHWM") - before)


def run_process(cmd, log, env=None, timeout=3600):
    """Run cmd (a list) from the repository root, its output into `log`; returns the peak resident set
    of its largest process in bytes (os.wait4: the child's own, and its children's once reaped, as
    torchrun's ranks are). A failure raises with the log's tail."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        timer = threading.Timer(timeout, p.kill)  # a run past its time is killed, and fails below
        timer.start()
        _, status, usage = os.wait4(p.pid, 0)  # reaps the child: its own resource usage
        timer.cancel()
    if os.waitstatus_to_exitcode(status) != 0:
        with open(log) as f:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{f.read()[-3000:]}")
    return usage.ru_maxrss * 1024  # KiB on Linux


def run_in_process(script, argv, log):
    """`python SCRIPT ARGV` in this process, as cli.script would run it, its output into `log` (tests and
    --cpu: a second, not an interpreter's start; the peak memory is then this process's). The exit status."""
    module, argv0, cwd, code = SCRIPTS[script.removesuffix(".py")], sys.argv, os.getcwd(), 0
    sys.argv = [script, *argv]
    os.chdir(ROOT)
    try:
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                cli.script(module.main, module.Config)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:  # noqa: BLE001  the traceback goes to the log, the status to the caller
                traceback.print_exc()
                code = 1
            finally:
                rundir.release()
    finally:
        sys.argv = argv0
        os.chdir(cwd)
    return code


# -----------------------------------------------------------------------------
# a step's work: tokens and model FLOPs, and the matmul peak MFU is taken against


def step_flops(script, rows, group_size, lengths, shape, completion=None):
    """(tokens, model FLOPs) of one step of `rows` rows (GRPO: prompts) of these (prompt, response)
    lengths, their expected values over the rows. Per token of a sequence of S tokens: 6 x block
    parameters + 12 x layers x width x S, forward and backward (PaLM, arXiv:2204.02311 App. B); the LM
    head (6 x width x V) at the response positions only (none for the reward model); forward-only work a
    third. A prompt that rows share (a pair's, a group's) is work once: the FLOPs a step needs, the same
    for every tool timed, so that MFU is never over 100% for a tool that computes each prompt once. GRPO
    (one update a rollout): the rollout (each distinct prompt prefilled once, a decode step a token,
    `completion` tokens: the measured mean, else the response length) and the reference's pass."""
    L, dm, body, V = shape
    mean = lambda f: statistics.mean(f(p, r) for p, r in lengths)  # noqa: E731
    # a prompt of p tokens and k responses of r: p + k r tokens, each attending over a p + r sequence
    work = lambda k, head: mean(lambda p, r: (p + k * r) * (6 * body + 12 * L * dm * (p + r)) + k * 6 * dm * V * r * head)  # noqa: E731
    S = mean(lambda p, r: p + r)
    if script in ("sft", "reward", "dpo"):
        n = rows * (1 if script == "sft" else 2)  # reward model and DPO: chosen and rejected
        return n * S, rows * work(1 if script == "sft" else 2, 0 if script == "reward" else 1)
    P, R = mean(lambda p, r: p), completion or lengths[0][1]
    n, S = rows * group_size, P + R
    rollout = rows * P * (2 * body + 4 * L * dm * P) + n * R * (2 * body + 4 * L * dm * S + 2 * dm * V)
    update = rows * ((P + group_size * R) * (6 * body + 12 * L * dm * S) + group_size * 6 * dm * V * R)
    return n * S, update * 4 / 3 + rollout


def matmul_peak(device):
    """Measured FLOP/s of square matmuls of random inputs in the scripts' compute dtype (bf16 on a GPU
    that has it, fp32 on a CPU): the ceiling MFU is taken against. CPU: 2048^3, the median of 5; CUDA:
    8192^3, 10 back to back between two events (a host sync each would add launch gaps), median of 5."""
    dtype = torch.bfloat16 if common.bf16_supported(device) else torch.float32
    n, inner = (8192, 10) if device.type == "cuda" else (2048, 1)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    batch = lambda: [torch.mm(a, b, out=out) for _ in range(inner)]  # noqa: E731
    batch()  # the kernel picked, the clocks up
    seconds = statistics.median(clock(batch, device)[0] for _ in range(5)) / inner
    return 2 * n**3 / seconds


# -----------------------------------------------------------------------------
# results: bench/results/<command>-<device>-<tag>.json, and the tables made of them


def markdown(header, rows):
    """A Markdown table: its header, then a line a row."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                      ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def device_of(name="auto"):
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "CPU"
    return f"{cpu}, {torch.get_num_threads()} threads"


def slug(text):
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def save(command, device, tag, payload, argv=None, folder=RESULTS):
    """Write bench/results/<command>-<device>-<tag>.json: the command line, commit, device, versions,
    time and the payload (each measurement with its repeats). Returns its path."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    kind = "cpu" if device.type == "cpu" else slug(torch.cuda.get_device_name(device))
    out = {"command": command, "argv": "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
           # dirty: code changed since the commit; not the results files, curves and docs that a run of several
           # commands and `report` write as they go
           "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno", "--", ".",
                                                                              ":!bench/results", ":!docs", ":!*.md") else ""),
           "device": device_name(device), "device_kind": kind, "time": time.strftime("%Y-%m-%d %H:%M"),
           "versions": {p: version(p) for p in ("torch", "transformers", "trl")}, **payload}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{command}-{kind}{'-' + tag if tag else ''}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return path
