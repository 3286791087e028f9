"""Group Relative Policy Optimization (GRPO): on-policy RL from a reward, without a value model.

For each prompt, G completions are sampled from the policy; each completion's advantage is
its reward minus the mean reward of its group, divided by the group's std (Eq. 3 / Sec. 4.1.2
of DeepSeekMath, arXiv:2402.03300). The policy maximises the PPO clipped surrogate
(arXiv:1707.06347) with a KL penalty against a reference policy (GRPO Eq. 3 and Eq. 4):

    J = E[ agg_t( min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) - beta KL_t ) ],
    rho_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t).

Knobs, each a flag that changes a few visible lines:
- decoupled clip range eps_low / eps_high ("clip-higher", DAPO arXiv:2503.14476 Eq. 10);
- mu optimisation passes per rollout over mini-batches, with log-probs of the rollout policy
  cached (GRPO Alg. 1);
- KL estimator k1, k2, k3, ratio*k1 or ratio*k3 (Schulman's "Approximating KL divergence"),
  in the loss (default k3, GRPO Eq. 4) or subtracted from the reward (--kl_in_reward, as
  PPO-RLHF does);
- loss aggregation: token mean over the mini-batch, per-sequence mean, or a constant
  normaliser max_new_tokens x sequences (Dr. GRPO arXiv:2503.20783 Sec. 3.1);
- reward scaling by group std, batch std or none (Dr. GRPO drops the std);
- statistical rejection sampling of G out of N samples per prompt (RSO arXiv:2309.06657
  Alg. 1) or top/bottom halves; global advantage normalisation across ranks;
- truncate token: generation stops at it and nothing after it counts, for the reward and the
  loss alike;
- reference: a frozen copy, refreshed every N steps (the policy drifts far from the SFT model
  on long runs), or with --lora the same network with its adapters disabled (no second copy).

Variants (flags named as in TRL 1.16, else verl; each a few lines, equations at the functions):
- the policy term (`policy_loss`): the clipped surrogate, CISPO or SAPO, with INTELLECT-2's
  delta and dual-clip bounds; the ratio per token or per sequence (GSPO, `importance_ratio`);
- advantages (`group_advantages`): group-normalised, RLOO or REINFORCE++-baseline;
- DAPO's dynamic sampling (`informative_rollout` in main) and soft overlong punishment;
- weights of the policy term: DeepSeek-V3.2's off-policy sequence mask, the top-entropy tokens
  ("80/20"), truncated importance sampling against the sampler's own log-probs, whose gap to
  the trainer's is logged every step (rollout/logp_diff).

Deliberate departures:
1. Each loss normaliser (tokens, sequences, or the Dr. GRPO constant) is computed over the
   whole global mini-batch (all micro-batches, all ranks) before the forward passes, so
   gradient accumulation and world size do not change the gradient (common.py's rule 1).
2. The KL monitor `kl` is always the k3 estimate (unbiased, non-negative), whatever estimator
   is optimised (`kl/optimized`): k1 in the loss has zero expected gradient, so its own value
   says little about the KL that training keeps.
3. With one pass over one mini-batch the old log-probs equal the current ones, so that forward
   is skipped and rho = exp(logp - logp.detach()) (value 1, gradient kept; trl #2703).
4. Rewards are rule-based functions named per row (a `reward_fn` column: one data set can mix
   tasks), a learned reward model, or a weighted sum of both.
5. The eval pairs' implicit reward beta*log(pi/pi_ref) uses the current reference, which is
   the SFT model unless --ref_refresh_every is set.
6. The sampler's random numbers are drawn for the whole global rollout and indexed by row
   (sampling.rollout_uniforms), so 1 and N processes sample the same completions: a 2-rank run
   reproduces the 1-process run step for step (rejection sampling's draws excepted).

Run:
    python grpo.py                                     # from runs/sft, gold reward, CPU
    python grpo.py --reward_model runs/rm --out_dir runs/grpo-rm   # the learned reward
    torchrun --nproc_per_node 2 grpo.py                # the same on 2 processes (FSDP2)
    torchrun --nproc_per_node 8 grpo.py --model runs/sft-gpt2 --dataset trl-lib/tldr \\
        --reward_model runs/rm-gpt2 --max_prompt_len 384 --max_new_tokens 56 --lr 1e-6
"""
import contextlib
import copy
import math
import time
from dataclasses import dataclass

import torch

import common
import run
import data
import sampling
import tasks

KL_ESTIMATORS = ("k1", "k2", "k3", "ratio_k1", "ratio_k3")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "constant")
LOSS_TYPES = ("grpo", "cispo", "sapo")
IS_LEVELS = ("token", "sequence", "sequence_token")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


