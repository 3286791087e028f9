"""The sampler-trainer gap, measured exactly: each off-policy correction's bias and variance.

A policy small enough to enumerate every response: T tokens from a vocabulary of V (N = V**T
sequences), an autoregressive softmax with a logits table per prefix (theta, (S, V), S = 1 + V +
... + V**(T-1) prefixes), a fixed reward per sequence. The sampler draws from mu, the trainer
computes pi; a known gap is injected between them:
    noise        mu = softmax(theta + eps * z), z a fixed standard normal table (kernels, precision)
    temperature  mu = softmax(theta / tau), the trainer at temperature 1 (a mismatched setting)
    top_p        mu = pi truncated to the top-p set and renormalised at each position (the sampler's rule)
    noise_top_p  mu = the noisy softmax truncated to top-p 0.9, the trainer replaying the truncation on
                 its own logits (grpo.py's default --sampling_replay): the two truncations may differ
Each correction is a set of grpo.py's flags, and its loss is grpo.py's own (grpo.grpo_loss with the
weights of grpo.policy_weights, the training loop's two calls) on the enumerated sequences, in one
pass (old = pi, grpo.py's departure 3), each sequence's tokens summed (every sequence has T tokens,
so the trainer's token mean is this times a constant). Advantage A(y) = R(y) - E_mu[R]: the group
mean of a large group drawn by the sampler, without the std (a constant factor).

For every correction, by enumeration: the estimator g(y) = -grad of y's loss, its expectation
E_mu[g] = sum_y mu(y) g(y) and its variance per sample sum_y mu(y) ||g(y) - E_mu[g]||^2, against
the exact gradient of the objective the correction claims to optimise (autograd of sum_y p(y) R(y)):
the full policy's, p = pi; where the trainer replays the truncation (truncates its own pi with the
sampler's rule), the truncated policy's. Bias = ||E_mu[g] - g_true|| / ||g_true||; variance is
shown relative to the on-policy estimator's (no gap, no correction) on the same instance. Both are
averaged over --instances random policies, rewards and noise tables.

    python -m studies.offpolicy_exact                # runs/offpolicy_exact/: table (.md, .json), figure (.png)
    python -m studies.offpolicy_exact --out plots    # the copies docs/offpolicy.md shows
"""
import argparse
import dataclasses
import json
import os

import torch

import grpo
import sampling
from plumbing import cli

# the gaps: the sampler's setting at each size; the trainer at temperature 1, truncating only where it replays
GAPS = {
    "noise": (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),  # eps, the std of the logit noise
    "temperature": (1.0, 1.003, 1.01, 1.03, 1.1, 1.3, 1.5),  # tau, the sampler's temperature
    "top_p": (1.0, 0.997, 0.99, 0.97, 0.9, 0.7),  # p, the sampler's nucleus
    "noise_top_p": (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),  # eps, with top_p NOISE_TOP_P replayed by every row
}
NOISE_TOP_P = 0.9
GAP_LABELS = {"noise": "logit noise std eps", "temperature": "sampler temperature - 1", "top_p": "1 - top_p",
              "noise_top_p": f"logit noise std eps, top_p {NOISE_TOP_P} replayed"}


# -----------------------------------------------------------------------------
# the enumerated policy


def enumerate_sequences(V, T):
    """Every sequence (N, T), N = V**T, and the row of theta each token is drawn from (N, T): the
    prefix y_<t, numbered T-level by level (the empty prefix 0, then the V one-token prefixes, ...)."""
    seqs = torch.cartesian_prod(*[torch.arange(V)] * T).reshape(-1, T)  # (N, T)
    prefix = torch.zeros_like(seqs)
    offset, code = 0, torch.zeros(seqs.shape[0], dtype=torch.long)
    for t in range(T):
        prefix[:, t] = offset + code
        offset += V ** t
        code = code * V + seqs[:, t]
    return seqs, prefix


def truncate(logits, top_p):
    """The logits (..., V) with the tokens outside the top-p set at -inf: the sampler's own rule
    (sampling.truncate_logits, which decides in fp32 as the sampler does and returns fp32 logits;
    only its decision is taken, so the kept logits stay float64)."""
    if top_p >= 1.0:
        return logits
    keep = torch.isfinite(sampling.truncate_logits(logits, top_p=top_p))
    return logits.masked_fill(~keep, float("-inf"))


