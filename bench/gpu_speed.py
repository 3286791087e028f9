"""One command for speed on a GPU, run first whenever one is lent (issue 55: at most ~8 minutes on one
H100/H200): ours at default flags against TRL 1.16 and against plain model.generate.

    python bench/gpu_speed.py                          # every section, in order, until --budget_s is spent
    python bench/gpu_speed.py --only grpo,dpo --shapes qwen2.5-0.5b   # what a budget left out
    python bench/gpu_speed.py --cpu                    # tiny shapes, seconds (tests/test_gpu_speed.py runs it)

Sections, in this order; one that would start after --budget_s seconds (default 240) is skipped, its
row naming the command that runs it (the command ends within ~8 minutes of an H200's time, machine
start included; its results are written after each section, should it be killed):
  exact    at equal weights a frozen copy's no-grad pass gives the policy's update forward's log-probs to
           the bit on the device, under bf16 autocast as grpo.py runs, padded, packed and sharing prompts
           (tests/test_exact.py's check, whose CPU kernels a GPU's may not share: SDPA's backend or cuBLAS's
           algorithm chosen by whether a weight needs a gradient would break it), seconds.
  compile  grpo.py --compile on Qwen2.5-0.5B's shape through 4 steps evaluating every one
           (bench/gpu_check.py's (b) and (d) rows): nothing compiled, recorded or re-recorded after
           step 2, KL 0 at lr 0.
  decode   the rollout's decode on SmolLM2's shape (random weights, fp32 under bf16 autocast as
           grpo.py's rollout), 16 prompts x G = 8, 128 + 128 tokens: sampling.generate eager and
           compiled (CUDA graphs) against model.generate, tokens/s, alternating 4 times (ABBA x2);
           ops and host syncs per decode step (bench/dispatch.py); and a profile of each side's
           eager call of 16 decode steps (torch.profiler): the device's busy share of the wall time,
           the top kernels by device time and the top ops by host time. Where ours costs more per
           op than model.generate (issue 55, item 4), this says whether the host or a kernel pays.
  grpo     ours at its default flags against TRL 1.16's GRPOTrainer (bench/trl_compare.py's runs, each
           side in its own process), 16 prompts x G = 8, 128 + 128 tokens, one optimizer step a
           rollout, a warm-up step and a timed one, ABBA x2: tokens/s, peak memory, and the update's
           MFU (its model FLOPs over its seconds, against the bf16 matmul peak measured here).
  dpo      the same for DPO, 16 pairs of 256 + 256 tokens, a live reference on both sides.
grpo and dpo run each shape of --shapes (SmolLM2's, then Qwen2.5-0.5B's). TRL runs where `import
trl` works; to carry it to a machine without a registry, see docs/gpu.md ("TRL as wheels").
Results: bench/results/gpu-speed-<device>.json and .md, the .md's table the rows of
docs/performance.md's GPU section, with the device's name and the command.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import sampling  # noqa: E402
from bench import dispatch, gpu_check, memory, trl_compare, util  # noqa: E402
from bench.steps import exact_alphabet, make_data, matmul_peak  # noqa: E402
from plumbing import models  # noqa: E402

SECTIONS = ("exact", "compile", "decode", "grpo", "dpo")
BF16_PEAK = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core FLOP/s of the SXM parts (NVIDIA's data sheets)
GPU = dict(shapes=("smollm2-random", "qwen2.5-0.5b"), decode=dict(prompts=16, G=8, prompt=128, new=128),
           grpo=dict(batch_size=16, group_size=8, prompt_len=128, response_len=128),
           dpo=dict(batch_size=16, prompt_len=256, response_len=256), steps=1, repeats=2, budget_s=240)
CPU = dict(shapes=("qwen2-tiny",), decode=dict(prompts=4, G=2, prompt=12, new=8),
           grpo=dict(batch_size=2, group_size=2, prompt_len=12, response_len=6),
           dpo=dict(batch_size=2, prompt_len=12, response_len=6), steps=1, repeats=2, budget_s=None)
SHAPES = {"qwen2.5-0.5b": gpu_check.QWEN_05B, "qwen2-tiny": gpu_check.CPU["shapes"]["qwen2 tiny"]}


def row(section, what, value, note=""):
    return dict(section=section, what=what, value=value, note=note)


def save_shape(shape, folder):
    """A random-weight model of `shape` saved with the character tokenizer (both sides load it):
    bench/util.py's shapes, or a Qwen2 one of bench/memory.py's format (its 151,936 ids mostly unused)."""
    if shape not in SHAPES:
        return trl_compare.save_model(shape, folder)
    from transformers import AutoModelForCausalLM

    import tasks

    tok = tasks.char_tokenizer()
    config = memory.hf_config(SHAPES[shape])
    config.eos_token_id = config.pad_token_id = config.bos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def body_shape(folder):
    """(layers, attention width, parameters outside the embeddings and head, vocabulary) of a saved model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    emb = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    text = config.get_text_config()
    width = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, width * text.num_attention_heads, body, text.vocab_size


