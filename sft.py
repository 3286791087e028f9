"""Supervised fine-tuning (SFT): teach a causal LM to answer prompts like its demonstrations.

The loss is the negative log-likelihood of the completion tokens and the EOS after them,
averaged over every completion token of the global batch (all micro-batches, all ranks);
prompt tokens are context only. This is the first stage of RLHF (Ouyang et al. 2022,
arXiv:2203.02155, Sec. 3.5) and the starting point of reward.py, dpo.py and grpo.py.

Deliberate choices:
1. The normaliser is the number of completion tokens in the whole global batch, counted
   before the forward passes, so gradient accumulation and the number of ranks do not change
   the gradient (trl #3021).
2. Dropout is off (common.disable_dropout), so the SFT policy is the same network that the
   later stages compare log-probs against.
3. Over-long prompts are cut from the left and over-long completions from the right; both
   are counted and printed, never dropped silently.

Run:
    python sft.py                                    # tiny GPT-2 on the embedded sort task, CPU, ~2 min
    torchrun --nproc_per_node 2 sft.py               # the same on 2 processes (FSDP2)
    torchrun --nproc_per_node 8 sft.py --model gpt2 --dataset trl-lib/tldr --max_prompt_len 384 \\
        --max_response_len 56 --steps 2000 --batch_size 64 --lr 5e-5 --out_dir runs/sft-gpt2
"""
import time
from dataclasses import dataclass

import torch

import common
import tasks


@dataclass
class Config:
    model: str = "tiny"
    """`tiny` (a small GPT-2 built in code), a hub id such as gpt2, or a local checkpoint folder"""
    dataset: str = "sort"
    """embedded task name, a hub id (trl-lib/tldr), or a local .jsonl/.json/.parquet with prompt, completion"""
    out_dir: str = "runs/sft"
    """where metrics.jsonl and the checkpoint/ folder go"""
    n_train: int = 50000
    """rows drawn from an embedded task (ignored for files and hub data sets)"""
    max_prompt_len: int = 64
    """prompt tokens kept (from the right)"""
    max_response_len: int = 32
    """completion tokens kept, EOS included"""
    steps: int = 700
    """optimizer steps"""
    batch_size: int = 64
    """rows per optimizer step, over all ranks and micro-batches"""
    grad_accum: int = 1
    """micro-batches per optimizer step on each rank"""
    lr: float = 1e-3
    """peak learning rate (AdamW)"""
    warmup_steps: int = 50
    """linear warmup steps before the cosine decay"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    eval_every: int = 100
    """evaluate every this many steps (and at the end)"""
    n_eval: int = 200
    """held-out rows for the eval loss and, on an embedded task, held-out prompts for greedy answers"""
    eval_batch_size: int = 256
    """held-out rows per forward pass on each rank"""
    save_every: int = 0
    """also write a resumable checkpoint (with optimizer and data position) every this many steps (0: only at the end)"""
    resume: bool = False
    """continue the run whose checkpoint is in out_dir"""
    overwrite: bool = False
    """replace the checkpoint and metrics already in out_dir"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% more compute)"""
    seed: int = 0
    """seed for model init and data order (the same on every rank)"""
    wandb: bool = False
    """also log to Weights & Biases"""
    trust_remote_code: bool = False
    """allow a hub model's own Python code to run"""


# -----------------------------------------------------------------------------
# the loss


def sft_loss(logps, mask, n_tokens):
    """Mean NLL of the completion tokens.

    logps: (B, R) log-prob of each response token; mask: (B, R) 1 on completion + EOS tokens;
    n_tokens: completion tokens in the whole global batch (the same for every micro-batch, so
    accumulating micro-batch losses gives exactly the full-batch token mean).
    """
    return -(logps * mask).sum() / n_tokens


# -----------------------------------------------------------------------------
# data


