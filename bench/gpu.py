"""The first command on a lent GPU: `python -m bench gpu` brings back the race in one device call of
~560 s (a fresh machine's start outside it). Its sections, in this order, each one's expected seconds
printed before it starts, a section that would end past --budget_s skipped (its row names the command
that runs it), the rows written after every section (bench/results/gpu-<device>.json):

  trl      TRL's check: a one-step GRPO and DPO trainer built in a child process, naming what is missing
  race     GRPO and DPO against TRL 1.16 on SmolLM2's shape (bench/steps.py's runs, 2 timed steps a run,
           A B B A x 2): like for like (TRL without gradient checkpointing, ours' AdamW; DPO: a live reference
           on both) and each at its own defaults (TRL: its checkpointing, beta 0 and no reference, its AdamW;
           ours: dpo.py's precomputed reference); ours' compile seconds (its first step less a timed one)
  compile  grpo.py --compile on Qwen2.5-0.5B's shape through an evaluation every step (tests/gpu_check.py's
           (b) and (d)): nothing compiled or recorded after step 2, KL 0 at lr 0
  decode   the rollout of the race's GRPO (16 prompts x G 8, 128 + 128 tokens): ours eager and compiled
           against model.generate; where ours' compile pays back; a profile of 16 decode steps each side (the
           device's busy share, the top kernels and host ops)
  qwen     the race on Qwen2.5-0.5B's shape
  check    tests/gpu_check.py, every GPU proof (--only check)

    python -m bench gpu                                 # trl, race, compile, decode, qwen until the budget is spent
    python -m bench gpu --only qwen                     # what a budget left out
    python -m bench gpu --cpu                           # tiny shapes on the CPU, seconds (tests/test_bench.py)

TRL travels to a GPU machine without a registry as wheels (docs/gpu.md).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from bench import harness, steps
import sampling  # noqa: E402  (on the path harness puts the repository on)

SECTIONS = ("trl", "race", "compile", "decode", "qwen", "check")
RACE = {"grpo": ["ours", "trl", "trl-defaults"],  # ours at its defaults is its like-for-like run here: beta 0 on both
        "dpo": ["ours --no-precompute_ref", "trl", "ours", "trl-defaults"]}
PAIRS = {"grpo": [("ours", "trl"), ("ours", "trl-defaults")],  # like for like, then each at its own defaults
         "dpo": [("ours --no-precompute_ref", "trl"), ("ours", "trl-defaults")]}
GPU = dict(model="smollm2-random", qwen="qwen2.5-0.5b-random", steps=2, repeats=2, budget_s=560,
           grpo=dict(rows=16, group_size=8, prompt_len=128, response_len=128),
           dpo=dict(rows=16, group_size=1, prompt_len=256, response_len=256),
           seconds=dict(trl=25, grpo=240, dpo=200, compile=80, decode=60, qwen=500, check=300))  # H200, 2026-11-28
CPU = dict(model="qwen2-tiny", qwen="tiny", steps=1, repeats=2, budget_s=None,
           grpo=dict(rows=2, group_size=2, prompt_len=12, response_len=6),
           dpo=dict(rows=2, group_size=1, prompt_len=12, response_len=6),
           seconds=dict(trl=20, grpo=10, dpo=10, compile=0, decode=10, qwen=10, check=60))


def row(section, what, value, note=""):
    return [section, what, value, note]


def race(plan, model, device, work, trl_ok, cpu):
    """GRPO and DPO, ours against TRL, on one shape: rows, and the measurements (bench/steps.py's)."""
    rows, ms = [], []
    folder = harness.model_folder(model, work)
    tok, peak = harness.models.load_tokenizer(folder), harness.matmul_peak(device)
    for script in ("grpo", "dpo"):
        w = steps.workload(script, model, folder, tok, device, work, peak, steps=plan["steps"], lr=1e-6, beta=None,
                           ranks=1, lengths_kind="fixed", **plan[script])
        variants = [v for v in RACE[script] if trl_ok or v.startswith("ours")]
        pairs = [p for p in PAIRS[script] if p[1] in variants]
        print(f"race {script} on {model}: {', '.join(variants)}; expected ~{plan['seconds'][script]} s", flush=True)
        # --cpu: our scripts in this process (seconds), unless TRL runs beside them (each side's own process)
        m = steps.measure(w, variants, plan["repeats"], pairs=pairs, in_process=cpu and not trl_ok)
        ms.append(m)
        for r in m["ratios"]:
            t, mem = r["tokens_per_s"], r.get("peak_gib")
            what = "like for like" if r["b"] == "trl" else "each at its own defaults"
            rows.append(row(script, f"{model}: `{r['a']}` / `{r['b']}` ({what}), tokens/s (peak memory)",
                            f"**{t['median']:.2f}x** ({t['min']:.2f}-{t['max']:.2f})" + (f" ({mem['median']:.2f}x)"
                                                                                          if mem else ""),
                            "wanted >= " + ("2x" if script == "grpo" else "1.5x") + " at <= 1x memory"))
        for v, x in m["variants"].items():
            first, step = statistics.median(x["first_step_s"]), statistics.median(x["step_s"])
            compiled = ((x.get("what_ran") or {}).get("compile") or {}).get("value")  # `auto`'s choice, recorded
            compile_s = f" (its compile ~{first - step:.0f} s; paid back: the decode section)" if compiled else ""
            value = (f"{step:.3f} s, first {first:.1f} s{compile_s}; {statistics.median(x['tokens_per_s']):,.0f} tok/s, "
                     f"{statistics.median(x['peak_gib']):.2f} GiB, MFU {statistics.median(x['mfu']):.1%}")
            rows.append(row(script, f"{model}: `{v}`, a step and its first", value, brief(x.get("what_ran"))))
        if not trl_ok:
            rows.append(row(script, f"{model}: ours / TRL 1.16", "TRL not run", "the trl section names what is missing"))
    return rows, ms


def brief(what_ran):
    """What a run ran, in a cell: `auto`'s choices (ours) or TRL's checkpointing, beta, reference and AdamW."""
    if not what_ran:
        return ""
    keys = ("gradient_checkpointing", "beta", "reference", "betas", "mixed_precision")
    return "; ".join(f"{k} {v['value'] if isinstance(v, dict) else v}" for k, v in what_ran.items()
                     if isinstance(v, dict) or k in keys)


def decode(plan, device, work, grpo):
    """The race's rollout alone (bench/steps.py's rollout), where compile pays back, ops and a profile."""
    size, cuda = plan["grpo"], device.type == "cuda"
    args = SimpleNamespace(model=plan["model"] if cuda else "tiny", device=device.type, rows=size["rows"],
                           group_size=size["group_size"], prompt_len=size["prompt_len"], response_len=size["response_len"],
                           lengths="fixed", variant=["ours"] + ["ours --compile"] * cuda + ["generate"], repeats=2,
                           threads=None, tag="gpu", results=plan["results"], dtype="auto", argv=plan["argv"])
    with open(steps.rollout(args)) as f:
        res = json.load(f)["measurements"][0]
    rows = [row("decode", f"{r['a']} / {r['b']}: {res['what']}, tokens/s",
                f"**{r['tokens_per_s']['median']:.2f}x** ({r['tokens_per_s']['min']:.2f}-{r['tokens_per_s']['max']:.2f})",
                f"greedy rows identical {res['variants'][r['a']]['greedy']['identical_rows']:.0%}")
            for r in res["ratios"]]
    ours = grpo and grpo["variants"].get("ours")
    if cuda and ours:  # compile's cost (the race's first step less a timed one) over its saving a rollout
        v = res["variants"]
        saving = statistics.median(v["ours"]["seconds"]) - statistics.median(v["ours --compile"]["seconds"])
        cost = statistics.median(ours["first_step_s"]) - statistics.median(ours["step_s"])
        step = 1 + math.ceil(cost / saving) if saving > 0 else None
        rows.append(row("decode", "ours' compile in the race's GRPO: its cost, its saving a rollout, paid back at step",
                        f"{cost:.1f} s, {saving:.2f} s, step {step or 'never'}", "cost: the first step less a timed one"))
    tok, model = harness.random_model(args.model)
    model = model.to(device).eval()
    ids, mask = harness.prompts_batch(tok, size["rows"], size["group_size"], device, [(size["prompt_len"], 0)] * size["rows"])
    with harness.common.autocast(harness.common.Dist(device=device)):
        calls = {"ours eager": lambda: sampling.generate(model, ids, mask, 17, -1, tok.pad_token_id),
                 "model.generate": lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=17,
                                                          min_new_tokens=17, do_sample=True, pad_token_id=tok.pad_token_id)}
        for k, fn in calls.items():
            p = profile(fn, device)
            rows.append(row("decode", f"{k}: profile of 16 decode steps (and the prefill)",
                            f"device busy {p['busy']:.0%} of {p['wall_ms']:.0f} ms; {p['ops']} ops",
                            "top kernels: " + ", ".join(f"{e[0]} {e[1]:.0f} us" for e in p["kernels"][:3])
                            + "; top host ops: " + ", ".join(f"{e[0]} {e[1]:.0f} us" for e in p["host"][:3])))
    return rows


