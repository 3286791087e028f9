"""What a user's reward function costs per GRPO step, called as before (in a thread of a pool in
the trainer, as reward_fns.RewardCaller called a plain function up to 3c74a6b) and as now (in a
worker process of its own, reward_fns.RewardCaller through plumbing/workers.py), A/B in one process.

The function is the embedded task's own rule written as TRL's reward_funcs take it
(`tasks.sort_reward` on each row), called on one step's batch of the embedded task: --prompts x
--G completions of --new_tokens tokens (32 x 8 x 24: grpo.py's defaults on `--dataset sort`),
their completion_ids and the `reward_fn` column; with --chat, the prompts as messages (one list
shared by a prompt's G rows, as environment.score_texts passes them: the worker copies each
repeat, as TRL gives each row its own). The two ways alternate call by call, --calls times each;
the ratio is of the sums, the median of the per-pair ratios, and of the minima (each way's
cost with the cores free: on a shared machine the others vary with the load). The embedded task's rules
themselves (`--reward_fn sort`, a row's `reward_fn`) still run in the trainer (environment.score_texts):
their cost has not changed.

With --before DIR (a checkout of the tree before, e.g. `git worktree add DIR 3c74a6b`), whole
GRPO steps too: `grpo.py --model tiny` on the embedded task with the function as
`--reward_fn rule.py:sort`, and with the task's own rule alone, run from DIR and from this tree in
alternating fresh processes (--repeats each, ABBA), --steps steps, the first left out: the
medians of time/reward (the reward phase) and time/step.

    python bench/reward_call.py                 # writes runs/bench/reward-call-cpu.json
    python bench/reward_call.py --chat
    python bench/reward_call.py --before ../before --steps 6 --repeats 2
"""
import argparse
import concurrent.futures
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reward_fns  # noqa: E402
import tasks  # noqa: E402
from bench import util  # noqa: E402

RULE = '''import tasks


def sort(prompts, completions, **kwargs):
    """the embedded task's rule, as TRL's reward_funcs take it"""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    prompts = [p[0]["content"] if isinstance(p, list) else p for p in prompts]
    return [tasks.sort_reward(p, c) for p, c in zip(prompts, texts)]
'''


def batch(args):
    """One step's keyword arguments, as environment.score_texts builds them."""
    rng = random.Random(0)
    rows = tasks.prompt_rows(args.prompts)
    own = [[{"role": "user", "content": r["prompt"]}] if args.chat else r["prompt"] for r in rows]
    prompts = [p for p in own for _ in range(args.G)]  # a prompt's G rows share its object
    texts = [" ".join(rng.choice("0123456789") for _ in range(args.new_tokens // 2)) for _ in prompts]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if args.chat else texts
    ids = [[rng.randrange(100) for _ in range(args.new_tokens)] for _ in prompts]
    return dict(prompts=prompts, completions=completions, completion_ids=ids, reward_fn=["sort"] * len(prompts))


def step_times(tree, folder, rule, args):
    """time/reward and time/step of each step after the first of `grpo.py --model tiny` (the
    embedded task's defaults: 32 prompts x 8, 24 tokens) run from tree, scored by rule.py:sort
    (rule) or by the task's own rule."""
    out = os.path.join(folder, "run")
    cmd = [sys.executable, os.path.join(tree, "grpo.py"), "--model", "tiny", "--steps", str(args.steps), "--eval_every",
           "1000", "--save_every", "0", "--out_dir", out, "--overwrite"]
    cmd += ["--reward_fn", f"{rule}:sort"] if rule else []
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["time/reward"], r["time/step"]) for r in rows if r["step"] > 1 and "time/step" in r]


def steps(args, path):
    """The --before comparison: {side: {time_reward_median_s, time_step_median_s, steps}}."""
    times = {}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.repeats):
            order = [(tree, rule) for tree in (args.before, ROOT) for rule in (path, None)]
            for tree, rule in order[::1 if r % 2 == 0 else -1]:
                side = f"{'before' if tree == args.before else 'now'}, {'user function' if rule else 'rule'}"
                times.setdefault(side, []).extend(step_times(tree, folder, rule, args))
    return {side: {"time_reward_median_s": statistics.median(t[0] for t in rows),
                   "time_step_median_s": statistics.median(t[1] for t in rows), "steps": len(rows)}
            for side, rows in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--chat", action="store_true", help="conversational prompts and completions")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--before", default=None, help="a checkout of the tree before: whole GRPO steps from it and from this")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="the results file (default: runs/bench/reward-call[-chat]-<device>.json)")
    args = p.parse_args()
    kw = batch(args)
    rows = list(range(1, len(kw["prompts"]) + 1))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rule.py")
        with open(path, "w") as f:
            f.write(RULE)
        spec = importlib.util.spec_from_file_location("rule", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pool = concurrent.futures.ThreadPoolExecutor(1)  # before: the function in a thread of the trainer
        caller = reward_fns.RewardCaller(reward_fns.load_reward_fns(f"{path}:sort"))  # now: in its worker
        columns = {"reward_fn": kw["reward_fn"]}

        def thread():
            return pool.submit(module.sort, **kw).result()

        def worker():
            return caller(kw["prompts"], kw["completions"], kw["completion_ids"], columns, rows, "bench")["sort"]

        assert thread() == worker()  # the same rewards either way
        whole = steps(args, path) if args.before else None
        times = {"thread": [], "worker": []}
        for i in range(args.calls):
            for name, fn in (("thread", thread), ("worker", worker))[::1 if i % 2 else -1]:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    pairs = [w / t for t, w in zip(times["thread"], times["worker"])]
    result = {"device": util.device_name(util.default_device()), "args": vars(args), "completions": len(rows),
              "per_call_s": {k: {"min": min(v), "median": statistics.median(v), "mean": statistics.mean(v)}
                             for k, v in times.items()},
              "ratio_of_sums": sum(times["worker"]) / sum(times["thread"]), "ratio_median": statistics.median(pairs),
              "ratio_quartiles": statistics.quantiles(pairs, n=4),
              "ratio_of_minima": min(times["worker"]) / min(times["thread"]), "steps": whole}
    name = f"reward-call{'-chat' if args.chat else ''}-{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    out = args.out or os.path.join(ROOT, "runs", "bench", name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    med = result["per_call_s"]
    print(f"{len(rows)} completions a call ({'chat' if args.chat else 'text'}): thread {med['thread']['median'] * 1e3:.3f} "
          f"ms, worker {med['worker']['median'] * 1e3:.3f} ms (medians; minima {med['thread']['min'] * 1e3:.3f}, "
          f"{med['worker']['min'] * 1e3:.3f}); worker / thread {result['ratio_of_sums']:.3f}x (sums), "
          f"{result['ratio_median']:.3f}x (median of pairs, quartiles {', '.join(f'{q:.3f}' for q in result['ratio_quartiles'])}), "
          f"{result['ratio_of_minima']:.3f}x (minima); load average {os.getloadavg()[0]:.1f}; {out}")
    for side, s in (whole or {}).items():
        print(f"{side:26s} time/reward {s['time_reward_median_s'] * 1e3:7.2f} ms, time/step {s['time_step_median_s']:.3f} s "
              f"(medians of {s['steps']} steps)")


if __name__ == "__main__":
    main()
