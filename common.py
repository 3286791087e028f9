"""What sft.py, reward.py, dpo.py and grpo.py share: distributed setup and FSDP2, padding,
packing and position ids, log-probs and reward scores, the optimizer step (each algorithm's
math is in its script, the sampler in sampling.py, data in data.py, running a script in plumbing/).

Shapes, named alike in every file: B rows (sequences) of a batch, G completions per prompt (a
group), P prompt tokens, R response tokens, V vocabulary entries; N rows of a whole rollout or
data set. A shape comment (B, P+R) follows the line that makes a tensor. Every batch is a prompt
block left-padded to P tokens, then a response block right-padded to R, no padding between:

    input_ids       (B, P+R)   [pad pad p1 p2 p3 | r1 r2 EOS pad]
    attention_mask  (B, P+R)   [ 0   0  1  1  1  |  1  1  1   0 ]
    response_mask   (B, R)                        [ 1  1  1   0 ]

Three rules every script follows, so that the scripts differ only in their math:
1. Loss: a loss function takes the global-batch denominator (tokens or pairs over all micro-
   batches and ranks) and divides loss and metrics by it; `backward` does the rest: neither
   accumulation nor the number of ranks changes the gradient (trl #3021).
2. Metrics: each micro-batch's detached metrics are added up on the device (`add_metrics`) and
   read once per step (`reduce_metrics`: one all-reduce, one host sync).
3. Evaluation: `map_rows` computes per-row values with as many forwards on every rank.
"""
import dataclasses
import functools
import inspect
import math
import os
import random
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch._inductor.config
import torch.distributed as dist

import lm_head

