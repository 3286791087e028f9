"""shared_prompt: each distinct prompt computed once for the rows that share it. Its log-probs,
entropies and gradients against common.response_logprobs' padded forward (the independent
computation: every row's prompt computed again), on GPT-2 (absolute positions), Llama, Qwen2 and
SmolLM2's shape (RoPE, grouped-query attention), with left-padded prompts of several lengths and
right-padded responses; the planted bug: rows given another prompt's keys and values."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import shared_prompt
import tasks
from plumbing import models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _groups(vocab, prompt_lens=(5, 2, 9), group=3, seed=0):
    """Groups of `group` rows after one prompt each (prompts of prompt_lens tokens, left-padded),
    responses of 1-4 tokens (right-padded): ids, attention mask (B, P+R), response mask (B, R)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i, n in enumerate(prompt_lens):
        p = torch.randint(3, vocab, (n,), generator=g).tolist()
        for k in range(group):
            prompts.append(p)
            responses.append(torch.randint(3, vocab, (1 + (i + k) % 4,), generator=g).tolist())
    return common.join_prompt_response(prompts, responses, pad_id=0)


def _models(user_models, smollm2_small):
    yield "tiny", models.load_model("tiny", tasks.char_tokenizer())
    for name, path in (("llama", user_models["llama"]), ("qwen2", user_models["qwen2"]), ("smollm2", smollm2_small)):
        torch.manual_seed(0)
        yield name, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_shared_prompt_logprobs_and_gradients_equal_the_padded_ones(user_models, smollm2_small, entropy_grad):
    """Log-probs and entropies of the real response tokens at temperature 0.7, a masked token-mean
    loss through both, and every parameter's gradient: shared prompts against the padded forward
    (fp32, 1e-5)."""
    for name, model in _models(user_models, smollm2_small):
        ids, attn, resp = _groups(model.config.vocab_size)
        out = []
        for fn in (common.response_logprobs, shared_prompt.response_logprobs):
            model.zero_grad()
            logps, ent = fn(model, ids, attn, resp.shape[1], temperature=0.7, with_entropy=True,
                            entropy_grad=entropy_grad)
            loss = ((logps + 0.1 * ent) * resp).sum() / resp.sum()
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            out.append((logps.detach() * resp, ent.detach() * resp, loss.detach(), grads))
        for padded, shared in zip(*out):
            torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5, msg=name)


def test_batched_and_sequence_logprobs_equal_common_ones(user_models):
    """The no-gradient passes (micro-batches of 4 rows: groups cut across them) and DPO's summed
    log-probs (chosen and rejected after one prompt) against common's."""
    model = AutoModelForCausalLM.from_pretrained(user_models["qwen2"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size, prompt_lens=(4, 7, 3, 6), group=3, seed=1)
    d = common.Dist()
    want = common.batched_logprobs(model, ids, attn, resp.shape[1], 1.0, d, rows_per_forward=4)
    got = shared_prompt.batched_logprobs(model, ids, attn, resp.shape[1], 1.0, d, rows_per_forward=4)
    torch.testing.assert_close(got * resp, want * resp, rtol=0, atol=1e-5)
    batch = _groups(model.config.vocab_size, prompt_lens=(4, 7, 3), group=2, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(shared_prompt.sequence_logprobs(model, batch, d),
                                   common.sequence_logprobs(model, batch, d), rtol=0, atol=1e-5)


def test_rows_of_distinct_prompts_take_the_padded_forward(user_models):
    """No two rows share a prompt: common.response_logprobs itself, the same floats."""
    model = AutoModelForCausalLM.from_pretrained(user_models["llama"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size, group=1)
    with torch.no_grad():
        assert torch.equal(shared_prompt.response_logprobs(model, ids, attn, resp.shape[1]),
                           common.response_logprobs(model, ids, attn, resp.shape[1]))


def test_rows_given_another_prompts_keys_differ(user_models, monkeypatch):
    """The planted bug: each row continues from the next distinct prompt's keys and values."""
    model = AutoModelForCausalLM.from_pretrained(user_models["llama"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size)
    with torch.no_grad():
        want = common.response_logprobs(model, ids, attn, resp.shape[1]) * resp
        real_unique = torch.unique

        def shifted(x, **kw):
            rows, inverse = real_unique(x, **kw)
            return rows, (inverse + 1) % len(rows)

        monkeypatch.setattr(shared_prompt.torch, "unique", shifted)
        got = shared_prompt.response_logprobs(model, ids, attn, resp.shape[1]) * resp
    assert (got - want).abs().max() > 1e-3
