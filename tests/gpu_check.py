"""One command that proves the GPU path on real shapes, in under 10 minutes on one H100 (the proofs a
GPU can make; bench/ measures: `python -m bench gpu` runs this as its last section, and its (b) and (d)
--compile run as its compile section):

    python tests/gpu_check.py                 # on a CUDA GPU: every check below
    python tests/gpu_check.py --only a,e      # some of them
    python tests/gpu_check.py --cpu           # the CPU subset on tiny shapes (tests/test_gpu_path.py runs it)

The models are built from configs with random weights and saved as folders with a tokenizer (a
byte-level BPE trained here, 4,096 tokens, the rest of the vocabulary unused), then loaded as a
user loads them: a Qwen2.5-0.5B and a Qwen2.5-1.5B shape (RoPE, GQA, tied head, 151,936 tokens),
a 4-layer Llama-3-8B shape (untied head, 128,256 tokens), and SmolLM2-135M-Instruct's real
weights where its package is installed (models.model_folder("smollm2")). Checks:
(a) the sampler's log-probs (sampling.generate(..., return_logprobs=True): the behaviour policy's,
    truncated to top-p and renormalised) against the training forward (common.response_logprobs)
    of the same tokens with the top-p rule replayed (grpo.py's --sampling_replay), temperature 0.7,
    top-p 0.95, prompts of distinct lengths (left padding): fp32 with TF32 off, max |diff| <= 1e-4;
    bf16 autocast (as the scripts run on one GPU), p99 and max, max <= 0.05; beside them, without a
    bound, the gap without the replay (the full policy's log-probs: the truncation's log kept mass
    on top of the numerics) and the response positions where the rule on the trainer's logits keeps
    another set than the sampler kept (recorded inside sample_token); and the rows scored in contiguous
    chunks (the old log-probs) against the same rows dealt into mini-batches by
    grpo.minibatch_rows with gradients on (the update): identical, bit for bit.
(b) grpo.py at lr 0, 2 passes x 2 mini-batches, temperature 0.7, top-p 0.95, under `python` and
    `torchrun --nproc_per_node 1`, with and without --activation_checkpointing and
    --offload_frozen, and with --lora (its reference: the adapters off; its frozen base cast to bf16
    once per rollout): the policy is its reference and its own old policy, so KL <= 1e-5, no token
    clipped (clip_ratio/low = clip_ratio/high = 0) and rollout/logp_diff <= 1e-2, read from
    metrics.jsonl; rewards must differ within some group (else no advantage could be clipped).
(c) each run's logged peak (mem/peak_gib) against bench/memory.py's estimate of the same flags
    and shape (its config.json), within 10% + 1 GiB; --compile, --teacher and --lora runs included.
(d) --compile under TORCH_LOGS=recompiles,cudagraphs,dynamo, 4 steps evaluating every one (training
    and evaluation rollouts of other rows alternate): compiled (at most 4 times) and CUDA graphs
    recorded in steps 0-2, nothing compiled or recorded after step 2, nothing re-recorded or
    skipped; ms per decoded token (the
    rollout's time over its tokens, prefill included) eager, compiled, under torchrun x1 and with
    --lora.
(e) dpo.py at lr 0, with --precompute_ref and with a live reference: loss within 1e-3 of ln 2,
    rewards/margins within 1e-3 of 0.
(f) at equal weights a frozen copy's no-grad pass (common.freeze, shared_prompt.planned_logprobs) gives
    the policy's update forward's log-probs to the bit on the device, under bf16 autocast, padded, packed
    and sharing prompts (tests/test_exact.py's check, whose CPU kernels a GPU's may not share: a kernel
    chosen by whether a weight needs a gradient would make the KL's gradient at equal weights noise).
The table (check, value, bound, pass/FAIL) goes to stdout and to
bench/results/gpu-check-<device>.md, with the device's name (its rows also to gpu-check-rows.json); the
exit status is 1 if any check failed. The CPU subset: (a), (b), (e) and (f) on tiny shapes, the scripts
run in this process (and
under torchrun with --launchers python,torchrun); no memory or compile checks (they read CUDA's).
"""
import argparse
import contextlib
import gc
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import grpo  # noqa: E402
import sampling  # noqa: E402
import shared_prompt  # noqa: E402
from bench import harness, memory  # noqa: E402
from plumbing import models  # noqa: E402