def train_flops(rows, prompt, response, shape):
    """Model FLOPs of a forward and backward of `rows` sequences of prompt + response tokens (PaLM,
    arXiv:2204.02311 App. B, as bench/steps.step_work counts them): 6 x body parameters + 12 x layers
    x width x S per token, the head's 6 x width x V at the response positions only."""
    L, width, body, V = shape
    S = prompt + response
    return rows * (S * (6 * body + 12 * L * width * S) + 6 * width * V * response)


# -----------------------------------------------------------------------------
# decode: ours eager and compiled against model.generate; ops per step; a profile of each


def decode_section(plan, device):
    size = plan["decode"]
    tok, model = util.random_model("smollm2-random" if device.type == "cuda" else "tiny")
    model.get_output_embeddings().__class__ = common.FP32Head  # the scripts' head (models.load_model)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tok), (size["prompts"], size["prompt"]), generator=g)
    ids = prompts.repeat_interleave(size["G"], 0).to(device)  # (B, P): a group's rows in a run, as GRPO's
    mask = torch.ones_like(ids)
    B, N, pad = ids.shape[0], size["new"], tok.pad_token_id
    d = common.Dist(device=device)

    def ours(n=N, compile=False):
        with common.autocast(d):
            return sampling.generate(model, ids, mask, n, -1, pad, temperature=1.0, compile=compile,
                                     generator=torch.Generator(device=device).manual_seed(0))

    def generate(n=N):
        with common.autocast(d):
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                                  eos_token_id=tok.eos_token_id)

    fns = {"ours eager": ours, "model.generate": generate}
    out = []
    if device.type == "cuda":
        t0 = time.perf_counter()
        ours(compile=True)
        util.sync(device)
        out.append(row("decode", "ours compiled: first call (compile and record)", f"{time.perf_counter() - t0:.1f} s"))
        fns["ours compiled"] = lambda: ours(compile=True)
    seconds = {k: [] for k in fns}
    with torch.no_grad():
        for k, fn in fns.items():  # warm-up
            fn()
        for rep in range(4):  # ABBA x2
            for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                util.sync(device)
                t0 = time.perf_counter()
                fns[k]()
                util.sync(device)
                seconds[k].append(time.perf_counter() - t0)
    hf = statistics.median(seconds["model.generate"])
    for k, s in seconds.items():
        ratios = [h / x for h, x in zip(seconds["model.generate"], s)]
        out.append(row("decode", f"{k}: {B} rows x {N} tokens, tokens/s (ms a token)",
                       f"{B * N / statistics.median(s):,.0f} ({1e3 * statistics.median(s) / N:.1f} ms)",
                       f"{hf / statistics.median(s):.2f}x model.generate (rounds {min(ratios):.2f}-{max(ratios):.2f})"))
    counts = dispatch.decode_step(model, ids, mask, pad, tok.eos_token_id, short=8, more=16)
    for k, (ops, syncs) in counts.items():
        out.append(row("decode", f"{'ours eager' if k == 'ours' else 'model.generate'}: ops and host syncs a decode "
                                 f"step", f"{dispatch.total(ops):.0f} ops, {dispatch.total(syncs):.3f} syncs"))
    profiles = {k: profile(lambda f=fns[k]: f(17), device) for k in ("ours eager", "model.generate")}
    for k, p in profiles.items():
        out.append(row("decode", f"{k}: profile of 16 decode steps (and the prefill)",
                       f"device busy {p['busy']:.0%} of {p['wall_ms']:.0f} ms; {p['ops']} ops",
                       "top kernels and host ops: the JSON's `profiles`"))
    return out, {"profiles": profiles, "seconds": seconds}


