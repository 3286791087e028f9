"""Micro benchmarks (pytest-benchmark): log-prob gathering, every loss function, AdamW, GELU, the draw.

Not part of the test suite (pytest's testpaths is tests/); run them on purpose:

    python -m bench micro                     # bench/results/micro-<device>.json, each group's ratios
    python -m pytest bench/test_micro.py --benchmark-only --benchmark-group-by group --benchmark-sort mean

Each benchmark first checks that the function under test computes the same thing as its
plain twin, so a faster number is never a wrong one; a group's plain twin is its last. Shapes:
B*T = 2048 positions of GPT-2's vocabulary (V = 50257) for log-probs (their peak memory above the
logits in extra_info, harness.peak_memory); 64 sequences x 256 tokens for the losses; 64 rows of
GPT-2's vocabulary for the draw.
"""
import pytest
import torch

import lm_head
import dpo
import grpo
import reward
import sampling
import sft
from bench import harness

V, BT = 50257, 2048
B, T = 64, 256


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BT, V, generator=g), torch.randint(0, V, (BT,), generator=g)


def naive_logprobs(x, y):
    return torch.log_softmax(x.float(), -1).gather(-1, y[:, None]).squeeze(-1)


def fwd_bwd(fn, x, y):
    x = x.detach().requires_grad_(True)
    fn(x, y).sum().backward()
    return x.grad


def with_peak(benchmark, fn, *args):
    """benchmark(fn, *args), the peak memory one call adds (GiB) in its extra_info."""
    with harness.peak_memory(torch.device("cpu")) as peak:
        fn(*args)
    benchmark.extra_info["peak_gib"] = peak["bytes"] / 2**30
    benchmark(fn, *args)


@pytest.mark.benchmark(group="logprobs forward")
@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_logprobs_forward(benchmark, logits, impl):
    fn = lm_head.logprobs_from_logits if impl == "chunked" else naive_logprobs
    torch.testing.assert_close(fn(*logits), naive_logprobs(*logits), rtol=1e-5, atol=1e-5)
    with_peak(benchmark, fn, *logits)


@pytest.mark.benchmark(group="logprobs forward+backward")
@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_logprobs_forward_backward(benchmark, logits, impl):
    fn = lm_head.logprobs_from_logits if impl == "chunked" else naive_logprobs
    torch.testing.assert_close(fwd_bwd(fn, *logits), fwd_bwd(naive_logprobs, *logits), rtol=1e-5, atol=1e-6)
    with_peak(benchmark, fwd_bwd, fn, *logits)


# -----------------------------------------------------------------------------
# losses: forward + backward on per-token (B, T) or per-sequence (B,) inputs