QWEN_05B = dict(L=24, h=896, heads=14, kv_heads=2, I=4864, V=151936, tied=True, gated=True, pos=0)
GPU = dict(  # what the check runs on a GPU: shapes in bench/memory.py's format, sizes of each check
    shapes={"qwen2.5-0.5b": QWEN_05B, "qwen2.5-1.5b": memory.SHAPES["qwen2.5-1.5b"],
            "llama-3-8b, 4 layers": dict(memory.SHAPES["llama-3-8b"], L=4)},
    smollm2=True, tokenizer_vocab=4096, dtype=torch.bfloat16,  # saved in bf16, as the hub's checkpoints are
    sampler=dict(prompts=8, group=4, min_prompt=16, max_prompt=128, new_tokens=64, mini_batches=2, grad_accum=2),
    grpo=dict(prompts_per_step=8, group_size=8, max_prompt_len=128, max_new_tokens=128),
    grpo_runs=[  # (shape, launcher, extra flags)
        ("qwen2.5-0.5b", "python", []), ("qwen2.5-0.5b", "python", ["--activation_checkpointing"]),
        ("qwen2.5-0.5b", "torchrun", []),
        ("qwen2.5-0.5b", "torchrun", ["--activation_checkpointing", "--offload_frozen"]),
        ("llama-3-8b, 4 layers", "python", []), ("llama-3-8b, 4 layers", "torchrun", []),
        ("llama-3-8b, 4 layers", "python", ["--teacher", "SELF"]),  # SELF: the policy's folder; 7 GiB in fp32
        ("qwen2.5-0.5b", "python", ["--compile"]),  # 3 steps: a CUDA graph re-recorded in step 3 shows
        ("qwen2.5-0.5b", "python", ["--lora"])],  # the frozen base cast once per rollout (environment.frozen_in_bf16)
    dpo=dict(shape="qwen2.5-0.5b", batch_size=8, max_prompt_len=128, max_response_len=128),
    exact=dict(QWEN_05B, L=4), budget_s=600)
CPU = dict(
    shapes={"qwen2 tiny": dict(L=2, h=64, heads=4, kv_heads=2, I=128, V=512, tied=True, gated=True, pos=0),
            "llama tiny": dict(L=2, h=64, heads=4, kv_heads=2, I=128, V=384, tied=False, gated=True, pos=0)},
    smollm2=False, tokenizer_vocab=300, dtype=torch.bfloat16,
    sampler=dict(prompts=4, group=4, min_prompt=3, max_prompt=12, new_tokens=12, mini_batches=2, grad_accum=2),
    grpo=dict(prompts_per_step=4, group_size=4, max_prompt_len=16, max_new_tokens=8),
    grpo_runs=[("qwen2 tiny", "python", []), ("qwen2 tiny", "python", ["--activation_checkpointing"]),
               ("qwen2 tiny", "python", ["--teacher", "SELF"]),
               ("qwen2 tiny", "torchrun", []), ("llama tiny", "torchrun", ["--activation_checkpointing"])],
    dpo=dict(shape="qwen2 tiny", batch_size=4, max_prompt_len=16, max_response_len=8),
    exact=dict(L=2, h=64, heads=4, kv_heads=2, I=128, V=512, tied=True, gated=True, pos=0), budget_s=None)
T, TOP_P = 0.7, 0.95
REPLAY = sampling.truncation(top_p=TOP_P)  # grpo.py's --sampling_replay at --top_p TOP_P
BOUNDS = dict(fp32=1e-4, bf16_rel=2.0, kl=1e-5, logp_diff=1e-2, mem_rel=0.10, mem_abs_gib=1.0, compilations=4,
              dpo=1e-3)
TORCH_LOGS = "recompiles,cudagraphs,dynamo"


def row(check, what, value, bound, ok):
    """A line of the table; ok: True, False, or None for a figure without a bound."""
    return dict(check=check, what=what, value=value, bound=bound, ok=ok)


# -----------------------------------------------------------------------------
# the models and data, as a user brings them


