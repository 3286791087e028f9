"""GRPO's environment: what a rollout samples and what scores it. Built once (make_env): the
prompts, rendered with the chat template and each with its rule, their order, the stop ids, a
reward model, on-policy distillation's teacher and the tool a policy may call. Each step: the
rollout (rollout: prompts -> completions, drawn by the sampler with the random numbers of the
global batch) and what scores its completions (score: each row's rule, the reward model). Beside
them the reference policy (LoRA's adapters switched off, or a frozen copy refreshed under FSDP2; none at beta 0)
and the held-out evaluation (greedy answers, the implicit reward's pairwise accuracy)."""
import contextlib
import copy
import dataclasses
import math
import os

import torch

import common
import data
import reward_fns
import sampling
import tasks
import tools
from plumbing import logs, models


def combine(parts, weights):
    """The weighted sum of the rewards, NaN (a function's None) left out as TRL's nansum does; a
    completion no weighted reward scores is NaN (TRL: left out of its group's statistics, advantage 0)."""
    terms = torch.stack([w * parts[k] for k, w in weights.items()])  # (F, N)
    return terms.nansum(0).masked_fill(terms.isnan().all(0), math.nan)


def reward_metrics(parts, weights, n_rows, d):
    """reward/<k> (the mean of each term that is never None: rule, model, penalties), and TRL's
    rewards/<name>/mean and /std of each reward (rule, model, each function: not the penalties)
    over the global batch, its None left out (NaN when it scored none). Values whose sum over
    ranks is the metric. Collective."""
    names = [k for k in parts if k in (*weights, "rule", "model")]
    out = {f"reward/{k}": v.sum() / n_rows for k, v in parts.items() if k not in names or k in ("rule", "model")}
    if names:
        x = torch.stack([parts[k] for k in names]).double()  # (F, N)
        ok = ~x.isnan()
        s = common.all_reduce_sum(torch.stack([x.nansum(1), (x * x).nansum(1), ok.sum(1).double()]), d)  # (3, F)
        mean = s[0] / s[2]
        std = ((s[1] - s[2] * mean * mean) / (s[2] - 1).clamp(min=1)).clamp(min=0).sqrt()
        for i, k in enumerate(names):  # every rank holds the global value: each adds its share
            out |= {f"rewards/{k}/mean": mean[i] / d.world_size, f"rewards/{k}/std": std[i] / d.world_size}
    return out


def load_prompts(cfg, rules, fns=(), split="train"):
    """grpo.py's training prompts (--dataset, --n_train of an embedded task), or with split "test"
    its held-out ones (--eval_dataset, else a local file's prompts hashing into the held-out share,
    else None), and each row's number in the data set (1-based). Where rules are scored, every row gets its rule (`reward_fn`:
    the row's own, else --reward_fn), and every row is checked against each rule of --reward_fn
    (fns): a bad row found at step 2 would have cost a run."""
    source = (cfg.eval_dataset or cfg.dataset) if split == "test" else cfg.dataset
    local = not cfg.eval_dataset and cfg.dataset not in tasks.TASKS and os.path.isfile(cfg.dataset)
    if split == "test" and not (cfg.eval_dataset or local):
        return None, None
    one_rule = cfg.reward_fn in tasks.REWARD_FNS  # --reward_fn NAME: every row's rule, a row's own winning
    columns = ["prompt"] + (["reward_fn"] if rules and not one_rule else [])
    ds = data.load_data(source, cfg.eval_split if cfg.eval_dataset and split == "test" else "train", columns,
                        kind="prompt", n=cfg.n_train, seed=cfg.seed,
                        optional=("reward_fn", "answer", "solution", cfg.answer_column) if rules or fns else ())
    reward_fns.check_columns(ds.column_names, source, fns)  # a column named `completions` would reach them twice
    builtin = [f.name for f in fns if f.builtin]
    # each column read once, whole ([:]): iterating a datasets Column formats it row by row, 100x slower
    prompts = ds["prompt"][:]
    row_rules = (ds["reward_fn"][:] if "reward_fn" in ds.column_names else [cfg.reward_fn] * len(ds)) if rules else []
    column = reward_fns.answer_column(ds, cfg, source, needed=any(r in tasks.NEEDS_ANSWER for r in [*builtin, *row_rules]))
    if rules and "reward_fn" not in ds.column_names:  # --reward_fn for every row
        ds = ds.add_column("reward_fn", row_rules)
    answers = ds[column][:] if column else None
    if rules:
        tasks.check_rule_rows(row_rules, prompts, source, answers)
    for name in builtin:
        tasks.check_rule_rows([name] * len(ds), prompts, source, answers, flag=f"--reward_fn {name}")
    rows = list(range(len(ds)))  # each row's in the data set, for the errors that name one
    if local:  # split as sft.py and dpo.py split a file without --eval_dataset (read whole above, as "train")
        rows = data.holdout_rows(prompts, source, split, what="prompts", eval_on_train=False)
        if rows is None:
            return None, None
    rows = rows[:cfg.n_eval] if split == "test" else rows
    return ds.select(rows), [i + 1 for i in rows]


