"""The `steps` and `rollout` commands. steps: whole training steps of our scripts at one or more flag
sets, and of TRL 1.16's trainers (GRPO, DPO), each run a process of its own on the same model folder and
rows, alternated A B B A; its first step is warm-up and left out. rollout: the sampler alone,
sampling.generate (eager, compiled) against model.generate in one process, alternated likewise.

Tokens/s counts the tokens a step trains on (prompt + response; GRPO: each side's own completions,
its rollout in the step's time). Peak memory: a GPU's max_memory_allocated since the process started
(ours logs mem/peak_gib; TRL's is read after every step), a CPU's peak resident set of the process
(under torchrun: of the largest rank); beside ours', the memory model's (bench/memory.py) for the flags
the run resolved (its run_config.json). MFU: the step's model FLOPs (harness.step_flops) over its
seconds and the matmul peak measured in the same command.
"""
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile

import torch

from bench import harness, memory
import sampling  # noqa: E402  (on the path harness puts the repository on)

SIDES = {"steps": ("ours", "trl", "trl-defaults"), "rollout": ("ours", "generate")}
AXES = ("response_len", "prompt_len", "rows", "ranks")
TRL_FLAGS = ("--precompute_ref", "--padding_free", "--activation_checkpointing")  # our names for TRL's knobs


def parse_variant(spec, command="steps"):
    """'ours --no-shared_prompt' -> ("ours", ["--no-shared_prompt"]): a side and its own flags."""
    try:
        words = shlex.split(spec)
    except ValueError:  # an unclosed quote
        words = []
    if not words or words[0] not in SIDES[command]:
        raise SystemExit(f"--variant {spec!r}: a variant starts with one of {', '.join(SIDES[command])}")
    if command == "rollout" and set(words[1:]) - {"--compile"}:
        raise SystemExit(f"--variant {spec!r}: the rollout's own flag is --compile")
    if words[0].startswith("trl") and set(words[1:]) - set(TRL_FLAGS):
        raise SystemExit(f"--variant {spec!r}: TRL's side takes {', '.join(TRL_FLAGS)} (bench/trl_side.py)")
    return words[0], words[1:]


def ours_argv(w, flags, out_dir):
    """Our script's command line for workload w: the workload's flags, then the variant's (the last wins)."""
    s, argv = w["script"], ["--model", w["model"], "--dataset", w["data"], "--eval_dataset", w["data"], "--out_dir",
                            out_dir, "--overwrite", "--steps", str(w["steps"] + 1), "--max_prompt_len",
                            str(w["prompt_len"]), "--eval_every", "1000000", "--n_eval", "1"]
    if s == "grpo":
        argv += ["--prompts_per_step", str(w["rows"]), "--group_size", str(w["group_size"]), "--max_new_tokens",
                 str(w["response_len"]), "--n_eval_pairs", "1"]
    else:
        argv += ["--batch_size", str(w["rows"]), "--max_response_len", str(w["response_len"])]
        argv += {"dpo": ["--n_eval_prompts", "1"], "reward": ["--no-normalize"], "sft": []}[s]
    argv += ["--lr", str(w["lr"])] if w["lr"] is not None else []
    argv += ["--beta", str(w["beta"])] if w["beta"] is not None and s in ("grpo", "dpo") else []
    return [f"{s}.py", *argv, *flags]


def run_ours(w, flags, out_dir, in_process=False):
    """One run of our script: its timed steps' seconds, completions, peak, phases and predicted peak."""
    argv, log = ours_argv(w, flags, out_dir), out_dir + ".log"
    if in_process:  # the peak this run added to this process, not a fresh process's
        with harness.peak_memory(w["device"]) as peak:
            if harness.run_in_process(argv[0], argv[1:], log):
                with open(log) as f:
                    raise RuntimeError(f"{' '.join(argv)} failed:\n{f.read()[-3000:]}")
        rss = peak["bytes"]
    else:
        launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                      str(w["ranks"])] if w["ranks"] > 1 else [])
        rss = harness.run_process(launch + argv, log, env=w["env"])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["step"] >= 1 and "time/step" in r]
    with open(os.path.join(out_dir, "run_config.json")) as f:
        cfg = json.load(f)
    with open(log) as f:
        pre = re.search(r"reference log-probs of \d+ train pairs in ([\d.]+)s", f.read())
    timed, gpu = rows[1:], max((r.get("mem/peak_gib", 0) for r in rows), default=0)
    out = {"step_s": statistics.median(r["time/step"] for r in timed), "first_step_s": rows[0]["time/step"],
           "peak_gib": gpu if w["device"].type == "cuda" else rss / 2**30,
           "precompute_s": float(pre.group(1)) if pre else None, "predicted_peak_gib": predicted_peak(w, cfg),
           "what_ran": cfg.get("choices")}  # what `auto` chose for the speed flags, and why
    out |= {k[5:] + "_s": statistics.median(r[k] for r in timed) for k in timed[-1]
            if k.startswith("time/") and k != "time/step"}
    if w["script"] == "grpo":
        out["completion_len"] = statistics.median(r["completions/mean_length"] for r in timed)
    return out