def make_tokenizer(vocab_size):
    """A byte-level BPE (Qwen's and Llama-3's kind) trained here on lines of random words of
    letters and digits, with one special token, <|endoftext|>, as EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(word(rng) for _ in range(24)) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def word(rng):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(1, 6)))


def text(tok, rng, lo, hi):
    """Random words of lo to hi tokens (each word is at least one)."""
    n = rng.randint(lo, hi)
    words = [word(rng) for _ in range(n)]
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) > n:
        words.pop()
    return " ".join(words)


def build_folder(path, shape, tok, device, dtype):
    """A model of this shape (bench/memory.py's hf_config) with random weights, saved with the
    tokenizer as a checkpoint folder; built on the device (a 2B model initialises in seconds)."""
    from transformers import AutoModelForCausalLM

    config = memory.hf_config(shape)
    config.eos_token_id = config.pad_token_id = tok.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


def write_data(work, tok, plan):
    """The GRPO prompts (near --max_prompt_len tokens: bench/memory.py counts that length) and the
    DPO pairs, train and held out, as .jsonl files; their paths by name."""
    rng, g, dp = random.Random(1), plan["grpo"], plan["dpo"]
    P, R = dp["max_prompt_len"], dp["max_response_len"]
    rows = {"prompts": [{"prompt": text(tok, rng, g["max_prompt_len"] * 7 // 8, g["max_prompt_len"]),
                         "reward_fn": "digits"} for _ in range(64)]}
    for name, n in (("pairs", 64), ("pairs_eval", 8)):  # responses leave a token for the EOS appended
        rows[name] = [{"prompt": text(tok, rng, P // 2, P), "chosen": text(tok, rng, R // 2, R - 1),
                       "rejected": text(tok, rng, R // 2, R - 1)} for _ in range(n)]
    paths = {}
    for name, rs in rows.items():
        paths[name] = os.path.join(work, name + ".jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    return paths


# -----------------------------------------------------------------------------
# (a) the sampler's log-probs against the training forward


@contextlib.contextmanager
def precision(kind, device):
    """fp32 with TF32 off (TF32 keeps 10 mantissa bits: 1e-4 needs full fp32, and common.py turns
    TF32 on), or bf16 autocast as the scripts compute on one device (common.autocast on a GPU)."""
    if kind == "bf16":
        ctx = common.autocast(common.Dist(device=device)) if device.type == "cuda" else \
            torch.autocast("cpu", dtype=torch.bfloat16)
        with ctx:
            yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def contiguous_and_dealt(model, ids, attn, R, mini_batches, grad_accum):
    """Log-probs (B, R) of every row twice: in contiguous chunks without gradients (grpo.py's old
    and reference log-probs) and in the micro-batches grpo.minibatch_rows deals, with gradients
    (its update); a row no mini-batch holds stays NaN."""
    B = ids.shape[0]
    micro = B // mini_batches // grad_accum
    with torch.no_grad():
        contiguous = torch.cat([common.response_logprobs(model, ids[i:i + micro], attn[i:i + micro], R, T,
                                                         truncate=REPLAY) for i in range(0, B, micro)]).float()
    dealt = torch.full_like(contiguous, float("nan"))
    deal = torch.Generator().manual_seed(sampling.stream_seed(0, 1, stream=2))
    with torch.enable_grad():
        for mb in grpo.minibatch_rows(B, mini_batches, deal).to(ids.device):
            for k in range(grad_accum):
                r = mb[k * micro:(k + 1) * micro]
                dealt[r] = common.response_logprobs(model, ids[r], attn[r], R, T, truncate=REPLAY).detach().float()
    return contiguous, dealt


@contextlib.contextmanager
def recording_kept_sets(sets):
    """The sampler's kept set of each token it draws, (B, V) bool, appended to `sets` in order."""
    kept = sampling.kept_tokens

    def recording(*args, **kwargs):
        sets.append(kept(*args, **kwargs))
        return sets[-1]

    sampling.kept_tokens = recording
    try:
        yield
    finally:
        sampling.kept_tokens = kept


@torch.no_grad()
def kept_sets_differ(model, ids, attn, R, sampled, r_mask):
    """Response positions where the top-p rule on the trainer's logits (fp32, at the temperature)
    keeps another set than the sampler kept (`sampled`: its sets, token by token), row by row."""
    n = 0
    for b in range(ids.shape[0]):
        logits = model(input_ids=ids[b:b + 1], attention_mask=attn[b:b + 1],
                       position_ids=common.position_ids_from_mask(attn[b:b + 1])).logits[0, -R - 1:-1]  # (R, V)
        trainer = sampling.kept_tokens(logits.float() / T, top_p=TOP_P)
        sampler = torch.stack([s[b] for s in sampled[:R]])  # (R, V)
        n += int(((trainer != sampler).any(-1) & r_mask[b].bool()).sum())
    return n


def check_sampler(name, folder, device, size):
    """(a) on one model folder: rows of the table."""
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok).to(device).eval()
    rng = random.Random(0)
    specials = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in specials]
    n = size["prompts"]
    lengths = [size["min_prompt"] + (size["max_prompt"] - size["min_prompt"]) * i // max(n - 1, 1) for i in range(n)]
    prompts = [[rng.choice(vocab) for _ in range(k)] for k in lengths]  # distinct lengths: every batch padded
    ids, mask = (t.to(device) for t in common.pad([p for p in prompts for _ in range(size["group"])],
                                                 tok.pad_token_id, side="left"))  # (B, P)
    u = sampling.rollout_uniforms(ids.shape[0], size["new_tokens"], seed=0)
    out, same = [], {}
    for kind in ("fp32", "bf16"):
        with precision(kind, device):
            sampled = []  # the sampler's kept set of every token, (B, V) each
            with recording_kept_sets(sampled):
                r_ids, r_mask, r_logps = sampling.generate(model, ids, mask, size["new_tokens"], tok.eos_token_id,
                                                           tok.pad_token_id, temperature=T, top_p=TOP_P, uniforms=u,
                                                           return_logprobs=True)  # (B, R) each
            full, attn, R = torch.cat([ids, r_ids], 1), torch.cat([mask, r_mask], 1), r_ids.shape[1]
            with torch.no_grad():
                trained = common.response_logprobs(model, full, attn, R, T, truncate=REPLAY).float()  # (B, R)
                whole = common.response_logprobs(model, full, attn, R, T).float()  # no replay: the full policy
            differ = kept_sets_differ(model, full, attn, R, sampled, r_mask)
            contiguous, dealt = contiguous_and_dealt(model, full, attn, R, size["mini_batches"], size["grad_accum"])
        gap, unreplayed = ((x - r_logps)[r_mask.bool()].abs() for x in (trained, whole))
        same[kind] = (contiguous - dealt).abs().max().item()  # NaN where a row was never dealt
        tokens = f"{int(r_mask.sum())} tokens"
        if kind == "fp32":
            worst = gap.max().item()
            out.append(row("a", f"{name}: sampler vs training log-probs, top-p replayed, fp32, TF32 off",
                           f"max {worst:.1e} ({tokens})", f"<= {BOUNDS['fp32']:g}", worst <= BOUNDS["fp32"]))
        else:
            p99, worst = torch.quantile(gap, 0.99).item(), gap.max().item()
            out.append(row("a", f"{name}: the same, replayed, bf16 autocast", f"p99 {p99:.1e}, max {worst:.1e} ({tokens})",
                           "", None))  # bf16's rounding, which grows with the model: bounded below, relatively
            # the bf16 sampler's own error: its tokens scored in fp32 (outside autocast) are the truth that both
            # the sampler's and the trainer's bf16 log-probs round; a sampler that loses precision the trainer
            # keeps (bf16 logits, a bf16 cache upcast late) errs more than the trainer does, where an absolute
            # bound only grows with the model (docs/gpu.md: 2.8e-2 at 0.5B, 7.9e-2 with 8B's blocks)
            with precision("fp32", device), torch.no_grad():
                exact = common.response_logprobs(model, full, attn, R, T, truncate=REPLAY).float()
            s_err, t_err = ((x - exact)[r_mask.bool()].abs() for x in (r_logps, trained))
            s_mean, t_mean, k = s_err.mean().item(), t_err.mean().item(), BOUNDS["bf16_rel"]
            out.append(row("a", f"{name}: bf16, each side's error against its tokens scored in fp32, sampler vs trainer",
                           f"mean {s_mean:.1e} vs {t_mean:.1e}; max {s_err.max().item():.1e} vs {t_err.max().item():.1e}",
                           f"mean <= {k:g} x the trainer's + {BOUNDS['fp32']:g}", s_mean <= k * t_mean + BOUNDS["fp32"]))
        out.append(row("a", f"{name}: {kind}, without the replay (the trainer's full log-probs)",
                       f"mean {unreplayed.mean().item():.1e}, p99 {torch.quantile(unreplayed, 0.99).item():.1e}, "
                       f"max {unreplayed.max().item():.1e}", "", None))
        out.append(row("a", f"{name}: {kind}, positions whose kept set differs, trainer vs sampler",
                       f"{differ} of {int(r_mask.sum())}", "", None))
    out.append(row("a", f"{name}: rows in contiguous chunks vs dealt into {size['mini_batches']} mini-batches x "
                        f"{size['grad_accum']} micro-batches",
                   f"largest difference fp32 {same['fp32']:g}, bf16 {same['bf16']:g}",
                   "0 (identical)", same["fp32"] == 0 and same["bf16"] == 0))
    del model
    free(device)
    return out


def check_exact(shape, device):
    """(f): a random model of `shape` (the kernels, not the depth, are in question) against its frozen copy,
    rows in groups sharing left-padded prompts, responses of many lengths; bf16 autocast where the device has it."""
    import copy

    from transformers import AutoModelForCausalLM

    d = common.Dist(device=device)
    config = memory.hf_config(shape)
    torch.manual_seed(0)
    policy = models.no_dropout(AutoModelForCausalLM.from_config(config)).to(device).train()
    ref = common.freeze(copy.deepcopy(policy), d)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (40, 17, 64, 5) for _ in range(4)]
    responses = [torch.randint(3, config.vocab_size, (1 + (7 * i) % 48,), generator=g).tolist() for i in range(16)]
    ids, attn, resp = (t.to(device) for t in common.join_prompt_response(prompts, responses, 0))
    rows, out = torch.arange(len(ids), device=device), []
    for packed, shared in ((False, False), (True, False), (False, True)):
        with common.autocast(d):
            want = shared_prompt.response_logprobs(policy, ids, attn, resp.shape[1], with_entropy=True, packed=packed,
                                                   shared=shared)[0].float().detach()
        got = shared_prompt.planned_logprobs(ref, ids, attn, resp.shape[1], [([rows], packed, [shared] if shared else False)], d)
        gap = float(((got - want) * resp).abs().max())
        layout = "shared" if shared else "packed" if packed else "padded"
        out.append(row("f", f"frozen copy vs the policy's update forward, {layout}"
                            + (", bf16 autocast" if common.bf16_supported(device) else ""),
                       f"max |diff| {gap:.3g}", "0 (equal to the bit)", gap == 0))
    del policy, ref
    free(device)
    return out


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -----------------------------------------------------------------------------
# the scripts' runs: (b), (c), (d), (e)


