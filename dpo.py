"""Direct Preference Optimization (DPO): fit the policy to preference pairs without a reward model.

DPO (Rafailov et al. 2023, arXiv:2305.18290) minimises, over pairs (x, y_w, y_l),
    -log sigmoid(beta * h),   h = [log pi(y_w|x) - log pi(y_l|x)] - [log ref(y_w|x) - log ref(y_l|x)]
(Eq. 7), where log pi(y|x) is summed over the response tokens and ref is the frozen SFT model.
beta * log(pi / ref) is the implicit reward; its pairwise accuracy on held-out pairs is the
evaluation. Variants, each a few lines of dpo_loss (--loss_type, TRL's names): cDPO label
smoothing (Mitchell 2023, "A note on DPO with noisy preferences"), IPO (arXiv:2310.12036 Eq. 17),
the SLiC hinge (arXiv:2305.10425), robust DPO (arXiv:2403.00409 Eq. 8), APO-zero
(arXiv:2408.06266), length-normalised DPO (sigmoid_norm: Tulu 3's dpo_norm, arXiv:2411.15124),
SimPO (arXiv:2405.14734: average log-probs and a margin, no reference model) and, added to any
of them, RPO's NLL term on the chosen response (--rpo_alpha, arXiv:2404.19733).

Deliberate choices and departures:
1. Chosen and rejected go through ONE forward: the batch holds each prompt block twice,
   followed by the chosen then the rejected responses padded to a common R (as the reference
   implementation, eric-mitchell/direct-preference-optimization, does; faster under FSDP).
2. The reference log-probs are computed once before training and the reference model is freed
   (`--precompute_ref`, default); `--no-precompute_ref` keeps a live frozen reference instead, run in
   the policy's layout (shared_prompt.layout), so that at equal weights both give the same log-probs
   to the bit (tests/test_exact.py).
   Both give the same loss in fp32 (tests/test_dpo.py); in bf16 the reference pass's batches round
   differently from the update's (margins 4.6e-3 apart at beta 0.1 on a 0.5B, docs/gpu.md). With
   --lora the reference is the policy itself with its adapters off (no copy; TRL's peft reference),
   precomputed or live (tests/test_lora.py).
3. The loss is the mean over the pairs of the global batch (all micro-batches, all ranks), so
   gradient accumulation does not change the gradient (common.py's rule 1).
4. IPO uses summed sequence log-probs, like the other loss types (TRL's ipo averages over tokens).
5. No SFT on the preferred responses first (the DPO paper's "SFT on chosen" step); the start is
   the SFT checkpoint trained on demonstrations.
6. Anthropic HH rows {chosen, rejected} (no prompt field) are split at the last
   "\\n\\nAssistant:" (data.split_hh); both dialogues must share that prompt.
7. A pair whose chosen and rejected responses are the same tokens carries no preference: its rejected
   log-probs are taken to be its chosen's own (dpo_loss's `same`), so its h and gradient are exactly 0;
   computed apart, two rows' gradients cancel only to float noise, which Adam scales to lr-sized steps.
8. beta 0.3 by default, not the paper's 0.1: on the embedded task beta 0.1 over-corrects the
   SFT model's dropped repeats into extra repeats (greedy exact-match 0.33 -> 0.50, a quarter of
   the answers too long); 0.3 reached 0.77 with the same held-out accuracy (0.69).

Run:
    python dpo.py                                     # tiny GPT-2 from runs/sft on the embedded sort task, CPU
    torchrun --nproc_per_node 2 dpo.py                # the same on 2 processes (FSDP2)
    torchrun --nproc_per_node 8 dpo.py --model runs/sft-gpt2 --dataset trl-lib/tldr-preference \\
        --eval_split validation --max_prompt_len 384 --max_response_len 56 --steps 2000 --lr 1e-6 \\
        --out_dir runs/dpo-gpt2
    python dpo.py --model runs/sft-pythia --dataset hh-rlhf/harmless-base/train.jsonl \\
        --eval_dataset hh-rlhf/harmless-base/test.jsonl --max_prompt_len 256 --max_response_len 128
"""
import time
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F

import common
import data
import tasks
import sampling
import shared_prompt
from plumbing import cli, conflicts, logs, models, rundir, speed

LossType = Literal["sigmoid", "sigmoid_norm", "ipo", "hinge", "robust", "apo_zero", "simpo"]


