"""Pieces shared by sft.py, reward.py, dpo.py and grpo.py.

Kept small on purpose: the math of each algorithm lives in its own script. This file holds
what every script repeats: config parsing, distributed setup and FSDP2, padding and position
ids, log-prob gathering, a KV-cached sampler, loading of models and data, logging and
checkpoints.

Batch layout used everywhere: a prompt block left-padded to P tokens followed by a response
block right-padded to R tokens, with no padding in the middle (seed 000):

    input_ids       (B, P+R)   [pad pad p1 p2 p3 | r1 r2 EOS pad]
    attention_mask  (B, P+R)   [ 0   0  1  1  1  |  1  1  1   0 ]
    response_mask   (B, R)                        [ 1  1  1   0 ]

GPT-2 has absolute position embeddings and does not derive position ids from the attention
mask, so every forward passes position_ids = cumsum(mask) - 1 (REFERENCE.md).
"""
import argparse
import ast
import dataclasses
import inspect
import json
import os
import random
import shutil
import sys
import textwrap
import time
import typing
import weakref
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

# The fp32 matmuls on a GPU are the LM head's (FP32Head) on bf16-valued operands: TF32 holds
# bf16's mantissa, so it multiplies them exactly and accumulates in fp32, at ~8x fp32's rate.
# The CUDA flag only: CPU matmuls keep full fp32 (the tests compare to 1e-5 there).
torch.backends.cuda.matmul.allow_tf32 = True

# -----------------------------------------------------------------------------
# config: one flat dataclass per script, parsed from the command line


def _field_docs(cls):
    """The string literal under each dataclass field (its docstring) becomes its --help."""
    docs = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _optional(tp):
    """(inner type, True) for `X | None`, (tp, False) otherwise."""
    args = typing.get_args(tp)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def parse_config(cls, argv=None):
    """Build a Config from the command line: `--lr 1e-6`, `--lr=1e-6`, `--flag` / `--no-flag`.

    An unknown flag or a value of the wrong type exits with an error that names it (argparse).
    """
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        tp, optional = _optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=docs.get(f.name, " "), dest=f.name)
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
            continue
        convert = tp
        if optional:  # `--x none` gives None
            convert = lambda s, tp=tp: None if s.lower() == "none" else tp(s)
            convert.__name__ = tp.__name__
        parser.add_argument(f"--{f.name}", type=convert, metavar=tp.__name__.upper(), **kw)
    return cls(**vars(parser.parse_args(argv)))


# -----------------------------------------------------------------------------
# distributed: the torchrun environment, or plain `python` as a world of one


@dataclasses.dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    sharded: bool = False  # launched by torchrun: a process group exists and models are wrapped with FSDP2

    @property
    def is_main(self):
        return self.rank == 0