def encode_sft(ds, tokenizer, cfg):
    """Token ids of every row: prompts cut from the left, completions (+EOS) from the right."""
    prompts, p_cut = common.encode_prompts(tokenizer, ds["prompt"], cfg.max_prompt_len)
    completions, c_cut = common.encode_responses(tokenizer, ds["completion"], cfg.max_response_len)
    if p_cut or c_cut:
        common.print0(f"{cfg.dataset}: truncated {p_cut} prompts (left) and {c_cut} completions (right) "
                      f"of {len(ds)} rows to {cfg.max_prompt_len}/{cfg.max_response_len} tokens")
    return prompts, completions


def make_batch(prompts, completions, rows, pad_id, device):
    input_ids, attention_mask, response_mask = common.join_prompt_response(
        [prompts[i] for i in rows], [completions[i] for i in rows], pad_id)
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


@torch.no_grad()
def eval_loss(model, prompts, completions, pad_id, d, batch_size):
    """Token-mean NLL of held-out completions (each rank a share; sums all-reduced).

    Every rank runs as many forwards (common.rank_share pads the shares with row 0): FSDP gathers
    each layer collectively, so a rank with a forward more would wait for the others until the
    collective timeout. The padding rows are computed and left out of both sums.
    """
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)  # NLL sum, token count
    rows, n_mine = common.rank_share(len(prompts), d)
    for i in range(0, len(rows), batch_size):
        ids, attn, resp = make_batch(prompts, completions, rows[i:i + batch_size], pad_id, d.device)
        with common.autocast(d):
            logps = common.response_logprobs(model, ids, attn, resp.shape[1])  # (b, R)
        keep = max(0, min(batch_size, n_mine - i))  # real rows of this chunk; the rest are padding
        total += torch.stack([-(logps[:keep] * resp[:keep]).sum().double(), resp[:keep].sum().double()])
    model.train()
    total = common.all_reduce_sum(total, d)
    return (total[0] / total[1]).item()


# -----------------------------------------------------------------------------


