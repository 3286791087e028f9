"""Log-probs of rows that share their prompt (GRPO's group of G samples, DPO's chosen and rejected),
each distinct prompt computed once, in one forward: a group's prompt then its rows' responses as one
sequence, each response attending the prompt and itself under a 4-D mask, so that the prompt's keys and
values serve every row. A forward of B rows of P + R tokens from U prompts then computes U x P + B x R
tokens instead of B x (P + R): for 4 prompts x G = 8 of 128 + 32 tokens, 1,536 instead of 5,120; for 8
DPO pairs, 1,536 instead of 2,560; and it dispatches a padded forward's ops (one pass, no per-layer
gathers: on a GPU a small model's step is bound by its launches). The groups are the caller's (the
rollout's rows r // G, DPO's pairs), not found by comparing the rows (a host read). Decoding (sampling's
generate and tool loop, compiled on CPU) keeps a rollout's prompts once the same way: `attention` reads
each prompt's keys and values once for its G samples instead of from a copy in each row's cache.

The same products as common.response_logprobs' padded forward: each real token sees the same real tokens
at the same positions; only float sums run in another order (fp32: ~1e-6 on random weights). With a
gradient, the prompt's positions get the sum over the rows that share it, as the padded forward's sum
over their copies (tests/test_shared_prompt.py).

Memory: a shared forward holds at most a padded micro-batch's rows (micro_batches cuts by rows even where
--padding_free would cut by tokens): U sequences of P + g R tokens (g: the most rows a prompt has in the
micro-batch) and their U (P + g R)^2 mask, whose attention is dense (the FLOP rule counts it:
micro_batches). Not bitwise the padded path's (float order), so two passes whose log-probs meet in one
formula (the policy's and the reference's in the KL, the old policy's in the ratio, the teacher's in
distillation) take one layout, decided once for every model they run (`micro_batches(models=...)`, `plan`):
at equal weights their log-probs are then equal to the bit, and so the KL, its gradient and log rho are
exactly 0 (tests/test_exact.py).
"""
import contextlib
import itertools

import torch
import transformers
from transformers.cache_utils import DynamicLayer, StaticLayer

import common


def _flops(tokens, keys, w):
    """packing_pays' per-layer count in units of a token's projections and MLP (24 h^2): each of
    `tokens` tokens attending over `keys` keys adds w = 1 / (6 h) a key."""
    return tokens * (1 + w * keys)


def _shareable(model, n_prompt):
    """Whether a forward of this model can share prompts: a prompt block; attention that takes a 4-D
    mask as given (SDPA, plumbing.models' packed SDPA, which passes one on to SDPA, or eager; not flash
    attention's varlen kernels); full attention in every layer (a sliding window's own mask would be
    replaced by the 4-D one); no activation checkpointing (its memory is counted in the padded layout:
    bench/memory.py)."""
    return (n_prompt > 0 and not getattr(model, "is_activation_checkpointing", False)
            and model.config.get_text_config()._attn_implementation in ("sdpa", "sdpa_packed", "eager")
            and all(type(layer) is DynamicLayer for layer in transformers.DynamicCache(config=model.config).layers))


def _possible(models, n_prompt, d):
    """_shareable for every one of `models` (None: absent), in one process: every FSDP rank must run as
    many forwards, and whether a rank's rows share prompts is its own."""
    return d.world_size == 1 and all(m is None or _shareable(m, n_prompt) for m in models)


def prompts(ids, attn, n_prompt):
    """The distinct prompts (the first n_prompt columns, ids then mask), (U, 2 n_prompt), and each
    row's among them, (B,): rows with one prompt share it."""
    return torch.unique(torch.cat([ids[:, :n_prompt], attn[:, :n_prompt]], 1), dim=0, return_inverse=True)


def groups_of(ids, attn, n_prompt):
    """Each row's prompt, numbered in order of first appearance (rows with one number share it), found
    by comparing the rows' prompt blocks (torch.unique: a host read), for a caller that does not know
    its rows' groups."""
    found = prompts(ids, attn, n_prompt)[1].tolist()
    number = {x: i for i, x in enumerate(dict.fromkeys(found))}
    return [number[x] for x in found]


