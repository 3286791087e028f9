"""Length distributions for the speed benchmarks (bench/steps.py and bench/trl_compare.py
`--lengths`): each synthetic row's prompt and response token counts.

- fixed: every row --prompt_len + --response_len tokens (the benchmarks' default: no padding).
- arith: the SmolLM2 arithmetic chat task's own. Prompts: tasks.arith_rows rendered with
  SmolLM2's chat template (its default system turn and the generation prompt included).
  Responses: SmolLM2-135M-Instruct's own replies to them at temperature 0.7, up to 128 tokens,
  the end of turn included. Recorded once in bench/results/lengths-arith.json (`python
  bench/lengths.py --record arith`, which needs `--model smollm2`'s package); rows draw (prompt,
  response) pairs from it with the seed.
- tldr-small: TL;DR's shape scaled down for a CPU (bench/packing.py's default): prompts log-uniform in
  [25, 125] tokens, responses 3 to 15, most short.
- tldr: TL;DR's shape, built from the seed alone: prompts log-normal about a median of 220
  tokens cut to [100, 500], responses log-normal about 24 cut to [10, 60]. Long-tailed: most
  rows short, a few long, so a micro-batch padded to its longest row is mostly padding.

The lengths are token counts of the benchmarks' one-token-per-character rows (bench/steps.py:
make_data); `padding_share` says what share of a padded batch is padding.

    python bench/lengths.py                      # each distribution's summary at batch 8
    python bench/lengths.py --record arith       # re-record arith's pairs (SmolLM2 on CPU: ~2 min)
"""
import argparse
import json
import math
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = os.path.join(ROOT, "bench", "results", "lengths-arith.json")
KINDS = ("fixed", "arith", "tldr", "tldr-small")


def _lognormal(rng, median, sigma, low, high):
    return int(min(high, max(low, round(math.exp(rng.gauss(math.log(median), sigma))))))


def row_lengths(kind, n, prompt_len=64, response_len=32, seed=0):
    """[(prompt tokens, response tokens)] of n rows (response: EOS or end of turn included)."""
    rng = random.Random(seed)
    if kind == "fixed":
        return [(prompt_len, response_len)] * n
    if kind == "tldr":
        return [(_lognormal(rng, 220, 0.45, 100, 500), _lognormal(rng, 24, 0.5, 10, 60)) for _ in range(n)]
    if kind == "tldr-small":  # prompts log-uniform in [25, 125], responses 3 + an exponential of mean 3, cut at 15
        return [(int(math.exp(rng.uniform(math.log(25), math.log(125)))), min(15, 3 + int(rng.expovariate(1 / 3))))
                for _ in range(n)]
    if kind == "arith":
        with open(ARITH) as f:
            pairs = [tuple(p) for p in json.load(f)["pairs"]]
        return [rng.choice(pairs) for _ in range(n)]
    raise ValueError(f"--lengths {kind!r}: one of {', '.join(KINDS)}")


def padding_share(lengths, batch, seed=0):
    """The share of padding in batches of `batch` rows drawn in a shuffled order, each row padded
    to the batch's longest prompt and longest response (the scripts' layout: prompt block
    left-padded, response block right-padded)."""
    rows = list(lengths)
    random.Random(seed).shuffle(rows)
    real = padded = 0
    for i in range(0, len(rows) - batch + 1, batch):
        b = rows[i:i + batch]
        real += sum(p + r for p, r in b)
        padded += batch * (max(p for p, _ in b) + max(r for _, r in b))
    return 1 - real / padded


def summary(lengths, batch=8):
    """Mean, range and padding share of a list of (prompt, response) lengths."""
    P, R = [p for p, _ in lengths], [r for _, r in lengths]
    return {"rows": len(lengths), "prompt_mean": statistics.mean(P), "prompt_range": [min(P), max(P)],
            "response_mean": statistics.mean(R), "response_range": [min(R), max(R)],
            f"padding_share_at_batch_{batch}": padding_share(lengths, batch)}


def record_arith(n=256, max_new_tokens=128, seed=0):
    """SmolLM2-135M-Instruct's replies to n arith prompts: (prompt, response) token counts."""
    import torch

    sys.path.insert(0, ROOT)
    import common
    import data
    import sampling
    import tasks
    from plumbing import models

    folder = models.model_folder("smollm2", kind="causal")
    tok = models.load_tokenizer(folder)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = tasks.arith_rows(n, seed=seed)
    prompts = [data.apply_template(tok, "arith", i, r["prompt"], add_generation_prompt=True) for i, r in enumerate(rows)]
    stops = sampling.stop_token_ids(tok, model)
    ids, _ = sampling.encode_prompts(tok, prompts, 1024)
    pairs = []
    for k in range(0, n, 64):  # 64 rows a call
        p_ids, p_mask = common.pad(ids[k:k + 64], tok.pad_token_id, side="left")
        u = sampling.rollout_uniforms(n, max_new_tokens, seed)[k:k + 64]
        _, r_mask = sampling.generate(model, p_ids, p_mask, max_new_tokens, eos_id=stops[0], pad_id=tok.pad_token_id,
                                      temperature=0.7, stop_ids=stops[1:], uniforms=u)
        pairs += [(len(x), int(m)) for x, m in zip(ids[k:k + 64], r_mask.sum(-1).tolist())]
    return {"what": f"tasks.arith_rows({n}, seed={seed}) rendered with SmolLM2's chat template (prompt tokens) and "
                    f"SmolLM2-135M-Instruct's replies at temperature 0.7, at most {max_new_tokens} tokens, the end of "
                    f"turn included (response tokens)", "command": "python bench/lengths.py --record arith",
            "pairs": pairs}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", choices=["arith"], help="re-record a distribution from its model")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    if args.record:
        out = record_arith()
        with open(ARITH, "w") as f:
            json.dump(out, f)
        print(f"wrote {ARITH}: {json.dumps(summary(out['pairs'], args.batch))}")
        return
    for kind in KINDS:
        print(f"{kind:6s} {json.dumps(summary(row_lengths(kind, 512), args.batch))}")


if __name__ == "__main__":
    main()
