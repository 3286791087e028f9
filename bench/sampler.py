"""Rollout sampling: sampling.generate (prefill once per distinct prompt, static KV cache,
inverse-CDF draws, optionally a compiled decode step) against model.generate, on the same
prompts with the same settings: G samples of each prompt, temperature 1, no early stop.

No early stop: every row generates exactly new_tokens tokens on both sides (checked on the
warm-up calls), so both do the same work. Ours is given EOS id -1, which no token has;
model.generate gets min_new_tokens = max_new_tokens, which masks EOS out of every draw.

Both samplers are timed in the same process, alternating, each call between two device
syncs, and the median is reported, so that load from other jobs hits both alike. Tokens/s
counts generated tokens: prompts x G x new_tokens per call.

Precision (--dtype): fp32 on CPU; on a GPU the weights of the one model both samplers share
are cast to bf16 (model.to), as a sampling-only deployment would run them (grpo.py's rollout
autocasts its fp32 weights instead: the same matmul precision). Greedy outputs (stopping at
EOS, as a rollout does) are compared row by row: in fp32 on CPU they must be identical (the
bench fails otherwise); in bf16 the two samplers reach the same logits through different
batch shapes and kernels (ours prefills each distinct prompt once, into a static cache), so a
near-tie between the two largest logits can go either way and a row part from there on: the
share of identical rows is reported, and a row that parts where the reference's top-2 logits
are more than one bf16 step apart fails the bench (real_divergences). Both use the scripts' LM
head (common.FP32Head: fp32 logits from the bf16 weights).

    python bench/sampler.py                               # tiny GPT-2, 8 prompts x G = 8, 32 tokens
    python bench/sampler.py --model runs/sft --compile    # a trained checkpoint, plus the compiled step
    python bench/sampler.py --threads 1                   # steadier on a busy machine
    python bench/sampler.py --model gpt2-small-random --prompts 16 --G 8 --new_tokens 64 --compile --tag gpt2-small
    python bench/sampler.py --compile --prompt_copies 4 --tag long-prompts   # prompts of ~88 tokens
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import sampling  # noqa: E402
import tasks  # noqa: E402
from bench import util  # noqa: E402


def prompts_batch(tokenizer, n_prompts, G, device, copies=1):
    """n_prompts test prompts, each repeated G times in a row (as grpo.py lays them out); copies:
    each prompt that many test prompts joined (longer prompts, ~22 tokens a copy)."""
    rows = [row["prompt"] for row in tasks.prompt_rows(n_prompts * copies, split="test")]
    texts = [" ".join(rows[i * copies:(i + 1) * copies]) for i in range(n_prompts) for _ in range(G)]
    ids, mask = common.pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id, side="left")
    return ids.to(device), mask.to(device)


def time_alternating(fns, device, repeat):
    """Median wall and CPU seconds of each fn, calling them in turn `repeat` times."""
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            util.sync(device)
            w, c = time.perf_counter(), time.process_time()
            fn()
            util.sync(device)
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    return {k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()}


def same_rows(a, b, pad_id):
    """(B,) True where two right-padded (B, R) outputs agree; R may differ (each stops when its
    last row does), so the shorter is padded first."""
    R = max(a.shape[1], b.shape[1])
    a, b = (torch.nn.functional.pad(x, (0, R - x.shape[1]), value=pad_id) for x in (a, b))
    return (a == b).all(-1)


def real_divergences(model, ids, mask, ours, ref, pad_id):
    """(B,) True where two greedy outputs part at a token whose reference top-2 logits are more
    than one bf16 step apart: a difference the rounding of two kernel paths cannot explain. A row
    that parts at a near-tie (within one step of the larger logit) is not counted: either side
    may break it. ours, ref: right-padded (B, R) ids after the prompts ids (left-padded)."""
    R = max(ours.shape[1], ref.shape[1])
    a, b = (torch.nn.functional.pad(x, (0, R - x.shape[1]), value=pad_id) for x in (ours, ref))
    real = torch.zeros(len(a), dtype=torch.bool, device=a.device)
    for i in (a != b).any(-1).nonzero().flatten().tolist():
        t = int((a[i] != b[i]).nonzero()[0])  # the first token where they part
        seq = torch.cat([ids[i], b[i, :t]])[None]
        m = torch.cat([mask[i], torch.ones(t, dtype=mask.dtype, device=mask.device)])[None]
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=m, position_ids=common.position_ids_from_mask(m)).logits
        top = logits[0, -1].float().topk(2).values
        step = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(top[0].abs().clamp(min=1e-30)))
        real[i] = bool(top[0] - top[1] > step)
    return real


def sampling_draws(V, B, device, repeat=20):
    """One draw per row from (B, V) fp32 logits: sample_token's inverse CDF against
    torch.multinomial. fp32 whatever the model's dtype: both samplers upcast the last position's
    logits before drawing."""
    logits = torch.randn(B, V, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    fns = {"inverse_cdf": lambda: sampling.sample_token(logits, 1.0, 0, 1.0, g),
           "multinomial": lambda: torch.multinomial(logits.softmax(-1), 1, generator=g)}
    for fn in fns.values():
        fn()
    wall, _ = time_alternating(fns, device, repeat)
    return wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny",
                   help=f"one of {sorted(util.SHAPES)} (random weights) or a checkpoint such as runs/sft")
    p.add_argument("--prompts", "--n_prompts", dest="prompts", type=int, default=8, help="distinct prompts")
    p.add_argument("--G", type=int, default=8, help="samples per prompt")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--prompt_copies", type=int, default=1,
                   help="each prompt this many test prompts joined: longer prompts (tiny: P + new_tokens <= 128)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--compile", action="store_true", help="also time generate(compile=True); compile time apart")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tag", default="", help="suffix of the results file name (bench/results/sampler[-TAG]-cuda.json)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="weights of both samplers; auto: bf16 on a GPU that supports it, else fp32")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cold = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if cold:  # a fresh inductor cache: the compile time that a new machine pays
        cache = tempfile.TemporaryDirectory(prefix="inductor-")  # removed at exit
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    device = util.default_device()
    if args.dtype == "auto":
        args.dtype = "bf16" if common.bf16_supported(device) else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    strict = device.type == "cpu" and dtype == torch.float32  # greedy outputs must match exactly
    tok, model = util.random_model(args.model)  # seeded random weights, or a checkpoint
    if type(model.get_output_embeddings()) is torch.nn.Linear:  # the scripts' head: fp32 logits (models.load_model)
        model.get_output_embeddings().__class__ = common.FP32Head
    model = model.to(device=device, dtype=dtype).eval()
    ids, mask = prompts_batch(tok, args.prompts, args.G, device, copies=args.prompt_copies)
    B, N, pad, eos = ids.shape[0], args.new_tokens, tok.pad_token_id, tok.eos_token_id
    print(f"{args.model}: {args.prompts} prompts x G={args.G} = {B} rows, prompt block {ids.shape[1]} tokens, "
          f"{N} new tokens, temperature {args.temperature}, {args.dtype} weights, {util.device_name(device)}",
          flush=True)

    def ours(compile=False):
        g = torch.Generator(device=device).manual_seed(0)
        return sampling.generate(model, ids, mask, N, -1, pad, temperature=args.temperature, generator=g,
                               compile=compile)  # eos -1: no early stop, like min_new_tokens below

    def hf():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=True,
                              temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=eos)

    # 1. greedy outputs, stopping at EOS as a rollout does
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)[:, ids.shape[1]:]
    greedy_out = {"ours": sampling.generate(model, ids, mask, N, eos, pad, temperature=0)[0]}
    fns = {"hf_generate": hf, "ours": ours}
    compile_seconds = None
    if args.compile:
        util.sync(device)
        t0 = time.perf_counter()
        ours(compile=True)  # compiles the decode step for this shape
        util.sync(device)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours(compile=True)
        util.sync(device)
        compile_seconds = first - (time.perf_counter() - t0)
        print(f"compile: {compile_seconds:.1f} s (first call minus a warm one; "
              f"{'cold' if cold else 'your'} inductor cache)", flush=True)
        greedy_out["ours_compiled"] = sampling.generate(model, ids, mask, N, eos, pad, temperature=0, compile=True)[0]
        fns["ours_compiled"] = lambda: ours(compile=True)
    rows_same = {k: same_rows(out, ref, pad) for k, out in greedy_out.items()}
    greedy = {k: bool(v.all()) for k, v in rows_same.items()}
    greedy_share = {k: v.float().mean().item() for k, v in rows_same.items()}
    real = {k: int(real_divergences(model, ids, mask, out, ref, pad).sum()) for k, out in greedy_out.items()}
    for k in greedy:
        print(f"greedy {k:14s} identical to model.generate: {greedy[k]} ({greedy_share[k]:.0%} of {B} rows; "
              f"{real[k]} part where the top-2 logits are more than one bf16 step apart)", flush=True)
    if strict and not all(greedy.values()):
        raise SystemExit("greedy outputs differ from model.generate's in fp32 on CPU: a bug, not rounding")
    if any(real.values()):
        raise SystemExit(f"greedy outputs part from model.generate's where no rounding explains it: {real}")

    # 2. sampling throughput, alternating
    with torch.no_grad():
        for k, fn in fns.items():  # warm-up, and the check that no row stopped early
            out = fn()  # ours: (response ids, mask); model.generate: prompt + response ids
            n_new = out[0].shape[1] if isinstance(out, tuple) else out.shape[1] - ids.shape[1]
            if n_new != N:
                raise SystemExit(f"{k}: {n_new} new tokens, not {N}: a row stopped early")
        wall, cpu = time_alternating(fns, device, args.repeat)
    cases = {k: {"seconds": wall[k], "cpu_seconds": cpu[k], "tokens_per_s": B * N / wall[k],
                 "speedup_vs_hf": wall["hf_generate"] / wall[k], "cpu_speedup_vs_hf": cpu["hf_generate"] / cpu[k]}
             for k in fns}
    for k, c in cases.items():
        print(f"{k:14s} {c['seconds'] * 1e3:8.1f} ms  {c['tokens_per_s']:9.0f} tokens/s  "
              f"{c['speedup_vs_hf']:.2f}x model.generate (CPU time {c['cpu_speedup_vs_hf']:.2f}x)", flush=True)

    # 3. one draw per row, B rows: the model's vocabulary and GPT-2's
    draws = {V: sampling_draws(V, B, device) for V in sorted({len(tok), 50257})}
    for V, d in draws.items():
        print(f"draw B={B} V={V}: inverse CDF {d['inverse_cdf'] * 1e3:.2f} ms, "
              f"multinomial {d['multinomial'] * 1e3:.2f} ms", flush=True)

    results = {"config": vars(args), "rows": B, "prompt_block": ids.shape[1], "greedy_identical": greedy,
               "greedy_identical_rows": greedy_share, "greedy_real_divergences": real,
               "compile_seconds": compile_seconds, "compile_cache_cold": cold, "cases": cases,
               "draw_seconds": {str(V): d for V, d in draws.items()}}
    path = util.write_results("sampler" + (f"-{args.tag}" if args.tag else ""), results, device)
    plot(cases, draws, path.replace(".json", ".png"),
         f"{args.model}, {args.prompts} prompts x G={args.G}, {N} new tokens, {args.dtype}; "
         f"{util.device_name(device)}")
    print(f"wrote {path}")


def plot(cases, draws, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    names = list(cases)
    colors = ["tab:gray", "tab:blue", "tab:green"][:len(names)]
    bars = ax.bar(names, [cases[k]["tokens_per_s"] for k in names], color=colors)
    for bar, k in zip(bars, names):
        ax.annotate(f"{cases[k]['speedup_vs_hf']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel("generated tokens/s")
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    Vs = list(draws)
    for i, impl in enumerate(("multinomial", "inverse_cdf")):
        ax.bar([j + 0.4 * i for j in range(len(Vs))], [draws[V][impl] * 1e3 for V in Vs], width=0.4, label=impl)
    ax.set_xticks([j + 0.2 for j in range(len(Vs))], [f"V={V}" for V in Vs])
    ax.set_yscale("log")
    ax.set_ylabel("one draw per row (ms)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Rollout sampling: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