@dataclass
class Config:
    # --- model and data ---
    model: str = "runs/sft"
    """the policy to start from: a checkpoint folder (runs/sft), a hub id, or `tiny` (random, for tests)"""
    dataset: str = "sort"
    """embedded task (sort; arith, a chat task for instruct models), a hub id, or a local .jsonl/.json/.parquet
    with a prompt (and reward_fn) column"""
    chat_template: str = ""
    """a Jinja chat template file for conversational rows (default: the tokenizer's own)"""
    n_train: int = 20000
    """prompts drawn from an embedded task [>= 1]"""
    max_prompt_len: int = 64
    """prompt tokens kept (from the right) [>= 1]"""
    # --- sampling ---
    prompts_per_step: int = 32
    """prompts per rollout, over all ranks [>= 1]"""
    group_size: int = 8
    """completions per prompt that enter the loss (G) [>= 2]"""
    max_new_tokens: int = 24
    """response tokens sampled at most (a completion that reaches it without stopping is 'clipped') [>= 1]"""
    temperature: float = 1.0
    """sampling temperature; the loss's log-probs use the same temperature [> 0]"""
    top_k: int = 0
    """sample from the k most likely tokens only (0: all) [>= 0]"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off) (0, 1]"""
    truncate_token: str = ""
    """a string of one token: generation also stops at it, and tokens after it are masked"""
    compile: bool = False
    """torch.compile the rollout's decode step (10-60 s once per batch shape; pays over a run's many rollouts)"""
    # --- reward ---
    reward_model: str = ""
    """a reward model checkpoint (reward.py's out_dir), scored on prompt + decoded completion"""
    reward_fn: str = ""
    """a rule of tasks.REWARD_FNS for every row of a data set without a `reward_fn` column (`math`: the final
    number against the row's `answer`, GSM8K's `#### 72` or a bare number; `think_format`: R1's
    <think>...</think><answer>...</answer>); a row's own `reward_fn` wins"""
    reward_weights: str = ""
    """weighted sum of rewards, e.g. `rule:1.0,model:0.5` (empty: `model:1` with --reward_model, else `rule:1`)"""
    no_eos_penalty: float = 0.0
    """subtracted from the reward of a completion that never stops (no EOS or truncate token) [>= 0]"""
    mask_truncated_completions: bool = False
    """leave completions that never stop out of the loss"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment (arXiv:2503.14476 Eq. 13; verl's overlong_buffer.len): a reward term
    falling linearly from 0 at max_new_tokens minus this many tokens to -overlong_penalty_factor at
    max_new_tokens (0: off) [>= 0]"""
    overlong_penalty_factor: float = 1.0
    """the overlong term at max_new_tokens (verl's overlong_buffer.penalty_factor) [>= 0]"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv:2503.14476 Sec. 3.2; verl's filter_groups): groups whose rewards are all
    equal carry no gradient; replace them by the groups of new prompts, sampled round after round"""
    max_num_gen_batches: int = 4
    """rollout rounds per step at most with --dynamic_sampling; groups still missing after them are filled with
    equal-reward ones, counted in dynamic_sampling/unfilled_groups (verl's name) [1, 15]"""
    rs_samples: int = 0
    """rejection sampling: sample this many per prompt and keep group_size of them (0: off) [>= 0]"""
    rs_mode: str = "rso"
    """rso (statistical rejection sampling, RSO Alg. 1) or topbottom (best and worst halves)"""
    rs_gamma: float = 2.0
    """RSO temperature: accept with probability exp((r - r_max) / gamma) [> 0]"""
    # --- loss ---
    adv_estimator: str = "grpo"
    """advantages (verl's name): grpo (reward - group mean, then --scale_rewards); rloo (reward - mean of the
    group's others, arXiv:2402.14740); reinforce_pp (reward - group mean, then whitened over every response token
    of the batch, as verl and OpenRLHF do: REINFORCE++-baseline, arXiv:2501.03262). rloo and reinforce_pp take
    --scale_rewards none"""
    scale_rewards: str = "group"
    """divide centred rewards by the std of their group, of the whole batch, or `none` (Dr. GRPO)"""
    global_norm: bool = False
    """then normalise advantages to mean 0, std 1 over the whole batch on all ranks"""
    epsilon_low: float = 0.2
    """clip rho below at 1 - epsilon_low [0, 1)"""
    epsilon_high: float = 0.28
    """clip rho above at 1 + epsilon_high (DAPO clip-higher); with --loss_type cispo the IS weight's cap itself, as
    in TRL (which suggests 5; MiniMax-M1 and verl write the cap as 1 + eps_high) (TRL's name) [>= 0]"""
    loss_type: str = "grpo"
    """the policy term (TRL's values): grpo (PPO's clipped surrogate), cispo (the clipped IS weight, without
    gradient, times every token's REINFORCE term: arXiv:2506.13585), sapo (a soft gate instead of the clip:
    arXiv:2511.20347); how it is averaged is --loss_agg"""
    importance_sampling_level: str = "token"
    """rho per token (PPO), per sequence (GSPO, arXiv:2507.18071: exp of the mean token log-ratio, one per
    sequence; GSPO clips at 3e-4 / 4e-4) (TRL's name and values), or sequence_token (GSPO-token: the sequence's
    value, each token's gradient; TRL has it only in an experimental trainer of its own, not as a value here)"""
    delta: float = 0.0
    """INTELLECT-2's two-sided clip (arXiv:2505.07291): rho capped at delta in the unclipped term, so negative
    advantages cannot weigh without bound (0: off; else > 1 + epsilon_high) (TRL's name) [>= 0]"""
    clip_ratio_c: float = 0.0
    """dual-clip PPO (arXiv:1912.09729): for negative advantages the loss is at most c |A| (0: off; else
    > 1, verl uses 3) (verl's name) [>= 0]"""
    sapo_temperature_pos: float = 1.0
    """sapo's gate temperature for positive advantages (TRL's name) [> 0]"""
    sapo_temperature_neg: float = 1.05
    """sapo's gate temperature for negative advantages (TRL's name) [> 0]"""
    off_policy_mask_threshold: float = 0.0
    """DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556 Eq. 9): sequences with a negative advantage
    whose mean token log(pi_rollout / pi) exceeds this leave the policy term (0: off) (TRL's name) [>= 0]"""
    top_entropy_share: float = 1.0
    """only this share of the rollout's response tokens, those of highest entropy under the rollout policy (the
    ceil(share x n) highest of all n, over all ranks), get the policy gradient (arXiv:2506.01939 keeps 0.2; 1: every
    token). TRL's top_entropy_quantile differs: floor(1 + q (n - 1)) tokens of each micro-batch by the current
    policy's entropy, which depends on how the batch is split (0, 1]"""
    vllm_importance_sampling_correction: bool = False
    """truncated importance sampling (TIS): weight each token's policy term by min(pi_old / pi_rollout, cap),
    pi_rollout the sampler's own log-probs, to correct for its numerics differing from the trainer's (TRL's
    name, made for vLLM rollouts; here sampling.py's; their gap is logged as rollout/logp_diff either way)"""
    vllm_importance_sampling_clip_max: float = 3.0
    """the TIS cap (TRL's name) [> 0]"""
    beta: float = 0.04
    """KL coefficient [>= 0]"""
    kl_estimator: str = "k3"
    """k1, k2, k3, ratio_k1 or ratio_k3 (GRPO Eq. 4 is k3)"""
    kl_in_reward: bool = False
    """subtract beta x sum of per-token KL estimates from each reward instead of adding KL to the loss"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient [>= 0]"""
    loss_agg: str = "token_mean"
    """token_mean, seq_mean_token_mean, or constant (divide by max_new_tokens x sequences; Dr. GRPO)"""
    # --- reference and LoRA ---
    ref_refresh_every: int = 0
    """copy the policy into the reference every this many steps (0: never) [>= 0]"""
    lora: bool = False
    """train LoRA adapters (peft); the reference is the same network with adapters disabled"""
    lora_r: int = 16
    """LoRA rank [>= 1]"""
    lora_alpha: float = 32.0
    """LoRA scale numerator (scale = alpha / r) [> 0]"""
    # --- optimisation ---
    steps: int = 20
    """rollouts (each followed by num_iterations x num_mini_batches optimizer steps) [>= 1]"""
    num_iterations: int = 2
    """mu: optimisation passes over each rollout [>= 1]"""
    num_mini_batches: int = 2
    """optimizer steps per pass (the rollout split into this many mini-batches) [>= 1]"""
    grad_accum: int = 1
    """micro-batches per mini-batch on each rank [>= 1]"""
    lr: float = 1e-4
    """peak learning rate (AdamW; 0 trains nothing, a check that KL and clipping stay 0) [>= 0]"""
    warmup_steps: int = 5
    """linear warmup (optimizer steps) before the cosine decay [>= 0]"""
    weight_decay: float = 0.0
    """AdamW weight decay [>= 0]"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping) [>= 0]"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% more compute)"""
    hsdp: int = 0
    """under torchrun: shard each model within groups of this many ranks (the GPUs of a node) and replicate across the groups, so parameter all-gathers stay on intra-node links (0: shard over all ranks) [>= 0]"""
    offload_frozen: bool = False
    """keep the reference and reward model's parameters in CPU memory between uses (FSDP2 on GPUs, under torchrun)"""
    # --- evaluation ---
    eval_every: int = 10
    """evaluate every this many steps (and at step 0 and the end) [>= 1]"""
    n_eval: int = 500
    """held-out prompts for greedy exact-match and gold reward (embedded task) [>= 1]"""
    n_eval_pairs: int = 500
    """held-out preference pairs for the pairwise accuracy of beta*log(pi/pi_ref) [>= 1]"""
    eval_pairs: str = ""
    """preference pairs (hub id or file: prompt, chosen, rejected, or HH rows) for that accuracy; the embedded
    task uses its own test pairs"""
    eval_pairs_split: str = "validation"
    """split of --eval_pairs (a local file has one)"""
    # --- run ---
    out_dir: str = "runs/grpo"
    """where metrics.jsonl and the checkpoint/ folder go"""
    save_every: int = 0
    """also write a resumable checkpoint every this many steps (0: only the final one) [>= 0]"""
    save_dtype: str = "float32"
    """dtype of the exported weights in checkpoint/ (float32, bfloat16, float16); the resumable state stays fp32"""
    resume: bool = False
    """continue the run whose checkpoint is in out_dir"""
    overwrite: bool = False
    """replace the checkpoint and metrics already in out_dir"""
    seed: int = 0
    """seed for data order and sampling (the same rollouts on any number of ranks) [0, 4294967295]"""
    wandb: bool = False
    """also log to Weights & Biases"""
    trust_remote_code: bool = False
    """allow a hub model's own Python code to run"""


# -----------------------------------------------------------------------------
# the math: pure functions of tensors, each returning detached metrics beside its result


def truncate_mask(response_ids, response_mask, truncate_id):
    """Zero the mask after the first truncate token of each row (the token itself is kept).

    response_ids, response_mask: (B, R). Returns (B, R). The reward and the loss both see this
    cut response, so nothing after the truncate token is rewarded or trained on.
    """
    if truncate_id is None:
        return response_mask
    hit = (response_ids == truncate_id) & response_mask.bool()
    after = (hit.long().cumsum(-1) - hit.long()) > 0  # strictly after the first hit
    return response_mask * (~after).long()