def grpo_evals(cfg, tokenizer, rules=False, fns=()):
    """What grpo.py evaluates on: an embedded task's held-out prompts (rendered, and as given), the
    held-out prompts of --eval_dataset or of a local file's hash split (`prompts`: their rendered
    columns, as given, their rows), and held-out preference pairs (--eval_pairs, or the task's own)
    encoded (not without a reference, at --beta 0: nothing to score them with); None where there are none."""
    embedded = cfg.dataset in tasks.TASKS
    held_out = pairs = gold_pairs = prompts = None
    if embedded:
        rows = data.load_data(cfg.dataset, "test", ["prompt"], kind="prompt", n=cfg.n_eval, seed=cfg.seed)
        held_out = {**data.render_chat(rows, tokenizer, cfg.dataset)[0][:], "own_prompt": rows["prompt"][:]}
    test, numbers = load_prompts(cfg, rules, fns, split="test")
    if test is not None:
        source = cfg.eval_dataset or cfg.dataset
        prompts = {"rows": data.render_chat(test, tokenizer, source)[0][:], "own": test["prompt"][:],
                   "numbers": numbers, "source": source}
    if (cfg.beta or cfg.reference) and (cfg.eval_pairs or (embedded and "preference" in tasks.TASKS[cfg.dataset])):
        rows = data.load_pairs(cfg.eval_pairs or cfg.dataset, cfg.eval_pairs_split if cfg.eval_pairs else "test",
                               cfg.n_eval_pairs, cfg.seed)
        rows, chat = data.render_chat(rows.select(range(min(cfg.n_eval_pairs, len(rows)))), tokenizer,
                                      cfg.eval_pairs or cfg.dataset)
        pairs = data.encode_pairs(rows, tokenizer, cfg.max_prompt_len, cfg.max_new_tokens, "eval pairs", eos=not chat)
        gold_pairs = None if cfg.eval_pairs else rows  # the embedded task's label noise is known
    return {"held_out": held_out, "pairs": pairs, "gold_pairs": gold_pairs, "prompts": prompts}


@dataclasses.dataclass
class Env:
    """What a rollout samples and what scores it, built once (make_env): the prompts rendered (with
    reward_fn and answer where the rules need them) and as given (text or messages: what the rules
    read, as TRL passes them), their order, the stop ids (EOS first), the rewards."""
    prompts: object  # a datasets.Dataset
    own_prompts: list
    order: data.DataOrder
    tokenizer: object
    stop_ids: list
    truncate_id: int | None
    weights: dict
    rows: list = None  # each prompt's row in the data set (1-based), for the errors that name one
    fns: list = dataclasses.field(default_factory=list)  # --reward_fn's functions (RewardFn)
    caller: object = None  # RewardCaller of the user's functions
    answer_column: str | None = None  # the rules' reference: `answer`, `solution` or --answer_column
    rm: object = None
    rm_tokenizer: object = None
    teacher: object = None  # on-policy distillation's, frozen
    tool: object = None  # --tools: a function, text -> text
    compile: bool = False  # the sampler's decode step compiled (--compile, or what `auto` chose: plumbing/speed.py)
    prompt_cut: object = None  # (n,) bool: the prompt is longer than --max_prompt_len, cut from the left