def launch(script, argv, log, launcher, in_process, env=None, timeout=600):
    """Run `python SCRIPT ARGV` (launcher "torchrun": torchrun x1) from the repository root, its
    output into the file `log`; in_process (the CPU subset's `python` runs): in this process, as
    cli.script would under that command line, saving an interpreter's start per run. Returns the
    exit status."""
    if in_process and launcher == "python":
        return harness.run_in_process(script, argv, log)
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
                              if launcher == "torchrun" else []) + [script, *argv]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ngpu_check: killed after {timeout} s\n")
            return 124


def metrics(out_dir):
    """The rows of a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def lr0_rows(name, rows):
    """(b): the policy at lr 0 is its reference, its old policy (and with --teacher its own teacher);
    rows of the table from its metrics of steps >= 1."""
    train = [r for r in rows if r["step"] >= 1]
    kl = max(abs(r["kl"]) for r in train)
    clip = [max(r[k] for r in train) for k in ("clip_ratio/low", "clip_ratio/high")]
    gap, gap_max = max(r["rollout/logp_diff"] for r in train), max(r["rollout/logp_diff_max"] for r in train)
    spread = 1 - max(r["frac_reward_zero_std"] for r in train)
    out = [row("b", f"{name}: KL to the reference (max over steps)", f"{kl:.1e}", f"<= {BOUNDS['kl']:g}",
               kl <= BOUNDS["kl"]),
           row("b", f"{name}: clip_ratio/low, /high", f"{clip[0]:g}, {clip[1]:g}", "0, 0", clip == [0, 0]),
           row("b", f"{name}: rollout/logp_diff (mean; max over tokens)", f"{gap:.1e} ({gap_max:.1e})",
               f"<= {BOUNDS['logp_diff']:g}", gap <= BOUNDS["logp_diff"]),
           row("b", f"{name}: share of groups whose rewards differ (else nothing could clip)", f"{spread:.2f}", "> 0",
               spread > 0)]
    if "distill/reverse_kl" in train[0]:
        distill = max(abs(r["distill/reverse_kl"]) for r in train)
        out.append(row("b", f"{name}: distill/reverse_kl (max over steps)", f"{distill:.1e}", f"<= {BOUNDS['kl']:g}",
                       distill <= BOUNDS["kl"]))
    return out


def mem_within(measured, model):
    """(c)'s bound: |measured - model| <= 10% of the model + 1 GiB (bench/memory.py's fits() margin)."""
    return abs(measured - model) <= BOUNDS["mem_rel"] * model + BOUNDS["mem_abs_gib"]


def memory_row(name, rows, config, script, launcher, flags):
    """(c): the run's logged peak against bench/memory.py's estimate for its config and flags (the
    command printed reproduces it)."""
    flags = dict(flags)
    ac, offload = flags.pop("activation_checkpointing", False), flags.pop("offload_frozen", False)
    phases = memory.estimate(memory.shape_of(config), script, 1, launcher, "gpu", ac=ac, offload_frozen=offload,
                             **flags)
    model_gib = memory.total(phases, "gpu")[0] / memory.GIB
    measured = max(r.get("mem/peak_gib", 0.0) for r in rows)
    cmd = (f"python -m bench memory --model {config} --script {script} --world 1 --launcher {launcher}"
           + " --activation_checkpointing" * ac + " --offload_frozen" * offload
           + "".join(f" --{k} {v}" for k, v in flags.items()))
    print(f"(c) {name}: {cmd}", flush=True)
    return row("c", f"{name}: peak memory logged vs bench/memory.py", f"{measured:.2f} vs {model_gib:.2f} GiB",
               "within 10% + 1 GiB", mem_within(measured, model_gib))


def ms_per_token(rows):
    """The last step's rollout time over the tokens it decoded (its longest response), in ms."""
    last = max(rows, key=lambda r: r["step"])
    return 1000 * last["time/rollout"] / last["completions/max_length"]


