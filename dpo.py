"""Direct Preference Optimization (DPO): fit the policy to preference pairs without a reward model.

DPO (Rafailov et al. 2023, arXiv:2305.18290) minimises, over pairs (x, y_w, y_l),
    -log sigmoid(beta * h),   h = [log pi(y_w|x) - log pi(y_l|x)] - [log ref(y_w|x) - log ref(y_l|x)]
(Eq. 7), where log pi(y|x) is summed over the response tokens and ref is the frozen SFT model.
beta * log(pi / ref) is the implicit reward; its pairwise accuracy on held-out pairs is the
evaluation of seed 000. Variants, each a few lines of dpo_loss: cDPO label smoothing
(Mitchell 2023, "A note on DPO with noisy preferences"), IPO (Azar et al. 2023,
arXiv:2310.12036, Eq. 17) and the SLiC hinge (Zhao et al. 2023, arXiv:2305.10425).

Deliberate choices and departures:
1. Chosen and rejected go through ONE forward: the batch holds each prompt block twice,
   followed by the chosen then the rejected responses padded to a common R (as the reference
   implementation, eric-mitchell/direct-preference-optimization, does; faster under FSDP).
2. The reference log-probs are computed once before training and the reference model is freed
   (`--precompute_ref`, default); `--no-precompute_ref` keeps a live frozen reference instead.
   Both give the same loss (tests/test_dpo.py).
3. The loss is the mean over the pairs of the global batch (all micro-batches, all ranks), so
   gradient accumulation does not change the gradient.
4. IPO uses summed sequence log-probs, like the other loss types (TRL's ipo averages over tokens).
5. No SFT on the preferred responses first (the DPO paper's "SFT on chosen" step); the start is
   the SFT checkpoint trained on demonstrations, as in seed 000.
6. Anthropic HH rows {chosen, rejected} (no prompt field) are split at the last
   "\\n\\nAssistant:" (split_hh, seed 001); both dialogues must share that prompt.
7. beta 0.3 by default, not the paper's 0.1: on the embedded task beta 0.1 over-corrects the
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

import torch
import torch.nn.functional as F

import common
import tasks


@dataclass
class Config:
    model: str = "runs/sft"
    """the policy's initial weights: a local checkpoint, `tiny`, or a hub id"""
    ref_model: str | None = None
    """the frozen reference (None: the same weights as --model)"""
    dataset: str = "sort"
    """embedded task name, hub id, or local .jsonl/.json/.parquet: prompt, chosen, rejected (or HH: chosen, rejected)"""
    eval_split: str = "test"
    """split of --dataset holding the held-out pairs (a local file has no splits: use --eval_dataset)"""
    eval_dataset: str | None = None
    """held-out pairs from another source (e.g. a second .jsonl); None: --eval_split of --dataset"""
    out_dir: str = "runs/dpo"
    """where metrics.jsonl and the checkpoint/ folder go"""
    n_train: int = 8000
    """pairs drawn from an embedded task (ignored for files and hub data sets); 250 steps of 64 see each twice"""
    max_prompt_len: int = 64
    """prompt tokens kept (from the right)"""
    max_response_len: int = 32
    """response tokens kept, EOS included"""
    steps: int = 250
    """optimizer steps"""
    batch_size: int = 64
    """pairs per optimizer step, over all ranks and micro-batches"""
    grad_accum: int = 1
    """micro-batches per optimizer step on each rank"""
    lr: float = 1e-4
    """peak learning rate (AdamW)"""
    warmup_steps: int = 20
    """linear warmup steps before the cosine decay"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    beta: float = 0.3
    """strength of the KL regularisation towards the reference (the implicit reward's scale); 0.1 overshoots here"""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, or hinge (SLiC)"""
    label_smoothing: float = 0.0
    """cDPO: assumed probability that a label is flipped (sigmoid loss only)"""
    precompute_ref: bool = True
    """compute reference log-probs once before training and free the reference model"""
    eval_every: int = 125
    """evaluate every this many steps (and at step 0 and the end)"""
    n_eval: int = 1000
    """held-out pairs for the implicit-reward accuracy"""
    n_eval_prompts: int = 200
    """held-out prompts for greedy answers scored by the gold reward (embedded task only)"""
    eval_batch_size: int = 64
    """pairs per forward when computing log-probs without gradients"""
    save_every: int = 0
    """also write a resumable checkpoint (optimizer, data position) every this many steps (0: only at the end)"""
    resume: bool = False
    """continue the run whose checkpoint is in out_dir"""
    overwrite: bool = False
    """replace the checkpoint and metrics already in out_dir"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% more compute)"""
    offload_frozen: bool = False
    """keep the reference's parameters in CPU memory between uses (FSDP2 on GPUs, under torchrun)"""
    seed: int = 0
    """seed for data order (the same on every rank)"""
    wandb: bool = False
    """also log to Weights & Biases"""
    trust_remote_code: bool = False
    """allow a hub model's own Python code to run"""


LOSS_TYPES = ("sigmoid", "ipo", "hinge")

# -----------------------------------------------------------------------------
# the loss


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
             loss_type="sigmoid", label_smoothing=0.0):
    """Per-pair preference losses from sequence log-probs.

    policy_chosen_logps, policy_rejected_logps: (B,) log pi(y|x) summed over response tokens;
    ref_chosen_logps, ref_rejected_logps: (B,) the same under the reference (no gradient).
    Returns (losses (B,), chosen_rewards (B,), rejected_rewards (B,)); the rewards are the
    implicit rewards beta * (log pi - log ref), detached. Reduce the losses yourself.
    """
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # (B,)
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to the sigmoid loss only, not {loss_type!r}")
    if loss_type == "sigmoid":
        # Eq. 7 of arXiv:2305.18290; with label_smoothing eps > 0 the expected loss under labels
        # flipped with probability eps (cDPO, Mitchell 2023)
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2  # Eq. 17 of arXiv:2310.12036: regress h onto 1/(2 beta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)  # SLiC calibration loss, arXiv:2305.10425 (margin 1/beta)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


