"""Reward model: a scalar score of (prompt, response), trained on preference pairs.

A causal LM with a linear head read at the last real token (a Hugging Face
AutoModelForSequenceClassification with one label), initialised from the SFT checkpoint, as in
Stiennon et al. 2020 (arXiv:2009.01325, Sec. 3.4) and Ouyang et al. 2022 (arXiv:2203.02155,
Sec. 3.5). The loss is the Bradley-Terry negative log-likelihood of the human choice,
-log sigmoid(r(x, y_chosen) - r(x, y_rejected)) (Eq. 1 of arXiv:2203.02155), averaged over
the pairs of the global batch. grpo.py reads the saved checkpoint through common.reward_scores.

Deliberate choices and departures:
1. One pair per row; InstructGPT puts all K-choose-2 pairs of a prompt in one batch element.
2. Chosen and rejected go through ONE forward (the batch holds the prompts twice), so FSDP
   gathers each layer once per micro-batch, not twice.
3. The score is read at the last real token with position ids (common.reward_scores), so pad
   == eos and the padding side do not matter.
4. Optional extras, each a few lines: a centring term center_coef * mean((r_c + r_r)^2)
   (Eisenstein et al. 2023, "Helping or Herding", arXiv:2312.09244; TRL's
   center_rewards_coefficient) and a per-pair margin subtracted inside the sigmoid when the data
   has a numeric `margin` column (Llama 2, arXiv:2307.09288, Eq. 2).
5. `--normalize` (on by default): after training, sample responses from a policy (the SFT model
   by default) on train prompts and set a gain and bias so that their rewards have mean 0 and
   std 1, stored as reward_gain / reward_bias in the model config (Ziegler et al. 2019,
   arXiv:1909.08593, whose code normalises after training the same way): GRPO's KL coefficient
   and advantages then see rewards of a known scale. Pairwise accuracy does not change (gain > 0).
6. `--lora`: adapters on the frozen model, its new score head trained whole beside them (peft's
   SEQ_CLS task, as TRL's reward trainer); the export merges them (tests/test_lora.py).

Run:
    python reward.py                                  # tiny GPT-2 from runs/sft on the embedded sort task, CPU
    torchrun --nproc_per_node 2 reward.py             # the same on 2 processes (FSDP2)
    torchrun --nproc_per_node 8 reward.py --model runs/sft-gpt2 --dataset trl-lib/tldr-preference \\
        --eval_split validation --max_prompt_len 384 --max_response_len 56 --steps 2000 --lr 1e-5 \\
        --out_dir runs/rm-gpt2
"""
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

import common
import data
import sampling
import tasks
from plumbing import cli, logs, models, rundir, speed


@dataclass
class Config(cli.SharedConfig):
    # the values of the flags left unset (cli.fill_defaults): the embedded task's, or TRL 1.16's RewardConfig
    # (lr 1e-4; max_length 1024 in all, here 512 prompt + 512 response tokens)
    DEFAULTS: ClassVar[dict] = {"embedded": dict(lr=1e-3, max_prompt_len=64, max_response_len=32),
                                "trl": dict(lr=1e-4, max_prompt_len=512, max_response_len=512)}
    # --- model and data ---
    model: str = "runs/sft"
    """initial weights, given a new score head: a checkpoint folder, hub id, `tiny`, `smollm2` or path/to/model.gguf"""
    dataset: str = "sort"
    """embedded task, hub id (trl-lib/tldr-preference), or local .jsonl/.json/.parquet: prompt, chosen, rejected (or
    Anthropic HH rows: chosen, rejected)"""
    eval_split: str = "test"
    """split of --dataset holding the held-out pairs (a local file without --eval_dataset: its prompts hashing into
    a held-out 5%, data.hold_out)"""
    eval_dataset: str | None = None
    """held-out pairs from another source (e.g. a second .jsonl); None: --eval_split of --dataset"""
    n_train: int = 20000
    """pairs drawn from an embedded task (ignored for files and hub data sets) [>= 1]"""
    max_response_len: int | None = None
    """response tokens kept, EOS included; a longer one is cut from the right, counted in the banner [>= 1]"""
    # --- loss ---
    center_coef: float = 0.0
    """weight of the reward-centring term mean((r_chosen + r_rejected)^2) (0: off) [>= 0]"""
    # --- optimisation ---
    steps: int = 300
    """optimizer steps [>= 1]"""
    batch_size: int = 64
    """pairs per optimizer step, over all ranks and micro-batches [>= 1]"""
    grad_accum: int = 1
    """micro-batches per optimizer step on each rank [>= 1]"""
    warmup_steps: int = 20
    """linear warmup steps before the cosine decay [>= 0]"""
    # --- normalisation ---
    normalize: bool = True
    """after training, set reward_gain/bias so the policy's samples score mean 0, std 1"""
    normalize_policy: str | None = None
    """policy whose samples set the normalisation (None: --model, the SFT start)"""
    n_normalize: int = 512
    """train prompts sampled (one response each, temperature 1) for --normalize [>= 1]"""
    # --- evaluation ---
    eval_every: int = 100
    """evaluate every this many steps (and at step 0 and the end) [>= 1]"""
    n_eval: int = 1000
    """held-out pairs for the pairwise accuracy [>= 1]"""
    eval_batch_size: int = 64
    """pairs per forward in evaluation (and prompts per rollout in --normalize) [>= 1]"""
    # --- run ---
    out_dir: str = "runs/rm"
    """where metrics.jsonl and the checkpoint/ folder go"""
    seed: int = 0
    """seed for the head's init and data order (the same on every rank) [0, 4294967295]"""