def table_probs(logits_table, temperature=1.0, top_p=1.0):
    """Next-token probabilities (S, V) of every prefix under a sampler's settings."""
    return truncate(logits_table / temperature, top_p).softmax(-1)


def sequence_probs(probs, seqs, prefix):
    """p(y) (N,) of every sequence: the product of its tokens' probabilities (no log: exact zeros)."""
    return probs[prefix, seqs].prod(-1)


def instance(V, T, scale, seed):
    """A random policy: theta (S, V) ~ N(0, scale^2), rewards (N,) ~ N(0, 1), a noise table z (S, V)."""
    g = torch.Generator().manual_seed(seed)
    S = sum(V ** t for t in range(T))
    theta = scale * torch.randn(S, V, generator=g, dtype=torch.float64)
    rewards = torch.randn(V ** T, generator=g, dtype=torch.float64)
    noise = torch.randn(S, V, generator=g, dtype=torch.float64)
    return theta, rewards, noise


def behaviour_logits(theta, noise, gap, size):
    """The sampler's logits table, temperature and top_p for a gap of this size."""
    if gap in ("noise", "noise_top_p"):
        return theta + size * noise, 1.0, NOISE_TOP_P if gap == "noise_top_p" else 1.0
    if gap == "temperature":
        return theta, size, 1.0
    if gap == "top_p":
        return theta, 1.0, size
    raise ValueError(f"unknown gap {gap!r}, expected one of {tuple(GAPS)}")


# -----------------------------------------------------------------------------
# the corrections: grpo.py's loss and weights under each correction's flags


def training_loss(flags, old="trainer"):
    """fn(logps, rollout_logps, A, mask) -> the summed loss of the sequences: grpo.grpo_loss (no KL
    term, normaliser 1: each sequence's tokens summed, the rows independent) with the policy term's
    weights from grpo.policy_weights (the loop's own call), under grpo.py's flags and these.
    old: the policy of the ratio, the trainer's own in one pass (old = logps.detach(), grpo.py's
    departure 3), or the sampler's log-probs (prime-rl's DPPO, whose old policy is the sampler's)."""
    cfg = dataclasses.replace(cli.with_defaults(grpo.Config()),
                              **{"vllm_importance_sampling_correction": False, **flags})

    def loss(logps, rollout_logps, A, mask):
        old_logps = logps.detach() if old == "trainer" else rollout_logps
        w, _ = grpo.policy_weights(cfg, logps, old_logps, rollout_logps, advantages=A, mask=mask, keep=None,
                                   n_tokens=mask.sum())
        out, _ = grpo.grpo_loss(logps, old_logps, logps.detach(), A, mask, normaliser=1.0, epsilon_low=cfg.epsilon_low,
                                epsilon_high=cfg.epsilon_high, beta=0.0, agg="token_mean", loss_type=cfg.loss_type,
                                clip_ratio_c=cfg.clip_ratio_c, pg_weights=w)
        return out
    return loss


def is_mode(mode, clip_min=None, clip_max=None):
    return dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)


_D = cli.with_defaults(grpo.Config())  # grpo.py's defaults (the embedded task's)
# name: (its loss, whether the trainer replays the sampler's truncation on its own logits: --sampling_replay)
CORRECTIONS = {
    "none": (training_loss({}), False),
    # the full importance weight pi(y) / mu(y), unbounded: the product of the token ratios
    "full_is": (training_loss(is_mode("sequence_mask")), False),
    "token_tis": (training_loss(is_mode("token_truncate", clip_max=3.0)), False),  # TRL's and verl's cap
    "token_mask": (training_loss(is_mode("token_mask", 0.5, 5.0)), False),  # IcePop's bounds
    "sequence_tis": (training_loss(is_mode("sequence_truncate", clip_max=3.0)), False),
    "sequence_mask": (training_loss(is_mode(_D.vllm_importance_sampling_mode, _D.vllm_importance_sampling_clip_min,
                                            _D.vllm_importance_sampling_clip_max)), False),  # the flag's mode and bounds, TRL's default
    "geometric_mask": (training_loss(is_mode("sequence_geometric_mask", 0.99, 1.01)), False),  # verl's seq_mean_k1
    "deepseek_mask": (training_loss({"off_policy_mask_threshold": 0.05}), False),  # DeepSeek-V3.2's, A < 0 only
    "dppo_tv": (training_loss(dict(loss_type="dppo_tv", epsilon_low=0.15, epsilon_high=0.15), old="sampler"), False),
    "dppo_kl": (training_loss(dict(loss_type="dppo_kl", epsilon_low=0.05, epsilon_high=0.05), old="sampler"), False),
    "replay": (training_loss({}), True),
}