# TF32 for a GPU's fp32 matmuls (FP32Head under `python`): ~8x fp32's rate; CPUs keep full fp32.
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

    @functools.cached_property
    def mesh(self):
        """FSDP2's device mesh: 1-D, or (replicate, shard) with hsdp: all-gathers inside a node."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.hsdp and self.hsdp != self.world_size:
            return init_device_mesh(self.device.type, (self.world_size // self.hsdp, self.hsdp),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, (self.world_size,))


def setup_distributed(timeout_minutes=10.0, hsdp=0):
    """Join torchrun's process group (nccl on CUDA, gloo on CPU; FSDP2 even for one process; under
    `python` neither). The device is LOCAL_RANK's (cuda:0-7 on each node of 8 GPUs), more ranks per
    node than GPUs refused. hsdp: the size of the groups that shard (Dist.mesh)."""
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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None)
    return Dist(rank, world_size, local_rank, device=device, torchrun=torchrun, hsdp=hsdp)


def cleanup_distributed():
    """Leave the process group (rundir.release also lets go of the run's out_dir)."""
    if dist.is_initialized():
        dist.barrier()
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


def all_gather(x, d):
    """Every rank's x (equal shapes) concatenated along dim 0, on every rank. Collective."""
    if d.world_size == 1:
        return x
    out = x.new_empty((d.world_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def to_device(values, device):
    """A list of ints as a long tensor on the device, copied without a host sync (from pinned memory on
    a GPU: a copy from pageable memory waits for the queue)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def shard_batch(n, d):
    """The slice of a global batch of n rows that this rank takes."""
    if n % d.world_size:
        raise ValueError(f"batch of {n} rows does not divide over {d.world_size} ranks")
    per = n // d.world_size
    return slice(d.rank * per, (d.rank + 1) * per)


def backward(model, loss, d, sync=True):
    """Backpropagate a micro-batch's loss, already divided by its global-batch denominator. FSDP
    averages gradients over ranks: x world_size makes that the sum. Each micro-batch is reduce-
    scattered into the rank's shard (deferring that holds full fp32 gradients: 30 GiB at 8B);
    HSDP's all-reduce across replicas waits for `sync`, the step's last micro-batch."""
    if hasattr(model, "set_requires_all_reduce"):
        model.set_requires_all_reduce(sync)
    (loss * d.world_size).backward()


def add_metrics(sums, metrics, weight=1.0):
    """Add a micro-batch's detached metrics (0-d tensors, already divided by the global-batch
    denominator) into `sums`, on the device: no host sync."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v.detach() * weight
    return sums


def reduce_metrics(sums, d, maxes=None, same=None):
    """The step's metrics as floats, in one host sync. Collective. sums: summed over ranks (each
    rank's share of a global-batch mean); maxes: the maximum over ranks; same: as they are (the
    grad norm, a rank's timings). Values: tensors on the device, or floats."""
    def stack(values):
        return torch.stack([torch.as_tensor(v).to(d.device, torch.float64) for v in values]) if values else \
            torch.zeros(0, dtype=torch.float64, device=d.device)

    maxes, same = maxes or {}, same or {}
    s, m = all_reduce_sum(stack(sums.values()), d), stack(maxes.values())
    if d.world_size > 1 and maxes:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return dict(zip([*sums, *maxes, *same], torch.cat([s, m, stack(same.values())]).tolist()))


ROWS_DONE = []  # callbacks(done, n) told of each chunk map_rows ends: a run's heartbeat (plumbing/logs.phase)


def map_rows(fn, n, d, batch_size, logits_per_row=0):
    """fn(rows) -> (len(rows), k) values, for all n rows, (n, k), on every rank. Collective. Each
    rank takes a strided share in chunks of at most batch_size rows (fewer where logits_per_row would
    pass lm_head.EVAL_LOGITS), every chunk of one size (the last padded with copies of a row, their values
    dropped: a compiled decode step meets one batch shape) and as many on every rank: FSDP's forwards
    are collective. After each chunk, ROWS_DONE's callbacks get the rows done so far over all ranks
    (no host sync)."""
    batch_size = max(1, min(batch_size, lm_head.EVAL_LOGITS // max(logits_per_row, 1)))
    mine, most = list(range(d.rank, n, d.world_size)), -(-n // d.world_size)  # most: the largest rank's share
    n_chunks = -(-most // batch_size)
    size = -(-most // n_chunks)  # the chunks of the largest share, as even as can be
    out = None
    for c in range(n_chunks):
        rows = mine[c * size:(c + 1) * size]
        values = fn(rows + [rows[0] if rows else 0] * (size - len(rows)))
        if out is None:
            out = values.new_zeros(n, values.shape[1])
        out[rows] = values[:len(rows)]
        for done in ROWS_DONE:
            done(min(n, (c + 1) * size * d.world_size), n)
    return all_reduce_sum(out, d)


# -----------------------------------------------------------------------------
# FSDP2: fully_shard every transformer block, then the root


def transformer_blocks(model):
    """Modules named by any `_no_split_modules` of the model tree: the whole tree, so that a causal
    LM inside a wrapper (a PeftModel) is still sharded block by block."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_blocks(model):
    """Each transformer block's forward compiled (regional compilation, as torchtitan's) for the passes
    without a KV cache, the training and log-prob ones: FSDP2's hooks run around it, and dynamo compiles
    a block's code once for every block of the model (their weights are the graph's inputs) and every
    batch shape (symbolic sizes: the micro-batches' lengths differ), a graph for each kind of pass (with
    and without a gradient, trained or frozen weights). A forward with a cache (the sampler's prefill
    and decode steps) runs the block as it is: its own compiled step traces it whole, and a cache's
    positions would recompile a block at every step. Inductor rounds its fused intermediates as eager
    code would (emulate_precision_casts), so that a pass without a gradient (the reference's, the old
    policy's) and one with it compute the same numbers."""
    torch._inductor.config.emulate_precision_casts = True
    for block in transformer_blocks(model):
        if "forward" not in vars(block):
            block.forward = _uncached_compiled(block.forward)


def _uncached_compiled(forward):
    """forward, compiled where it is called without a KV cache (its `cache`, or an older transformers'
    `past_key_values` / `layer_past`, None: by keyword or at its place)."""
    params = list(inspect.signature(forward).parameters)
    name = next((p for p in ("cache", "past_key_values", "layer_past") if p in params), None)
    at = params.index(name) if name else None
    compiled = torch.compile(forward, dynamic=True)

    def run(*args, **kwargs):
        cached = name is not None and (kwargs.get(name) if name in kwargs else args[at] if at < len(args) else None)
        return forward(*args, **kwargs) if cached is not None else compiled(*args, **kwargs)
    run.compiled = compiled
    return run


def bf16_supported(device):
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def frozen_dtype(d):
    """Frozen models' dtype: bf16 under FSDP on a GPU, where the policy computes with bf16 parameters
    too (MixedPrecisionPolicy); fp32 under `python`, where the policy's fp32 weights meet autocast."""
    return torch.bfloat16 if d.torchrun and bf16_supported(d.device) else torch.float32


def shard_model(model, d, cpu_offload=False, activation_checkpointing=False):
    """The model on its device: FSDP2 under torchrun (each block, then the root), else a move.
    FSDP2 computes in bf16 with fp32 master weights and gradient reduction where the GPU has bf16,
    fp32 elsewhere. cpu_offload: the shards in host memory between uses (frozen models; a GPU). A
    frozen root reshards after each forward (no backward follows that would need it gathered)."""
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

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_supported(d.device) \
        else MixedPrecisionPolicy()
    kw = dict(mesh=d.mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
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
    """A frozen model (reference, reward model): no gradients, eval mode, sharded, its parameters
    in frozen_dtype(d). Parameters only: a Llama's rotary inv_freq buffer stays fp32, as in the
    policy under MixedPrecisionPolicy (model.to(bf16) rounds it by up to 2e-3: KL != 0 at step 0)."""
    dtype = frozen_dtype(d)
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    return shard_model(model.eval(), d, cpu_offload=cpu_offload)


def fill_from_rank0(model, full, d):
    """Rank 0's weights (`full`, its state dict) into every rank's shards of a sharded model built
    on the meta device elsewhere (load_model), by broadcast; buffers outside the state dict (rotary
    inv_freq, causal masks) whole. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not d.is_main:
        model.to_empty(device=d.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


def autocast(d, enabled=True):
    """bf16 autocast for a single GPU without FSDP (FSDP's MixedPrecisionPolicy casts itself)."""
    if enabled and not d.torchrun and bf16_supported(d.device):
        return torch.autocast(d.device.type, dtype=torch.bfloat16)
    return nullcontext()


@contextmanager
def unsharded(model):
    """Gather FSDP parameters once for a whole rollout, not once per token (pytorch #123962), until
    the block ends. No-op without FSDP."""
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
            # shard_model's settings: blocks reshard after forward; a trained root not (backward needs
            # them, and reward_scores' hook inside the forward would find them freed); a frozen one does
            m.set_reshard_after_forward(m is not model or frozen, recurse=False)


@contextmanager
def evaluating(model, gather=False):
    """Eval mode and no gradients for the block. gather: the parameters gathered once (`unsharded`),
    for generation; without it every rank must run as many forwards (`map_rows`)."""
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
    """Prompts left-padded, responses right-padded, joined: input_ids, attention_mask (B, P+R)
    and response_mask (B, R)."""
    p_ids, p_mask = pad(prompts, pad_id, side="left")
    r_ids, r_mask = pad(responses, pad_id, side="right")
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), r_mask


def pack(model, kw):
    """A padded batch's real tokens back to back in one sequence: kw's input_ids and position_ids (B, T)
    become (1, N), position ids restarting at 0 with each row, and its attention mask None; returns
    index (B, T), each token's place in the pack (-1: padding). Given position ids and no mask,
    transformers reads each restart as a new sequence and masks attention block-diagonally
    (masking_utils.find_packed_sequence_indices, for SDPA and eager; flash attention's varlen kernels
    take the same ids), so no row sees another's tokens and no pad token is computed; under
    plumbing.models' sdpa_packed the rows' bounds (cu_seq_lens_q) make each row attend on its own.
    Whether a model honours it: `packing_works`."""
    real = kw.pop("attention_mask").bool()
    index = torch.where(real, real.flatten().long().cumsum(0).view(real.shape) - 1, -1)  # (B, T)
    kw.update(input_ids=kw["input_ids"][real][None], position_ids=kw["position_ids"][real][None], attention_mask=None)
    if getattr(model.config, "_attn_implementation", None) == "sdpa_packed":
        kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = torch.nn.functional.pad(real.sum(-1).cumsum(0), (1, 0)).int()
    return index


def micro_batches(rows, attention_mask, rows_per_forward, d, packed=False):
    """`rows` (indices into attention_mask's (n, T)) cut into micro-batches of rows_per_forward rows,
    or, packed, of consecutive rows holding at most rows_per_forward * T real tokens (a padded
    micro-batch's tokens: no more activation memory), a row longer than that alone. Packed, every
    rank cuts as many as the rank that needs most (FSDP's forwards are collective), halving its
    largest: one host sync (and one all-reduce) per call. A list of index tensors, in order."""
    if not packed:
        return [rows[i:i + rows_per_forward] for i in range(0, len(rows), rows_per_forward)]
    budget, lengths = rows_per_forward * attention_mask.shape[1], attention_mask[rows].sum(-1).tolist()
    cuts, held = [0], 0  # each micro-batch's first row; the tokens of the one being filled
    for i, n in enumerate(lengths):
        if held + n > budget and i > cuts[-1]:
            cuts.append(i)
            held = 0
        held += n
    n = torch.tensor(len(cuts), device=attention_mask.device)
    if d.world_size > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    spans = [(a, b) for a, b in zip(cuts, cuts[1:] + [len(rows)])]
    while len(spans) < int(n):  # halve the micro-batch with most tokens (of those with 2+ rows)
        a, b = max((s for s in spans if s[1] - s[0] > 1), key=lambda s: sum(lengths[s[0]:s[1]]))
        i = spans.index((a, b))
        spans[i:i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [rows[a:b] for a, b in spans]


def packing_pays(model, attention_mask, rows_per_forward, d):
    """Whether packing these rows (micro-batches of at most rows_per_forward x T tokens) computes less
    than padding them. Flash attention's varlen kernels attend within each row: always. SDPA and
    eager mask a packed micro-batch's N x N query-key pairs but still compute them (padded: B x T x T);
    per layer a token's projections and MLP cost ~24 h^2 FLOPs and a pair 4 h, so with w = 1 / (6 h)
    packing pays where N (1 + w min(N, rows_per_forward T)) < n T (1 + w T): for h = 1536, T = 1536
    and 4 rows a micro-batch, where more than 23% of the tokens are padding. Summed over d's ranks
    first: packing changes how many forwards (collectives under FSDP) a rank runs (common.micro_batches),
    so one rank's rows must not decide it alone. One host sync."""
    if "flash" in str(getattr(model.config, "_attn_implementation", "")) or \
            getattr(model.config, "_attn_implementation", None) == "sdpa_packed":
        return True
    n, T = attention_mask.shape
    w = 1 / (6 * model.config.get_text_config().hidden_size)
    N = attention_mask.sum(dtype=torch.float64)
    cost = torch.stack([N * (1 + w * N.clamp(max=rows_per_forward * T)), N.new_tensor(n * T * (1 + w * T))])
    if d.world_size > 1:
        dist.all_reduce(cost)
    return bool(cost[0] < cost[1])


# -----------------------------------------------------------------------------
# log-probs and reward scores


def _accepts(model, arg):
    """Whether the model's forward takes `arg` (a PeftModel's: the wrapped model's, not **kwargs)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return arg in inspect.signature(model.forward).parameters


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False,
                      entropy_grad=False, truncate=None, packed=False):
    """Per-token log-probs of the response block, (B, R), at the sampling temperature, from one
    forward with position ids (GPT-2 does not derive them from the mask); with_entropy: also each
    position's entropy, detached unless entropy_grad. Position t predicts token t+1: only the R
    positions before the response reach the head (`logits_to_keep`), which scores them in chunks
    (forward_logprobs): no (B, R, V) logits, let alone (B, P+R, V).
    truncate: fn(logits, labels) -> logits with the tokens a sampler's rule drops at -inf
    (sampling.truncation): the log-probs are then the truncated policy's, renormalised on what it
    keeps; the entropy stays the full distribution's (a -inf logit has no entropy term to add).
    packed: the rows back to back in one sequence (`pack`), no padding computed; log-probs and
    entropies 0 at the response block's padding (the padded forward leaves values there that every
    loss masks out)."""
    kw = dict(input_ids=input_ids, attention_mask=attention_mask,
              position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    T, keep, resp = input_ids.shape[1], slice(-(n_response + 1), -1), None
    if packed:  # the M real response tokens, each predicted from the packed position before it
        index, resp = pack(model, kw), attention_mask[:, T - n_response:].bool()  # (B, T), (B, R)
        keep = index[:, T - n_response - 1:T - 1][resp]  # (M,)
    if _accepts(model, "logits_to_keep"):  # those positions only: a contiguous (B, R, V), no copy in reshapes
        kw["logits_to_keep"] = keep if packed else torch.arange(T - n_response - 1, T - 1, device=input_ids.device)
    labels = input_ids[:, -n_response:] if resp is None else input_ids[:, -n_response:][resp]  # (B, R) or (M,)
    unpack = None if resp is None else (lambda x: x.new_zeros(resp.shape).masked_scatter(resp, x))
    knobs = dict(temperature=temperature, truncate=truncate, with_entropy=with_entropy, entropy_grad=entropy_grad,
                 unpack=unpack)
    if "logits_to_keep" not in kw:  # a model that computes every position's logits: the response's taken
        logits = model(**kw).logits[0, keep] if packed else model(**kw).logits[:, keep]  # (M, V) or (B, R, V)
        return scored_logits(logits, labels, **knobs)
    return forward_logprobs(model, kw, labels, **knobs)


def forward_logprobs(model, kw, labels, temperature=1.0, truncate=None, with_entropy=False, entropy_grad=False,
                     unpack=None):
    """model(**kw)'s log-probs of `labels` at the positions its head sees (kw's logits_to_keep: one
    per label, in order), (labels.shape), and with_entropy their distributions' entropies (detached
    unless entropy_grad), each through unpack(x) where given. Fused in the head where the model's
    forward returns what its head computes (FP32Head.request: no (tokens x V) logits), else from the
    logits (scored_logits)."""
    head = lm_head.fused_head(model)
    if head is None:
        logits = model(**kw).logits.reshape(*labels.shape, -1)  # (..., V)
        return scored_logits(logits, labels, temperature=temperature, truncate=truncate, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, unpack=unpack)
    head.request = dict(labels=labels, temperature=temperature, truncate=truncate, entropy=with_entropy,
                        entropy_grad=entropy_grad)
    try:
        out = model(**kw).logits.reshape(*labels.shape, -1)  # (..., 1 | 2): log-prob, entropy
    finally:
        head.request = None
    unpack = unpack or (lambda x: x)
    if not with_entropy:
        return unpack(out[..., 0])
    return unpack(out[..., 0]), unpack(out[..., 1] if entropy_grad else out[..., 1].detach())


def scored_logits(logits, labels, temperature=1.0, truncate=None, with_entropy=False, entropy_grad=False, unpack=None):
    """forward_logprobs from logits (..., V): at the temperature, under `truncate`, chunked."""
    if temperature != 1.0:
        logits = logits / temperature
    unpack = unpack or (lambda x: x)
    logps = unpack(lm_head.logprobs_from_logits(logits if truncate is None else truncate(logits, labels), labels))
    if not with_entropy:
        return logps
    with nullcontext() if entropy_grad else torch.no_grad():
        return logps, unpack(lm_head.entropy_from_logits(logits))


def sequence_logprobs(model, batch, d, packed=False):
    """log pi(y|x) summed over each row's response tokens, (B,), for a batch (ids, attn, resp), one
    forward; packed: where it computes less (`packing_pays`)."""
    ids, attn, resp = batch
    with autocast(d):
        logps = response_logprobs(model, ids, attn, resp.shape[1], packed=packed and packing_pays(model, attn, len(ids), d))
    return (logps.float() * resp).sum(-1)


def per_position(model, **kw):
    """The forward's per-position output: a causal LM's logits (B, T, V), a sequence classifier's
    `score` head (B, T, 1) (hooked inside its forward, so FSDP gathers it as usual; the model's own
    output is pooled)."""
    head = getattr(model, "score", None)
    if head is None:
        return model(**kw, use_cache=False).logits
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        model(**kw, use_cache=False)
    finally:
        handle.remove()
    return captured[0]


def reward_scores(model, input_ids, attention_mask, packed=False):
    """Scalar score of each sequence, (B,), from an AutoModelForSequenceClassification's `score`
    head, read at the last real token by the mask (pad == eos does no harm: transformers #35352);
    the config's gain and bias apply. packed: the rows back to back (`pack`), no padding computed."""
    if getattr(model, "score", None) is None:
        raise ValueError(f"{type(model).__name__} has no `score` head: not a sequence-classification model")
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    if packed:
        index = pack(model, kw)
    values = per_position(model, **kw).squeeze(-1).float()  # (B, T), or (1, N) packed
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # (B,) index of the last 1
    if packed:  # the last real token's place in the packed sequence
        scores = values[0, index.gather(1, last[:, None]).squeeze(1)]
    else:
        scores = values.gather(1, last[:, None]).squeeze(1)
    return scores * getattr(model.config, "reward_gain", 1.0) + getattr(model.config, "reward_bias", 0.0)


def ranking_accuracy(chosen, rejected):
    """Share of pairs whose chosen score is above the rejected one, ties counting half (a policy
    equal to its reference ranks nothing). chosen, rejected: (N,). A 0-d tensor."""
    return ((chosen > rejected).double() + 0.5 * (chosen == rejected).double()).mean()


# -----------------------------------------------------------------------------
# loading what a script trains, and its optimizer step


def lr_schedule(step, warmup_steps, total_steps, kind="cosine"):
    """The learning rate's multiplier at an optimizer step: a linear warmup from 0, then a cosine or
    a linear decay to 0 at total_steps, or constant (`constant`: no warmup either): transformers'
    get_scheduler of each name, the same floats (tests/test_common.py)."""
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(params, lr, weight_decay, warmup_steps, total_steps, schedule="cosine"):
    """AdamW (betas 0.9, 0.95; fused: one kernel for all parameters, bench/test_micro.py) and its
    schedule (lr_schedule of that kind: --lr_scheduler_type)."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)
    multiplier = functools.partial(lr_schedule, warmup_steps=warmup_steps, total_steps=max(total_steps, 1),
                                   kind=schedule)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_grad_norm(model, max_norm):
    """Clip by the global norm (FSDP2's DTensor gradients too); the pre-clip norm, 0-d (0: no clip)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def optimizer_step(model, optimizer, scheduler, max_norm):
    """Clip, step, advance the schedule, clear the gradients -> (pre-clip grad norm, the lr used)."""
    norm = clip_grad_norm(model, max_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, lr