def predicted_peak(w, cfg):
    """bench/memory.py's peak (GiB) for the flags the run resolved; None where the model has no config.json."""
    path = os.path.join(w["model"], "config.json")
    if not os.path.isfile(path):
        return None
    Config = harness.SCRIPTS[w["script"]].Config
    names = {f for f in Config.__dataclass_fields__} - {"activation_checkpointing", "offload_frozen"}
    flags = {k: v for k, v in cfg.items() if k in names and v is not None}
    device = "gpu" if w["device"].type == "cuda" else "cpu"
    phases = memory.estimate(memory.shape_of(path), w["script"], w["ranks"], "torchrun" if w["ranks"] > 1 else "python",
                             device, ac=cfg["activation_checkpointing"], offload_frozen=cfg.get("offload_frozen", False),
                             **flags)
    return memory.total(phases, device)[0] / memory.GIB


def run_trl(w, side, flags, out_dir):
    """One run of TRL's trainer (bench/trl_side.py in a process of its own)."""
    spec = {k: w[k] for k in ("script", "model", "data", "steps", "lr", "beta", "rows", "group_size", "prompt_len",
                              "response_len")} | {"out_dir": out_dir, "flags": flags, "defaults": side == "trl-defaults",
                                                  "dtype": "bf16" if harness.common.bf16_supported(w["device"]) else "fp32"}
    spec["steps"] += 1
    spec["lr"] = spec["lr"] or 1e-6
    with open(out_dir + ".spec.json", "w") as f:
        json.dump(spec, f)
    rss = harness.run_process([sys.executable, "-m", "bench.trl_side", out_dir + ".spec.json", out_dir + ".json"],
                              out_dir + ".log", env=w["env"])
    with open(out_dir + ".json") as f:
        res = json.load(f)
    out = {"step_s": statistics.median(res["step_s"][1:]), "first_step_s": res["step_s"][0],
           "peak_gib": (res["peak_gpu_bytes"] if w["device"].type == "cuda" else rss) / 2**30,
           "precompute_s": res.get("precompute_s"), "what_ran": res["what_ran"]}
    if w["script"] == "grpo":
        out["tokens"] = statistics.mean(res["tokens"][1:])
        out["completion_len"] = statistics.mean(res["completion_len"][1:])
    return out


def measure(w, variants, repeats, pairs=None, in_process=False):
    """One measurement: every variant of workload w run `repeats` times, alternated; each run's metrics
    as lists over the repeats, and the ratios of each pair (default: each variant against the last)."""
    shape = harness.model_shape(w["model"])
    mean_prompt = statistics.mean(p for p, _ in w["lengths"])

    def run(spec, rep):
        side, flags = parse_variant(spec)
        out_dir = os.path.join(w["work"], f"{w['script']}-{harness.slug(spec)}-r{rep}")
        r = run_ours(w, flags, out_dir, in_process) if side == "ours" else run_trl(w, side, flags, out_dir)
        tokens, flops = harness.step_flops(w["script"], w["rows"], w["group_size"], w["lengths"], shape,
                                           completion=r.get("completion_len"))
        if w["script"] == "grpo":
            tokens = r.pop("tokens", w["rows"] * w["group_size"] * (mean_prompt + r["completion_len"]))
        r |= {"tokens_per_s": tokens / r["step_s"], "mfu": flops / r["step_s"] / w["peak_flops"]}
        print(f"  {spec:40s} {r['step_s']:8.3f} s/step {r['tokens_per_s']:9.0f} tok/s  peak "
              f"{r['peak_gib'] or 0:6.2f} GiB" + (f" (model {r['predicted_peak_gib']:.2f})"
                                                  if r.get("predicted_peak_gib") else ""), flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)  # a checkpoint of GPT-2 large per run would fill the disk
        return r

    runs = harness.alternate(list(variants), repeats, run)
    metrics = {v: {k: [r.get(k) for r in rs] for k in rs[0] if k != "what_ran"} | {"what_ran": rs[0].get("what_ran")}
               for v, rs in runs.items()}
    pairs = pairs if pairs is not None else [(v, variants[-1]) for v in variants[:-1]]
    return {"what": describe(w), "script": w["script"], "model": w["model_name"],
            "workload": {k: w[k] for k in ("rows", "group_size", "prompt_len", "response_len", "steps", "lr", "beta",
                                           "ranks", "lengths_kind")},
            "padding_share": harness.padding_share(w["lengths"], w["rows"]), "variants": metrics,
            "ratios": harness.ratios(metrics, pairs)}


