"""Log-probs of rows that share their prompt (GRPO's group of G samples, DPO's chosen and rejected),
each distinct prompt computed once: its keys and values serve every row that shares it, as the
rollout's prefill does (sampling._prefill). A forward of B rows of P + R tokens from U prompts then
computes U x P + B x R tokens instead of B x (P + R): for 4 prompts x G = 8 of 128 + 32 tokens,
1,536 instead of 5,120; for 8 DPO pairs, 1,536 instead of 2,560. Decoding (sampling's generate and
tool loop, compiled on CPU) keeps a rollout's prompts once the same way: `attention` reads each
prompt's keys and values once for its G samples instead of from a copy in each row's cache.

The same products as common.response_logprobs' padded forward: the prompt's positions see the same
prompt tokens, the response's the prompt's keys and values and their own; only float sums run in
another order (fp32: ~1e-6 on random weights). With a gradient, the cache's keys and values carry it
back to the prompt's positions through the same index, summed over the rows that share it, as the
padded forward's sum over their copies (tests/test_shared_prompt.py).

Memory: a shared forward holds at most a padded micro-batch's rows (micro_batches cuts by rows even
where --padding_free would cut by tokens), so each of its terms is at most the padded one's: U x P +
B x R tokens' activations, B x R logits (never concatenated: the first position's log-probs and the
rest's are computed apart), and B x (P + R) cached keys and values, which the padded forward keeps for
its backward too. Without a gradient (the reference pass) the cache of every layer lives to the
forward's end: B x (P + R) x layers, at most the rollout's cache of all its rows (unless
--generation_micro_batch_size cuts the rollout finer than the micro-batch; bench/memory.py counts it).
Not bitwise the padded path's (float order): a pass whose log-probs are compared token by token with
another model's (grpo.py's old policy against its teacher) keeps to common's, so that both take one
path whatever each model's activation checkpointing (tests/test_grpo.py).
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
    """Whether a forward can share prompts: a prompt block, no activation checkpointing (transformers
    turns the cache off under it)."""
    return n_prompt > 0 and not getattr(model, "is_activation_checkpointing", False)


def _possible(model, n_prompt, d):
    """_shareable, in one process: every FSDP rank must run as many forwards, and whether a rank's rows
    share prompts is its own."""
    return d.world_size == 1 and _shareable(model, n_prompt)


def prompts(ids, attn, n_prompt):
    """The distinct prompts (the first n_prompt columns, ids then mask), (U, 2 n_prompt), and each
    row's among them, (B,): rows with one prompt share it."""
    return torch.unique(torch.cat([ids[:, :n_prompt], attn[:, :n_prompt]], 1), dim=0, return_inverse=True)