STEP_LINE = re.compile(r"^step (\d+)/\d+ \|", re.M)  # a step line, not a heartbeat (`step 3/10: ...`)
# dynamo starting a compilation: [frame/compile] ids, a restart of the same one ([0/0_1]) not counted
TRACING = re.compile(r"\[(\d+)/(\d+)\][^\n]*torchdynamo start tracing (\S+)")
RECORDING = re.compile(r"(?<!re-)recording function", re.I)  # a graph recorded (torch 2.11 and 2.13 wordings)
RERECORDING = re.compile(r"re-recording function", re.I)  # a recorded graph's static inputs moved


def compile_report(log, after_step=2):
    """From a run's output under TORCH_LOGS=recompiles,cudagraphs,dynamo (the step lines on the same
    stream), split at the step `after_step` line (None after it when that line is missing): the
    compilations (each `start tracing` of a new [frame/compile] id; the ids start again after
    torch.compiler.reset(), which kv_cache.decode_cache calls when its cache grows) up to and
    after it, the frames' names, the CUDA graphs recorded up to and after it, the re-recordings and
    the CUDA graphs skipped."""
    cut = next((m.end() for m in STEP_LINE.finditer(log) if int(m[1]) == after_step), None)
    parts = (log, None) if cut is None else (log[:cut], log[cut:])
    compiles = [None if p is None else len(TRACING.findall(p)) for p in parts]
    recordings = [None if p is None else len(RECORDING.findall(p)) for p in parts]
    return dict(compiled=compiles[0], compiled_after=compiles[1], frames=sorted({m[3] for m in TRACING.finditer(log)}),
                recorded=recordings[0], recorded_after=recordings[1], rerecorded=len(RERECORDING.findall(log)),
                skipped=log.count("skipping cudagraphs"))


