"""Rollouts in which the policy calls a tool (grpo.py --tools, environment.rollout). The sampler
stops a row at the closing tag of a call, the tool runs on the text the row wrote since the last
opening tag (the calls of one turn at once, in the tool's worker processes: tools.call_tools),
its result goes in as tokens of a result tag pair, and the row continues from its
exact tokens (what the model wrote is never re-tokenised), until it ends its turn, has made
max_calls calls, or has max_new_tokens response tokens in all. The result's tokens are returned
masked (`tool_mask`): no log-prob, no loss, no KL, no importance ratio of the policy's is taken
on them.

Under FSDP call it inside `common.evaluating(model, gather=True)`, like sampling.generate: the
weights are gathered once, no collective runs while decoding, so ranks whose rows call the tool
a different number of times never wait for each other.
"""
import functools

import torch

import common
import sampling
import tools


def closing_tag_id(tokenizer, flag="--tools"):
    """The id of tools.CALL_CLOSE, which must be one token (Qwen2.5's tokenizer has it; for others
    add the tag pairs as tokens, tokenizer.add_tokens, and resize the embeddings) so that the
    sampler can stop at it like at an end-of-turn id."""
    ids = tokenizer.encode(tools.CALL_CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{flag}: {tools.CALL_CLOSE!r} is {len(ids)} tokens for this tokenizer: add the tags "
                         f"({tools.CALL_OPEN}, {tools.CALL_CLOSE}, {tools.RESULT_OPEN}, {tools.RESULT_CLOSE}) as tokens")
    return ids[0]


@functools.lru_cache(maxsize=16)
def longest_token(tokenizer, vocab_size):
    """The most characters one token of the tokenizer stands for (its longest vocabulary entry: a
    byte-level entry has one character per byte, so at least as many as it decodes to); cached
    per tokenizer and vocabulary size, since a 150k vocabulary takes tens of ms to list."""
    return max(map(len, tokenizer.get_vocab()))


def call_text(tokenizer, written_ids):
    """The text of a row's last call: what the row wrote after its last opening tag, closing tag
    left out."""
    text = tokenizer.decode(written_ids)
    return text.rsplit(tools.CALL_OPEN, 1)[-1].replace(tools.CALL_CLOSE, "").strip()


def results_tokens(tokenizer, written, tool, rooms):
    """The tokens of the result tag pair of each row's last call (written: each row's own tokens),
    at most rooms[k] of them: the tool runs on call_text of every row at once (tools.call_tools;
    an error text if it fails or overruns), its text cut, before it is tokenized, to the
    characters rooms[k] tokens can hold (longest_token each), so a tool that returns 10 MB costs
    no more than one that returns what fits."""
    if not written:
        return []
    width = longest_token(tokenizer, len(tokenizer))
    texts = [call_text(tokenizer, ids) for ids in written]
    replies = tools.call_tools(tool, texts, max_chars=max(rooms) * width)
    return [tokenizer.encode(tools.RESULT_OPEN + reply[:room * width] + tools.RESULT_CLOSE,
                             add_special_tokens=False)[:room] for reply, room in zip(replies, rooms)]


def result_tokens(tokenizer, written_ids, tool, room=None):
    """The tokens of the result tag pair for one row's last call: results_tokens for one row,
    room: the tokens the row has left (None: no limit)."""
    if room is None:
        return tokenizer.encode(tools.RESULT_OPEN + tools.call_tool(tool, call_text(tokenizer, written_ids))
                                + tools.RESULT_CLOSE, add_special_tokens=False)
    return results_tokens(tokenizer, [written_ids], tool, [room])[0]


@torch.no_grad()
def generate_with_tools(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, tokenizer, tool,
                        stop_ids=(), max_calls=2, uniforms=None, **sampler_kw):
    """sampling.generate with tool calls: returns ids (B, R), mask (B, R) of every response token
    (the model's and the tools'), the model's log-probs (B, R) (0 on tool tokens) and tool_mask (B, R)
    (1 on tool tokens; a call's count: tool_calls(tool_mask)). uniforms (B, >= max_new_tokens): column t for
    response token t, whichever turn writes it, so a row samples the same on any number of ranks."""
    close = closing_tag_id(tokenizer)
    B, device = prompt_ids.shape[0], prompt_ids.device
    rows = [[] for _ in range(B)]  # per row: (token, is_tool, log-prob)
    calls = [0] * B
    active = list(range(B))
    prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in range(B)]
    if uniforms is not None:  # a turn samples max(budget) tokens for every row and keeps each row's budget
        uniforms = torch.nn.functional.pad(uniforms[:, :max_new_tokens], (0, max_new_tokens), value=0.5)
    while active:
        budget = [max_new_tokens - len(rows[i]) for i in active]
        ids, mask = common.pad([prompts[i] + [t for t, _, _ in rows[i]] for i in active], pad_id, side="left")
        u = None
        if uniforms is not None:  # the columns from each row's next response position on
            u = torch.stack([uniforms[i, len(rows[i]):len(rows[i]) + max(budget)] for i in active])
        r_ids, r_mask, r_logps = sampling.generate(
            model, ids.to(device), mask.to(device), max(budget), eos_id=eos_id, pad_id=pad_id,
            stop_ids=(*stop_ids, close), uniforms=u, return_logprobs=True, **sampler_kw)
        r_ids, r_mask, r_logps = r_ids.tolist(), r_mask.tolist(), r_logps.tolist()  # once per turn
        calling = []  # the rows whose turn ended in a call they may make, and the tokens they have left
        for k, i in enumerate(active):
            n = min(sum(r_mask[k]), budget[k])
            rows[i] += [(t, False, lp) for t, lp in zip(r_ids[k][:n], r_logps[k][:n])]
            room = max_new_tokens - len(rows[i])
            if n and r_ids[k][n - 1] == close and calls[i] < max_calls and room > 0:
                calls[i] += 1
                calling.append((i, room))
        written = [[t for t, is_tool, _ in rows[i] if not is_tool] for i, _ in calling]
        for (i, _), result in zip(calling, results_tokens(tokenizer, written, tool, [room for _, room in calling])):
            rows[i] += [(t, True, 0.0) for t in result]
        active = [i for i, _ in calling if len(rows[i]) < max_new_tokens]
    R = max(len(r) for r in rows)
    pad = [[(pad_id, False, 0.0, 0)] * (R - len(r)) for r in rows]  # (token, is_tool, log-prob, in the response)
    full = [[(t, is_tool, lp, 1) for t, is_tool, lp in r] + p for r, p in zip(rows, pad)]
    column = lambda j, dtype: torch.tensor([[x[j] for x in r] for r in full], dtype=dtype, device=device)  # noqa: E731
    return column(0, torch.long), column(3, torch.long), column(2, torch.float), column(1, torch.long)


def tool_calls(tool_mask):
    """The calls each row made, (B,): its runs of tool tokens (a result follows every call)."""
    return (tool_mask.diff(dim=1, prepend=tool_mask[:, :1] * 0) == 1).sum(-1)
