"""The exact off-policy study (studies/offpolicy_exact.py) holds the theory: the full importance weight
is unbiased, every correction is the on-policy gradient when there is no gap, replaying the sampler's
truncation is unbiased for the truncated policy's objective, and the enumeration's expectation is
what the sampler's own draws (sampling.sample_token) average to."""

import pytest
import torch

import sampling
from studies import offpolicy_exact as ox

V, T, SCALE = 4, 3, 1.5
SEQS, PREFIX = ox.enumerate_sequences(V, T)


def biases(gap, size, seed=0, corrections=None, reference_top_p=None):
    """{correction: bias} at one gap size on instance `seed`; reference_top_p replaces the top-p
    of the objective each correction is measured against (None: the one it claims)."""
    theta, rewards, noise = ox.instance(V, T, SCALE, seed)
    out, _ = ox.measure(theta, rewards, noise, gap, size, SEQS, PREFIX, corrections)
    if reference_top_p is not None:
        g_ref = ox.true_gradient(theta, SEQS, PREFIX, rewards, top_p=reference_top_p)
        return {n: ox.bias(mean, g_ref) for n, (mean, _, _) in out.items()}
    return {n: ox.bias(mean, g_true) for n, (mean, _, g_true) in out.items()}


def assert_unbiased(correction, seeds=(0, 1)):
    """The correction's expected gradient is the full policy's under the noise and temperature gaps
    (the sampler's support covers every sequence), to float64 round-off."""
    for seed in seeds:
        for gap, size in (("noise", 0.3), ("noise", 1.0), ("temperature", 1.3), ("temperature", 0.8)):
            b = biases(gap, size, seed, {"c": correction})["c"]
            assert b < 1e-10, (gap, size, seed, b)


def test_the_enumeration_covers_every_sequence_once_with_its_prefix_row():
    assert SEQS.shape == (V ** T, T) and len({tuple(s) for s in SEQS.tolist()}) == V ** T
    # the prefix row of token t is a function of y_<t alone, and different prefixes get different rows
    rows = {}
    for s, p in zip(SEQS.tolist(), PREFIX.tolist()):
        for t in range(T):
            assert rows.setdefault(tuple(s[:t]), p[t]) == p[t]
    assert sorted(rows.values()) == list(range(sum(V ** t for t in range(T))))
    theta, _, _ = ox.instance(V, T, SCALE, 0)
    torch.testing.assert_close(ox.sequence_probs(ox.table_probs(theta), SEQS, PREFIX).sum(),
                               torch.tensor(1.0, dtype=torch.float64))


def test_the_full_importance_weight_is_unbiased_and_no_correction_is_not():
    assert_unbiased(ox.CORRECTIONS["full_is"])
    for gap, size in (("noise", 0.3), ("temperature", 1.3)):
        b = biases(gap, size)
        assert b["none"] > 0.05 and b["token_tis"] > 0.02, b  # the gap is large enough to see


def test_an_inverted_importance_ratio_fails_the_unbiasedness_check():
    """The planted bug: mu / pi in place of pi / mu (arguments swapped) is caught by assert_unbiased."""
    full_is = ox.CORRECTIONS["full_is"][0]
    # the sampler's log-probs handed over as 2 log pi - log mu: the weight exp(log pi - that) is mu / pi
    inverted = (lambda lp, rl, A, m: full_is(lp, 2 * lp.detach() - rl, A, m), False)
    with pytest.raises(AssertionError):
        assert_unbiased(inverted, seeds=(0,))


@pytest.mark.parametrize("gap", list(ox.GAPS))
def test_with_no_gap_every_correction_is_the_on_policy_gradient(gap):
    theta, rewards, noise = ox.instance(V, T, SCALE, 2)
    no_gap = ox.GAPS[gap][0]
    out, logp_diff = ox.measure(theta, rewards, noise, gap, no_gap, SEQS, PREFIX)
    assert logp_diff == 0.0
    mean0, var0, g_true = out["none"]
    assert ox.bias(mean0, g_true) < 1e-12
    # with noise_top_p at eps 0 the sampler truncates and the trainer replays: on-policy for the truncated policy
    logits, temperature, top_p = ox.behaviour_logits(theta, noise, gap, no_gap)
    mu_table = ox.table_probs(logits, temperature, top_p)
    keep = ox.sequence_probs(mu_table, SEQS, PREFIX) > 0
    seqs, prefix = SEQS[keep], PREFIX[keep]
    rollout = mu_table[prefix, seqs].log()
    A = rewards[keep] - rollout.sum(-1).exp() @ rewards[keep]
    g_none = ox.per_sample_grads(theta, seqs, prefix, ox.CORRECTIONS["none"][0], rollout, A, top_p=top_p)
    for name, (loss_fn, replay) in ox.CORRECTIONS.items():
        mean, var, _ = out[name]
        torch.testing.assert_close(mean, g_true, rtol=0, atol=1e-12)
        torch.testing.assert_close(var, var0, rtol=1e-12, atol=0)
        # sample by sample, not only on average
        torch.testing.assert_close(ox.per_sample_grads(theta, seqs, prefix, loss_fn, rollout, A, top_p=top_p), g_none,
                                   rtol=0, atol=1e-12)


