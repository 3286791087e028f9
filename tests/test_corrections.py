"""The sampler-trainer corrections (TRL 1.16's vllm_importance_sampling_mode: token and sequence,
truncated and masked; verl's and SkyRL's geometric sequence mask) and the two losses of 2026
(DPPO's binary TV and KL trust regions, MaxRL's mean-normalised advantage): each equal to a hand
computation written from the peer's code (function and file named in each test), its gradient
against autograd of the peer's own form, and MaxRL's claim checked by exact enumeration."""
import itertools
import math
from dataclasses import replace

import pytest
import torch

import common
import grpo
from grpo import dppo_mask, grpo_loss, group_advantages, policy_loss, rollout_is_weights
from helpers import forward_lengths, fp32_rtol, logprob_size, read_metrics, run_here, write_jsonl
from plumbing import cli, conflicts

f64 = dict(dtype=torch.float64)


def rollout_case():
    """Trainer (old) and sampler log-probs of 3 rows of lengths 4, 2, 3 (padding that would change
    any result it leaked into): token log-ratios from -1.5 to 1.2, sequence sums 1.5, -1.3 and -0.1."""
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.3, 9.0], [-0.2, -1.0, 9.0, 9.0, 9.0], [-0.7, -0.1, -1.2, 9.0, 9.0]], **f64)
    log_r = torch.tensor([[1.2, 0.1, -0.3, 0.5, 7.0], [0.2, -1.5, 7.0, 7.0, 7.0], [-0.4, 0.6, -0.3, 7.0, 7.0]], **f64)
    mask = (torch.arange(5)[None] < torch.tensor([4, 2, 3])[:, None]).to(torch.float64)
    return old, old - log_r, mask


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's importance_sampling_ratio, as trl/trainer/grpo_trainer.py's
    _generate_and_score_completions computes it: (old - sampling) * mask, summed over the
    sequence for sequence_*, exp; *_truncate clamps to [C_min, C_max], *_mask sets the ratios
    outside them to 0 (a None bound: -inf or inf)."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (1 / 3, 3.0), (0.5, None)])
def test_each_trl_mode_equals_trls_formula(mode, bounds):
    old, rollout, mask = rollout_case()
    w, outside = rollout_is_weights(old, rollout, mask, mode, *bounds)
    want = trl_is_ratio(old, rollout, mask, mode, *bounds)
    torch.testing.assert_close(w, want)
    assert w.shape == ((3, 1) if mode.startswith("sequence") else (3, 5)) and not w.requires_grad
    r = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True) if mode.startswith("sequence") else old - rollout)
    lo, hi = bounds[0] or 0.0, bounds[1] or math.inf
    torch.testing.assert_close(outside, ((r < lo) | (r > hi)).expand_as(mask) & mask.bool())


def test_hand_values_of_the_default_sequence_mask_and_icepop():
    """The defaults (TRL 1.16: sequence_mask, C_max 3, no C_min): row 0's product exp(1.5) = 4.48
    leaves [0, 3], masked whole; rows 1 and 2 keep their ratios exp(-1.3), exp(-0.1). IcePop (token_mask in
    [1/3, 3]): the tokens of ratio exp(1.2) = 3.32 and exp(-1.5) = 0.22 are masked, the rest keep theirs."""
    old, rollout, mask = rollout_case()
    w, outside = rollout_is_weights(old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[0.0], [math.exp(-1.3)], [math.exp(-0.1)]], **f64))
    assert outside.sum(-1).tolist() == [4, 0, 0]
    w, outside = rollout_is_weights(old, rollout, mask, "token_mask", 1 / 3, 3.0)
    assert (w == 0).nonzero().tolist() == [[0, 0], [1, 1]] and outside.nonzero().tolist() == [[0, 0], [1, 1]]
    assert w[0, 1].item() == pytest.approx(math.exp(0.1)) and w[0, 4].item() == 1.0  # padding: ratio 1, untouched


def test_geometric_sequence_mask_equals_skyrls_and_verls_seq_mean_k1():
    """SkyRL's compute_sequence_mask(..., "geometric") (skyrl/backends/skyrl_train/utils/
    off_policy_correction_utils.py): exp(sum_t log r_t / n_tokens) outside [geo_mask_low,
    geo_mask_high] -> 0, else 1; verl's rollout_rs=seq_mean_k1 (rollout_corr_helper.py) keeps
    log-lower <= mean_t log r_t <= log-upper. Rows' means 0.375, -0.65, -0.033."""
    old, rollout, mask = rollout_case()
    for lo, hi in ((0.9, 1.1), (0.5, 1.5), (0.97, 2.0)):
        w, outside = rollout_is_weights(old, rollout, mask, "sequence_geometric_mask", lo, hi)
        geo = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        torch.testing.assert_close(w, (~((geo > hi) | (geo < lo))).to(w))
        mean_log = ((old - rollout) * mask).sum(-1) / mask.sum(-1)
        assert w[:, 0].bool().tolist() == ((mean_log >= math.log(lo)) & (mean_log <= math.log(hi))).tolist()
        assert outside.any(-1).tolist() == (w[:, 0] == 0).tolist()
    assert rollout_is_weights(old, rollout, mask, "sequence_geometric_mask", 0.6, 1.5)[0][:, 0].tolist() == [1, 0, 1]


