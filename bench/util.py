"""Shared by the benchmarks: device description, timing, peak memory, results files.

Peak memory: on GPU, torch.cuda.max_memory_allocated around the measured region; on CPU, the
peak resident set size of a fresh subprocess per case (ru_maxrss), minus its size just before
the measured region, so every case starts from the same empty process.
"""
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
from plumbing import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, warmup=2, repeat=5):
    """Median wall time of fn() in seconds, after warm-up calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_peak(fn, device):
    """Run fn() once; return the peak memory it added above what was allocated before it."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = rss_bytes()
    fn()
    return max(0, peak_rss_bytes() - before)


def run_child(argv, timeout=900):
    """Run `python <argv>` in a fresh process; it prints one JSON object as its last line."""
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_results(name, payload, device):
    """bench/results/<name>-<device>.json with the device, torch version and every figure."""
    os.makedirs(RESULTS, exist_ok=True)
    tag = "cuda" if device.type == "cuda" else "cpu"
    payload = {"device": device_name(device), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M"),
               **payload}
    path = os.path.join(RESULTS, f"{name}-{tag}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# -----------------------------------------------------------------------------
# models: `tiny`, GPT-2 small and large and SmolLM2-135M shapes with random weights and the real
# vocabulary size (throughput does not depend on the weights), all with the character tokenizer


SHAPES = {
    "tiny": {},
    "gpt2-small-random": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
    "gpt2-large-random": dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257),
    # SmolLM2-135M-Instruct's architecture (Llama: SwiGLU, grouped-query attention with 3 KV heads,
    # RoPE, tied head), for machines without the 92-MB pip package (the GPU machine)
    "smollm2-random": dict(llama=True, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, vocab_size=49152),
}


def model_config(shape, tokenizer):
    if shape not in SHAPES:
        raise SystemExit(f"model {shape!r} is not one of {sorted(SHAPES)}")
    shape = dict(SHAPES[shape])
    if shape.pop("llama", False):
        from transformers import LlamaConfig

        return LlamaConfig(**shape, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    return tasks.char_gpt2_config(tokenizer, **shape)


def random_model(shape, seed=0):
    """(tokenizer, model) of one of SHAPES with seeded random weights, or of a checkpoint folder."""
    from transformers import AutoModelForCausalLM

    if shape not in SHAPES:
        tok = models.load_tokenizer(shape)
        return tok, models.load_model(shape, tok)
    tok = tasks.char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(shape, tok), dtype=torch.float32)
    return tok, model


def random_checkpoint(shape, folder, seed=0):
    """Save random_model(shape) as a checkpoint the scripts load with --model; returns the number
    of parameters. `tiny` needs none (the scripts build it)."""
    tok, model = random_model(shape, seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())