# -----------------------------------------------------------------------------
# the loss


def bt_loss(r_chosen, r_rejected, n_pairs, margin=None, center_coef=0.0):
    """Bradley-Terry loss of a micro-batch of pairs, divided by the pairs of the global batch
    (common.py's rule 1: summed over micro-batches and ranks, the mean over the global batch).

    r_chosen, r_rejected: (B,) scalar rewards; n_pairs: pairs in the global batch; margin: (B,)
    or None, a required gap (Llama 2); center_coef: weight of mean((r_c + r_r)^2), which pulls
    the rewards towards zero mean. Returns (loss, metrics), the metrics detached.
    """
    diff = r_chosen - r_rejected  # (B,)
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).sum() / n_pairs  # Eq. 1 of arXiv:2203.02155
    if center_coef:
        loss = loss + center_coef * ((r_chosen + r_rejected) ** 2).sum() / n_pairs  # arXiv:2312.09244
    metrics = {"loss": loss, "accuracy": (diff > 0).float().sum(), "margin": diff.sum(),
               "rewards/chosen": r_chosen.sum(), "rewards/rejected": r_rejected.sum()}
    return loss, {k: v.detach() / (1 if k == "loss" else n_pairs) for k, v in metrics.items()}


# -----------------------------------------------------------------------------
# evaluation and normalisation


def score_pairs(model, pairs, pad_id, d, batch_size):
    """Rewards (N, 2) of chosen and rejected of every pair, on every rank (common.map_rows)."""
    def scores(rows):
        ids, attn, _ = data.pair_batch(pairs, rows, pad_id, d.device)
        with common.autocast(d):
            return torch.stack(common.reward_scores(model, ids, attn).float().chunk(2), 1)  # (b, 2)

    with common.evaluating(model):
        return common.map_rows(scores, len(pairs[0]), d, batch_size)


def normalization(model, tokenizer, cfg, prompts, d):
    """Gain and bias that give the policy's samples on `prompts` reward mean 0 and std 1 (the
    population std over the samples). Returns (gain, bias, mean, std)."""
    name = cfg.normalize_policy or cfg.model
    p_tok = models.load_tokenizer(name, cfg.trust_remote_code)
    policy = models.load_frozen(name, p_tok, d, trust_remote_code=cfg.trust_remote_code)
    stops = sampling.stop_token_ids(p_tok, policy)
    u = sampling.rollout_uniforms(len(prompts), cfg.max_response_len, cfg.seed)  # by row: the same on any world size

    def rewards(rows):
        texts = [prompts[i] for i in rows]
        with common.autocast(d):
            replies = sampling.respond(policy, p_tok, texts, max_prompt_len=cfg.max_prompt_len,
                                   max_new_tokens=cfg.max_response_len, stops=stops, device=d.device,
                                   temperature=1.0, uniforms=u[rows])
        # re-encoded: the policy's tokenizer need not be the reward model's
        responses, _ = sampling.encode_responses(tokenizer, replies, cfg.max_response_len)  # a cut-off sample keeps no EOS
        ids, attn, _ = common.join_prompt_response(sampling.encode_prompts(tokenizer, texts, cfg.max_prompt_len)[0],
                                                   responses, tokenizer.pad_token_id)
        with common.autocast(d):
            return common.reward_scores(model, ids.to(d.device), attn.to(d.device)).double()[:, None]  # (b, 1)

    with common.evaluating(policy, gather=True), common.evaluating(model):
        r = common.map_rows(rewards, len(prompts), d, cfg.eval_batch_size)[:, 0]  # (n,)
    mean, std = r.mean(), r.std(correction=0).clamp(min=1e-6)
    return (1 / std).item(), (-mean / std).item(), mean.item(), std.item()


# -----------------------------------------------------------------------------


@logs.phase("evaluation")
def evaluate(model, tokenizer, pairs, gold_pairs, cfg, d):
    """Pairwise accuracy and mean margin of the rewards on held-out pairs; on the embedded task
    (gold_pairs: its rows) also against the best accuracy its label noise allows."""
    r = score_pairs(model, pairs, tokenizer.pad_token_id, d, cfg.eval_batch_size)  # (N, 2)
    metrics = {"eval/accuracy": common.ranking_accuracy(r[:, 0], r[:, 1]).item(),
               "eval/margin": (r[:, 0] - r[:, 1]).mean().item()}
    return metrics | (tasks.against_bayes(metrics["eval/accuracy"], gold_pairs) if gold_pairs is not None else {})