def per_token(seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    mask = (torch.arange(T)[None] < torch.randint(T // 4, T + 1, (B, 1), generator=g)).float()
    return logps, mask, g


@pytest.mark.benchmark(group="losses")
def test_sft_loss(benchmark):
    logps, mask, _ = per_token()

    def step():
        logps.grad = None
        sft.sft_loss(logps, mask, mask.sum())[0].backward()

    step()
    torch.testing.assert_close(logps.grad, -mask / mask.sum())  # d(-mean NLL)/d logp
    benchmark(step)


@pytest.mark.benchmark(group="losses")
def test_bt_loss(benchmark):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, B, generator=g).requires_grad_(True)

    def step():
        r.grad = None
        reward.bt_loss(r[0], r[1], B)[0].backward()

    step()
    torch.testing.assert_close(r.grad[0], -torch.sigmoid(-(r[0] - r[1])).detach() / B)
    benchmark(step)


@pytest.mark.benchmark(group="losses")
@pytest.mark.parametrize("loss_type", dpo.LOSS_TYPES)
def test_dpo_loss(benchmark, loss_type):
    g = torch.Generator().manual_seed(0)
    pol = (-torch.rand(2, B, generator=g) * 50).requires_grad_(True)
    ref = -torch.rand(2, B, generator=g) * 50
    lengths = torch.randint(1, 65, (2, B), generator=g)  # response tokens, for the length-normalised losses

    def step():
        pol.grad = None
        dpo.dpo_loss(pol[0], pol[1], ref[0], ref[1], 0.1, B, loss_type, lengths=lengths)[0].backward()

    step()
    assert torch.isfinite(pol.grad).all() and pol.grad.abs().sum() > 0
    benchmark(step)


@pytest.mark.benchmark(group="losses")
@pytest.mark.parametrize("estimator", grpo.KL_ESTIMATORS)
def test_grpo_loss(benchmark, estimator):
    logps, mask, g = per_token()
    old = logps.detach() + 0.05 * torch.randn(B, T, generator=g)
    ref = logps.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)

    def step():
        logps.grad = None
        loss, _ = grpo.grpo_loss(logps, old, ref, adv, mask, mask.sum().item(), 0.2, 0.28, 0.04, estimator)
        loss.backward()

    step()
    assert torch.isfinite(logps.grad).all() and (logps.grad * (1 - mask)).abs().sum() == 0  # padding gets none
    benchmark(step)


# -----------------------------------------------------------------------------
# two choices every script makes: fused AdamW, and the fused tanh-GELU of the config-built models


@pytest.fixture(scope="module")
def gpt2_small_params():
    _, model = harness.random_model("gpt2-small-random")
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return list(model.parameters())


@pytest.mark.benchmark(group="AdamW step, GPT-2 small (124M parameters)")
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_step(benchmark, gpt2_small_params, impl):
    kw = {"fused": dict(fused=True), "for-loop": dict(foreach=False), "foreach": dict(foreach=True)}[impl]
    small = [torch.zeros(3, 4, requires_grad=True) for _ in range(2)]  # the same update as the plain loop
    for p in small:
        p.grad = torch.arange(12.0).view(3, 4) / 10
    ref = [p.detach().clone().requires_grad_(True) for p in small]
    for p, q in zip(ref, small):
        p.grad = q.grad.clone()
    for opt in (torch.optim.AdamW(small, lr=0.1, **kw), torch.optim.AdamW(ref, lr=0.1, foreach=False)):
        opt.step()
        opt.step()
    torch.testing.assert_close(small, ref)
    opt = torch.optim.AdamW(gpt2_small_params, lr=1e-4, betas=(0.9, 0.95), **kw)
    benchmark.pedantic(opt.step, rounds=5, warmup_rounds=1)


@pytest.mark.benchmark(group="GELU (tanh), 4096 x 3072")
@pytest.mark.parametrize("impl", ["gelu_pytorch_tanh", "gelu_new"])
def test_gelu(benchmark, impl):
    from transformers.activations import ACT2FN

    x = torch.randn(4096, 3072, generator=torch.Generator().manual_seed(0))
    fn = ACT2FN[impl]
    torch.testing.assert_close(fn(x), ACT2FN["gelu_new"](x), rtol=1e-5, atol=1e-6)
    benchmark(fn, x)


# -----------------------------------------------------------------------------
# the rollout's draw: one token a row by inverting the float64 CDF (sampling.sample_token) against multinomial


@pytest.mark.benchmark(group="the draw, 64 rows x 50257 tokens")
@pytest.mark.parametrize("impl", ["inverse_cdf", "multinomial"])
def test_draw(benchmark, impl):
    g = torch.Generator().manual_seed(0)
    x, u = torch.randn(64, V, generator=g), torch.rand(64, generator=g, dtype=torch.float64)
    cdf = torch.softmax(x, -1).double().cumsum(-1)  # the plain twin: each row's first entry whose CDF passes u
    plain = [int((c > uu * c[-1]).nonzero()[0]) for c, uu in zip(cdf, u)]
    assert sampling.sample_token(x, u=u).tolist() == plain
    fn = (lambda: sampling.sample_token(x, generator=g)) if impl == "inverse_cdf" else \
        (lambda: torch.multinomial(x.softmax(-1), 1, generator=g))
    benchmark(fn)