def test_with_no_gap_every_mode_is_the_identity():
    old, _, mask = rollout_case()
    for mode in grpo.IS_MODES:
        w, outside = rollout_is_weights(old, old.clone(), mask, mode, 0.9 if "geometric" in mode else None, 1.1)
        assert (w == 1).all() and not outside.any()


# -----------------------------------------------------------------------------
# DPPO: the binary TV and KL trust regions


def dppo_case():
    """Probabilities old -> new of 6 tokens, advantages of both signs: a rare token's tenfold rise
    (0.01 -> 0.1, ratio 10: PPO clips it; TV 0.09 keeps it; binary KL 0.071 masks it at 0.05), a
    likely token's rise past TV 0.2 (0.5 -> 0.8), a fall past it (0.9 -> 0.6), small moves, and a rise
    (0.3 -> 0.6) where the advantage is negative: pushing the token down, no trust region stops it."""
    p_old = torch.tensor([[0.01, 0.5, 0.9], [0.3, 0.6, 0.05]], **f64)
    p = torch.tensor([[0.1, 0.8, 0.6], [0.6, 0.45, 0.02]], **f64)
    A = torch.tensor([[1.5], [-0.8]], **f64)
    return p.log().requires_grad_(), p_old.log(), A


def verl_dppo(logps, old_logps, A, kind, low, high, c):
    """verl's compute_policy_loss_dppo_tv / compute_policy_loss_dppo_kl (verl/trainer/ppo/
    core_algos.py, from the paper's sail-sg/Stable-RL): valid = (p - p_old <= high) for A > 0,
    (p - p_old >= -low) otherwise; KL: valid = (kl <= high) | (p <= p_old) for A > 0, (kl <= low) |
    (p >= p_old) otherwise; loss = -A sg[min(ratio, c)] log_prob valid."""
    ratio = torch.exp(logps - old_logps)
    prob, old_prob = torch.exp(logps), torch.exp(old_logps)
    if kind == "dppo_tv":
        valid_pos, valid_neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        kl = old_prob * (old_logps - logps) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_pos, valid_neg = (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)
    valid = torch.where(A > 0, valid_pos, valid_neg).detach().to(logps)
    return -A * torch.clamp(ratio, max=c).detach() * logps * valid, valid


def prime_rl_dppo(logps, inference_logps, A, low, high):
    """prime-rl's default_loss_fn (src/prime_rl/trainer/rl/loss.py), its policy term: -A ratio keep,
    keep = not (p - p_inf > dppo_mask_high for A > 0, p - p_inf < -dppo_mask_low otherwise)."""
    ratio = torch.exp(logps - inference_logps)
    diff = torch.exp(logps) - torch.exp(inference_logps)
    keep = ~torch.where(A > 0, diff > high, diff < -low)
    return -(keep * A * ratio)


@pytest.mark.parametrize("kind, low, high, masked", [("dppo_tv", 0.2, 0.2, [[0, 1, 0], [0, 0, 0]]),
                                                     ("dppo_tv", 0.2, 0.05, [[1, 1, 0], [0, 0, 0]]),
                                                     ("dppo_tv", 0.1, 0.2, [[0, 1, 0], [0, 1, 0]]),
                                                     ("dppo_kl", 0.04, 0.05, [[1, 1, 0], [0, 1, 0]])])
def test_dppo_masks_hand_values_and_equals_verls_loss_gradient(kind, low, high, masked):
    logps, old, A = dppo_case()
    m = dppo_mask(logps, old, A, kind, low, high)
    assert (1 - m).tolist() == masked and not m.requires_grad
    rho = torch.exp(logps - old)
    for c in (0.0, 3.0):  # no truncation; verl's clip_ratio_c 3 (it truncates the 10x token's weight)
        ours = policy_loss(rho, logps, A, loss_type=kind, epsilon_low=low, epsilon_high=high, clip_ratio_c=c,
                           old_logps=old)
        theirs, valid = verl_dppo(logps, old, A, kind, low, high, c or 1e9)
        torch.testing.assert_close(valid, m)
        g_ours, = torch.autograd.grad(ours.sum(), logps)
        g_theirs, = torch.autograd.grad(theirs.sum(), logps)
        torch.testing.assert_close(g_ours, g_theirs)
    if kind == "dppo_tv":  # its value (c off) is prime-rl's and SkyRL's -A ratio mask, not verl's -A ratio log p
        torch.testing.assert_close(policy_loss(rho, logps, A, loss_type=kind, epsilon_low=low, epsilon_high=high,
                                               old_logps=old), prime_rl_dppo(logps, old, A, low, high))