def setup_distributed(timeout_minutes=10.0):
    """Read RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun) and join the process group.

    The device comes from LOCAL_RANK, not the global rank, so two nodes of 8 GPUs each use
    cuda:0-7 on each node. nccl on CUDA, gloo on CPU. Under torchrun there is a process group
    and FSDP2 even with one process (`torchrun --nproc_per_node 1`: what CPU offload needs);
    plain `python` runs without either. More processes per node than visible GPUs is refused
    before the process group starts, since two ranks cannot share one GPU under nccl.
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus:
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {n_gpus} CUDA device(s) are visible: launch with "
                               f"torchrun --nproc_per_node at most {n_gpus}, or set CUDA_VISIBLE_DEVICES to show "
                               f"more GPUs (CUDA_VISIBLE_DEVICES= runs every rank on the CPU)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    sharded = "RANK" in os.environ
    if sharded and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
    return Dist(rank, world_size, local_rank, device, sharded)


def cleanup_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_sum(x, d):
    """Sum a tensor over ranks (every rank must call this: never under `if rank == 0`)."""
    if d.world_size > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def reduce_metrics(metrics, d):
    """Mean of each scalar metric over ranks, as plain floats. Collective: call on all ranks.

    Values may be floats or 0-d tensors on the device: metrics are accumulated as tensors in
    the hot loops and read back here, in one host sync per step."""
    keys = sorted(metrics)
    vals = torch.stack([v.detach().to(d.device, torch.float64) if torch.is_tensor(v)
                        else torch.tensor(float(v), dtype=torch.float64, device=d.device) for v in (metrics[k] for k in keys)])
    vals = all_reduce_sum(vals, d) / d.world_size
    return dict(zip(keys, vals.tolist()))


def rank_share(n, d):
    """This rank's rows of n (strided) for evaluation, padded with row 0 to the same count on every
    rank: FSDP gathers each layer collectively, so every rank must run as many forwards. Returns
    (rows, number of real rows); the padded ones are computed and not used."""
    rows = list(range(n))[d.rank::d.world_size]
    return rows + [0] * (-(-n // d.world_size) - len(rows)), len(rows)


def shard_batch(n, d):
    """The slice of a global batch of n rows that this rank takes."""
    if n % d.world_size:
        raise ValueError(f"batch of {n} rows does not divide over {d.world_size} ranks")
    per = n // d.world_size
    return slice(d.rank * per, (d.rank + 1) * per)


# -----------------------------------------------------------------------------
# FSDP2: fully_shard every transformer block, then the root


def transformer_blocks(model):
    """Modules named by any `_no_split_modules` found in the model tree.

    Searching the whole tree (not only the root) means a causal LM inside a wrapper module
    is still sharded block by block (seed 000: transformer_auto_wrap_policy missed that).
    """
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def bf16_supported(device):
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def frozen_dtype(d):
    """The dtype frozen models (reference, reward model) are loaded in: bf16 under FSDP on a GPU,
    where the policy's forward sees bf16 parameters too (MixedPrecisionPolicy), so the reference
    computes exactly the policy's function at half the memory. Under plain `python` the policy
    runs fp32 weights through autocast, whose numerics a bf16 copy would not reproduce (the
    residual stream stays fp32 there): the frozen models stay fp32, and KL is 0 while pi = ref."""
    return torch.bfloat16 if d.sharded and bf16_supported(d.device) else torch.float32


def shard_model(model, d, mixed_precision=True, cpu_offload=False, activation_checkpointing=False):
    """Place the model on its device: FSDP2 under torchrun, a plain move otherwise.

    FSDP2 with bf16 compute, fp32 master weights and fp32 gradient reduction on GPUs that
    support it (seed 000: bf16 master weights hurt); fp32 on CPU. `fully_shard` moves one block
    at a time to the GPU and keeps its shard, so no GPU ever holds the whole model; pass the
    model on the CPU. `cpu_offload` keeps the sharded parameters in host memory between uses
    (for frozen reference / reward models); it needs an accelerator. A frozen model (no
    parameter requires grad) also reshards its root after every forward: FSDP keeps a root
    gathered for the backward that follows, and a frozen model has none.
    Activation checkpointing recomputes each block's activations in the backward pass."""
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # from_pretrained returns eval mode, in which HF models skip the checkpointing
    if cpu_offload and (not d.sharded or d.device.type != "cuda"):
        print0(f"note: CPU offload of {type(model).__name__} skipped: it needs FSDP (launch with torchrun, "
               f"also for one process) and a GPU")
        cpu_offload = False
    if not d.sharded:
        return model.to(d.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy()
    if mixed_precision and bf16_supported(d.device):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    blocks = transformer_blocks(model)
    if not blocks:
        print0(f"warning: no _no_split_modules in {type(model).__name__}; sharding the root module only")
    for block in blocks:
        fully_shard(block, **kw)
    frozen = not any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=True if frozen else None, **kw)
    return model


def autocast(d, enabled=True):
    """bf16 autocast for a single GPU without FSDP (FSDP's MixedPrecisionPolicy casts itself)."""
    if enabled and not d.sharded and bf16_supported(d.device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def set_grad_sync(model, sync):
    """Skip the gradient reduce-scatter on all but the last micro-batch (public FSDP2 API)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


@contextmanager
def unsharded(model):
    """Gather FSDP parameters once for a whole rollout instead of once per generated token
    (pytorch #123962), and keep them gathered until the block ends. No-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    frozen = not any(p.requires_grad for p in model.parameters())
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            # back to shard_model's settings: blocks reshard after forward; a trained root does
            # not (backward needs its parameters at once; a loss read from a hook inside the
            # forward, as reward_scores does, would otherwise find them freed); a frozen one does
            m.set_reshard_after_forward(m is not model or frozen, recurse=False)


def clip_grad_norm(model, max_norm):
    """Clip by the global norm; works on FSDP2's sharded DTensor gradients. Returns the norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# -----------------------------------------------------------------------------
# padding and positions


def position_ids_from_mask(mask):
    """(B, T) 0/1 mask -> (B, T) positions counting real tokens only: [0 0 1 1] -> [0 0 0 1]."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pad(seqs, pad_id, side="right", length=None):
    """List of token-id lists -> ids (B, T) and mask (B, T), padded on `side`."""
    T = max(len(s) for s in seqs) if length is None else length
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) > T:
            raise ValueError(f"sequence of {len(s)} tokens does not fit in {T}")
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def join_prompt_response(prompts, responses, pad_id):
    """Left-pad the prompts, right-pad the responses, and join them: no padding in the middle.

    Returns input_ids (B, P+R), attention_mask (B, P+R) and response_mask (B, R).
    """
    p_ids, p_mask = pad(prompts, pad_id, side="left")
    r_ids, r_mask = pad(responses, pad_id, side="right")
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), r_mask