# -----------------------------------------------------------------------------
# data

HH_MARKER = "\n\nAssistant:"


def split_hh(chosen, rejected):
    """Split two Anthropic HH dialogues at their last "\\n\\nAssistant:" into
    (prompt, chosen response, rejected response); the prompt keeps the marker.

    The two dialogues must share that prompt, else ValueError (the caller adds the row number).
    """
    i, j = chosen.rfind(HH_MARKER), rejected.rfind(HH_MARKER)
    if i < 0 or j < 0:
        raise ValueError(f"the {'chosen' if i < 0 else 'rejected'} dialogue has no {HH_MARKER!r}")
    prompt, other = chosen[:i + len(HH_MARKER)], rejected[:j + len(HH_MARKER)]
    if prompt != other:
        at = next((k for k, (a, b) in enumerate(zip(prompt, other)) if a != b), min(len(prompt), len(other)))
        raise ValueError(f"chosen and rejected dialogues have different prompts before their last "
                         f"{HH_MARKER!r} (first difference at character {at})")
    return prompt, chosen[len(prompt):], rejected[len(other):]


def load_pairs(name, split, n, seed):
    """(prompts, chosen, rejected) text lists from prompt/chosen/rejected rows, or from HH rows
    {chosen, rejected} split by split_hh. Errors name the file and the row (1-based)."""
    ds = common.load_data(name, split, ["chosen", "rejected"], kind="preference", n=n, seed=seed)
    if "prompt" in ds.column_names:
        bad = next((i for i, p in enumerate(ds["prompt"]) if not isinstance(p, str)), None)
        if bad is not None:
            raise ValueError(f"{name} row {bad + 1}: field 'prompt' is not a string")
        return list(ds["prompt"]), list(ds["chosen"]), list(ds["rejected"])
    triples = []
    for i, (c, r) in enumerate(zip(ds["chosen"], ds["rejected"])):
        try:
            triples.append(split_hh(c, r))
        except ValueError as e:
            raise ValueError(f"{name} row {i + 1}: {e}") from None
    return tuple(map(list, zip(*triples)))


def encode_pairs(texts, tokenizer, cfg, what):
    """Token ids of prompts (cut from the left) and responses + EOS (cut from the right); counts printed."""
    prompts, chosen, rejected = texts
    p, p_cut = common.encode_prompts(tokenizer, prompts, cfg.max_prompt_len)
    c, c_cut = common.encode_responses(tokenizer, chosen, cfg.max_response_len)
    r, r_cut = common.encode_responses(tokenizer, rejected, cfg.max_response_len)
    if p_cut or c_cut or r_cut:
        common.print0(f"{what}: truncated {p_cut} prompts (left), {c_cut} chosen and {r_cut} rejected responses "
                      f"(right) of {len(p)} pairs to {cfg.max_prompt_len}/{cfg.max_response_len} tokens")
    return p, c, r


def pair_batch(pairs, rows, pad_id, device):
    """Each prompt twice, then the chosen and the rejected responses right-padded to a common R:
    input_ids (2B, P+R), attention_mask (2B, P+R), response_mask (2B, R)."""
    prompts, chosen, rejected = pairs
    p = [prompts[i] for i in rows]
    batch = common.join_prompt_response(p + p, [chosen[i] for i in rows] + [rejected[i] for i in rows], pad_id)
    return [x.to(device) for x in batch]


