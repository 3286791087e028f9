"""tool_rollout.py: the token layout of a rollout with tool calls on a hand case (written tokens,
the tool's result tokens, resumed tokens; masks, log-probs, the exact tokens each turn continues
from, the random numbers' columns), and a policy that never calls the tool giving exactly
sampling.generate's rollout."""
import pytest
import torch
from transformers import GPT2LMHeadModel

import common
import sampling
import tasks
import tool_rollout
import tools


def tool_tokenizer():
    tok = tasks.char_tokenizer()
    tok.add_tokens([tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE])
    return tok


def test_a_call_is_answered_in_tokens_masked_out_and_the_row_resumes_from_its_exact_tokens(monkeypatch):
    """Two rows; the sampler is scripted. Turn 1: row 0 writes a calculator call, row 1 answers
    and stops. Turn 2: row 0 alone continues from prompt + its call + the result tokens, and
    answers. Every id is checked against an independent layout built here."""
    tok = tool_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    call, answer0, answer1 = enc("<tool_call>12*3</tool_call>"), enc("so 36") + [eos], enc("9") + [eos]
    result = enc("<tool_result>36</tool_result>")
    prompts = [enc("a ="), enc("b c =")]
    script = [{0: call, 1: answer1}, {0: answer0}]
    seen = []

    def scripted(model, ids, mask, n, eos_id, pad_id, stop_ids=(), uniforms=None, return_logprobs=False, **kw):
        turn = script[len(seen)]
        rows = [ids[k][mask[k].bool()].tolist() for k in range(ids.shape[0])]
        seen.append((rows, uniforms.clone(), n))
        which = [0, 1] if len(seen) == 1 else [0]
        outs = [turn[i] for i in which]
        r_ids, r_mask = common.pad(outs, pad_id)
        logps = torch.arange(1, r_ids.numel() + 1, dtype=torch.float).view(r_ids.shape) / -100 * r_mask
        return r_ids, r_mask, logps

    monkeypatch.setattr(tool_rollout.sampling, "generate", scripted)
    ids, mask = common.pad(prompts, pad, side="left")
    u = torch.rand(2, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r_ids, r_mask, r_logps, tool_mask = tool_rollout.generate_with_tools(
        None, ids, mask, 40, eos_id=eos, pad_id=pad, tokenizer=tok, tool=tools.calculator, uniforms=u)
    row0 = call + result + answer0
    assert r_ids[0, :len(row0)].tolist() == row0 and r_mask[0].tolist() == [1] * len(row0) + [0] * (r_ids.shape[1] - len(row0))
    assert r_ids[1, :len(answer1)].tolist() == answer1 and r_mask[1].sum() == len(answer1)
    want_tool = [0] * len(call) + [1] * len(result) + [0] * len(answer0)
    assert tool_mask[0, :len(row0)].tolist() == want_tool and tool_mask[1].sum() == 0
    assert (r_logps[0][tool_mask[0].bool()] == 0).all() and (r_logps[0, :len(call)] < 0).all()
    assert tool_rollout.tool_calls(tool_mask).tolist() == [1, 0]
    # turn 2 continues row 0 from its exact tokens (never re-tokenised), with the uniforms of its
    # next response positions
    (rows1, u1, n1), (rows2, u2, n2) = seen
    assert rows1 == prompts and rows2 == [prompts[0] + call + result]
    assert torch.equal(u2[0], u[0, len(call) + len(result):len(call) + len(result) + n2])
    assert n2 == 40 - len(call) - len(result)


def test_a_policy_that_never_calls_the_tool_gives_exactly_the_samplers_rollout():
    """The closing tag's logit pushed to -inf (a hook on the head, for both sides): sampled with
    the same uniforms, the tool rollout equals sampling.generate's, ids, mask and log-probs, with
    no tool token and no call."""
    tok = tool_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2)).eval()
    close = tool_rollout.closing_tag_id(tok)
    model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([close]), float("-inf")))
    prompts = [tok.encode(p) for p in ("sort 3 1 =", "sort 9 =", "x")]
    ids, mask = common.pad(prompts, tok.pad_token_id, side="left")
    u = sampling.rollout_uniforms(3, 12, seed=1)
    want = sampling.generate(model, ids, mask, 12, tok.eos_token_id, tok.pad_token_id, uniforms=u,
                             return_logprobs=True)
    got = tool_rollout.generate_with_tools(model, ids, mask, 12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                           tokenizer=tok, tool=tools.calculator, uniforms=u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[3].sum() == 0


def test_a_closing_tag_of_several_tokens_is_refused():
    with pytest.raises(ValueError, match="add the tags"):
        tool_rollout.closing_tag_id(tasks.char_tokenizer())