def make_env(cfg, d, prompts, order, tokenizer, model, weights, rows=None, fns=()):
    """The Env of a run: the tool first (a bad --tools is named at once; the closing tag must be one
    token, for the sampler to stop at), the reward model and the teacher, loaded frozen with their
    context checked against prompt + completion, the stop ids, and the prompts rendered with the
    generation prompt (those cut from the left counted here)."""
    tool = None
    if cfg.tools:
        tool = tools.load_tool(cfg.tools)
        tools.closing_tag_id(tokenizer, flag=f"--tools {cfg.tools}")
    rm = rm_tokenizer = None
    if cfg.reward_model:
        rm_tokenizer = models.load_tokenizer(cfg.reward_model, cfg.trust_remote_code)
        rm = models.load_frozen(cfg.reward_model, rm_tokenizer, d, kind="reward", trust_remote_code=cfg.trust_remote_code,
                                cpu_offload=cfg.offload_frozen)
        models.check_context(rm, cfg.max_prompt_len, cfg.max_new_tokens + 1, "--max_new_tokens (+1)",
                             f"--reward_model {cfg.reward_model}")
    teacher = None
    if cfg.teacher:  # it scores the policy's own tokens: one vocabulary for both
        vocab = models.load_tokenizer(cfg.teacher, cfg.trust_remote_code).get_vocab()
        if vocab != tokenizer.get_vocab():
            raise ValueError(f"--teacher {cfg.teacher}: its tokenizer ({len(vocab)} tokens) is not the policy's "
                             f"({len(tokenizer)}): on-policy distillation scores the policy's own tokens with the "
                             f"teacher, so both must share one tokenizer")
        teacher = models.load_frozen(cfg.teacher, tokenizer, d, trust_remote_code=cfg.trust_remote_code,
                                     cpu_offload=cfg.offload_frozen)
        models.check_context(teacher, cfg.max_prompt_len, cfg.max_new_tokens, "--max_new_tokens", f"--teacher {cfg.teacher}")
    stop_ids = sampling.stop_token_ids(tokenizer, model, cfg.truncate_token)  # EOS first, the truncate token last
    rendered, _ = data.render_chat(prompts, tokenizer, cfg.dataset)
    p_ids, cut = sampling.encode_prompts(tokenizer, rendered["prompt"][:], cfg.max_prompt_len, cfg.dataset)
    data.show_example(tokenizer, p_ids[0], None, cfg.dataset)
    return Env(prompts=rendered, own_prompts=prompts["prompt"][:], order=order, tokenizer=tokenizer,
               stop_ids=stop_ids, truncate_id=stop_ids[-1] if cfg.truncate_token else None, weights=weights, rm=rm,
               rm_tokenizer=rm_tokenizer, teacher=teacher, tool=tool, prompt_cut=torch.tensor(cut),
               rows=rows or list(range(1, len(prompts) + 1)), fns=list(fns),
               caller=reward_fns.RewardCaller(fns, cfg.reward_fn_timeout, rank=d.rank if d.world_size > 1 else None),
               answer_column=reward_fns.answer_column(prompts, cfg, cfg.dataset, needed=False))