# -----------------------------------------------------------------------------
# exact expectation and variance


def trainer_probs(theta, seqs, prefix, top_p=1.0):
    """The trainer's next-token distribution at every token of every sequence, (N, T, V): its pi,
    or replaying a top-p truncation, its pi truncated by the sampler's rule on its own logits with
    the sampled token kept whatever the rule says (sampling.truncate_logits with labels, the
    trainer's own call: where the sampler's logits differ from the trainer's, the sampler may draw
    a token the trainer's rule would drop)."""
    logits = theta[prefix]  # (N, T, V)
    if top_p < 1.0:
        keep = torch.isfinite(sampling.truncate_logits(logits, labels=seqs, top_p=top_p))
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1)


def per_sample_grads(theta, seqs, prefix, loss_fn, rollout_logps, A, top_p=1.0):
    """g (N, S * V): minus the gradient of each sequence's loss with respect to theta.

    The loss of sequence n depends on theta only through its own token log-probs logps[n] (T,), so
    g[n] = -sum_t dloss_n/dlogps[n, t] * dlogps[n, t]/dtheta: the first factor from autograd through
    the training code, the second in closed form for a softmax table, the row of the token's prefix
    s getting onehot(y_t) - p(. | y_<t) (p the trainer's distribution, truncated when it replays)."""
    probs = trainer_probs(theta, seqs, prefix, top_p)  # (N, T, V)
    logps = probs.gather(-1, seqs[..., None]).squeeze(-1).log().detach().requires_grad_()  # (N, T)
    mask = torch.ones_like(logps)
    (dloss,) = torch.autograd.grad(loss_fn(logps, rollout_logps, A, mask), logps)  # (N, T)
    S, V = theta.shape
    at = torch.nn.functional.one_hot(prefix, S).to(theta)  # (N, T, S)
    score = torch.nn.functional.one_hot(seqs, V).to(theta) - probs  # (N, T, V)
    return -torch.einsum("nt,nts,ntv->nsv", dloss, at, score).reshape(len(seqs), S * V)


def true_gradient(theta, seqs, prefix, rewards, top_p=1.0):
    """The gradient (S * V,) of J = sum_y p(y) R(y) by autograd, p the policy truncated to top_p."""
    theta = theta.detach().requires_grad_()
    J = (sequence_probs(table_probs(theta, 1.0, top_p), seqs, prefix) * rewards).sum()
    return torch.autograd.grad(J, theta)[0].reshape(-1)


def exact_moments(mu, g):
    """E_mu[g] (P,) and the variance per sample, the trace of g's covariance under mu."""
    mean = mu @ g
    return mean, mu @ ((g - mean) ** 2).sum(-1)