def test_replaying_the_truncation_is_unbiased_for_the_truncated_objective():
    for seed in (0, 1):
        for p in (0.95, 0.8, 0.6):
            b = biases("top_p", p, seed)
            assert b["replay"] < 1e-10, (seed, p, b)
            # the others miss both objectives: the sampler never draws what the truncation drops,
            # so not even the full importance weight recovers the full policy's gradient ...
            assert b["none"] > 1e-3 and b["full_is"] > 1e-3, (seed, p, b)
            # ... and training the full policy's log-probs is not the truncated policy's gradient
            b_trunc = biases("top_p", p, seed, reference_top_p=p)
            assert b_trunc["none"] > 1e-3, (seed, p, b_trunc)

    # with the sampler's logits noisy, the replay is exact only where both sides keep the same top-p
    # sets: where they differ, the sampler draws tokens the trainer's rule drops and never draws some it
    # keeps, and not even the full weight is unbiased
    seen = set()
    for seed in (0, 1):
        theta, _, noise = ox.instance(V, T, SCALE, seed)
        for eps in (0.1, 0.3, 1.0):
            kept_mu = torch.isfinite(ox.truncate(theta + eps * noise, ox.NOISE_TOP_P))  # (S, V)
            kept_pi = torch.isfinite(ox.truncate(theta, ox.NOISE_TOP_P))
            drawn = ox.sequence_probs(kept_mu.double(), SEQS, PREFIX) + ox.sequence_probs(kept_pi.double(), SEQS, PREFIX) > 0
            reached = PREFIX[drawn].unique()  # the prefixes either side can reach
            same = torch.equal(kept_mu[reached], kept_pi[reached])
            b = biases("noise_top_p", eps, seed)
            assert (b["full_is"] < 1e-10) if same else (1e-2 < b["full_is"] < b["none"]), (seed, eps, same, b)
            seen.add(same)
    assert seen == {True, False}  # both cases met


def test_per_sample_gradients_are_autograds_through_the_policy():
    """The closed-form chain of per_sample_grads against autograd of a weighted sum of the losses
    with the log-probs computed from theta (a different weight per sequence, so a row mixed up shows)."""
    theta, rewards, noise = ox.instance(V, T, SCALE, 3)
    c = torch.rand(len(SEQS), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for name in ("token_tis", "sequence_mask", "dppo_tv", "replay"):
        loss_fn, replay = ox.CORRECTIONS[name]
        top_p = 0.8 if replay else 1.0
        rollout = ox.table_probs(theta + 0.5 * noise)[PREFIX, SEQS].log()
        A = rewards - rewards.mean()
        th = theta.clone().requires_grad_()
        # the trainer's log-probs as autograd sees them; replaying, a sequence the trainer's own rule
        # would drop keeps its sampled tokens (the labels), so every row is finite
        lp = ox.trainer_probs(th, SEQS, PREFIX, top_p).gather(-1, SEQS[..., None]).squeeze(-1).log()
        dropped = ~torch.isfinite(torch.log_softmax(ox.truncate(theta, top_p), -1)[PREFIX, SEQS]).all(-1)
        assert dropped.any() == replay  # the labels' path is exercised
        # one call per sequence: the batch's loss is the sum of its sequences' (rows independent)
        loss = sum(c[n] * loss_fn(lp[n:n + 1], rollout[n:n + 1], A[n:n + 1], torch.ones(1, T, dtype=lp.dtype))
                   for n in range(len(SEQS)))
        (want,) = torch.autograd.grad(-loss, th)
        g = ox.per_sample_grads(theta, SEQS, PREFIX, loss_fn, rollout, A, top_p=top_p)
        torch.testing.assert_close(c @ g, want.reshape(-1), rtol=1e-10, atol=1e-12)


def sampler_draws(logits_table, temperature, top_p, n, seed):
    """n sequences drawn token by token by the sampler itself (sampling.sample_token); their
    indices into SEQS."""
    g = torch.Generator().manual_seed(seed)
    code = torch.zeros(n, dtype=torch.long)
    offset = 0
    for t in range(T):
        tok = sampling.sample_token(logits_table[offset + code], temperature=temperature, top_p=top_p, generator=g)
        offset += V ** t
        code = code * V + tok
    return code  # SEQS is enumerated in base-V order: sequence (y_0, ..., y_{T-1}) is row sum y_t V^(T-1-t)


@pytest.mark.parametrize("gap,size", [("noise", 0.7), ("temperature", 1.4), ("top_p", 0.8)])
def test_the_exact_expectation_is_what_the_samplers_draws_average_to(gap, size):
    theta, rewards, noise = ox.instance(V, T, SCALE, 4)
    logits, temperature, top_p = ox.behaviour_logits(theta, noise, gap, size)
    mu_table = ox.table_probs(logits, temperature, top_p)
    mu = ox.sequence_probs(mu_table, SEQS, PREFIX)
    n = 20000
    idx = sampler_draws(logits, temperature, top_p, n, seed=0)
    # the sampler draws exactly the enumeration's support: nothing it drops, everything it keeps
    assert (mu[idx] > 0).all()
    assert set(idx.tolist()) >= set(torch.nonzero(mu > 1e-3).flatten().tolist())
    keep = mu > 0  # top-p: the sequences the sampler can draw
    row = torch.cumsum(keep, 0) - 1  # a drawn sequence's row among them
    rollout = mu_table[PREFIX[keep], SEQS[keep]].log()
    A = rewards[keep] - mu[keep] @ rewards[keep]
    for name in ("token_tis", "full_is"):
        g = ox.per_sample_grads(theta, SEQS[keep], PREFIX[keep], ox.CORRECTIONS[name][0], rollout, A)  # (n, P)
        mean, var = ox.exact_moments(mu[keep], g)
        draws = g[row[idx]]
        # the standard error from the exact variance of each coordinate: the draws' own underestimates
        # it where a rare sequence carries a large gradient and was not drawn
        se = (mu[keep] @ (g - mean) ** 2 / n).sqrt()
        live = se > 0
        z = ((draws.mean(0) - mean).abs()[live] / se[live]).max()
        assert z < 4.5, (name, float(z))
        assert abs(float(((draws - draws.mean(0)) ** 2).sum(-1).mean() / var) - 1) < 0.1
