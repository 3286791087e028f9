"""Group Relative Policy Optimization (GRPO): on-policy RL from a reward, without a value model.

For each prompt, G completions are sampled from the policy; each completion's advantage is its
reward minus the mean reward of its group, divided by the group's std (DeepSeekMath Sec. 4.1.2,
arXiv:2402.03300). The policy maximises PPO's clipped surrogate (arXiv:1707.06347) with a KL
penalty against a reference policy (GRPO Eq. 3 and 4):

    J = E[ agg_t( min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) - beta KL_t ) ],
    rho_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t).

Every variant is a flag that changes a few visible lines (--help names its paper, and whose name
the flag is: TRL's, else verl's); the functions below carry the equations: the policy term
(`policy_loss`: clipped surrogate, CISPO, SAPO, DPPO), the ratio per token or sequence (GSPO),
advantages (GRPO, RLOO, REINFORCE++, MaxRL), KL estimators, aggregation (Dr. GRPO), rejection sampling
(RSO), DAPO's dynamic sampling and overlong term, and weights of the policy term (DeepSeek-V3.2's
off-policy mask, high-entropy tokens, the sampler-trainer corrections: TIS, IcePop); with --teacher, on-policy
distillation (`distill_advantages`: a per-token advantage from a teacher's log-probs); with --tools,
calls to a tool inside the rollout (sampling.py), whose result tokens the loss leaves out.

Deliberate departures:
1. Each loss normaliser (tokens, sequences, or Dr. GRPO's constant) is that of the whole global
   mini-batch (all micro-batches, all ranks), so accumulation and world size do not change the
   gradient (common.py's rule 1).
2. The `kl` metric is always k3 (unbiased, non-negative), whatever estimator is optimised
   (`kl/optimized`): k1's expected gradient is zero, so its value says little.
3. With one pass over one mini-batch, old log-probs equal the current ones: that forward is
   skipped and rho = exp(logp - logp.detach()) (value 1, gradient kept; trl #2703).
4. Rewards: a rule named per row (a `reward_fn` column), your functions as TRL calls them, a reward
   model, or a weighted sum; a None (not applicable) is left out of the sum and its group, as TRL.
5. Nothing random depends on the rank: the sampler's numbers are drawn for the global rollout and
   indexed by row, rejection sampling draws per prompt, mini-batches are dealt from the global
   rollout and dynamic sampling picks groups in global order: 2 ranks reproduce 1 process.
6. The mini-batches are dealt once a rollout and each pass goes over the same ones (as TRL does), cut
   into the same micro-batches as the reference's, the rollout policy's and the teacher's passes
   (shared_prompt.plan): at equal weights their log-probs are the policy's to the bit, so KL = 0 and
   rho = 1 exactly, and a run whose advantages are all 0 moves no weight (tests/test_exact.py).

Run:
    python grpo.py                                     # from runs/sft, gold reward, CPU
    python grpo.py --reward_model runs/rm --out_dir runs/grpo-rm   # the learned reward
    torchrun --nproc_per_node 8 grpo.py --model runs/sft-gpt2 --dataset trl-lib/tldr \\
        --reward_model runs/rm-gpt2 --max_prompt_len 384 --max_new_tokens 56 --lr 1e-6
"""
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch

import common
import data
import environment
import reward_fns
import sampling
import shared_prompt
import tasks
from plumbing import cli, conflicts, logs, models, rundir, speed

KlEstimator = Literal["k1", "k2", "k3", "ratio_k1", "ratio_k3"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "constant"]
LossType = Literal["grpo", "cispo", "sapo", "dppo_tv", "dppo_kl"]
IsLevel = Literal["token", "sequence", "sequence_token"]
AdvEstimator = Literal["grpo", "rloo", "reinforce_pp", "maxrl"]
IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "sequence_geometric_mask"]
KL_ESTIMATORS, LOSS_AGGS, LOSS_TYPES, IS_LEVELS, ADV_ESTIMATORS, IS_MODES = map(
    get_args, (KlEstimator, LossAgg, LossType, IsLevel, AdvEstimator, IsMode))


