"""Log-prob gathering: chunked selective log-softmax (common.logprobs_from_logits) against
the naive full log_softmax + gather, and a per-row Python loop (trl #7125).

Each case runs in a fresh process, so its peak memory is its own. Memory is what the case
adds on top of the logits it is given (forward, or forward + backward to the logits): the
child's peak RSS on CPU, torch.cuda.max_memory_allocated on GPU (util.measure_peak). Times
are medians of calls each ended by a device sync (util.timeit).

Logits dtype (--dtype auto): fp32 on CPU; bf16 on a GPU, where the scripts autocast and the
LM head hands over bf16 logits. Every implementation takes the log-softmax in fp32.

    python bench/logprobs.py                       # V = 50257, B*T = 8192: fp32 on CPU, bf16 on GPU
    python bench/logprobs.py --V 32768 --BT 16384 --dtype bf16
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from bench import util  # noqa: E402

IMPLS = ("naive", "chunked", "row_loop")


def naive(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None]).squeeze(-1)


def row_loop(logits, labels):
    return torch.stack([torch.log_softmax(row.float(), -1).gather(-1, lab[:, None]).squeeze(-1)
                        for row, lab in zip(logits, labels)])


def child(args):
    device = util.default_device()
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    B = args.BT // args.T
    logits = torch.randn(B, args.T, args.V, device=device, dtype=dtype, requires_grad=args.mode == "fwdbwd")
    labels = torch.randint(0, args.V, (B, args.T), device=device)
    fn = {"naive": naive, "chunked": common.logprobs_from_logits, "row_loop": row_loop}[args.impl]

    def step():
        out = fn(logits, labels)
        if args.mode == "fwdbwd":
            out.sum().backward()
            logits.grad = None

    peak = util.measure_peak(step, device)  # first call: fresh process, nothing cached yet
    seconds = util.timeit(step, device, warmup=1, repeat=args.repeat)
    print(json.dumps({"impl": args.impl, "mode": args.mode, "peak_bytes": peak, "seconds": seconds}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--V", type=int, default=50257)
    p.add_argument("--BT", type=int, default=8192)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="dtype of the logits; auto: bf16 on a GPU that supports it, else fp32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("--mode", choices=["fwd", "fwdbwd"])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    device = util.default_device()
    if args.dtype == "auto":
        args.dtype = "bf16" if common.bf16_supported(device) else "fp32"
    base = ["bench/logprobs.py", "--child", "--V", str(args.V), "--BT", str(args.BT), "--T", str(args.T),
            "--dtype", args.dtype, "--repeat", str(args.repeat)]
    cases = []
    for mode in ("fwd", "fwdbwd"):
        for impl in IMPLS:
            r = util.run_child(base + ["--impl", impl, "--mode", mode])
            cases.append(r)
            print(f"{mode:7s} {impl:9s} peak +{r['peak_bytes'] / 2**20:8.0f} MiB  {r['seconds'] * 1e3:8.1f} ms", flush=True)
    ratios = {}
    for mode in ("fwd", "fwdbwd"):
        by = {c["impl"]: c for c in cases if c["mode"] == mode}
        ratios[mode] = {"memory_chunked_over_naive": by["chunked"]["peak_bytes"] / max(by["naive"]["peak_bytes"], 1),
                        "speed_chunked_over_naive": by["naive"]["seconds"] / by["chunked"]["seconds"],
                        "speed_chunked_over_row_loop": by["row_loop"]["seconds"] / by["chunked"]["seconds"]}
        print(f"{mode}: chunked/naive memory {ratios[mode]['memory_chunked_over_naive']:.3f}x, "
              f"speed {ratios[mode]['speed_chunked_over_naive']:.2f}x naive, "
              f"{ratios[mode]['speed_chunked_over_row_loop']:.2f}x row loop")
    path = util.write_results("logprobs", {"config": vars(args), "cases": cases, "ratios": ratios}, device)
    plot(cases, path.replace(".json", ".png"), f"V={args.V}, B*T={args.BT}, {args.dtype} logits, "
                                                f"{util.device_name(device)}")
    print(f"wrote {path}")


def plot(cases, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, scale in ((axes[0], "peak_bytes", "peak memory added (MiB)", 2**20),
                                  (axes[1], "seconds", "time (ms)", 1e-3)):
        for i, mode in enumerate(("fwd", "fwdbwd")):
            vals = [next(c[key] for c in cases if c["impl"] == impl and c["mode"] == mode) / scale for impl in IMPLS]
            ax.bar([j + 0.4 * i for j in range(len(IMPLS))], vals, width=0.4,
                   label="forward" if mode == "fwd" else "forward + backward")
        ax.set_xticks([j + 0.2 for j in range(len(IMPLS))], IMPLS)
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Log-prob gathering: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