def profile(fn, device, top=25):
    """torch.profiler over one call: wall ms, the device's busy share (its kernels' time over the
    wall), and the top kernels by device time and ops by host (self CPU) time, with counts."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad():
        fn()
        util.sync(device)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            util.sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def dev(e):
        return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)

    kernels = [e for e in events if dev(e) > 0 and not e.key.startswith(("aten::", "cuda"))]
    ops = [e for e in events if e.key.startswith("aten::")]
    table = lambda es, key: [dict(name=e.key, count=e.count, device_us=round(dev(e), 1),  # noqa: E731
                                  host_us=round(e.self_cpu_time_total, 1)) for e in sorted(es, key=key)[:top]]
    return dict(wall_ms=1e3 * wall, busy=sum(dev(e) for e in kernels) / 1e6 / wall if kernels else 0.0,
                ops=sum(e.count for e in ops), kernels=table(kernels, lambda e: -dev(e)),
                host_ops=table(ops, lambda e: -e.self_cpu_time_total))


# -----------------------------------------------------------------------------
# exact: the reference's pass is the policy's own on this device (tests/test_exact.py's check)


def exact_section(plan, device):
    """A random Qwen2.5-0.5B-shaped model (4 of its layers: the kernels, not the depth, are in question)
    against its frozen copy (common.freeze), rows in groups sharing left-padded prompts, responses of
    many lengths."""
    import copy

    from transformers import AutoModelForCausalLM

    import shared_prompt

    d = common.Dist(device=device)
    config = memory.hf_config(SHAPES["qwen2-tiny"] if device.type == "cpu" else dict(SHAPES["qwen2.5-0.5b"], L=4))
    torch.manual_seed(0)
    policy = models.no_dropout(AutoModelForCausalLM.from_config(config)).to(device).train()
    ref = common.freeze(copy.deepcopy(policy), d)
    g = torch.Generator().manual_seed(0)
    V, G = config.vocab_size, 4
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (40, 17, 64, 5) for _ in range(G)]
    responses = [torch.randint(3, V, (1 + (7 * i) % 48,), generator=g).tolist() for i in range(len(prompts))]
    ids, attn, resp = (t.to(device) for t in common.join_prompt_response(prompts, responses, 0))
    rows, out = torch.arange(len(ids), device=device), []
    for packed, shared in ((False, False), (True, False), (False, True)):
        with common.autocast(d):
            want = shared_prompt.response_logprobs(policy, ids, attn, resp.shape[1], with_entropy=True, packed=packed,
                                                   shared=shared)[0].float().detach()
        got = shared_prompt.planned_logprobs(ref, ids, attn, resp.shape[1], [([rows], packed, shared)], d)
        gap = float(((got - want) * resp).abs().max())
        layout = "shared" if shared else "packed" if packed else "padded"
        precision = ", bf16 autocast" if common.bf16_supported(device) else ""
        out.append(row("exact", f"frozen copy vs the policy's update forward, {layout}{precision}",
                       f"max |diff| {gap:.3g}", "equal to the bit: pass" if gap == 0 else
                       "FAIL: at equal weights the KL's gradient is float noise here"))
    return out, {}


# -----------------------------------------------------------------------------
# compile: grpo.py --compile through an evaluation every step (bench/gpu_check.py's run)


def compile_section(device, work):
    if device.type != "cuda":
        return [row("compile", "grpo.py --compile through evaluations", "not run", "CUDA graphs need a GPU")], {}
    tok = gpu_check.make_tokenizer(gpu_check.GPU["tokenizer_vocab"])
    folder = gpu_check.build_folder(os.path.join(work, "qwen2.5-0.5b-bpe"), gpu_check.QWEN_05B, tok, device,
                                    gpu_check.GPU["dtype"])
    gpu_check.free(device)
    paths = gpu_check.write_data(work, models.load_tokenizer(folder), gpu_check.GPU)
    rows = gpu_check.run_grpo("qwen2.5-0.5b", "python", ["--compile"], {"qwen2.5-0.5b": folder}, paths,
                              gpu_check.GPU, work, cpu=False, only={"b", "d"})
    return [row("compile", r["what"], r["value"], f"{r['bound']}: {'pass' if r['ok'] else 'FAIL'}"
                if r["ok"] is not None else "") for r in rows], {"rows": rows}


# -----------------------------------------------------------------------------
# grpo and dpo: ours at its default flags against TRL 1.16, each side in its own process


def trl_importable():
    return subprocess.run([sys.executable, "-c", "import trl"], capture_output=True).returncode == 0


def race(algo, shape, plan, device, peak, work, trl):
    """ABBA x repeats of ours (default flags) and TRL on one shape: rows, and every run's case."""
    size = plan[algo]
    folder = os.path.join(work, shape)
    if not os.path.isdir(folder):
        save_shape(shape, folder)
    dims = body_shape(folder)
    n_rows = 512 if algo == "grpo" else size["batch_size"] * (plan["steps"] + 1)
    data = make_data(os.path.join(work, f"{algo}-{shape}.jsonl"), n_rows, size["prompt_len"], size["response_len"],
                     alphabet=exact_alphabet(models.load_tokenizer(folder)))
    a = SimpleNamespace(**({"group_size": 1} | size), steps=plan["steps"], lr=1e-6, lengths="fixed",
                        prompt_mean=size["prompt_len"], response_mean=size["response_len"])
    dtype = "bf16" if common.bf16_supported(device) else "fp32"
    sides = {"ours": ("ours", {"precompute": False, "padding_free": None, "shared_prompt": None}),
             "trl": ("trl", {"gc": False, "precompute": False, "padding_free": False})}
    if not trl:
        sides.pop("trl")
    runs = {k: [] for k in sides}
    with contextlib.ExitStack() as stack:
        if device.type == "cpu":  # the scripts in this process, as gpu_check.py --cpu runs them: seconds, not a
            stack.enter_context(_in_process())  # fresh interpreter's each
        for rep in range(plan["repeats"]):
            for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):  # ABBA
                side, settings = sides[name]
                runs[name].append(trl_compare.run_variant(algo, name, side, settings, a, folder, data, work, dtype,
                                                          rep))
    rows_ = dict(grpo=size["batch_size"] * size.get("group_size", 1), dpo=2 * size["batch_size"])[algo]
    flops = train_flops(rows_, size["prompt_len"], size["response_len"], dims)
    out = []
    for name, cases in runs.items():
        c = trl_compare.median_run(cases)
        update_s, update_flops = update_time(algo, name, c), flops * (4 / 3 if algo == "dpo" or name == "ours" else 1)
        mfu = update_flops / update_s / peak if update_s else None
        out.append(row(algo, f"{shape}, {name}: tokens/s, peak GiB, update MFU",
                       f"{c['tokens_per_s']:,.0f}, {(c['peak_gpu_bytes'] or c['peak_rss_bytes']) / 2**30:.1f} GiB, "
                       + (f"{mfu:.1%}" if mfu else "-"),
                       f"{c['step_seconds']:.3f} s a step (repeats "
                       + ", ".join(f"{s:.3f}" for s in c["repeats_step_seconds"]) + ")"))
    if "trl" in runs:
        r = trl_compare.pair_ratios(runs, "ours", "trl", device.type == "cuda")
        per = r["tokens_per_s_ratio_repeats"]
        out.append(row(algo, f"{shape}: ours / TRL 1.16, tokens/s (memory)",
                       f"{r['tokens_per_s_ratio']:.2f}x ({r['peak_memory_ratio']:.2f}x)",
                       f"repeats {min(per):.2f}-{max(per):.2f}; wanted >= {2.0 if algo == 'grpo' else 1.5}x at <= 1x"))
    else:
        out.append(row(algo, f"{shape}: ours / TRL 1.16", "TRL not importable", "docs/gpu.md: TRL as wheels"))
    return out, runs