def main(cfg):
    # 0. setup: the same seed on every rank so every rank builds the same initial weights
    d = common.setup_distributed()
    common.set_seed(cfg.seed)
    if cfg.batch_size % (d.world_size * cfg.grad_accum):
        raise ValueError(f"--batch_size {cfg.batch_size} must be divisible by world size {d.world_size} "
                         f"x --grad_accum {cfg.grad_accum}")
    micro = cfg.batch_size // (d.world_size * cfg.grad_accum)
    resume_from = common.prepare_out_dir(cfg.out_dir, cfg.resume, cfg.overwrite, d)
    tokenizer = common.load_tokenizer(resume_from or cfg.model, cfg.trust_remote_code)
    model = common.load_model(resume_from or cfg.model, tokenizer, trust_remote_code=cfg.trust_remote_code)
    common.check_context(model, cfg.max_prompt_len, cfg.max_response_len)
    model = common.shard_model(model, d, activation_checkpointing=cfg.activation_checkpointing)
    n_params = sum(p.numel() for p in model.parameters())

    train = common.load_data(cfg.dataset, "train", ["prompt", "completion"], kind="sft", n=cfg.n_train, seed=cfg.seed)
    test = common.load_data(cfg.dataset, "test", ["prompt", "completion"], kind="sft", n=cfg.n_eval, seed=cfg.seed)
    train_p, train_c = encode_sft(train, tokenizer, cfg)
    test_p, test_c = encode_sft(test.select(range(min(cfg.n_eval, len(test)))), tokenizer, cfg)
    embedded = cfg.dataset in tasks.TASKS
    eval_prompts = [r["prompt"] for r in tasks.prompt_rows(cfg.n_eval, seed=cfg.seed, split="test")] if embedded else []

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  fused=True)  # one kernel for all parameters (bench/test_micro.py)
    scheduler = common.lr_schedule(optimizer, cfg.warmup_steps, cfg.steps)
    logger = common.Logger(cfg.out_dir, cfg, d, use_wandb=cfg.wandb, project="rlhf-sft")
    common.print0(f"sft: {n_params / 1e6:.2f}M parameters, {len(train)} train rows, world size {d.world_size}, "
                  f"micro-batch {micro} x {cfg.grad_accum} accumulation")

    # data order: one seeded permutation per epoch, identical on every rank
    order_gen = torch.Generator().manual_seed(cfg.seed)
    order, pos, start, last_ckpt = torch.randperm(len(train_p), generator=order_gen), 0, 1, None
    if resume_from:
        state = common.load_training_state(resume_from, model, optimizer, scheduler, d)
        order, pos, start, last_ckpt = state["order"], state["pos"], state["step"] + 1, resume_from
        order_gen.set_state(state["order_gen"])
        common.print0(f"resumed from {resume_from} at step {state['step']}")

    def evaluate(step):
        metrics = {"eval/loss": eval_loss(model, test_p, test_c, tokenizer.pad_token_id, d, cfg.eval_batch_size)}
        if embedded:
            metrics |= common.evaluate_generations(model, tokenizer, eval_prompts, tasks.REWARD_FNS["sort"], d,
                                                   cfg.max_prompt_len, cfg.max_response_len)
        return metrics

    if start == 1:
        logger.log(0, evaluate(0))
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        # ---------------------------------------------------------------------
        # 1. the global batch: every rank draws the same rows, then takes its slice
        if pos + cfg.batch_size > len(order):
            order, pos = torch.randperm(len(train_p), generator=order_gen), 0
        global_rows = order[pos:pos + cfg.batch_size].tolist()
        pos += cfg.batch_size
        rows = global_rows[common.shard_batch(cfg.batch_size, d)]
        n_tokens = sum(len(train_c[i]) for i in global_rows)  # the normaliser of the whole global batch

        # ---------------------------------------------------------------------
        # 2. forward and backward per micro-batch; gradients sync on the last one only
        nll_sum = torch.zeros((), device=d.device)
        for k in range(cfg.grad_accum):
            ids, attn, resp = make_batch(train_p, train_c, rows[k * micro:(k + 1) * micro], tokenizer.pad_token_id,
                                         d.device)
            common.set_grad_sync(model, k == cfg.grad_accum - 1)
            with common.autocast(d):
                logps = common.response_logprobs(model, ids, attn, resp.shape[1])  # (micro, R)
            # FSDP averages gradients over ranks; scaling by world size turns that into the sum
            # over ranks, so the gradient is that of the token mean over the global batch
            loss = sft_loss(logps, resp, n_tokens) * d.world_size
            loss.backward()
            nll_sum += -(logps.detach() * resp).sum()

        # ---------------------------------------------------------------------
        # 3. optimizer step
        grad_norm = common.clip_grad_norm(model, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        # ---------------------------------------------------------------------
        # 4. metrics (all-reduced on every rank), eval, log
        loss_value = (common.all_reduce_sum(nll_sum, d) / n_tokens).item()
        if not torch.isfinite(torch.tensor(loss_value)):
            raise FloatingPointError(f"step {step}: loss is {loss_value}; stopping. Last good checkpoint: "
                                     f"{last_ckpt or 'none written yet'}")
        metrics = {"loss": loss_value, "grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0],
                   "tokens": n_tokens, "time/step": time.time() - t0}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics |= evaluate(step)
        logger.log(step, metrics)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            last_ckpt = common.save_checkpoint(model, tokenizer, cfg.out_dir, d, optimizer, scheduler,
                                               dict(step=step, order=order, pos=pos, order_gen=order_gen.get_state()))

    path = common.save_checkpoint(model, tokenizer, cfg.out_dir, d)
    common.print0(f"saved {path}")
    logger.close()
    common.cleanup_distributed()


if __name__ == "__main__":
    main(common.parse_config(Config))