@dataclass
class Config(cli.SharedConfig):
    # the values of the flags left unset (cli.fill_defaults): the embedded task's, its results' own, or TRL 1.16's
    # GRPOConfig (lr 1e-6, 512 completion tokens, beta 0, epsilon 0.2, one pass of one mini-batch; TRL cuts no prompt)
    LORA_RESUMES: ClassVar[bool] = False  # --lora's checkpoint holds merged weights (conflicts.grpo, cli.check_saves)
    DEFAULTS: ClassVar[dict] = {
        "embedded": dict(lr=1e-4, max_prompt_len=64, max_new_tokens=24, beta=0.04, epsilon_high=0.28, num_iterations=2,
                         num_mini_batches=2, reference=True),
        "trl": dict(lr=1e-6, max_prompt_len=512, max_new_tokens=512, beta=0.0, epsilon_high=0.2, num_iterations=1,
                    num_mini_batches=1, reference=False)}
    # --- model and data ---
    model: str = "runs/sft"
    """the policy to start from: a checkpoint folder (runs/sft), a hub id, `tiny`, `smollm2` or path/to/model.gguf"""
    dataset: str = "sort"
    """embedded task (sort; arith, a chat task for instruct models), a hub id, or a local .jsonl/.json/.parquet with
    a prompt (and reward_fn) column; every other column reaches your reward functions"""
    n_train: int = 20000
    """prompts drawn from an embedded task [>= 1]"""
    # --- sampling ---
    prompts_per_step: int = 32
    """prompts per rollout, over all ranks [>= 1]"""
    group_size: int = 8
    """completions per prompt that enter the loss (G) [>= 2]"""
    max_new_tokens: int | None = None
    """response tokens sampled at most (a completion that reaches it without stopping is 'clipped') [>= 1]"""
    temperature: float = 1.0
    """sampling temperature; the loss's log-probs use the same temperature [> 0]"""
    top_k: int = 0
    """sample from the k most likely tokens only (0: all) [>= 0]"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off) (0, 1]"""
    min_p: float = 0.0
    """min-p sampling (arXiv:2407.01082): keep tokens >= min_p x the top one's probability, before --top_k and --top_p
    as vLLM orders them (0: off) [0, 1)"""
    sampling_replay: bool = True
    """under --top_k/--top_p/--min_p the sampler draws from, and records log-probs of, the truncated renormalised
    distribution; replay: the trainer applies the same rule to its logits (fp32, the sampled token kept), so loss,
    ratios and KL optimise that truncated policy, the one that sampled. --no-sampling_replay: the full policy, the
    truncation corrected only by --vllm_importance_sampling_correction (pi_full / pi_truncated; dropped tokens are
    never sampled) (prime-rl's sampling replay, PR #2601; DeepSeek-V3.2's Keep Sampling Mask, arXiv:2512.02556 3.1)"""
    truncate_token: str = ""
    """a string of one token: generation also stops at it, and tokens after it are masked"""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the rollout's decode step (10-60 s once per batch shape; pays over a run's many rollouts). auto:
    on a GPU under `python` (a CUDA-graph decode step), not under torchrun nor on a CPU (plumbing/speed.py)"""
    generation_micro_batch_size: int = 0
    """rows each rank samples at once: its KV cache's rows (0: all; TRL's generation_batch_size is the rollout) [>= 0]"""
    tools: str = ""
    """a tool the policy may call mid-answer (sampling.generate_with_tools): `calculator`, or your `module:function` (text -> text)"""
    max_tool_calls: int = 2
    """tool calls per completion at most; their results count in --max_new_tokens but never in the loss [>= 1]"""
    # --- reward ---
    reward_model: str = ""
    """a reward model checkpoint (reward.py's out_dir), scored on prompt + decoded completion"""
    reward_fn: str = ""
    """a rule of tasks.REWARD_FNS for every row without a `reward_fn` of its own (`math`: the final number against
    the row's answer, GSM8K's `#### 72` or a bare number; `think_format`: R1's <think>...</think><answer>...
    </answer>); or TRL's reward_funcs, comma-separated: rules and your `module:function`s (a module, or
    path/to/file.py:fn), each called fn(prompts=, completions=, completion_ids=, **columns) -> a float or None
    per completion; the functions of one file in one worker process, sharing its state and called in this order, as
    TRL calls them in its one process"""
    reward_fn_timeout: float = 600.0
    """seconds a --reward_fn function's call (a rank's completions of a step, all at once; it runs in a worker process)
    may take before the run stops naming it, its rows and its rank (TRL has none): minutes for a judge behind an API;
    under torchrun at most half of --timeout_minutes (refused otherwise), so that a hang is named before another
    rank's collective times out [> 0]"""
    reward_weights: str = ""
    """weighted sum of rewards by name, e.g. `rule:1.0,model:0.5` or `math:1,fn:0.5` (rule: each row's rule; model:
    --reward_model; a function: its name) (empty: each --reward_fn function and --reward_model at 1, else the one
    reward there is)"""
    answer_column: str = ""
    """the column holding each row's reference for the rules that need one (math) (empty: `answer`, else TRL's
    `solution`)"""
    teacher: str = ""
    """on-policy distillation: a model with the policy's tokenizer whose log-probs of the policy's own tokens give each
    token an advantage, teacher_coef x (log p_teacher - log pi), beside the reward's (`--reward_weights rule:0`: alone)"""
    teacher_coef: float = 1.0
    """the distillation advantage's weight [>= 0]"""
    no_eos_penalty: float = 0.0
    """subtracted from the reward of a completion that never stops (no EOS or truncate token) [>= 0]"""
    mask_truncated_completions: bool = False
    """leave completions that never stop out of the loss"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment (arXiv:2503.14476 Eq. 13; verl's overlong_buffer.len): a reward term falling
    linearly from 0 at max_new_tokens minus this many tokens to -overlong_penalty_factor at max_new_tokens (0: off)
    [>= 0]"""
    overlong_penalty_factor: float = 1.0
    """the overlong term at max_new_tokens (verl's overlong_buffer.penalty_factor) [>= 0]"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv:2503.14476 Sec. 3.2; verl's filter_groups): groups whose rewards are all equal
    carry no gradient; replace them by the groups of new prompts, sampled round after round"""
    max_num_gen_batches: int = 4
    """rollout rounds per step at most with --dynamic_sampling; groups still missing after them are filled with
    equal-reward ones, counted in dynamic_sampling/unfilled_groups (verl's name) [1, 15]"""
    rs_samples: int = 0
    """rejection sampling: sample this many per prompt and keep group_size of them (0: off) [>= 0]"""
    rs_mode: Literal["rso", "topbottom"] = "rso"
    """rso (statistical rejection sampling, RSO Alg. 1) or topbottom (best and worst halves)"""
    rs_gamma: float = 2.0
    """RSO temperature: accept with probability exp((r - r_max) / gamma) [> 0]"""
    # --- loss ---
    adv_estimator: AdvEstimator = "grpo"
    """advantages (verl's name): grpo (reward - group mean, then --scale_rewards); rloo (reward - mean of the
    group's others, arXiv:2402.14740); reinforce_pp (reward - group mean, then whitened over every response token of
    the batch, as verl and OpenRLHF do: REINFORCE++-baseline, arXiv:2501.03262); maxrl (MaxRL, arXiv:2602.02710:
    (reward - group mean) / group mean, 0 where the mean is <= 0, as prime-rl and SkyRL (whose name it is) compute
    it: a truncation of maximum likelihood for rewards in [0, 1]). All but grpo take --scale_rewards none"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide centred rewards by the std of their group, of the whole batch, or `none` (Dr. GRPO)"""
    global_norm: bool = False
    """then normalise advantages to mean 0, std 1 over the whole batch on all ranks"""
    epsilon_low: float = 0.2
    """clip rho below at 1 - epsilon_low [0, 1)"""
    epsilon_high: float | None = None
    """clip rho above at 1 + epsilon_high: 0.28 on the embedded task (DAPO's clip-higher, arXiv:2503.14476), TRL's
    default 0.2 for your own model; with --loss_type cispo the IS weight's cap itself, as in TRL (which suggests 5;
    MiniMax-M1 and verl write 1 + eps_high) (TRL's name) [>= 0]"""
    loss_type: LossType = "grpo"
    """the policy term: grpo (PPO's clipped surrogate), cispo (the clipped IS weight, without gradient, times every
    token's REINFORCE term: arXiv:2506.13585), sapo (a soft gate instead of the clip: arXiv:2511.20347); or (verl's
    values) dppo_tv, dppo_kl (DPPO, arXiv:2602.04879: a token whose probability moved past --epsilon_low /
    --epsilon_high in the advantage's direction, by their difference (TV) or the binary KL, gets no gradient; verl's
    recipe: 0.15 for TV, 0.05 for KL; prime-rl's default loss). How it is averaged is --loss_agg. TRL's loss_type
    names both: its dapo and dr_grpo are taken for --loss_agg token_mean and constant; grpo and sapo given here mean
    TRL's, averaged per sequence (--loss_agg seq_mean_token_mean) unless --loss_agg is given (not given, the policy
    term is grpo's and the average token_mean: TRL's default dapo); its bnpo, luspo and vespo are refused saying
    what is nearest (trl_flags)"""
    importance_sampling_level: IsLevel = "token"
    """rho per token (PPO), per sequence (GSPO, arXiv:2507.18071: exp of the mean token log-ratio, one per sequence;
    GSPO clips at 3e-4 / 4e-4) (TRL's name and values), or sequence_token (GSPO-token: the sequence's value, each
    token's gradient; TRL has it only in an experimental trainer of its own, not as a value here)"""
    delta: float = 0.0
    """INTELLECT-2's two-sided clip (arXiv:2505.07291): rho capped at delta in the unclipped term, so negative
    advantages cannot weigh without bound (0: off; else > 1 + epsilon_high) (TRL's name) [>= 0]"""
    clip_ratio_c: float = 0.0
    """dual-clip PPO (arXiv:1912.09729): for negative advantages the loss is at most c |A| (0: off; else > 1, verl
    uses 3); with --loss_type dppo_*, each token's weight capped at c, as verl's DPPO does (verl's name) [>= 0]"""
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
    """weight the policy term by the ratio pi_old / pi_rollout, pi_rollout the sampler's own log-probs, bounded as
    --vllm_importance_sampling_mode says, to correct for the sampler's numerics differing from the trainer's (TRL's
    name; TRL turns it on for vLLM's rollouts. Off here: the sampler is the trainer's own model, in fp32 on the CPU
    the ratio is 1 up to float noise, which it would only add; turn it on for bf16 on a GPU. Their gap is logged
    as rollout/logp_diff either way)"""
    vllm_importance_sampling_mode: IsMode = "sequence_mask"
    """token_truncate (TIS: each token's ratio clamped to the bounds, Yao et al. 2025), token_mask (IcePop: a
    token's ratio outside them gets no gradient, arXiv:2510.18855), sequence_truncate / sequence_mask (one ratio
    per sequence, the product of its tokens', clamped, or the sequence masked outside the bounds: MIS) (TRL's
    name, values and default), or sequence_geometric_mask (a sequence whose geometric mean ratio leaves the bounds
    gets no gradient, the others weight 1: verl's rollout_rs=seq_mean_k1, SkyRL's geometric mask; bounds
    near 1, e.g. 0.99 and 1.01)"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """the ratio's upper bound C_max (none: unbounded) (TRL's name and default) [> 0]"""
    vllm_importance_sampling_clip_min: float | None = None
    """the ratio's lower bound C_min (none: unbounded, TRL's default) (TRL's name) [>= 0]"""
    beta: float | None = None
    """the KL penalty's coefficient (GRPO Eq. 3): 0.04 on the embedded task (DeepSeekMath's, with which its results
    were made); for a model of your own TRL's default 0, and then, as in TRL, no reference model is loaded (--reference
    loads one) and the run logs no `kl` nor eval/accuracy [>= 0]"""
    kl_estimator: KlEstimator = "k3"
    """k1, k2, k3, ratio_k1 or ratio_k3 (GRPO Eq. 4 is k3)"""
    kl_in_reward: bool = False
    """subtract beta x sum of per-token KL estimates from each reward instead of adding KL to the loss"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient [>= 0]"""
    loss_agg: LossAgg = "token_mean"
    """how the per-token terms are averaged, over the global mini-batch: token_mean (over its tokens; TRL's dapo, its
    default), seq_mean_token_mean (each sequence's token mean, averaged over sequences: TRL's grpo and sapo, which
    --loss_type grpo or sapo given brings) or constant (the sum over max_new_tokens x sequences: Dr. GRPO, TRL's
    dr_grpo)"""
    # --- reference ---
    reference: bool | None = None
    """load the reference policy at --beta 0 too, for the `kl` metric and eval/accuracy (at --beta > 0 one always
    is): on by default on the embedded task, whose KL study measures a run without a KL term; off for a model of
    your own, as TRL loads none at beta 0"""
    ref_refresh_every: int = 0
    """copy the policy into the reference every this many steps (0: never) [>= 0]"""
    # --- optimisation ---
    steps: int = 20
    """rollouts (each followed by num_iterations x num_mini_batches optimizer steps) [>= 1]"""
    num_iterations: int | None = None
    """mu: passes over each rollout: 2 on the embedded task, TRL's default 1 for a model of your own [>= 1]"""
    num_mini_batches: int | None = None
    """optimizer steps per pass (the rollout split into this many mini-batches): 2 on the embedded task, TRL's
    default 1 (one optimizer step a rollout) for a model of your own [>= 1]"""
    grad_accum: int = 1
    """micro-batches per mini-batch on each rank [>= 1]"""
    shared_prompt: bool | Literal["auto"] = "auto"
    """a group's rows compute their prompt once, its keys and values serving each row, in the reference pass and
    the update, where that computes fewer FLOPs than padded (or --padding_free) micro-batches: the same log-probs to
    float rounding, never more rows a forward than a padded micro-batch; one process (under torchrun: off). auto:
    true on a CPU; on a GPU if faster, timed once on a first micro-batch (plumbing/speed.py)"""
    warmup_steps: int = 5
    """linear warmup (optimizer steps) before the cosine decay [>= 0]"""
    offload_frozen: bool = False
    """keep the reference and reward model's parameters in CPU memory between uses (FSDP2 on GPUs, under
    torchrun)"""
    # --- evaluation ---
    eval_dataset: str | None = None
    """held-out prompts (a file, or a hub id's --eval_split), answered greedily and sampled and scored by every
    reward (eval/reward, eval/rewards/<name>/mean; eval/greedy/...); None: a local --dataset's prompts hashing into
    a held-out 5%"""
    eval_split: str = "test"
    """split of a hub --eval_dataset"""
    eval_every: int = 10
    """evaluate every this many steps (and at step 0 and the end) [>= 1]"""
    n_eval: int = 500
    """held-out prompts evaluated at most (the embedded task's: greedy exact-match and gold reward) [>= 1]"""
    n_eval_pairs: int = 500
    """held-out preference pairs for the pairwise accuracy of beta*log(pi/pi_ref) [>= 1]"""
    eval_batch_size: int = 128
    """pairs per forward in that evaluation, fewer where their logits would pass 1 GiB [>= 1]"""
    eval_pairs: str = ""
    """preference pairs (hub id or file: prompt, chosen, rejected, or HH rows) for that accuracy; the embedded task
    uses its own test pairs"""
    eval_pairs_split: str = "validation"
    """split of --eval_pairs (a local file has one)"""
    log_completions: int = 0
    """print each step's first N completions of rank 0 (prompt, completion, reward and its parts) as a table and append
    them to out_dir/completions.jsonl (TRL's log_completions) [>= 0]"""
    # --- run ---
    out_dir: str = "runs/grpo"
    """where metrics.jsonl and the checkpoint/ folder go"""
    seed: int = 0
    """seed for data order and sampling (the same rollouts on any number of ranks) [0, 4294967295]"""


# -----------------------------------------------------------------------------
# the math: pure functions of tensors, each returning detached metrics beside its result


def rejection_sample(rewards, k, gamma, mode="rso", generator=None):
    """Keep k of N samples per prompt. rewards: (B, N) -> indices (B, k), ascending per row.
    rso: RSO Algorithm 1 (arXiv:2309.06657): rounds over the remaining candidates, each accepted
    with probability exp((r - r_max) / gamma), r_max the best remaining reward, until k are (small
    gamma keeps the best, large samples uniformly). topbottom: the k - k//2 highest and k//2 lowest
    rewards. generator: one, or one per row (grpo.py seeds each by its prompt's index)."""
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
    batch on all ranks (`batch`), or 1 (`none`, Dr. GRPO); unbiased stds. global_norm then
    rescales A to mean 0, std 1 over the batch on all ranks.
    rloo: A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group(r)) (arXiv:2402.14740).
    reinforce_pp: r - mean_group(r), whitened over every response token of the batch (each
    response counted `lengths` (B, G) times: (A - mean) / sqrt(var + 1e-8), as verl and OpenRLHF
    compute REINFORCE++-baseline, arXiv:2501.03262 Sec. 3).
    maxrl: (r - mean_group(r)) / mean_group(r), 0 for a group whose mean is <= 0 (MaxRL,
    arXiv:2602.02710, as prime-rl and SkyRL compute it): for rewards in {0, 1} the expected
    gradient is that of -sum_{k<G} (1 - p)^k / k, p the prompt's pass rate, a truncation of
    maximum likelihood's log p that weighs hard prompts ~1/p where GRPO's std weighs them ~1/sqrt(p).
    A NaN reward (no reward function scored the completion) is left out of every mean and std, and
    its advantage is 0 (TRL's unscorable completions); a group without one takes the plain path."""
    G = rewards.shape[1]
    scored = ~rewards.isnan()  # (B, G)
    full, n, r0 = scored.all(1, keepdim=True), scored.sum(1, keepdim=True), rewards.nan_to_num(0.0)
    nan_mean = r0.sum(1, keepdim=True) / n.clamp(min=1)
    nan_std = ((((r0 - nan_mean) * scored) ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    mean = torch.where(full, rewards.mean(1, keepdim=True), nan_mean)
    std = torch.where(full, rewards.std(1, keepdim=True), nan_std) if G > 1 else torch.zeros_like(mean)
    # equal scored rewards (none scored: equal) have no advantage, exactly: compared, not read from their
    # std, whose mean can be an ulp off (8 x 0.3 -> 3e-8), which eps scales to 3e-4 and Adam to lr-sized steps
    zero_std = rewards.nan_to_num(-math.inf).amax(1) <= rewards.nan_to_num(math.inf).amin(1)  # (B,)
    adv = torch.where(zero_std[:, None], 0.0, rewards - mean)
    if estimator == "rloo":
        adv = adv * n / (n - 1).clamp(min=1)
    elif estimator == "reinforce_pp":
        t_mean, t_std = _global_mean_std(adv.nan_to_num(0.0), d, weights=(torch.ones_like(r0) if lengths is None else lengths) * scored)
        adv = (adv - t_mean) * torch.rsqrt(t_std * t_std + 1e-8)
    elif estimator == "maxrl":
        adv = torch.where(mean > 0, adv / torch.where(mean > 0, mean, 1.0), 0.0)
    elif estimator != "grpo":
        raise ValueError(f"unknown adv_estimator {estimator!r}, expected one of {ADV_ESTIMATORS}")
    if scale == "group":
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / (_global_mean_std(r0, d, weights=scored)[1] + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}")
    if global_norm:
        g_mean, g_std = _global_mean_std(adv.nan_to_num(0.0), d, weights=scored)
        adv = (adv - g_mean) / (g_std + eps)
    n_groups = rewards.shape[0] * d.world_size
    metrics = {"reward": mean.sum() / n_groups, "reward_std": std.sum() / n_groups,
               "frac_reward_zero_std": zero_std.float().sum() / n_groups}
    return torch.where(scored, adv, 0.0), metrics


def kl_per_token(logps, ref_logps, old_logps, estimator):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi_old, (B, T).

    log r = log pi_ref - log pi;  k1 = -log r;  k2 = (log r)^2 / 2;  k3 = r - log r - 1.
    ratio_k* multiply by rho = pi / pi_old (value 1 on-policy, gradient not): their expected
    gradient is that of KL(pi || pi_ref), which k1's (zero) and k3's (KL(pi_ref || pi)) are not."""
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


def distill_advantages(teacher_logps, logps, mask, coef=1.0):
    """On-policy distillation's advantage of each sampled token (GKD, arXiv:2306.13649; Thinking
    Machines' recipe, 2025), (B, T): coef (log q - log pi), q the teacher: minus kl_per_token's k1
    sample of KL(pi || q), with the teacher as the reference. No baseline: E_o~pi[(log q(o) -
    log pi(o)) grad log pi(o)] = -grad KL(pi || q), since E[grad log pi] = 0, so the policy term
    descends the reverse KL (mode seeking), each token for its own term (discount 0: a token is not
    credited with the KL of the tokens after it). Unlike beta x KL in the loss, it is a reward:
    clipped like one, and zero where the policy already agrees with the teacher."""
    return coef * (teacher_logps - logps).detach() * mask


def aggregate(x, mask, agg, normaliser):
    """Reduce per-token values x (B, T) under mask (B, T) to a scalar.

    normaliser (from loss_normaliser, over the whole global mini-batch):
      token_mean:          sum of x over tokens / tokens in the global mini-batch
      seq_mean_token_mean: sum over sequences of (token mean of the sequence) / sequences
      constant:            sum of x over tokens / (max_new_tokens x sequences)  (Dr. GRPO)
    Summing this over micro-batches gives exactly the value of the whole mini-batch."""
    if agg == "seq_mean_token_mean":
        return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    if agg in ("token_mean", "constant"):
        return (x * mask).sum() / normaliser
    raise ValueError(f"unknown loss_agg {agg!r}, expected one of {LOSS_AGGS}")


def loss_normaliser(mask, agg, max_new_tokens, d=common.Dist()):
    """The denominator of `aggregate` for a global mini-batch whose local rows have this
    mask (B, T): tokens or sequences summed over all ranks, at least 1 (with
    --mask_truncated_completions a mini-batch may hold no token: its loss is 0, not 0 / 0). Collective."""
    n = mask.sum() if agg == "token_mean" else mask.new_tensor(mask.shape[0] * (max_new_tokens if agg == "constant" else 1))
    return common.all_reduce_sum(n.double(), d).clamp(min=1)  # a tensor: no host sync per mini-batch


def importance_ratio(logps, old_logps, mask, level="token"):
    """rho (B, T) of every response token, from log-probs (B, T) and the response mask.

    token:          rho_t = pi(o_t) / pi_old(o_t)                             (PPO)
    sequence:       s = exp(mean_t log rho_t), the same for every token       (GSPO)
    sequence_token: sg[s] * pi(o_t) / sg[pi(o_t)]: value s, gradient of log pi(o_t) times s
                    (GSPO-token; equal to `sequence` in value, and in gradient when the
                    advantage is the same for every token of a sequence)
    The sequence ratio is length-normalised so that its clip range does not depend on length."""
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
                sapo_temperatures=(1.0, 1.05), old_logps=None):
    """The per-token policy term (B, T) to minimise, from rho (B, T), log-probs (B, T) and A (B, 1).

    grpo:  max(-A rho', -A clip(rho, 1 - eps_low, 1 + eps_high))        (PPO, GRPO Eq. 3)
           rho' = min(rho, delta) with delta (INTELLECT-2), and for A < 0 at most -A c with
           clip_ratio_c = c (dual-clip): a token far off-policy cannot weigh without bound.
    cispo: -sg[min(rho, eps_high)] A log pi                             (CISPO, MiniMax-M1)
           clipping the weight, not the token: every token keeps its REINFORCE gradient. The cap
           is eps_high itself, as in TRL (ScaleRL's eps_max); MiniMax-M1 and verl write 1 + eps_high.
    sapo:  -A (4 / tau) sigmoid(tau (rho - 1)), tau by the sign of A    (SAPO)
           a soft gate: gradient A rho at rho = 1, fading smoothly off-policy.
    dppo_tv, dppo_kl: -A rho m, m = dppo_mask (0 or 1, no gradient)       (DPPO)
           the trust region is a divergence of the token's probability, not its ratio; with
           clip_ratio_c = c the weight is sg[min(rho, c)] (verl's truncation): -A sg[min(rho, c)] pi / sg[pi].
    All have the gradient -A grad(rho) at rho = 1 (on-policy): they differ off-policy only."""
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
    if loss_type in ("dppo_tv", "dppo_kl"):
        m = dppo_mask(logps, old_logps, A, loss_type, delta_low=epsilon_low, delta_high=epsilon_high)
        w = torch.clamp(rho, max=clip_ratio_c).detach() * torch.exp(logps - logps.detach()) if clip_ratio_c else rho
        return -A * w * m
    raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")


def dppo_mask(logps, old_logps, A, kind, delta_low, delta_high):
    """DPPO's binary trust region (arXiv:2602.04879 Eq. 13-14; verl's dppo_tv / dppo_kl, prime-rl's
    default, SkyRL's dppo), (B, T), no gradient: 0 on the tokens whose probability moved from p_old
    past delta in the advantage's direction (up for A > 0, down otherwise), else 1; dppo_tv: by p -
    p_old (the total variation of {token, rest}), dppo_kl: by that binary distribution's KL(p_old || p).
    Unlike PPO's ratio, a rare token's tenfold rise stays inside it and a likely token's fall does not."""
    p, p_old, lp = torch.exp(logps.detach()), torch.exp(old_logps), logps.detach()
    if kind == "dppo_tv":
        up, down = p - p_old > delta_high, p - p_old < -delta_low
    else:
        kl = p_old * (old_logps - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        up, down = (kl > delta_high) & (p > p_old), (kl > delta_low) & (p < p_old)
    return (~torch.where(A > 0, up, down)).to(logps.dtype)


def off_policy_mask(logps, rollout_logps, advantages, mask, threshold):
    """(B, 1): 0 for the sequences DeepSeek-V3.2 leaves out of the policy term (arXiv:2512.02556
    Eq. 9), those with a negative advantage and a mean token log(pi_rollout / pi) above threshold
    (pushing down the mistakes of a policy it has drifted from destabilises training), else 1."""
    kl = ((rollout_logps - logps.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return ((advantages[:, None] >= 0) | (kl <= threshold)).float()


def top_entropy_mask(entropy, mask, quantile, d=common.Dist(), width=None):
    """(B, T): 1 on the ceil(quantile x n) highest-entropy of the n response tokens of the global
    rollout (all ranks, each padded to `width` columns; ties kept), else 0: only these "forking"
    tokens get the policy gradient (arXiv:2506.01939). Collective; no host sync."""
    vals = torch.where(mask.bool(), entropy.float(), float("-inf"))  # entropies are >= 0: -inf marks padding
    vals = torch.nn.functional.pad(vals, (0, (width or vals.shape[1]) - vals.shape[1]), value=float("-inf"))
    vals = common.all_gather(vals, d).flatten().sort(descending=True).values
    k = (quantile * (vals > float("-inf")).sum()).ceil().long().clamp(min=1)
    threshold = vals.gather(0, (k - 1).reshape(1))  # the k-th largest
    return ((entropy >= threshold) & mask.bool()).float()


def rollout_is_weights(old_logps, rollout_logps, mask, mode="sequence_mask", clip_min=None, clip_max=3.0):
    """The sampler-trainer correction (TRL 1.16's vllm_importance_sampling_mode): weights of the
    policy term, no gradient, (B, T) per token or (B, 1) per sequence, and the tokens (B, T) whose
    ratio left [clip_min, clip_max] (None: unbounded). The sampler's numerics (kernels, precision,
    batch shape) make pi_rollout, which drew the samples, differ from the trainer's pi_old.
    token_*:    r_t = pi_old(o_t) / pi_rollout(o_t)
    sequence_*: r = prod_t r_t (TRL; verl's rollout_is=sequence): unbiased, its variance growing with length
    *_truncate: clamp(r, clip_min, clip_max)           (TIS, Yao et al. 2025)
    *_mask:     r inside the bounds, 0 outside          (token_mask: IcePop; sequence_mask: MIS)
    sequence_geometric_mask: 1 if exp(mean_t log r_t) is inside the bounds, else 0, a rejection, not
                a weight (verl's rollout_rs=seq_mean_k1, SkyRL's geometric sequence mask)."""
    log_r = (old_logps - rollout_logps) * mask
    if mode == "sequence_geometric_mask":
        log_r = log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    elif mode.startswith("sequence"):
        log_r = log_r.sum(-1, keepdim=True)
    elif not mode.startswith("token"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}, expected one of {IS_MODES}")
    r = torch.exp(log_r).detach()
    outside = (r < (-math.inf if clip_min is None else clip_min)) | (r > (math.inf if clip_max is None else clip_max))
    if mode.endswith("truncate"):
        w = r.clamp(min=clip_min, max=clip_max)
    else:
        w = torch.where(outside, 0.0, torch.ones_like(r) if mode == "sequence_geometric_mask" else r)
    return w, outside.expand_as(mask) & mask.bool()


def policy_weights(cfg, logps, old_logps, rollout_logps, advantages, mask, keep, n_tokens):
    """The policy term's weights for one micro-batch, (B, T) or (B, 1), no gradient: DeepSeek-V3.2's
    off-policy mask, the high-entropy tokens kept (`keep`, or None), the sampler-trainer correction
    (--vllm_importance_sampling_mode); and the correction's metrics, shares of the global mini-batch
    (n_tokens tokens; its sequences from the flags) as TRL logs them: the mean ratio (per token, or
    per sequence for sequence modes) and the tokens and sequences outside the bounds."""
    w, metrics = torch.ones_like(mask[:, :1]), {}
    if cfg.off_policy_mask_threshold:
        w = w * off_policy_mask(logps, rollout_logps, advantages, mask, cfg.off_policy_mask_threshold)
    if keep is not None:
        w = w * keep
    if cfg.vllm_importance_sampling_correction:
        is_w, outside = rollout_is_weights(old_logps, rollout_logps, mask, mode=cfg.vllm_importance_sampling_mode,
                                           clip_min=cfg.vllm_importance_sampling_clip_min,
                                           clip_max=cfg.vllm_importance_sampling_clip_max)
        w, n_seqs = w * is_w, cfg.prompts_per_step * cfg.group_size / cfg.num_mini_batches
        mean = is_w.sum() / n_seqs if is_w.shape[1] == 1 else (is_w * mask).sum() / n_tokens
        metrics = {"sampling/importance_sampling_ratio/mean": mean,
                   "sampling/importance_sampling_ratio/outside_tokens": outside.sum() / n_tokens,
                   "sampling/importance_sampling_ratio/outside_sequences": outside.any(-1).sum() / n_seqs}
    return w, metrics


def overlong_penalty(lengths, max_len, buffer, factor):
    """DAPO's soft overlong punishment (arXiv:2503.14476 Eq. 13), (B,): 0 up to max_len - buffer
    tokens, then falling linearly to -factor at max_len, where a completion is cut."""
    return -factor * ((lengths - (max_len - buffer)) / buffer).clamp(min=0, max=1)


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, normaliser, epsilon_low=0.2, epsilon_high=0.2,
              beta=0.0, kl_estimator="k3", agg="token_mean", entropy=None, entropy_coef=0.0, n_tokens=None,
              loss_type="grpo", level="token", delta=0.0, clip_ratio_c=0.0, sapo_temperatures=(1.0, 1.05),
              pg_weights=None):
    """Policy term + beta * KL - entropy_coef * entropy, aggregated (GRPO Eq. 3, DAPO Eq. 10).

    logps, old_logps, ref_logps, mask, entropy: (B, T) (ref_logps None: no reference, beta 0, no KL
    metrics); advantages: (B,); normaliser: the global mini-batch's (loss_normaliser); pg_weights: (B, T)
    or (B, 1) weights of the policy term alone
    (masks, truncated IS). Returns (loss, metrics); token metrics are divided by n_tokens, the
    global mini-batch's tokens (None: this micro-batch's), so they add up like the loss."""
    A = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1): one per sequence; (B, T): per token
    rho = importance_ratio(logps, old_logps, mask, level)
    pg = policy_loss(rho, logps, A, loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                     clip_ratio_c=clip_ratio_c, sapo_temperatures=sapo_temperatures, old_logps=old_logps)
    loss = aggregate(pg if pg_weights is None else pg * pg_weights, mask, agg, normaliser)
    kl = None if ref_logps is None else kl_per_token(logps, ref_logps, old_logps, kl_estimator)  # None: no reference
    if beta != 0:
        loss = loss + beta * aggregate(kl, mask, agg, normaliser)
    if entropy_coef != 0:
        loss = loss - entropy_coef * aggregate(entropy, mask, agg, normaliser)

    tokens = mask.sum().clamp(min=1) if n_tokens is None else n_tokens

    def mean(x):  # a share of the token mean, for metrics
        return (x.detach().float() * mask).sum() / tokens

    low, high = (rho < 1 - epsilon_low, rho > 1 + epsilon_high)  # DPPO: the tokens its trust region masks
    if loss_type in ("dppo_tv", "dppo_kl"):
        low = high = dppo_mask(logps, old_logps, A, loss_type, delta_low=epsilon_low, delta_high=epsilon_high) == 0
    metrics = {"loss": loss.detach()}
    if kl is not None:
        metrics |= {"kl": mean(kl_per_token(logps, ref_logps, old_logps, "k3")), "kl/optimized": mean(kl)}
    metrics |= {"clip_ratio/low": mean(low & (A < 0)), "clip_ratio/high": mean(high & (A > 0))}
    if clip_ratio_c:
        metrics["clip_ratio/dual"] = mean((rho > clip_ratio_c) & (A < 0))
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
    return loss, metrics


# -----------------------------------------------------------------------------
# the rollout's rewards (phase 2; environment.rollout samples it, phase 1)


def reward(roll, env, cfg, d, step, round_=0):
    """Phase 2: each completion's reward, the weighted sum of what scores it (environment.score: its
    row's rule, logged even when not optimised, and a reward model) minus --no_eos_penalty, plus
    DAPO's overlong term; then with --rs_samples group_size of each prompt's samples kept."""
    parts = environment.score(roll, env, cfg, d)  # NaN where a function returned None: left out (TRL's nansum)
    rewards = environment.combine(parts, env.weights) - cfg.no_eos_penalty * (~roll.stopped).float()
    if cfg.overlong_buffer_len:  # a reward term, logged as reward/overlong
        parts["overlong"] = overlong_penalty(roll.r_mask.sum(-1).float(), cfg.max_new_tokens, cfg.overlong_buffer_len,
                                             cfg.overlong_penalty_factor)
        rewards = rewards + parts["overlong"]
    roll.rewards, roll.parts = rewards, parts
    if cfg.rs_samples:  # keep group_size of the rs_samples completions of each prompt
        n_local = cfg.prompts_per_step // d.world_size
        gens = [torch.Generator().manual_seed(sampling.stream_seed(cfg.seed, step, stream=1, index=i, round_=round_))
                for i in range(d.rank * n_local, (d.rank + 1) * n_local)]
        ranked = rewards.nan_to_num(torch.finfo(rewards.dtype).min)  # a completion no reward scores: the lowest
        keep = rejection_sample(ranked.view(n_local, cfg.rs_samples), cfg.group_size, cfg.rs_gamma, mode=cfg.rs_mode,
                                generator=gens)  # (n_local, G)
        roll = roll.select((keep + torch.arange(n_local)[:, None] * cfg.rs_samples).flatten())
    return roll


def dynamic_sample(rounds, cfg, d, pad_id):
    """DAPO's dynamic sampling (Sec. 3.2): of the rounds so far (each a global rollout), the first
    prompts_per_step groups whose rewards differ, then equal-reward ones to fill up (they carry no
    gradient): this rank's share of them, and how many groups are still missing."""
    roll = environment.Rollout.cat(rounds, pad_id)
    g = roll.rewards.view(-1, cfg.group_size)
    ok = (g.nan_to_num(-math.inf).amax(1) > g.nan_to_num(math.inf).amin(1)).repeat_interleave(cfg.group_size)  # (rows,)
    roll = roll.select(torch.cat([ok.nonzero().flatten(), (~ok).nonzero().flatten()]))
    missing = max(cfg.prompts_per_step - int(ok.sum()) // cfg.group_size, 0)
    rows_local = cfg.prompts_per_step // d.world_size * cfg.group_size
    return roll.select(torch.arange(d.rank * rows_local, (d.rank + 1) * rows_local)), missing


def minibatch_rows(n_rows, n_minibatches, generator, local=slice(None)):
    """The rows of each mini-batch, (K, n_rows / K): each K consecutive rows of the global rollout
    are dealt one to each of the K mini-batches in a random order (the generator: the same on
    every rank). A rank's share (`local`, its slice; indices within it) is whole blocks of K rows
    (conflicts.grpo): every mini-batch holds the same rows on any number of ranks, as many on each."""
    K = n_minibatches
    deal = torch.rand(n_rows // K, K, generator=generator).argsort(1)  # (n/K, K): the row of each block for mb j
    rows = (torch.arange(n_rows // K)[:, None] * K + deal).T  # (K, n/K) global rows of each mini-batch
    start, stop = local.start or 0, n_rows if local.stop is None else local.stop
    return rows[:, start // K:stop // K] - start


SHOW = ["loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio/low", "clip_ratio/high",
        "completions/mean_length", "eval/exact_match", "eval/gold_reward", "eval/accuracy", "eval/reward",
        "eval/greedy/reward", "time/step"]  # the metrics of a step's line


def main(cfg):
    # 0. setup: policy, reference, optional reward model, data
    d = cli.start(cfg)  # flags checked and filled, process group joined, seed set
    conflicts.grpo(cfg, d)  # flags that do not go together, with what to change
    fns = reward_fns.load_reward_fns(cfg.reward_fn)  # --reward_fn's functions, imported once (a bad one named here)
    weights = reward_fns.parse_weights(cfg.reward_weights, bool(cfg.reward_model), bool(cfg.teacher), [f.name for f in fns])
    rules = "rule" in weights or cfg.dataset in tasks.TASKS
    train, rows = environment.load_prompts(cfg, rules, fns)
    order = data.DataOrder(len(train), cfg.seed, cfg.prompts_per_step, f"--dataset {cfg.dataset}", "--prompts_per_step")
    cli.steps_from_epochs(cfg, len(train))  # TRL's --num_train_epochs, now that the prompts are known
    job = rundir.Run(cfg, d, model_flags=["model", "reward_model", "teacher"])  # out_dir checked, locked; nothing written
    tokenizer, model = models.load_policy(cfg.model, cfg, d, response_len=cfg.max_new_tokens,
                                          response_flag="--max_new_tokens", shard=False)
    model = models.with_lora(model, cfg)  # --lora's adapters
    ref = environment.reference(model, cfg, d)  # the starting policy (a resumed run's last refresh: below); none at beta 0
    model = common.shard_model(model, d, activation_checkpointing=cfg.activation_checkpointing)
    env = environment.make_env(cfg, d, prompts=train, order=order, tokenizer=tokenizer, model=model, weights=weights,
                               rows=rows, fns=fns)
    evals = environment.grpo_evals(cfg, tokenizer, rules, fns)  # held-out prompts (a task's, --eval_dataset's), pairs
    params = [p for p in model.parameters() if p.requires_grad]
    n_updates = cfg.num_iterations * cfg.num_mini_batches  # optimizer steps per rollout
    optimizer, scheduler = common.make_optimizer(params, cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                                                 cfg.steps * n_updates, schedule=cfg.lr_scheduler_type)
    n_local, rows_local = cfg.prompts_per_step // d.world_size, cfg.prompts_per_step // d.world_size * cfg.group_size
    micro = rows_local // cfg.num_mini_batches // cfg.grad_accum  # rows per forward on this rank
    common.print0(logs.grpo_banner(cfg, d, params, micro, env))
    fast = speed.choose(cfg, d, job.choices, model, functools.partial(speed.rollout_sample, env, cfg, micro, d),
                        models_=[env.teacher, ref])  # the speed flags (--compile, ...): auto, per device
    env.compile, n_rows = fast["compile"], rows_local * d.world_size  # sequences in the global batch
    loss_knobs = dict(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, beta=0 if cfg.kl_in_reward else cfg.beta,
                      kl_estimator=cfg.kl_estimator, agg=cfg.loss_agg, entropy_coef=cfg.entropy_coef,
                      loss_type=cfg.loss_type, level=cfg.importance_sampling_level, delta=cfg.delta,
                      clip_ratio_c=cfg.clip_ratio_c, sapo_temperatures=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))
    start = job.begin(model, tokenizer, optimizer, scheduler, order, show=SHOW)  # restores a resumed run's state
    if job.resume_from and cfg.ref_refresh_every:  # a checkpoint is at a refresh (conflicts.grpo)
        environment.refresh_reference(ref, model)
    if start == 1 and (first := environment.evaluate(model, ref, env, evals, cfg=cfg, d=d)):  # prompts alone: none
        job.log(0, first)
    clock = logs.Clock(d, job.logger)  # each phase's seconds and peak GPU memory (time/*, mem/*); the heartbeat's phase
    for step in range(start, cfg.steps + 1):
        clock.split()
        # ---------------------------------------------------------------------
        # 1. rollout: prompts_per_step new prompts, group_size completions each (rs_samples, of which
        #    group_size are kept); 2. reward. With --dynamic_sampling, rounds of both until that many
        #    groups have rewards that differ (a group of equal rewards has no advantage, no gradient)
        rounds, sums = [], {}
        for k in range(cfg.max_num_gen_batches if cfg.dynamic_sampling else 1):
            roll = environment.rollout(model, env, cfg, d, step=step, round_=k)  # 1
            clock.split("rollout")
            roll = reward(roll, env, cfg, d, step=step, round_=k)  # 2
            clock.split("reward")
            if cfg.dynamic_sampling:  # the groups found so far, from every rank, in global order
                rounds.append(roll.gather(tokenizer.pad_token_id, d))
                roll, missing = dynamic_sample(rounds, cfg, d, tokenizer.pad_token_id)
                sums = {"dynamic_sampling/rounds": torch.tensor((k + 1.0) / d.world_size, device=d.device),
                        "dynamic_sampling/unfilled_groups": torch.tensor(missing / d.world_size, device=d.device)}
                if missing == 0:
                    break
        ids, attn = torch.cat([roll.p_ids, roll.r_ids], 1), torch.cat([roll.p_mask, roll.r_mask], 1)  # (rows, P+R)
        own = roll.r_mask * (1 - roll.r_tool)  # the policy's own tokens: a tool's (--tools) are read, never trained on
        loss_mask = own * roll.stopped[:, None].long() if cfg.mask_truncated_completions else own
        R, rewards, parts = roll.r_ids.shape[1], roll.rewards, dict(roll.parts)

        # ---------------------------------------------------------------------
        # 3. advantages, after the reference's (and, for mu > 1 or several mini-batches, the rollout
        #    policy's) log-probs, in the precision of training (LoRA's base cast once for both), each pass
        #    on the update's own micro-batches (`plan`): at equal weights the KL and log rho are exactly 0
        deal = torch.Generator().manual_seed(sampling.stream_seed(cfg.seed, step, stream=2))  # the same on every rank
        minibatches = minibatch_rows(n_rows, cfg.num_mini_batches, deal, common.shard_batch(n_rows, d)).to(d.device)
        plan = shared_prompt.plan(minibatches, ids, attn, R, rows_per_forward=micro, d=d, packed=fast["padding_free"],
                                  models=[model, env.teacher], enabled=fast["shared_prompt"],
                                  group_size=cfg.group_size)  # per mini-batch
        lp = dict(**environment.scoring(cfg), plan=plan, d=d)  # the log-prob passes' knobs
        old_logps = keep = None  # keep: the tokens that get the policy gradient (--top_entropy_share)
        with environment.frozen_in_bf16(model, d):
            with environment.reference_context(model, ref):  # (rows_local, R); none without a reference (beta 0)
                ref_logps = None if ref is None else shared_prompt.planned_logprobs(ref, ids, attn, R, **lp)
            if cfg.top_entropy_share < 1:
                old_logps, entropy = shared_prompt.planned_logprobs(model, ids, attn, R, **lp, with_entropy=True)
                keep = top_entropy_mask(entropy, loss_mask, cfg.top_entropy_share, d, cfg.max_new_tokens)
            elif cfg.num_iterations > 1 or cfg.num_mini_batches > 1 or cfg.kl_in_reward or cfg.teacher:  # else old = pi
                old_logps = shared_prompt.planned_logprobs(model, ids, attn, R, **lp)
        if cfg.kl_in_reward:  # beta * sum_t KL_t of each sequence, taken from its reward (the loss has none)
            parts["kl_penalty"] = cfg.beta * (kl_per_token(old_logps, ref_logps, old_logps, cfg.kl_estimator)
                                              * own).sum(-1)  # logged as reward/kl_penalty
            rewards = rewards - parts["kl_penalty"]
        adv, adv_metrics = group_advantages(rewards.view(n_local, cfg.group_size), cfg.scale_rewards, cfg.global_norm,
                                            d, estimator=cfg.adv_estimator,
                                            lengths=loss_mask.sum(-1).view(n_local, cfg.group_size))
        adv = adv.flatten()  # (rows_local,)
        if env.teacher is not None:  # on-policy distillation: each token's advantage, (rows_local, R)
            teacher_logps = shared_prompt.planned_logprobs(env.teacher, ids, attn, R, **lp)
            adv = adv[:, None] + distill_advantages(teacher_logps, old_logps, loss_mask, cfg.teacher_coef)
            sums["distill/reverse_kl"] = ((old_logps - teacher_logps) * loss_mask).sum() / (rows_local * d.world_size)
        lengths = roll.r_mask.sum(-1).float()
        sums |= adv_metrics | environment.reward_metrics(parts, weights, n_rows, d)  # TRL's rewards/<name>/mean too
        sums |= {"completions/mean_length": lengths.sum() / n_rows,
                 "completions/clipped_ratio": (~roll.stopped).float().sum() / n_rows,
                 "prompts/truncated_ratio": roll.prompt_cut.float().sum() / n_rows}  # cut to --max_prompt_len
        sums |= {"tools/call_frequency": sampling.tool_calls(roll.r_tool).sum() / n_rows} if cfg.tools else {}

        # ---------------------------------------------------------------------
        # 4. update: num_iterations passes, each over the same num_mini_batches optimizer steps (as
        #    TRL) of grad_accum micro-batches dealt from the global rollout; every normaliser is that of
        #    the global mini-batch
        grad_norms, gap_max = [], torch.zeros((), device=d.device)
        for it in range(cfg.num_iterations):
            for mb_rows, (chunks, pack, share) in zip(minibatches, plan):
                normaliser = loss_normaliser(loss_mask[mb_rows], cfg.loss_agg, cfg.max_new_tokens, d)
                n_tokens = loss_normaliser(loss_mask[mb_rows], "token_mean", 0, d).clamp(min=1)  # metrics' denominator
                for k, r in enumerate(chunks):
                    with common.autocast(d):
                        logps, entropy = shared_prompt.response_logprobs(model, ids[r], attn[r], R, **environment.scoring(cfg),
                                                                         with_entropy=True, packed=pack, shared=share and share[k],
                                                                         entropy_grad=cfg.entropy_coef != 0)  # (micro, R)
                    logps, mask = logps.float(), loss_mask[r].float()
                    old = logps.detach() if old_logps is None else old_logps[r]
                    w, w_metrics = policy_weights(cfg, logps, old, roll.r_logps[r], adv[r], mask=mask,  # masks, IS
                                                  keep=None if keep is None else keep[r], n_tokens=n_tokens)
                    loss, m = grpo_loss(logps, old, None if ref is None else ref_logps[r], adv[r], mask,
                                        normaliser=normaliser, entropy=entropy.float(), n_tokens=n_tokens, pg_weights=w,
                                        **loss_knobs)
                    m |= w_metrics
                    if it == 0:  # the sampler's log-probs against the trainer's, once per token
                        gap = (old - roll.r_logps[r]).abs() * mask
                        m["rollout/logp_diff"] = gap.sum() / n_tokens * cfg.num_iterations  # the weight undone
                        gap_max = torch.maximum(gap_max, gap.max())
                    common.backward(model, loss, d, sync=k == len(chunks) - 1)
                    common.add_metrics(sums, m, weight=1 / n_updates)  # the mean over the step's updates
                grad_norm, lr = common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)
                grad_norms.append(grad_norm)
        if cfg.ref_refresh_every and step % cfg.ref_refresh_every == 0:
            environment.refresh_reference(ref, model)
        clock.split("update")  # reference and old log-probs, advantages and the optimizer steps

        # =====================================================================
        # 5. bookkeeping, not the algorithm: metrics (one all-reduce), eval, log, checkpoint
        metrics = common.reduce_metrics(sums, d, maxes={"completions/max_length": lengths.max(),
                                                        "rollout/logp_diff_max": gap_max},
                                        same={"grad_norm": torch.stack(grad_norms).mean()})
        metrics |= {"lr": lr} | clock.lap()  # time/step: training only, evaluation is not part of a step
        job.check(step, metrics, ["loss", "kl", "grad_norm"])  # a NaN stops the run, naming the last good checkpoint
        if step % cfg.eval_every == 0 and step < cfg.steps:
            metrics |= environment.evaluate(model, ref, env, evals, cfg=cfg, d=d)
        job.logger.completions(step, roll, env, rewards=rewards, parts=parts, n=cfg.log_completions)  # before a save
        job.log(step, metrics)  # and a checkpoint every --save_every steps, and at the last
    job.final(environment.evaluate(model, ref, env, evals, cfg=cfg, d=d))  # after that checkpoint: a kill loses nothing
    job.finish()  # LoRA's adapters merged into the export (models.merged_state): it loads with AutoModelForCausalLM


if __name__ == "__main__":
    cli.script(main, Config)
