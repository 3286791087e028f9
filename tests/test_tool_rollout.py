"""sampling.generate_with_tools: the token layout of a rollout with tool calls on a hand case (written tokens,
the tool's result tokens, resumed tokens; masks, log-probs, the exact tokens the model is fed; the random
numbers' columns: tests/test_tool_cache.py), and a policy that never calls the tool giving exactly
sampling.generate's rollout."""
import json

import pytest
import torch
from helpers import read_metrics, run_here
from transformers import GPT2LMHeadModel

import common
import sampling
import kv_cache
import tasks
import tools


def tool_tokenizer():
    tok = tasks.char_tokenizer()
    tok.add_tokens([tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE])
    return tok


def scripted_policy(monkeypatch, writes, tok):
    """The model replaced by a script (sampling._prefill and sampling._next_logits, so the loop runs as
    it is): row b writes writes[b], its own tokens, whatever the tool's results put between them,
    then EOS; one-hot logits (0 on the token, -2 elsewhere: a log-prob below 0), to sample greedily.
    A row's own tokens are what it was fed after its prompt less the result tag spans. Returns the
    model to pass (a stand-in) and each row's tokens as fed, prompt first: what the model saw."""
    opener, closer = tok.convert_tokens_to_ids([tools.RESULT_OPEN, tools.RESULT_CLOSE])
    fed, at = [], []  # per row: its tokens as fed; at: [prompt width P, steps run]

    def logits():
        out = torch.full((len(fed), len(tok)), -2.0)
        for b, row in enumerate(fed):
            own, inside = [], False
            for x in row[len(prompts[b]):]:
                inside = (inside or x == opener) and x != closer
                if not inside and x != closer:
                    own.append(x)
            out[b, writes[b][len(own)] if len(own) < len(writes[b]) else tok.eos_token_id] = 0.0
        return out

    def prefill(model, prompt_ids, prompt_mask, max_new_tokens, compile, kw, reserve):
        prompts[:] = [r[m.bool()].tolist() for r, m in zip(prompt_ids, prompt_mask)]
        fed[:] = [list(r) for r in prompts]
        at[:] = [prompt_ids.shape[1], 0]
        L = prompt_ids.shape[1] + max_new_tokens
        return logits(), None, kv_cache.Rows(len(fed), L, L, prompt_ids.device), None

    def step(model, tok_, mask, pos, cache, kw):
        slot = at[0] + at[1]
        at[1] += 1
        for b in range(len(fed)):
            if mask[b, slot]:  # a row's token, not an idle slot
                fed[b].append(int(tok_[b, 0]))
        return logits()

    prompts = []
    monkeypatch.setattr(sampling, "_prefill", prefill)
    monkeypatch.setattr(sampling, "_next_logits", step)
    return torch.nn.Identity(), fed


def test_a_call_is_answered_in_tokens_masked_out_and_the_row_resumes_from_its_exact_tokens(monkeypatch):
    """Two rows; the policy is scripted. Row 0 writes a calculator call, is fed the result, and
    answers; row 1 answers at once and stops. Row 0 goes on from prompt + its call + the result
    tokens, its exact tokens (never re-tokenised). Every id is checked against an independent
    layout built here."""
    tok = tool_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    call, answer0, answer1 = enc("<tool_call>12*3</tool_call>"), enc("so 36") + [eos], enc("9") + [eos]
    result = enc("<tool_result>36</tool_result>")
    prompts = [enc("a ="), enc("b c =")]
    model, fed = scripted_policy(monkeypatch, [call + answer0, answer1], tok)
    ids, mask = common.pad(prompts, pad, side="left")
    r_ids, r_mask, r_logps, tool_mask = sampling.generate_with_tools(
        model, ids, mask, 40, eos_id=eos, pad_id=pad, tokenizer=tok, tool=tools.calculator, temperature=0.0)
    row0 = call + result + answer0
    assert r_ids[0, :len(row0)].tolist() == row0 and r_mask[0].tolist() == [1] * len(row0) + [0] * (r_ids.shape[1] - len(row0))
    assert r_ids[1, :len(answer1)].tolist() == answer1 and r_mask[1].sum() == len(answer1)
    want_tool = [0] * len(call) + [1] * len(result) + [0] * len(answer0)
    assert tool_mask[0, :len(row0)].tolist() == want_tool and tool_mask[1].sum() == 0
    assert (r_logps[0][tool_mask[0].bool()] == 0).all() and (r_logps[0][r_mask[0].bool() & ~tool_mask[0].bool()] < 0).all()
    assert sampling.tool_calls(tool_mask).tolist() == [1, 0]
    # what the model was fed: row 0 its prompt, call, result and answer but the last token (which ends it)
    assert fed[0] == prompts[0] + row0[:-1], tok.decode(fed[0])


