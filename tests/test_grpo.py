"""Tests of grpo.py: the math on hand cases and exact enumeration, the rejection sampler against
an independent probability tree, LoRA's reference, and a subprocess run of the script."""
import copy
import importlib.util
import math
import types

import datasets
import pytest
import torch

import common
import data
import environment
import reward_fns
import grpo
import sampling
import tasks
from grpo import (aggregate, group_advantages, grpo_loss, kl_per_token, loss_normaliser,
                  rejection_sample)
from environment import truncate_mask
from helpers import (TWO_RANK_RUNS, adam_drift, assert_runs_agree, checkpoint_weights, forward_lengths, fp32_rtol,
                     gamma, logprob_size, max_abs_diff, read_metrics, run_here, write_jsonl)
from plumbing import cli, conflicts, models


# -----------------------------------------------------------------------------
# KL estimators on a toy categorical policy pi = softmax(theta), every outcome enumerated


def toy(V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_()
    ref_logp = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), 0)
    return theta, ref_logp


def per_sample_grads(theta, ref_logp, estimator):
    """(V, V): row x is the gradient wrt theta of the estimator evaluated at sample x."""
    rows = []
    for x in range(theta.shape[0]):
        logp = torch.log_softmax(theta, 0)[x]
        k = kl_per_token(logp, ref_logp[x], logp.detach(), estimator)  # old = pi itself: on-policy
        rows.append(torch.autograd.grad(k, theta)[0])
    return torch.stack(rows)


def closed_form_grads(theta, ref_logp):
    logp = torch.log_softmax(theta, 0)
    reverse = (logp.exp() * (logp - ref_logp)).sum()  # KL(pi || pi_ref)
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()  # KL(pi_ref || pi)
    return (torch.autograd.grad(reverse, theta, retain_graph=True)[0], torch.autograd.grad(forward, theta)[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator, target", [("k1", "zero"), ("k2", "reverse"), ("k3", "forward"),
                                               ("ratio_k1", "reverse"), ("ratio_k3", "reverse")])
def test_kl_estimator_expected_gradient_exact(seed, estimator, target):
    theta, ref_logp = toy(seed=seed)
    pi = torch.softmax(theta, 0).detach()
    expected_grad = (pi[:, None] * per_sample_grads(theta, ref_logp, estimator)).sum(0)  # E_pi[grad k(x)]
    reverse, forward = closed_form_grads(theta, ref_logp)
    want = {"zero": torch.zeros_like(reverse), "reverse": reverse, "forward": forward}[target]
    torch.testing.assert_close(expected_grad, want, rtol=1e-10, atol=1e-12)
    # the three targets differ on this toy, so a wrong estimator cannot pass by accident
    others = [v for k, v in {"zero": torch.zeros_like(reverse), "reverse": reverse, "forward": forward}.items()
              if k != target]
    assert all((expected_grad - o).abs().max() > 1e-3 for o in others)


# on-policy distillation: the per-token advantage coef (log q - log pi) through grpo_loss


def distill_loss_per_outcome(theta, teacher_logp, T=1):
    """grpo_loss at each outcome x of the toy policy (the batch's rows: a one-token completion x,
    one per row), its per-token advantage from distill_advantages, on-policy (old = pi), no KL term,
    weighted by pi(x) through pg_weights and summed (normaliser 1): the expected loss, whose
    gradient is the expected policy gradient."""
    V = theta.shape[0]
    logps = torch.log_softmax(theta, 0)[:, None].expand(V, T)  # (V, T): row x is outcome x
    mask = torch.ones(V, T, dtype=torch.float64)
    adv = grpo.distill_advantages(teacher_logp[:, None].expand(V, T), logps, mask, coef=1.0)  # (V, T)
    pi = torch.softmax(theta, 0).detach()[:, None]
    loss, _ = grpo_loss(logps, logps.detach(), logps.detach(), adv, mask, normaliser=1.0, agg="token_mean",
                        pg_weights=pi)
    return loss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distillation_expected_gradient_is_the_reverse_kl_gradient(seed):
    """--teacher: E_x~pi[policy gradient with advantage log q(x) - log pi(x)] = grad KL(pi || q),
    every outcome of a toy categorical policy enumerated (not the forward KL, not zero); a flipped
    sign or the teacher and student swapped gives minus it."""
    theta, teacher_logp = toy(seed=seed)
    grad = torch.autograd.grad(distill_loss_per_outcome(theta, teacher_logp), theta)[0]
    reverse, forward = closed_form_grads(theta, teacher_logp)
    torch.testing.assert_close(grad, reverse, rtol=1e-10, atol=1e-12)
    assert (grad - forward).abs().max() > 1e-3 and grad.abs().max() > 1e-3


@pytest.mark.parametrize("checkpointing", [False, True])
def test_distillation_from_a_teacher_equal_to_the_student_leaves_the_policy_unchanged(tmp_path, checkpointing):
    """--teacher the policy itself, the task reward weighted 0 and no KL term: every token's
    advantage is log pi - log pi = 0 (the teacher's log-probs are the policy's, computed the same
    way), so no gradient, and the checkpoint equals the start; the reverse KL logged is 0, with and
    without --activation_checkpointing (under which the policy cannot share prompts: transformers
    turns its cache off; the frozen teacher could): both passes run one plan (shared_prompt.plan),
    decided for the policy and the teacher together. Planted: the plan's `models=[model]` alone, the
    checkpointed policy's padded forward against a sharing teacher, makes it -6e-8 and -1.2e-7."""
    from transformers import AutoModelForCausalLM

    tok = tasks.char_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    data = write_digits_prompts(tmp_path / "prompts.jsonl", 8)
    grpo.main(grpo.Config(model=str(tmp_path / "m"), teacher=str(tmp_path / "m"), reward_weights="rule:0", beta=0.0,
                          dataset=data, out_dir=str(tmp_path / "g"), steps=2, prompts_per_step=4, group_size=2,
                          max_prompt_len=64, max_new_tokens=6, lr=1e-2, warmup_steps=0, eval_every=100, n_eval_pairs=4,
                          activation_checkpointing=checkpointing))
    rows = [r for r in read_metrics(tmp_path / "g") if r["step"] > 0]
    assert [r["distill/reverse_kl"] for r in rows] == [0.0, 0.0]
    assert max_abs_diff(checkpoint_weights(tmp_path / "g"), checkpoint_weights(tmp_path, "m")) == 0.0


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    """On-policy distillation scores the policy's own token ids with the teacher: a teacher whose
    vocabulary differs is refused before training, naming --teacher."""
    from transformers import AutoModelForCausalLM

    tok = tasks.char_tokenizer()
    model = AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    tok.add_tokens(["<tool>"])
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    data = write_digits_prompts(tmp_path / "prompts.jsonl", 8)
    with pytest.raises(ValueError, match=r"--teacher .*t: its tokenizer"):
        grpo.main(grpo.Config(model=str(tmp_path / "m"), teacher=str(tmp_path / "t"), dataset=data,
                              out_dir=str(tmp_path / "g"), steps=1, prompts_per_step=4, group_size=2,
                              max_prompt_len=64, max_new_tokens=8))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "ratio_k1"])