def describe(w):
    s = "s" * (w["rows"] != 1)
    rows = f"{w['rows']} prompt{s} x {w['group_size']}" if w["script"] == "grpo" else \
        f"{w['rows']} {'pair' if w['script'] in ('dpo', 'reward') else 'row'}{s}"
    lengths = f"{w['prompt_len']} + {w['response_len']} tokens" if w["lengths_kind"] == "fixed" else \
        f"{w['lengths_kind']} lengths (up to {w['prompt_len']} + {w['response_len']})"
    ranks = f", {w['ranks']} ranks" if w["ranks"] > 1 else ""
    name = {"sft": "SFT", "reward": "Reward model", "dpo": "DPO", "grpo": "GRPO"}[w["script"]]
    return f"{name}, {w['model_name']}, {rows}, {lengths}{ranks}"


def workload(script, model_name, folder, tok, device, work, peak_flops, env=None, **knobs):
    """What measure() runs: the script, model, device and knobs (rows, group_size, prompt_len,
    response_len, steps, lr, beta, ranks, lengths_kind), and the rows of every step, written for both sides."""
    w = dict(script=script, model=folder, model_name=model_name, device=device, env=env or {}, work=work,
             peak_flops=peak_flops, **knobs)
    kind, n = w["lengths_kind"], w["rows"] * (w["steps"] + 1)
    w["lengths"] = harness.row_lengths(kind, n, w["prompt_len"], w["response_len"])
    name = harness.slug(f"{script} {model_name} {w['rows']} {w['prompt_len']} {w['response_len']}") + ".jsonl"
    w["data"] = harness.make_data(os.path.join(work, name), w["lengths"], harness.exact_alphabet(tok), task=kind == "task")
    if kind == "task":
        with open(w["data"]) as f:
            w["lengths"] = [(len(tok(json.loads(r)["prompt"])["input_ids"]), w["response_len"]) for r in f]
    if kind != "fixed":  # the limits: the longest prompt and response, so that no row is cut
        w["prompt_len"], w["response_len"] = (max(col) for col in zip(*w["lengths"]))
    return w


def steps(args):
    """The steps command: each script x model (x sweep point), a measurement; one results file."""
    device = harness.device_of(args.device)
    axis, points = (args.sweep.split("=", 1)[0], [int(x) for x in args.sweep.split("=", 1)[1].split(",")]) \
        if args.sweep else (None, [None])
    if axis not in (None, *AXES):
        raise SystemExit(f"--sweep {args.sweep}: one of {', '.join(AXES)}=v1,v2,...")
    for v in args.variant:
        parse_variant(v)
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if args.threads:  # the matmul peak and the device's name on the runs' threads
        torch.set_num_threads(args.threads)
    peak = harness.matmul_peak(device)
    print(f"steps on {harness.device_name(device)}, matmul peak {peak / 1e9:.0f} GFLOP/s", flush=True)
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        for model in args.model.split(","):
            folder = harness.model_folder(model, work)
            tok = harness.models.load_tokenizer(folder)
            for script in args.script.split(","):
                for x in points:
                    knobs = dict(rows=args.rows, group_size=args.group_size, prompt_len=args.prompt_len,
                                 response_len=args.response_len, steps=args.steps, lr=args.lr, beta=args.beta,
                                 ranks=args.ranks, lengths_kind=args.lengths) | ({axis: x} if axis else {})
                    w = workload(script, model, folder, tok, device, work, peak, env=env, **knobs)
                    print(f"{describe(w)}: {', '.join(args.variant)}", flush=True)
                    m = measure(w, args.variant, args.repeats, in_process=args.in_process)
                    out.append(m | ({"x": {axis: x}} if axis else {}))
                    print_ratios(m)
    path = harness.save("steps", device, args.tag, {"sweep": axis, "matmul_peak_flops": peak, "measurements": out},
                        argv=args.argv, folder=args.results)
    if axis:
        with open(path) as f:
            sweep_plots([json.load(f)], args.plots)
    print(f"wrote {path}")
    return path


