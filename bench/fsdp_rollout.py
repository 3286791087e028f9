"""Rollouts under FSDP2: parameters gathered once per rollout (common.unsharded) against FSDP's
default of gathering every block for every generated token (pytorch #123962).

Runs itself under torchrun (2 processes: gloo on CPU, nccl on GPUs). Each rank generates
`--new_tokens` tokens for its `--rows` rows from the same sharded model, alternating the two
ways, `--repeat` times each; the figure is the median seconds per rollout on rank 0 and the
number of all-gathers FSDP issued (counted by wrapping FSDP2's foreach_all_gather). Stop tokens are
disabled so that both ranks run every decode step (FSDP's collectives need equal counts).

    python bench/fsdp_rollout.py                                  # tiny and GPT-2 small, 2 CPU processes
    python bench/fsdp_rollout.py --models gpt2-large-random --world_size 8   # GPUs
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import sampling  # noqa: E402
from bench import util  # noqa: E402
from plumbing import rundir  # noqa: E402


def child(args):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # private: only to count, never to change

    d = common.setup_distributed()
    gathers = {"n": 0}
    all_gather = _fsdp_param_group.foreach_all_gather

    def counted(*a, **kw):  # every all-gather of a module's parameters goes through here
        gathers["n"] += 1
        return all_gather(*a, **kw)

    _fsdp_param_group.foreach_all_gather = counted
    cases = []
    for name in args.models.split(","):
        tok, model = util.random_model(name)
        model = common.shard_model(model.eval(), d)
        g = torch.Generator().manual_seed(d.rank)
        prompts = torch.randint(3, len(tok), (args.rows, args.prompt_len), generator=g).to(d.device)
        mask = torch.ones_like(prompts)

        def rollout(gather_once, model=model):
            with common.unsharded(model) if gather_once else nullcontext(), common.autocast(d):
                return sampling.generate(model, prompts, mask, args.new_tokens, eos_id=-1, pad_id=tok.pad_token_id,
                                       uniforms=sampling.rollout_uniforms(args.rows, args.new_tokens, d.rank))

        times, counts = {True: [], False: []}, {}
        for rep in range(args.repeat + 1):  # the first of each is warm-up
            for gather_once in (True, False):
                gathers["n"] = 0
                util.sync(d.device)
                t0 = time.perf_counter()
                out = rollout(gather_once)
                util.sync(d.device)
                if rep:
                    times[gather_once].append(time.perf_counter() - t0)
                counts[gather_once] = gathers["n"]
                assert out[0].shape[1] == args.new_tokens
        case = {"model": name, "rows_per_rank": args.rows, "new_tokens": args.new_tokens,
                "seconds_gather_once": statistics.median(times[True]),
                "seconds_gather_per_token": statistics.median(times[False]),
                "all_gathers_gather_once": counts[True], "all_gathers_per_token": counts[False]}
        case["speedup"] = case["seconds_gather_per_token"] / case["seconds_gather_once"]
        cases.append(case)
        common.print0(f"{name:18s} gathered once: {case['seconds_gather_once']:.3f} s ({counts[True]} all-gathers)   "
                      f"per token: {case['seconds_gather_per_token']:.3f} s ({counts[False]} all-gathers)   "
                      f"x{case['speedup']:.2f}")
        del model
    if d.is_main:
        print(json.dumps({"world_size": d.world_size, "cases": cases}))
    rundir.release()


def title(args, threads, device):
    name = util.device_name(device).rsplit(",", 1)[0] if device.type == "cpu" else util.device_name(device)
    return (f"FSDP2 on {args.world_size} ranks ({threads} thread each), {args.rows} rows x {args.new_tokens} new "
            f"tokens per rank, {name}")


def plot(cases, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [c["seconds_gather_once"] for c in cases], 0.4, label="gathered once per rollout")
    ax.bar([i + 0.2 for i in x], [c["seconds_gather_per_token"] for c in cases], 0.4,
           label="gathered per token (FSDP default)")
    for i, c in enumerate(cases):
        ax.annotate(f"x{c['speedup']:.1f}", (i + 0.2, c["seconds_gather_per_token"]), ha="center", va="bottom")
    ax.set_xticks(list(x), [c["model"] for c in cases])
    ax.set_ylabel("seconds per rollout")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,gpt2-small-random")
    p.add_argument("--world_size", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--rows", type=int, default=16, help="rows per rank")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    argv = [a for a in sys.argv[1:]]
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # per rank
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}",
                        os.path.abspath(__file__), "--child", *argv], cwd=util.ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": threads})
    if r.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{r.stderr[-3000:]}")
    lines = r.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))
    result = json.loads(lines[-1])
    device = util.default_device()
    path = util.write_results("fsdp_rollout", {"config": vars(args), "threads_per_rank": threads, **result}, device)
    plot(result["cases"], path.replace(".json", ".png"), title(args, threads, device))
    print(f"wrote {path} and its .png")


if __name__ == "__main__":
    main()
