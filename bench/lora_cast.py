"""grpo.py --lora's rollout under bf16 autocast: the frozen base cast to bf16 on every forward (what
autocast does with weights that need no gradient) against once per rollout (environment.frozen_in_bf16),
tokens/s of sampling.generate side by side in one process, ABBA order (per forward, once, once, per
forward), the cast's own time counted in. Both must sample the same ids and log-probs (checked).

A LoRA model (models.add_lora, r 16, its B matrices random so the adapters count) on a random model
of a shape from bench/util.py; G samples of each of `prompts` random prompts, `new_tokens` tokens
each (EOS id -1: no early stop, both do the same work). On a CPU the scripts use no autocast:
here common.bf16_supported is patched to say yes, so that common.autocast(d) is the CPU's bf16
autocast and the rollout takes a bf16 GPU's path (as tests/test_frozen_bf16.py does); CPU bf16
matmuls are not a GPU's, so only a GPU's ratio stands for a GPU (docs/gpu.md).

    python bench/lora_cast.py --threads 1 --layers 4 --prompts 2 --G 4 --new_tokens 16 --tag smollm2-4L
    python bench/lora_cast.py --model gpt2-small-random --threads 1 --layers 4 --prompts 2 --G 4 --new_tokens 16 --tag gpt2-small-4L
    python bench/lora_cast.py --prompts 16 --G 8 --new_tokens 128  # a GPU: SmolLM2-135M's shape, all 30 layers

Results: bench/results/lora_cast[-TAG]-{cpu,cuda}.json.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import environment  # noqa: E402
import sampling  # noqa: E402
from bench import util  # noqa: E402
from plumbing import models  # noqa: E402


def rollout(model, ids, mask, new_tokens, uniforms, d, cast_once):
    """One rollout as environment.sample draws it (eval mode, no graph, autocast); its seconds and
    (ids, mask, log-probs)."""
    util.sync(d.device)
    t0 = time.perf_counter()
    with common.evaluating(model), common.autocast(d), environment.frozen_in_bf16(model, d, enabled=cast_once):
        out = sampling.generate(model, ids, mask, new_tokens, eos_id=-1, pad_id=0, uniforms=uniforms,
                                return_logprobs=True)
    util.sync(d.device)
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-random", help=f"one of {sorted(util.SHAPES)}")
    ap.add_argument("--layers", type=int, default=0, help="transformer blocks kept (0: all)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=4, help="samples of each prompt")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="ABBA rounds")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--tag", default="", help="results file bench/results/lora_cast[-TAG]-<device>.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = util.default_device()
    d = common.Dist(device=device)
    if device.type == "cpu":  # the CPU's bf16 autocast in place of a GPU's (see the docstring)
        common.bf16_supported = lambda device: True
    if not common.bf16_supported(device):
        raise SystemExit(f"{util.device_name(device)} has no bf16: grpo.py runs it in fp32, nothing to cast")
    shape = args.model
    if args.layers:
        key = "n_layer" if "gpt2" in shape else "num_hidden_layers"
        util.SHAPES[shape] = {**util.SHAPES[shape], key: args.layers}
    _, model = util.random_model(shape)
    model = models.add_lora(model, r=16, alpha=32.0).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.G
    prompts = torch.randint(3, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g)
    ids = prompts.repeat_interleave(args.G, 0).to(device)  # each prompt G times in a row, as grpo.py lays them out
    mask = torch.ones_like(ids)
    uniforms = torch.rand(rows, args.new_tokens, generator=g, dtype=torch.float64).to(device)  # drawn on the CPU: the same on any device
    _, want = rollout(model, ids, mask, args.new_tokens, uniforms, d, cast_once=False)  # warm-up, both
    _, got = rollout(model, ids, mask, args.new_tokens, uniforms, d, cast_once=True)
    for a, b in zip(want, got):
        if not torch.equal(a, b):
            raise SystemExit("the rollout cast once differs from the one cast per forward")
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for cast_once in (False, True, True, False):
            times[cast_once].append(rollout(model, ids, mask, args.new_tokens, uniforms, d, cast_once)[0])
    tokens = rows * args.new_tokens
    tps = {k: [tokens / t for t in v] for k, v in times.items()}
    ratios = [a / b for a, b in zip(times[False], times[True])]  # same round: per forward's seconds / once's
    summary = lambda v: {"median": statistics.median(v), "min": min(v), "max": max(v)}  # noqa: E731
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    results = {"args": vars(args), "model": shape, "frozen_parameters": frozen, "rows": rows,
               "tokens_per_s": {"per_forward": summary(tps[False]), "once": summary(tps[True])},
               "ratio_once_over_per_forward": summary(ratios), "identical": True,
               "threads": torch.get_num_threads()}
    print(f"{shape}{f' ({args.layers} layers)' if args.layers else ''}, {frozen / 1e6:.0f}M frozen, {rows} rows x "
          f"{args.new_tokens} tokens, {util.device_name(device)}: tokens/s cast per forward "
          f"{statistics.median(tps[False]):.0f} [{min(tps[False]):.0f}, {max(tps[False]):.0f}], once "
          f"{statistics.median(tps[True]):.0f} [{min(tps[True]):.0f}, {max(tps[True]):.0f}]; once/per forward "
          f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]; ids and log-probs identical",
          flush=True)
    print(util.write_results("lora_cast" + (f"-{args.tag}" if args.tag else ""), results, device))


if __name__ == "__main__":
    main()