def print_ratios(m):
    for r in m["ratios"]:
        t = r.get("tokens_per_s")
        mem = r.get("peak_gib")
        print(f"  {r['a']} / {r['b']}: tokens/s {t['median']:.2f}x ({t['min']:.2f}-{t['max']:.2f})"
              + (f", peak memory {mem['median']:.2f}x" if mem else ""), flush=True)


def sweep_plots(files, folder):
    """Sweeps' results as PNG curves, one a script x model x axis x device
    (docs/bench/sweep-SCRIPT-MODEL-AXIS-DEVICE.png): the points of every file that sweeps it, so that a
    later command can add points to a curve (a later file's point at the same value replaces an earlier's)."""
    curves = {}
    for res in files:
        for m in res["measurements"]:
            key = (m["script"], m["model"], res["sweep"], res["device_kind"])
            curves.setdefault(key, {"device": res["device"], "points": {}})["points"][m["x"][res["sweep"]]] = m
    for (script, model, axis, kind), c in curves.items():
        plot_sweep([c["points"][x] for x in sorted(c["points"])], axis,
                   os.path.join(folder, f"sweep-{script}-{model}-{axis}-{kind}.png"), c["device"])


def plot_sweep(ms, axis, path, device):
    """Against the axis (log 2): each variant's tokens/s, its speed over the last variant's (1: as fast;
    where a curve crosses it, ours stops being faster) and its peak memory, the memory model's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    ratios = ms[0]["ratios"]
    fig, axes = plt.subplots(1, 3 if ratios else 2, figsize=(15 if ratios else 10, 4.2))
    ax1, ax2, ax3 = axes[0], axes[-1], axes[1] if ratios else None
    xs = [m["x"][axis] for m in ms]
    for i, v in enumerate(ms[0]["variants"]):
        med = lambda k: [statistics.median(m["variants"][v][k]) if None not in m["variants"][v][k] else None  # noqa: E731
                         for m in ms]
        ax1.plot(xs, med("tokens_per_s"), "o-", color=f"C{i}", label=v)
        ax2.plot(xs, med("peak_gib"), "o-", color=f"C{i}", label=v)
        if "predicted_peak_gib" in ms[0]["variants"][v] and None not in med("predicted_peak_gib"):
            ax2.plot(xs, med("predicted_peak_gib"), "--", color=f"C{i}", label=f"{v}: bench/memory.py's model")
    for i, r in enumerate(ratios):
        qs = [next(q for q in m["ratios"] if q["a"] == r["a"])["tokens_per_s"] for m in ms]  # median, min, max
        ax3.errorbar(xs, [q["median"] for q in qs], fmt="o-", color=f"C{i}", capsize=3, label=f"{r['a']} / {r['b']}",
                     yerr=[[q["median"] - q["min"] for q in qs], [q["max"] - q["median"] for q in qs]])
    if ratios:
        ax3.axhline(1, color="grey", lw=1)
        ax3.set_ylim(bottom=0)
    for ax, label in ((ax1, "tokens / s (higher is better)"), (ax3, "speed ratio, tokens / s (1: as fast)"),
                      (ax2, "peak memory, GiB")):
        if ax is None:
            continue
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if y]
        ax.set_xscale("log", base=2)
        if ax is not ax3 and ys and max(ys) > 4 * min(ys):  # log axes where the values span enough of a decade
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlabel(axis)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{ms[0]['what'].split(',')[0]} on {ms[0]['model']}, against {axis}: {device}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"drew {path}")


# -----------------------------------------------------------------------------
# rollout: sampling.generate against model.generate, in one process


def real_divergences(model, ids, mask, ours, ref, pad_id):
    """(B,) True where two greedy outputs part at a token whose reference top-2 logits are more than one
    bf16 step apart: a difference the rounding of two kernel paths cannot explain (a near-tie may go
    either way). ours, ref: right-padded (B, R) ids after the left-padded prompts."""
    R = max(ours.shape[1], ref.shape[1])
    a, b = (torch.nn.functional.pad(x, (0, R - x.shape[1]), value=pad_id) for x in (ours, ref))
    real = torch.zeros(len(a), dtype=torch.bool, device=a.device)
    for i in (a != b).any(-1).nonzero().flatten().tolist():
        t = int((a[i] != b[i]).nonzero()[0])  # the first token where they part
        seq = torch.cat([ids[i], b[i, :t]])[None]
        m = torch.cat([mask[i], torch.ones(t, dtype=mask.dtype, device=mask.device)])[None]
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=m,
                           position_ids=harness.common.position_ids_from_mask(m)).logits
        top = logits[0, -1].float().topk(2).values
        step = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(top[0].abs().clamp(min=1e-30)))
        real[i] = bool(top[0] - top[1] > step)
    return real


def rollout(args):
    """The rollout command: each variant's tokens/s and peak, greedy rows against model.generate's."""
    device = harness.device_of(args.device)
    variants = [parse_variant(v, "rollout") for v in args.variant]
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        folder = harness.model_folder(args.model, work)
        tok = harness.models.load_tokenizer(folder)
        model = harness.models.load_model(folder, tok)
    if type(model.get_output_embeddings()) is torch.nn.Linear:  # the scripts' head: fp32 logits
        model.get_output_embeddings().__class__ = harness.lm_head.FP32Head
    dtype = torch.bfloat16 if args.dtype == "bf16" or args.dtype == "auto" and device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    lengths = harness.row_lengths(args.lengths, args.rows, args.prompt_len, args.response_len)
    ids, mask = harness.prompts_batch(tok, args.rows, args.group_size, device, lengths)
    B, N, pad, eos = ids.shape[0], args.response_len, tok.pad_token_id, tok.eos_token_id

    def call(side, flags, n=N, greedy=False):
        if side == "generate":
            sample = {} if greedy else dict(do_sample=True, min_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0)
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad,
                                  eos_token_id=eos, **sample)[:, ids.shape[1]:]
        g = torch.Generator(device=device).manual_seed(0)
        return sampling.generate(model, ids, mask, n, eos if greedy else -1, pad, temperature=0 if greedy else 1.0,
                                 generator=g, compile="--compile" in flags)[0]  # EOS -1: no early stop

    names, fns, compile_s, greedy = list(args.variant), {}, {}, {}
    with torch.no_grad():
        ref = call("generate", [], greedy=True)
        for spec, (side, flags) in zip(names, variants):
            fns[spec] = lambda s=side, f=flags: call(s, f)
            first, out = harness.clock(fns[spec], device)  # warm-up (a compile's first call)
            warm, _ = harness.clock(fns[spec], device)
            compile_s[spec] = first - warm if "--compile" in flags else None
            if out.shape[1] != N:
                raise SystemExit(f"{spec}: {out.shape[1]} new tokens, not {N}: a row stopped early")
            got = call(side, flags, greedy=True)
            R = max(got.shape[1], ref.shape[1])
            same = (torch.nn.functional.pad(got, (0, R - got.shape[1]), value=pad) ==
                    torch.nn.functional.pad(ref, (0, R - ref.shape[1]), value=pad)).all(-1)
            real = int(real_divergences(model, ids, mask, got, ref, pad).sum())
            greedy[spec] = {"identical_rows": float(same.float().mean()), "real_divergences": real}
            if real or (dtype == torch.float32 and device.type == "cpu" and not bool(same.all())):
                raise SystemExit(f"{spec}: greedy rows part from model.generate's where no rounding explains it")

        def run(spec, rep):
            with harness.peak_memory(device) as peak:
                seconds, _ = harness.clock(fns[spec], device)
            return {"seconds": seconds, "tokens_per_s": B * N / seconds, "peak_gib": peak["bytes"] / 2**30}

        runs = harness.alternate(names, args.repeats, run)
    metrics = {v: {k: [r[k] for r in rs] for k in rs[0]} | {"compile_s": compile_s[v], "greedy": greedy[v]}
               for v, rs in runs.items()}
    m = {"what": f"rollout, {args.model}, {args.rows} prompts x {args.group_size}, {ids.shape[1]} + {N} tokens, "
                 f"{str(dtype)[6:]}", "model": args.model, "variants": metrics,
         "ratios": harness.ratios(metrics, [(v, names[-1]) for v in names[:-1]])}
    for v, x in metrics.items():
        print(f"  {v:24s} {statistics.median(x['tokens_per_s']):9.0f} tok/s; greedy rows identical "
              f"{x['greedy']['identical_rows']:.0%}" + (f"; compile {x['compile_s']:.1f} s" if x["compile_s"] else ""))
    print_ratios(m)
    path = harness.save("rollout", device, args.tag, {"measurements": [m]}, argv=args.argv, folder=args.results)
    print(f"wrote {path}")
    return path
