"""sampling.generate_with_tools runs one decode loop for every row, a row's tool result fed to it
token by token while the others sample: against a reference loop that prefills every active row's
whole history again at each turn (sampling.generate on the grown prompts, as a tool loop without a
kept cache does), the same token ids, masks and tool masks and log-probs within 1e-6 in fp32, on
the GPT-2 and the Llama (RoPE, GQA) calculator callers, with rows calling at different steps, some
three times, and calls answered at once (CPU) or after up to 7 idle steps (a GPU's check period);
after the prefill the model is fed one token per row a step, and the loop runs no more steps than
the longest row has tokens (plus the waits)."""
import pytest
import torch

import common
import sampling
from helpers import dynamo_eager
import shared_prompt
import tasks
import tools
from helpers import forward_lengths, fp32_rtol, logprob_size
from plumbing import models


GENERATE = sampling.generate  # the sampler itself, whatever a test records


def reference_loop(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, tokenizer, tool, stop_ids=(),
                   max_calls=2, uniforms=None, **sampler_kw):
    """The tool loop with no cache kept: each turn, sampling.generate on every active row's prompt
    and response so far, left-padded (a fresh prefill), max(budget) tokens with the uniforms of
    each row's next response positions; the same outputs as generate_with_tools."""
    close = tools.closing_tag_id(tokenizer)
    B = prompt_ids.shape[0]
    rows, calls, active = [[] for _ in range(B)], [0] * B, list(range(B))
    prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in range(B)]
    uniforms = torch.nn.functional.pad(uniforms[:, :max_new_tokens], (0, max_new_tokens), value=0.5)
    while active:
        budget = [max_new_tokens - len(rows[i]) for i in active]
        ids, mask = common.pad([prompts[i] + [t for t, _, _ in rows[i]] for i in active], pad_id, side="left")
        u = torch.stack([uniforms[i, len(rows[i]):len(rows[i]) + max(budget)] for i in active])
        r_ids, r_mask, r_logps = (x.tolist() for x in GENERATE(
            model, ids, mask, max(budget), eos_id=eos_id, pad_id=pad_id, stop_ids=(*stop_ids, close), uniforms=u,
            return_logprobs=True, **sampler_kw))
        calling = []
        for k, i in enumerate(active):
            n = min(sum(r_mask[k]), budget[k])
            rows[i] += [(t, 0, lp) for t, lp in zip(r_ids[k][:n], r_logps[k][:n])]
            if n and r_ids[k][n - 1] == close and calls[i] < max_calls and len(rows[i]) < max_new_tokens:
                calls[i] += 1
                calling.append(i)
        for i in calling:
            room = max_new_tokens - len(rows[i])
            written = [t for t, is_tool, _ in rows[i] if not is_tool]
            rows[i] += [(t, 1, 0.0) for t in tools.results_tokens(tokenizer, [written], tool, [room])[0]]
        active = [i for i in calling if len(rows[i]) < max_new_tokens]
    R = max(map(len, rows))
    ids = torch.tensor([[t for t, _, _ in r] + [pad_id] * (R - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in rows])
    logps = torch.tensor([[lp for _, _, lp in r] + [0.0] * (R - len(r)) for r in rows])
    tool_mask = torch.tensor([[is_tool for _, is_tool, _ in r] + [0] * (R - len(r)) for r in rows])
    return ids, mask, logps, tool_mask


@pytest.fixture(scope="module")
def short_tool(tmp_path_factory):
    """A tool whose results are a few tokens (the length of the call's text), so that rows resume
    after their calls with room to call again: written as a module for its worker processes."""
    folder = tmp_path_factory.mktemp("short_tool")
    (folder / "short_tool.py").write_text("def length(text):\n    return str(len(text))\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        yield tools.load_tool("short_tool:length")


@pytest.mark.parametrize("check_every", [1, 8], ids=["calls answered at once", "calls waiting for the check"])
@pytest.mark.parametrize("name,sampler_kw", [("gpt2", dict(temperature=1.0)),
                                             ("llama", dict(temperature=0.7, top_p=0.9))])
def test_one_loop_gives_the_full_prefills_rollout(name, sampler_kw, check_every, user_models, short_tool, tmp_path):
    """12 prompts of distinct lengths, 40 tokens, up to 3 calls, two seeds; the model's forwards
    recorded. check_every 8 (a GPU's): a calling row idles until the next check, its slots masked
    and its positions and random numbers its own tokens'. Planted bugs fail it: a waiting row's
    slots left unmasked, the fed token's position one off, the uniforms' column the step's rather
    than the row's, a result's last token fed twice."""
    folder = tasks.calculator_gpt2(tmp_path / "gpt2") if name == "gpt2" else user_models["llama_calculator"]
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok).eval()
    texts = [r["prompt"] for r in tasks.prompt_rows(12)]
    if tok.chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    ids, mask = common.pad(sampling.encode_prompts(tok, texts, 128)[0], tok.pad_token_id, side="left")
    widths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, tokenizer=tok, tool=short_tool, max_calls=3,
              **sampler_kw)
    for seed in (0, 1):
        u = sampling.rollout_uniforms(12, 40, seed=seed)
        widths.clear()
        got = sampling.generate_with_tools(model, ids, mask, 40, uniforms=u, check_every=check_every, **kw)
        steps = list(widths)
        want = reference_loop(model, ids, mask, 40, uniforms=u, **kw)
        for g, w, what in zip(got, want, ("ids", "mask", "log-probs", "tool mask")):
            assert g.shape == w.shape, (what, g.shape, w.shape)
            if what == "log-probs":  # fp32: another batch shape's rounding (helpers.fp32_rtol), the terms' size
                tol = fp32_rtol(forward_lengths(model.config, ids.shape[1] + 40)) * logprob_size(
                    model, sampler_kw["temperature"])
                torch.testing.assert_close(g, w, atol=tol, rtol=0)
            else:
                assert torch.equal(g, w), what
        calls = sampling.tool_calls(got[3])
        assert len(set(calls.tolist())) > 1 and max(calls) == 3, calls  # rows calling at different steps
        # the prefill, then one token per row a step: no history fed again; as many steps as the longest row has
        # tokens (its last is not fed), and the waits: calls answered at once wait none
        assert steps[0] == ids.shape and all(s == (12, 1) for s in steps[1:]), steps
        longest, waits = int(got[1].sum(1).max()), (check_every - 1) * int(calls.max())
        assert longest - 1 <= len(steps) - 1 <= longest - 1 + waits, (len(steps), longest)


