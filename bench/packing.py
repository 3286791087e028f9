"""Padding-free (packed) against padded training passes: tokens/s of GRPO's update pass
(common.response_logprobs forward and backward, micro-batches as grpo.py cuts them) on rows of a
seeded long-tailed length distribution, both layouts side by side in one process, ABBA order.

The rows (by default bench/lengths.py's tldr-small: TL;DR's shape scaled down for a CPU, prompts
~25-125 tokens, log-uniform; responses 3-15, long-tailed), padded as a rollout is: prompts
left-padded to the longest prompt, responses right-padded to the longest response; padded
micro-batches hold --rows rows, packed ones that many rows' worth of padded tokens
(common.micro_batches). Tokens/s counts real tokens only (the same numerator for both layouts:
the ratio is the inverse ratio of the seconds).

    python bench/packing.py                                  # GPT-2 small and SmolLM2 shapes, 2 layers, CPU
    python bench/packing.py --models smollm2-random --layers 30 --rows_total 64     # a GPU: full depth
    python bench/packing.py --models smollm2-random --layers 30 --rows_total 64 --lengths arith   # real lengths

`--lengths arith|tldr` takes other rows of bench/lengths.py (SmolLM2's arithmetic chat task, TL;DR's
shape at full size).

Results: bench/results/packing[-TAG]-{cpu,cuda}.json.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from plumbing import models  # noqa: E402
from bench import lengths as length_dists  # noqa: E402
from bench import util  # noqa: E402


def batch(vocab, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in rows]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in rows]
    return common.join_prompt_response(prompts, responses, pad_id=0)


def update_pass(model, ids, attn, resp, rows_per_forward, packed, device):
    """One pass of grpo.py's update over the rows: per micro-batch a forward and a backward of a
    token-mean loss; its seconds."""
    d, R = common.Dist(device=device), resp.shape[1]
    util.sync(device)
    t0 = time.perf_counter()
    for r in common.micro_batches(torch.arange(ids.shape[0], device=device), attn, rows_per_forward, d, packed):
        with common.autocast(d):
            logps = common.response_logprobs(model, ids[r], attn[r], R, packed=packed)
        ((logps.float() * resp[r]).sum() / resp.sum()).backward()
    util.sync(device)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-small-random,smollm2-random")
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks kept of each shape (CPU: 2)")
    ap.add_argument("--rows_total", type=int, default=32, help="rows of one update pass")
    ap.add_argument("--rows", type=int, default=8, help="rows per padded micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="ABBA rounds (each: padded, packed, packed, padded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", default="tldr-small", choices=[k for k in length_dists.KINDS if k != "fixed"],
                    help="each row's lengths (bench/lengths.py): tldr-small, TL;DR's shape scaled down for a CPU")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--packed_attention", action="store_true",
                    help="packed rows attend as runs of one length (plumbing.models.packed_attention), as the "
                         "scripts' --packed_attention")
    args = ap.parse_args()
    device = util.default_device()
    results = {"args": vars(args), "models": {}}
    for shape in args.models.split(","):
        key = "n_layer" if "gpt2" in shape else "num_hidden_layers"
        saved, util.SHAPES[shape] = util.SHAPES[shape], {**util.SHAPES[shape], key: args.layers}
        tok, model = util.random_model(shape)
        util.SHAPES[shape] = saved
        model = model.to(device).train()
        if args.packed_attention:
            model = models.packed_attention(model)
        rows = length_dists.row_lengths(args.lengths, args.rows_total, seed=args.seed)
        ids, attn, resp = (t.to(device) for t in batch(model.config.vocab_size, rows))
        real, total = int(attn.sum()), attn.numel()
        assert models.packing_works(model, device)
        times = {False: [], True: []}
        update_pass(model, ids, attn, resp, args.rows, True, device)  # warm-up, both layouts
        update_pass(model, ids, attn, resp, args.rows, False, device)
        for _ in range(args.repeats):
            for packed in (False, True, True, False):
                model.zero_grad(set_to_none=True)
                times[packed].append(update_pass(model, ids, attn, resp, args.rows, packed, device))
        tps = {k: [real / t for t in v] for k, v in times.items()}
        ratios = [a / b for a, b in zip(times[False], times[True])]  # pairwise, same round
        pays = common.packing_pays(model, attn, args.rows)  # what the scripts decide here
        row = {"padding_share": 1 - real / total, "real_tokens": real, "padded_tokens": total, "packing_pays": pays,
               "tokens_per_s": {("packed" if k else "padded"): {"median": statistics.median(v), "min": min(v),
                                                                "max": max(v)} for k, v in tps.items()},
               "ratio_packed_over_padded": {"median": statistics.median(ratios), "min": min(ratios),
                                            "max": max(ratios)}}
        results["models"][f"{shape}-{args.layers}L-{args.lengths}{'-sdpa_packed' if args.packed_attention else ''}"] = row
        print(f"{shape} ({args.layers} layers): padding {row['padding_share']:.0%} of {total} tokens; tokens/s padded "
              f"{statistics.median(tps[False]):.0f} [{min(tps[False]):.0f}, {max(tps[False]):.0f}], packed "
              f"{statistics.median(tps[True]):.0f} [{min(tps[True]):.0f}, {max(tps[True]):.0f}]; packed/padded "
              f"{row['ratio_packed_over_padded']['median']:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]; the scripts "
              f"would {'pack' if pays else 'pad'}", flush=True)
    print(util.write_results("packing" + (f"-{args.tag}" if args.tag else ""), results, device))


if __name__ == "__main__":
    main()
