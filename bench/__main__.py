"""python -m bench COMMAND: the speed and memory benchmarks, one entry point. Every command writes
bench/results/<command>-<device>-<tag>.json (the command line, commit, device, versions, each
measurement's repeats); `report` renders docs/performance.md's and README.md's tables from those files.

  steps     whole training steps: our scripts at one or more flag sets, TRL 1.16's trainers, side by side
            (A B B A); --sweep: how tokens/s and peak memory grow with a length, the rows or the ranks
  rollout   the sampler alone: sampling.generate, eager or compiled, against model.generate
  memory    the memory model: a script's peak per device from its flags, what fits, its check
  dispatch  ops and host syncs of a decode step and of a DPO and GRPO step, counted on the CPU
  gpu       the first command on a lent GPU: GRPO and DPO against TRL, the compile check, decode, Qwen's shape
  micro     the micro-benchmarks (pytest-benchmark): log-probs, losses, the optimizer step, the draw
  report    the docs' tables from bench/results/ (--check: fail where a table is not its files')

`python -m bench COMMAND --help` lists a command's flags; docs/performance.md which command line
replaced which of the scripts bench/ held before.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys

from bench import dispatch, gpu, harness, memory, steps

COMMANDS = ("steps", "rollout", "memory", "dispatch", "gpu", "micro", "report")


def parser():
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--model", default="tiny", help=f"comma-separated: one of {', '.join(harness.SHAPES)} (random "
                        "weights, the real vocabulary), calculator, smollm2 (the pip package), a hub id or a folder")
    shared.add_argument("--device", default="auto", help="auto (cuda where there is one), cpu or cuda")
    shared.add_argument("--rows", type=int, default=8, help="GRPO's prompts a step (--prompts_per_step), DPO's and the "
                        "reward model's pairs, SFT's rows (--batch_size); rollout: prompts")
    shared.add_argument("--group_size", type=int, default=4, help="GRPO's and the rollout's samples a prompt")
    shared.add_argument("--prompt_len", type=int, default=64, help="prompt tokens (fixed lengths)")
    shared.add_argument("--response_len", type=int, default=32,
                        help="response tokens, EOS included (GRPO and rollout: new tokens at most)")
    shared.add_argument("--lengths", default="fixed", choices=harness.LENGTHS,
                        help="each row's lengths: fixed, or drawn: arith (SmolLM2's arithmetic chat task), tldr "
                             "(TL;DR's long-tailed shape), tldr-small, task (the embedded task's prompts)")
    shared.add_argument("--variant", action="append", default=None, metavar="SIDE [FLAGS]",
                        help="repeatable; steps: 'ours [script flags]', 'trl [--precompute_ref|--padding_free|"
                             "--activation_checkpointing]' (matched to ours), 'trl-defaults' (TRL's own); rollout: "
                             "'ours [--compile]', 'generate'. Ratios: each against the last")
    shared.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternated A B B A")
    shared.add_argument("--threads", type=int, default=None, help="torch threads (OMP_NUM_THREADS of each run)")
    shared.add_argument("--tag", default="", help="the results file's tag: bench/results/COMMAND-DEVICE-TAG.json")
    shared.add_argument("--results", default=harness.RESULTS, help="the results folder")
    s = sub.add_parser("steps", parents=[shared], help="whole training steps, ours and TRL's",
                       description="Whole training steps of our scripts at one or more flag sets and of TRL's "
                       "trainers, each run a process of its own, alternated A B B A (bench/steps.py).")
    s.add_argument("--script", default="grpo", help="comma-separated: sft, reward, dpo, grpo")
    s.add_argument("--steps", type=int, default=2, help="timed steps a run (one more runs first, as warm-up)")
    s.add_argument("--lr", type=float, default=None, help="both sides' learning rate (default: each one's)")
    s.add_argument("--beta", type=float, default=None, help="GRPO's and DPO's beta on both sides (default: each "
                   "one's for a model of your own: GRPO 0, no reference model)")
    s.add_argument("--ranks", type=int, default=1, help="ours under torchrun --nproc_per_node RANKS (TRL: 1)")
    s.add_argument("--sweep", default=None, metavar="AXIS=V1,V2,...",
                   help="response_len, prompt_len, rows or ranks: a measurement at each value, and PNG curves")
    s.add_argument("--plots", default=os.path.join(harness.ROOT, "docs", "bench"), help="the sweep's PNG folder")
    s.add_argument("--in_process", action="store_true", help=argparse.SUPPRESS)  # tests: our scripts in this process
    r = sub.add_parser("rollout", parents=[shared], help="the sampler against model.generate")
    r.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="weights (auto: bf16 on a GPU)")
    sub.add_parser("memory", help="the memory model (its own --help)", add_help=False)
    d = sub.add_parser("dispatch", help="ops and host syncs a step dispatches (CPU)")
    d.add_argument("--layers", type=int, default=30, help="SmolLM2's architecture, widths cut, this many layers")
    d.add_argument("--diff", action="store_true", help="each op whose count per decode step differs")
    d.add_argument("--training", action="store_true", help="also a DPO and a GRPO step against a padded transformers one")
    d.add_argument("--launches", action="store_true", help="also the kernel launches of a DPO and a GRPO step, eager "
                   "and --compile_layers, against TRL's padded step (inductor compiles on the CPU: minutes)")
    d.add_argument("--tag", default="")
    d.add_argument("--results", default=harness.RESULTS)
    sub.add_parser("gpu", help="the first command on a lent GPU (its own --help)", add_help=False)
    m = sub.add_parser("micro", help="the micro-benchmarks under pytest-benchmark")
    m.add_argument("-k", default=None, help="pytest's -k: some of them")
    m.add_argument("--tag", default="")
    m.add_argument("--results", default=harness.RESULTS)
    rp = sub.add_parser("report", help="the docs' tables from bench/results/")
    rp.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table differs from its files")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["memory"], ["gpu"]):  # their own command lines
        return (memory if argv[0] == "memory" else gpu).main(argv[1:])
    args = parser().parse_args(argv)
    args.argv = argv
    if args.command in ("steps", "rollout"):
        args.variant = args.variant or (["ours"] if args.command == "steps" else ["ours", "generate"])
        getattr(steps, args.command)(args)
    elif args.command == "dispatch":
        dispatch.main(args)
    elif args.command == "micro":
        micro(args)
    else:
        return report(check=args.check)
    return 0


def micro(args):
    """pytest-benchmark over bench/test_micro.py, its groups as measurements (each impl's rounds, the
    ratio of medians against the group's last: the plain twin)."""
    out = os.path.join(args.results, ".micro-raw.json")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join("bench", "test_micro.py"),
           "--benchmark-only", f"--benchmark-json={out}"] + (["-k", args.k] if args.k else [])
    if subprocess.run(cmd, cwd=harness.ROOT).returncode:
        raise SystemExit("the micro-benchmarks failed (a result not its plain twin's, or an error): see above")
    with open(out) as f:
        raw = json.load(f)["benchmarks"]
    os.remove(out)
    groups = {}
    for b in raw:
        groups.setdefault(b["group"], {})[b["name"].removeprefix("test_")] = {
            "seconds": [b["stats"]["median"]], "rounds": b["stats"]["rounds"],
            "peak_gib": [b.get("extra_info", {}).get("peak_gib")]}
    ms = []
    for group, variants in groups.items():  # a group of one function's impls: each against the last, its plain twin
        names = list(variants)
        twins = len({n.split("[")[0] for n in names}) == 1
        ms.append({"what": group, "variants": variants, "ratios": [
            {"a": a, "b": names[-1], "speed": {"median": variants[names[-1]]["seconds"][0] / variants[a]["seconds"][0]}}
            for a in names[:-1]] if twins else []})
    print(harness.save("micro", harness.device_of(), args.tag, {"measurements": ms}, argv=args.argv,
                       folder=args.results))