@torch.no_grad()
def learned_rewards(env, prompts, completions, cfg, d):
    """Reward model scores of prompt + completion re-tokenized with the RM's tokenizer, (N,)."""
    p_ids, _ = sampling.encode_prompts(env.rm_tokenizer, prompts, cfg.max_prompt_len)
    r_ids, _ = sampling.encode_responses(env.rm_tokenizer, completions, cfg.max_new_tokens + 1)
    ids, attn, _ = common.join_prompt_response(p_ids, r_ids, env.rm_tokenizer.pad_token_id)  # (N, P+R)
    with common.autocast(d):
        return common.reward_scores(env.rm, ids.to(d.device), attn.to(d.device)).float()


def truncate_mask(response_ids, response_mask, truncate_id):
    """(B, R) mask zeroed after each row's first truncate token (kept): nothing after it is
    rewarded or trained on."""
    if truncate_id is None:
        return response_mask
    hit = (response_ids == truncate_id) & response_mask.bool()
    after = (hit.long().cumsum(-1) - hit.long()) > 0  # strictly after the first hit
    return response_mask * (~after).long()


@dataclasses.dataclass
class Rollout:
    """The rows of a rollout on this rank, each prompt's G completions contiguous; the prompt block
    left-padded to P tokens and the response block right-padded to R (common.py's layout)."""
    p_ids: torch.Tensor  # (N, P)
    p_mask: torch.Tensor  # (N, P)
    r_ids: torch.Tensor  # (N, R)
    r_mask: torch.Tensor  # (N, R) 1 up to and including the stop token
    r_logps: torch.Tensor  # (N, R) the sampler's log-probs of its tokens under what it drew from (the behaviour
    #   policy: truncated by --top_k / --top_p / --min_p and renormalised), what every ratio against the sampler reads
    r_tool: torch.Tensor  # (N, R) 1 on a tool's tokens (--tools): attended to, never trained on
    stopped: torch.Tensor  # (N,) ended with EOS, an end-of-turn id or the truncate token
    prompt_idx: torch.Tensor  # (N,) each row's prompt: its row in the data set
    prompt_cut: torch.Tensor  # (N,) its prompt is longer than --max_prompt_len, cut from the left
    rewards: torch.Tensor  # (N,) 0 until `reward`
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
        blocks = self.p_ids.new_tensor([[self.p_ids.shape[1], self.r_ids.shape[1]]])  # (1, 2): P and R
        P, R = common.all_gather(blocks, d).amax(0).tolist()  # the longest of any rank
        return self.padded(P, R, pad_id).map(lambda name, x: common.all_gather(x.int(), d).bool()
                                             if x.dtype == torch.bool else common.all_gather(x, d))