def micro_batches(rows, ids, attn, n_response, rows_per_forward, d, packed=False, model=None, enabled=True):
    """(micro-batches, shared): common.micro_batches' cut (packed: by tokens), or, where computing each
    distinct prompt once computes fewer FLOPs, micro-batches of rows_per_forward rows (never more rows
    than a padded micro-batch, whatever packing would fit: its memory) with shared = True, for
    response_logprobs(shared=True). A micro-batch of rows of distinct prompts counts as its padded or
    packed forward, which it then takes. A few host syncs (the rows' lengths and prompts) a pass."""
    P, R = ids.shape[1] - n_response, n_response
    cut = common.micro_batches(rows, attn, rows_per_forward, d, packed)
    if not enabled or model is None or not _possible(model, P, d):
        return cut, False
    T, w = ids.shape[1], 1 / (6 * model.config.get_text_config().hidden_size)
    lengths, prompt = attn[rows].sum(-1).tolist(), prompts(ids[rows], attn[rows], P)[1].tolist()  # per row of `rows`
    per_row = "flash" in str(model.config._attn_implementation) or model.config._attn_implementation == "sdpa_packed"

    def alone(a, b):  # common.response_logprobs' FLOPs for rows[a:b]: padded, or packed (N x N pairs under SDPA)
        if not packed:
            return _flops((b - a) * T, T, w)
        n = lengths[a:b]
        return sum(_flops(x, x, w) for x in n) if per_row else _flops(sum(n), sum(n), w)

    def shared(a, b):
        U = len(set(prompt[a:b]))
        return alone(a, b) if U == b - a else _flops(U * P, P, w) + _flops((b - a) * R, T, w)

    def spans(chunks):  # each micro-batch's (first, end) in `rows`: they cut it in order
        ends = list(itertools.accumulate(len(c) for c in chunks))
        return zip([0] + ends[:-1], ends)

    by_rows = common.micro_batches(rows, attn, rows_per_forward, d)
    if sum(shared(a, b) for a, b in spans(by_rows)) < sum(alone(a, b) for a, b in spans(cut)):
        return by_rows, True
    return cut, False


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False,
                      entropy_grad=False, truncate=None, packed=False, shared=False):
    """common.response_logprobs' (B, R) log-probs (and entropies: detached unless entropy_grad), the
    prompts (the first T - n_response columns, left-padded) computed once each where shared (the rows
    cut by micro_batches for it: at most a padded micro-batch's; it says shared only in one process).
    common.response_logprobs itself (packed or not) where not shared, where no two rows share a
    prompt, under activation checkpointing and for caches that are not plain (sliding-window layers)."""
    P, R = input_ids.shape[1] - n_response, n_response

    def whole():
        return common.response_logprobs(model, input_ids, attention_mask, R, temperature=temperature,
                                        with_entropy=with_entropy, entropy_grad=entropy_grad, truncate=truncate,
                                        packed=packed)

    if not shared or not _shareable(model, P):
        return whole()
    p_rows, inverse = prompts(input_ids, attention_mask, P)
    if len(p_rows) == len(input_ids):
        return whole()
    # 1. each distinct prompt once: its last position's logits (the first response token's) and its cache
    ids, mask = p_rows[:, :P], p_rows[:, P:]  # (U, P)
    keep = dict(logits_to_keep=1) if common._accepts(model, "logits_to_keep") else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True,
                **keep)
    if not all(type(layer) is DynamicLayer for layer in out.cache.layers):
        return whole()
    logits = [out.logits[:, -1:][inverse]]  # (B, 1, V)
    # 2. every row's response after its prompt's keys and values: positions P .. P + R - 2 predict tokens 2 .. R
    if R > 1:
        for layer in out.cache.layers:  # (U, h, P, D) -> (B, h, P, D)
            layer.keys, layer.values = layer.keys[inverse], layer.values[inverse]
        pos = common.position_ids_from_mask(attention_mask)[:, P:-1]  # (B, R - 1)
        logits.append(model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=pos,
                            cache=out.cache, use_cache=True).logits)  # (B, R - 1, V)
    del out
    # each part's log-probs and entropies apart, then joined: (B, R) each, no (B, R, V) copy of the logits
    labels = input_ids[:, P:].split([1, R - 1], 1)[:len(logits)]
    logits = [x / temperature for x in logits] if temperature != 1.0 else logits
    logps = torch.cat([common.logprobs_from_logits(x if truncate is None else truncate(x, y), y)
                       for x, y in zip(logits, labels)], 1)  # (B, R)
    if not with_entropy:
        return logps
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        return logps, torch.cat([common.entropy_from_logits(x) for x in logits], 1)


@torch.no_grad()
def batched_logprobs(model, ids, attn, n_response, temperature, d, rows_per_forward, with_entropy=False, truncate=None,
                     packed=False, enabled=True):
    """common.batched_logprobs, each micro-batch through response_logprobs above (micro_batches above
    decides where prompts are shared): (N, R) log-probs (and entropies), no graph."""
    out, packed = [], packed and common.packing_pays(model, attn, rows_per_forward, d)
    chunks, shared = micro_batches(torch.arange(ids.shape[0], device=ids.device), ids, attn, n_response,
                                   rows_per_forward, d=d, packed=packed, model=model, enabled=enabled)
    for r in chunks:
        with common.autocast(d):
            out.append(response_logprobs(model, ids[r], attn[r], n_response, temperature=temperature,
                                         with_entropy=with_entropy, truncate=truncate, packed=packed, shared=shared))
    if with_entropy:
        return tuple(torch.cat([o[j] for o in out]).float() for j in (0, 1))
    return torch.cat(out).float()


def sequence_logprobs(model, batch, d, packed=False, enabled=True):
    """common.sequence_logprobs (one forward of the batch, DPO's chosen and rejected rows) through
    response_logprobs above where micro_batches above finds sharing computes less: log pi(y|x) summed
    over each row's response tokens, (B,), for a batch (ids, attn, resp)."""
    ids, attn, resp = batch
    packed = packed and common.packing_pays(model, attn, len(ids))
    _, shared = micro_batches(torch.arange(len(ids), device=ids.device), ids, attn, resp.shape[1], len(ids), d=d,
                              packed=packed, model=model, enabled=enabled)
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
    step's attention is bound by reading the cache on CPU: bench/sampler.py). transformers calls it
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