def compile_rows(name, log):
    """(d): the compiled decode step through a run that evaluates every step (other rows, the
    held-out prompts): compiled and recorded in steps 0-2 (each shape once, and once more after
    the cache grew to the run's largest rollout), nothing compiled or recorded after step 2,
    nothing re-recorded or skipped."""
    r = compile_report(log)
    settled = r["compiled_after"] == 0 and r["recorded_after"] == 0
    return [row("d", f"{name}: compilations after step 2 (TORCH_LOGS)",
                f"{r['compiled_after']} ({r['compiled']} in steps 0-2: {', '.join(r['frames']) or 'none'})",
                f"0 (1 to {BOUNDS['compilations']} in steps 0-2)",
                settled and 1 <= r["compiled"] <= BOUNDS["compilations"]),
            row("d", f"{name}: CUDA graph recordings after step 2",
                f"{r['recorded_after']} ({r['recorded']} in steps 0-2, {r['rerecorded']} re-recorded, "
                f"{r['skipped']} skipped)", "0 (>= 1 in steps 0-2, 0 re-recorded, 0 skipped)",
                settled and r["recorded"] >= 1 and r["rerecorded"] == 0 and r["skipped"] == 0)]


def grpo_argv(folder, out_dir, prompts, g, extra):
    """grpo.py's flags: every one a check depends on given, none left to a default; with --compile 4
    steps, evaluating every one (steps 3 and 4 must replay the graphs of steps 0-2's training and
    evaluation rollouts), else 2 steps."""
    compiled = "--compile" in extra
    return ["--model", folder, "--dataset", prompts, "--reward_fn", "digits", "--out_dir", out_dir, "--lr", "0",
            "--steps", "4" if compiled else "2", "--warmup_steps", "0",
            "--prompts_per_step", str(g["prompts_per_step"]), "--group_size", str(g["group_size"]),
            "--num_iterations", "2", "--num_mini_batches", "2", "--grad_accum", "1",
            "--temperature", str(T), "--top_p", str(TOP_P), "--top_k", "0",
            "--max_prompt_len", str(g["max_prompt_len"]), "--max_new_tokens", str(g["max_new_tokens"]),
            "--beta", "0.04", "--kl_estimator", "k3", "--epsilon_low", "0.2", "--epsilon_high", "0.28",
            "--loss_agg", "token_mean", "--scale_rewards", "group", "--eval_every", "1" if compiled else "1000",
            "--seed", "0", "--save_dtype", "bfloat16", *extra]