def decode_reserve(cfg, d):
    """(rows, slots) of the compiled sampler's cache, made at the run's first rollout or evaluation
    and kept to its end (sampling.DecodeCache), sized from the flags so that every call of the run
    fits and none replaces it (each would recompile every shape): rows, the largest call's (a
    rollout's chunk of --generation_micro_batch_size rows at most, an evaluation's chunk of
    --eval_batch_size prompts, the embedded task's greedy answers); slots, the longest prompt and
    response (--max_prompt_len + --max_new_tokens, with --tools the tool loop's waits for its calls)."""
    n, most = cfg.prompts_per_step // d.world_size * (cfg.rs_samples or cfg.group_size), cfg.generation_micro_batch_size
    rollout = -(-n // -(-n // most)) if most else n  # chunks' largest
    rows = max(rollout, min(cfg.n_eval, cfg.eval_batch_size, most or cfg.eval_batch_size), min(cfg.n_eval, most or 256))
    new = sampling.tool_steps(cfg.max_new_tokens, cfg.max_tool_calls, sampling.GPU_CHECK_EVERY) if cfg.tools else \
        cfg.max_new_tokens
    return rows, cfg.max_prompt_len + new


def chunks(n, size):
    """Slices of range(n) of at most `size` rows each (0: one of all n), as even as possible (24 rows
    at 10: 8, 8, 8), so that a compiled decode step meets as few batch shapes as possible."""
    k = -(-n // size) if size else 1
    bounds = [n * i // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@contextlib.contextmanager
def frozen_in_bf16(model, d, enabled=True):
    """For a block of no-grad forwards under bf16 autocast (a rollout, the reference and old-policy
    passes): the frozen weights and biases of the model's linear layers (LoRA's base; GPT-2's Conv1D
    too) swapped for bf16 copies made once, and the fp32 masters put back on leaving. autocast keeps
    its casts only of leaf tensors that require grad, so a frozen weight is cast again by every
    forward, every decoded token included: 6 bytes of traffic per weight before the matmul reads 2.
    Exact: autocast rounds the fp32 master to the same bf16 tensor, and casts a bf16 one to itself.
    The adapters (trainable), the fp32 head (lm_head.FP32Head, not an nn.Linear) and norms are left
    alone. No-op where common.autocast(d) is no bf16 autocast (the CPU, FSDP2's own casts) or not
    enabled; nested, the inner block finds bf16 weights and copies nothing. Costs a bf16 copy of
    the frozen linear weights while the block runs (bench/memory.py)."""
    cast = common.autocast(d)
    swapped = []  # (module, name, its fp32 master)
    if enabled and isinstance(cast, torch.autocast) and cast.fast_dtype == torch.bfloat16:
        for m in model.modules():
            if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D":
                for name, p in list(m.named_parameters(recurse=False)):
                    if not p.requires_grad and p.dtype == torch.float32:
                        swapped.append((m, name, p))
                        setattr(m, name, torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
    try:
        yield
    finally:
        for m, name, p in swapped:
            setattr(m, name, p)


def sample(model, env, prompts, u, temperature, cfg, d):
    """Completions of rendered prompts, drawn with the uniforms u (N, max_new_tokens) at the
    temperature (0: greedy), with --tools' calls where there is a tool: the prompt block
    left-padded, the response right-padded and cut after a truncate token, the sampler's
    log-probs, 1 on the tools' tokens. Inside common.evaluating. The sampler runs on chunks of at
    most --generation_micro_batch_size rows, so a KV cache holds that many rows, not N; each chunk
    takes its own rows' uniforms and the prompt block of all N, so its rows draw what they draw in
    one call (the same tokens; log-probs up to the float noise of a matmul over fewer rows). Under
    FSDP the weights stay gathered for every chunk (common.unsharded): a chunk runs no collective."""
    p_ids, _ = sampling.encode_prompts(env.tokenizer, prompts, cfg.max_prompt_len)
    p_ids, p_mask = (t.to(d.device) for t in common.pad(p_ids, env.tokenizer.pad_token_id, side="left"))  # (N, P)
    pad_id = env.tokenizer.pad_token_id
    kw = dict(eos_id=env.stop_ids[0], pad_id=pad_id, temperature=temperature, top_k=cfg.top_k,
              top_p=cfg.top_p, min_p=cfg.min_p, stop_ids=env.stop_ids[1:], compile=env.compile,
              reserve=decode_reserve(cfg, d))
    outs = []  # each chunk's (ids, mask, log-probs, tool mask), (n, R_chunk) each
    # LoRA's frozen base cast to bf16 once for the whole rollout; --compile decodes from sampling._bf16_decoder's copies
    with common.autocast(d), frozen_in_bf16(model, d, enabled=not env.compile):
        for rows in chunks(len(prompts), cfg.generation_micro_batch_size):
            if env.tool is None:
                out = sampling.generate(model, p_ids[rows], p_mask[rows], cfg.max_new_tokens, uniforms=u[rows],
                                        return_logprobs=True, **kw)
                outs.append((*out, torch.zeros_like(out[1])))
            else:  # the policy's calls run between its turns; r_tool: 1 on the tools' tokens (sampling.generate_with_tools)
                outs.append(sampling.generate_with_tools(model, p_ids[rows], p_mask[rows], cfg.max_new_tokens,
                                                         tokenizer=env.tokenizer, tool=env.tool, uniforms=u[rows],
                                                         max_calls=cfg.max_tool_calls, **kw))
    R = max(out[0].shape[1] for out in outs)  # the longest response of any chunk
    right = lambda x, value: torch.nn.functional.pad(x, (0, R - x.shape[1]), value=value)  # noqa: E731
    r_ids, r_mask, r_logps, r_tool = (torch.cat([right(out[k], pad_id if k == 0 else 0) for out in outs])
                                      for k in range(4))  # (N, R) each
    return p_ids, p_mask, r_ids, truncate_mask(r_ids, r_mask, env.truncate_id), r_logps, r_tool


def scoring(cfg):
    """How the trainer scores the rollout's tokens, response_logprobs' knobs: at the sampling
    temperature and, with --sampling_replay, under the sampler's truncation (sampling.truncation;
    None without one), for the policy, its old self, the reference and the teacher alike: the KL
    and the distillation compare the policies as they sample (a policy equal to its reference: KL 0)."""
    return dict(temperature=cfg.temperature,
                truncate=sampling.truncation(cfg.top_k, cfg.top_p, cfg.min_p) if cfg.sampling_replay else None)


def rollout(model, env, cfg, d, step, round_=0):
    """Phase 1: this rank's share of prompts_per_step new prompts, rs_samples or group_size
    completions each, groups contiguous, drawn with the random numbers of the global rollout
    indexed by row (any number of ranks samples the same)."""
    n_sample = cfg.rs_samples or cfg.group_size
    rows = env.order.next(cfg.prompts_per_step)[common.shard_batch(cfg.prompts_per_step, d)]
    prompts = [p for p in env.prompts.select(rows)["prompt"] for _ in range(n_sample)]  # groups contiguous
    u = sampling.rollout_uniforms(cfg.prompts_per_step * n_sample, cfg.max_new_tokens,
                         sampling.stream_seed(cfg.seed, step, stream=0, round_=round_))
    u = u[common.shard_batch(cfg.prompts_per_step * n_sample, d)]  # (N, max_new_tokens) this rank's rows
    with common.evaluating(model, gather=True):
        p_ids, p_mask, r_ids, r_mask, r_logps, r_tool = sample(model, env, prompts, u, cfg.temperature, cfg=cfg, d=d)
    stopped = (torch.isin(r_ids, r_ids.new_tensor(env.stop_ids)) & r_mask.bool()).any(-1)  # (N,)
    prompt_idx = torch.tensor(rows, device=d.device).repeat_interleave(n_sample)  # (N,)
    prompt_cut = env.prompt_cut[rows].to(d.device).repeat_interleave(n_sample)  # (N,)
    roll = Rollout(p_ids, p_mask, r_ids, r_mask, r_logps, r_tool=r_tool * r_mask, stopped=stopped,
                   prompt_idx=prompt_idx, prompt_cut=prompt_cut, rewards=torch.zeros_like(r_logps[:, 0]), parts={})
    return roll


def score(roll, env, cfg, d):
    """What scores each completion of a rollout, {name: (N,)}, on the text after the prompt (stop
    tokens left out): score_texts of this rank's rows."""
    is_stop = torch.isin(roll.r_ids, roll.r_ids.new_tensor(env.stop_ids))
    texts = sampling.decode_responses(env.tokenizer, roll.r_ids, roll.r_mask * (~is_stop).long(), roll.p_ids)
    idx = roll.prompt_idx.tolist()
    ids = None
    if env.caller.fns:  # TRL's completion_ids: the sampled tokens, the stop token included
        ids = [row[:n] for row, n in zip(roll.r_ids.tolist(), roll.r_mask.sum(-1).tolist())]
    return score_texts(env, env.prompts.select(idx)[:], [env.own_prompts[i] for i in idx], texts, ids=ids,
                       numbers=[env.rows[i] for i in idx], source=cfg.dataset, cfg=cfg, d=d)


def score_texts(env, rows, own_prompts, texts, ids, numbers, source, cfg, d):
    """{name: (N,)}: `rule`, each row's rule (tasks.py) given its prompt as written (text or
    messages, as TRL passes it) and its answer; each --reward_fn function, a rule on every row or
    the user's own called as TRL calls it (prompts and completions as the row is written, every
    other column as a keyword list; NaN where it returns None); `model`, the reward model. rows:
    the rendered rows' columns as lists; numbers: their rows in `source` (1-based)."""
    host = {}  # the rewards computed on the host (rules, your functions), as Python floats
    answers = rows.get(env.answer_column, [None] * len(texts))
    if "reward_fn" in rows:
        host["rule"] = [tasks.REWARD_FNS[f](p, c, a) for f, p, c, a in zip(rows["reward_fn"], own_prompts, texts, answers)]
    for f in env.fns:
        if f.builtin:
            host[f.name] = [f.fn(p, c, a) for p, c, a in zip(own_prompts, texts, answers)]
    if env.caller.fns:
        chat = data.is_conversation(own_prompts[0])  # completions as TRL passes them: messages after messages
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        columns = {k: v for k, v in rows.items() if k not in ("prompt", "completion")}
        host |= env.caller(own_prompts, completions, ids, columns, rows=numbers, source=source)
    reward_fns.check_weighted_sum(host, env.weights, numbers, source)  # 1e38 x weight 10 is inf in float32
    parts = {k: torch.tensor(v, dtype=torch.float32, device=d.device) for k, v in host.items()}
    if env.rm is not None:  # a model's float32 scores, on the device: bounded by its own head
        parts["model"] = learned_rewards(env, rows["prompt"], texts, cfg, d)
    return parts


def evaluate_rewards(model, env, held, cfg, d):
    """Held-out prompts (grpo_evals' `prompts`) answered greedily and sampled as the rollouts sample
    (--temperature, --top_k, --top_p, --min_p, with draws seeded by --seed alone: the same at every
    evaluation, on any number of ranks), each completion scored as in the rollouts (score_texts).
    The weighted reward and each reward's mean, None left out, under TRL's names with this
    project's eval/ prefix: eval/reward and eval/rewards/<name>/mean sampled (TRL evaluates with
    its sampling settings), eval/greedy/reward and eval/greedy/rewards/<name>/mean ({} without
    held-out prompts). Collective."""
    if held is None:
        return {}
    rows, own, n = held["rows"], held["own"], len(held["own"])
    names = (["rule"] if "reward_fn" in rows else []) + [f.name for f in env.fns] + (["model"] if env.rm else [])
    u = sampling.rollout_uniforms(n, cfg.max_new_tokens, sampling.stream_seed(cfg.seed, 0, stream=3))
    metrics = {}
    for mode, temperature in (("greedy/", 0.0), ("", cfg.temperature)):
        def run(idx):
            p_ids, _, r_ids, r_mask, _, _ = sample(model, env, [rows["prompt"][i] for i in idx], u[idx], temperature,
                                                   cfg=cfg, d=d)
            is_stop = torch.isin(r_ids, r_ids.new_tensor(env.stop_ids))
            texts = sampling.decode_responses(env.tokenizer, r_ids, r_mask * (~is_stop).long(), p_ids)
            ids = [row[:k] for row, k in zip(r_ids.tolist(), r_mask.sum(-1).tolist())]
            parts = score_texts(env, {c: [v[i] for i in idx] for c, v in rows.items()}, [own[i] for i in idx], texts,
                                ids=ids, numbers=[held["numbers"][i] for i in idx], source=held["source"], cfg=cfg, d=d)
            return torch.stack([parts[k].to(d.device, torch.float64) for k in names], 1)  # (len(idx), F)

        with common.evaluating(model, gather=True):
            r = common.map_rows(run, n, d, cfg.eval_batch_size)  # (n, F), NaN where a function returned None
        parts = {k: r[:, i] for i, k in enumerate(names)}
        metrics[f"eval/{mode}reward"] = combine(parts, env.weights).nanmean().item()
        metrics |= {f"eval/{mode}rewards/{k}/mean": v.nanmean().item() for k, v in parts.items()}
    return metrics


# -----------------------------------------------------------------------------
# the reference policy and the held-out evaluation


def reference(model, cfg, d):
    """The reference policy, before the policy is sharded: the policy itself when it has LoRA adapters
    (reference_context switches them off), else a frozen copy of it; None at --beta 0 without
    --reference (TRL's default), where the loss needs none: none is loaded, and the run says what it
    leaves out."""
    if not (cfg.beta or cfg.reference):
        common.print0("--beta 0: no KL term, so no reference model is loaded (TRL's default); no `kl` metric and no "
                      "eval/accuracy of beta log(pi / pi_ref) (--reference loads one for them)")
        return None
    return model if hasattr(model, "peft_config") else common.freeze(copy.deepcopy(model), d,
                                                                      cpu_offload=cfg.offload_frozen)


def reference_context(model, ref):
    """Run the reference: a frozen copy as it is, the LoRA policy (ref is model) with its adapters off."""
    return models.as_reference(model) if ref is model else contextlib.nullcontext()


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


def pairwise_accuracy(model, ref, pairs, pad_id, d, batch_size):
    """Share of held-out pairs (data.encode_pairs) whose implicit reward log(pi/pi_ref), against the
    current reference, ranks chosen above rejected (ties half): does RL on the reward also move the
    policy towards what people preferred?"""
    def margins(rows):  # (b, 2): log pi - log pi_ref of chosen and of rejected
        batch = data.pair_batch(pairs, rows, pad_id, d.device)
        pi = common.sequence_logprobs(model, batch, d)
        with reference_context(model, ref):
            pi_ref = common.sequence_logprobs(ref, batch, d)
        return torch.stack((pi - pi_ref).chunk(2), 1)

    with common.evaluating(model):
        m = common.map_rows(margins, len(pairs[0]), d, batch_size, logits_per_row=data.pair_logits(pairs, model))
    return common.ranking_accuracy(m[:, 0], m[:, 1]).item()


@logs.phase("evaluation")
def evaluate(model, ref, env, evals, cfg, d):
    """Greedy answers to the embedded task's held-out prompts, scored by its rule (exact-match and
    gold reward; with --tools, the tool's calls run as in the rollouts), and the held-out pairs'
    accuracy of the implicit reward beta log(pi / pi_ref); on the embedded task also against the
    best accuracy its label noise allows."""
    metrics = {}
    if evals["held_out"] is not None:  # every row of a task has its rule
        h = evals["held_out"]
        rule = tasks.REWARD_FNS[h["reward_fn"][0]]
        with frozen_in_bf16(model, d):  # greedy decoding: LoRA's base cast once, not per token
            metrics |= sampling.evaluate_generations(
                model, env.tokenizer, h["prompt"], rule, d, max_prompt_len=cfg.max_prompt_len,
                max_new_tokens=cfg.max_new_tokens, answers=h.get("answer"), own_prompts=h["own_prompt"], tool=env.tool,
                max_tool_calls=cfg.max_tool_calls, batch_size=cfg.generation_micro_batch_size or 256,
                compile=env.compile, reserve=decode_reserve(cfg, d))
    metrics |= evaluate_rewards(model, env, evals["prompts"], cfg, d)  # --eval_dataset, a file's 5%
    if evals["pairs"] is not None:
        metrics["eval/accuracy"] = pairwise_accuracy(model, ref, evals["pairs"], env.tokenizer.pad_token_id, d,
                                                     batch_size=cfg.eval_batch_size)
    if evals["gold_pairs"] is not None:
        metrics |= tasks.against_bayes(metrics["eval/accuracy"], evals["gold_pairs"])
    return metrics