def test_kl_estimator_gradient_monte_carlo(estimator):
    """Mean of sampled per-sample gradients agrees with the exact one within 4 standard errors."""
    theta, ref_logp = toy(seed=3)
    pi = torch.softmax(theta, 0).detach()
    grads = per_sample_grads(theta, ref_logp, estimator)  # (V, V)
    n = 20000
    x = torch.multinomial(pi, n, replacement=True, generator=torch.Generator().manual_seed(0))
    samples = grads[x]  # (n, V) per-sample gradients
    mc, se = samples.mean(0), samples.std(0) / math.sqrt(n)
    exact = (pi[:, None] * grads).sum(0)
    assert ((mc - exact).abs() <= 4 * se + 1e-12).all(), (mc, exact, se)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimator_values(seed):
    theta, ref_logp = toy(seed=seed)
    logp = torch.log_softmax(theta, 0).detach()
    pi = logp.exp()
    kl = (pi * (logp - ref_logp)).sum()
    for est in ("k1", "k3"):  # unbiased for KL(pi || pi_ref), exactly
        torch.testing.assert_close((pi * kl_per_token(logp, ref_logp, logp, est)).sum(), kl)
    k2_mean = (pi * kl_per_token(logp, ref_logp, logp, "k2")).sum()
    assert abs(k2_mean - kl) > 1e-4  # k2 is biased: the test above would catch a swap
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_per_token(a, b, a, "k3") >= 0).all()
    assert (kl_per_token(a, b, a, "k1") < 0).any()  # k1 is not


# -----------------------------------------------------------------------------
# the clipped surrogate


def surrogate_grad(rho, adv, eps_low=0.2, eps_high=0.28):
    """d loss / d logp for one token whose ratio to the old policy is rho."""
    f64 = dict(dtype=torch.float64)
    logp = torch.tensor([[0.0]], requires_grad=True, **f64)
    old = torch.tensor([[-math.log(rho)]], **f64)
    loss, m = grpo_loss(logp, old, old, torch.tensor([float(adv)], **f64), torch.ones(1, 1, **f64), 1.0, eps_low, eps_high)
    loss.backward()
    return logp.grad.item(), m


@pytest.mark.parametrize("rho, adv, want, clip", [
    (1.5, +1, 0.0, "high"),    # A > 0 and rho above 1 + eps_high: clipping blocks further increase
    (0.5, -1, 0.0, "low"),     # A < 0 and rho below 1 - eps_low: clipping blocks further decrease
    (0.5, +1, -0.5, None),     # A > 0, rho low: unclipped side, the gradient raises logp (-A rho)
    (1.5, -1, +1.5, None),     # A < 0, rho high: unclipped side, the gradient lowers logp
    (1.1, +1, -1.1, None),     # inside the region
    (0.9, -1, +0.9, None),
    (1.25, +1, -1.25, None),   # inside [1 - 0.2, 1 + 0.28] thanks to clip-higher
])
def test_clipped_surrogate_gradient(rho, adv, want, clip):
    grad, m = surrogate_grad(rho, adv)
    assert grad == pytest.approx(want, abs=1e-12)
    assert m["clip_ratio/high"] == (clip == "high") and m["clip_ratio/low"] == (clip == "low")


def test_clip_high_is_separate_from_clip_low():
    assert surrogate_grad(1.25, +1, 0.2, 0.2)[0] == 0.0  # symmetric 0.2 clips it
    assert surrogate_grad(0.75, -1, 0.2, 0.28)[0] == 0.0  # eps_high does not widen the low side


@pytest.mark.parametrize("estimator", grpo.KL_ESTIMATORS)
def test_kl_monitor_is_k3_whatever_estimator_is_optimised(estimator):
    """Departure 2: `kl` is the k3 estimate, token-mean under the mask, for every estimator in
    the loss; `kl/optimized` is the estimator itself. Were `kl` the optimised estimator, a k1
    run would log a KL that can go negative and runs with different estimators would not be
    comparable on one plot."""
    logps, old, ref, adv, mask, _ = random_batch()
    _, m = grpo_loss(logps, old, ref, adv, mask, 1.0, beta=0.1, kl_estimator=estimator)
    log_r = ref - logps.detach()  # log pi_ref - log pi, written out here, not via kl_per_token
    k3 = ((log_r.exp() - log_r - 1) * mask).sum() / mask.sum()
    k1 = (-log_r * mask).sum() / mask.sum()
    torch.testing.assert_close(m["kl"], k3)
    assert (k3 - k1).abs() > 1e-2  # the batch tells them apart: a k1 monitor would fail above
    if estimator == "k1":
        torch.testing.assert_close(m["kl/optimized"], k1)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_and_entropy_use_the_temperature(entropy_grad):
    """Both paths of response_logprobs(with_entropy) (entropy with or without its graph) against a naive
    computation: one plain forward, logits / T, log_softmax, gather; entropy of softmax(logits / T).
    The sampler draws from softmax(logits / T), so a path that forgot T would give rho != 1 on
    the first pass and a wrong entropy bonus. Rows are left-padded to different lengths, so the
    position ids matter too."""
    torch.manual_seed(0)
    tok = tasks.char_tokenizer()
    model = models.load_model("tiny", tok)
    with torch.no_grad():  # random init gives near-uniform logits, on which T barely shows: sharpen them
        model.get_output_embeddings().weight.mul_(30)
    ids, attn, resp = common.join_prompt_response([tok("sort 3 1 2 =")["input_ids"], tok("9 8 =")["input_ids"]],
                                                  [tok(" 1 2 3")["input_ids"], tok(" 8 9 0 1")["input_ids"]],
                                                  tok.pad_token_id)
    R, T = resp.shape[1], 0.7
    logps, entropy = common.response_logprobs(model, ids, attn, R, T, with_entropy=True, entropy_grad=entropy_grad)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn,
                       position_ids=common.position_ids_from_mask(attn)).logits.double() / T
        logp_all = torch.log_softmax(logits[:, -R - 1:-1], -1)  # position t predicts token t + 1
        want = logp_all.gather(-1, ids[:, -R:, None]).squeeze(-1)
        want_entropy = -(logp_all.exp() * logp_all).sum(-1)
        at_t1 = torch.log_softmax(logits[:, -R - 1:-1] * T, -1).gather(-1, ids[:, -R:, None]).squeeze(-1)
    assert (want - at_t1).abs().max() > 0.1  # T = 0.7 changes these log-probs: the check has teeth
    # two layouts' float32 rounding, of the largest log-prob's size (the logits' spread, sharpened)
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logp_all.abs().max().item()
    torch.testing.assert_close(logps.double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=tol)
    assert entropy.requires_grad == entropy_grad


# -----------------------------------------------------------------------------
# advantages, masks, aggregation, accumulation


def test_group_advantages_hand_case():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv, m = group_advantages(r, "group")
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4))
    torch.testing.assert_close(adv[1], torch.zeros(4))
    assert m["frac_reward_zero_std"] == 0.5 and m["reward"] == pytest.approx(1.25)
    assert m["reward_std"] == pytest.approx(s / 2)
    adv, _ = group_advantages(r, "none")
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    adv, _ = group_advantages(r, "batch")
    batch_std = torch.tensor([1, 0, 0, 1, 2, 2, 2, 2.0]).std()  # 0.8864
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (batch_std + 1e-4))