# -----------------------------------------------------------------------------
# report: <!-- bench: NAME [NAME...] --> ... <!-- /bench --> in README.md and docs/*.md, each NAME a
# results file (bench/results/NAME.json), its table rendered between the two markers

MARK = re.compile(r"(<!-- bench: ([^>]*?) -->\n)(.*?)(<!-- /bench -->)", re.S)


def fmt(x):
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def summary(variant):
    """A variant's medians over its repeats: tokens/s (or seconds), peak memory, MFU, where measured."""
    out = []
    for key, shown in (("tokens_per_s", "{} tok/s"), ("seconds", "{} s"), ("peak_gib", "{} GiB"), ("mfu", "MFU {}")):
        vals = [v for v in variant.get(key) or [] if v is not None]
        if vals and not (key == "seconds" and "tokens_per_s" in variant):
            x = statistics.median(vals)
            out.append(shown.format(f"{x:.0%}" if key == "mfu" else fmt(x)))
    return ", ".join(out)


def machine(res):
    return f"{res['device']}; {res['commit']}, {res['time'][:10]}"


def command(res):
    """The command that made a file; for one carried over from a script bench/ held before, that script's too."""
    old = res.get("converted_from")
    return f"`{res['argv']}`" + (f" (measured by `{old['command'].split(' --')[0]}`, {old['file']})" if old else "")


