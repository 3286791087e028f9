"""The GRPO and DPO variants (issue: GSPO, CISPO, SAPO, dual-clip, delta, off-policy masking,
entropy masking, truncated IS, RLOO, REINFORCE++, DAPO overlong and dynamic sampling;
length-normalised DPO, SimPO, RPO): each against an independent computation on hand-sized
inputs (a per-sequence or per-token loop, a closed form, enumeration), the identities that must
hold, and a planted-bug case each would miss if it were wrong."""
import math
import re
from dataclasses import replace

import pytest
import torch

import common
import dpo
import grpo
import sampling
import tasks
import test_grpo
from grpo import (grpo_loss, importance_ratio, off_policy_mask, overlong_penalty, policy_loss, rollout_is_weights,
                  top_entropy_mask)
from helpers import (TWO_RANK_RUNS, adam_drift, assert_runs_agree, checkpoint_weights, forward_lengths, fp32_rtol,
                     logprob_size, max_abs_diff, read_metrics, run_here, write_jsonl)
from plumbing import cli, conflicts, models

f64 = dict(dtype=torch.float64)


def batch(seed=0, B=4, T=5, spread=0.3):
    """log-probs, old and reference log-probs, advantages (distinct, both signs) and a mask with
    rows of lengths 5, 3, 4, 2 (padding with values that would change any result it leaked into)."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g, **f64) * 2).requires_grad_()
    old = logps.detach() + spread * torch.randn(B, T, generator=g, **f64)
    ref = logps.detach() + spread * torch.randn(B, T, generator=g, **f64)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9], **f64)[:B]
    lengths = torch.tensor([5, 3, 4, 2])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    return logps, old, ref, adv, mask


def grad(loss, x):
    return torch.autograd.grad(loss, x, retain_graph=True)[0]


# -----------------------------------------------------------------------------
# importance ratio level: token, sequence (GSPO), sequence_token (GSPO-token)


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio_over_each_rows_own_tokens():
    logps, old, _, _, mask = batch()
    rho = importance_ratio(logps, old, mask, "sequence")
    for i in range(4):  # a per-row loop over the valid tokens only
        n = int(mask[i].sum())
        s = math.exp(sum((logps[i, t] - old[i, t]).item() for t in range(n)) / n)
        assert torch.allclose(rho[i, :n], torch.full((n,), s, **f64))
    # a mean over every column (padding included) is a different number: the mask matters here
    assert not torch.allclose(rho[1, 0], torch.exp((logps - old)[1].mean()))
    torch.testing.assert_close(importance_ratio(logps, old, mask, "token"), torch.exp(logps - old))


def test_gspo_on_policy_gradient_equals_the_token_level_one_under_each_aggregation():
    """One pass on-policy (old = logps): s_i's gradient is s_i times the mean of its tokens'
    log-prob gradients, and each sequence weighs its tokens alike under every aggregation, so
    GSPO, GSPO-token and the token ratio give one gradient per aggregation. Off-policy they part."""
    logps, old_off, ref, adv, mask = batch()
    for agg, norm in (("seq_mean_token_mean", 4.0), ("token_mean", mask.sum()), ("constant", 20.0)):
        g = {}
        for level in ("token", "sequence", "sequence_token"):
            for where, old in (("on", logps.detach()), ("off", old_off)):
                g[level, where] = grad(grpo_loss(logps, old, ref, adv, mask, norm, agg=agg, level=level)[0], logps)
        torch.testing.assert_close(g["sequence", "on"], g["token", "on"])
        torch.testing.assert_close(g["sequence_token", "on"], g["token", "on"])
        assert not torch.allclose(g["sequence", "off"], g["token", "off"])


def test_gspo_clips_whole_sequences_like_a_naive_per_sequence_objective():
    """GSPO's objective written per sequence: J = mean_i min(s_i A_i, clip(s_i, 1 - e_l, 1 + e_h) A_i).
    Off-policy (the rows' ratios 1.74, 1.10, 0.91, 0.73) with e = 0.1, rows 0 and 3 are clipped
    as a whole; loss and gradient agree with the loop."""
    logps, old, ref, adv, mask = batch(seed=1, spread=0.4)
    loss, m = grpo_loss(logps, old, ref, adv, mask, 4.0, 0.1, 0.1, agg="seq_mean_token_mean", level="sequence")
    naive = 0
    for i in range(4):
        n = int(mask[i].sum())
        s = torch.exp((logps[i, :n] - old[i, :n]).mean())
        naive = naive - torch.minimum(s * adv[i], s.clamp(0.9, 1.1) * adv[i]) / 4
    torch.testing.assert_close(loss, naive)
    torch.testing.assert_close(grad(loss, logps), grad(naive, logps))
    s = importance_ratio(logps, old, mask, "sequence")[:, 0]
    clipped = ((s > 1.1) & (adv > 0)) | ((s < 0.9) & (adv < 0))
    assert clipped.tolist() == [True, False, False, True]
    g = grad(grpo_loss(logps, old, ref, adv, mask, 4.0, 0.1, 0.1, agg="seq_mean_token_mean",
                       level="sequence")[0], logps)
    assert (g[clipped] == 0).all() and (g[~clipped] * mask[~clipped] != 0).any()


def test_gspo_token_has_the_sequence_value_and_each_tokens_own_gradient():
    logps, old, _, _, mask = batch(seed=1)
    st = importance_ratio(logps, old, mask, "sequence_token")
    s = importance_ratio(logps, old, mask, "sequence")
    torch.testing.assert_close(st, s)
    # d st[i, t] / d logps[i, t] = s_i, and nothing for the other tokens (stop-gradient on s)
    g = grad(st[1, 0], logps)
    assert g[1, 0] == pytest.approx(s[1, 0].item()) and (g != 0).sum() == 1


# -----------------------------------------------------------------------------
# the policy term: grpo (+ delta, dual-clip), cispo, sapo


def test_every_policy_term_has_the_token_level_gradient_on_policy():
    logps, _, ref, adv, mask = batch()
    old = logps.detach()
    base = grad(grpo_loss(logps, old, ref, adv, mask, mask.sum())[0], logps)
    for kw in (dict(loss_type="cispo", epsilon_high=5.0), dict(loss_type="sapo"), dict(delta=2.0), dict(clip_ratio_c=3.0)):
        torch.testing.assert_close(grad(grpo_loss(logps, old, ref, adv, mask, mask.sum(), **kw)[0], logps), base)


def test_cispo_matches_a_per_token_loop_with_the_weight_held_constant():
    """CISPO (MiniMax-M1) token by token: - min(rho_t, e_h) A log pi_t (TRL's cap) with the weight a
    Python float (no gradient through it). Tokens whose ratio is clipped keep a gradient (the
    clipped surrogate gives them none)."""
    logps, old, ref, adv, mask = batch(seed=2, spread=0.5)
    loss, _ = grpo_loss(logps, old, ref, adv, mask, mask.sum(), epsilon_high=1.28, loss_type="cispo")
    naive = 0
    for i in range(4):
        for t in range(int(mask[i].sum())):
            w = min(math.exp((logps[i, t] - old[i, t]).item()), 1.28)
            naive = naive - w * adv[i].item() * logps[i, t] / mask.sum()
    torch.testing.assert_close(loss, naive)
    g = grad(loss, logps)
    torch.testing.assert_close(g, grad(naive, logps))
    rho = torch.exp(logps - old).detach()
    high = (rho > 1.28) & (adv[:, None] > 0) & mask.bool()
    assert high.any() and (g[high] != 0).all()  # clipped, still trained
    ppo = grad(grpo_loss(logps, old, ref, adv, mask, mask.sum(), epsilon_high=0.28)[0], logps)
    assert (ppo[high] == 0).all()


def test_sapo_gradient_is_the_closed_form_with_the_temperature_of_the_advantages_sign():
    """d/d log pi of -A (4 / tau) sigmoid(tau (rho - 1)) = -A 4 sigma(x) (1 - sigma(x)) rho,
    x = tau (rho - 1), tau_pos for A > 0 and tau_neg otherwise (distinct here, so swapping them fails)."""
    logps, old, _, adv, mask = batch(seed=4, spread=0.6)
    taus = (0.7, 1.9)
    rho = torch.exp(logps - old)
    pg = policy_loss(rho, logps, adv[:, None], "sapo", sapo_temperatures=taus)
    tau = torch.tensor([taus[0] if a > 0 else taus[1] for a in adv.tolist()], **f64)[:, None]
    x = tau * (rho.detach() - 1)
    want = -adv[:, None] * 4 * torch.sigmoid(x) * (1 - torch.sigmoid(x)) * rho.detach()
    torch.testing.assert_close(grad(pg.sum(), logps), want)


@pytest.mark.parametrize("rho, adv, kw, loss, slope", [
    (5.0, -1.0, dict(clip_ratio_c=3.0), 3.0, 0.0),    # dual-clip: a negative advantage far off-policy is capped at c|A|
    (2.0, -1.0, dict(clip_ratio_c=3.0), 2.0, 2.0),    # below c: the clipped surrogate as it was
    (5.0, +1.0, dict(clip_ratio_c=3.0), -1.28, 0.0),  # positive advantages: untouched (clipped at 1 + e_h)
    (3.0, -1.0, dict(delta=2.0), 2.0, 0.0),           # delta caps rho in the unclipped term
    (1.5, -1.0, dict(delta=2.0), 1.5, 1.5),           # below delta: unchanged
    (3.0, -1.0, {}, 3.0, 3.0),                        # without either: -A rho, unbounded
])
def test_dual_clip_and_delta_hand_values(rho, adv, kw, loss, slope):
    """The loss value and its slope d loss / d log pi for one token (slope = -A rho on the
    unclipped side, 0 where a bound holds)."""
    logp = torch.tensor([[0.0]], **f64).requires_grad_()
    old = torch.tensor([[-math.log(rho)]], **f64)
    pg = policy_loss(torch.exp(logp - old), logp, torch.tensor([[adv]], **f64), "grpo", 0.2, 0.28, **kw)
    assert pg.item() == pytest.approx(loss)
    assert grad(pg.sum(), logp).item() == pytest.approx(slope, abs=1e-12)


# -----------------------------------------------------------------------------
# masks and weights of the policy term


def test_off_policy_mask_drops_negative_advantage_sequences_past_the_threshold_only():
    """Rows: A > 0 drifted (kept), A < 0 drifted (dropped), A < 0 close (kept), A < 0 drifted
    only in a padded column (kept: padding is not evidence)."""
    logps = torch.zeros(4, 3, **f64)
    rollout = torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9], [0.1, 0.1, 0.1], [0.1, 0.1, 9.0]], **f64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], **f64)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0], **f64)
    keep = off_policy_mask(logps, rollout, adv, mask, 0.5)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0, 1.0]
    # in the loss it weighs the policy term only: a dropped row keeps its KL gradient
    lp = logps.clone().requires_grad_()
    g = grad(grpo_loss(lp, lp.detach(), rollout, adv, mask, mask.sum(), beta=0.1, pg_weights=keep)[0], lp)
    g_kl = grad(grpo_loss(lp, lp.detach(), rollout, adv * 0, mask, mask.sum(), beta=0.1)[0], lp)
    torch.testing.assert_close(g[1], g_kl[1])
    assert not torch.allclose(g[0], g_kl[0])


def test_off_policy_mask_compares_the_threshold_with_the_mean_log_ratio():
    """DeepSeek-V3.2's Eq. 9 bounds the mean token log(pi_rollout / pi), not its sum: row 0 drifts
    0.1 on each of 4 tokens (mean 0.1, sum 0.4) and is kept under a threshold of 0.2; row 1 drifts
    0.3 on its 2 tokens (mean 0.3), its padding 5: dropped; row 2 drifts 0.15 on 1 token and is kept.
    Planted, fails here: the sum over tokens without `/ mask.sum(-1)`."""
    logps = torch.zeros(3, 4, **f64)
    rollout = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 5.0, 5.0], [0.15, 5.0, 5.0, 5.0]], **f64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], **f64)
    keep = off_policy_mask(logps, rollout, torch.tensor([-1.0, -1.0, -1.0], **f64), mask, 0.2)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("mode, want", [("token_mask", [1.0, 0.0, 1.5, 0.0]), ("token_truncate", [1.0, 0.5, 1.5, 2.0])])
def test_policy_weights_bound_the_ratio_below_by_clip_min(mode, want):
    """policy_weights passes both bounds on: per-token ratios pi_old / pi_rollout of 1, 0.3, 1.5
    and 3 under --vllm_importance_sampling_clip_min 0.5 and _clip_max 2 are masked (IcePop) to
    1, 0, 1.5, 0 or truncated to 1, 0.5, 1.5, 2, and half the tokens are outside. Planted, fails
    here: the call of rollout_is_weights without `clip_min=cfg.vllm_importance_sampling_clip_min`."""
    cfg = replace(cli.with_defaults(grpo.Config()), prompts_per_step=1, group_size=1, num_mini_batches=1,
                  vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                  vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    old = torch.log(torch.tensor([[1.0, 0.3, 1.5, 3.0]], **f64))
    rollout, mask = torch.zeros(1, 4, **f64), torch.ones(1, 4, **f64)
    w, m = grpo.policy_weights(cfg, old, old, rollout, torch.tensor([1.0], **f64), mask, None,
                               n_tokens=torch.tensor(4.0, **f64))
    torch.testing.assert_close(w, torch.tensor([want], **f64))
    assert m["sampling/importance_sampling_ratio/outside_tokens"].item() == 0.5


def test_top_entropy_mask_keeps_the_top_share_of_real_tokens_by_enumeration():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(3, 6, generator=g) * 5
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    entropy[mask == 0] = 100.0  # padding with the largest entropies must not be picked
    real = sorted(entropy[mask.bool()].tolist(), reverse=True)  # 13 tokens
    for q, k in ((0.2, 3), (0.5, 7), (1.0, 13), (0.01, 1)):  # ceil(q * 13)
        keep = top_entropy_mask(entropy, mask, q)
        assert keep.sum() == k and (keep * (1 - mask)).sum() == 0
        assert sorted(entropy[keep.bool()].tolist(), reverse=True) == real[:k]


def test_truncated_is_weights_hand_values_and_no_gradient():
    old = torch.tensor([[0.0, -1.0, -2.0]], **f64).requires_grad_()
    rollout = torch.tensor([[-0.5, -1.0, 0.0]], **f64)
    w, _ = rollout_is_weights(old, rollout, torch.ones(1, 3, **f64), "token_truncate", clip_max=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, math.exp(-2.0)]], **f64))  # exp(0.5) = 1.65 capped
    assert not w.requires_grad


def test_sampler_log_probs_are_the_trainers_at_the_sampling_temperature():
    """generate(return_logprobs=True) returns log pi(token) of what it sampled, at the temperature,
    equal (fp32 on the CPU) to the trainer's response_logprobs of the same sequences: the gap
    logged as rollout/logp_diff is numerics only. Without the temperature it would not be."""
    torch.manual_seed(0)
    tok = tasks.char_tokenizer()
    model = models.load_model("tiny", tok).eval()
    p_ids, p_mask = common.pad([tok(t)["input_ids"] for t in ["sort 3 1 2 =", "sort 9 =", "sort 5 4 =", "sort 1 ="]],
                               tok.pad_token_id, side="left")
    with torch.no_grad():
        r_ids, r_mask, r_logps = sampling.generate(model, p_ids, p_mask, 6, tok.eos_token_id, tok.pad_token_id,
                                                   0.7, generator=torch.Generator().manual_seed(1),
                                                   return_logprobs=True)
        ids, attn = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
        trainer = common.response_logprobs(model, ids, attn, r_ids.shape[1], 0.7) * r_mask
        at_one = common.response_logprobs(model, ids, attn, r_ids.shape[1], 1.0) * r_mask
    # the sampler's cached decode and the trainer's forward: float32's rounding of two layouts
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logprob_size(model, temperature=0.7)
    torch.testing.assert_close(r_logps, trainer, atol=tol, rtol=0)
    assert (r_logps - at_one).abs().max() > 1e-2


# -----------------------------------------------------------------------------
# advantages and rewards


def test_rloo_is_the_leave_one_out_baseline_by_a_loop():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0, 3.0], [2.0, -1.0, 0.5, 0.5, 4.0]], **f64)
    adv, _ = grpo.group_advantages(r, "none", estimator="rloo")
    for b in range(2):
        for i in range(5):
            others = [r[b, j].item() for j in range(5) if j != i]
            assert adv[b, i].item() == pytest.approx(r[b, i].item() - sum(others) / 4)


# the fields of TRL's GRPOConfig and (for simpo_gamma) its experimental CPOConfig, read from TRL's source
TRL_FIELDS = {
    "grpo": {"beta", "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg", "sapo_temperature_pos",
             "importance_sampling_level", "reward_weights", "scale_rewards", "loss_type", "mask_truncated_completions",
             "top_entropy_quantile", "entropy_coef", "vllm_importance_sampling_correction",
             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
             "off_policy_mask_threshold", "temperature", "top_p", "top_k", "num_train_epochs"},
    "dpo": {"beta", "loss_type", "label_smoothing", "precompute_ref_log_probs", "simpo_gamma", "num_train_epochs"},
}


@pytest.mark.parametrize("script", ["grpo", "dpo"])
def test_a_flag_said_to_be_trls_is_a_trl_flag(script):
    """--help says whose name each flag is. `sequence_token` and `rpo_alpha` were called TRL's but
    are not in TRL's configs; a flag that keeps TRL's name keeps TRL's meaning (cispo's cap, above),
    and one that means something else has another name (--top_entropy_share)."""
    docs = cli._field_docs(__import__(script).Config)
    claimed = {name for name, doc in docs.items() if re.search(r"\(TRL's (CPO trainer's )?name", doc)}
    assert claimed and claimed <= TRL_FIELDS[script], claimed - TRL_FIELDS[script]
    if script == "grpo":
        assert "not as a value here" in docs["importance_sampling_level"] and "top_entropy_quantile" not in docs
    else:
        assert "TRL 1.x has no such flag" in docs["rpo_alpha"] and "CPO trainer" in docs["simpo_gamma"]


def test_reinforce_pp_whitens_over_tokens_as_verl_does():
    """verl's and OpenRLHF's REINFORCE++-baseline: r - group mean, then whitened over every response
    token of the batch (a response of L tokens counts L times; Bessel over tokens; rsqrt(var +
    1e-8)). The hand case of the report: rewards [[1, 0], [1, 0]], lengths [1, 3, 1, 1] give verl's
    [1.291, -0.645, 1.291, -0.645] (a per-sequence whitening gives +-0.866), and a naive loop over
    the tokens of a second case."""
    import statistics

    adv, _ = grpo.group_advantages(torch.tensor([[1.0, 0.0], [1.0, 0.0]], **f64), "none", estimator="reinforce_pp",
                                   lengths=torch.tensor([[1, 3], [1, 1]]))
    torch.testing.assert_close(adv.flatten(), torch.tensor([1.290994, -0.645497, 1.290994, -0.645497], **f64),
                               atol=1e-6, rtol=0)
    r = torch.tensor([[1.0, 0.0, 2.0], [3.0, 3.0, 6.0]], **f64)
    lengths = torch.tensor([[2, 5, 1], [4, 3, 7]])
    adv, _ = grpo.group_advantages(r, "none", estimator="reinforce_pp", lengths=lengths)
    centred = (r - r.mean(1, keepdim=True)).flatten().tolist()
    tokens = [c for c, n in zip(centred, lengths.flatten().tolist()) for _ in range(n)]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    torch.testing.assert_close(adv.flatten(), torch.tensor([(c - mean) / math.sqrt(var + 1e-8) for c in centred], **f64))


def test_reinforce_pp_whitens_over_the_tokens_of_scored_completions_only():
    """An unscored completion (NaN: a function returned None) gets advantage 0 and is no part of
    REINFORCE++'s whitening: rewards [[1, None, 0], [2, 4, 3]] with lengths [[2, 7, 1], [1, 2, 3]]
    are centred by each group's scored mean, then whitened over the scored completions' tokens
    alone (a naive loop over them). Planted, fails here: the whitening's weights without `* scored`
    (the unscored completion's 7 tokens counted as advantage 0)."""
    import statistics

    r = torch.tensor([[1.0, math.nan, 0.0], [2.0, 4.0, 3.0]], **f64)
    lengths = torch.tensor([[2, 7, 1], [1, 2, 3]])
    adv, _ = grpo.group_advantages(r, "none", estimator="reinforce_pp", lengths=lengths)
    centred = [0.5, None, -0.5, -1.0, 1.0, 0.0]  # r - the mean of the group's scored rewards (0.5; 3)
    tokens = [c for c, n in zip(centred, lengths.flatten().tolist()) if c is not None for _ in range(n)]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    want = [0.0 if c is None else (c - mean) / math.sqrt(var + 1e-8) for c in centred]
    torch.testing.assert_close(adv.flatten(), torch.tensor(want, **f64))


def test_cispo_caps_the_weight_at_epsilon_high_itself_as_trl_does():
    """TRL's cispo: -min(rho, epsilon_high) A log pi (TRL suggests epsilon_high 5). rho 6 and 0.5
    under a cap of 5: weights 5 and 0.5 (with 1 + eps_high, the MiniMax-M1 writing, 6 and 0.5)."""
    logps = torch.tensor([[-1.0, -2.0]], **f64).requires_grad_()
    old = logps.detach() - torch.tensor([[math.log(6.0), math.log(0.5)]], **f64)
    mask, A = torch.ones(1, 2, **f64), torch.tensor([2.0], **f64)
    loss, _ = grpo_loss(logps, old, old, A, mask, 2.0, epsilon_high=5.0, loss_type="cispo")
    assert loss.item() == pytest.approx(-(5 * 2 * -1.0 + 0.5 * 2 * -2.0) / 2)
    torch.testing.assert_close(grad(loss, logps), torch.tensor([[-5.0, -0.5]], **f64))


def test_top_entropy_share_keeps_ceil_share_of_the_rollout_not_trls_count():
    """--top_entropy_share keeps ceil(q n) tokens of the whole rollout: 2 of 4 at q 0.3, where TRL's
    top_entropy_quantile keeps floor(1 + q (n - 1)) = 1 of each micro-batch: a flag of another name
    because it means another thing (its --help says how)."""
    keep = top_entropy_mask(torch.tensor([[0.4, 0.1, 0.3, 0.2]]), torch.ones(1, 4), 0.3)
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert "TRL's top_entropy_quantile differs" in cli._field_docs(grpo.Config)["top_entropy_share"]


@pytest.mark.parametrize("length, want", [(5, 0.0), (6, 0.0), (7, -0.5), (9, -1.5), (10, -2.0)])
def test_overlong_penalty_is_dapo_eq_13(length, want):
    """L_max 10, buffer 4, factor 2: 0 up to 6 tokens, then -2 (|y| - 6) / 4."""
    assert overlong_penalty(torch.tensor([float(length)]), 10, 4, 2.0).item() == pytest.approx(want)


# -----------------------------------------------------------------------------
# the script: flags refused together, dynamic sampling


@pytest.mark.parametrize("flags, message", [
    (dict(adv_estimator="rloo"), "--scale_rewards none"),
    (dict(adv_estimator="reinforce_pp", scale_rewards="none", global_norm=True), "no --global_norm"),
    (dict(loss_type="cispo", epsilon_high=5.0, delta=6.0), "needs --loss_type grpo"),
    (dict(loss_type="cispo"), "caps the IS weight at --epsilon_high itself, as TRL does"),
    (dict(clip_ratio_c=3.0, loss_type="sapo"), "needs --loss_type grpo or dppo_"),
    (dict(delta=1.1), "must exceed 1 + --epsilon_high"),
    (dict(clip_ratio_c=0.5), "must exceed 1"),
    (dict(loss_type="gspo"), "--loss_type 'gspo'"),
    (dict(importance_sampling_level="seq"), "--importance_sampling_level 'seq'"),
    (dict(overlong_buffer_len=30, max_new_tokens=24), "at most --max_new_tokens"),
    (dict(lora=True, ref_refresh_every=2), "--lora runs under `python`"),
    (dict(lora=True, save_every=2), "--lora runs under `python`"),
    (dict(lora=True, resume=True), "--lora runs under `python`"),
    (dict(save_every=3, ref_refresh_every=2), "must be a multiple of --ref_refresh_every 2"),
])
def test_flags_that_cannot_go_together_are_refused(flags, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace("(", r"\(")):
        cfg = replace(cli.with_defaults(grpo.Config()), **flags)
        cli.check_ranges(cfg)  # each flag's range and choices
        conflicts.grpo(cfg, common.Dist())  # the flags that do not go together


@pytest.mark.parametrize("flag", ["lora", "compile"])
def test_lora_and_compile_are_refused_under_torchrun(flag):
    """--compile under FSDP2 would split the decode step into a graph per layer and re-record
    its CUDA graphs every rollout; LoRA's adapters are not merged when sharded."""
    conflicts.grpo(replace(cli.with_defaults(grpo.Config()), **{flag: True}), common.Dist())
    with pytest.raises(ValueError, match=f"--{flag} runs under `python`"):
        conflicts.grpo(replace(cli.with_defaults(grpo.Config()), **{flag: True}), common.Dist(torchrun=True))


def run_grpo(tmp_path, *extra):
    out = tmp_path / "run"
    args = ["grpo.py", "--model", "tiny", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
            "--max_new_tokens", "8", "--n_eval", "8", "--n_eval_pairs", "8", "--eval_every", "2",
            "--out_dir", str(out), *extra]
    proc = run_here(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r for r in read_metrics(out) if "loss" in r]


def test_dynamic_sampling_leaves_only_unfilled_groups_with_equal_rewards(tmp_path):
    """The random tiny policy's samples all score 0 on the sort task: with one round nothing can
    be replaced and every group is unfilled. With half the prompts scored by the digits reward
    (which its samples vary under) and up to 8 rounds, more rounds are drawn, and the
    equal-reward groups left are exactly the unfilled ones: none."""
    one = run_grpo(tmp_path / "one", "--dynamic_sampling", "--max_num_gen_batches", "1")  # the sort reward: all 0
    mixed = write_jsonl(tmp_path / "p.jsonl", [{"prompt": r["prompt"], "reward_fn": ("sort", "digits")[i % 2]}
                                              for i, r in enumerate(tasks.prompt_rows(64))])
    many = run_grpo(tmp_path / "many", "--dataset", mixed, "--dynamic_sampling", "--max_num_gen_batches", "8")
    for rows, rounds in ((one, 1), (many, None)):
        for r in rows:
            assert r["frac_reward_zero_std"] * 4 == pytest.approx(r["dynamic_sampling/unfilled_groups"])
            assert rounds is None or r["dynamic_sampling/rounds"] == rounds
    assert any(r["dynamic_sampling/unfilled_groups"] > 0 for r in one)
    assert all(r["dynamic_sampling/unfilled_groups"] == 0 for r in many)
    assert any(r["dynamic_sampling/rounds"] > 1 for r in many)


def test_every_variant_flag_runs_and_logs_the_rollout_gap(tmp_path):
    rows = run_grpo(tmp_path, "--loss_type", "cispo", "--epsilon_high", "5", "--importance_sampling_level", "sequence",
                    "--off_policy_mask_threshold", "0.5", "--top_entropy_share", "0.2",
                    "--vllm_importance_sampling_correction", "--adv_estimator", "rloo", "--scale_rewards", "none",
                    "--overlong_buffer_len", "4", "--num_iterations", "2")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")
    noise = fp32_rtol(forward_lengths(model.config, 64 + 8)) * logprob_size(model)  # fp32 on the CPU: two layouts
    for r in rows:
        assert r["rollout/logp_diff"] < noise and r["rollout/logp_diff_max"] < noise, (r, noise)
        assert r["reward/overlong"] <= 0


def variant_collectives(folder):
    return ("--dataset", test_grpo.write_digits_prompts(folder / "prompts.jsonl", 16), "--num_iterations", "2",
            "--num_mini_batches", "1", "--loss_type", "cispo", "--epsilon_high", "5", "--importance_sampling_level",
            "sequence_token", "--top_entropy_share", "0.5", "--off_policy_mask_threshold", "0.01",
            "--vllm_importance_sampling_correction", "--adv_estimator", "reinforce_pp", "--scale_rewards", "none",
            "--lr", "1e-4", "--warmup_steps", "0")


TWO_RANK_RUNS["grpo_variants"] = lambda folder, models: test_grpo.grpo_argv(folder / "run", *variant_collectives(folder))


def test_two_processes_match_one_process_with_the_variants_collectives(tmp_path, two_ranks):
    """The top-entropy threshold is taken over the whole rollout (an all-gather) and REINFORCE++
    whitens over the whole batch (an all-reduce): 2 ranks (FSDP2, gloo) must log the losses,
    rewards and gradient norms of 1 process on the same global batch, and end on its weights.
    Off-policy (2 passes), with every policy-term weight switched on. The 2-rank run is
    conftest.py's `two_ranks`."""
    # --no-shared_prompt: under torchrun each rank computes every row's prompt, so both sides sum in one order
    # (sharing moved the weights by 1.2e-5 over two steps at this lr, past the bound)
    out1, one = test_grpo.run_grpo(tmp_path, *variant_collectives(tmp_path), "--grad_accum", "2", "--no-shared_prompt")
    out2 = two_ranks("grpo_variants") / "run"
    one, two = ([r for r in rows if "loss" in r] for rows in (one, read_metrics(out2)))
    assert [r["step"] for r in two] == [1, 2]
    # within helpers.assert_runs_agree's derived bounds (2 optimizer steps a step: step 1's rollout
    # and first pass tight, the losses within rounding and Adam's drift; the loss a mean of CISPO's
    # weight, at most --epsilon_high 5, times advantages whitened to RMS 1; logp_diff is rounding
    # noise, within its own bound)
    config = models.load_model("tiny", models.load_tokenizer("tiny")).config
    size = logprob_size(models.load_model("tiny", models.load_tokenizer("tiny")))
    assert_runs_agree(one, two, config, length=64 + 8, lr=1e-4, updates=2, tokens=16 * 72,
                      keys=("reward", "reward_std", "loss", "grad_norm", "rollout/logp_diff"),
                      start_keys=test_grpo.ROLLOUT + ("rollout/logp_diff",),
                      scales={"loss": [5], "rollout/logp_diff": [size]})
    assert max_abs_diff(checkpoint_weights(out1), checkpoint_weights(out2)) <= adam_drift(1e-4, 4)
    assert test_grpo.moved_from_the_initial_weights(out1) > 1e-4


# -----------------------------------------------------------------------------
# DPO: sigmoid_norm, simpo, rpo


def pairs(seed=0, B=3):
    g = torch.Generator().manual_seed(seed)
    pc, pr = (-torch.rand(B, generator=g, **f64) * 20).requires_grad_(), (-torch.rand(B, generator=g, **f64) * 20).requires_grad_()
    rc, rr = -torch.rand(B, generator=g, **f64) * 20, -torch.rand(B, generator=g, **f64) * 20
    return pc, pr, rc, rr


def test_sigmoid_norm_equals_dpo_with_beta_over_l_when_every_response_has_length_l():
    pc, pr, rc, rr = pairs()
    L = torch.full((3,), 7.0, **f64)
    a, _ = dpo.dpo_loss(pc, pr, rc, rr, 0.7, 3, "sigmoid_norm", lengths=(L, L))
    b, _ = dpo.dpo_loss(pc, pr, rc, rr, 0.1, 3, "sigmoid")
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(grad(a, pc), grad(b, pc))


def test_sigmoid_norm_and_simpo_hand_values_with_distinct_lengths():
    pc, pr, rc, rr = (torch.tensor([v], **f64) for v in (-6.0, -12.0, -4.0, -9.0))
    lc, lr = torch.tensor([2.0], **f64), torch.tensor([4.0], **f64)
    h = (-6 + 4) / 2 - (-12 + 9) / 4  # -1 + 0.75
    loss, m = dpo.dpo_loss(pc, pr, rc, rr, 0.5, 1, "sigmoid_norm", lengths=(lc, lr))
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * h))))
    assert m["rewards/chosen"].item() == pytest.approx(0.5 * -1)
    # simpo: average log-probs alone (the reference values are ignored), margin gamma subtracted
    loss, m = dpo.dpo_loss(pc, pr, rc + 100, rr - 100, 2.0, 1, "simpo", lengths=(lc, lr), simpo_gamma=0.5)
    z = 2.0 * (-6 / 2 - -12 / 4) - 0.5  # 2 * 0 - 0.5
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-z))))
    assert m["rewards/chosen"].item() == pytest.approx(-6.0) and m["rewards/rejected"].item() == pytest.approx(-6.0)