def pair_logps(model, batch, d):
    """Sequence log-probs (summed over response tokens) of chosen and rejected: two (B,) tensors."""
    ids, attn, resp = batch
    with common.autocast(d):
        logps = common.response_logprobs(model, ids, attn, resp.shape[1])  # (2B, R)
    return (logps.float() * resp).sum(-1).chunk(2)  # (B,), (B,)


@torch.no_grad()
def all_pair_logps(model, pairs, pad_id, d, batch_size):
    """Sequence log-probs (N, 2) of chosen and rejected of every pair: each rank computes a share,
    the zero-filled results are summed over ranks (common.rank_share: the same number of forwards
    on every rank, as FSDP gathers each layer collectively)."""
    n = len(pairs[0])
    out = torch.zeros(n, 2, device=d.device)
    rows, n_mine = common.rank_share(n, d)
    was_training = model.training
    model.eval()
    for i in range(0, len(rows), batch_size):
        logps = torch.stack(pair_logps(model, pair_batch(pairs, rows[i:i + batch_size], pad_id, d.device), d), 1)
        keep = max(0, min(batch_size, n_mine - i))
        out[rows[i:i + keep]] = logps[:keep]  # (b, 2)
    model.train(was_training)
    return common.all_reduce_sum(out, d)


# -----------------------------------------------------------------------------