def _slots(groups):
    """The shared layout of rows whose prompts are `groups` (one id a row): the distinct groups in
    order of first appearance, U of them, each a sequence of its prompt then g response slots (g: the
    most rows a group has). Returns src, (U, g) the row in each slot (-1: an empty slot), and each
    row's slot, u g + k, (B,); host lists."""
    members = {}
    for b, x in enumerate(groups):
        members.setdefault(x, []).append(b)
    g = max(map(len, members.values()))
    src = [m + [-1] * (g - len(m)) for m in members.values()]
    slot = [0] * len(groups)
    for u, m in enumerate(members.values()):
        for k, b in enumerate(m):
            slot[b] = u * g + k
    return src, slot


def _length(groups, P, R):
    """(U, L): a shared forward's sequences and their length, P + g R."""
    members = {}
    for x in groups:
        members[x] = members.get(x, 0) + 1
    return len(members), P + max(members.values()) * R


def micro_batches(rows, ids, attn, n_response, rows_per_forward, d, packed=False, models=(), enabled=True, groups=None):
    """(micro-batches, shared): common.micro_batches' cut (packed: by tokens), or, where computing each
    distinct prompt once computes fewer FLOPs, micro-batches of rows_per_forward rows (never more rows
    than a padded micro-batch, whatever packing would fit: its memory) with shared, a list of each
    micro-batch's rows' groups, for response_logprobs(shared=...); False where not shared. groups: each
    row of ids' prompt (the rollout's or the pairing's structure; None: compared, a host read). One
    decision for every one of `models` (the policy first, whose width counts the FLOPs): a model that
    cannot share (activation checkpointing) keeps them all off it. A micro-batch whose rows all have
    prompts of their own counts as its padded or packed forward, which it then takes. A few host
    syncs (the rows and their lengths) a pass."""
    P, R = ids.shape[1] - n_response, n_response
    cut = common.micro_batches(rows, attn, rows_per_forward, d, packed)
    if not enabled or not models or not _possible(models, P, d):
        return cut, False
    model = models[0]
    T, w = ids.shape[1], 1 / (6 * model.config.get_text_config().hidden_size)
    lengths = attn[rows].sum(-1).tolist()  # per row of `rows`
    prompt = groups_of(ids[rows], attn[rows], P) if groups is None else [groups[i] for i in rows.tolist()]
    per_row = "flash" in str(model.config._attn_implementation) or model.config._attn_implementation == "sdpa_packed"

    def alone(a, b):  # common.response_logprobs' FLOPs for rows[a:b]: padded, or packed (N x N pairs under SDPA)
        if not packed:
            return _flops((b - a) * T, T, w)
        n = lengths[a:b]
        return sum(_flops(x, x, w) for x in n) if per_row else _flops(sum(n), sum(n), w)

    def shared(a, b):  # U sequences of a prompt and its rows' responses, each token attending its whole length
        U, L = _length(prompt[a:b], P, R)
        return alone(a, b) if U == b - a else _flops(U * L, L, w)

    def spans(chunks):  # each micro-batch's (first, end) in `rows`: they cut it in order
        ends = list(itertools.accumulate(len(c) for c in chunks))
        return list(zip([0] + ends[:-1], ends))

    by_rows = common.micro_batches(rows, attn, rows_per_forward, d)
    if sum(shared(a, b) for a, b in spans(by_rows)) < sum(alone(a, b) for a, b in spans(cut)):
        return by_rows, [prompt[a:b] for a, b in spans(by_rows)]
    return cut, False


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False,
                      entropy_grad=False, truncate=None, packed=False, shared=False):
    """common.response_logprobs' (B, R) log-probs (and entropies: detached unless entropy_grad), where
    `shared` (each row's group: rows of a group share their prompt block; True: found by comparing
    them) with each distinct prompt computed once, in ONE forward: a group's prompt then its rows'
    responses as one sequence, each response attending the prompt and itself (a 4-D mask), so that a
    step dispatches a padded forward's ops, not a prefill's and a second pass's. The same products as
    the padded forward's: each real token sees the same real tokens at the same positions. common.
    response_logprobs itself (packed or not) where not shared or where no two rows share a prompt."""
    P, R = input_ids.shape[1] - n_response, n_response
    groups = groups_of(input_ids, attention_mask, P) if shared is True else shared
    if not groups or len(set(groups)) == len(groups):
        return common.response_logprobs(model, input_ids, attention_mask, R, temperature=temperature,
                                        with_entropy=with_entropy, entropy_grad=entropy_grad, truncate=truncate,
                                        packed=packed)
    src, slot = (common.to_device(x, input_ids.device) for x in _slots(groups))  # (U, g), (B,)
    (U, g), T = src.shape, input_ids.shape[1]
    structure, eye, keep, slot_of, col = _structure(P, g, R, input_ids)
    row = src.gather(1, slot_of.expand(U, -1))  # (U, L): the row each token of a sequence comes from; -1: none
    at = row.clamp(min=0) * T + col  # (U, L): each token's place in the (B, T) block, as torch.take reads it
    ids, pos = input_ids.take(at), common.position_ids_from_mask(attention_mask).take(at)
    real = attention_mask.take(at).bool() & (row >= 0)  # (U, L): the rows' real tokens
    mask = ((structure & real[:, None, :]) | eye)[:, None]  # (U, 1, L, L): True where a query sees a key
    if model.config.get_text_config()._attn_implementation == "eager":  # eager attention adds its mask
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep)
    return common.forward_logprobs(model, kw, ids[:, P:], temperature=temperature, truncate=truncate,
                                   with_entropy=with_entropy, entropy_grad=entropy_grad,
                                   unpack=lambda x: x.reshape(U * g, R).index_select(0, slot))  # (B, R) each