def measure(theta, rewards, noise, gap, size, seqs, prefix, corrections=None):
    """{correction: (E_mu[g], variance, g_true)} at one gap size, and the gap as grpo.py's
    rollout/logp_diff measures it (E_mu of the mean |log pi - log mu| of a sequence's tokens)."""
    logits, temperature, top_p = behaviour_logits(theta, noise, gap, size)
    mu_table = table_probs(logits, temperature, top_p)
    mu = sequence_probs(mu_table, seqs, prefix)
    keep = mu > 0  # the sampler never draws the rest: they weigh nothing in any expectation
    seqs_k, prefix_k, mu_k = seqs[keep], prefix[keep], mu[keep]
    rollout_logps = mu_table[prefix_k, seqs_k].log()  # (n, T): what the sampler records
    A = rewards[keep] - mu_k @ rewards[keep]  # R - E_mu[R]
    out = {}
    for name, (loss_fn, replay) in (corrections or CORRECTIONS).items():
        p = top_p if replay or gap == "noise_top_p" else 1.0
        g = per_sample_grads(theta, seqs_k, prefix_k, loss_fn, rollout_logps=rollout_logps, A=A, top_p=p)
        mean, var = exact_moments(mu_k, g)
        out[name] = (mean, var, true_gradient(theta, seqs, prefix, rewards, top_p=p))
    # grpo.py's rollout/logp_diff, the mean |log pi - log mu| of the sampled tokens, the trainer's pi as
    # that gap's rows compute it: replaying top-p in noise_top_p, not in top_p (where the replay logs 0)
    pi = trainer_probs(theta, seqs_k, prefix_k, top_p if gap == "noise_top_p" else 1.0)
    logp_diff = mu_k @ (pi.gather(-1, seqs_k[..., None]).squeeze(-1).log() - rollout_logps).abs().mean(-1)
    return out, float(logp_diff)


def bias(mean, g_true):
    return float((mean - g_true).norm() / g_true.norm())


# -----------------------------------------------------------------------------
# the study


def applies(name, gap, corrections=CORRECTIONS):
    """The replay row is the top-p gap's alone: without truncation it is the identity, and with
    noise_top_p every row replays."""
    return gap == "top_p" or not corrections[name][1]


def run(V, T, scale, instances, seed, corrections=CORRECTIONS):
    """Per gap and size, per correction: the bias and the variance relative to on-policy's (and the
    cosine of E[g] with g_true), each averaged over the instances; the rollout/logp_diff of each gap
    size; and the on-policy estimator's variance per sample over ||g_true||^2 (its noise-to-signal
    for one sequence)."""
    seqs, prefix = enumerate_sequences(V, T)
    rows = {gap: {"sizes": list(sizes), "logp_diff": [0.0] * len(sizes),
                  **{n: {k: [0.0] * len(sizes) for k in ("bias", "var", "cos")}
                     for n in corrections if applies(n, gap, corrections)}}
            for gap, sizes in GAPS.items()}
    rows["on_policy_noise_to_signal"] = 0.0
    for i in range(instances):
        theta, rewards, noise = instance(V, T, scale, seed + i)
        on_policy, _ = measure(theta, rewards, noise, "noise", 0.0, seqs=seqs, prefix=prefix,
                           corrections={"none": CORRECTIONS["none"]})
        _, var0, g0 = on_policy["none"]
        rows["on_policy_noise_to_signal"] += float(var0 / g0.norm() ** 2) / instances
        for gap, sizes in GAPS.items():
            todo = {n: c for n, c in corrections.items() if applies(n, gap, corrections)}
            for j, size in enumerate(sizes):
                out, diff = measure(theta, rewards, noise, gap, size, seqs=seqs, prefix=prefix, corrections=todo)
                rows[gap]["logp_diff"][j] += diff / instances
                for n, (mean, var, g_true) in out.items():
                    rows[gap][n]["bias"][j] += bias(mean, g_true) / instances
                    # the direction alone: a mask that drops sequences shrinks E[g] (bias up to 1) and may
                    # keep its direction, which a larger learning rate would undo
                    rows[gap][n]["cos"][j] += float(torch.cosine_similarity(mean, g_true, dim=0)) / instances
                    rows[gap][n]["var"][j] += float(var / var0) / instances
    return rows


def gap_x(gap, sizes):
    return [s - 1 if gap == "temperature" else 1 - s if gap == "top_p" else s for s in sizes]


def table(rows, names):
    """A markdown table per gap: a row per correction, 'bias / variance' at each gap size
    (a bias of 0: none beyond float64 round-off, 1e-10)."""
    lines = []
    for gap in GAPS:
        r = rows[gap]
        xs = gap_x(gap, r["sizes"])
        lines += [f"**{gap}** ({GAP_LABELS[gap]}; in brackets the gap as grpo.py's rollout/logp_diff would log it)", "",
                  "| correction | " + " | ".join(f"{x:g} ({k:.2g})" for x, k in zip(xs, r["logp_diff"])) + " |",
                  "|---|" + "---|" * len(xs)]
        for n in (n for n in names if n in r):
            lines.append(f"| {n} | " + " | ".join(f"{b:.3f} / {v:.2f}" if b > 1e-10 else f"0 / {v:.2f}" for b, v in zip(r[n]["bias"], r[n]["var"])) + " |")
        lines.append("")
    return "\n".join(lines)


