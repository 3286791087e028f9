"""Log-probs of rows that share their prompt (GRPO's group of G samples, DPO's chosen and rejected),
each distinct prompt computed once: its keys and values serve every row that shares it, as the
rollout's prefill does (sampling._prefill). A forward of B rows of P + R tokens from U prompts then
computes U x P + B x R tokens instead of B x (P + R): for 4 prompts x G = 8 of 128 + 32 tokens,
1,536 instead of 5,120; for 8 DPO pairs, 1,536 instead of 2,560.

The same products as common.response_logprobs' padded forward: the prompt's positions see the same
prompt tokens, the response's the prompt's keys and values and their own; only float sums run in
another order (fp32: ~1e-6 on random weights). With a gradient, the cache's keys and values carry it
back to the prompt's positions through the same index, summed over the rows that share it, as the
padded forward's sum over their copies (tests/test_shared_prompt.py).
"""
from contextlib import nullcontext

import torch
from transformers.cache_utils import DynamicLayer

import common


def response_logprobs(model, input_ids, attention_mask, n_response, temperature=1.0, with_entropy=False,
                      entropy_grad=False, truncate=None, packed=False, d=common.Dist()):
    """common.response_logprobs' (B, R) log-probs (and entropies: detached unless entropy_grad), the
    prompts (the first T - n_response columns, left-padded) computed once each. common.response_logprobs
    itself (packed or not) where no two rows share a prompt, under torchrun (every rank must run as
    many forwards: FSDP's are collective, and whether a rank's rows share prompts is its own), under
    activation checkpointing (transformers turns the cache off) and for caches that are not plain
    (sliding-window layers)."""
    P, R = input_ids.shape[1] - n_response, n_response

    def whole():
        return common.response_logprobs(model, input_ids, attention_mask, R, temperature=temperature,
                                        with_entropy=with_entropy, entropy_grad=entropy_grad, truncate=truncate,
                                        packed=packed)

    if d.world_size > 1 or P == 0 or getattr(model, "is_activation_checkpointing", False):
        return whole()
    p_rows, inverse = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True)
    if len(p_rows) == len(input_ids):
        return whole()
    # 1. each distinct prompt once: its last position's logits (the first response token's) and its cache
    ids, mask = p_rows[:, :P], p_rows[:, P:]  # (U, P)
    keep = dict(logits_to_keep=1) if common._accepts(model, "logits_to_keep") else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True,
                **keep)
    if not all(type(layer) is DynamicLayer for layer in out.cache.layers):
        return whole()
    logits = out.logits[:, -1:][inverse]  # (B, 1, V)
    # 2. every row's response after its prompt's keys and values: positions P .. P + R - 2 predict tokens 2 .. R
    if R > 1:
        for layer in out.cache.layers:  # (U, h, P, D) -> (B, h, P, D)
            layer.keys, layer.values = layer.keys[inverse], layer.values[inverse]
        pos = common.position_ids_from_mask(attention_mask)[:, P:-1]  # (B, R - 1)
        rest = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=pos,
                     cache=out.cache, use_cache=True).logits  # (B, R - 1, V)
        logits = torch.cat([logits, rest], 1)  # (B, R, V)
    del out
    if temperature != 1.0:
        logits = logits / temperature
    labels = input_ids[:, P:]
    logps = common.logprobs_from_logits(logits if truncate is None else truncate(logits, labels), labels)
    if not with_entropy:
        return logps
    with nullcontext() if entropy_grad else torch.no_grad():
        return logps, common.entropy_from_logits(logits)


@torch.no_grad()
def batched_logprobs(model, ids, attn, n_response, temperature, d, rows_per_forward, with_entropy=False, truncate=None,
                     packed=False):
    """common.batched_logprobs, each micro-batch through response_logprobs above: (N, R) log-probs
    (and entropies), no graph."""
    out = []
    for r in common.micro_batches(torch.arange(ids.shape[0], device=ids.device), attn, rows_per_forward, d, packed):
        with common.autocast(d):
            out.append(response_logprobs(model, ids[r], attn[r], n_response, temperature=temperature,
                                         with_entropy=with_entropy, truncate=truncate, packed=packed, d=d))
    if with_entropy:
        return tuple(torch.cat([o[j] for o in out]).float() for j in (0, 1))
    return torch.cat(out).float()


def sequence_logprobs(model, batch, d, packed=False):
    """common.sequence_logprobs through response_logprobs above: log pi(y|x) summed over each row's
    response tokens, (B,), for a batch (ids, attn, resp)."""
    ids, attn, resp = batch
    with common.autocast(d):
        logps = response_logprobs(model, ids, attn, resp.shape[1], packed=packed, d=d)  # (B, R)
    return (logps.float() * resp).sum(-1)