@dataclass
class Config(cli.SharedConfig):
    # the values of the flags left unset (cli.fill_defaults): the embedded task's, or TRL 1.16's DPOConfig
    # (lr 1e-6; max_length 1024 in all, here 512 prompt + 512 response tokens)
    DEFAULTS: ClassVar[dict] = {"embedded": dict(lr=1e-4, max_prompt_len=64, max_response_len=32),
                                "trl": dict(lr=1e-6, max_prompt_len=512, max_response_len=512)}
    # --- model and data ---
    model: str = "runs/sft"
    """the policy's initial weights: a checkpoint folder, a hub id, `tiny`, `smollm2` or path/to/model.gguf"""
    ref_model: str | None = None
    """the frozen reference (None: the same weights as --model)"""
    dataset: str = "sort"
    """embedded task name, hub id, or local .jsonl/.json/.parquet: prompt, chosen, rejected (or HH: chosen,
    rejected)"""
    eval_split: str = "test"
    """split of --dataset holding the held-out pairs (a local file without --eval_dataset: its prompts hashing into
    a held-out 5%, data.hold_out)"""
    eval_dataset: str | None = None
    """held-out pairs from another source (e.g. a second .jsonl); None: --eval_split of --dataset"""
    n_train: int = 8000
    """pairs drawn from an embedded task (ignored for files and hub data sets); 250 steps of 64 see each twice [>=
    1]"""
    max_response_len: int | None = None
    """response tokens kept, EOS included; a longer one is cut from the right, counted in the banner [>= 1]"""
    # --- loss ---
    beta: float = 0.3
    """strength of the KL regularisation towards the reference (the implicit reward's scale; 0.1 overshoots here) [>
    0]"""
    loss_type: LossType = "sigmoid"
    """sigmoid (DPO), sigmoid_norm (log-ratios averaged over tokens: Tulu 3's dpo_norm), ipo, hinge (SLiC), robust
    (rDPO), apo_zero (APO-zero), or simpo (SimPO: average log-probs, no reference model); TRL's names (simpo: its
    CPO trainer's)"""
    label_smoothing: float = 0.0
    """assumed probability that a label is flipped: cDPO with sigmoid, rDPO's epsilon with robust [0, 0.5)"""
    simpo_gamma: float = 0.5
    """SimPO's target margin gamma, in reward units (TRL's CPO trainer's name) [>= 0]"""
    rpo_alpha: float = 0.0
    """RPO (arXiv:2404.19733): add alpha x the chosen response's NLL per token (0: off); older TRL's name (TRL 1.x
    has no such flag: it writes RPO as loss_type [sigmoid, sft] with loss_weights [1, alpha]) [>= 0]"""
    precompute_ref: bool = True
    """compute reference log-probs once before training and free the reference model"""
    # --- optimisation ---
    steps: int = 250
    """optimizer steps [>= 1]"""
    batch_size: int = 64
    """pairs per optimizer step, over all ranks and micro-batches [>= 1]"""
    grad_accum: int = 1
    """micro-batches per optimizer step on each rank [>= 1]"""
    shared_prompt: bool | Literal["auto"] = "auto"
    """chosen and rejected compute their prompt once, its keys and values serving both, in the policy's and the live
    reference's forwards, where that computes fewer FLOPs than the padded (or --padding_free) forward: the same
    log-probs to float rounding, the same rows; one process (under torchrun: off). auto: true on a CPU; on a GPU if
    faster, timed once on the first micro-batch (plumbing/speed.py)"""
    warmup_steps: int = 20
    """linear warmup steps before the cosine decay [>= 0]"""
    offload_frozen: bool = False
    """keep the reference's parameters in CPU memory between uses (FSDP2 on GPUs, under torchrun)"""
    # --- evaluation ---
    eval_every: int = 125
    """evaluate every this many steps (and at step 0 and the end) [>= 1]"""
    n_eval: int = 1000
    """held-out pairs for the implicit-reward accuracy [>= 1]"""
    n_eval_prompts: int = 200
    """held-out prompts for greedy answers scored by the gold reward (embedded task only) [>= 1]"""
    eval_batch_size: int = 64
    """pairs per forward when computing log-probs without gradients, fewer where their logits would pass 1 GiB
    [>= 1]"""
    # --- run ---
    out_dir: str = "runs/dpo"
    """where metrics.jsonl and the checkpoint/ folder go"""
    seed: int = 0
    """seed for data order (the same on every rank) [0, 4294967295]"""


LOSS_TYPES = get_args(LossType)

# -----------------------------------------------------------------------------
# the loss


