"""Whole training steps of grpo.py or dpo.py with --shared_prompt against --no-shared_prompt: each
run the real script in a fresh subprocess (bench/steps.py's rows of exact token lengths and its
command line), the two alternated A B B A, repeated; a run's second step is measured (the first
warms up). Reports each pair's ratio (shared / not) of seconds per step and, for GRPO, of its
update phase (the reference pass, the update's forwards and backwards, the optimizer step), their
medians and ranges; both runs' losses must agree (the same step, the same rows).

    python bench/shared_prompt_steps.py --algo grpo --model smollm2 --batch_size 2 --group_size 8 \
        --prompt_len 64 --response_len 16 --repeats 2 --threads 1
    python bench/shared_prompt_steps.py --algo dpo --model smollm2 --batch_size 8 --prompt_len 64 \
        --response_len 32 --repeats 2 --threads 1
    python bench/shared_prompt_steps.py --algo dpo --model smollm2 --batch_size 4 --lengths tldr --tag tldr

Results: bench/results/shared-prompt-steps-ALGO[-TAG]-cpu.json.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import lengths as length_dists  # noqa: E402
from bench import steps, util  # noqa: E402
from plumbing import models  # noqa: E402

FLAGS = {"shared": "--shared_prompt", "not": "--no-shared_prompt"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algo", default="grpo", choices=["grpo", "dpo"])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch_size", type=int, default=2, help="GRPO: prompts a step; DPO: pairs")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--response_len", type=int, default=16)
    p.add_argument("--lengths", default="fixed", choices=length_dists.KINDS, help="bench/lengths.py's rows")
    p.add_argument("--repeats", type=int, default=2, help="A B B A blocks")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    args.steps, args.activation_checkpointing, args.extra = 2, False, ""
    tokenizer = models.load_tokenizer(models.model_folder(args.model) if args.model == "smollm2" else args.model)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    tmp = tempfile.mkdtemp()
    lengths = length_dists.row_lengths(args.lengths, 64, args.prompt_len, args.response_len)
    if args.lengths != "fixed":  # the scripts' limits: the longest prompt and response, so no row is cut
        args.prompt_len, args.response_len = max(p for p, _ in lengths), max(r for _, r in lengths)
    data = steps.make_data(os.path.join(tmp, "rows.jsonl"), 64, args.prompt_len, args.response_len,
                           alphabet=steps.exact_alphabet(tokenizer), lengths=lengths)
    runs = {"shared": [], "not": []}
    order = ["shared", "not", "not", "shared"] * args.repeats
    for i, variant in enumerate(order):
        out = os.path.join(tmp, f"{i}-{variant}")
        argv = steps.script_args(args.algo, args, data, out) + [FLAGS[variant]]
        steps.run_case(argv, out + ".log")  # raises with the log's tail if the run fails
        with open(os.path.join(out, "metrics.jsonl")) as f:
            row = [r for r in map(json.loads, f) if r.get("step") == 2][0]
        runs[variant].append(row)
        print(variant, {k: round(v, 3) for k, v in row.items() if k.startswith("time/")}, "loss", row["loss"],
              flush=True)
    result = {"args": vars(args), "threads": args.threads, "ratios": {}}
    for key in ("time/step", "time/update") if args.algo == "grpo" else ("time/step",):
        ratios = sorted(a[key] / b[key] for a, b in zip(runs["shared"], runs["not"]))
        result["ratios"][key] = {"median": statistics.median(ratios), "range": [ratios[0], ratios[-1]], "each": ratios}
        print(f"{key}: shared / not {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}), "
              f"{len(ratios)} pairs", flush=True)
    for a, b in zip(runs["shared"], runs["not"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(b["loss"])), (a["loss"], b["loss"])
    result["runs"] = runs
    print(util.write_results(f"shared-prompt-steps-{args.algo}{'-' + args.tag if args.tag else ''}", result,
                             torch.device("cpu")))


if __name__ == "__main__":
    main()