@contextlib.contextmanager
def _in_process():
    """trl_compare's runs of our scripts in this process (gpu_check.launch), peak RSS the process's;
    TRL's side (bench/trl_compare.py --child, where TRL is installed) in its own process, as on a GPU."""
    import resource

    def run_case(argv, log_path):
        if os.path.dirname(argv[0]):  # not one of the top-level scripts
            return saved(argv, log_path)
        if gpu_check.launch(argv[0], argv[1:], log_path, "python", in_process=True) != 0:
            with open(log_path) as f:
                raise RuntimeError(f"{' '.join(argv)} failed:\n{f.read()[-3000:]}")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    saved, trl_compare.run_case = trl_compare.run_case, run_case
    try:
        yield
    finally:
        trl_compare.run_case = saved


def update_time(algo, name, case):
    """Seconds of the update: DPO's whole step; GRPO's time/update (ours: the reference's pass, the
    policy's forward and backward, the optimizer), or TRL's step less its generation, rewards and
    reference pass (_generate_and_score_completions)."""
    if algo == "dpo":
        return case["step_seconds"]
    phases = case.get("phase_seconds") or {}
    if name == "ours":
        return phases.get("update")
    return case["step_seconds"] - phases["generate_and_score"] if "generate_and_score" in phases else None


# -----------------------------------------------------------------------------