def move_padding_left(input_ids, attention_mask):
    """Move every pad token of each row to the left, keeping the real tokens in order
    (for reward scoring; seed 000 found it helps GPT-2's absolute positions)."""
    order = torch.argsort(attention_mask, dim=1, stable=True)  # pads (0) first, order kept
    return input_ids.gather(1, order), attention_mask.gather(1, order)


# -----------------------------------------------------------------------------
# log-probs


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(x)[y] chunk by chunk, with a hand-written backward into one gradient buffer.

    d/dx_j log softmax(x)[y] = 1[j = y] - softmax(x)_j, so the backward needs only the saved
    logits: no (N, V) log_softmax is ever stored, and autograd does not allocate a full-size
    zero gradient per chunk as it would through slicing. Each chunk uses the fused
    log_softmax / softmax kernels (one pass each; logsumexp takes several on CPU).
    """

    @staticmethod
    def forward(ctx, logits, labels, rows):  # (N, V), (N,)
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for i in range(0, logits.shape[0], rows):
            chunk = torch.log_softmax(logits[i:i + rows].float(), dim=-1)
            out[i:i + rows] = chunk.gather(-1, labels[i:i + rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.rows):
            g = grad_out[i:i + ctx.rows, None].float()
            chunk = torch.softmax(logits[i:i + ctx.rows].float(), dim=-1).mul_(-g)  # -softmax * g
            grad[i:i + ctx.rows] = chunk.scatter_add_(-1, labels[i:i + ctx.rows, None], g)
        return grad, None, None


def logprobs_from_logits(logits, labels, chunk_elems=None):
    """log softmax(logits)[label] for every position, (...) from (..., V) and (...), in float32.

    Never materialises the full float32 log_softmax: per chunk of rows, gather the label's
    logit and subtract the row's logsumexp. A chunk holds about `chunk_elems` logits: 2^22
    (16 MB in fp32) on a CPU, small enough for its allocator to reuse; 2^26 on a GPU, where
    16 MB chunks left the kernels too short to fill the device (bench/logprobs.py).
    """
    if chunk_elems is None:
        chunk_elems = 2**26 if logits.device.type == "cuda" else 2**22
    V = logits.shape[-1]
    rows = max(1, chunk_elems // V)
    out = _SelectiveLogSoftmax.apply(logits.reshape(-1, V), labels.reshape(-1), rows)
    return out.view(labels.shape)


def entropy_from_logits(logits, chunk_elems=2**22):
    """Entropy of softmax(logits) per position, (...) from (..., V), chunked like above."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    rows = max(1, chunk_elems // V)
    out = []
    for i in range(0, flat.shape[0], rows):
        chunk = flat[i:i + rows].float()
        logp = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).view(logits.shape[:-1])


