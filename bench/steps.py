"""Whole training steps of every algorithm: seconds per step, tokens/s, peak memory and MFU.

Each case runs the real script (sft.py, reward.py, dpo.py, grpo.py) in a fresh subprocess for
a few steps on synthetic rows of exact token lengths (the character tokenizer makes one
character one token), and reads its per-step times from its metrics.jsonl; the first step is
warm-up and left out. Peak memory is the child's peak RSS on CPU and, on GPU,
torch.cuda.max_memory_allocated since the child started (logged by every script as
mem/peak_gib); where grpo.py logs the peak within its rollout and update phases
(mem/rollout_gib, mem/update_gib) those are reported too.

Tokens/s counts the tokens of the sequences a step trains on (prompt + response; GRPO: prompts
x group size, its rollout included in the step's time). MFU (model FLOPs utilisation) = the
model FLOPs a step needs per second (`step_work`: 6 x body parameters + attention per trained
token, the LM head only where log-probs are needed, forward-only work at a third; PaLM,
arXiv:2204.02311 App. B) / the machine's matmul peak measured in the same run in the scripts'
compute dtype (`matmul_peak`: bf16 on a GPU, as the scripts autocast there; fp32 on CPU).

GRPO also reports rollout tokens/s: completion tokens generated per second of its rollout
phase (sampling.generate, KV-cached).

`--lengths` (bench/lengths.py): `fixed` rows of --prompt_len + --response_len tokens (no
padding), or each row its own lengths from a distribution, `arith` (SmolLM2's arithmetic chat
task) or `tldr` (TL;DR's long-tailed shape); the scripts then pad each micro-batch to its
longest row, and tokens/s counts real tokens only (a step's expected tokens: rows x the mean
row; GRPO: the prompts' mean + the completions' measured mean). GRPO's completions are the
policy's own: a random-weight policy seldom stops, so they run to the largest response length
of the distribution (--max_new_tokens), and only its prompts follow the distribution.

    python bench/steps.py                                         # tiny and GPT-2 small, CPU
    python bench/steps.py --activation_checkpointing              # the same with recomputation
    python bench/steps.py --models tiny,gpt2-small-random --tag bf16          # GPU: bf16 autocast and peak
    python bench/steps.py --models gpt2-large-random --algos dpo --batch_size 16 --tag large-dpo  # GPU MFU
    python bench/steps.py --models gpt2-small-random --lengths tldr --tag tldr   # GPU, TL;DR's lengths
    python bench/steps.py --models tiny --algos sft,dpo --lengths arith --steps 3 --tag arith-small  # CPU

Results: bench/results/steps[-ac][-TAG]-{cpu,cuda}.json and a .png beside it.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import tasks  # noqa: E402
from bench import lengths as length_dists  # noqa: E402
from bench import util  # noqa: E402
from plumbing import models  # noqa: E402

ALGOS = ("sft", "reward", "dpo", "grpo")


def exact_alphabet(tokenizer):
    """Characters that tokenize to one token each in any order: letters, digits and spaces for
    the character tokenizer, digits alone for tokenizers that split numbers into digits
    (SmolLM2, Llama-3, Qwen), so that rows of k characters are k tokens."""
    for alphabet in ("abcdefghij 0123456789", "0123456789"):
        rng = random.Random(0)
        sample = "".join(rng.choice(alphabet) for _ in range(200))
        if len(tokenizer(sample, add_special_tokens=False)["input_ids"]) == len(sample):
            return alphabet
    raise SystemExit(f"{type(tokenizer).__name__}: no alphabet tokenizes to one token per character")


def make_data(path, n, prompt_len, response_len, seed=0, alphabet="abcdefghij 0123456789", lengths=None):
    """Rows of every column the scripts read, with exact character (= token, see exact_alphabet)
    lengths: prompt_len and response_len (EOS included), or each row's own of `lengths`, a list of
    n (prompt, response) pairs (bench/lengths.py)."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice(alphabet) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for P, R in lengths or [(prompt_len, response_len)] * n:
            f.write(json.dumps({"prompt": text(P), "completion": text(R - 1), "chosen": text(R - 1),
                                "rejected": text(R - 1), "reward_fn": "digits"}) + "\n")
    return path