def test_rpo_adds_alpha_times_the_chosen_nll_per_token_and_alpha_0_is_dpo():
    pc, pr, rc, rr = pairs(1)
    lengths = (torch.tensor([3.0, 5.0, 8.0], **f64), torch.tensor([4.0, 4.0, 2.0], **f64))
    base, _ = dpo.dpo_loss(pc, pr, rc, rr, 0.1, 6, "sigmoid", lengths=lengths)
    zero, _ = dpo.dpo_loss(pc, pr, rc, rr, 0.1, 6, "sigmoid", lengths=lengths, rpo_alpha=0.0)
    rpo, _ = dpo.dpo_loss(pc, pr, rc, rr, 0.1, 6, "sigmoid", lengths=lengths, rpo_alpha=0.5)
    torch.testing.assert_close(zero, base)
    nll = sum(-pc[i].item() / lengths[0][i].item() for i in range(3))
    assert rpo.item() == pytest.approx(base.item() + 0.5 * nll / 6)
    # its gradient adds -alpha / (L_c n_pairs) on the chosen log-prob only
    torch.testing.assert_close(grad(rpo, pc) - grad(base, pc), -0.5 / lengths[0] / 6)
    torch.testing.assert_close(grad(rpo, pr), grad(base, pr))


def test_simpo_loads_no_reference_and_trains(tmp_path, monkeypatch):
    loaded = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda name, *a, **kw: loaded.append(name) or load(name, *a, **kw))
    out = tmp_path / "run"
    proc = run_here(["dpo.py", "--model", "tiny", "--loss_type", "simpo", "--beta", "2.0", "--steps", "3",
                     "--batch_size", "8", "--n_train", "64", "--n_eval", "16", "--n_eval_prompts", "4",
                     "--eval_every", "3", "--out_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert loaded == ["tiny"]  # the policy alone
    refused = run_here(["dpo.py", "--model", "tiny", "--loss_type", "simpo", "--ref_model", "tiny",
                        "--out_dir", str(tmp_path / "refused")])
    assert refused.returncode != 0 and "drop --ref_model" in refused.stderr and not (tmp_path / "refused").exists()
    rows = read_metrics(out)
    assert rows[-1]["rewards/chosen"] < 0 and rows[-1]["loss"] > 0


# -----------------------------------------------------------------------------
# GRPO's defaults for a model of your own (TRL 1.16's) and TRL's loss_type names


def test_each_preset_fills_its_grpo_values_and_says_so():
    """The embedded task (`--model tiny` or `--dataset sort`) keeps the values its results were made
    with (beta 0.04, DAPO's clip-higher 0.28, 2 passes of 2 mini-batches, a reference loaded); a
    model and data of your own get TRL 1.16's (beta 0, epsilon 0.2, one pass of one mini-batch, no
    reference), named on the banner's defaults line; a flag given is kept; --help gives both values
    and why."""
    embedded = cli.with_defaults(grpo.Config(model="tiny", dataset="my.jsonl"))
    assert (embedded.beta, embedded.epsilon_high, embedded.num_iterations, embedded.num_mini_batches,
            embedded.reference) == (0.04, 0.28, 2, 2, True)
    cfg = grpo.Config(model="my-model", dataset="my.jsonl", num_mini_batches=4)
    line = cli.fill_defaults(cfg)
    assert (cfg.beta, cfg.epsilon_high, cfg.num_iterations, cfg.num_mini_batches, cfg.reference) == (0.0, 0.2, 1, 4, False)
    assert "TRL 1.16's" in line and "--beta 0 --epsilon_high 0.2 --num_iterations 1 --no-reference" in line
    assert "--num_mini_batches" not in line  # given, not filled
    helps = cli._field_docs(grpo.Config)
    for flag in ("beta", "epsilon_high", "num_iterations", "num_mini_batches"):
        assert "embedded task" in helps[flag] and "TRL's default" in helps[flag], flag


# TRL 1.16's GRPOTrainer._compute_loss, written out from its source for the loss types here: the policy term,
# beta x k3 added per token, then each type's aggregation of each micro-batch (over `ga` accumulation steps of
# `n_proc` processes, whose gradients DDP averages); the global accumulated batch's tokens for dapo and cispo
def trl_loss(loss_type, logps, old, ref, adv, mask, beta, eps_low, eps_high, max_len, n_proc=2, ga=2,
             sapo_temps=(1.0, 1.05)):
    per, total, num_items = logps.shape[0] // (n_proc * ga), 0.0, mask.sum()
    for k in range(n_proc * ga):
        r = slice(k * per, (k + 1) * per)
        lp, a, m = logps[r], adv[r][:, None], mask[r]
        coef_1 = torch.exp(lp - old[r])
        if loss_type == "cispo":
            ptl = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
        elif loss_type == "sapo":
            temps = torch.where(a > 0, sapo_temps[0], sapo_temps[1])
            ptl = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * a
        else:
            ptl = -torch.min(coef_1 * a, torch.clamp(coef_1, 1 - eps_low, 1 + eps_high) * a)
        if beta:
            ptl = ptl + beta * (torch.exp(ref[r] - lp) - (ref[r] - lp) - 1)
        if loss_type in ("grpo", "sapo"):
            loss = ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / ga
        elif loss_type == "dr_grpo":
            loss = (ptl * m).sum() / (per * max_len) / ga
        else:  # dapo, cispo
            loss = (ptl * m).sum() / (num_items / n_proc)
        total = total + loss / n_proc
    return total


TRL_LOSSES = {  # TRL's loss_type -> (its epsilon_high, beta) and what a TRL user passes here for it
    "dapo": (0.2, 0.04, ["--loss_type", "dapo"]),
    "dr_grpo": (0.2, 0.04, ["--loss_type", "dr_grpo"]),
    "grpo": (0.2, 0.04, ["--loss_type", "grpo"]),  # TRL's average comes with the name (before: token_mean)
    "cispo": (5.0, 0.04, ["--loss_type", "cispo", "--epsilon_high", "5"]),
    "sapo": (0.2, 0.04, ["--loss_type", "sapo"]),
    "default": (0.2, 0.0, []),  # a model of your own at this project's defaults: TRL's default, dapo at beta 0
}


@pytest.mark.parametrize("name", TRL_LOSSES)
def test_trls_loss_types_are_the_flags_they_map_to(name):
    """Each of TRL's GRPO loss types that has an equal here, computed as TRL computes it (trl_loss: 2
    processes x 2 accumulation steps) and by grpo_loss with the flags its name maps to (translated
    by the parser: `--loss_type dapo` -> `--loss_agg token_mean`), summed over the same 4
    micro-batches: the same loss and gradient, exactly."""
    eps_high, beta, argv = TRL_LOSSES[name]
    cfg = cli.with_defaults(cli.parse_config(grpo.Config, ["--model", "mine", "--dataset", "mine.jsonl", *argv,
                                                           "--beta", str(beta)]))
    assert cfg.epsilon_high == eps_high and cfg.epsilon_low == 0.2
    g = torch.Generator().manual_seed(1)
    B, T = 8, 6
    logps = (-torch.rand(B, T, generator=g, **f64) * 2).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g, **f64)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g, **f64)
    adv = torch.randn(B, generator=g, **f64)
    mask = (torch.arange(T)[None] < torch.tensor([6, 3, 4, 1, 5, 2, 6, 4])[:, None]).to(torch.float64)
    trl = trl_loss("dapo" if name == "default" else name, logps, old, ref, adv, mask, beta, 0.2, eps_high, T)
    normaliser = grpo.loss_normaliser(mask, cfg.loss_agg, T)
    ours = sum(grpo_loss(logps[r], old[r], ref[r], adv[r], mask[r], normaliser, epsilon_low=cfg.epsilon_low,
                         epsilon_high=cfg.epsilon_high, beta=cfg.beta, agg=cfg.loss_agg, loss_type=cfg.loss_type)[0]
               for r in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)))
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(ours, logps), grad(trl, logps), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value, says", [
    ("bnpo", "--loss_agg token_mean (TRL's dapo) is bnpo exactly where a step is one micro-batch on one process"),
    ("luspo", "--importance_sampling_level sequence --loss_agg constant"),
    ("vespo", "no VESPO"),
])
def test_trls_loss_types_without_an_equal_are_refused_saying_what_is_nearest(value, says, capsys):
    for argv in (["--loss_type", value], [f"--loss_type={value}"]):
        with pytest.raises(SystemExit):
            cli.parse_config(grpo.Config, argv)
        err = capsys.readouterr().err
        assert f"--loss_type {value} is TRL's, with no equal here" in err and says in err, err
    with pytest.raises(SystemExit):  # a TRL name and the flag it stands for, both given
        cli.parse_config(grpo.Config, ["--loss_type", "dr_grpo", "--loss_agg", "token_mean"])
    assert "and --loss_agg is given too: pass one of them" in capsys.readouterr().err
    # grpo and sapo are values here too: given with --loss_agg, the average given (SAPO's term at the token mean);
    # not given, PPO's term at the token mean (TRL's default dapo)
    for argv, want in ((["--loss_type", "grpo", "--loss_agg", "token_mean"], ("grpo", "token_mean")),
                       (["--loss_agg=constant", "--loss_type=sapo"], ("sapo", "constant")), ([], ("grpo", "token_mean"))):
        cfg = cli.parse_config(grpo.Config, argv)
        assert (cfg.loss_type, cfg.loss_agg) == want, argv