_STRUCTURES = {}  # (P, g, R, device, fake mode) -> _structure's tensors: a run meets a few shapes
KEPT_MASK = 2**22  # kept for a shape whose (L, L) masks are this many entries or fewer: 4 MB each


def _structure(P, g, R, like):
    """A shared sequence of a P-token prompt and g response slots of R tokens, L = P + g R, made once for
    each shape and device (the tensors of `like`, a fake mode's too) where its masks are small, as on a
    launch-bound GPU, whose step the few ops that make them would lengthen; a long one's (512 + 8 x 1024
    tokens: 2 x 76 MB) is made for each forward, whose own cost dwarfs theirs, rather than held for the
    run. Who may see whom, (L, L) bool (causal, no response slot seeing another's); the diagonal (a
    padding token sees itself: no empty row, whose softmax would be NaN); the positions whose logits
    score each slot's R tokens, (g R,): the prompt's last for the first, then the slot's own; and each
    position's slot (0: the prompt's, its row's) and column in its row's (P + R) block, (L,) each."""
    mode = torch._guards.detect_fake_mode(like)
    key = (P, g, R, like.device, id(mode))
    if key in _STRUCTURES:
        return _STRUCTURES[key]
    L, device = P + g * R, like.device
    j = torch.arange(L, device=device)
    seg = j.sub(P).div(R, rounding_mode="floor").add(1).clamp(min=0)  # (L,): 0 the prompt, k slot k
    structure = (j[None, :] <= j[:, None]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
    keep = (j[P:] - 1).view(g, R)
    keep[:, 0] = P - 1
    col = torch.where(seg == 0, j, P + (j - P) % R)  # its column in the row's block
    made = structure, j[:, None] == j[None, :], keep.flatten(), (seg - 1).clamp(min=0)[None], col
    if L * L <= KEPT_MASK:
        _STRUCTURES[key] = made
    return made


def plan(minibatches, ids, attn, n_response, rows_per_forward, d, packed=False, models=(), enabled=True,
         group_size=0):
    """The forwards of every pass over a rollout, cut once: for each mini-batch (a row of
    `minibatches`, indices into ids), its micro-batches, whether they pack (where that computes less,
    common.packing_pays, agreed by all ranks) and whether they share prompts (micro_batches, for every
    one of `models`; group_size: rows r and r' share one where r // group_size == r' // group_size, the
    rollout's groups): [(micro-batches, packed, shared)], shared False or each micro-batch's groups.
    The reference's, the rollout policy's and the teacher's log-probs and every update's forwards run
    over these same micro-batches. A row's log-probs depend, in their last float bits, on the rows it
    is computed with (the matmuls' and the attention's blocking over the batch and its padded length):
    in one layout, a model equal to the policy gives the policy's log-probs to the bit, so that the KL,
    its gradient and log rho are 0, not float noise that Adam would scale into lr-sized steps
    (tests/test_exact.py)."""
    groups = [r // group_size for r in range(len(ids))] if group_size else None
    out = []
    for rows in minibatches:
        pack = packed and common.packing_pays(models[0], attn[rows], rows_per_forward, d)
        chunks, shared = micro_batches(rows, ids, attn, n_response, rows_per_forward=rows_per_forward, d=d, packed=pack,
                                       models=models, enabled=enabled, groups=groups)
        out.append((chunks, pack, shared))
    return out


@torch.no_grad()
def planned_logprobs(model, ids, attn, n_response, plan, d, temperature=1.0, truncate=None, with_entropy=False):
    """Log-probs of the response block of every row that `plan` holds, (N, R) (and the entropies of its
    positions' distributions, with_entropy), each micro-batch through response_logprobs as `plan` cut
    it; no graph."""
    out = [torch.zeros(ids.shape[0], n_response, device=ids.device) for _ in range(1 + with_entropy)]
    for chunks, packed, shared in plan:
        for k, r in enumerate(chunks):
            with common.autocast(d):
                values = response_logprobs(model, ids[r], attn[r], n_response, temperature=temperature,
                                           with_entropy=with_entropy, truncate=truncate, packed=packed,
                                           shared=shared and shared[k])
            for o, v in zip(out, values if with_entropy else (values,)):
                o[r] = v.float()
    return tuple(out) if with_entropy else out[0]


def layout(batch, d, packed=False, models=(), enabled=True):
    """(packed, shared) for one forward of a whole batch (ids, attn, resp), DPO's chosen and rejected
    rows (rows i and B + i: pair i, one prompt): packed where that computes less (agreed by all ranks),
    sharing prompts where that computes less still (shared: each row's pair); one decision for every
    one of `models` (the policy and its reference), as `plan`'s."""
    ids, attn, resp = batch
    packed = packed and common.packing_pays(models[0], attn, len(ids), d)
    pairs = [i % (len(ids) // 2) for i in range(len(ids))]
    _, shared = micro_batches(torch.arange(len(ids), device=ids.device), ids, attn, resp.shape[1], rows_per_forward=len(ids),
                              d=d, packed=packed, models=models, enabled=enabled, groups=pairs)
    return packed, shared and shared[0]


def sequence_logprobs(model, batch, d, packed=False, shared=False):
    """log pi(y|x) summed over each row's response tokens, (B,), for a batch (ids, attn, resp) in one
    forward (DPO's chosen and rejected rows), in the layout `layout` chose."""
    ids, attn, resp = batch
    with common.autocast(d):
        logps = response_logprobs(model, ids, attn, resp.shape[1], packed=packed, shared=shared)  # (B, R)
    return (logps.float() * resp).sum(-1)


# -----------------------------------------------------------------------------
# decoding: a rollout's G samples of a prompt attend to its keys and values kept once (sampling.generate)


def runs(model, prompt_ids, prompt_mask):
    """G where decoding can keep each prompt's keys and values once, else 0: the rows come in runs of
    G >= 2 equal prompts (GRPO's layout), every layer is full attention in a static cache, and the
    attention is SDPA or eager without softcapping (what `attention` computes), in transformers' own
    modules of a text model, which look their attention function up by the config's name (`decoding`
    switches it; a module of remote code, or one reading a sub-config's name, would not see it)."""
    B, rows = prompt_ids.shape[0], torch.cat([prompt_ids, prompt_mask], 1)
    G = int((rows == rows[:1]).all(-1).cumprod(0).sum())  # the first prompt's run
    if G < 2 or B % G or not bool((rows.view(B // G, G, -1) == rows[::G, None]).all()):
        return 0
    config = model.config.get_text_config()
    if (config is not model.config or config._attn_implementation not in ("sdpa", "eager")
            or getattr(config, "attn_logit_softcapping", None)
            or not all(type(m).__module__.startswith("transformers.models.") for m in model.modules()
                       if hasattr(m, "layer_idx"))):
        return 0
    layers = transformers.StaticCache(config=model.config, max_cache_len=1).layers
    return G if all(type(layer) is StaticLayer for layer in layers) else 0


class PromptKV:
    """The keys and values of U prompts, each kept once for its G consecutive rows: keys[i], values[i]
    (U, H_kv, P, D) of layer i, mask (U, P) their real tokens; `responses`, the static cache of the
    B = U x G rows' response tokens, whose slots up to the last written are all seen unless
    `response_mask` (B, slots) says which (the tool loop's: a row waiting for a result skips a slot)."""

    def __init__(self, keys, values, mask, responses):
        self.keys, self.values, self.mask, self.responses = keys, values, mask, responses
        self.response_mask = None


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, prompts=None, **kwargs):
    """Decode attention (a query token a row) over each prompt's keys and values kept once for its G
    rows, then each row's own response slots (cascade attention, FlashInfer's name for it): the
    softmax of attention over B whole rows, without reading each prompt's keys G times (a decode
    step's attention is bound by reading the cache on CPU: `python -m bench rollout`). transformers calls it
    as an attention function, `prompts` (PromptKV) passed through the model's keyword arguments.
    query (B, H, 1, D); key, value (B, H_kv, S, D): the responses' static cache, whose slots past
    the tokens written are masked here."""
    if dropout or kwargs.get("softcap") or kwargs.get("sliding_window") or "s_aux" in kwargs:
        raise ValueError("shared_prompt.attention: no dropout, softcapping, sliding window or attention sinks")
    pk, pv = prompts.keys[module.layer_idx], prompts.values[module.layer_idx]
    (U, Hkv, P, D), (B, H, S) = pk.shape, (query.shape[0], query.shape[1], key.shape[2])
    G, r = B // U, H // Hkv  # rows a prompt, query heads a key/value head (GQA)
    q = query.view(U, G, Hkv, r, D).transpose(1, 2).reshape(U, Hkv, G * r, D)  # a prompt's rows: one matmul
    s_prompt = (q @ pk.transpose(-1, -2)).view(U, Hkv, G, r, P).transpose(1, 2).reshape(B, H, 1, P)
    s_response = (query.view(B, Hkv, r, D) @ key.transpose(-1, -2)).view(B, H, 1, S)
    n = prompts.responses.layers[module.layer_idx].cumulative_length  # response tokens written, this one too
    seen = (torch.arange(S, device=n.device) < n if prompts.response_mask is None  # the slots written so far
            else prompts.response_mask.bool())  # the tool loop's, set slot by slot (a waiting row's left empty)
    real = torch.cat([prompts.mask[:, None].expand(U, G, P).reshape(B, P), seen.expand(B, S)], -1)  # (B, P + S)
    p = (torch.cat([s_prompt, s_response], -1) * scaling).masked_fill(~real[:, None, None], float("-inf")).softmax(-1)
    p_prompt = p[..., :P].reshape(U, G, Hkv, r, P).transpose(1, 2).reshape(U, Hkv, G * r, P)
    out = ((p_prompt @ pv).view(U, Hkv, G, r, D).transpose(1, 2).reshape(B, H, 1, D)
           + (p[..., P:].view(B, Hkv, r, S) @ value).view(B, H, 1, D))
    return out.transpose(1, 2), None  # (B, 1, H, D), as transformers' attention functions return it


transformers.AttentionInterface.register("shared_prompt", attention)


@contextlib.contextmanager
def decoding(model, shared=True):
    """The model's attention switched to `attention` (shared=False: left as it is)."""
    if not shared:
        yield
        return
    config = model.config
    before, config._attn_implementation = config._attn_implementation, "shared_prompt"
    try:
        yield
    finally:
        config._attn_implementation = before
