"""A GRPO step with tool calls against one without, side by side: tokens/s of the whole step
(rollout, reward, reference and update) and of the rollout alone.

The same policy (tasks.calculator_gpt2: a GPT-2 of the character tokenizer whose output leans to
digits, '+' and the call tags, so that most answers call the calculator, some twice) runs
grpo.py for a few steps with `--tools calculator` and without (then the tags it writes are
plain tokens and nothing runs). The sides alternate, each in a fresh subprocess, --repeats
times in ABBA order; the first step of a run is warm-up and left out. Tokens/s counts response
tokens, the model's and (with the tool) the results', per second: the tool's tokens are not
sampled, but a step attends to them and carries them through every forward. The ratios: of the
sums over every repeat, and per repeat (its median and range). What the tool loop costs: the
host work of decoding a call and encoding its result, and a call's result fed to its row one token
a decode step (sampling.generate_with_tools: one loop for every row, no turns). A call runs in a worker process
(tools.py): its cost alone, per call of the calculator, is measured too, against a thread of a
pool in the trainer's own process (how a tool ran before, and what a hanging tool could hang).

    python bench/tool_step.py                        # the TINY_GPT2 shape, 8 prompts x 8, 48 tokens, CPU
    python bench/tool_step.py --n_layer 1 --n_embd 32 --steps 4

The figures go to runs/bench/tool-step-{cpu,cuda}.json (untracked); `--out
bench/results/tool-step-cpu.json` replaces the recorded ones the docs quote.
"""
import argparse
import json
import os
import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import tasks  # noqa: E402
from bench import util  # noqa: E402


def one_run(folder, policy, prompts, tools, args):
    """grpo.py for args.steps steps; per step after the first: (response tokens, step s, rollout s)."""
    out = os.path.join(folder, "run-tools" if tools else "run-plain")
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", policy, "--dataset", prompts, "--steps",
           str(args.steps), "--prompts_per_step", str(args.prompts), "--group_size", str(args.G), "--max_new_tokens",
           str(args.new_tokens), "--max_prompt_len", str(args.prompt_len), "--n_eval", "8", "--eval_every", "1000", "--out_dir", out, "--save_every", "0", "--overwrite"]
    cmd += ["--tools", "calculator"] if tools else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r["step"] > 1 and "time/step" in r]
    n = args.prompts * args.G
    return [(r["completions/mean_length"] * n, r["time/step"], r["time/rollout"], r.get("tools/call_frequency", 0.0))
            for r in rows]


def per_call_seconds(n=2000, turn=64):
    """Seconds per calculator call: in a thread of a pool (a future each), through a worker
    process one call at a time (tools.call_tool), and in turns of `turn` calls at once
    (tools.call_tools, as a rollout's turn makes them)."""
    import tools

    pool, tool = concurrent.futures.ThreadPoolExecutor(4), tools.load_tool("calculator")
    tools.call_tools(tool, ["1"] * turn)  # every worker started
    t = time.perf_counter()
    for _ in range(n):
        pool.submit(tools.calculator, "12 * 34").result(timeout=10)
    thread = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        tools.call_tool(tool, "12 * 34")
    worker = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n // turn):
        tools.call_tools(tool, ["12 * 34"] * turn)
    return {"thread": thread, "worker": worker, f"worker_turn_of_{turn}": (time.perf_counter() - t) / (n // turn * turn)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n_layer", type=int, default=tasks.TINY_GPT2["n_layer"])
    p.add_argument("--n_embd", type=int, default=tasks.TINY_GPT2["n_embd"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--prompt_len", type=int, default=64, help="--max_prompt_len (the prompts are shorter; with "
                   "--new_tokens within the model's 128 positions)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="the results file (default: runs/bench/tool-step-<device>.json)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        policy = tasks.calculator_gpt2(os.path.join(folder, "policy"), n_layer=args.n_layer, n_embd=args.n_embd,
                                       n_head=max(args.n_embd // 32, 1))
        prompts = os.path.join(folder, "prompts.jsonl")
        with open(prompts, "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "reward_fn": "digits"}) + "\n"
                         for r in tasks.prompt_rows(args.prompts * (args.steps + 1)))
        steps, per_repeat = {True: [], False: []}, []
        for r in range(args.repeats):
            runs = {tools: one_run(folder, policy, prompts, tools, args) for tools in ((True, False), (False, True))[r % 2]}
            for tools, rows in runs.items():
                steps[tools] += rows
            rate = {tools: sum(x[0] for x in rows) / sum(x[2] for x in rows) for tools, rows in runs.items()}
            per_repeat.append(rate[True] / rate[False])  # rollout tokens/s, with / without
    sides = {}
    for tools, rows in steps.items():
        tokens, step_s, roll_s, calls = zip(*rows)
        sides["with tool calls" if tools else "without"] = {
            "steps": len(rows), "response_tokens_per_step": statistics.mean(tokens),
            "calls_per_answer": statistics.mean(calls), "step_s_median": statistics.median(step_s),
            "tokens_per_s": sum(tokens) / sum(step_s), "rollout_tokens_per_s": sum(tokens) / sum(roll_s)}
    w, wo = sides["with tool calls"], sides["without"]
    calls = per_call_seconds()
    result = {"device": util.device_name(util.default_device()), "torch": torch.__version__, "args": vars(args), "sides": sides,
              "per_call_s": calls,
              "ratio_tokens_per_s": w["tokens_per_s"] / wo["tokens_per_s"],
              "ratio_rollout_tokens_per_s": w["rollout_tokens_per_s"] / wo["rollout_tokens_per_s"],
              "ratio_rollout_per_repeat": per_repeat}
    out = args.out or os.path.join(ROOT, "runs", "bench", f"tool-step-{'cuda' if torch.cuda.is_available() else 'cpu'}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in sides.items():
        print(f"{name:16s} {s['response_tokens_per_step']:6.0f} response tokens/step, {s['calls_per_answer']:.2f} calls "
              f"per answer, {s['step_s_median']:.2f} s/step, {s['tokens_per_s']:.0f} tokens/s (rollout "
              f"{s['rollout_tokens_per_s']:.0f})")
    print(f"with / without: {result['ratio_tokens_per_s']:.2f}x tokens/s, rollout {result['ratio_rollout_tokens_per_s']:.2f}x "
          f"(per repeat: median {statistics.median(per_repeat):.2f}x, {min(per_repeat):.2f}-{max(per_repeat):.2f}) "
          f"({result['device']}); {out}")
    print("per calculator call: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in calls.items()))


if __name__ == "__main__":
    main()