def test_a_beta_0_run_loads_no_reference_and_beta_above_0_does(tmp_path, monkeypatch):
    """TRL's default beta 0 for a model of your own: no frozen copy of the policy is made (TRL loads
    no reference model), the run logs no kl, and says so; with --beta 0.04, or --reference at beta 0
    (the embedded task's KL study measures a run without a KL term), the copy is made and kl is
    logged; with --lora and --beta 0.04 the reference is the policy, adapters off: no copy either."""
    from transformers import AutoModelForCausalLM

    tok = tasks.char_tokenizer()  # a model of your own: not tiny's shape (a checkpoint of tiny takes its presets)
    AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, n_layer=2)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    rows = write_jsonl(tmp_path / "p.jsonl", tasks.prompt_rows(32))
    frozen = []
    freeze = common.freeze
    monkeypatch.setattr(common, "freeze", lambda model, *a, **k: frozen.append(model) or freeze(model, *a, **k))
    for extra, copies, kl in (([], 0, False), (["--beta", "0.04"], 1, True), (["--reference"], 1, True),
                              (["--beta", "0.04", "--lora", "--lora_r", "4"], 0, True)):
        frozen.clear()
        out = tmp_path / f"run{len(extra)}"
        proc = run_here(["grpo.py", "--model", str(tmp_path / "m"), "--dataset", rows, "--steps", "1",
                         "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8", "--max_prompt_len", "32",
                         "--eval_every", "5", "--out_dir", str(out), *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(frozen) == copies, (extra, frozen)
        assert ("kl" in read_metrics(out)[-1]) == kl, extra
        assert ("no reference model is loaded" in proc.stdout) == (not extra), proc.stdout