def run_grpo(shape, launcher, extra, folders, paths, plan, work, cpu, only):
    """One grpo.py run at lr 0: rows of (b), (c) and (d)."""
    folder = folders[shape]
    extra = [folder if a == "SELF" else a for a in extra]
    shown = " ".join(a if a != folder else "(itself)" for a in extra)
    name = f"grpo.py {shape}, {launcher}{' ' + shown if shown else ''}"
    out_dir = os.path.join(work, slug(name))
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier check's, in a --keep folder
    compiled = "--compile" in extra
    env = {"TORCH_LOGS": TORCH_LOGS} if compiled else None
    t0 = time.time()
    code = launch("grpo.py", grpo_argv(folder, out_dir, paths["prompts"], plan["grpo"], extra), out_dir + ".log",
                  launcher, in_process=cpu, env=env, timeout=300)
    print(f"{name}: exit {code} in {time.time() - t0:.0f} s (log {out_dir}.log)", flush=True)
    if code != 0:
        return [row("b", name, f"exited {code}: {out_dir}.log", "exit 0", False)]
    rows = metrics(out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoint"), ignore_errors=True)  # gigabytes, not needed
    out = lr0_rows(name, rows) if "b" in only else []
    if "c" in only and not cpu:
        flags = dict(plan["grpo"], num_mini_batches=2, grad_accum=1)
        flags |= {"activation_checkpointing": "--activation_checkpointing" in extra,
                  "offload_frozen": "--offload_frozen" in extra, **({"compile": True} if compiled else {}),
                  **({"teacher": folder} if "--teacher" in extra else {}), **({"lora": True} if "--lora" in extra else {})}
        out.append(memory_row(name, rows, os.path.join(folder, "config.json"), "grpo", launcher, flags))
    if "d" in only:
        if compiled:
            with open(out_dir + ".log") as f:
                out += compile_rows(name, f.read())
        if not ({"--teacher", "--activation_checkpointing", "--offload_frozen"} & set(extra)):
            n_rows = plan["grpo"]["prompts_per_step"] * plan["grpo"]["group_size"]
            out.append(row("d", f"{name}: ms per decoded token ({n_rows} rows, last step)", f"{ms_per_token(rows):.2f}",
                           "", None))
    return out


def run_dpo(folder, precompute, paths, plan, work, cpu, only):
    """One dpo.py run at lr 0: rows of (e) and (c)."""
    dp = plan["dpo"]
    name = f"dpo.py {dp['shape']}, python, {'--precompute_ref' if precompute else 'live reference'}"
    out_dir = os.path.join(work, f"dpo-{'precomputed' if precompute else 'live'}")
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = ["--model", folder, "--dataset", paths["pairs"], "--eval_dataset", paths["pairs_eval"], "--n_eval", "8",
            "--out_dir", out_dir, "--lr", "0", "--steps", "2", "--warmup_steps", "0", "--batch_size",
            str(dp["batch_size"]), "--grad_accum", "1", "--eval_batch_size", str(dp["batch_size"]),
            "--max_prompt_len", str(dp["max_prompt_len"]), "--max_response_len", str(dp["max_response_len"]),
            "--beta", "0.1", "--loss_type", "sigmoid", "--label_smoothing", "0", "--eval_every", "1000",
            "--seed", "0", "--save_dtype", "bfloat16", "--precompute_ref" if precompute else "--no-precompute_ref"]
    code = launch("dpo.py", argv, out_dir + ".log", "python", in_process=cpu, timeout=300)
    print(f"{name}: exit {code} (log {out_dir}.log)", flush=True)
    if code != 0:
        return [row("e", name, f"exited {code}: {out_dir}.log", "exit 0", False)]
    rows = metrics(out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoint"), ignore_errors=True)
    train = [r for r in rows if r["step"] >= 1]
    loss = max(abs(r["loss"] - math.log(2)) for r in train)
    margin = max(abs(r["rewards/margins"]) for r in train)
    out = [row("e", f"{name}: loss - ln 2, largest of the steps in absolute value", f"{loss:.1e}",
               f"<= {BOUNDS['dpo']:g}", loss <= BOUNDS["dpo"]),
           row("e", f"{name}: rewards/margins, the same", f"{margin:.1e}", f"<= {BOUNDS['dpo']:g}",
               margin <= BOUNDS["dpo"])]
    if "c" in only and not cpu:
        flags = dict(batch_size=dp["batch_size"], grad_accum=1, max_prompt_len=dp["max_prompt_len"],
                     max_response_len=dp["max_response_len"], precompute_ref=precompute)
        out.append(memory_row(name, rows, os.path.join(folder, "config.json"), "dpo", "python", flags))
    return out


# -----------------------------------------------------------------------------


def table(rows):
    lines = ["| check | what | value | bound | result |", "|---|---|---|---|---|"]
    for r in rows:
        result = "info" if r["ok"] is None else "pass" if r["ok"] else "**FAIL**"
        lines.append(f"| ({r['check']}) | {r['what']} | {r['value']} | {r['bound']} | {result} |")
    return "\n".join(lines)


def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU subset on tiny shapes (tests/test_gpu_path.py runs it)")
    p.add_argument("--only", default="a,b,c,d,e,f", help="the checks to run, comma-separated letters (default: all)")
    p.add_argument("--runs", default=None,
                   help="(b)-(d): which of the plan's grpo.py runs, comma-separated indices from 0 (default: all)")
    p.add_argument("--launchers", default=None,
                   help="python,torchrun (default on a GPU); on the CPU python alone unless given")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="folder of the results table")
    p.add_argument("--keep", default="", help="keep the models, runs and logs in this folder (default: a temporary "
                                              "one, removed unless a check failed)")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    if only - set("abcdef"):
        p.error(f"--only {args.only}: checks are the letters a to f")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the scripts' runs too
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False). Run it on a machine "
                         "with a GPU, or pass --cpu for the CPU subset on tiny shapes.")
    plan = CPU if args.cpu else GPU
    picked = None if args.runs is None else {int(i) for i in args.runs.split(",")}
    if picked is not None and not picked <= set(range(len(plan["grpo_runs"]))):
        p.error(f"--runs {args.runs}: the plan's grpo.py runs are 0 to {len(plan['grpo_runs']) - 1}")
    launchers = (args.launchers or ("python" if args.cpu else "python,torchrun")).split(",")
    device = torch.device("cpu" if args.cpu else "cuda")
    device_name = "CPU" if args.cpu else torch.cuda.get_device_name(device)
    work = args.keep or tempfile.mkdtemp(prefix="gpu_check-")
    os.makedirs(work, exist_ok=True)
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars of each load, as the scripts switch them off
    print(f"gpu_check on {device_name}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"runs and logs in {work}", flush=True)
    t0, rows = time.time(), []

    # the model folders and data files
    tok = make_tokenizer(plan["tokenizer_vocab"])
    folders = {name: build_folder(os.path.join(work, slug(name)), shape, tok, device, plan["dtype"])
               for name, shape in plan["shapes"].items()}
    free(device)
    # the data's lengths counted by the tokenizer as the scripts load it: transformers gives a Qwen2
    # folder's BPE Qwen's own pre-tokenizer (digits one by one), not the one it was trained with
    paths = write_data(work, models.load_tokenizer(folders[plan["dpo"]["shape"]]), plan)
    print(f"models and data ready in {time.time() - t0:.0f} s", flush=True)

    if "a" in only:
        sampled = dict(folders)
        if plan["smollm2"]:
            try:
                sampled["SmolLM2-135M-Instruct"] = models.model_folder("smollm2")
            except (FileNotFoundError, ModuleNotFoundError) as e:
                rows.append(row("a", "SmolLM2-135M-Instruct", f"not run: {e}", "", None))
        for name, folder in sampled.items():
            rows += check_sampler(name, folder, device, plan["sampler"])
        print(f"(a) done at {time.time() - t0:.0f} s", flush=True)
    if only & set("bcd"):
        for i, (shape, launcher, extra) in enumerate(plan["grpo_runs"]):
            if launcher in launchers and (picked is None or i in picked):
                rows += run_grpo(shape, launcher, extra, folders, paths, plan, work, args.cpu, only)
        print(f"(b) to (d) done at {time.time() - t0:.0f} s", flush=True)
    if "e" in only or "c" in only:
        for precompute in (True, False):
            rows += run_dpo(folders[plan["dpo"]["shape"]], precompute, paths, plan, work, args.cpu, only | {"e"})
    if "f" in only:
        rows += check_exact(plan["exact"], device)
    seconds = time.time() - t0
    budget = plan["budget_s"]
    rows.append(row("all", "wall time of this command", f"{seconds:.0f} s", f"<= {budget} s" if budget else "",
                    None if budget is None else seconds <= budget))

    failed = [r for r in rows if r["ok"] is False]
    cmd = " ".join(["python tests/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout
    report = (f"# tests/gpu_check.py on {device_name}\n\n`{cmd}`: torch {torch.__version__}, transformers "
              f"{transformers.__version__}, commit {commit.strip() or 'unknown'}, {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{seconds:.0f} s; {len(failed)} of {sum(r['ok'] is not None for r in rows)} checks failed\n\n"
              f"{table(rows)}\n")
    if args.cpu:
        report += "\n--cpu: no peak-memory (c) or compile (d) checks: they read CUDA's allocator and CUDA graphs.\n"
    os.makedirs(args.results, exist_ok=True)
    out = os.path.join(args.results, f"gpu-check-{slug(device_name)}.md")
    with open(out, "w") as f:
        f.write(report)
    with open(os.path.join(args.results, "gpu-check-rows.json"), "w") as f:  # `python -m bench gpu` reads them
        json.dump(rows, f)
    print("\n" + report + f"\nwritten to {out}", flush=True)
    if failed:
        print(f"gpu_check FAILED: {len(failed)} check(s); the runs and logs are kept in {work}", flush=True)
        return 1
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check passed in {seconds:.0f} s on {device_name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