def main(cfg):
    # 0. setup and checks that fail fast
    d = common.setup_distributed()
    common.set_seed(cfg.seed)
    if cfg.batch_size % (d.world_size * cfg.grad_accum):
        raise ValueError(f"--batch_size {cfg.batch_size} must be divisible by world size {d.world_size} "
                         f"x --grad_accum {cfg.grad_accum}")
    if cfg.loss_type not in LOSS_TYPES:
        raise ValueError(f"--loss_type {cfg.loss_type!r}: expected one of {LOSS_TYPES}")
    if cfg.label_smoothing and cfg.loss_type != "sigmoid":
        raise ValueError("--label_smoothing applies to --loss_type sigmoid only")
    micro = cfg.batch_size // (d.world_size * cfg.grad_accum)
    resume_from = common.prepare_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite, d)
    tokenizer = common.load_tokenizer(resume_from or cfg.model, cfg.trust_remote_code)
    pad_id = tokenizer.pad_token_id

    train_texts = load_pairs(cfg.dataset, "train", cfg.n_train, cfg.seed)
    test_texts = load_pairs(cfg.eval_dataset or cfg.dataset, cfg.eval_split, cfg.n_eval, cfg.seed)
    test_texts = [x[:cfg.n_eval] for x in test_texts]
    train_pairs = encode_pairs(train_texts, tokenizer, cfg, "train")
    test_pairs = encode_pairs(test_texts, tokenizer, cfg, "eval")
    embedded = (cfg.eval_dataset or cfg.dataset) in tasks.TASKS
    if embedded:  # the label noise is known: the best accuracy any model can reach on these pairs
        bayes = tasks.bayes_accuracy([dict(prompt=p, chosen=c, rejected=r) for p, c, r in zip(*test_texts)])
        eval_prompts = [r["prompt"] for r in tasks.prompt_rows(cfg.n_eval_prompts, seed=cfg.seed, split="test")]

    # -------------------------------------------------------------------------
    # 1. the reference: log-probs of every train and eval pair once, or a live frozen model
    t_start = time.time()
    common.set_seed(cfg.seed)  # `--model tiny` builds random weights: the policy must start equal to its reference
    ref = common.load_model(cfg.ref_model or cfg.model, tokenizer, dtype=common.frozen_dtype(d),
                            trust_remote_code=cfg.trust_remote_code)
    common.check_context(ref, cfg.max_prompt_len, cfg.max_response_len)
    ref = common.shard_model(ref.requires_grad_(False).eval(), d, cpu_offload=cfg.offload_frozen)
    ref_test = all_pair_logps(ref, test_pairs, pad_id, d, cfg.eval_batch_size)  # (N_eval, 2)
    ref_train = None
    if cfg.precompute_ref:
        t_ref = time.time()
        ref_train = all_pair_logps(ref, train_pairs, pad_id, d, cfg.eval_batch_size)  # (N_train, 2)
        del ref
        common.print0(f"reference log-probs of {len(train_pairs[0])} train pairs in {time.time() - t_ref:.1f}s")

    common.set_seed(cfg.seed)
    model = common.load_model(resume_from or cfg.model, tokenizer, trust_remote_code=cfg.trust_remote_code)
    model = common.shard_model(model, d, activation_checkpointing=cfg.activation_checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  fused=True)  # one kernel for all parameters (bench/test_micro.py)
    scheduler = common.lr_schedule(optimizer, cfg.warmup_steps, cfg.steps)
    logger = common.Logger(cfg.out_dir, cfg, d, use_wandb=cfg.wandb, project="rlhf-dpo")
    common.print0(f"dpo: {n_params / 1e6:.2f}M parameters, {len(train_pairs[0])} train pairs, "
                  f"{len(test_pairs[0])} eval pairs, world size {d.world_size}, micro-batch {micro} pairs x "
                  f"{cfg.grad_accum} accumulation, {'precomputed' if cfg.precompute_ref else 'live'} reference")

    order_gen = torch.Generator().manual_seed(cfg.seed)
    order, pos, start, last_ckpt = torch.randperm(len(train_pairs[0]), generator=order_gen), 0, 1, None
    if resume_from:
        state = common.load_training_state(resume_from, model, optimizer, scheduler, d)
        order, pos, start, last_ckpt = state["order"], state["pos"], state["step"] + 1, resume_from
        order_gen.set_state(state["order_gen"])
        common.print0(f"resumed from {resume_from} at step {state['step']}")

    def evaluate():
        pol = all_pair_logps(model, test_pairs, pad_id, d, cfg.eval_batch_size)  # (N_eval, 2)
        h = (pol[:, 0] - pol[:, 1]) - (ref_test[:, 0] - ref_test[:, 1])  # (N_eval,)
        accuracy = ((h > 0).float() + 0.5 * (h == 0).float()).mean().item()  # a tie (policy == ref) is a coin flip
        metrics = {"eval/accuracy": accuracy, "eval/margin": (cfg.beta * h).mean().item()}
        if embedded:
            metrics |= {"eval/bayes_accuracy": bayes, "eval/accuracy_over_bayes": metrics["eval/accuracy"] / bayes}
            metrics |= common.evaluate_generations(model, tokenizer, eval_prompts, tasks.REWARD_FNS["sort"], d,
                                                   cfg.max_prompt_len, cfg.max_response_len)
        return metrics

    if start == 1:
        logger.log(0, evaluate())  # the SFT start
    names = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected"]
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        # ---------------------------------------------------------------------
        # 2. the global batch: every rank draws the same rows, then takes its slice
        if pos + cfg.batch_size > len(order):
            order, pos = torch.randperm(len(train_pairs[0]), generator=order_gen), 0
        rows = order[pos:pos + cfg.batch_size].tolist()[common.shard_batch(cfg.batch_size, d)]
        pos += cfg.batch_size

        # ---------------------------------------------------------------------
        # 3. forward (chosen and rejected together) and backward per micro-batch
        sums = torch.zeros(len(names), device=d.device)  # sums over this rank's pairs
        for k in range(cfg.grad_accum):
            mb = rows[k * micro:(k + 1) * micro]
            batch = pair_batch(train_pairs, mb, pad_id, d.device)
            common.set_grad_sync(model, k == cfg.grad_accum - 1)
            pi_c, pi_r = pair_logps(model, batch, d)  # (micro,), (micro,)
            if cfg.precompute_ref:
                ref_c, ref_r = ref_train[mb].unbind(1)
            else:
                with torch.no_grad():
                    ref_c, ref_r = pair_logps(ref, batch, d)
            losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg.beta, cfg.loss_type, cfg.label_smoothing)
            # sum over the micro-batch / pairs in the global batch = the global-batch mean whatever
            # the accumulation; FSDP averages gradients over ranks, so scale by the world size
            (losses.sum() / cfg.batch_size * d.world_size).backward()
            right = (r_c > r_r).float() + 0.5 * (r_c == r_r).float()  # a tie (policy == ref) is a coin flip
            sums += torch.stack([losses.detach().sum(), r_c.sum(), r_r.sum(), right.sum(),
                                 (r_c - r_r).sum(), pi_c.detach().sum(), pi_r.detach().sum()])

        # ---------------------------------------------------------------------
        # 4. optimizer step
        grad_norm = common.clip_grad_norm(model, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # ---------------------------------------------------------------------
        # 5. metrics (means over the global batch of pairs, reduced on every rank), eval, log
        metrics = dict(zip(names, (common.all_reduce_sum(sums, d) / cfg.batch_size).tolist()))
        if not torch.isfinite(torch.tensor(metrics["loss"])):
            raise FloatingPointError(f"step {step}: loss is {metrics['loss']}; stopping. Last good checkpoint: "
                                     f"{last_ckpt or 'none written yet'}")
        metrics |= {"grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0], "time/step": time.time() - t0}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate()
        logger.log(step, metrics)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            last_ckpt = common.save_checkpoint(model, tokenizer, cfg.out_dir, d, optimizer, scheduler,
                                               dict(step=step, order=order, pos=pos, order_gen=order_gen.get_state()))

    path = common.save_checkpoint(model, tokenizer, cfg.out_dir, d)
    common.print0(f"saved {path} ({time.time() - t_start:.0f}s)")
    logger.close()
    common.cleanup_distributed()


if __name__ == "__main__":
    main(common.parse_config(Config))