def log_ratios(policy_logps, ref_logps, lengths, loss_type):
    """The implicit reward / beta of each response, from log-probs summed over its tokens and its
    length (all (B,)): log pi - log ref; averaged over tokens for sigmoid_norm (Tulu 3, so long
    responses do not dominate); for simpo the average log pi alone (SimPO: no reference)."""
    if loss_type == "simpo":
        return policy_logps / lengths
    if loss_type == "sigmoid_norm":
        return (policy_logps - ref_logps) / lengths
    return policy_logps - ref_logps


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, n_pairs,
             loss_type="sigmoid", label_smoothing=0.0, lengths=None, simpo_gamma=0.5, rpo_alpha=0.0, same=None):
    """Preference loss of a micro-batch of pairs, divided by the pairs of the global batch
    (common.py's rule 1: summed over micro-batches and ranks, the mean over the global batch).

    policy_chosen_logps, policy_rejected_logps: (B,) log pi(y|x) summed over response tokens;
    ref_chosen_logps, ref_rejected_logps: (B,) the same under the reference (no gradient; unused
    by simpo); lengths: (chosen, rejected) response tokens, (B,) each, for sigmoid_norm, simpo
    and rpo_alpha; n_pairs: pairs in the global batch; same: (B,) True where chosen and rejected are
    the same tokens. Returns (loss, metrics); rewards/* are the implicit rewards beta * log_ratios,
    detached.
    """
    len_c, len_r = lengths if lengths is not None else (None, None)
    if same is not None:  # no preference: the rejected log-probs are the chosen's own, so that h and its gradient
        # are exactly 0 (two forwards' gradients cancel only to float noise, which Adam scales to lr-sized steps)
        policy_rejected_logps = torch.where(same, policy_chosen_logps, policy_rejected_logps)
        ref_rejected_logps = torch.where(same, ref_chosen_logps, ref_rejected_logps)
    lr_c = log_ratios(policy_chosen_logps, ref_chosen_logps, len_c, loss_type)  # (B,)
    lr_r = log_ratios(policy_rejected_logps, ref_rejected_logps, len_r, loss_type)
    h = lr_c - lr_r  # (B,)
    if label_smoothing and loss_type not in ("sigmoid", "sigmoid_norm", "robust"):
        raise ValueError(f"label_smoothing applies to the sigmoid(_norm) and robust losses only, not {loss_type!r}")
    if loss_type in ("sigmoid", "sigmoid_norm"):
        # Eq. 7 of arXiv:2305.18290; with label_smoothing eps > 0 the expected loss under labels
        # flipped with probability eps (cDPO, Mitchell 2023)
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "simpo":
        losses = -F.logsigmoid(beta * h - simpo_gamma)  # SimPO: a target margin gamma
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2  # Eq. 17 of arXiv:2310.12036: regress h onto 1/(2 beta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)  # SLiC calibration loss, arXiv:2305.10425 (margin 1/beta)
    elif loss_type == "robust":
        # rDPO, Eq. 8 of arXiv:2403.00409: with labels flipped with probability eps, its expectation
        # over the flip is the clean sigmoid loss (unbiased), where cDPO's is not
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "apo_zero":
        # APO-zero, arXiv:2408.06266: push the chosen log-ratio up and the rejected one down, each
        # on its own (not only their difference): for chosen answers better than the policy's own
        losses = 1 - torch.sigmoid(beta * lr_c) + torch.sigmoid(beta * lr_r)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")
    if rpo_alpha:  # RPO: the chosen response's NLL per token keeps its likelihood from falling
        losses = losses - rpo_alpha * policy_chosen_logps / len_c
    r_c, r_r = beta * lr_c.detach(), beta * lr_r.detach()
    right = (r_c > r_r).float() + 0.5 * (r_c == r_r).float()  # a tie (policy == ref) is a coin flip
    loss = losses.sum() / n_pairs
    metrics = {"rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/accuracies": right,
               "rewards/margins": r_c - r_r, "logps/chosen": policy_chosen_logps.detach(),
               "logps/rejected": policy_rejected_logps.detach()}
    return loss, {"loss": loss.detach(), **{k: v.sum() / n_pairs for k, v in metrics.items()}}


# -----------------------------------------------------------------------------
# log-probs of every pair


def response_lengths(pairs, device):
    """The response tokens of each pair's chosen and rejected, (N, 2) (sigmoid_norm's, simpo's and RPO's
    per-token averages), and whether the two are the same tokens, (N,) (dpo_loss's `same`)."""
    lengths = torch.tensor([[len(c), len(r)] for c, r in zip(pairs[1], pairs[2])], dtype=torch.float, device=device)
    return lengths, torch.tensor([c == r for c, r in zip(pairs[1], pairs[2])], dtype=torch.bool, device=device)