def rejection_sample(rewards, k, gamma, mode="rso", generator=None):
    """Keep k of N samples per prompt. rewards: (B, N) -> indices (B, k), ascending per row.

    rso: RSO Algorithm 1 (arXiv:2309.06657). Rounds over the remaining candidates in order;
    each is accepted with probability exp((r - r_max) / gamma), r_max the best remaining reward,
    until k are accepted. Small gamma keeps the best, large gamma samples uniformly.
    topbottom: the k - k//2 highest and k//2 lowest rewards (ties by index).
    generator: one for all rows, or a list of one per row (grpo.py seeds each by its prompt's
    global index, so that any number of ranks keeps the same samples).
    """
    B, N = rewards.shape
    if mode == "topbottom":
        order = torch.argsort(-rewards, dim=1, stable=True)
        return torch.cat([order[:, :k - k // 2], order[:, N - k // 2:]], 1).sort(1).values
    if mode != "rso":
        raise ValueError(f"unknown rejection sampling mode {mode!r}")
    kept = []
    gens = generator if isinstance(generator, list) else [generator] * B
    for row, gen in zip(rewards.tolist(), gens):
        left, accepted = list(range(N)), []
        while len(accepted) < k:
            r_max = max(row[i] for i in left)
            u = torch.rand(len(left), generator=gen).tolist()
            for i, u_i in zip(left, u):
                if u_i < math.exp((row[i] - r_max) / gamma):
                    accepted.append(i)
                    if len(accepted) == k:
                        break
            left = [i for i in left if i not in accepted]
        kept.append(sorted(accepted))
    return torch.tensor(kept, dtype=torch.long)


def _global_mean_std(x, d, weights=None):
    """Mean and unbiased std of the elements of x over all ranks, each element counted `weights`
    times (a tensor like x; None: once): Bessel's correction over the total weight. Collective."""
    w = torch.ones_like(x) if weights is None else weights.to(x)
    s = common.all_reduce_sum(torch.stack([(w * x).sum(), (w * x * x).sum(), w.sum()]).double(), d)
    mean = s[0] / s[2]
    var = (s[1] - s[2] * mean * mean) / (s[2] - 1).clamp(min=1)
    return mean.float(), var.clamp(min=0).sqrt().float()


def group_advantages(rewards, scale="group", global_norm=False, d=common.Dist(), eps=1e-4, estimator="grpo",
                     lengths=None):
    """Group-relative advantages. rewards: (B, G), one row per prompt -> advantages (B, G).

    grpo: A = (r - mean_group(r)) / (std + eps), std of the group (GRPO Sec. 4.1.2), of the whole
    batch over all ranks (`batch`), or 1 (`none`, Dr. GRPO). global_norm then rescales A to mean
    0 and std 1 over the batch on all ranks. Stds are unbiased (n - 1).
    rloo: A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group(r)) (RLOO, arXiv:2402.14740).
    reinforce_pp: r - mean_group(r), then whitened over every response token of the batch on all
    ranks (REINFORCE++-baseline, arXiv:2501.03262 Sec. 3, as verl and OpenRLHF compute it: each
    response weighs as many times as it has tokens, lengths (B, G); (A - mean) / sqrt(var + 1e-8)).
    The metrics are this rank's share of the global-batch mean (every rank holds B groups:
    common.py's rule 2).
    """
    G = rewards.shape[1]
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True) if G > 1 else torch.zeros_like(mean)
    adv = rewards - mean
    if estimator == "rloo":
        adv = adv * G / (G - 1)
    elif estimator == "reinforce_pp":
        t_mean, t_std = _global_mean_std(adv, d, weights=lengths)
        adv = (adv - t_mean) * torch.rsqrt(t_std * t_std + 1e-8)
    elif estimator != "grpo":
        raise ValueError(f"unknown adv_estimator {estimator!r}, expected one of {ADV_ESTIMATORS}")
    if scale == "group":
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / (_global_mean_std(rewards, d)[1] + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}")
    if global_norm:
        g_mean, g_std = _global_mean_std(adv, d)
        adv = (adv - g_mean) / (g_std + eps)
    n_groups = rewards.shape[0] * d.world_size
    metrics = {"reward": rewards.mean(1).sum() / n_groups, "reward_std": std.sum() / n_groups,
               "frac_reward_zero_std": (rewards.amax(1) == rewards.amin(1)).float().sum() / n_groups}
    return adv, metrics


def kl_per_token(logps, ref_logps, old_logps, estimator):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi_old, (B, T).

    log r = log pi_ref - log pi;  k1 = -log r;  k2 = (log r)^2 / 2;  k3 = r - log r - 1.
    ratio_k* multiply by rho = pi / pi_old (value 1 on-policy, gradient not): their expected
    gradient is that of KL(pi || pi_ref), which k1's (zero) and k3's (KL(pi_ref || pi)) are not.
    """
    log_r = ref_logps - logps
    if estimator in ("k1", "ratio_k1"):
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r ** 2
    elif estimator in ("k3", "ratio_k3"):
        kl = torch.exp(log_r) - log_r - 1
    else:
        raise ValueError(f"unknown kl_estimator {estimator!r}, expected one of {KL_ESTIMATORS}")
    if estimator.startswith("ratio_"):
        kl = torch.exp(logps - old_logps) * kl
    return kl


def aggregate(x, mask, agg, normaliser):
    """Reduce per-token values x (B, T) under mask (B, T) to a scalar.

    normaliser (from loss_normaliser, over the whole global mini-batch):
      token_mean:          sum of x over tokens / tokens in the global mini-batch
      seq_mean_token_mean: sum over sequences of (token mean of the sequence) / sequences
      constant:            sum of x over tokens / (max_new_tokens x sequences)  (Dr. GRPO)
    Summing this over micro-batches gives exactly the value of the whole mini-batch.
    """
    if agg == "seq_mean_token_mean":
        return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    if agg in ("token_mean", "constant"):
        return (x * mask).sum() / normaliser
    raise ValueError(f"unknown loss_agg {agg!r}, expected one of {LOSS_AGGS}")


def loss_normaliser(mask, agg, max_new_tokens, d=common.Dist()):
    """The denominator of `aggregate` for a global mini-batch whose local rows have this
    mask (B, T): tokens or sequences summed over all ranks. Collective."""
    n = mask.sum() if agg == "token_mean" else mask.new_tensor(mask.shape[0] * (max_new_tokens if agg == "constant" else 1))
    return common.all_reduce_sum(n.double(), d)  # a tensor: no host sync per mini-batch


def importance_ratio(logps, old_logps, mask, level="token"):
    """rho (B, T) of every response token, from log-probs (B, T) and the response mask.

    token:          rho_t = pi(o_t) / pi_old(o_t)                             (PPO)
    sequence:       s = exp(mean_t log rho_t), the same for every token       (GSPO)
    sequence_token: sg[s] * pi(o_t) / sg[pi(o_t)]: value s, gradient of log pi(o_t) times s
                    (GSPO-token; equal to `sequence` in value, and in gradient when the
                    advantage is the same for every token of a sequence)
    The sequence ratio is length-normalised so that its clip range does not depend on length.
    """
    log_rho = logps - old_logps
    if level == "token":
        return torch.exp(log_rho)
    seq = (log_rho * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    if level == "sequence":
        return torch.exp(seq).expand_as(logps)
    if level == "sequence_token":
        return torch.exp(seq.detach() + logps - logps.detach())
    raise ValueError(f"unknown importance_sampling_level {level!r}, expected one of {IS_LEVELS}")


def policy_loss(rho, logps, A, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, delta=0.0, clip_ratio_c=0.0,
                sapo_temperatures=(1.0, 1.05)):
    """The per-token policy term (B, T) to minimise, from rho (B, T), log-probs (B, T) and A (B, 1).

    grpo:  max(-A rho', -A clip(rho, 1 - eps_low, 1 + eps_high))        (PPO, GRPO Eq. 3)
           rho' = min(rho, delta) with delta (INTELLECT-2), and for A < 0 at most -A c with
           clip_ratio_c = c (dual-clip): a token far off-policy cannot weigh without bound.
    cispo: -sg[min(rho, eps_high)] A log pi                             (CISPO, MiniMax-M1)
           clipping the weight, not the token: every token keeps its REINFORCE gradient. The cap
           is eps_high itself, as in TRL (ScaleRL's eps_max); MiniMax-M1 and verl write 1 + eps_high.
    sapo:  -A (4 / tau) sigmoid(tau (rho - 1)), tau by the sign of A    (SAPO)
           a soft gate: gradient A rho at rho = 1, fading smoothly off-policy.
    All three have the gradient -A grad(rho) at rho = 1 (on-policy): they differ off-policy only.
    """
    if loss_type == "grpo":
        rho_1 = torch.clamp(rho, max=delta) if delta else rho
        pg = torch.maximum(-A * rho_1, -A * torch.clamp(rho, 1 - epsilon_low, 1 + epsilon_high))
        if clip_ratio_c:
            pg = torch.where(A < 0, torch.minimum(pg, -A * clip_ratio_c), pg)
        return pg
    if loss_type == "cispo":
        return -torch.clamp(rho, max=epsilon_high).detach() * A * logps
    if loss_type == "sapo":
        tau = torch.where(A > 0, sapo_temperatures[0], sapo_temperatures[1])
        return -A * torch.sigmoid(tau * (rho - 1)) * 4 / tau
    raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")


def off_policy_mask(logps, rollout_logps, advantages, mask, threshold):
    """(B, 1): 0 for the sequences DeepSeek-V3.2 leaves out of the policy term (arXiv:2512.02556
    Eq. 9): a negative advantage and a mean token log(pi_rollout / pi) above threshold (the
    policy has drifted from the one that sampled them, and pushing down its mistakes then
    destabilises training), else 1. No gradient."""
    kl = ((rollout_logps - logps.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return ((advantages[:, None] >= 0) | (kl <= threshold)).float()


def top_entropy_mask(entropy, mask, quantile, d=common.Dist(), width=None):
    """(B, T): 1 on the ceil(quantile x n) highest-entropy response tokens of the global rollout
    (all ranks, each padded to `width` columns; n its response tokens; ties kept), else 0: only
    these "forking" tokens get the policy gradient (arXiv:2506.01939). Collective; no host sync
    (the k-th largest is read by a gather on the device)."""
    vals = torch.where(mask.bool(), entropy.float(), float("-inf"))  # entropies are >= 0: -inf marks padding
    vals = torch.nn.functional.pad(vals, (0, (width or vals.shape[1]) - vals.shape[1]), value=float("-inf"))
    vals = common.all_gather(vals, d).flatten().sort(descending=True).values
    k = (quantile * (vals > float("-inf")).sum()).ceil().long().clamp(min=1)
    threshold = vals.gather(0, (k - 1).reshape(1))  # the k-th largest
    return ((entropy >= threshold) & mask.bool()).float()


def truncated_is_weights(old_logps, rollout_logps, cap):
    """min(pi_old / pi_rollout, cap) per token, (B, T), no gradient (truncated importance
    sampling: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"). The sampler's numbers differ from the trainer's (bf16 decode kernels, another
    engine), so its samples come from pi_rollout, not pi_old: this ratio corrects the
    expectation, and the cap bounds the variance."""
    return torch.exp(old_logps - rollout_logps).clamp(max=cap).detach()


def overlong_penalty(lengths, max_len, buffer, factor):
    """DAPO's soft overlong punishment (arXiv:2503.14476 Eq. 13), (B,): 0 up to max_len - buffer
    tokens, then falling linearly to -factor at max_len, where a completion is cut."""
    return -factor * ((lengths - (max_len - buffer)) / buffer).clamp(min=0, max=1)


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, normaliser, epsilon_low=0.2, epsilon_high=0.2,
              beta=0.0, kl_estimator="k3", agg="token_mean", entropy=None, entropy_coef=0.0, n_tokens=None,
              loss_type="grpo", level="token", delta=0.0, clip_ratio_c=0.0, sapo_temperatures=(1.0, 1.05),
              pg_weights=None):
    """Policy term + beta * KL - entropy_coef * entropy, aggregated (GRPO Eq. 3, DAPO Eq. 10).

    logps, old_logps, ref_logps, mask: (B, T) per response token; advantages: (B,) per sequence;
    entropy: (B, T) or None; normaliser: the global mini-batch's (loss_normaliser); pg_weights:
    (B, T) or (B, 1) weights of the policy term alone (the masks and truncated IS weights),
    leaving the normaliser as it is. Returns (loss, metrics), 0-d tensors; the token metrics are
    divided by n_tokens, the tokens of the global mini-batch (None: this micro-batch's), so they
    add up like the loss (common.py's rule 1).
    """
    A = advantages[:, None]  # (B, 1): outcome supervision, one advantage for every token
    rho = importance_ratio(logps, old_logps, mask, level)
    pg = policy_loss(rho, logps, A, loss_type, epsilon_low, epsilon_high, delta, clip_ratio_c, sapo_temperatures)
    loss = aggregate(pg if pg_weights is None else pg * pg_weights, mask, agg, normaliser)
    kl = kl_per_token(logps, ref_logps, old_logps, kl_estimator)
    if beta != 0:
        loss = loss + beta * aggregate(kl, mask, agg, normaliser)
    if entropy_coef != 0:
        loss = loss - entropy_coef * aggregate(entropy, mask, agg, normaliser)

    tokens = mask.sum().clamp(min=1) if n_tokens is None else n_tokens

    def mean(x):  # a share of the token mean, for metrics
        return (x.detach().float() * mask).sum() / tokens

    metrics = {"loss": loss.detach(), "kl": mean(kl_per_token(logps, ref_logps, old_logps, "k3")), "kl/optimized": mean(kl),
               "clip_ratio/low": mean((rho < 1 - epsilon_low) & (A < 0)),
               "clip_ratio/high": mean((rho > 1 + epsilon_high) & (A > 0))}
    if clip_ratio_c:
        metrics["clip_ratio/dual"] = mean((rho > clip_ratio_c) & (A < 0))
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
    return loss, metrics


def stream_seed(seed, step, stream, index=0, round_=0):
    """The seed of one random stream of one step (0: sampling; 1: rejection sampling, one stream
    per prompt, `index` its global index; 2: mini-batch order), in rollout round round_ (< 16,
    --dynamic_sampling): distinct for every (run seed, step, stream, round, index), which a sum
    like seed + step would not be (seed 1 step 2 = seed 2 step 1). None depends on the rank:
    1 and N processes draw alike."""
    return seed * 1_000_003 + step + 2**32 * stream + 2**36 * round_ + 2**40 * index


def parse_weights(spec, has_model):
    """`rule:1.0,model:0.5` -> {"rule": 1.0, "model": 0.5}; empty picks the one reward there is."""
    if not spec:
        return {"model": 1.0} if has_model else {"rule": 1.0}
    weights = {}
    for part in spec.split(","):
        name, _, w = part.partition(":")
        try:
            weights[name.strip()] = float(w)
        except ValueError:
            w = "nan"
        if name.strip() not in ("rule", "model") or not math.isfinite(float(w)):
            raise ValueError(f"--reward_weights {spec!r}: expected parts like rule:1.0 or model:0.5 (finite weights)")
    if "model" in weights and not has_model:
        raise ValueError(f"--reward_weights {spec!r} uses `model` but no --reward_model is given")
    return weights


# -----------------------------------------------------------------------------
# models: the reference, LoRA, log-probs of a rollout, rewards, evaluation


def add_lora(model, r, alpha):
    """Wrap every linear layer (not the LM head) with LoRA adapters (peft, an optional extra)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear"))


def reference_context(model, ref):
    """Run the reference: the frozen copy, or the LoRA model with its adapters disabled."""
    return model.disable_adapter() if ref is None else contextlib.nullcontext()


@torch.no_grad()
def refresh_reference(ref, model):
    """Copy the policy's weights into the reference. Under FSDP2 both are sharded
    alike; the root module stays gathered after a no-grad forward, so reshard both first."""
    from torch.distributed.fsdp import FSDPModule

    for m in (*ref.modules(), *model.modules()):
        if isinstance(m, FSDPModule):
            m.reshard()
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        p_ref.copy_(p)


@torch.no_grad()
def batched_logprobs(model, ids, attn, n_response, temperature, d, rows_per_forward, with_entropy=False):
    """Log-probs of the response block of every row, in chunks (no graph); with_entropy: and the
    entropy of each position's distribution."""
    out = []
    for i in range(0, ids.shape[0], rows_per_forward):
        with common.autocast(d):
            out.append(common.response_logprobs(model, ids[i:i + rows_per_forward], attn[i:i + rows_per_forward],
                                                n_response, temperature, with_entropy))
    if with_entropy:
        return tuple(torch.cat([o[j] for o in out]).float() for j in (0, 1))
    return torch.cat(out).float()


@torch.no_grad()
def learned_rewards(rm, rm_tokenizer, prompts, completions, cfg, d):
    """Reward model scores of prompt + completion re-tokenized with the RM's tokenizer, (B,)."""
    p_ids, _ = data.encode_prompts(rm_tokenizer, prompts, cfg.max_prompt_len)
    r_ids, _ = data.encode_responses(rm_tokenizer, completions, cfg.max_new_tokens + 1)
    ids, attn, _ = common.join_prompt_response(p_ids, r_ids, rm_tokenizer.pad_token_id)
    with common.autocast(d):
        return common.reward_scores(rm, ids.to(d.device), attn.to(d.device)).float()


def pairwise_accuracy(model, ref, pairs, pad_id, d, batch_size=128):
    """Share of held-out preference pairs (encoded, data.encode_pairs) whose implicit reward
    log(pi/pi_ref) ranks chosen above rejected, ties counting half: does RL on the reward also
    move the policy towards what people preferred?"""
    def margins(rows):  # (b, 2): log pi - log pi_ref of chosen and of rejected
        batch = data.pair_batch(pairs, rows, pad_id, d.device)
        pi = common.sequence_logprobs(model, batch, d)
        with reference_context(model, ref):
            pi_ref = common.sequence_logprobs(model if ref is None else ref, batch, d)
        return torch.stack((pi - pi_ref).chunk(2), 1)

    with common.evaluating(model):
        m = common.map_rows(margins, len(pairs[0]), d, batch_size)
    return common.ranking_accuracy(m[:, 0], m[:, 1]).item()


@dataclass
class Rollout:
    """The rows of a rollout on this rank, each prompt's G completions contiguous; the prompt block
    left-padded to P tokens and the response block right-padded to R (common.py's layout)."""
    p_ids: torch.Tensor  # (N, P)
    p_mask: torch.Tensor  # (N, P)
    r_ids: torch.Tensor  # (N, R)
    r_mask: torch.Tensor  # (N, R) 1 up to and including the stop token
    r_logps: torch.Tensor  # (N, R) the sampler's log-probs of its tokens
    stopped: torch.Tensor  # (N,) ended with EOS, an end-of-turn id or the truncate token
    rewards: torch.Tensor  # (N,)
    parts: dict  # each term of the reward, (N,): logged as reward/<name>

    def map(self, fn):
        """A rollout of fn(name, tensor) for every tensor."""
        tensors = {f: fn(f, getattr(self, f)) for f in self.__dataclass_fields__ if f != "parts"}
        return Rollout(**tensors, parts={k: fn(k, v) for k, v in self.parts.items()})

    def select(self, idx):
        """The rows idx (a 1-D index)."""
        return self.map(lambda name, x: x[idx.to(x.device)])

    def padded(self, P, R, pad_id):
        """The prompt block left-padded to P tokens, the response block right-padded to R."""
        def pad(name, x):
            if name[:2] not in ("p_", "r_"):
                return x
            side = (P - x.shape[1], 0) if name[:2] == "p_" else (0, R - x.shape[1])
            return torch.nn.functional.pad(x, side, value=pad_id if name.endswith("_ids") else 0)
        return self.map(pad)

    @staticmethod
    def cat(rolls, pad_id):
        """Several rollouts as one, padded to the longest prompt and response blocks."""
        P, R = max(r.p_ids.shape[1] for r in rolls), max(r.r_ids.shape[1] for r in rolls)
        rolls = [r.padded(P, R, pad_id) for r in rolls]
        tensors = [f for f in Rollout.__dataclass_fields__ if f != "parts"]
        return Rollout(**{f: torch.cat([getattr(r, f) for r in rolls]) for f in tensors},
                       parts={k: torch.cat([r.parts[k] for r in rolls]) for k in rolls[0].parts})

    def gather(self, pad_id, d):
        """Every rank's rows, in rank order (the global rollout), on every rank. Collective."""
        if d.world_size == 1:
            return self
        P, R = common.all_reduce_max(self.p_ids.new_tensor(self.p_ids.shape[1:] + self.r_ids.shape[1:]), d).tolist()
        return self.padded(P, R, pad_id).map(lambda name, x: common.all_gather(x.int(), d).bool()
                                             if x.dtype == torch.bool else common.all_gather(x, d))


def minibatch_rows(n_rows, n_minibatches, generator, local=slice(None)):
    """The rows of each mini-batch, (K, n_rows / K): each K consecutive rows of the global rollout
    are dealt one to each of the K mini-batches, in a random order. A rank's share of the rollout
    is a run of whole blocks of K rows (check_config), so every mini-batch holds the same rows on
    any number of ranks, and the same number on each; `local`: this rank's slice of the global
    rows (the indices returned are within it). The generator must be the same on every rank."""
    K = n_minibatches
    deal = torch.rand(n_rows // K, K, generator=generator).argsort(1)  # (n/K, K): the row of each block for mb j
    rows = (torch.arange(n_rows // K)[:, None] * K + deal).T  # (K, n/K) global rows of each mini-batch
    start, stop = local.start or 0, n_rows if local.stop is None else local.stop
    return rows[:, start // K:stop // K] - start


def sync(d):
    """Wait for the device's queued work, so that a wall clock read next measures it (CUDA runs
    asynchronously: without this a phase's time spills into the next one's)."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)


def phase_peak_memory(d):
    """Peak GPU memory (GiB) allocated since the last call, which starts a new window: the
    rollout's and the update's peaks are logged apart. 0 on CPU."""
    if d.device.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated(d.device) / 2**30
    torch.cuda.reset_peak_memory_stats(d.device)
    return peak


# -----------------------------------------------------------------------------


def check_config(cfg, d):
    """Batch arithmetic and flag combinations, with messages that say what to change (the range of
    each flag alone: run.check_ranges)."""
    checks = [
        (cfg.prompts_per_step % d.world_size == 0,
         f"--prompts_per_step {cfg.prompts_per_step} must be divisible by world size {d.world_size} (groups stay on one rank)"),
        ((cfg.prompts_per_step // d.world_size * cfg.group_size) % (cfg.num_mini_batches * cfg.grad_accum) == 0,
         f"each rank's {cfg.prompts_per_step // max(d.world_size, 1)} prompts x --group_size {cfg.group_size} completions "
         f"must split into --num_mini_batches {cfg.num_mini_batches} x --grad_accum {cfg.grad_accum} equal micro-batches"),
        (cfg.rs_samples == 0 or cfg.rs_samples >= cfg.group_size,
         f"--rs_samples {cfg.rs_samples} must be at least --group_size {cfg.group_size} (it keeps group_size of them)"),
        (cfg.rs_mode in ("rso", "topbottom"), f"--rs_mode {cfg.rs_mode!r}: expected rso or topbottom"),
        (cfg.kl_estimator in KL_ESTIMATORS, f"--kl_estimator {cfg.kl_estimator!r}: expected one of {KL_ESTIMATORS}"),
        (cfg.loss_agg in LOSS_AGGS, f"--loss_agg {cfg.loss_agg!r}: expected one of {LOSS_AGGS}"),
        (cfg.scale_rewards in ("group", "batch", "none"), f"--scale_rewards {cfg.scale_rewards!r}: expected group, batch or none"),
        (cfg.loss_type in LOSS_TYPES, f"--loss_type {cfg.loss_type!r}: expected one of {LOSS_TYPES}"),
        (cfg.importance_sampling_level in IS_LEVELS,
         f"--importance_sampling_level {cfg.importance_sampling_level!r}: expected one of {IS_LEVELS}"),
        (cfg.adv_estimator in ADV_ESTIMATORS, f"--adv_estimator {cfg.adv_estimator!r}: expected one of {ADV_ESTIMATORS}"),
        (cfg.adv_estimator == "grpo" or (cfg.scale_rewards == "none" and not cfg.global_norm),
         f"--adv_estimator {cfg.adv_estimator} sets its own scale: pass --scale_rewards none and no --global_norm"),
        (cfg.loss_type != "cispo" or cfg.epsilon_high >= 1,
         f"--loss_type cispo caps the IS weight at --epsilon_high itself, as TRL does: {cfg.epsilon_high} would "
         f"scale every token down; pass a cap above 1 (TRL suggests 5, ScaleRL's eps_max)"),
        (not (cfg.delta or cfg.clip_ratio_c) or cfg.loss_type == "grpo",
         f"--delta and --clip_ratio_c bound the clipped surrogate: they need --loss_type grpo, not {cfg.loss_type}"),
        (not cfg.delta or cfg.delta > 1 + cfg.epsilon_high,
         f"--delta {cfg.delta} must exceed 1 + --epsilon_high ({1 + cfg.epsilon_high}) or be 0 (off)"),
        (not cfg.clip_ratio_c or cfg.clip_ratio_c > 1, f"--clip_ratio_c {cfg.clip_ratio_c} must exceed 1 or be 0 (off)"),
        (cfg.overlong_buffer_len <= cfg.max_new_tokens,
         f"--overlong_buffer_len {cfg.overlong_buffer_len} must be at most --max_new_tokens {cfg.max_new_tokens}"),
        (not (cfg.lora and cfg.ref_refresh_every), "--ref_refresh_every needs a reference copy; it does not combine with --lora"),
        (not (cfg.lora and d.torchrun), "--lora runs without torchrun only (merging sharded adapters is not supported)"),
        (not (cfg.lora and (cfg.save_every or cfg.resume)), "--save_every / --resume do not combine with --lora "
         "(the checkpoint holds merged weights)"),
        (not (cfg.save_every and cfg.ref_refresh_every and cfg.save_every % cfg.ref_refresh_every),
         f"--save_every {cfg.save_every} must be a multiple of --ref_refresh_every {cfg.ref_refresh_every} "
         f"(a resumed run rebuilds its reference from the checkpoint)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def main(cfg):
    # 0. setup: policy, reference, optional reward model, data
    run.check_ranges(cfg)  # every numeric flag within the range its --help states
    d = common.setup_distributed(hsdp=cfg.hsdp)
    check_config(cfg, d)
    common.set_seed(cfg.seed)
    weights = parse_weights(cfg.reward_weights, bool(cfg.reward_model))
    # the data first: a bad file or row stops the run before out_dir or any model is touched
    embedded = cfg.dataset in tasks.TASKS
    rules = "rule" in weights or embedded
    columns = ["prompt"] + (["reward_fn"] if rules and not cfg.reward_fn else [])
    train = data.load_data(cfg.dataset, "train", columns, kind="prompt", n=cfg.n_train, seed=cfg.seed)
    if rules and "reward_fn" not in train.column_names:  # --reward_fn for every row
        train = train.add_column("reward_fn", [cfg.reward_fn] * len(train))
    if rules:
        answers = train["answer"] if "answer" in train.column_names else None
        tasks.check_rule_rows(train["reward_fn"], train["prompt"], cfg.dataset, answers and list(answers))
    pairs = None  # held-out preference pairs
    if cfg.eval_pairs or (embedded and "preference" in tasks.TASKS[cfg.dataset]):
        pairs = data.load_pairs(cfg.eval_pairs or cfg.dataset, cfg.eval_pairs_split if cfg.eval_pairs else "test",
                                cfg.n_eval_pairs, cfg.seed)
        pairs = pairs.select(range(min(cfg.n_eval_pairs, len(pairs))))
    order = common.DataOrder(len(train), cfg.seed, batch=cfg.prompts_per_step, source=f"--dataset {cfg.dataset}",
                             flag="--prompts_per_step")
    run.check_model_paths(cfg, "model", "reward_model")
    job = run.Run(cfg, d)  # checks and locks out_dir; writes nothing yet
    resume_from = job.resume_from
    tokenizer = common.load_tokenizer(resume_from or cfg.model, cfg.trust_remote_code, cfg.chat_template)
    model = common.load_model(resume_from or cfg.model, tokenizer, trust_remote_code=cfg.trust_remote_code, d=d)
    common.check_context(model, cfg.max_prompt_len, cfg.max_new_tokens, "--max_new_tokens")
    ref = None  # with --lora: the policy with its adapters disabled
    if cfg.lora:
        model = add_lora(model, cfg.lora_r, cfg.lora_alpha)
    elif resume_from and not cfg.ref_refresh_every:  # the reference is the starting policy
        common.set_seed(cfg.seed)  # as it was built (`--model tiny` draws random weights)
        ref = common.load_frozen(cfg.model, tokenizer, d, trust_remote_code=cfg.trust_remote_code,
                                 cpu_offload=cfg.offload_frozen)
    else:  # the starting policy, or the last refresh (a resumed checkpoint is one; see check_config)
        ref = common.freeze(copy.deepcopy(model), d, cpu_offload=cfg.offload_frozen)
    model = common.shard_model(model, d, activation_checkpointing=cfg.activation_checkpointing)
    rm = rm_tokenizer = None
    if cfg.reward_model:
        rm_tokenizer = common.load_tokenizer(cfg.reward_model, cfg.trust_remote_code)
        rm = common.load_frozen(cfg.reward_model, rm_tokenizer, d, kind="reward",
                                trust_remote_code=cfg.trust_remote_code, cpu_offload=cfg.offload_frozen)
        # the reward model reads the prompt and the completion re-tokenised (learned_rewards)
        common.check_context(rm, cfg.max_prompt_len, cfg.max_new_tokens + 1, "--max_new_tokens (+1)",
                             f"--reward_model {cfg.reward_model}")
    truncate_id = None
    if cfg.truncate_token:
        t_ids = tokenizer(cfg.truncate_token, add_special_tokens=False)["input_ids"]
        if len(t_ids) != 1:
            raise ValueError(f"--truncate_token {cfg.truncate_token!r} is {len(t_ids)} tokens; it must be one")
        truncate_id = t_ids[0]
    eos_ids = common.stop_token_ids(tokenizer, model)  # EOS, and every end-of-turn id of the generation config
    stop_ids = eos_ids[1:] + ([truncate_id] if truncate_id is not None else [])
    stops = torch.tensor(eos_ids[:1] + stop_ids, device=d.device)
    rule_prompts = list(train["prompt"])  # each row's own prompt, text or messages: what rule rewards read (TRL's)
    train, _ = data.render_chat(train, tokenizer, cfg.dataset)  # conversational prompts, with the generation prompt
    p_ids, n_cut = data.encode_prompts(tokenizer, train["prompt"], cfg.max_prompt_len, cfg.dataset)
    data.show_example(tokenizer, p_ids[0], None, cfg.dataset)
    if n_cut:  # counted once here; each rollout cuts them again from the left
        common.print0(f"{cfg.dataset}: {n_cut} of {len(train)} prompts are longer than --max_prompt_len "
                      f"{cfg.max_prompt_len} tokens and are cut from the left")
    held_out = None  # an embedded task's held-out prompts (rendered) for greedy answers
    if embedded:
        held_out = data.load_data(cfg.dataset, "test", ["prompt"], kind="prompt", n=cfg.n_eval, seed=cfg.seed)
        held_out = {**data.render_chat(held_out, tokenizer, cfg.dataset)[0][:], "own_prompt": list(held_out["prompt"])}
    eval_pairs = bayes = None  # the pairs encoded, and the embedded task's best accuracy on them
    if pairs is not None:
        pairs, chat = data.render_chat(pairs, tokenizer, cfg.eval_pairs or cfg.dataset)
        eval_pairs = data.encode_pairs(pairs, tokenizer, cfg.max_prompt_len, cfg.max_new_tokens, "eval pairs",
                                       eos=not chat)
        if not cfg.eval_pairs:  # the embedded task's label noise is known: the best accuracy there is
            bayes = tasks.bayes_accuracy(pairs)

    params = [p for p in model.parameters() if p.requires_grad]
    n_updates = cfg.num_iterations * cfg.num_mini_batches  # optimizer steps per rollout
    optimizer, scheduler = common.make_optimizer(params, cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                                                 cfg.steps * n_updates)
    n_local = cfg.prompts_per_step // d.world_size  # prompts on this rank per rollout
    n_sample = cfg.rs_samples or cfg.group_size  # completions sampled per prompt
    rows_local = n_local * cfg.group_size  # sequences in the loss on this rank
    mini = rows_local // cfg.num_mini_batches
    micro = mini // cfg.grad_accum
    common.print0(f"grpo: {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters, world size {d.world_size}{d.layout}, "
                  f"{cfg.prompts_per_step} prompts x {cfg.group_size} completions per rollout"
                  f"{f' (kept of {n_sample})' if cfg.rs_samples else ''}, {cfg.num_iterations} pass(es) x "
                  f"{cfg.num_mini_batches} mini-batch(es) of {mini} x {cfg.grad_accum} micro per rank, rewards {weights}")
    start = job.begin(model, tokenizer, optimizer, scheduler, order,  # restores a resumed run's state
                      show=["reward", "kl", "clip_ratio/low", "clip_ratio/high", "completions/mean_length",
                            "eval/exact_match", "eval/gold_reward", "eval/accuracy", "time/step"])

    def evaluate():
        metrics = {}
        if held_out is not None:  # every row of a task has its rule
            metrics |= sampling.evaluate_generations(model, tokenizer, held_out["prompt"],
                                                    tasks.REWARD_FNS[held_out["reward_fn"][0]], d, cfg.max_prompt_len,
                                                    cfg.max_new_tokens, answers=held_out.get("answer"),
                                                    own_prompts=held_out["own_prompt"])
        if eval_pairs is not None:
            metrics["eval/accuracy"] = pairwise_accuracy(model, ref, eval_pairs, tokenizer.pad_token_id, d)
        if bayes is not None:
            metrics |= {"eval/bayes_accuracy": bayes, "eval/accuracy_over_bayes": metrics["eval/accuracy"] / bayes}
        return metrics

    def rollout(step, k):
        """Round k of a step's rollout (1) and rewards (2) on this rank: its slice of
        prompts_per_step new prompts, group_size completions each (the kept ones of n_sample
        with --rs_samples). A dict of row tensors (groups contiguous) and the phases' seconds."""
        t0 = time.time()
        # 1. rollout: every rank draws the same prompts and takes its slice; n_sample each
        rows = order.next(cfg.prompts_per_step)[common.shard_batch(cfg.prompts_per_step, d)]
        batch = train.select(rows)
        prompts = [p for p in batch["prompt"] for _ in range(n_sample)]  # (n_local*n_sample,), groups contiguous
        # the random numbers of the whole global rollout, seeded by step; this rank's rows of them
        u = sampling.rollout_uniforms(cfg.prompts_per_step * n_sample, cfg.max_new_tokens,
                                     stream_seed(cfg.seed, step, stream=0, round_=k))
        u = u[common.shard_batch(cfg.prompts_per_step * n_sample, d)]  # (n_local*n_sample, max_new_tokens)
        p_ids, _ = data.encode_prompts(tokenizer, prompts, cfg.max_prompt_len)
        p_ids, p_mask = (t.to(d.device) for t in common.pad(p_ids, tokenizer.pad_token_id, side="left"))
        with common.evaluating(model, gather=True), common.autocast(d):
            r_ids, r_mask, r_logps = sampling.generate(model, p_ids, p_mask, cfg.max_new_tokens, tokenizer.eos_token_id,
                                                      tokenizer.pad_token_id, cfg.temperature, cfg.top_k, cfg.top_p,
                                                      stop_ids, uniforms=u, compile=cfg.compile, return_logprobs=True)
        r_mask = truncate_mask(r_ids, r_mask, truncate_id)  # (N, R); N = n_local * n_sample
        is_stop = torch.isin(r_ids, stops)  # EOS, another end-of-turn id, or the truncate token
        stopped = (is_stop & r_mask.bool()).any(-1)  # (N,) ended with EOS or the truncate token
        sync(d)  # each phase's clock read after its GPU work is done
        t1 = time.time()
        stats = {"time/rollout": t1 - t0, "mem/rollout_gib": phase_peak_memory(d)}

        # 2. reward: rule functions named per row, a reward model, or a weighted sum
        texts = sampling.decode_responses(tokenizer, r_ids, r_mask * (~is_stop).long(), p_ids)  # no EOS / truncate token
        parts = {}
        if "reward_fn" in batch.column_names:  # each row's rule (logged even when not optimised), given its answer
            fns = [f for f in batch["reward_fn"] for _ in range(n_sample)]
            answers = [a for a in batch["answer"] for _ in range(n_sample)] if "answer" in batch.column_names \
                else [None] * len(fns)
            own = [rule_prompts[i] for i in rows for _ in range(n_sample)]  # the row's prompt, as TRL passes it
            # Python floats of Python functions, computed on the host
            parts["rule"] = torch.tensor([tasks.REWARD_FNS[f](p, c, a) for f, p, c, a in zip(fns, own, texts, answers)],
                                         device=d.device)
        if rm is not None:
            parts["model"] = learned_rewards(rm, rm_tokenizer, prompts, texts, cfg, d)
        rewards = sum(w * parts[k] for k, w in weights.items()) - cfg.no_eos_penalty * (~stopped).float()
        if cfg.overlong_buffer_len:  # a reward term, logged as reward/overlong
            parts["overlong"] = overlong_penalty(r_mask.sum(-1).float(), cfg.max_new_tokens, cfg.overlong_buffer_len,
                                                 cfg.overlong_penalty_factor)
            rewards = rewards + parts["overlong"]
        roll = Rollout(p_ids, p_mask, r_ids, r_mask, r_logps, stopped, rewards, parts)
        if cfg.rs_samples:  # keep group_size of the n_sample completions of each prompt, one stream per prompt
            gens = [torch.Generator().manual_seed(stream_seed(cfg.seed, step, stream=1, index=i, round_=k))
                    for i in range(d.rank * n_local, (d.rank + 1) * n_local)]
            keep = rejection_sample(rewards.view(n_local, n_sample), cfg.group_size, cfg.rs_gamma, cfg.rs_mode, gens)
            roll = roll.select((keep + torch.arange(n_local)[:, None] * n_sample).flatten())
        return roll, stats | {"time/reward": time.time() - t1}

    def informative_rollout(step):
        """--dynamic_sampling: rounds of rollout(step, k) until prompts_per_step groups whose rewards
        differ (DAPO Sec. 3.2) are found, at most max_num_gen_batches; groups still missing are
        filled with equal-reward ones and counted. Each round's rollout is gathered from every
        rank, and the first groups found in global order are dealt to the ranks as any rollout
        is: the same groups on any number of ranks. One host sync per round."""
        kept, spare, stats = [], [], {}
        for k in range(cfg.max_num_gen_batches):
            roll, s = rollout(step, k)
            stats = {key: max(v, stats.get(key, 0.0)) if key.startswith("mem/") else v + stats.get(key, 0.0)
                     for key, v in s.items()}
            roll = roll.gather(tokenizer.pad_token_id, d)  # the round's global rollout, on every rank
            g = roll.rewards.view(-1, cfg.group_size)
            ok = (g.amax(1) > g.amin(1)).repeat_interleave(cfg.group_size)  # (rows,) in groups
            kept.append(roll.select(ok.nonzero().flatten()))
            spare.append(roll.select((~ok).nonzero().flatten()))
            missing = max(cfg.prompts_per_step - sum(len(r.rewards) for r in kept) // cfg.group_size, 0)
            if missing == 0:
                break
        roll = Rollout.cat(kept + spare, tokenizer.pad_token_id)
        roll = roll.select(torch.arange(d.rank * rows_local, (d.rank + 1) * rows_local))
        return roll, stats, {"dynamic_sampling/rounds": torch.tensor(k + 1.0, device=d.device) / d.world_size,
                             "dynamic_sampling/unfilled_groups": torch.tensor(missing / d.world_size, device=d.device)}

    by_entropy = cfg.top_entropy_share < 1
    sapo = (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    peak_gib = 0.0  # the run's peak GPU memory, over the phases' windows
    if start == 1 and (first := evaluate()):  # a prompt file without eval pairs has nothing to evaluate
        job.log(0, first)
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        phase_peak_memory(d)
        # ---------------------------------------------------------------------
        # 1-2. rollout and rewards (rollout() above); with --dynamic_sampling, groups whose rewards
        #      are all equal (no advantage, so no gradient) are replaced by those of new prompts
        if cfg.dynamic_sampling:
            roll, stats, sums = informative_rollout(step)
        else:
            (roll, stats), sums = rollout(step, 0), {}
        p_ids, p_mask, r_ids, r_mask, r_logps = roll.p_ids, roll.p_mask, roll.r_ids, roll.r_mask, roll.r_logps
        stopped, rewards, parts = roll.stopped, roll.rewards, roll.parts
        ids = torch.cat([p_ids, r_ids], 1)  # (rows_local, P+R)
        attn = torch.cat([p_mask, r_mask], 1)
        loss_mask = r_mask * stopped[:, None].long() if cfg.mask_truncated_completions else r_mask
        R = r_ids.shape[1]

        # ---------------------------------------------------------------------
        # 3. advantages, after the reference (and, for mu > 1 or several mini-batches, the
        #    rollout policy's) log-probs, in the precision of training
        t2 = time.time()
        with reference_context(model, ref):
            ref_logps = batched_logprobs(model if ref is None else ref, ids, attn, R, cfg.temperature, d, micro)
        need_old = cfg.num_iterations > 1 or cfg.num_mini_batches > 1 or cfg.kl_in_reward or by_entropy
        old_logps = keep = None  # keep: the tokens that get the policy gradient (--top_entropy_share)
        if by_entropy:
            old_logps, entropy = batched_logprobs(model, ids, attn, R, cfg.temperature, d, micro, with_entropy=True)
            keep = top_entropy_mask(entropy, loss_mask, cfg.top_entropy_share, d, cfg.max_new_tokens)
        elif need_old:
            old_logps = batched_logprobs(model, ids, attn, R, cfg.temperature, d, micro)
        if cfg.kl_in_reward:  # beta * sum_t KL_t of each sequence, taken from its reward (the loss has none)
            kl_seq = (kl_per_token(old_logps, ref_logps, old_logps, cfg.kl_estimator) * r_mask).sum(-1)
            rewards = rewards - cfg.beta * kl_seq
            parts["kl_penalty"] = cfg.beta * kl_seq  # logged as reward/kl_penalty
        adv, adv_metrics = group_advantages(rewards.view(n_local, cfg.group_size), cfg.scale_rewards, cfg.global_norm,
                                            d, estimator=cfg.adv_estimator,
                                            lengths=loss_mask.sum(-1).view(n_local, cfg.group_size))
        sums |= adv_metrics
        adv = adv.flatten()  # (rows_local,)
        n_rows = rows_local * d.world_size  # sequences in the global batch
        lengths = r_mask.sum(-1).float()
        sums |= {f"reward/{k}": v.sum() / n_rows for k, v in parts.items()}
        sums |= {"completions/mean_length": lengths.sum() / n_rows,
                 "completions/clipped_ratio": (~stopped).float().sum() / n_rows}

        # ---------------------------------------------------------------------
        # 4. update: num_iterations passes, each over num_mini_batches optimizer steps of
        #    grad_accum micro-batches; every normaliser is that of the global mini-batch
        grad_norms, gap_max = [], torch.zeros((), device=d.device)
        deal_gen = torch.Generator().manual_seed(stream_seed(cfg.seed, step, stream=2))  # the same on every rank
        beta_loss = 0.0 if cfg.kl_in_reward else cfg.beta
        for it in range(cfg.num_iterations):
            batches = minibatch_rows(rows_local * d.world_size, cfg.num_mini_batches, deal_gen,
                                     common.shard_batch(rows_local * d.world_size, d)).to(d.device)
            for mb_rows in batches:
                normaliser = loss_normaliser(loss_mask[mb_rows], cfg.loss_agg, cfg.max_new_tokens, d)
                n_tokens = loss_normaliser(loss_mask[mb_rows], "token_mean", 0, d).clamp(min=1)  # the metrics' denominator
                for k in range(cfg.grad_accum):
                    r = mb_rows[k * micro:(k + 1) * micro]
                    with common.autocast(d):
                        logps, entropy = common.response_logprobs(model, ids[r], attn[r], R, cfg.temperature,
                                                                  with_entropy=True,
                                                                  entropy_grad=cfg.entropy_coef != 0)
                    logps, mask = logps.float(), loss_mask[r].float()
                    old = logps.detach() if old_logps is None else old_logps[r]
                    w = torch.ones_like(mask[:, :1])  # the policy term's weights: masks, truncated IS
                    if cfg.off_policy_mask_threshold:
                        w = w * off_policy_mask(logps, r_logps[r], adv[r], mask, cfg.off_policy_mask_threshold)
                    if keep is not None:
                        w = w * keep[r]
                    if cfg.vllm_importance_sampling_correction:
                        w = w * truncated_is_weights(old, r_logps[r], cfg.vllm_importance_sampling_clip_max)
                    loss, m = grpo_loss(logps, old, ref_logps[r], adv[r], mask, normaliser, cfg.epsilon_low,
                                        cfg.epsilon_high, beta_loss, cfg.kl_estimator, cfg.loss_agg, entropy.float(),
                                        cfg.entropy_coef, n_tokens, cfg.loss_type, cfg.importance_sampling_level,
                                        cfg.delta, cfg.clip_ratio_c, sapo, w)
                    if it == 0:  # the sampler's log-probs against the trainer's, once per token
                        gap = (old - r_logps[r]).abs() * mask
                        m["rollout/logp_diff"] = gap.sum() / n_tokens * cfg.num_iterations  # the weight undone
                        gap_max = torch.maximum(gap_max, gap.max())
                    common.backward(model, loss, d, sync=k == cfg.grad_accum - 1)
                    common.add_metrics(sums, m, weight=1 / n_updates)  # the mean over the step's updates
                grad_norm, lr = common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)
                grad_norms.append(grad_norm)
        if cfg.ref_refresh_every and step % cfg.ref_refresh_every == 0:
            refresh_reference(ref, model)
        sync(d)
        t_update = time.time() - t2
        stats["mem/update_gib"] = phase_peak_memory(d)  # reward, reference and update phases

        # ---------------------------------------------------------------------
        # 5. metrics (one all-reduce), eval, log
        metrics = common.reduce_metrics(sums, d, maxes={"completions/max_length": lengths.max(),
                                                        "rollout/logp_diff_max": gap_max},
                                        same={"grad_norm": torch.stack(grad_norms).mean()})
        metrics |= {"lr": lr, "time/rollout": stats["time/rollout"], "time/reward": stats["time/reward"],
                    "time/update": t_update}
        if d.device.type == "cuda":
            peak_gib = max(peak_gib, stats["mem/rollout_gib"], stats["mem/update_gib"])
            metrics |= {"mem/rollout_gib": stats["mem/rollout_gib"], "mem/update_gib": stats["mem/update_gib"],
                        "mem/peak_gib": peak_gib}
        job.check(step, metrics, ["loss", "kl", "grad_norm"])  # a NaN stops the run, naming the last good checkpoint
        metrics["time/step"] = time.time() - t0  # training only: evaluation is not part of a step
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate()
        job.log(step, metrics)  # and a checkpoint every --save_every steps

    # LoRA: the adapters folded into the weights, so that the checkpoint loads with AutoModelForCausalLM
    job.finish(model.merge_and_unload() if cfg.lora else None)

if __name__ == "__main__":
    run.script(main, Config)