def test_global_normalisation_hand_case():
    r = torch.tensor([[1.0, 0.0], [3.0, 3.0], [0.0, 4.0]])
    adv, _ = group_advantages(r, "none", global_norm=True, eps=0.0)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0, -2.0, 2.0])  # mean 0; unbiased std sqrt(8.5 / 5)
    torch.testing.assert_close(adv.flatten(), centred / math.sqrt(8.5 / 5))


def test_truncate_mask():
    ids = torch.tensor([[5, 7, 3, 7, 2], [5, 5, 5, 0, 0], [7, 1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    want = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    assert torch.equal(truncate_mask(ids, mask, 7), want)
    assert torch.equal(truncate_mask(ids, mask, None), mask)
    # a truncate token on padding does not count
    assert torch.equal(truncate_mask(torch.tensor([[1, 2, 7]]), torch.tensor([[1, 1, 0]]), 7), torch.tensor([[1, 1, 0]]))


def test_aggregation_hand_case():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    cases = {"token_mean": (3, 7 / 3), "seq_mean_token_mean": (2, (1.5 + 4) / 2), "constant": (6, 7 / 6)}
    for agg, (norm, value) in cases.items():
        assert loss_normaliser(mask, agg, max_new_tokens=3) == norm
        assert aggregate(x, mask, agg, norm).item() == pytest.approx(value)
    with pytest.raises(ValueError):
        aggregate(x, mask, "sum", 1)


def random_batch(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 5, 2, 4, 3, 5])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logps = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logps.detach() + 0.5 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    entropy = torch.rand(B, T, generator=g)
    return logps, old, ref, adv, mask, entropy


@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
def test_accumulation_matches_full_batch(agg):
    logps, old, ref, adv, mask, ent = random_batch()
    kw = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.1, kl_estimator="ratio_k1", agg=agg, entropy_coef=0.01)
    norm = loss_normaliser(mask, agg, max_new_tokens=5)
    full, _ = grpo_loss(logps, old, ref, adv, mask, norm, entropy=ent * logps, **kw)
    g_full = torch.autograd.grad(full, logps)[0]
    g_acc, g_naive = torch.zeros_like(logps), torch.zeros_like(logps)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        args = (logps[rows], old[rows], ref[rows], adv[rows], mask[rows])
        loss, _ = grpo_loss(*args, norm, entropy=(ent * logps)[rows], **kw)  # the global normaliser
        g_acc += torch.autograd.grad(loss, logps)[0]
        naive, _ = grpo_loss(*args, loss_normaliser(mask[rows], agg, 5), entropy=(ent * logps)[rows], **kw)
        g_naive += torch.autograd.grad(naive, logps)[0] / 3  # per-micro-batch normaliser, averaged
    torch.testing.assert_close(g_acc, g_full)
    if agg == "token_mean":  # unequal lengths: a per-micro-batch token mean is a different gradient
        assert (g_naive - g_full).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# rejection sampling


def rso_inclusion_exact(rewards, k, gamma):
    """Inclusion probability of each candidate under RSO Alg. 1, by walking its probability tree."""
    N, incl = len(rewards), [0.0] * len(rewards)

    def walk(left, accepted, prob):
        if len(accepted) == k:
            for i in accepted:
                incl[i] += prob
            return
        r_max = max(rewards[i] for i in left)

        def step(j, acc_round, p):  # decide candidate left[j] of this round
            if len(accepted) + len(acc_round) == k or j == len(left):
                walk([i for i in left if i not in acc_round], accepted + acc_round, p)
                return
            a = math.exp((rewards[left[j]] - r_max) / gamma)
            if a > 0:
                step(j + 1, acc_round + [left[j]], p * a)
            if a < 1:
                step(j + 1, acc_round, p * (1 - a))
        step(0, [], prob)

    walk(list(range(N)), [], 1.0)
    return incl


def test_rejection_sampler_follows_rso_formula():
    rewards, k, gamma, n = [0.0, 0.3, 1.0, 0.6], 2, 0.5, 20000
    exact = torch.tensor(rso_inclusion_exact(rewards, k, gamma))
    assert exact.sum().item() == pytest.approx(k)
    kept = rejection_sample(torch.tensor([rewards] * n), k, gamma, generator=torch.Generator().manual_seed(0))
    assert kept.shape == (n, k) and (kept[:, 0] < kept[:, 1]).all()  # distinct, ascending
    freq = torch.bincount(kept.flatten(), minlength=4).double() / n
    se = (exact * (1 - exact) / n).sqrt()
    assert ((freq - exact).abs() <= 4 * se + 1e-9).all(), (freq, exact)
    assert (exact - k / 4).abs().max() > 0.1  # far from uniform, so the check has teeth


def test_rejection_sampler_limits_and_topbottom():
    r = torch.tensor([[0.0, 5.0, 1.0, 3.0, 2.0, 4.0]])
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(r, 2, 1e-3, generator=g).tolist() == [[1, 5]]  # gamma -> 0: the best k
    assert rejection_sample(r, 4, 1.0, mode="topbottom").tolist() == [[0, 1, 2, 5]]  # best 2, worst 2
    assert rejection_sample(r, 3, 1.0, mode="topbottom").tolist() == [[0, 1, 5]]


# -----------------------------------------------------------------------------
# config checks and reward weights


def test_batch_arithmetic_is_checked():
    base = vars(cli.with_defaults(grpo.Config(prompts_per_step=4, group_size=4)))  # its lengths filled
    conflicts.grpo(grpo.Config(**base), common.Dist())
    for bad, match in [(dict(num_mini_batches=3), "equal micro-batches"), (dict(rs_samples=2), "rs_samples")]:
        with pytest.raises(ValueError, match=match):
            conflicts.grpo(grpo.Config(**(base | bad)), common.Dist())
    with pytest.raises(ValueError, match="--kl_estimator 'k4' is not one of k1, k2, k3, ratio_k1, ratio_k3"):
        cli.check_ranges(grpo.Config(kl_estimator="k4"))
    with pytest.raises(ValueError, match="divisible by world size"):
        conflicts.grpo(grpo.Config(**(base | dict(prompts_per_step=3))), common.Dist(world_size=2))


def test_parse_weights():
    assert reward_fns.parse_weights("", False) == {"rule": 1.0}
    assert reward_fns.parse_weights("", True) == {"model": 1.0}
    assert reward_fns.parse_weights("", True, names=["a", "b"]) == {"a": 1.0, "b": 1.0, "model": 1.0}  # TRL's: all at 1
    assert reward_fns.parse_weights("rule:1.0,model:0.5", True) == {"rule": 1.0, "model": 0.5}
    with pytest.raises(ValueError):
        reward_fns.parse_weights("rule:1,model:1", False)
    with pytest.raises(ValueError):
        reward_fns.parse_weights("gold:1", False)
    for bad in ("rule:nan", "rule:inf", "rule:x", "rule:"):
        with pytest.raises(ValueError, match="finite weights"):
            reward_fns.parse_weights(bad, False)


# -----------------------------------------------------------------------------
# LoRA: the adapter-disabled network is the base model


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_lora_reference_is_the_base_model():
    torch.manual_seed(0)
    tok = models.load_tokenizer("tiny")
    base = models.load_model("tiny", tok, dtype=torch.float32)
    model = models.add_lora(copy.deepcopy(base), r=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # LoRA starts as the identity; make the adapters do something
    ids = torch.randint(3, len(tok), (2, 7))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
        with environment.reference_context(model, model):  # ref is model: LoRA's adapters off
            disabled = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    assert (adapted - want).abs().max() > 1e-2
    torch.testing.assert_close(disabled, want, rtol=0, atol=0)
    # the saved checkpoint is the policy: (W + s B A) x against W x + s B (A x), float32's rounding of
    # the two (an r-term sum more in each adapted layer), of the logits' size
    tol = fp32_rtol(forward_lengths(base.config, ids.shape[1]) + [4] * 4 * 4) * adapted.abs().max().item()
    torch.testing.assert_close(merged, adapted, rtol=0, atol=tol)


# -----------------------------------------------------------------------------
# the script end to end


def grpo_argv(out, *extra):
    """grpo.py for 2 steps on the tiny model writing into out, then extra."""
    return ["grpo.py", "--model", "tiny", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
            "--max_new_tokens", "8", "--n_eval", "8", "--n_eval_pairs", "8", "--eval_every", "1", "--out_dir", str(out),
            *extra]


def run_grpo(tmp_path, *extra):
    """grpo.py for 2 steps on the tiny model, then extra, in this process; its out_dir and the
    metrics it logged."""
    out = tmp_path / "run"
    proc = run_here(grpo_argv(out, *extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, read_metrics(out)


def moved_from_the_initial_weights(out):
    """The largest change of any weight from the tiny model grpo.py starts from to out's checkpoint."""
    w = checkpoint_weights(out)
    common.set_seed(0)  # the initial weights, built as grpo.py builds them
    start = models.load_model("tiny", models.load_tokenizer("tiny")).state_dict()
    return max((w[k] - start[k]).abs().max().item() for k in w)


def write_digits_prompts(path, n):
    """n prompts of the embedded task, each scored by the digits reward (which a random policy's
    samples vary under; the sort reward is 0 for all of them), as a jsonl file; its path."""
    return write_jsonl(path, [{"prompt": r["prompt"], "reward_fn": "digits"} for r in tasks.prompt_rows(n)])


def test_script_runs_with_many_knobs_and_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    out, rows = run_grpo(tmp_path, "--rs_samples", "6", "--truncate_token", "9", "--num_iterations", "2",
                         "--num_mini_batches", "2", "--grad_accum", "2", "--kl_estimator", "ratio_k1",
                         "--entropy_coef", "0.01", "--loss_agg", "constant", "--global_norm",
                         "--ref_refresh_every", "1", "--no_eos_penalty", "0.5")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "kl/optimized", "clip_ratio/low",
                "clip_ratio/high", "entropy", "completions/mean_length", "completions/clipped_ratio",
                "time/rollout", "time/reward", "time/update", "eval/exact_match", "eval/accuracy"):
        assert key in rows[-1], key
    assert rows[0]["eval/accuracy"] == 0.5  # policy == reference: every pair is a tie
    for r in rows[1:]:
        # --no_eos_penalty 0.5 is subtracted from the reward of each completion that never stopped
        # (means are linear); most of them here (0.88 and 0.81 measured), so the check has teeth
        assert r["completions/clipped_ratio"] > 0.25, r
        # means of 16 float32 rewards (>= 0 each), taken apart: within gamma_18 of their sizes
        bound = gamma(16 + 2) * (r["reward/rule"] + 0.5 * r["completions/clipped_ratio"])
        assert r["reward"] == pytest.approx(r["reward/rule"] - 0.5 * r["completions/clipped_ratio"], abs=bound), r
    # --ref_refresh_every 1 copies the policy into the reference, not the other way round: the
    # policy keeps what it learnt (its weights moved by up to 4e-4, measured; with the copy reversed, 0)
    assert moved_from_the_initial_weights(out) > 1e-4
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert model.config.n_layer == 4


def _sequence_logprob(model, prompt_ids, response_ids):
    """log pi(response | prompt) by one forward of the unpadded sequence (batch of one, so no
    padding or position ids to get wrong): a naive check of pairwise_accuracy's batched path."""
    ids = torch.tensor([prompt_ids + response_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)  # row t predicts token t + 1
    return logp[len(prompt_ids) - 1:].gather(-1, torch.tensor(response_ids)[:, None]).sum().item()


def test_script_pairwise_accuracy_on_a_preference_file(tmp_path):
    """--eval_pairs: a prompt-only data set (no gold reward to score greedy answers) still gets the
    pairwise accuracy of beta*log(pi/pi_ref) on held-out pairs.

    The logged accuracy is checked against a recomputation from the saved policy and the rebuilt
    reference, pair by pair. A bare "accuracy != 0.5 after training" would be a coin toss: on 8
    pairs, 4 right is a likely outcome of a random policy, and a harmless change of rounding or
    of the sampled rollouts could flip it; nor would it notice chosen and rejected swapped. A pair
    whose margin is within 1e-4 of zero may rank either way under rounding, so it only widens
    the allowed range; the accuracy must also be a multiple of 1 / (2N) (ties count half)."""
    from transformers import AutoModelForCausalLM

    N = 24
    prompts = write_digits_prompts(tmp_path / "prompts.jsonl", 8)
    pairs = tasks.preference_rows(N, split="test")
    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out, rows = run_grpo(tmp_path, "--dataset", prompts, "--eval_pairs", pairs_file, "--lr", "1e-2",
                         "--warmup_steps", "0", "--n_eval_pairs", str(N))  # the last --n_eval_pairs wins
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/accuracy"] == 0.5  # policy == reference: every pair a tie, exactly
    assert "eval/exact_match" not in rows[-1]

    tok = models.load_tokenizer("tiny")
    policy = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    common.set_seed(0)  # the reference: the initial weights, built as grpo.py builds them
    ref = models.load_model("tiny", tok).eval()
    wins = losses = 0
    with torch.no_grad():
        for pair in pairs:
            p = tok(pair["prompt"])["input_ids"][-64:]  # --max_prompt_len 64 keeps the end
            margin = 0.0
            for sign, col in ((1, "chosen"), (-1, "rejected")):
                r = (tok(pair[col], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:8]  # --max_new_tokens 8
                margin += sign * (_sequence_logprob(policy, p, r) - _sequence_logprob(ref, p, r))
            wins, losses = wins + (margin > 1e-4), losses + (margin < -1e-4)
    acc = rows[-1]["eval/accuracy"]
    assert wins + losses >= N // 2, (wins, losses)  # training moved the policy: most pairs are decided
    assert wins / N <= acc <= (N - losses) / N, (acc, wins, losses)
    assert abs(2 * N * acc - round(2 * N * acc)) < 1e-9


@pytest.fixture(scope="module")
def multi_pass_kl_in_reward_run(tmp_path_factory):
    """An in-process run with several passes over each rollout (mu = 3 x 2 mini-batches), a large
    lr so that the policy moves within a rollout, and the KL taken from the reward; the tests
    below read its metrics, and what grpo_loss was given: per call, the largest difference over
    the response tokens between the log-probs and the old ones, and between them and the
    reference's. A reward the random policy's samples vary under (digits) makes the advantages
    nonzero."""
    tmp = tmp_path_factory.mktemp("multi_pass")
    data = write_digits_prompts(tmp / "prompts.jsonl", 16)
    cfg = grpo.Config(model="tiny", dataset=data, out_dir=str(tmp / "g"), steps=2, prompts_per_step=4,
                      group_size=4, max_new_tokens=8, num_iterations=3, num_mini_batches=2, lr=1e-2,
                      warmup_steps=0, kl_in_reward=True, beta=0.5, eval_every=100, n_eval_pairs=4)
    loss_inputs, loss_fn = [], grpo.grpo_loss

    def recording_loss(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs):
        m = mask.bool()
        loss_inputs.append(((logps - old_logps)[m].abs().max().item(), (logps - ref_logps)[m].abs().max().item()))
        return loss_fn(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "grpo_loss", recording_loss)
        grpo.main(cfg)
    return [r for r in read_metrics(tmp / "g") if r["step"] > 0], loss_inputs


def test_clipping_acts_on_later_passes_over_a_rollout(multi_pass_kl_in_reward_run):
    """Passes after the first must compare with the cached log-probs of the rollout policy
    (GRPO Alg. 1): then rho drifts from 1 as the policy moves and the clip acts. Were the old
    log-probs recomputed from the current forward (old = logps.detach()), rho would be exactly 1
    on every pass, the clip ratios always 0, and mu > 1 an unclipped policy gradient."""
    rows, _ = multi_pass_kl_in_reward_run
    assert len(rows) == 2
    assert max(r["clip_ratio/low"] + r["clip_ratio/high"] for r in rows) > 0.01, rows


def test_old_and_reference_log_probs_reach_the_loss_in_their_places(multi_pass_kl_in_reward_run):
    """The first optimizer step of a rollout runs the rollout policy itself: its log-probs equal
    the old ones exactly (rho = 1, log rho 0 to the bit: the old policy's pass runs the update's own
    micro-batches, shared_prompt.plan), while at the second rollout the policy has left the
    reference (step 1 moved it). Old and reference log-probs passed in each other's place (rho =
    pi / pi_ref) would clip against the wrong policy and still train, pass every metric check and go
    unnoticed; the old policy's pass in a layout of its own (its rows padded in one forward) gives
    log rho float noise instead of 0 where layouts round apart (test_exact.py: the Llama folder)."""
    _, loss_inputs = multi_pass_kl_in_reward_run
    assert len(loss_inputs) == 2 * 3 * 2  # steps x passes x mini-batches
    first_of_step_1, first_of_step_2 = loss_inputs[0], loss_inputs[6]
    assert first_of_step_1 == (0, 0), loss_inputs  # pi = pi_old = pi_ref, to the bit
    assert first_of_step_2[0] == 0 and first_of_step_2[1] > 0.1, loss_inputs  # measured: 0 and 1.9


def test_kl_in_reward_is_subtracted(multi_pass_kl_in_reward_run):
    """--kl_in_reward: reward = rule - beta * sum_t KL_t per sequence, so the logged means obey
    reward = reward/rule - reward/kl_penalty (means are linear). The penalty is k3, >= 0, and
    nonzero once the policy has left the reference (step 1 starts at it: penalty 0), so a
    penalty added instead of subtracted fails here."""
    rows, _ = multi_pass_kl_in_reward_run
    assert rows[0]["reward/kl_penalty"] == 0  # policy == reference at the first rollout
    assert max(r["reward/kl_penalty"] for r in rows) > 1e-3  # the check below has teeth
    for r in rows:
        assert r["reward/kl_penalty"] >= 0
        bound = gamma(16 + 2) * (r["reward/rule"] + r["reward/kl_penalty"])  # float32 means of 16 terms >= 0
        assert r["reward"] == pytest.approx(r["reward/rule"] - r["reward/kl_penalty"], abs=bound), r


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_script_lora_checkpoint_is_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    # --entropy_coef: a gradient whatever the rewards, so the adapters move (at the first step the
    # KL penalty is 0, every sort reward 0, and the random policy's completions may all be clipped)
    out, _ = run_grpo(tmp_path, "--lora", "--kl_in_reward", "--lr", "1e-2", "--steps", "1", "--entropy_coef", "0.01")
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert not any("lora" in name for name, _ in model.named_parameters())
    # the adapters' update is in the weights (they moved by up to 0.017, measured): unloaded
    # unmerged, they would leave the base model
    assert moved_from_the_initial_weights(out) > 1e-3


ROLLOUT = ("reward", "reward_std", "completions/mean_length", "dynamic_sampling/rounds",
           "dynamic_sampling/unfilled_groups", "tools/call_frequency")  # measured at a step's rollout


def assert_same_run(one, two, lr=1e-4, keys=("reward", "reward_std", "completions/mean_length", "loss", "grad_norm"),
                    config=None, updates=4):
    """The logged training rows of two runs of grpo_argv (the embedded model at its defaults: 2
    passes x 2 mini-batches, 4 optimizer steps a step; config and updates: another model's) agree
    step for step, within the bounds of helpers.assert_runs_agree: step 1's rollout (its samples
    drawn at the starting weights: the same tokens, bar a near-tie that rounding flips), the losses
    within rounding and Adam's drift; at lr 0 every key at every step (the weights never move)."""
    one, two = ([r for r in rows if "loss" in r] for rows in (one, two))  # step 0 has no eval here
    assert [r["step"] for r in two] == [1, 2] and all(r["reward_std"] > 0 for r in one)
    config = config or models.load_model("tiny", models.load_tokenizer("tiny")).config
    assert_runs_agree(one, two, config, length=64 + 24, lr=lr, keys=keys, updates=updates, tokens=16 * 88,
                      start_keys=ROLLOUT, scales={"loss": [1.5]})  # |A| <= (G - 1) / sqrt(G) in a group of G = 4


def default_flags(folder):
    return ("--dataset", write_digits_prompts(folder / "prompts.jsonl", 16), "--lr", "1e-4", "--warmup_steps", "0")


def rejection_and_dynamic_sampling(folder):
    rows = [{"prompt": r["prompt"], "reward_fn": ("sort", "digits")[i % 2]} for i, r in enumerate(tasks.prompt_rows(48))]
    return ("--dataset", write_jsonl(folder / "p.jsonl", rows), "--rs_samples", "6", "--dynamic_sampling",
            "--max_num_gen_batches", "3", "--scale_rewards", "batch", "--global_norm", "--ref_refresh_every", "1",
            "--lr", "1e-4", "--warmup_steps", "0")


TWO_RANK_RUNS["grpo_defaults"] = lambda folder, models: grpo_argv(folder / "run", *default_flags(folder))
TWO_RANK_RUNS["grpo_defaults_lr0"] = lambda folder, models: grpo_argv(folder / "run", *default_flags(folder), "--lr", "0")
TWO_RANK_RUNS["grpo_rs_dynamic"] = lambda folder, models: grpo_argv(folder / "run", *rejection_and_dynamic_sampling(folder))


def test_two_processes_match_one_process_at_the_default_flags(tmp_path, two_ranks):
    """FSDP2 on 2 ranks (gloo) against 1 process, every algorithm flag at its default (mu 2 passes
    over 2 mini-batches among them). The sampler's random numbers are indexed by global row
    (sampling.rollout_uniforms) and the mini-batches are dealt from the global rollout
    (minibatch_rows), so both draw the same completions and optimise the same mini-batches: the
    rewards, the loss of every step and the final weights agree (fp32). With each rank shuffling
    its own rows, step 1's grad norm differed (1.534 against 1.672 in the report). The 2-rank run
    is conftest.py's `two_ranks`."""
    out1, one = run_grpo(tmp_path, *default_flags(tmp_path))
    out2 = two_ranks("grpo_defaults") / "run"
    assert_same_run(one, read_metrics(out2))
    # Adam turns rounding noise in a near-zero gradient into a step of up to lr, either way: the
    # weights within adam_drift of 8 optimizer steps (1.6e-3), having moved
    assert max_abs_diff(checkpoint_weights(out1), checkpoint_weights(out2)) <= adam_drift(1e-4, 8)
    assert moved_from_the_initial_weights(out1) > 1e-4
    # at lr 0 the weights never move: every update's loss and grad norm at every step, tight (a
    # rank shuffling its own rows moved step 1's grad norm from 1.534 to 1.672)
    (tmp_path / "lr0").mkdir()
    _, one = run_grpo(tmp_path / "lr0", *default_flags(tmp_path), "--lr", "0")
    assert_same_run(one, read_metrics(two_ranks("grpo_defaults_lr0") / "run"), lr=0)


def test_two_processes_match_one_with_rejection_and_dynamic_sampling_and_batch_statistics(tmp_path, two_ranks):
    """The collectives and the per-prompt random streams: rejection sampling (each prompt's draws
    seeded by its global index), dynamic sampling (each round's groups gathered from every rank
    and dealt in global order), batch-std scaling, global normalisation and a reference refreshed
    every step. Half the prompts are scored by the sort rule, which the random policy never
    satisfies (all-equal groups that dynamic sampling must replace), half by the digits rule."""
    out1, one = run_grpo(tmp_path, *rejection_and_dynamic_sampling(tmp_path), "--grad_accum", "2")
    out2 = two_ranks("grpo_rs_dynamic") / "run"
    assert_same_run(one, read_metrics(out2), keys=("reward", "reward_std", "loss", "grad_norm",
                                                   "dynamic_sampling/rounds", "dynamic_sampling/unfilled_groups"))
    assert any(r.get("dynamic_sampling/rounds", 0) > 1 for r in one)  # groups were replaced
    assert max_abs_diff(checkpoint_weights(out1), checkpoint_weights(out2)) <= adam_drift(1e-4, 8)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_minibatches_hold_the_same_rows_on_any_number_of_ranks(K):
    """minibatch_rows on 1, 2 and 4 ranks (each rank its contiguous share of 16 global rows): the
    global rows of every mini-batch are the same set, each rank holds an equal part of each, and
    every row is in exactly one mini-batch per pass."""
    def deal(world):
        per = 16 // world
        parts = [grpo.minibatch_rows(16, K, torch.Generator().manual_seed(3), slice(r * per, (r + 1) * per)) + r * per
                 for r in range(world)]
        assert all(p.shape == (K, per // K) for p in parts)
        return [sorted(torch.cat([p[j] for p in parts]).tolist()) for j in range(K)]

    one = deal(1)
    assert sorted(sum(one, [])) == list(range(16))
    assert deal(2) == one and deal(4) == one
    if K > 1:  # random: another seed deals other rows
        assert grpo.minibatch_rows(16, K, torch.Generator().manual_seed(4)).sort(1).values.tolist() != one


def test_the_update_computes_log_probs_at_the_sampling_temperature(tmp_path):
    """lr 0 and temperature 0.7, two passes over two mini-batches: the policy never moves, so the
    update's forward must reproduce the old and reference log-probs exactly (both at the sampling
    temperature): ratio 1 (no clipping), KL 0, and the sampler's log-probs within rounding.
    An update forward at temperature 1 gives KL > 0 and clips."""
    out, rows = run_grpo(tmp_path, "--dataset", write_digits_prompts(tmp_path / "p.jsonl", 16), "--lr", "0",
                         "--temperature", "0.7", "--beta", "0.1")
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")  # lr 0: the policy that sampled
    # the sampler's cached decode and the update's forward: float32's rounding of two layouts
    bound = fp32_rtol(forward_lengths(model.config, 64 + 8)) * logprob_size(model, temperature=0.7)
    for r in rows:
        assert r["kl"] == 0 and r["kl/optimized"] == 0, r
        assert r["clip_ratio/low"] == 0 and r["clip_ratio/high"] == 0, r
        assert r["rollout/logp_diff"] < bound, (r, bound)


def test_the_reference_of_a_rope_model_computes_the_policy_under_mixed_precision():
    """On a GPU under torchrun the reference is a bf16 copy of the policy, whose forward FSDP's
    MixedPrecisionPolicy runs with bf16 parameters and its buffers as they are. A config-built
    Llama: the frozen copy keeps the rotary frequencies (a buffer) in fp32 like the policy, and
    its log-probs equal those of the policy's mixed-precision forward (parameters cast to bf16,
    buffers untouched: torch.func.functional_call), so KL is 0 at step 0. A copy cast whole
    (model.to(bf16)) rounds inv_freq (relative error up to 2e-3) and KL is not 0."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=256, rope_theta=10000.0)
    policy = AutoModelForCausalLM.from_config(cfg).eval()
    gpu = common.Dist(torchrun=True)  # frozen_dtype: bf16 where the policy computes in bf16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "frozen_dtype", lambda d: torch.bfloat16)
        mp.setattr(common, "shard_model", lambda model, d, **kw: model)  # the placement is not under test
        ref = common.freeze(copy.deepcopy(policy), gpu)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ref.parameters())
    for (name, b), (_, b_ref) in zip(policy.named_buffers(), ref.named_buffers()):
        assert b_ref.dtype == b.dtype == torch.float32 and torch.equal(b, b_ref), name
    ids = torch.randint(0, 64, (2, 200))
    attn = torch.ones_like(ids)
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in policy.named_parameters()}
    with torch.no_grad():
        pi = torch.func.functional_call(policy, bf16, (), dict(input_ids=ids, attention_mask=attn)).logits
        ref_logits = ref(input_ids=ids, attention_mask=attn).logits
        whole = copy.deepcopy(policy).to(torch.bfloat16)(input_ids=ids, attention_mask=attn).logits
    lp, lp_ref, lp_whole = (torch.log_softmax(x.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]) for x in
                            (pi, ref_logits, whole))
    assert grpo.kl_per_token(lp, lp_ref, lp, "k3").abs().max() == 0
    assert grpo.kl_per_token(lp, lp_whole, lp, "k3").max() > 0


def test_bad_rule_rows_stop_grpo_at_load_time(tmp_path):
    """An unknown rule in row 2 stops the run when the data is loaded, named by file and row (it
    used to crash with a bare KeyError at the step that drew the row)."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "sort 3 1 2 =", "reward_fn": "sort"},
                                              {"prompt": "sort 3 1 2 =", "reward_fn": "nope"}])
    with pytest.raises(ValueError, match=r"p.jsonl row 2: reward_fn 'nope' is not one of"):
        grpo.main(grpo.Config(model="tiny", dataset=str(path), out_dir=str(tmp_path / "o")))


def test_prompt_truncation_is_counted_in_the_banner_and_each_step(tmp_path, capsys):
    """Like the other scripts, grpo.py says how many prompts --max_prompt_len cuts: in its banner,
    and each step's share as `prompts/truncated_ratio` (it used to cut them at every rollout with
    one printed line). Each step draws all 3 prompts, 2 of them cut."""
    rows = [{"prompt": p, "reward_fn": "sort"} for p in ("sort 1 2 3 =", "sort 9 8 7 6 5 4 3 2 =", "sort 5 5 5 5 =")]
    path = write_jsonl(tmp_path / "p.jsonl", rows)  # 12, 20 and 14 characters: the tokens of the char tokenizer
    grpo.main(grpo.Config(model="tiny", dataset=path, out_dir=str(tmp_path / "o"), max_prompt_len=13,
                          prompts_per_step=3, group_size=2, max_new_tokens=4, steps=2, num_mini_batches=1))
    assert "2 of 3 prompts are longer than --max_prompt_len 13 tokens and cut" in capsys.readouterr().out
    assert [r["prompts/truncated_ratio"] for r in read_metrics(tmp_path / "o")] == pytest.approx([2 / 3, 2 / 3])


def test_rollouts_stop_at_every_end_of_turn_id_and_rewards_see_the_text_after_the_prompt(tmp_path, monkeypatch):
    """grpo.py passes the generation config's end-of-turn ids to the sampler, counts a rollout
    that ends at one as stopped (no --no_eos_penalty), and decodes completions after their
    prompts (sampling.decode_responses with prompt_ids), in the rollouts and in the evaluation of
    the file's held-out prompts."""
    from transformers import AutoModelForCausalLM

    tok = tasks.char_tokenizer()
    model = AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2))
    end_of_turn = tok.convert_tokens_to_ids("|")
    model.generation_config.eos_token_id = [tok.eos_token_id, end_of_turn]
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    calls = {"generate": [], "decode": []}
    generate, decode = grpo.sampling.generate, grpo.sampling.decode_responses

    def spy_generate(model, p_ids, p_mask, n, eos_id, pad_id, **kw):
        calls["generate"].append((eos_id, kw.get("stop_ids")))
        r_ids, r_mask, *logps = generate(model, p_ids, p_mask, n, eos_id, pad_id, **kw)  # + the rollout's log-probs
        r_ids[:, 0], r_mask[:, 0], r_mask[:, 1:] = end_of_turn, 1, 0  # every rollout ends its turn at once
        return r_ids, r_mask, *logps

    def spy_decode(tokenizer, r_ids, r_mask, prompt_ids=None):
        calls["decode"].append(prompt_ids is not None)
        return decode(tokenizer, r_ids, r_mask, prompt_ids)

    monkeypatch.setattr(grpo.sampling, "generate", spy_generate)
    monkeypatch.setattr(grpo.sampling, "decode_responses", spy_decode)
    data = write_digits_prompts(tmp_path / "prompts.jsonl", 8)
    grpo.main(grpo.Config(model=str(tmp_path / "m"), dataset=data, out_dir=str(tmp_path / "g"), steps=1,
                          prompts_per_step=2, group_size=2, max_prompt_len=64, max_new_tokens=4, no_eos_penalty=1.0,
                          eval_every=100,
                          n_eval_pairs=4, warmup_steps=0))
    assert calls["generate"][0] == (tok.eos_token_id, [end_of_turn]) and calls["decode"] and all(calls["decode"])
    row = read_metrics(tmp_path / "g")[-1]
    assert row["completions/clipped_ratio"] == 0.0, row  # each ended at the end-of-turn id


@pytest.mark.parametrize("column, flag", [("answer", ""), ("solution", ""), ("ref", "ref")])
def test_math_rows_with_reward_fn_flag_are_scored_against_their_answers(tmp_path, monkeypatch, column, flag):
    """A local jsonl of questions with an `answer` column (or TRL's `solution`, or one --answer_column
    names) and no `reward_fn` column, run with --reward_fn math: every completion is scored against
    its own row's answer. Completions are fixed here (every other one right), so the logged rule
    reward must be exactly 0.5."""
    rows = [{"prompt": f"What is {i} + 1?", column: f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(8)]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    by_prompt = {r["prompt"]: i + 1 for i, r in enumerate(rows)}
    seen = []

    def fixed_texts(tokenizer, r_ids, r_mask, prompt_ids=None):
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        seen.extend(prompts)
        return [f"so it is {by_prompt[p] + (k % 2)}" for k, p in enumerate(prompts)]  # right, wrong, right, ...

    monkeypatch.setattr(grpo.sampling, "decode_responses", fixed_texts)
    grpo.main(grpo.Config(model="tiny", dataset=path, reward_fn="math", answer_column=flag, out_dir=str(tmp_path / "g"),
                          steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=100, n_eval_pairs=4,
                          warmup_steps=0))
    assert len(seen) == 8 and set(seen) <= set(by_prompt)
    assert [r["reward/rule"] for r in read_metrics(tmp_path / "g")] == [0.5, 0.5]  # no step-0 row: nothing to evaluate
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": r["prompt"]} for r in rows])
    with pytest.raises(ValueError, match=r"q.jsonl: the reward needs an `answer` or `solution` column"):
        grpo.main(grpo.Config(model="tiny", dataset=str(tmp_path / "q.jsonl"), reward_fn="math",
                              out_dir=str(tmp_path / "q")))


def test_a_mini_batch_of_truncated_completions_only_has_a_zero_loss_not_nan(tmp_path):
    """--mask_truncated_completions with 4 new tokens: 15 of the tiny random policy's 16 completions
    never stop, so one of the two mini-batches of 8 has an empty loss mask. Its token mean was 0 / 0
    and the run stopped at step 1 ("loss is nan"); the denominator is at least 1 (TRL clamps it
    too), so that mini-batch's loss is 0."""
    out, rows = run_grpo(tmp_path, "--mask_truncated_completions", "--max_new_tokens", "4", "--steps", "1",
                         "--eval_every", "5")
    step = rows[-1]
    assert step["completions/clipped_ratio"] == 15 / 16, step  # the case: one stopped completion in 16
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]), step


# -----------------------------------------------------------------------------
# the wiring around the math: each test fails with the one-line bug its docstring names planted


def hand_rollout(rewards, stopped=None):
    """An environment.Rollout of len(rewards) rows (prompt_idx: the row's number), its rewards as given."""
    rewards = torch.tensor(rewards, dtype=torch.float32)
    N = len(rewards)
    ids = torch.arange(N)[:, None].repeat(1, 2)
    return environment.Rollout(p_ids=ids, p_mask=torch.ones_like(ids), r_ids=ids, r_mask=torch.ones_like(ids),
                               r_logps=torch.zeros(N, 2), r_tool=torch.zeros(N, 2),
                               stopped=torch.ones(N, dtype=torch.bool) if stopped is None else stopped,
                               prompt_idx=torch.arange(N), prompt_cut=torch.zeros(N, dtype=torch.bool),
                               rewards=rewards, parts={})


def test_combine_pairs_each_weight_with_the_reward_of_its_name():
    """The weighted sum takes each weight's reward by name: the parts come in another order than
    the weights, after a term no weight names (a penalty, logged alone). Hand case: 0.5 a + 2 b.
    Planted, fails here: `zip(weights.values(), parts.values())` (by position)."""
    parts = {"overlong": torch.tensor([-100.0, -100.0]), "b": torch.tensor([1.0, 2.0]), "a": torch.tensor([10.0, 20.0])}
    assert environment.combine(parts, {"a": 0.5, "b": 2.0}).tolist() == [0.5 * 10 + 2 * 1, 0.5 * 20 + 2 * 2]


def test_dynamic_sampling_keeps_a_group_whose_scored_rewards_differ_beside_an_unscored_one():
    """DAPO's dynamic sampling: a group [0, None, 1, 0] (a function returned None for one
    completion) has rewards that differ, and is kept before the equal-reward groups; [2, None, 2,
    2] is equal. Groups 1 and 3 are kept, none missing. Planted, fails here: `g.amax(1) >
    g.amin(1)` without nan_to_num (NaN compares False: the group counted as all-equal)."""
    nan = math.nan
    rewards = [1, 1, 1, 1, 0, nan, 1, 0, 2, nan, 2, 2, 3, 1, 0, 2]  # groups 0..3 of 4
    cfg = grpo.Config(prompts_per_step=2, group_size=4)
    roll, missing = grpo.dynamic_sample([hand_rollout(rewards)], cfg, common.Dist(), pad_id=0)
    assert roll.prompt_idx.tolist() == [4, 5, 6, 7, 12, 13, 14, 15] and missing == 0
    roll, missing = grpo.dynamic_sample([hand_rollout(rewards[:12])], cfg, common.Dist(), pad_id=0)
    assert roll.prompt_idx.tolist()[:4] == [4, 5, 6, 7] and missing == 1


@pytest.mark.parametrize("mode", ["rso", "topbottom"])
def test_rejection_sampling_ranks_an_unscored_completion_last(monkeypatch, mode):
    """--rs_samples 4 keeping 3 (--group_size): a completion no reward scores (None) ranks below
    every scored one, whatever they are. Rewards all negative: rso keeps the three scored ones
    (an unscored one has acceptance probability 0 while any is left), topbottom the two highest
    and the unscored as the lowest. Planted, fails here: `rewards.nan_to_num(0.0)` (an unscored
    completion ranked as reward 0, above them all)."""
    nan = math.nan
    rewards = torch.tensor([-1.0, nan, -2.0, -3.0, -5.0, -4.0, nan, -6.0])
    monkeypatch.setattr(environment, "score", lambda roll, env, cfg, d: {"rule": rewards.clone()})
    env = types.SimpleNamespace(weights={"rule": 1.0})
    cfg = grpo.Config(prompts_per_step=2, group_size=3, rs_samples=4, rs_mode=mode, no_eos_penalty=0.0)
    roll = grpo.reward(hand_rollout([0.0] * 8), env, cfg, common.Dist(), step=1)
    want = {"rso": [0, 2, 3, 4, 5, 7], "topbottom": [0, 1, 2, 4, 5, 6]}[mode]
    assert roll.prompt_idx.tolist() == want


def test_the_sampled_evaluation_draws_from_its_own_stream(monkeypatch):
    """environment.evaluate_rewards samples the held-out prompts with uniforms of their own stream
    (seeded by --seed alone): the same at every evaluation, whatever the global RNG holds. The
    uniforms `sample` is given for each chunk are those of sampling.rollout_uniforms(n, T,
    stream_seed(seed, 0, stream=3)), after torch.manual_seed(0) as after (1). Planted, fails here:
    `u = torch.rand(n, cfg.max_new_tokens, dtype=torch.float64)` (the global RNG)."""
    seen = []

    def fake_sample(model, env, prompts, u, temperature, cfg, d):
        assert u.shape[0] == len(prompts)
        seen.append((temperature, u.clone()))
        n = len(prompts)
        return (torch.zeros(n, 1, dtype=torch.long), None, torch.full((n, 2), 7), torch.ones(n, 2, dtype=torch.long),
                None, None)

    monkeypatch.setattr(environment, "sample", fake_sample)
    monkeypatch.setattr(sampling, "decode_responses", lambda tok, ids, mask, p_ids: ["x"] * len(ids))
    monkeypatch.setattr(environment, "score_texts", lambda env, rows, own, texts, **kw: {"rule": torch.ones(len(texts))})
    env = types.SimpleNamespace(fns=[], rm=None, stop_ids=[0], tokenizer=None, weights={"rule": 1.0})
    held = {"rows": {"prompt": ["a", "b", "c"], "reward_fn": ["sort"] * 3}, "own": ["a", "b", "c"],
            "numbers": [1, 2, 3], "source": "held.jsonl"}
    cfg = grpo.Config(seed=3, max_new_tokens=5, temperature=0.9, eval_batch_size=2)
    want = sampling.rollout_uniforms(3, 5, sampling.stream_seed(3, 0, stream=3))
    for global_seed in (0, 1):
        seen.clear()
        torch.manual_seed(global_seed)
        environment.evaluate_rewards(torch.nn.Linear(1, 1), env, held, cfg, common.Dist())
        sampled = torch.cat([u for t, u in seen if t == cfg.temperature])  # chunks of rows [0, 1], [2, 2]: one shape
        assert torch.equal(sampled, want[[0, 1, 2, 2]]), global_seed


def test_a_row_stopped_only_where_a_stop_id_is_inside_its_response(monkeypatch):
    """`stopped` (--no_eos_penalty, --mask_truncated_completions, completions/clipped_ratio) reads
    the stop ids inside the response mask only: where the pad id is a stop id (EOS as pad), a row
    cut before it stopped (a tool budget, --truncate_token's mask) has that id in its padding.
    Rows: stopped at EOS; cut, EOS-as-pad after it; full length, no stop id. Planted, fails here:
    `torch.isin(r_ids, stop_ids).any(-1)` without `& r_mask.bool()`."""
    eos = pad = 0
    r_ids = torch.tensor([[5, eos, pad], [5, 6, pad], [5, 6, 7]])
    r_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])

    def fake_sample(model, env, prompts, u, temperature, cfg, d):
        n = len(prompts)
        return (torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), r_ids, r_mask,
                torch.zeros(n, 3), torch.zeros(n, 3, dtype=torch.long))

    monkeypatch.setattr(environment, "sample", fake_sample)
    env = types.SimpleNamespace(order=data.DataOrder(2, 0, 1), prompts=datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                                stop_ids=[eos, 9], prompt_cut=torch.zeros(2, dtype=torch.bool))
    cfg = grpo.Config(prompts_per_step=1, group_size=3, max_new_tokens=3)
    roll = environment.rollout(torch.nn.Linear(1, 1), env, cfg, common.Dist(), step=1)
    assert roll.stopped.tolist() == [True, False, False]