def test_dppo_gradient_by_finite_differences_and_on_policy():
    """d loss / d log pi of grpo_loss(dppo_tv), token_mean over 6 tokens: -A rho m / 6 by central
    differences (the mask held at its value: no threshold lies within h of a probability here);
    on-policy (old = logps) it is GRPO's gradient, whatever the thresholds."""
    logps, old, A = dppo_case()
    mask = torch.ones(2, 3, **f64)
    kw = dict(loss_type="dppo_tv", epsilon_low=0.2, epsilon_high=0.2)
    g, = torch.autograd.grad(grpo_loss(logps, old, old, A[:, 0], mask, 6.0, **kw)[0], logps)
    h, fd = 1e-6, torch.zeros(2, 3, **f64)
    for i, j in itertools.product(range(2), range(3)):
        e = torch.zeros(2, 3, **f64)
        e[i, j] = h
        fd[i, j] = (grpo_loss(logps.detach() + e, old, old, A[:, 0], mask, 6.0, **kw)[0]
                    - grpo_loss(logps.detach() - e, old, old, A[:, 0], mask, 6.0, **kw)[0]) / (2 * h)
    torch.testing.assert_close(g, fd, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(g, -A * torch.exp(logps - old).detach() * dppo_mask(logps, old, A, "dppo_tv", 0.2, 0.2) / 6)
    on = logps.detach().requires_grad_()
    for kind in ("dppo_tv", "dppo_kl"):
        base, = torch.autograd.grad(grpo_loss(on, on.detach(), old, A[:, 0], mask, 6.0)[0], on)
        got, = torch.autograd.grad(grpo_loss(on, on.detach(), old, A[:, 0], mask, 6.0, loss_type=kind)[0], on)
        torch.testing.assert_close(got, base)


def test_dppo_masked_tokens_are_its_clip_ratio_metrics():
    logps, old, A = dppo_case()
    _, m = grpo_loss(logps, old, old, A[:, 0], torch.ones(2, 3, **f64), 6.0, loss_type="dppo_kl", epsilon_low=0.04,
                     epsilon_high=0.05)
    assert m["clip_ratio/high"].item() == pytest.approx(2 / 6) and m["clip_ratio/low"].item() == pytest.approx(1 / 6)


# -----------------------------------------------------------------------------
# MaxRL: the mean-normalised advantage


def test_maxrl_advantage_equals_prime_rls_and_skyrls():
    """prime-rl's MaxRLAlgorithm.score_group (src/prime_rl/orchestrator/algo/max_rl.py): zeros if the
    group's mean <= 0, else (r - mean) / mean; SkyRL's compute_maxrl_advantage (skyrl/backends/
    skyrl_train/utils/ppo_utils.py): (r - mean) / (mean + 1e-6), equal for rewards >= 0."""
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.5, 0.0, 1.5],
                      [-1.0, 0.5, 0.0, 0.0]], **f64)
    adv, _ = group_advantages(r, "none", estimator="maxrl")
    for row, a in zip(r, adv):
        mean = row.mean()
        prime = torch.zeros_like(row) if mean <= 0 else (row - mean) / mean
        torch.testing.assert_close(a, prime)
        if (row >= 0).all():
            torch.testing.assert_close(a, (row - mean) / (mean + 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adv[0], torch.tensor([3.0, -1.0, -1.0, -1.0], **f64))  # p = 1/4: the success x 3


@pytest.mark.parametrize("G", [2, 3, 4])
def test_maxrl_expected_gradient_is_truncated_maximum_likelihood_by_enumeration(G):
    """MaxRL's claim (arXiv:2602.02710), exactly: a policy over 3 answers (softmax of logits), answer 0
    right (reward 1). Enumerating all 3^G groups, E[(1/G) sum_i A_i grad log pi(y_i)] with MaxRL's A
    equals the gradient of -sum_{k=1}^{G-1} (1 - p)^k / k, p = pi(0): log p's Taylor series
    truncated at order G - 1 (the mean counts each sample itself). GRPO's std-scaled A does not."""
    theta = torch.tensor([-0.4, 0.3, 0.9], **f64, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    expected = {"maxrl": torch.zeros(3, **f64), "grpo": torch.zeros(3, **f64)}
    for ys in itertools.product(range(3), repeat=G):
        prob = math.exp(sum(logp[y].item() for y in ys))
        r = torch.tensor([[float(y == 0) for y in ys]], **f64)
        for est, scale in (("maxrl", "none"), ("grpo", "group")):
            A, _ = group_advantages(r, scale, estimator=est)
            surrogate = sum(A[0, i] * logp[y] for i, y in enumerate(ys)) / G
            expected[est] += prob * torch.autograd.grad(surrogate, theta, retain_graph=True)[0]
    p = torch.exp(logp[0])
    truncated = -sum((1 - p) ** k / k for k in range(1, G))
    want, = torch.autograd.grad(truncated, theta)
    torch.testing.assert_close(expected["maxrl"], want)
    assert (expected["grpo"] - want).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# the script: flags refused together, the weights' metrics, a user model


@pytest.mark.parametrize("flags, message", [
    (dict(loss_type="dppo_tv", importance_sampling_level="sequence"), "DPPO's trust region is per token"),
    (dict(vllm_importance_sampling_clip_min=3.0), "must be less than --vllm_importance_sampling_clip_max"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
     "needs --vllm_importance_sampling_clip_min or --vllm_importance_sampling_clip_max"),
    (dict(adv_estimator="maxrl"), "--scale_rewards none"),
])
def test_correction_and_loss_flags_that_cannot_go_together_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        cfg = replace(cli.with_defaults(grpo.Config()), **flags)
        cli.check_ranges(cfg)
        conflicts.grpo(cfg, common.Dist())


def test_policy_weights_combine_the_masks_and_log_what_the_correction_touched():
    """policy_weights (the loop's one call): DeepSeek-V3.2's mask x the kept tokens x the correction; the share of
    tokens and of sequences outside the bounds over the global mini-batch (here 8 rows x 11 tokens
    in 2 mini-batches of 4 rows: this micro-batch is 3 of them)."""
    old, rollout, mask = rollout_case()
    cfg = replace(cli.with_defaults(grpo.Config()), prompts_per_step=2, group_size=4, num_mini_batches=2,
                  off_policy_mask_threshold=0.5, vllm_importance_sampling_correction=True)
    adv = torch.tensor([1.0, -1.0, -1.0], **f64)
    keep = torch.ones(3, 5, **f64)
    keep[2, 1] = 0  # --top_entropy_share left this token out
    w, m = grpo.policy_weights(cfg, old, old, rollout, adv, mask, keep, n_tokens=torch.tensor(11.0, **f64))
    # row 1: A < 0 and mean log(pi_rollout / pi) = 0.65 > 0.5: DeepSeek's mask; row 0: TRL's mask
    want = torch.tensor([[0.0], [0.0], [math.exp(-0.1)]], **f64) * keep
    torch.testing.assert_close(w, want)
    assert m["sampling/importance_sampling_ratio/outside_tokens"].item() == pytest.approx(4 / 11)
    assert m["sampling/importance_sampling_ratio/outside_sequences"].item() == pytest.approx(1 / 4)
    assert m["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(
        (math.exp(-1.3) + math.exp(-0.1)) / 4)


def test_dppo_maxrl_and_icepop_train_a_llama_and_log_no_gap(tmp_path, user_models):
    """A Llama-shaped model (BOS, chat template) with the new flags: every step logs the correction's
    metrics, and in fp32 on the CPU the sampler is the trainer, so nothing is outside [1/3, 3]."""
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "solution": str(i)} for i in range(8)]
    proc = run_here(["grpo.py", "--model", user_models["llama"], "--dataset", write_jsonl(tmp_path / "p.jsonl", rows),
                     "--reward_fn", "digits", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                     "--max_new_tokens", "6", "--max_prompt_len", "64", "--n_eval", "4", "--eval_every", "2",
                     "--loss_type", "dppo_kl", "--epsilon_low", "0.05", "--epsilon_high", "0.05",
                     "--adv_estimator", "maxrl", "--scale_rewards", "none", "--vllm_importance_sampling_correction",
                     "--vllm_importance_sampling_mode",
                     "token_mask", "--vllm_importance_sampling_clip_min", "0.3333", "--out_dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(steps) == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(user_models["llama"])
    gap = fp32_rtol(forward_lengths(model.config, 64 + 6)) * logprob_size(model)  # two layouts' log-probs
    for r in steps:  # exp(gap) - 1 < 2 gap for a gap this small
        assert r["sampling/importance_sampling_ratio/outside_tokens"] == 0
        assert r["sampling/importance_sampling_ratio/mean"] == pytest.approx(1, abs=2 * gap)