FLOOR = 1e-4  # the bias panel's floor: an unbiased correction's 1e-16 round-off is drawn here
REFERENCE_BATCH = 256  # sequences: the on-policy estimator's own relative error at this batch, for scale


def figure(rows, names, path):
    """Bias (top) and variance (bottom) against each gap's size, log-log, one line per correction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(GAPS), figsize=(5.4 * len(GAPS), 9.0), squeeze=False)
    styles = ["-", "--", ":", "-."]
    MARKERS = "osv^DPX*<>h"
    noise = (rows["on_policy_noise_to_signal"] / REFERENCE_BATCH) ** 0.5
    for c, gap in enumerate(GAPS):
        r = rows[gap]
        xs = gap_x(gap, r["sizes"])[1:]  # no gap (every correction exact) is off a log axis
        for k, n in enumerate(names):
            if n not in r:
                continue
            # hollow markers of their own: corrections that coincide (most do at small gaps) stay visible
            kw = dict(label=n, marker=MARKERS[k % len(MARKERS)], markersize=4 + k % 4, markerfacecolor="none",
                      linestyle=styles[k % len(styles)], color=f"C{k % 10}")
            if k >= 10:
                kw.update(color="black")
            axes[0, c].plot(xs, [max(b, FLOOR) for b in r[n]["bias"][1:]], **kw)
            axes[1, c].plot(xs, r[n]["var"][1:], **kw)
        axes[0, c].axhline(noise, color="grey", linewidth=3, alpha=0.3,
                           label=f"on-policy noise, {REFERENCE_BATCH} samples")
        axes[0, c].set_ylim(FLOOR / 2, 2)
        axes[0, c].set_title(f"gap: {gap}" + (f" (top_p {NOISE_TOP_P} replayed)" if gap == "noise_top_p" else ""))
        axes[0, c].set_ylabel(f"bias ||E[g] - g_true|| / ||g_true|| (unbiased: at {FLOOR:g})")
        axes[1, c].set_ylabel("variance per sample / on-policy's")
        for ax in axes[:, c]:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(GAP_LABELS[gap])
            ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0, list(GAPS).index("top_p")].get_legend_handles_labels()  # the panel with every row
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--V", type=int, default=5, help="vocabulary size")
    p.add_argument("--T", type=int, default=3, help="tokens per sequence (V**T sequences are enumerated)")
    p.add_argument("--scale", type=float, default=1.5, help="std of the policy's logits")
    p.add_argument("--instances", type=int, default=16, help="random policies averaged over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "offpolicy_exact"),
                   help="folder for offpolicy_exact.{md,json,png} (plots: the copies docs/offpolicy.md shows)")
    args = p.parse_args()
    if args.V < 2 or args.T < 1 or args.V ** args.T > 5000 or args.instances < 1:
        raise SystemExit(f"--V {args.V} --T {args.T} --instances {args.instances}: need V >= 2, T >= 1, "
                         "V**T <= 5000 sequences, instances >= 1")
    torch.set_num_threads(1)
    rows = run(args.V, args.T, args.scale, args.instances, args.seed)
    names = list(CORRECTIONS)
    text = (f"V = {args.V}, T = {args.T}, logit scale {args.scale}, mean over {args.instances} instances; each cell: bias / "
            f"variance per sample relative to the on-policy estimator's, whose own variance is "
            f"{rows['on_policy_noise_to_signal']:.1f} x ||g_true||^2\n\n" + table(rows, names))
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "offpolicy_exact.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "offpolicy_exact.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    figure(rows, names, os.path.join(args.out, "offpolicy_exact.png"))
    print(f"wrote {args.out}/offpolicy_exact.{{md,json,png}}")


if __name__ == "__main__":
    main()