def all_pair_logps(model, pairs, pad_id, d, batch_size):
    """Sequence log-probs (N, 2) of chosen and rejected of every pair, on every rank (map_rows)."""
    def logps(rows):
        return torch.stack(common.sequence_logprobs(model, data.pair_batch(pairs, rows, pad_id, d.device), d)
                           .chunk(2), 1)  # (b, 2)

    with common.evaluating(model):
        return common.map_rows(logps, len(pairs[0]), d, batch_size, logits_per_row=data.pair_logits(pairs, model))


@logs.phase("reference log-probs")
def reference_logps(ref, cfg, train_pairs, test_pairs, pad_id, d):
    """The reference's log-probs (N, 2) of the held-out pairs and, with --precompute_ref, of the train
    pairs, after which the reference is not kept: (the reference kept live or None, the train pairs',
    the held-out pairs'). ref: a frozen model, or the LoRA policy, its adapters off (models.as_reference)."""
    with models.as_reference(ref):
        ref_test = all_pair_logps(ref, test_pairs, pad_id, d, cfg.eval_batch_size)  # (N_eval, 2)
        if not cfg.precompute_ref:
            return ref, None, ref_test
        t0 = time.time()
        ref_train = all_pair_logps(ref, train_pairs, pad_id, d, cfg.eval_batch_size)  # (N, 2)
    common.print0(f"reference log-probs of {len(train_pairs[0])} train pairs in {time.time() - t0:.1f}s")
    return None, ref_train, ref_test


# -----------------------------------------------------------------------------


@logs.phase("evaluation")
def evaluate(model, tokenizer, held_out, gold_prompts, cfg, d):
    """The implicit reward's pairwise accuracy and mean margin on the held-out pairs (held_out: the
    pairs encoded, their reference log-probs (N, 2) and response lengths (N, 2)); on the embedded
    task also against the best accuracy its label noise allows, and greedy answers scored by the
    gold reward."""
    pairs, ref_logps, lengths = held_out
    pol = all_pair_logps(model, pairs, tokenizer.pad_token_id, d, cfg.eval_batch_size)  # (N, 2)
    h = (log_ratios(pol[:, 0], ref_logps[:, 0], lengths[:, 0], cfg.loss_type)
         - log_ratios(pol[:, 1], ref_logps[:, 1], lengths[:, 1], cfg.loss_type))  # (N,) reward margin / beta
    metrics = {"eval/accuracy": common.ranking_accuracy(h, torch.zeros_like(h)).item(),
               "eval/margin": (cfg.beta * h).mean().item()}
    if gold_prompts:
        metrics |= tasks.against_bayes(metrics["eval/accuracy"], gold_prompts["pairs"])
        metrics |= sampling.evaluate_generations(model, tokenizer, gold_prompts["prompts"], tasks.REWARD_FNS["sort"], d,
                                              max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_response_len)
    return metrics


# -----------------------------------------------------------------------------