def table(rows):
    lines = ["| section | what | value | note |", "|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['what']} | {r['value']} | {r['note']} |" for r in rows]
    return "\n".join(lines)


def write(args, argv, name, rows, details, seconds):
    """The table (.md) and everything measured (.json) in --results, named by the device; the report."""
    cmd = " ".join(["python bench/gpu_speed.py", *(sys.argv[1:] if argv is None else argv)])
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout
    report = (f"# bench/gpu_speed.py on {name}\n\n`{cmd}`: torch {torch.__version__}, commit "
              f"{commit.strip() or 'unknown'}, {time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s\n\n{table(rows)}\n")
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"gpu-speed-{gpu_check.slug(name)}")
    with open(path + ".md", "w") as f:
        f.write(report)
    with open(path + ".json", "w") as f:
        json.dump({"device": name, "command": cmd, "rows": rows, "details": details}, f, indent=1, default=str)
    return report + f"\nwritten to {path}.md and .json"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU, seconds (tests/test_gpu_speed.py)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--shapes", default=None, help="grpo and dpo's shapes, comma-separated (default: both)")
    p.add_argument("--budget_s", type=float, default=None, help="start no section after this many seconds (GPU: 240)")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="folder of the results")
    args = p.parse_args(argv)
    only = args.only.split(",")
    if set(only) - set(SECTIONS):
        p.error(f"--only {args.only}: sections are {', '.join(SECTIONS)}")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_speed: no CUDA GPU is visible. Run it on a machine with a GPU, or pass --cpu for the "
                         "tiny CPU subset.")
    plan = CPU if args.cpu else GPU
    shapes = args.shapes.split(",") if args.shapes else list(plan["shapes"])
    budget = args.budget_s if args.budget_s is not None else plan["budget_s"]
    device = torch.device("cpu" if args.cpu else "cuda")
    name = util.device_name(device) if device.type == "cuda" else "CPU"
    trl = trl_importable()
    peak, _ = matmul_peak(device, torch.bfloat16 if common.bf16_supported(device) else torch.float32)
    spec = next((v for k, v in BF16_PEAK.items() if k in name), None)
    rows = [row("all", "matmul peak measured here (bf16 on a GPU, MFU's reference)", f"{peak / 1e12:.1f} TFLOP/s",
                f"data sheet {spec / 1e12:.0f}" if spec else "")]
    t0, details = time.time(), {}
    print(f"gpu_speed on {name}, torch {torch.__version__}, trl {'importable' if trl else 'not importable'}",
          flush=True)
    todo = [(s, None) for s in SECTIONS[:3] if s in only] + [(s, shape) for shape in shapes for s in SECTIONS[3:]
                                                              if s in only]
    with tempfile.TemporaryDirectory(prefix="gpu_speed-") as work:
        for section, shape in todo:
            what = section + (f" {shape}" if shape else "")
            if budget is not None and time.time() - t0 > budget:
                again = f"python bench/gpu_speed.py --only {section}" + (f" --shapes {shape}" if shape else "")
                rows.append(row(section, f"{what}: skipped", f"the budget ({budget:.0f} s) was spent", again))
                continue
            s0 = time.time()
            try:
                if section == "exact":
                    got, details["exact"] = exact_section(plan, device)
                elif section == "decode":
                    got, details["decode"] = decode_section(plan, device)
                elif section == "compile":
                    got, details["compile"] = compile_section(device, work)
                else:
                    got, runs = race(section, shape, plan, device, peak, work, trl)
                    details[what] = runs
            except Exception as e:  # noqa: BLE001  a section that fails is a row; the others still run
                got = [row(section, f"{what}: FAILED", f"{type(e).__name__}: {str(e)[-300:]}")]
            rows += got
            print(f"{what} done in {time.time() - s0:.0f} s\n" + table(got), flush=True)
            write(args, argv, name, rows, details, time.time() - t0)  # what ran so far, should the command be killed
            gpu_check.free(device)
    seconds = time.time() - t0
    rows.append(row("all", "wall time of this command", f"{seconds:.0f} s", f"budget {budget:.0f} s" if budget else ""))
    print("\n" + write(args, argv, name, rows, details, seconds), flush=True)
    return 1 if any("FAILED" in r["what"] or "FAIL" in r["note"] for r in rows) else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