def measurement_rows(res):
    """A row per ratio (A against B) of each measurement, or per variant where it has none."""
    rows = []
    for m in res["measurements"]:
        what, v = m["what"], m["variants"]
        for r in m["ratios"] or [{"a": n} for n in v]:
            speed = r.get("tokens_per_s") or r.get("speed") or {}
            rng = f" ({speed['min']:.2f}-{speed['max']:.2f})" if speed.get("min", 1) != speed.get("max", 1) else ""
            mem = r.get("peak_gib")
            rows.append([what, f"`{r['a']}`" + (f" / `{r['b']}`" if "b" in r else ""),
                         f"**{speed['median']:.2f}x**{rng}" if speed else "-", f"{mem['median']:.2f}x" if mem else "-",
                         summary(v[r["a"]]) + (f"; {summary(v[r['b']])}" if "b" in r else ""), machine(res),
                         command(res)])
    return rows


def render(names, where=""):
    """The Markdown table of the results files `names`: measurements (steps, rollout, micro) in one
    shape, tables of rows (dispatch, memory, gpu) as their command wrote them."""
    files = []
    for name in names:
        path = os.path.join(harness.RESULTS, name + ".json")
        if not os.path.isfile(path):
            raise SystemExit(f"{where} names {os.path.relpath(path, harness.ROOT)}, which does not exist: run the "
                             "command that makes it (bench/regenerate.sh lists them)")
        with open(path) as f:
            files.append(json.load(f))
    if all("measurements" in r for r in files):
        head = ["what", "variants (A / B)", "speed A / B, median (range)", "peak memory A / B", "each, median",
                "machine", "command"]
        rows = [row for r in files for row in measurement_rows(r)]
    else:
        head, rows = files[0]["header"], [row for r in files for row in r["rows"]]
    made = [f"Made by {command(r)} on {machine(r)}." for r in files if "measurements" not in r]
    return harness.markdown(head, rows) + ("\n" + "".join(line + "\n" for line in made) if made else "")


def pages():
    """The pages whose marked tables report renders: README.md and docs/*.md."""
    return [os.path.join(harness.ROOT, "README.md"), *sorted(glob.glob(os.path.join(harness.ROOT, "docs", "*.md")))]


def report(check=False):
    """Render every marked table; with check, write nothing and return 1 where one differs."""
    stale = []
    for path in pages():
        with open(path) as f:
            text = f.read()
        new = MARK.sub(lambda m: m[1] + render(m[2].split(), os.path.relpath(path, harness.ROOT)) + m[4], text)
        if new != text:
            stale.append(os.path.relpath(path, harness.ROOT))
            if not check:
                with open(path, "w") as f:
                    f.write(new)
    print(("stale: " if check else "rendered: ") + (", ".join(stale) or "nothing changed"))
    if not check:  # the sweeps' curves, drawn from their files as the tables are (the newer file last)
        files = []
        for path in glob.glob(os.path.join(harness.RESULTS, "steps-*.json")):
            with open(path) as f:
                files.append(json.load(f))
        steps.sweep_plots(sorted((r for r in files if r.get("sweep")), key=lambda r: r["time"]),
                          os.path.join(harness.ROOT, "docs", "bench"))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