def script_args(algo, args, data, out_dir):
    """The command line of one case: the same batch, lengths and steps for every algorithm."""
    argv = ["--model", args.model, "--dataset", data, "--out_dir", out_dir, "--steps", str(args.steps),
            "--max_prompt_len", str(args.prompt_len), "--eval_every", "1000000", "--overwrite"]
    if algo == "grpo":  # batch_size prompts x group_size samples, generated to exactly response_len - 1 tokens + EOS
        argv += ["--prompts_per_step", str(args.batch_size), "--group_size", str(args.group_size),
                 "--max_new_tokens", str(args.response_len), "--n_eval", "8", "--n_eval_pairs", "8"]
    else:
        argv += ["--batch_size", str(args.batch_size), "--max_response_len", str(args.response_len), "--n_eval", "8",
                 "--eval_dataset", data]  # train on every row (no hash split), evaluate on the first 8
    # GRPO: one optimizer step per rollout (mu = 1, one mini-batch), so a step is one rollout + one update
    argv += {"sft": [], "reward": ["--no-normalize"], "dpo": ["--n_eval_prompts", "8"],
             "grpo": ["--num_iterations", "1", "--num_mini_batches", "1"]}[algo]
    if args.activation_checkpointing:
        argv.append("--activation_checkpointing")
    return [f"{algo}.py", *argv, *args.extra.split()]


def step_work(algo, args, cfg, vocab, lengths=None):
    """Training tokens of one step (the figure of tokens/s) and its model FLOPs (for MFU); with
    `lengths` (each row's (prompt, response)) their expected values over a step's rows.

    Per token of a sequence of S tokens: 6 x body parameters (all but the embeddings) + 12 x
    n_layer x n_embd x S for attention, forward + backward (PaLM, arXiv:2204.02311 App. B); the
    LM head (6 x n_embd x V) only at the positions whose log-probs are needed (the response;
    none for the reward model, whose head is one number); forward-only work a third of that.
    GRPO also runs the reference over every sequence and the rollout: each distinct prompt
    prefilled once, then one decode step per generated token.
    """
    L, dm = cfg["n_layer"], cfg["n_embd"]
    body = cfg.get("body") or 12 * L * dm * dm  # attention and MLP weights of the blocks (GPT-2: 12 d^2 a layer)
    rows = lengths or [(args.prompt_len, args.response_len)]
    mean = lambda f: statistics.mean(f(p, r) for p, r in rows)  # noqa: E731  the expected value over rows
    S = mean(lambda p, r: p + r)

    def seq_flops(head):  # forward + backward of one sequence, head: the LM head's positions (0 or the response)
        return mean(lambda p, r: (p + r) * (6 * body + 12 * L * dm * (p + r)) + 6 * dm * vocab * r * head)

    if algo == "sft":
        return args.batch_size * S, args.batch_size * seq_flops(1)
    if algo == "reward":
        return 2 * args.batch_size * S, 2 * args.batch_size * seq_flops(0)
    if algo == "dpo":  # chosen and rejected; reference log-probs precomputed once before training
        return 2 * args.batch_size * S, 2 * args.batch_size * seq_flops(1)
    P, R = mean(lambda p, r: p), args.response_len  # grpo: the prompts' mean; a policy that never stops fills R
    S = P + R
    n = args.batch_size * args.group_size  # grpo: mu = 1, one mini-batch: no old log-probs
    rollout = args.batch_size * P * (2 * body + 4 * L * dm * P) + n * R * (2 * body + 4 * L * dm * S + 2 * dm * vocab)
    train = n * (S * (6 * body + 12 * L * dm * S) + 6 * dm * vocab * R)
    return n * S, train * 4 / 3 + rollout  # training + the reference's forward (a third)


def matmul_peak(device, dtype):
    """Measured matmul FLOP/s of square products of random normal inputs: the ceiling MFU is
    taken against. Returns (FLOP/s, n).

    CPU: n = 2048, the median of 5 single products (every committed CPU figure was taken so).
    CUDA: n = 8192, large enough to fill every SM. One product takes ~1.4 ms on an H100 in
    bf16, so timing each one with a host sync would add launch and sync gaps to it; instead 10
    run back to back between two CUDA events, and the figure is the median of 5 such batches.
    The inputs are random (zeros ran ~13% faster on an H200 here: fewer bits toggle, less
    power is drawn and the clock stays higher), so the ceiling is one that real weights can reach.
    """
    if device.type != "cuda":
        n = 2048
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return 2 * n**3 / util.timeit(lambda: a @ b, device, warmup=2, repeat=5), n
    n, inner = 8192, 10
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)  # written in place: no allocator work in the batch

    def batch():
        for _ in range(inner):
            torch.mm(a, b, out=out)

    batch()  # warm-up: cuBLAS picks its kernel, the clocks ramp up
    seconds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / inner)  # elapsed_time is in ms
    return 2 * n**3 / statistics.median(seconds), n