def profile(fn, device, top=10):
    """torch.profiler over one call: its wall ms, the device's busy share (its kernels' time over the wall),
    aten ops dispatched, and the top kernels by device time and ops by host time."""
    from torch.profiler import ProfilerActivity

    with torch.no_grad():
        fn()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")) as p:
            wall, _ = harness.clock(fn, device)
    events = p.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", 0)  # noqa: E731
    kernels = sorted((e for e in events if dev(e) > 0 and not e.key.startswith(("aten::", "cuda"))), key=lambda e: -dev(e))
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    return dict(wall_ms=1e3 * wall, busy=sum(dev(e) for e in kernels) / 1e6 / wall, ops=sum(e.count for e in ops),
                kernels=[(e.key[:40], dev(e)) for e in kernels[:top]], host=[(e.key, e.self_cpu_time_total) for e in ops[:top]])


def gpu_check(argv, results):
    """tests/gpu_check.py in a child process: its rows (compile: (b) and (d) of the --compile run)."""
    cmd = [sys.executable, os.path.join("tests", "gpu_check.py"), *argv, "--results", results]
    code = subprocess.run(cmd, cwd=harness.ROOT).returncode
    with open(os.path.join(results, "gpu-check-rows.json")) as f:
        rows = json.load(f)
    return [row("compile" if "--runs" in argv else "check", f"({r['check']}) {r['what']}", r["value"],
                f"{r['bound']}: {'info' if r['ok'] is None else 'pass' if r['ok'] else 'FAIL'}") for r in rows] + \
        ([row("check", "tests/gpu_check.py", f"exit {code}", "FAIL")] if code else [])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU, seconds (tests/test_bench.py)")
    p.add_argument("--only", default="trl,race,compile,decode,qwen", help=f"sections, of {', '.join(SECTIONS)}")
    p.add_argument("--budget_s", type=float, default=None, help="start no section that would end past this (GPU: 560)")
    p.add_argument("--tag", default="")
    p.add_argument("--results", default=harness.RESULTS, help="the results folder ($OUT on a lent machine)")
    args = p.parse_args(argv)
    only = args.only.split(",")
    if set(only) - set(SECTIONS):
        p.error(f"--only {args.only}: sections are {', '.join(SECTIONS)}")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        raise SystemExit("bench gpu: no CUDA GPU is visible. Run it on a machine with one, or pass --cpu.")
    plan = dict(CPU if args.cpu else GPU, results=args.results, argv=["gpu", *(argv if argv is not None else sys.argv[2:])])
    device, budget = torch.device("cpu" if args.cpu else "cuda"), args.budget_s or plan["budget_s"]
    rows, t0, trl_ok, grpo = [], time.time(), None, None
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
        for section in (s for s in SECTIONS if s in only):
            expected = plan["seconds"]["grpo" if section == "race" else section] + \
                (plan["seconds"]["dpo"] if section == "race" else 0)
            if budget and time.time() - t0 + expected > budget:
                rows.append(row(section, "skipped", f"{time.time() - t0:.0f} s spent, ~{expected} s more would pass the "
                                                    f"budget ({budget:.0f} s)", f"python -m bench gpu --only {section}"))
                continue
            print(f"\n== {section}: expected ~{expected} s (at {time.time() - t0:.0f} s of {budget or '-'})", flush=True)
            s0 = time.time()
            try:
                if section == "trl":
                    got = check_trl(work)
                    trl_ok = got[0][2] == "ok"
                elif section in ("race", "qwen"):
                    got, ms = race(plan, plan["model" if section == "race" else "qwen"], device, work,
                                   trl_ok if "trl" in only else harness.version("trl") is not None, args.cpu)
                    grpo = grpo or ms[0]
                    harness.save("steps", device, f"gpu-{section}{'-' + args.tag if args.tag else ''}",
                                 {"measurements": ms}, argv=plan["argv"], folder=args.results)
                elif section == "compile":
                    got = gpu_check(["--only", "b,d", "--runs", "7", "--launchers", "python"], args.results) \
                        if not args.cpu else [row("compile", "grpo.py --compile through evaluations", "not run",
                                                  "CUDA graphs need a GPU")]
                elif section == "decode":
                    got = decode(plan, device, work, grpo)
                else:
                    got = gpu_check(["--cpu"] * args.cpu, args.results)
            except (Exception, SystemExit) as e:  # noqa: BLE001  a section that fails is a row; the others still run
                got = [row(section, "FAILED", f"{type(e).__name__}: {str(e)[-400:]}")]
            rows += got + [row(section, "seconds", f"{time.time() - s0:.0f}", f"expected ~{expected}")]
            for r in got:
                print(" | ".join(r), flush=True)
            write(rows, device, plan, t0, args.tag)
    rows.append(row("all", "wall time of this command", f"{time.time() - t0:.0f} s", f"budget {budget or '-'} s"))
    print(f"wrote {write(rows, device, plan, t0, args.tag)}", flush=True)
    return 1 if any(r[1] == "FAILED" or "FAIL" in r[3] for r in rows) else 0


def check_trl(work):
    """TRL's check in a child process (bench/trl_side.py --check)."""
    out = os.path.join(work, "trl-check.json")
    try:
        harness.run_process([sys.executable, "-m", "bench.trl_side", "--check", out], out + ".log")
        with open(out) as f:
            res = json.load(f)
    except (RuntimeError, FileNotFoundError) as e:
        res = {"ok": False, "missing": "trl" if "No module named 'trl'" in str(e) else None, "error": str(e)[-300:]}
    if res["ok"]:
        return [row("trl", "a one-step GRPO and DPO trainer built and run", "ok", f"trl {res['trl']}")]
    return [row("trl", "a one-step GRPO and DPO trainer built and run", "FAILED: " + (
        f"missing {res['missing']}" if res["missing"] else res["error"]), "docs/gpu.md: TRL as wheels")]


def write(rows, device, plan, t0, tag):
    return harness.save("gpu", device, tag, {"header": ["section", "what", "value", "note"], "rows": rows,
                                             "seconds": time.time() - t0}, argv=plan["argv"], folder=plan["results"])