def _accepts(model, arg):
    """Whether the model's forward takes `arg`. A PeftModel's forward takes **kwargs and passes
    them on, so the wrapped model's signature is the one that counts."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return arg in inspect.signature(model.forward).parameters


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False):
    """Per-token log-probs of the response block, (B, R), from one forward with position ids.

    The logit at position t predicts token t+1, so the R response tokens are predicted by the
    R positions before them: logits[:, P-1 : P+R-1]. Only those are computed when the model
    accepts `logits_to_keep` (all HF causal LMs do), which avoids a (B, P+R, V) tensor.
    """
    kw = dict(input_ids=input_ids, attention_mask=attention_mask,
              position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    if _accepts(model, "logits_to_keep"):
        kw["logits_to_keep"] = n_response + 1
    logits = model(**kw).logits[:, -(n_response + 1):-1]  # (B, R, V)
    if temperature != 1.0:
        logits = logits / temperature
    logps = logprobs_from_logits(logits, input_ids[:, -n_response:])  # (B, R)
    if with_entropy:
        with torch.no_grad():
            return logps, entropy_from_logits(logits)
    return logps


def reward_scores(model, input_ids, attention_mask, padding_left=False):
    """Scalar score of each sequence from an AutoModelForSequenceClassification, (B,).

    Read at the last real token (by the attention mask, whatever the padding side, so pad ==
    eos does no harm; transformers #35352), with position ids. The per-position scores are
    taken from the `score` head inside the model's own forward, so FSDP gathers the head's
    weights as usual. A gain and bias stored in the config (reward.py --normalize) apply.
    """
    if padding_left:
        input_ids, attention_mask = move_padding_left(input_ids, attention_mask)
    head = getattr(model, "score", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no `score` head: not a sequence-classification model")
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask,
              position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    finally:
        handle.remove()
    per_position = captured[0].squeeze(-1).float()  # (B, T)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # (B,) index of the last 1
    scores = per_position.gather(1, last[:, None]).squeeze(1)
    cfg = model.config
    return scores * getattr(cfg, "reward_gain", 1.0) + getattr(cfg, "reward_bias", 0.0)


# -----------------------------------------------------------------------------
# sampling: a lean KV-cached loop (what generate() does, minus its per-step overhead)


def rollout_uniforms(n_rows, n_tokens, seed):
    """U(0, 1) draws (n_rows, n_tokens), float64, one per row and sampled token of a global batch.

    Each rank indexes its own rows, so a row's samples depend on its global index and not on
    the number of ranks: 1 process and 8 draw the same rollout (tests/test_grpo.py). Costs 8
    bytes per row and token on every rank.
    """
    return torch.rand(n_rows, n_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


NAN_LOGITS = "sample_token: logits with NaN or +inf, or all -inf (a diverged model, or a bad --top_k/--top_p mask)"


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, u=None, bad=None):
    """One token per row from (B, V) logits; temperature 0 means greedy.

    Draws by inverting the CDF with one uniform number per row (`u`, (B,), or drawn from
    `generator`). torch.multinomial (like the Gumbel trick) draws one random number per
    vocabulary entry, which is slow on CPU: for 64 rows of GPT-2's 50257 tokens it takes 3x as
    long (bench/sampler.py). The CDF is summed in float64 so that it stays exact over a large
    vocabulary. Logits that are not finite raise RuntimeError; with `bad` (a bool tensor on the
    device) they set it instead, and generate raises after its loop.
    """
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    cdf = logits.softmax(-1).double().cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1) ~1; NaN if a row had no finite logit
    finite = torch.isfinite(total).all()
    if bad is None:  # a direct call: check now (one host sync)
        if not finite:
            raise RuntimeError(NAN_LOGITS)
    else:  # inside generate: record on the device, checked once at the end (no sync per token)
        bad.logical_or_(~finite)
    if u is None:
        u = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator)
    u = u.view(-1, 1).to(cdf) * total
    # the first CDF entry above u: zero-probability tokens (top-k / top-p) span no interval and
    # are never drawn; u is kept below total in case u * total rounds up to it
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # clamped: a NaN row would give index V, an out-of-range id that the next forward's embedding
    # lookup turns into a CUDA device-side assert (which leaves the context unusable)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def _next_logits(model, input_ids, attention_mask, position_ids, cache, kw):
    """(B, T) ids through the model with a KV cache -> (B, V) logits of the token after them."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=cache, use_cache=True, **kw).logits[:, -1]


def _next_logits_unfused(model, *args):
    """_next_logits with attention as matmul -> softmax -> matmul (SDPA's math backend). Under
    torch.compile on CPU, inductor fuses the mask and softmax between the two matmuls: 4.1 ms
    per token against 5.3 ms with the CPU flash kernel (tiny GPT-2, 64 rows, one thread)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return _next_logits(model, *args)


_compiled = {}  # torch.compile of the step, made once; dynamo keeps a graph per model and shape


def _step_fn(compile, device):
    """The decode step: eager, or compiled. On CUDA the compiled step is also captured as a CUDA
    graph ("reduce-overhead"): decoding a small model is bound by kernel launches (hundreds per
    token), which one graph replay replaces. The graph reads the static cache in place, so the
    cache must keep its addresses from call to call (_decode_cache)."""
    if not compile:
        return _next_logits
    fn = _next_logits_unfused if device.type == "cpu" else _next_logits
    if fn not in _compiled:
        mode = "reduce-overhead" if device.type == "cuda" else None
        _compiled[fn] = torch.compile(fn, dynamic=False, mode=mode)
    return _compiled[fn]


_DECODE_CACHES = weakref.WeakKeyDictionary()  # model -> {(rows, length): StaticCache}, for compiled decoding


def _decode_cache(model, B, L, persistent):
    """A static KV cache of B rows and L slots, or None when the model has sliding-window or other
    non-plain layers (they are prefilled straight into a fresh cache instead). With `persistent`
    (compiled decoding) the cache of each (B, L) is made once per model and overwritten in place
    by every later rollout, so the captured graph's addresses stay valid; it stays allocated
    between rollouts (at most 4 shapes per model)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    caches = _DECODE_CACHES.setdefault(model, {}) if persistent else {}
    if (B, L) in caches:
        return caches[B, L]
    cache = StaticCache(config=model.config, max_cache_len=L)
    if not all(type(layer) is StaticLayer for layer in cache.layers):
        return None
    if persistent:
        if len(caches) >= 4:
            caches.pop(next(iter(caches)))
        caches[B, L] = cache
    return cache


def _fill_cache(cache, prefill, inverse, P):
    """Copy the prefill's keys and values (U distinct prompts, P tokens) into slots [0, P) of the
    static cache, row i taking prompt inverse[i]; in place, so the cache keeps its addresses."""
    for dst, src in zip(cache.layers, prefill.layers):
        k, v = (src.keys, src.values) if inverse is None else (src.keys[inverse], src.values[inverse])
        if not dst.is_initialized or dst.keys.dtype != k.dtype:
            dst.lazy_initialization(k[:, :, :0], v[:, :, :0])
        dst.keys[:, :, :P].copy_(k)
        dst.values[:, :, :P].copy_(v)
        dst.cumulative_length.fill_(P)


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, temperature=1.0, top_k=0,
             top_p=1.0, stop_ids=(), generator=None, compile=False, uniforms=None):
    """Sample responses for left-padded prompts with a KV cache.

    Random numbers come from `generator`, or from `uniforms` (B, >= max_new_tokens): column t
    draws token t of each row (rollout_uniforms; the same rollout on any number of ranks).

    Returns response ids (B, R) right-padded with pad_id, and response_mask (B, R) that is 1
    up to and including the first EOS (or stop token). R <= max_new_tokens; the loop ends
    early once every row has stopped. Only local forwards: under FSDP call it inside
    `unsharded(model)`, and ranks may stop at different steps.

    Greedy output is identical to model.generate's. Speed against it: bench/sampler.py.
    1. each distinct prompt is prefilled once and its keys/values copied to its repeats (GRPO
       samples every prompt G times): the eager gain;
    2. a static KV cache written in place: no concatenation per step, and the fixed shapes
       and addresses that torch.compile and CUDA graphs need; mask and positions of the whole
       response are built once; on a GPU, whether every row has stopped is read every 8 tokens
       (each read waits for the GPU to drain), not after every token;
    3. compile=True: the decode step under torch.compile (on CPU with SDPA's math backend,
       which inductor fuses; on CUDA replayed as a CUDA graph). Compiling takes 10-60 s, once
       per process, model and shape (batch size, cache length): it pays over the many rollouts
       of a run, not for one call. The cache length is rounded up so that nearby prompt lengths
       share a graph; dynamo keeps up to torch._dynamo.config.recompile_limit (8) graphs.
    Under autocast the fp32 weights are cast to bf16 once per rollout, not per token (autocast
    caches the casts of leaf parameters within its region).
    """
    B, P = prompt_ids.shape
    device = prompt_ids.device
    L = P + max_new_tokens
    if compile:  # round up to a multiple of L/8 to L/4 (54 -> 56, 300 -> 320)
        q = max(8, 2 ** (L.bit_length() - 3))
        L = -(-L // q) * q
    kw = dict(logits_to_keep=1) if _accepts(model, "logits_to_keep") else {}
    stops = torch.tensor([eos_id, *stop_ids], device=device)
    uniforms = None if uniforms is None else uniforms.to(device)

    # 1. prefill the distinct prompts, then give each row its prompt's keys and values
    rows, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    dedup = len(rows) < B
    ids, mask = (rows[:, :P], rows[:, P:]) if dedup else (prompt_ids, prompt_mask)
    cache = _decode_cache(model, B, L, persistent=compile)
    if cache is None:  # sliding-window layers: prefill into a fresh static cache, then reorder it
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=L)
        logits = _next_logits(model, ids, mask, position_ids_from_mask(mask), cache, kw)  # (U, V)
        if dedup:
            cache.reorder_cache(inverse)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True, **kw)
        logits = out.logits[:, -1]  # (U, V)
        _fill_cache(cache, out.past_key_values, inverse if dedup else None, P)
        del out
    if dedup:
        logits = logits[inverse]  # (B, V)

    # 2. decode; slots of the static cache past the current token are hidden by the causal mask
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, L - P)], 1)  # (B, L)
    pos = prompt_mask.sum(-1, keepdim=True)  # (B, 1) position of the first response token
    step = _step_fn(compile, device)
    graphs = compile and device.type == "cuda"
    check_every = 8 if device.type == "cuda" else 1
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    response_mask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    bad = torch.zeros((), dtype=torch.bool, device=device)  # any row with non-finite logits
    for t in range(max_new_tokens):
        u = None if uniforms is None else uniforms[:, t]
        tok = sample_token(logits, temperature, top_k, top_p, generator, u, bad).masked_fill(done, pad_id)
        tokens[:, t] = tok
        response_mask[:, t] = ~done  # the stop token itself counts
        done = done | torch.isin(tok, stops)
        if t == max_new_tokens - 1 or (t % check_every == check_every - 1 and done.all()):
            break
        if graphs:  # each step's logits are read before the next replay overwrites them
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(model, tok[:, None], mask, pos + t, cache, kw)
    if bad:
        raise RuntimeError(NAN_LOGITS)
    R = int(response_mask.any(0).sum())  # the longest response: its columns are the first R
    return tokens[:, :R], response_mask[:, :R]