def main(cfg):
    # 0. setup and checks that fail fast
    d = cli.start(cfg)  # flags checked, process group joined, seed set
    micro = cli.micro_batch(cfg.batch_size, cfg.grad_accum, d)
    conflicts.dpo(cfg)
    train, test = data.load_preferences(cfg)
    order = data.DataOrder(len(train), cfg.seed, batch=cfg.batch_size, source=f"--dataset {cfg.dataset}")
    cli.steps_from_epochs(cfg, len(train))  # TRL's --num_train_epochs, now that the rows are known
    job = rundir.Run(cfg, d, model_flags=["model", "ref_model"])  # out_dir checked and locked; nothing written yet
    tokenizer = models.load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.chat_template)
    train, test, train_pairs, test_pairs = data.encode_preferences(train, test, tokenizer, cfg)
    (train_len, same), (test_len, _) = (response_lengths(pairs, d.device) for pairs in (train_pairs, test_pairs))
    gold = {"pairs": test, "prompts": tasks.test_prompts(cfg.n_eval_prompts, cfg.seed)} \
        if (cfg.eval_dataset or cfg.dataset) in tasks.TASKS else None  # the embedded task's gold reward

    # -------------------------------------------------------------------------
    # 1. the reference: log-probs of every train and eval pair once, or a live frozen model; with --lora (and
    #    no --ref_model) the policy itself with its adapters off, so after the policy loads
    own = cfg.lora and not cfg.ref_model and cfg.loss_type != "simpo"  # LoRA's reference: the policy, adapters off
    if cfg.loss_type == "simpo":  # reference-free: no reference model is loaded
        ref, ref_test, ref_train = None, *(torch.zeros(len(x), 2, device=d.device) for x in (test, train))
    elif not own:
        common.set_seed(cfg.seed)  # `--model tiny` builds random weights: the policy must start equal to its reference
        ref = models.load_frozen(cfg.ref_model or cfg.model, tokenizer, d, trust_remote_code=cfg.trust_remote_code,
                                 cpu_offload=cfg.offload_frozen)
        models.check_context(ref, cfg.max_prompt_len, cfg.max_response_len)
        ref, ref_train, ref_test = reference_logps(ref, cfg, train_pairs, test_pairs, tokenizer.pad_token_id, d=d)
    common.set_seed(cfg.seed)
    _, model = models.load_policy(cfg.model, cfg, d, response_len=cfg.max_response_len)
    if own:
        ref, ref_train, ref_test = reference_logps(model, cfg, train_pairs, test_pairs, tokenizer.pad_token_id, d=d)
    fast = speed.choose(cfg, d, job.choices, model, data.pair_batch(train_pairs, range(micro), tokenizer.pad_token_id,
                                                                    d.device), models_=[ref])  # auto: per device
    optimizer, scheduler = common.make_optimizer(model.parameters(), cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                                                 cfg.steps, schedule=cfg.lr_scheduler_type)
    common.print0(f"dpo: {models.parameters(model)}, {len(train)} train pairs, "
                  f"{len(test)} eval pairs, world size {d.world_size}{logs.layout(d)}, micro-batch {micro} pairs x "
                  f"{cfg.grad_accum}, {'live' if ref else 'no' if cfg.loss_type == 'simpo' else 'precomputed'} reference")
    knobs = dict(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                 simpo_gamma=cfg.simpo_gamma, rpo_alpha=cfg.rpo_alpha)
    start = job.begin(model, tokenizer, optimizer, scheduler, order)  # restores a resumed run's state
    if start == 1:  # the SFT start
        job.log(0, evaluate(model, tokenizer, (test_pairs, ref_test, test_len), gold, cfg=cfg, d=d))
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        # ---------------------------------------------------------------------
        # 2. the global batch: every rank draws the same rows, then takes its slice
        rows = order.next(cfg.batch_size)[common.shard_batch(cfg.batch_size, d)]

        # ---------------------------------------------------------------------
        # 3. forward (chosen and rejected together, a live reference in the same layout) and backward per micro-batch
        sums = {}
        for k in range(cfg.grad_accum):
            mb = rows[k * micro:(k + 1) * micro]
            batch = data.pair_batch(train_pairs, mb, tokenizer.pad_token_id, d.device)  # 2 x micro rows
            layout = shared_prompt.layout(batch, d, fast["padding_free"], models=[model, ref], enabled=fast["shared_prompt"])
            pi_c, pi_r = shared_prompt.sequence_logprobs(model, batch, d, *layout).chunk(2)  # (micro,) x 2
            if ref is None:  # precomputed (or simpo's zeros)
                ref_c, ref_r = ref_train[mb].unbind(1)
            else:  # frozen, or --lora's policy with its adapters off: no gradient, no graph kept
                with models.as_reference(ref):
                    ref_c, ref_r = shared_prompt.sequence_logprobs(ref, batch, d, *layout).chunk(2)
            loss, m = dpo_loss(pi_c, pi_r, ref_c, ref_r, n_pairs=cfg.batch_size, lengths=train_len[mb].unbind(1),
                               same=same[mb], **knobs)
            common.backward(model, loss, d, sync=k == cfg.grad_accum - 1)
            common.add_metrics(sums, m)

        # ---------------------------------------------------------------------
        # 4. optimizer step
        grad_norm, lr = common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)

        # =====================================================================
        # 5. bookkeeping, not the algorithm: metrics (one all-reduce), eval, log, checkpoint
        metrics = common.reduce_metrics(sums, d, same={"grad_norm": grad_norm}) | {"lr": lr, "time/step": time.time() - t0}
        job.check(step, metrics)  # a NaN loss stops the run, naming the last good checkpoint
        if step % cfg.eval_every == 0 and step < cfg.steps:
            metrics |= evaluate(model, tokenizer, (test_pairs, ref_test, test_len), gold, cfg=cfg, d=d)
        job.log(step, metrics)  # and a checkpoint every --save_every steps, and at the last
    job.final(evaluate(model, tokenizer, (test_pairs, ref_test, test_len), gold, cfg=cfg, d=d))  # loses nothing to a kill
    job.finish()


if __name__ == "__main__":
    cli.script(main, Config)
