"""What `auto` means for the speed flags (--padding_free, --shared_prompt, --compile) on the device a
run has: each changes how fast a step runs, not what it computes (the same log-probs to float
rounding), so a run takes the faster path for its device and says which, and why.

- A CPU's step is bound by its FLOPs: packing and shared prompts are taken wherever they compute
  fewer (common.packing_pays, shared_prompt.micro_batches: `true`); the rollout's decode step is not
  compiled (10-60 s of compile a batch shape, paid back only over a long run).
- A GPU's step on a small model is bound by kernel launches, not FLOPs (so --compile_layers fuses each block's ops) (on an H200 the shared-prompt
  DPO step, 2.1x the padded step's ops for 25% fewer FLOPs, ran at 0.62x its speed: docs/gpu.md). The
  layouts are timed once, forward and backward of the first micro-batch, fastest kept; the times are
  summed over the ranks, so that every rank keeps the same. The compiled CUDA-graph decode step is
  taken, under torchrun too, where it decodes from a bf16 copy of the model outside FSDP2 (whose hooks
  would cut the compiled step into a graph per block, its gathered weights moving between rollouts):
  not with LoRA's adapters or remote code under torchrun, which the copy cannot hold.
A choice is recorded with the run (run_config.json, and each checkpoint's trainer_state.json) and a
resumed run takes it again instead of timing anew: resumed == uninterrupted, as for a flag given.
"""
import functools
import time

import torch

import common
import sampling
import kv_cache
import shared_prompt
from plumbing import models

AUTO = "auto"
SPEED_FLAGS = ("padding_free", "shared_prompt", "compile", "compile_layers")
ROUNDS = 3  # timed calls of each layout, alternated (A B C C B A ...), after one warm-up call of each


def timed(d):
    """Whether `auto` times the layouts on this device (a GPU) rather than counting FLOPs (a CPU)."""
    return d.device.type == "cuda"