def gpu_memory(rows):
    """Peak GPU memory (GiB) of a run from its metrics rows, or None on CPU (the keys are absent).

    mem/peak_gib is torch.cuda.max_memory_allocated since the process started, so its largest
    value over the rows is the run's peak. Other mem/* keys (grpo.py: mem/rollout_gib,
    mem/update_gib) are the peak within one phase of a step; the largest over the steps is kept.
    """
    keys = sorted({k for r in rows for k in r if k.startswith("mem/")})
    if not keys:
        return None, {}
    phases = {k.split("/", 1)[1].removesuffix("_gib"): max(r[k] for r in rows if k in r)
              for k in keys if k != "mem/peak_gib"}
    peak = max((r["mem/peak_gib"] for r in rows if "mem/peak_gib" in r), default=None)
    return peak, phases


def run_case(argv, log_path):
    """Run a script in a fresh process; return its peak RSS in bytes (this child alone)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, *argv], cwd=util.ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # reaps the child and returns its own resource usage
    if os.waitstatus_to_exitcode(status) != 0:
        with open(log_path) as f:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{f.read()[-3000:]}")
    return usage.ru_maxrss * 1024  # KiB on Linux


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--models", default="tiny,gpt2-small-random")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--response_len", type=int, default=32)
    p.add_argument("--lengths", default="fixed", choices=length_dists.KINDS,
                   help="each row's prompt and response lengths (bench/lengths.py): fixed (--prompt_len + "
                        "--response_len), arith (SmolLM2's arithmetic chat task) or tldr (TL;DR's long-tailed shape)")
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--extra", default="", help="more flags for every script, e.g. '--offload_frozen'")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="dtype of the matmul peak; auto: the scripts' compute dtype (bf16 autocast on a GPU "
                        "that supports it, else fp32)")
    args = p.parse_args()
    lengths = length_dists.row_lengths(args.lengths, 512, args.prompt_len, args.response_len)
    if args.lengths != "fixed":  # the scripts' limits: the longest prompt and response, so no row is cut
        args.prompt_len, args.response_len = max(p for p, _ in lengths), max(r for _, r in lengths)
    dist = length_dists.summary(lengths, args.batch_size)
    print(f"lengths {args.lengths}: {json.dumps(dist)}", flush=True)
    device = util.default_device()
    cuda = device.type == "cuda"
    if args.dtype == "auto":
        args.dtype = "bf16" if common.bf16_supported(device) else "fp32"
    peak, peak_n = matmul_peak(device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    print(f"matmul peak ({args.dtype}, {peak_n}^3): {peak / 1e9:.0f} GFLOP/s on {util.device_name(device)}",
          flush=True)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            args.model = model  # `tiny` is built by the scripts; the larger shapes are saved for them
            if model != "tiny":
                args.model = os.path.join(tmp, model)
                util.random_checkpoint(model, args.model)  # or a checkpoint (`smollm2`, a folder) as it is
            if model in util.SHAPES:
                config, tok = util.model_config(model, tasks.char_tokenizer()), tasks.char_tokenizer()
            else:
                config, tok = AutoConfig.from_pretrained(args.model), models.load_tokenizer(args.model)
            with torch.device("meta"):  # count the parameters without allocating them
                built = AutoModelForCausalLM.from_config(config)
            n_params = sum(x.numel() for x in built.parameters())
            cfg = {"n_layer": config.num_hidden_layers, "n_embd": config.hidden_size,
                   "body": sum(x.numel() for block in common.transformer_blocks(built) for x in block.parameters())}
            rows_file = make_data(os.path.join(tmp, f"rows-{model}.jsonl"), 512, args.prompt_len, args.response_len,
                                  alphabet=exact_alphabet(tok), lengths=lengths)
            for algo in args.algos.split(","):
                out_dir = os.path.join(tmp, f"{algo}-{model}")
                argv = script_args(algo, args, rows_file, out_dir)
                t0 = time.time()
                peak_rss = run_case(argv, out_dir + ".log")
                with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                    all_rows = [json.loads(line) for line in f]
                rows = [r for r in all_rows if r["step"] >= 2]  # step 1 is warm-up; step 0, if any, is eval
                step_s = statistics.median(r["time/step"] for r in rows)
                peak_gpu, mem_phases = gpu_memory(all_rows)
                train_tok, flops = step_work(algo, args, cfg, config.vocab_size,
                                             lengths=None if args.lengths == "fixed" else lengths)
                if algo == "grpo" and args.lengths != "fixed":  # the prompts' mean + the completions' measured mean
                    train_tok = args.batch_size * args.group_size * (
                        statistics.mean(p for p, _ in lengths)
                        + statistics.median(r["completions/mean_length"] for r in rows))
                case = {"algo": algo, "model": model, "params": n_params, "step_seconds": step_s,
                        "train_tokens_per_step": train_tok, "tokens_per_s": train_tok / step_s,
                        "model_flops_per_step": flops,
                        "mfu": flops / step_s / peak, "peak_rss_bytes": peak_rss,
                        "peak_gpu_gib": peak_gpu, "wall_s": time.time() - t0,
                        "phases": {k: statistics.median(r[k] for r in rows) for k in rows[-1] if k.startswith("time/")}}
                if mem_phases:  # GiB, peak within each phase: {"rollout": .., "update": ..}
                    case["peak_gpu_gib_phases"] = mem_phases
                if algo == "grpo":  # completion tokens generated per second of rollout
                    gen = args.batch_size * args.group_size * statistics.median(r["completions/mean_length"] for r in rows)
                    case["rollout_tokens_per_s"] = gen / case["phases"]["time/rollout"]
                cases.append(case)
                if cuda and peak_gpu is not None:
                    mem = f"peak GPU {peak_gpu:6.2f} GiB" + "".join(f", {k} {v:.2f}" for k, v in mem_phases.items())
                else:
                    mem = f"peak RSS {peak_rss / 2**30:6.2f} GiB"
                print(f"{algo:6s} {model:18s} {step_s:8.3f} s/step {case['tokens_per_s']:10.0f} tok/s "
                      f"MFU {100 * case['mfu']:5.1f}%  {mem}"
                      + (f"  rollout {case['rollout_tokens_per_s']:.0f} tok/s" if algo == "grpo" else ""), flush=True)
    name = "steps" + ("-ac" if args.activation_checkpointing else "") + (
        f"-{args.lengths}" if args.lengths != "fixed" else "") + (f"-{args.tag}" if args.tag else "")
    path = util.write_results(name, {"config": vars(args), "lengths": dist, "matmul_peak_flops": peak,
                                     "matmul_peak_dtype": args.dtype, "matmul_peak_n": peak_n, "cases": cases}, device)
    shape = (f"lengths {args.prompt_len}+{args.response_len}" if args.lengths == "fixed" else
             f"{args.lengths} lengths (mean {dist['prompt_mean']:.0f}+{dist['response_mean']:.0f}, up to "
             f"{args.prompt_len}+{args.response_len})")
    plot(cases, path.replace(".json", ".png"), f"{util.device_name(device)}; batch {args.batch_size}, "
         f"{shape}{', act. ckpt' if args.activation_checkpointing else ''}")
    print(f"wrote {path} and its .png")


def plot(cases, path, title):
    """Tokens/s, MFU and peak memory of each algorithm, one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c["model"] for c in cases))
    algos = list(dict.fromkeys(c["algo"] for c in cases))
    panels = [("tokens_per_s", "training-step tokens/s", 1), ("mfu", "MFU (%)", 100),
              ("peak", "peak memory (GiB)", 1 / 2**30)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(models)
    for ax, (key, label, scale) in zip(axes, panels):
        for i, model in enumerate(models):
            vals = []
            for algo in algos:
                c = next((c for c in cases if c["model"] == model and c["algo"] == algo), None)
                v = None if c is None else (c["peak_gpu_gib"] * 2**30 if c["peak_gpu_gib"] else c["peak_rss_bytes"]) \
                    if key == "peak" else c[key]
                vals.append(0 if v is None else v * scale)
            ax.bar([j + i * width for j in range(len(algos))], vals, width, label=model)
        ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(algos))], algos)
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(models), fontsize=9)
    fig.suptitle(f"whole training steps: {title}", fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