# -----------------------------------------------------------------------------
# loading: models, tokenizers and data


def char_tokenizer():
    """A character-level tokenizer built in code (no files, no network): printable ASCII
    plus newline, with <pad>, <eos>, <unk>. Round-trips through save_pretrained."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# Models built from a config, no download: `tiny` for the embedded task, and GPT-2 small and
# large shapes with random weights and the real vocabulary size, for the benchmarks
# (throughput does not depend on the weights). All use the character tokenizer.
MODEL_SHAPES = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, n_positions=128),
    "gpt2-small-random": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
    "gpt2-large-random": dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257),
}


def tiny_config(tokenizer, shape="tiny"):
    """A GPT-2 config of one of MODEL_SHAPES. `tiny` (0.8M parameters) learns the sort task in
    about two minutes on 2 cores. Dropout is off."""
    from transformers import GPT2Config

    kw = dict(MODEL_SHAPES[shape])
    kw.setdefault("vocab_size", len(tokenizer))
    # GPT-2's tanh-approximated GELU as one fused kernel (6.6x faster on CPU than gelu_new's chain
    # of element-wise ops, same function to 2.4e-7); checkpoints keep their own activation
    return GPT2Config(**kw, activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def resolve_checkpoint(path):
    """A run's out_dir holds its checkpoint in `checkpoint/`; accept either folder. If a kill
    struck between the two renames of save_checkpoint, the previous one is `checkpoint.old/`."""
    for p in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
    return path  # a hub id


def load_tokenizer(name, trust_remote_code=False):
    if name in MODEL_SHAPES:
        return char_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_checkpoint(name), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:  # GPT-2 and Pythia have none; masks, not pad ids, decide what is padding
        tok.pad_token = tok.eos_token
    return tok


class FP32Head(torch.nn.Linear):
    """An LM head that computes its logits in fp32, whatever the dtype of its input and weight.

    Under autocast or FSDP's bf16 parameters the head would return bf16 logits, and logits of
    GPT-2 (often 30-120) have bf16 steps of 0.25-0.5: the same token's log-prob could move by
    ~0.1 between two batch layouts, so rho != 1 on the first pass, clipping fires where nothing
    changed and KL != 0 while pi = pi_ref. In fp32 the bf16 operands multiply exactly (on a
    GPU as TF32, which holds bf16's mantissa: the flag at the top of this file) and accumulate
    in fp32.
    Costs an fp32 copy of the weight per forward; only the positions kept by `logits_to_keep`
    pass through it."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else nullcontext():
            return torch.nn.functional.linear(x.float(), self.weight.float(),
                                              None if self.bias is None else self.bias.float())


def fp32_lm_head(model):
    """Make the model's output layer an FP32Head (same weights, same module). Checkpoints are
    unchanged: save_pretrained writes the weights, and loading gives an ordinary nn.Linear."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = FP32Head
    return model


def disable_dropout(model):
    """RLHF compares log-probs of two forwards (policy vs reference, new vs old): dropout
    would add noise to every ratio, so it is switched off everywhere, as TRL does."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def load_model(name, tokenizer, kind="causal", dtype=torch.float32, trust_remote_code=False):
    """`tiny` or another of MODEL_SHAPES (built from a config), a hub id, or a local checkpoint folder.

    kind: "causal" (AutoModelForCausalLM) or "reward" (AutoModelForSequenceClassification with
    one label; the score head is new when loading from a causal LM). Weights load from
    safetensors only; remote code only when asked for.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind not in ("causal", "reward"):
        raise ValueError(f"unknown model kind {kind!r}")
    auto = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    if name in MODEL_SHAPES:
        config = tiny_config(tokenizer, name)
        if kind == "reward":
            config.num_labels = 1
        model = auto.from_config(config, dtype=dtype)
    else:
        extra = dict(num_labels=1) if kind == "reward" else {}
        model = auto.from_pretrained(resolve_checkpoint(name), dtype=dtype, use_safetensors=True,
                                     trust_remote_code=trust_remote_code, **extra)
    n_emb = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_emb:
        raise ValueError(f"tokenizer of {name!r} has {len(tokenizer)} tokens but the model's embedding has "
                         f"{n_emb} rows: the tokenizer does not match the model")
    if kind == "reward":
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        fp32_lm_head(model)
    return disable_dropout(model)


def check_context(model, max_prompt_len, max_response_len):
    """Prompt + response must fit the model's context (position embeddings), checked up front."""
    n = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if n is not None and max_prompt_len + max_response_len > n:
        raise ValueError(f"--max_prompt_len {max_prompt_len} + --max_response_len {max_response_len} = "
                         f"{max_prompt_len + max_response_len} tokens exceeds the model's context of {n}")


def _check_jsonl(path):
    """Find the first line of a .jsonl file that is not a JSON object, to name it in the error."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")


def load_data(name, split, columns, kind=None, n=None, seed=0):
    """A `datasets.Dataset` with string `columns`, from an embedded task (`sort`), a local
    .jsonl / .json / .parquet file, or a hub id. Every row is checked: a missing or non-string
    field is an error naming the file, the row (1-based) and the field. Nothing is dropped.

    kind ("sft", "preference", "prompt") and n pick the rows of an embedded task.
    """
    import datasets

    import tasks

    if name in tasks.TASKS:
        split = "test" if split in ("test", "validation", "eval") else split
        ds = datasets.Dataset.from_list(tasks.task_rows(name, kind, n, seed=seed, split=split))
    elif os.path.splitext(name)[1] in (".jsonl", ".json", ".parquet"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"data file {name} does not exist")
        builder = "parquet" if name.endswith(".parquet") else "json"
        if name.endswith(".jsonl"):
            _check_jsonl(name)
        try:
            ds = datasets.load_dataset(builder, data_files=name, split="train")
        except Exception as e:  # pyarrow's messages name neither the file nor the row
            raise ValueError(f"{name}: could not be read as {builder}: {e}") from None
    else:
        ds = datasets.load_dataset(name, split=split)
    if len(ds) == 0:
        raise ValueError(f"{name} ({split}): no rows")
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{name} ({split}): missing column(s) {missing}; has {ds.column_names}")
    for c in columns:
        for i, v in enumerate(ds[c]):
            if not isinstance(v, str):
                what = "missing field" if v is None else f"field is {type(v).__name__}, not a string:"
                raise ValueError(f"{name} row {i + 1}: {what} {c!r}")
    return ds


def encode_prompts(tokenizer, texts, max_len):
    """Token ids of each prompt; an over-long prompt keeps its last max_len tokens (the end
    of a prompt is what the response follows). Returns (ids, number truncated)."""
    ids = tokenizer(list(texts))["input_ids"]
    n_cut = sum(len(x) > max_len for x in ids)
    return [x[-max_len:] for x in ids], n_cut


def encode_responses(tokenizer, texts, max_len):
    """Token ids of each response followed by EOS; an over-long one keeps its first max_len
    tokens (and so loses its EOS). Returns (ids, number truncated)."""
    ids = [x + [tokenizer.eos_token_id] for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    n_cut = sum(len(x) > max_len for x in ids)
    return [x[:max_len] for x in ids], n_cut


def decode_responses(tokenizer, response_ids, response_mask):
    """Text of each sampled response, without EOS or padding. One transfer from the device for
    the whole batch, not one per row."""
    ids, mask = response_ids.tolist(), response_mask.tolist()
    return [tokenizer.decode([t for t, m in zip(row, keep) if m], skip_special_tokens=True)
            for row, keep in zip(ids, mask)]


@torch.no_grad()
def evaluate_generations(model, tokenizer, prompts, reward_fn, d, max_prompt_len, max_new_tokens, batch_size=256):
    """Greedy answers to held-out prompts, scored by a gold reward: mean reward and the share
    of exact answers (reward 1). Each rank takes its share of prompts; sums are all-reduced."""
    mine = prompts[d.rank::d.world_size]
    total = torch.zeros(3, dtype=torch.float64, device=d.device)  # reward sum, exact count, n
    was_training = model.training
    model.eval()
    with unsharded(model):
        for i in range(0, len(mine), batch_size):
            texts = mine[i:i + batch_size]
            ids, _ = encode_prompts(tokenizer, texts, max_prompt_len)
            p_ids, p_mask = pad(ids, tokenizer.pad_token_id, side="left")
            with autocast(d):
                r_ids, r_mask = generate(model, p_ids.to(d.device), p_mask.to(d.device), max_new_tokens,
                                         tokenizer.eos_token_id, tokenizer.pad_token_id, temperature=0)
            rewards = [reward_fn(p, c) for p, c in zip(texts, decode_responses(tokenizer, r_ids, r_mask))]
            total += torch.tensor([sum(rewards), sum(r == 1.0 for r in rewards), len(rewards)],
                                  dtype=torch.float64, device=d.device)
    model.train(was_training)
    total = all_reduce_sum(total, d)
    return {"eval/gold_reward": (total[0] / total[2]).item(), "eval/exact_match": (total[1] / total[2]).item()}


# -----------------------------------------------------------------------------
# logging: metrics.jsonl and one line per step on rank 0; wandb only when asked for


_PEAK_GIB = [0.0]  # the run's peak GPU memory over the windows reset_peak_memory closed


def sync(d):
    """Wait for the device's queued work, so that a wall clock read next measures it (CUDA runs
    asynchronously: without this a phase's time spills into the next one's)."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)