@pytest.mark.parametrize("check_every", [1, 8], ids=["calls answered at once", "calls waiting for the check"])
def test_the_compiled_loop_keeping_each_prompt_once_gives_the_full_prefills_rollout(check_every, user_models,
                                                                                     short_tool, monkeypatch):
    """Compiled on CPU with 4 prompts x G = 3 in runs, the loop keeps each prompt's keys and values
    once (shared_prompt.attention, a waiting row's response slots left out by the loop's mask): the
    reference loop's ids, masks, log-probs and tool masks, two seeds. Dynamo's eager backend: the
    traced step that inductor compiles."""
    tok = models.load_tokenizer(user_models["llama_calculator"])
    model = models.load_model(user_models["llama_calculator"], tok).eval()
    dynamo_eager(monkeypatch)
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for r in tasks.prompt_rows(4) for _ in range(3)]
    ids, mask = common.pad(sampling.encode_prompts(tok, texts, 128)[0], tok.pad_token_id, side="left")
    assert shared_prompt.runs(model, ids, mask) == 3
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, tokenizer=tok, tool=short_tool, max_calls=3,
              temperature=1.0)
    for seed in (0, 1):
        u = sampling.rollout_uniforms(12, 40, seed=seed)
        got = sampling.generate_with_tools(model, ids, mask, 40, uniforms=u, check_every=check_every, compile=True,
                                           **kw)
        want = reference_loop(model, ids, mask, 40, uniforms=u, **kw)
        for g, w, what in zip(got, want, ("ids", "mask", "log-probs", "tool mask")):
            assert g.shape == w.shape, (what, g.shape, w.shape)
            if what == "log-probs":  # fp32: another layout's rounding (helpers.fp32_rtol), the terms' size
                tol = fp32_rtol(forward_lengths(model.config, ids.shape[1] + 40)) * logprob_size(model)
                torch.testing.assert_close(g, w, atol=tol, rtol=0)
            else:
                assert torch.equal(g, w), what
        calls = sampling.tool_calls(got[3])
        assert len(set(calls.tolist())) > 1, calls  # rows calling at different steps, so some wait