def seconds(fn, d):
    """Wall time of one call of fn, the device's queue drained before and after."""
    torch.cuda.synchronize(d.device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(d.device)
    return time.perf_counter() - t0


def _forward_backward(model, batch, layout, reward, d):
    """One training forward and backward of `batch` (ids, attn, response mask) in `layout`, the
    gradients then dropped: what a layout costs in an update."""
    ids, attn, resp = batch
    with common.autocast(d):
        if reward:
            out = common.reward_scores(model, ids, attn, packed=layout == "packed")
        else:
            out = shared_prompt.response_logprobs(model, ids, attn, resp.shape[1], packed=layout == "packed",
                                                  shared=layout == "shared")
    out.float().sum().backward()
    model.zero_grad(set_to_none=True)


def fastest(model, batch, layouts, d, reward=False):
    """The fastest of `layouts` for a forward and backward of `batch`, by the ROUNDS timed calls of
    each (the least), summed over the ranks: (name, {name: seconds})."""
    for layout in layouts:  # warm-up: allocations, kernel selection, autotuning
        _forward_backward(model, batch, layout, reward=reward, d=d)
    times = torch.full((len(layouts),), float("inf"), dtype=torch.float64)
    for r in range(ROUNDS):
        for i in (range(len(layouts)) if r % 2 == 0 else reversed(range(len(layouts)))):
            times[i] = min(times[i], seconds(functools.partial(_forward_backward, model, batch, layouts[i], reward=reward, d=d), d))
    times = common.all_reduce_sum(times.to(d.device), d).tolist()
    return layouts[times.index(min(times))], dict(zip(layouts, times))


def choose(cfg, d, recorded, model, batch, models_=(), reward=False):
    """Each speed flag of cfg resolved to True or False: as given, as `recorded` with the run it
    resumes ({flag: {"value", "why"}}, Run.choices), else by this device's rule, which it adds to
    `recorded` and prints. batch: the first micro-batch (ids, attn, response mask), or a function that
    makes it (called only where a GPU times). models_: the other models that run the policy's layout
    (a frozen reference, a teacher; None: absent). --padding_free on where every model keeps packed
    rows apart (models.use_packing). Returns {flag: value}."""
    asked = {f: getattr(cfg, f) for f in SPEED_FLAGS if hasattr(cfg, f)}
    out = {f: v for f, v in asked.items() if v != AUTO}
    fresh = {f: recorded[f] for f in asked if asked[f] == AUTO and f in recorded}
    out |= {f: c["value"] for f, c in fresh.items()}
    todo = [f for f in asked if f not in out]
    if "compile" in todo:
        copyable = not d.torchrun or kv_cache.compilable_under_fsdp(model)
        on = timed(d) and copyable
        why = ("a CUDA-graph decode step, several times model.generate's speed (docs/gpu.md)" +
               (", from a bf16 copy of the model outside FSDP2" if d.torchrun else "") if on else
               "under torchrun the compiled step decodes from a copy of the model outside FSDP2, which LoRA's "
               "adapters or remote code do not allow" if timed(d) else
               "on a CPU 10-60 s of compile a batch shape pays back only over a long run")
        recorded["compile"] = {"value": on, "why": why}
    if out.get("compile_layers", "compile_layers" in todo and timed(d)):  # before the timing: compiled blocks timed
        for m in [model, *models_]:
            if m is not None:
                common.compile_blocks(m)
    layouts = [f for f in todo if f not in ("compile", "compile_layers")]
    if layouts and not timed(d):
        for f in layouts:
            recorded[f] = {"value": True, "why": "a CPU step is bound by FLOPs: where that computes fewer"}
    elif layouts:
        candidates = ["padded"]
        if "padding_free" in layouts and all(m is None or models.packing_works(m, d.device) for m in [model, *models_]):
            candidates.append("packed")
        ids, attn, resp = batch = batch() if callable(batch) else batch
        if "shared_prompt" in layouts and shared_prompt._possible([model, *models_], ids.shape[1] - resp.shape[1], d):
            candidates.append("shared")
        best, times = fastest(model, batch, candidates, d, reward=reward)
        measured = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items())
        for f, layout in (("padding_free", "packed"), ("shared_prompt", "shared")):
            if f in layouts:
                recorded[f] = {"value": best == layout, "why": f"timed on the first micro-batch: {measured}"}
    if "compile_layers" in todo:
        recorded["compile_layers"] = {"value": timed(d), "why": (
            "a block's ops fused into a few kernels: a small model's step on a GPU is bound by its launches" if timed(d)
            else "on a CPU a step is bound by its FLOPs, which fusing does not cut, and the compile takes minutes")}
    out |= {f: recorded[f]["value"] for f in todo}
    line = "; ".join(f"--{f} {str(c['value']).lower()} ({'as the run it resumes chose: ' if f in fresh else ''}"
                     f"{c['why']})" for f, c in recorded.items() if f in fresh or f in todo)
    if line:
        common.print0(f"auto: {line}")
    if "padding_free" in out:
        out["padding_free"] = models.use_packing(out["padding_free"], [model, *models_], d)
    return out


def rollout_sample(env, cfg, micro, d):
    """GRPO's first micro-batch as far as it can be known before the first rollout: rows of the first
    prompts, as many of each as a mini-batch holds (group_size / num_mini_batches), and responses of
    random tokens, each of a length drawn up to --max_new_tokens. (ids, attn, response mask)."""
    per = max(1, cfg.group_size // cfg.num_mini_batches)
    p_ids, _ = sampling.encode_prompts(env.tokenizer, env.prompts.select(range(-(-micro // per)))["prompt"][:],
                                       cfg.max_prompt_len)
    p_ids = [p for p in p_ids for _ in range(per)][:micro]
    g = torch.Generator().manual_seed(cfg.seed)
    lengths = torch.randint(1, cfg.max_new_tokens + 1, (len(p_ids),), generator=g).tolist()
    vocab = len(env.tokenizer)
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return tuple(t.to(d.device) for t in common.join_prompt_response(p_ids, responses, env.tokenizer.pad_token_id))