def reset_peak_memory(d):
    """Peak GPU memory (GiB) allocated since the last call, and start a new window, so a script
    can log the peak of each phase (grpo.py: rollout, update). 0 on CPU."""
    if d.device.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated(d.device) / 2**30
    _PEAK_GIB[0] = max(_PEAK_GIB[0], peak)
    torch.cuda.reset_peak_memory_stats(d.device)
    return peak


class Logger:
    def __init__(self, out_dir, cfg, d, use_wandb=False, project="rlhf"):
        self.enabled, self.wandb, self.t0 = d.is_main, None, time.time()
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "run_config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        if use_wandb:
            import wandb  # optional extra

            self.wandb = wandb.init(project=project, config=dataclasses.asdict(cfg))

    def log(self, step, metrics, echo=True):
        if not self.enabled:
            return
        if torch.cuda.is_available():  # the whole run's peak, across reset_peak_memory's windows
            metrics = {**metrics, "mem/peak_gib": max(_PEAK_GIB[0], torch.cuda.max_memory_allocated() / 2**30)}
        row = {"step": step, "time": round(time.time() - self.t0, 2), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if echo:
            print(f"step {step:5d} | " + " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()), flush=True)

    def close(self):
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


# -----------------------------------------------------------------------------
# checkpoints: Hugging Face native, written so that a kill never leaves a broken one


def full_state_dict(model, d):
    """The full (unsharded) state dict on CPU. Collective under FSDP: call on every rank."""
    if not d.sharded:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # tied weights (GPT-2's lm_head = wte) are one Parameter under two names: keep one name,
    # as save_pretrained does; FSDP's gathered copies no longer share storage to show it
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in state.items() if k not in aliases}


def prepare_out_dir(out_dir, resume, overwrite, d):
    """The checkpoint to resume from, or None for a fresh run.

    An out_dir that already holds a checkpoint is never written over by accident: without
    --resume or --overwrite the run stops before doing anything. With --resume, metrics rows
    past the checkpoint's step (from the interrupted run) are cut so none appear twice.
    """
    found = resolve_checkpoint(out_dir)
    has_ckpt = os.path.isfile(os.path.join(found, "config.json"))
    if has_ckpt and not (resume or overwrite):
        raise FileExistsError(f"{out_dir} already holds a checkpoint ({found}); pass --resume to continue that run "
                              f"or --overwrite to replace it")
    if has_ckpt and resume and not os.path.isfile(os.path.join(found, "training_state.pt")):
        raise FileNotFoundError(f"{found} has no training_state.pt (a final-only checkpoint): cannot --resume")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if d.is_main and os.path.isfile(metrics):
        if has_ckpt and resume:
            step = torch.load(os.path.join(found, "training_state.pt"), weights_only=True)["step"]
            with open(metrics) as f:
                keep = [line for line in f if json.loads(line)["step"] <= step]
            with open(metrics, "w") as f:
                f.writelines(keep)
        elif not resume:
            os.remove(metrics)
    if d.world_size > 1:
        dist.barrier()
    if resume and not has_ckpt:
        print0(f"--resume: no checkpoint in {out_dir}; starting a fresh run")
    return found if (has_ckpt and resume) else None


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(model, tokenizer, out_dir, d, optimizer=None, scheduler=None, train_state=None,
                    name="checkpoint"):
    """save_pretrained (model + tokenizer) into a temporary folder, then rename it into place.

    With an optimizer, `training_state.pt` goes beside the weights: optimizer and scheduler
    state, RNG states of every rank, and `train_state` (step, data position) for --resume.
    A kill while writing leaves the previous `checkpoint/` untouched (or, between the two
    renames, as `checkpoint.old/`, which resolve_checkpoint finds). Collective: all ranks call.
    """
    state = full_state_dict(model, d)
    extra = None
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rngs = [None] * d.world_size
        if d.world_size > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        extra = {"optimizer": optim, "scheduler": scheduler.state_dict() if scheduler else None, "rng": rngs,
                 **(train_state or {})}
    path = os.path.join(out_dir, name)
    if d.is_main:
        tmp, old = path + ".tmp", path + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            torch.save(extra, os.path.join(tmp, "training_state.pt"))
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    return path


def load_training_state(path, model, optimizer, scheduler, d):
    """Restore optimizer, scheduler and this rank's RNG state from `path` (the weights were
    loaded with the model). Returns the saved train_state (step, data position, ...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(os.path.join(path, "training_state.pt"), weights_only=True, map_location="cpu")
    set_optimizer_state_dict(model, optimizer, state.pop("optimizer"), options=StateDictOptions(full_state_dict=True))
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state.pop("scheduler"))
    rngs = state.pop("rng")
    if len(rngs) != d.world_size:
        raise ValueError(f"{path} was saved by {len(rngs)} ranks; resuming on {d.world_size} would change sampling")
    set_rng_state(rngs[d.rank])
    return state


def lr_schedule(optimizer, warmup_steps, total_steps):
    """Linear warmup then cosine decay to zero (the transformers implementation)."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, warmup_steps, max(total_steps, 1))