def test_a_policy_that_never_calls_the_tool_gives_exactly_the_samplers_rollout():
    """The closing tag's logit pushed to -inf (a hook on the head, for both sides): sampled with
    the same uniforms, the tool rollout equals sampling.generate's, ids, mask and log-probs, with
    no tool token and no call."""
    tok = tool_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2)).eval()
    close = tools.closing_tag_id(tok)
    model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([close]), float("-inf")))
    prompts = [tok.encode(p) for p in ("sort 3 1 =", "sort 9 =", "x")]
    ids, mask = common.pad(prompts, tok.pad_token_id, side="left")
    u = sampling.rollout_uniforms(3, 12, seed=1)
    want = sampling.generate(model, ids, mask, 12, tok.eos_token_id, tok.pad_token_id, uniforms=u,
                             return_logprobs=True)
    got = sampling.generate_with_tools(model, ids, mask, 12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                           tokenizer=tok, tool=tools.calculator, uniforms=u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[3].sum() == 0


def test_a_row_gets_max_calls_results_each_of_its_own_last_call(monkeypatch):
    """A scripted policy whose row 0 makes 3 calls of distinct values (12*3, 5*7, 11*13) and row 1
    one (2+9), max_calls 2: row 0 gets exactly 2 results, 36 and then 35 (the second call's own
    text: what follows the row's last opening tag), and ends at its third call, unanswered; row 1
    gets 11 and answers. Planted bugs: `calls < max_calls + 1` (a third result) and the text after
    the row's first opening tag (the second result an error text): each fails."""
    tok = tool_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call = lambda e: enc(f"{tools.CALL_OPEN}{e}{tools.CALL_CLOSE}")  # noqa: E731
    result = lambda v: enc(f"{tools.RESULT_OPEN}{v}{tools.RESULT_CLOSE}")  # noqa: E731
    answer = enc("so 11") + [tok.eos_token_id]
    writes = [call("12*3") + call("5*7") + call("11*13") + enc("more") + [tok.eos_token_id], call("2+9") + answer]
    model, _ = scripted_policy(monkeypatch, writes, tok)
    ids, mask = common.pad([enc("a ="), enc("b =")], tok.pad_token_id, side="left")
    r_ids, r_mask, r_logps, tool_mask = sampling.generate_with_tools(
        model, ids, mask, 60, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, tokenizer=tok, tool=tools.calculator,
        max_calls=2, temperature=0.0)
    rows = [call("12*3") + result(36) + call("5*7") + result(35) + call("11*13"), call("2+9") + result(11) + answer]
    for k, row in enumerate(rows):
        assert r_ids[k, :len(row)].tolist() == row and r_mask[k].sum() == len(row), tok.decode(r_ids[k])
    assert sampling.tool_calls(tool_mask).tolist() == [2, 1]
    results = [tok.decode(r_ids[0][tool_mask[0].bool()])]
    assert results == [f"{tools.RESULT_OPEN}36{tools.RESULT_CLOSE}{tools.RESULT_OPEN}35{tools.RESULT_CLOSE}"]


def forced_gpt2(folder, prompt_len, text, context=80):
    """A GPT-2 of the character tokenizer with the tag pairs as tokens that writes `text` and then
    EOS after any prompt of prompt_len tokens, whatever it is given: the output at position p is
    the token at position p + 1 of prompt + text, read from the position alone (a one-hot position
    embedding, no token embedding, the blocks' outputs zeroed), so each response token sits at its
    position in `text` only while the results the tool put in are the ones `text` holds."""
    tok = tool_tokenizer()
    script = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    width = context  # the positions and the hidden width: one-hot positions
    model = GPT2LMHeadModel(tasks.char_gpt2_config(tok, n_layer=1, n_embd=width, n_head=1, n_positions=width,
                                                   tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wpe.weight.copy_(torch.eye(width))
        model.transformer.ln_f.weight.fill_(1.0)
        for p in range(prompt_len - 1, width):
            k = p - prompt_len + 1
            model.lm_head.weight[script[k] if k < len(script) else tok.eos_token_id, p] = 30.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_grpo_rollouts_answer_two_calls_of_three_with_each_calls_own_value(tmp_path, monkeypatch):
    """grpo.py --tools calculator --max_tool_calls 2 on a policy forced to write three calls
    (12*3, 5*7, 11*13), each after the result it expects: every rollout row is exactly call, 36,
    call, 35, third call, and the step logs 2 calls per answer. Through the
    script, the same planted bugs fail (a third result; an error text for the second call), as
    would a call site passing max_calls + 1."""
    c = lambda e: f"{tools.CALL_OPEN}{e}{tools.CALL_CLOSE}"  # noqa: E731
    r = lambda v: f"{tools.RESULT_OPEN}{v}{tools.RESULT_CLOSE}"  # noqa: E731
    want = c("12*3") + r(36) + c("5*7") + r(35) + c("11*13")
    policy = forced_gpt2(tmp_path / "policy", 4, want + r(143) + "so 143")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i} =", "reward_fn": "digits"}) + "\n" for i in range(10)))
    rows, generate = [], sampling.generate_with_tools

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        rows.extend(zip(out[0].tolist(), out[1].tolist(), sampling.tool_calls(out[3]).tolist()))
        return out

    monkeypatch.setattr(sampling, "generate_with_tools", recording)
    from test_grpo import grpo_argv

    proc = run_here(grpo_argv(tmp_path / "run", "--model", policy, "--dataset", str(prompts), "--tools", "calculator",
                              "--max_tool_calls", "2", "--max_prompt_len", "8", "--max_new_tokens", "64",
                              "--steps", "1", "--prompts_per_step", "2", "--group_size", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = tool_tokenizer()
    assert len(rows) == 4  # 2 prompts x 2
    for ids, mask, calls in rows:
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == want and calls == 2
    assert [m["tools/call_frequency"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [2.0]


def test_a_closing_tag_of_several_tokens_is_refused():
    with pytest.raises(ValueError, match="add the tags"):
        tools.closing_tag_id(tasks.char_tokenizer())