@logs.phase("normalisation")
def normalize(model, tokenizer, train, cfg, d):
    """After training: the gain and bias from the policy's own samples on train prompts, set in the
    model's config (what the checkpoint saves), and their figures for the log."""
    prompts = list(dict.fromkeys(train["prompt"][:]))[:cfg.n_normalize]
    gain, bias, mean, std = normalization(model, tokenizer, cfg, prompts, d)
    model.config.reward_gain, model.config.reward_bias = gain, bias
    common.print0(f"normalize: raw reward of {len(prompts)} samples from {cfg.normalize_policy or cfg.model}: "
                  f"mean {mean:.4f} std {std:.4f} -> gain {gain:.4f} bias {bias:.4f}")
    return {"normalize/mean": mean, "normalize/std": std, "normalize/gain": gain, "normalize/bias": bias}


# -----------------------------------------------------------------------------


def main(cfg):
    # 0. setup: the same seed on every rank so every rank builds the same score head
    d = cli.start(cfg)  # flags checked, process group joined, seed set
    micro = cli.micro_batch(cfg.batch_size, cfg.grad_accum, d)
    train, test = data.load_preferences(cfg)
    order = data.DataOrder(len(train), cfg.seed, batch=cfg.batch_size, source=f"--dataset {cfg.dataset}")
    cli.steps_from_epochs(cfg, len(train))  # TRL's --num_train_epochs, now that the rows are known
    job = rundir.Run(cfg, d, model_flags=["model", "normalize_policy"])  # out_dir checked, locked; nothing written
    tokenizer, model = models.load_policy(cfg.model, cfg, d, response_len=cfg.max_response_len,
                                          kind="new_reward")
    model.config.reward_gain, model.config.reward_bias = 1.0, 0.0  # training sees raw scores
    train, test, train_pairs, test_pairs = data.encode_preferences(train, test, tokenizer, cfg)
    packed = speed.choose(cfg, d, job.choices, model, data.pair_batch(train_pairs, range(micro), tokenizer.pad_token_id,
                                                                      d.device), reward=True)["padding_free"]
    margins = torch.tensor(train["margin"][:], dtype=torch.float32) if "margin" in train.column_names else None
    gold_pairs = test if (cfg.eval_dataset or cfg.dataset) in tasks.TASKS else None  # the embedded task's noise
    optimizer, scheduler = common.make_optimizer(model.parameters(), cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                                                 cfg.steps, schedule=cfg.lr_scheduler_type)
    common.print0(f"reward: {models.parameters(model)}, {len(train)} train pairs, "
                  f"{len(test)} eval pairs, world size {d.world_size}{logs.layout(d)}, micro-batch {micro} pairs x "
                  f"{cfg.grad_accum}")
    start = job.begin(model, tokenizer, optimizer, scheduler, order)  # restores a resumed run's state
    if start == 1:
        job.log(0, evaluate(model, tokenizer, test_pairs, gold_pairs, cfg=cfg, d=d))
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        # ---------------------------------------------------------------------
        # 1. the global batch: every rank draws the same rows, then takes its slice
        rows = order.next(cfg.batch_size)[common.shard_batch(cfg.batch_size, d)]

        # ---------------------------------------------------------------------
        # 2. forward (chosen and rejected together) and backward per micro-batch
        sums = {}
        for k in range(cfg.grad_accum):
            mb = rows[k * micro:(k + 1) * micro]
            ids, attn, _ = data.pair_batch(train_pairs, mb, tokenizer.pad_token_id, d.device)  # (2 micro, P+R)
            pack = packed and common.packing_pays(model, attn, 2 * micro, d)  # padding-free where it computes less
            with common.autocast(d):
                r_chosen, r_rejected = common.reward_scores(model, ids, attn, pack).chunk(2)  # (micro,), (micro,)
            margin = margins[mb].to(d.device) if margins is not None else None
            loss, m = bt_loss(r_chosen, r_rejected, cfg.batch_size, margin=margin, center_coef=cfg.center_coef)
            common.backward(model, loss, d, sync=k == cfg.grad_accum - 1)
            common.add_metrics(sums, m)

        # ---------------------------------------------------------------------
        # 3. optimizer step
        grad_norm, lr = common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)

        # =====================================================================
        # 4. bookkeeping, not the algorithm: metrics (one all-reduce), eval, log, checkpoint
        metrics = common.reduce_metrics(sums, d, same={"grad_norm": grad_norm})
        metrics |= {"lr": lr, "time/step": time.time() - t0}
        job.check(step, metrics)  # a NaN loss stops the run, naming the last good checkpoint
        if step % cfg.eval_every == 0 and step < cfg.steps:
            metrics |= evaluate(model, tokenizer, test_pairs, gold_pairs, cfg=cfg, d=d)
        job.log(step, metrics)  # and a checkpoint every --save_every steps, and at the last
    # 5. after training and the last step's checkpoint (a kill here loses nothing): figures that join its row
    job.final(evaluate(model, tokenizer, test_pairs, gold_pairs, cfg=cfg, d=d))
    if cfg.normalize:
        job.final(normalize(model, tokenizer, train, cfg, d))
    job.finish()


if __name__ == "__main__":
    cli.script(main, Config)
