"""The behaviour policy under --top_k / --top_p / --min_p: the sampler records the log-prob of the
distribution it drew from (truncated and renormalised, at the temperature), and grpo.py's
--sampling_replay makes the trainer compute the same log-probs from its own logits. Hand cases and
exact enumeration of the rule (sampling.kept_tokens, truncate_logits, sample_token), then the
zero-gap contract on the real-architecture user models (RoPE, GQA, left padding, KV cache, a
temperature, the rule replayed): sampler and trainer within float32's rounding of two layouts
(helpers.fp32_rtol), directly and through grpo.py's own loop."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import environment
import grpo
import sampling
import shared_prompt
from helpers import forward_lengths, fp32_rtol, gamma, logprob_size, read_metrics
from test_grpo import write_digits_prompts
from plumbing import models

RULES = [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05), dict(top_k=30, top_p=0.8, min_p=0.02)]
MODEL_RULES = [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.3), dict(top_k=100, top_p=0.8, min_p=0.1)]  # the user
# models' random weights spread their probability: min-p 0.05 would keep every one of their ~300 tokens


# -----------------------------------------------------------------------------
# the rule, by hand and by enumeration


def test_the_rule_on_a_hand_case():
    """Probabilities at T = 1: 0.4, 0.3, 0.15, 0.1, 0.05 (logits their logs, shuffled). top_p 0.8
    keeps 0.4, 0.3 (0.7 < 0.8) and 0.15 (reaches 0.85); top_k 2 keeps the first two; min_p 0.3
    keeps p >= 0.12: three; min_p 0.3 then top_k 4 then top_p 0.8 (vLLM's order): {0.4, 0.3, 0.15},
    renormalised 0.47, 0.35, 0.18: 0.47, then 0.82 reaches 0.8: two (in HF's order, top_k, top_p,
    min_p, three: 0.4, 0.3, 0.15 of 0.95 reach 0.8 only at 0.89)."""
    p = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15], dtype=torch.float64)
    logits = p.log().float()[None]
    for kw, kept in [(dict(top_p=0.8), [1, 3, 4]), (dict(top_k=2), [1, 3]), (dict(min_p=0.3), [1, 3, 4]),
                     (dict(min_p=0.3, top_k=4, top_p=0.8), [1, 3])]:
        keep = sampling.kept_tokens(logits, **kw)[0]
        assert keep.nonzero().flatten().tolist() == kept, kw
        lp = torch.log_softmax(sampling.truncate_logits(logits, **kw), -1)[0].double()
        mass = p[kept].sum()
        # log(p_i / kept mass) on the kept set, -inf elsewhere; float32's logits (rounded) and log-softmax
        # over 5 terms, within gamma_8 of its terms' size
        tol = gamma(5 + 3) * (2 * logits.abs().max().item() + math.log(5))
        for i in range(5):
            assert lp[i].item() == (pytest.approx(math.log(p[i] / mass), abs=tol) if i in kept else float("-inf"))


@pytest.mark.parametrize("kw", RULES)
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_every_token_the_sampler_can_draw_and_its_recorded_log_prob(kw, T):
    """One position of a 64-token vocabulary, enumerated: a uniform number at the middle of every
    token's CDF interval draws each token of the kept set once and no other; the recorded log-prob
    of each is log(softmax(logits / T)[tok] / kept mass), written here from the probabilities in
    float64; exp of them sums to 1 over the kept set."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=g) * 2
    p = torch.softmax(logits.double() / T, -1)[0]
    keep = sampling.kept_tokens(logits / T, **kw)[0]
    q = torch.where(keep, p, 0) / p[keep].sum()  # the behaviour policy
    cdf = q.cumsum(0)
    mid = (cdf - q / 2)[keep]  # one uniform per kept token, inside its interval
    tok, logp = sampling.sample_token(logits.expand(len(mid), 64), T, u=mid, return_logprob=True, **kw)
    assert tok.tolist() == keep.nonzero().flatten().tolist()  # each kept token once, in order, none other
    # float32 against float64: the log-softmax's and the kept mass's sums over 64, of the terms' size
    tol = fp32_rtol([64, 64]) * (2 * logits.abs().max().item() / T + math.log(64))
    torch.testing.assert_close(logp.double(), (p[tok] / p[keep].sum()).log(), atol=tol, rtol=0)
    assert logp.double().exp().sum().item() == pytest.approx(1.0, abs=tol)  # each p within tol of its size
    assert 1 < int(keep.sum()) < 64  # the rule truncates, and keeps more than one


def test_the_trainers_replay_keeps_the_sampled_token_and_its_gradient_flows_through_the_kept_logits():
    """truncate_logits with labels keeps each label (a finite log-prob where the trainer's logits
    would drop it); the gradient of a kept token's log-prob is (onehot - q) / T on the kept set,
    0 on the dropped tokens (finite differences of the same function agree)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    out = sampling.truncate_logits(logits, labels=torch.tensor([4]), top_k=2)
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False, True]
    lp = torch.log_softmax(sampling.truncate_logits(logits / 0.5, top_k=3), -1)[0, 1]
    lp.backward()
    q = torch.softmax(logits.detach()[0, :3] / 0.5, -1)
    expected = torch.tensor([-q[0], 1 - q[1], -q[2], 0, 0], dtype=torch.float64) / 0.5
    torch.testing.assert_close(logits.grad[0], expected)


# -----------------------------------------------------------------------------
# the zero-gap contract: sampler and trainer on the user models, fp32


def prompts_of(tok, n=4):
    """n chat prompts of distinct lengths, left-padded: (ids, mask)."""
    texts = [tok.apply_chat_template([{"role": "user", "content": "sort " + " ".join("97531"[:k])}], tokenize=False,
                                     add_generation_prompt=True) for k in range(1, n + 1)]
    ids, _ = sampling.encode_prompts(tok, texts, 128)
    return common.pad(ids, tok.pad_token_id, side="left")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sampler_and_replayed_trainer_log_probs_agree_and_so_do_their_kept_sets(user_models, name):
    """The sampler (KV cache, left padding, temperature 0.7, each rule) records the truncated
    log-probs; the trainer's forward (no cache, the whole sequence) with the rule replayed gives
    the same within float32's rounding of the two layouts; without the replay it gives the full log-probs, lower by log(kept mass)
    (> 5e-3 a token on average: the gap the replay removes). The kept sets: the sampler's (recorded inside
    sample_token) against the rule on the trainer's logits, at every response position: counted,
    and equal on these models in fp32."""
    tok = models.load_tokenizer(user_models[name])
    model = models.load_model(user_models[name], tok).eval()
    p_ids, p_mask = prompts_of(tok)
    p_ids, p_mask = p_ids.repeat_interleave(2, 0), p_mask.repeat_interleave(2, 0)  # (8, P)
    u = sampling.rollout_uniforms(8, 12, seed=5)
    T = 0.7
    for kw in MODEL_RULES:
        seen = []
        kept = sampling.kept_tokens

        def recording(logits, *args, **kwargs):
            seen.append(kept(logits, *args, **kwargs))
            return seen[-1]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sampling, "kept_tokens", recording)
            r_ids, r_mask, r_logps = sampling.generate(model, p_ids, p_mask, 12, tok.eos_token_id, tok.pad_token_id,
                                                       temperature=T, uniforms=u, return_logprobs=True, **kw)
        ids, attn, R = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), r_ids.shape[1]
        with torch.no_grad():
            replayed = common.response_logprobs(model, ids, attn, R, T, truncate=sampling.truncation(**kw)) * r_mask
            full = common.response_logprobs(model, ids, attn, R, T) * r_mask
            logits = model(input_ids=ids, attention_mask=attn,
                           position_ids=common.position_ids_from_mask(attn)).logits[:, -R - 1:-1] / T
        # the sampler's cached decode and the trainer's forward: float32's rounding of two layouts
        tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logprob_size(model, T)
        torch.testing.assert_close(r_logps, replayed, atol=tol, rtol=0)
        gap = ((replayed - full) * r_mask).sum() / r_mask.sum()
        assert gap > 10 * tol, (kw, gap, tol)
        sampler_kept = torch.stack(seen[:R], 1)  # (B, R, V): step t's set, for response token t
        trainer_kept = kept(logits.float(), **kw)
        differ = ((sampler_kept != trainer_kept).any(-1) & r_mask.bool()).sum().item()
        assert differ == 0, f"{name} {kw}: {differ} of {int(r_mask.sum())} positions keep another set"


def test_through_grpo_the_trainer_computes_the_samplers_log_probs_with_replay(user_models, tmp_path):
    """grpo.py's own loop on the Llama-shaped model (2 passes x 2 mini-batches), temperature 0.7,
    top-p 0.9: the log-probs the update's first forward gives its rows (before any optimizer step)
    equal the sampler's recorded ones within float32's rounding, and rollout/logp_diff (the old log-probs against
    the sampler's) is ~0 at both steps; with --no-sampling_replay the trainer's
    are the full policy's and rollout/logp_diff is the truncation's |log kept mass| (> 0.02)."""
    prompts = write_digits_prompts(tmp_path / "p.jsonl", 4)
    metrics = {}
    for replay in (True, False):
        seen = {"rollouts": [], "trainer": []}
        orig_rollout, orig_logprobs = environment.rollout, common.response_logprobs

        def rollout(*args, **kwargs):
            seen["rollouts"].append(orig_rollout(*args, **kwargs))
            return seen["rollouts"][-1]

        def recorded(fn):
            def response_logprobs(model, ids, attn, *args, **kwargs):
                out = fn(model, ids, attn, *args, **kwargs)
                if torch.is_grad_enabled():  # the update's forward, not the reference's or the evaluation's
                    seen["trainer"].append((ids, out[0].detach()))
                return out
            return response_logprobs

        response_logprobs, shared_logprobs = recorded(orig_logprobs), recorded(shared_prompt.response_logprobs)

        cfg = grpo.Config(model=user_models["llama"], dataset=prompts, out_dir=str(tmp_path / f"g{replay}"),
                          sampling_replay=replay, temperature=0.7, top_p=0.9, steps=2, prompts_per_step=2,
                          group_size=4, max_prompt_len=128, max_new_tokens=8, lr=1e-3, warmup_steps=0, eval_every=100,
                          n_eval_pairs=4)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(environment, "rollout", rollout)
            mp.setattr(common, "response_logprobs", response_logprobs)
            mp.setattr(shared_prompt, "response_logprobs", shared_logprobs)  # the update's, where rows share prompts
            grpo.main(cfg)
        metrics[replay] = [m["rollout/logp_diff"] for m in read_metrics(cfg.out_dir)]
        model = AutoModelForCausalLM.from_pretrained(user_models["llama"])
        tol = fp32_rtol(forward_lengths(model.config, 128 + 8)) * logprob_size(model, 0.7)
        roll = seen["rollouts"][0]
        rows = {tuple(torch.cat([p, r]).tolist()): (lp, m) for p, r, lp, m in
                zip(roll.p_ids, roll.r_ids, roll.r_logps, roll.r_mask)}
        for ids, logps in seen["trainer"][:1]:  # step 1's first micro-batch (4 rows), before any optimizer step
            for row, lp in zip(ids, logps):
                sampler, mask = rows[tuple(row.tolist())]
                if replay:  # float32's rounding of the two layouts, of the log-probs' terms' size
                    torch.testing.assert_close(lp * mask, sampler * mask, atol=tol, rtol=0)
                else:  # the full policy: below the truncated one wherever the rule dropped a token
                    assert ((sampler - lp) * mask >= -1e-6).all() and ((sampler - lp) * mask).sum() > 0
    assert max(metrics[True]) < tol, (metrics, tol)
    assert min(metrics[False]) > 0.02, metrics


def test_the_tool_loop_records_the_behaviour_log_probs_of_the_policys_own_tokens(user_models):
    """generate_with_tools at top-p 0.8, T 0.7 on the calculator-calling Llama: its rows call the
    tool, and on the policy's own tokens (not the tools' results) the recorded log-probs equal the
    trainer's replayed ones on the whole sequence (results included, as grpo.py scores it)."""
    import tools

    tok = models.load_tokenizer(user_models["llama_calculator"])
    model = models.load_model(user_models["llama_calculator"], tok).eval()
    p_ids, p_mask = prompts_of(tok)
    kw = dict(temperature=0.7, top_p=0.8)
    r_ids, r_mask, r_logps, r_tool = sampling.generate_with_tools(
        model, p_ids, p_mask, 24, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, tokenizer=tok, tool=tools.calculator,
        uniforms=sampling.rollout_uniforms(4, 24, seed=2), **kw)
    assert sampling.tool_calls(r_tool).sum() > 0
    ids, attn, R = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), r_ids.shape[1]
    with torch.no_grad():
        replayed = common.response_logprobs(model, ids, attn, R, 0.7, truncate=sampling.truncation(top_p=0.8))
    own = r_mask * (1 - r_tool)  # float32's rounding of the two layouts, of the log-probs' terms' size
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logprob_size(model, 0.7)
    torch.testing.assert_close(r_logps * own, replayed * own, atol=tol, rtol=0)
