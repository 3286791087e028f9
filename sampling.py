"""The sampler: a lean KV-cached loop for rollouts and greedy evaluation (what
model.generate() does, minus its per-step overhead), shared by grpo.py, reward.py's
normalisation and every script's evaluation. Its speed against model.generate:
bench/sampler.py; its correctness: tests/test_sampler.py.
"""
import copy
import hashlib
import time
import weakref
from dataclasses import dataclass

import torch

import common
import data
import run
import tool_rollout


def stream_seed(seed, step, stream, index=0, round_=0):
    """Seed of a step's stream (0: sampling; 1: rejection sampling of global prompt `index`; 2: mini-batch deal) in
    round round_: hashed to the 32 bits a CPU generator (mt19937) keeps; two keys collide with probability 2^-32."""
    return int(hashlib.blake2b(f"{seed},{step},{stream},{round_},{index}".encode(), digest_size=4).hexdigest(), 16)


def truncate_mask(response_ids, response_mask, truncate_id):
    """(B, R) mask zeroed after each row's first truncate token (kept): nothing after it is
    rewarded or trained on."""
    if truncate_id is None:
        return response_mask
    hit = (response_ids == truncate_id) & response_mask.bool()
    after = (hit.long().cumsum(-1) - hit.long()) > 0  # strictly after the first hit
    return response_mask * (~after).long()


def rollout_uniforms(n_rows, n_tokens, seed):
    """U(0, 1) draws (n_rows, n_tokens), float64, one per row and token of a global batch: each
    rank indexes its own rows, so 1 process and 8 draw the same rollout."""
    return torch.rand(n_rows, n_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


NAN_LOGITS = "sample_token: logits with NaN or +inf, or all -inf (a diverged model, or a bad --top_k/--top_p mask)"


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, u=None, bad=None):
    """One token per row from (B, V) logits (temperature 0: greedy), by inverting the float64 CDF
    with one uniform number per row (`u`, or from `generator`): torch.multinomial draws one per
    vocabulary entry, slow on CPU (bench/sampler.py). Non-finite logits raise, or with `bad` (a
    bool tensor on the device) set it, for generate to raise after its loop (no sync per token)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    cdf = logits.softmax(-1).double().cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1) ~1; NaN if a row had no finite logit
    finite = torch.isfinite(total).all()
    if bad is None:  # a direct call: check now (one host sync)
        if not finite:
            raise RuntimeError(NAN_LOGITS)
    else:  # inside generate: record on the device, checked once at the end (no sync per token)
        bad.logical_or_(~finite)
    if u is None:
        u = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator)
    u = u.view(-1, 1).to(cdf) * total
    # the first CDF entry above u: zero-probability tokens (top-k / top-p) span no interval and
    # are never drawn; u is kept below total in case u * total rounds up to it
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # clamped: a NaN row would give index V, an out-of-range id that the next forward's embedding
    # lookup turns into a CUDA device-side assert (which leaves the context unusable)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def _next_logits(model, input_ids, attention_mask, position_ids, cache, kw):
    """(B, T) ids through the model with a KV cache -> (B, V) logits of the token after them."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache=cache, use_cache=True, **kw).logits[:, -1]


def _next_logits_unfused(model, *args, **kwargs):
    """_next_logits with attention as matmul -> softmax -> matmul (SDPA's math backend), which
    inductor fuses on CPU: faster than the CPU flash kernel (bench/results/sampler-*.json)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return _next_logits(model, *args, **kwargs)


_compiled = {}  # torch.compile of the step, made once; dynamo keeps a graph per model and shape


def _step_fn(compile, device):
    """The decode step: eager, or compiled; on CUDA also a CUDA graph ("reduce-overhead"), one replay
    for the hundreds of kernel launches of a token, reading the static cache in place."""
    if not compile:
        return _next_logits
    fn = _next_logits_unfused if device.type == "cpu" else _next_logits
    if fn not in _compiled:
        mode = "reduce-overhead" if device.type == "cuda" else None
        _compiled[fn] = torch.compile(fn, dynamic=False, mode=mode)
    return _compiled[fn]


_DECODE_CACHES = weakref.WeakKeyDictionary()  # model -> ((rows, slots), StaticCache), for compiled decoding


def _decode_cache(model, B, L, persistent):
    """A static KV cache of B rows and L slots, and its slots (None for sliding-window layers:
    prefilled into a fresh cache). persistent (compiled decoding): one per model, reused in place
    (the captured graph reads it at fixed addresses) while its rows match and its slots suffice;
    a rollout that needs others replaces it. One, not one per length: several kept through the
    update would hold 22-37 GiB at 8B."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if persistent:
        (rows, slots), cache = _DECODE_CACHES.pop(model, ((0, 0), None))  # an old one goes before a new one is made
        if rows == B and slots >= L:
            _DECODE_CACHES[model] = ((rows, slots), cache)
            return cache, slots
        del cache
    cache = StaticCache(config=model.config, max_cache_len=L)
    if not all(type(layer) is StaticLayer for layer in cache.layers):
        return None, L
    if persistent:
        _DECODE_CACHES[model] = ((B, L), cache)
    return cache, L


_BF16_COPIES = weakref.WeakKeyDictionary()  # model -> (its copy with bf16 linear weights, [(bf16, fp32)])


def _bf16_decoder(model):
    """Compiled decoding under autocast (one GPU, plain `python`): the model with bf16 copies of its
    linear weights, refreshed in place once per rollout. Inside a graph autocast would cast every
    weight on every token (its cast cache serves eager code only); held between rollouts (2 bytes
    per weight), the copies keep the CUDA graph's addresses. Embeddings, norms and the fp32 head
    are the model's own, so the numbers are autocast's."""
    if model not in _BF16_COPIES:
        memo = {id(t): t for t in (*model.parameters(), *model.buffers())}  # shared, not copied
        linears = [m.weight for m in model.modules() if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"]
        memo |= {id(w): torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False) for w in linears}
        _BF16_COPIES[model] = (copy.deepcopy(model, memo), [(memo[id(w)], w) for w in linears])
    decoder, pairs = _BF16_COPIES[model]
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    return decoder


def _fill_cache(cache, prefill, inverse, P):
    """Copy the prefill's keys and values (U distinct prompts, P tokens) into slots [0, P) of the
    static cache, row i taking prompt inverse[i]; in place, so the cache keeps its addresses."""
    for dst, src in zip(cache.layers, prefill.layers):
        k, v = (src.keys, src.values) if inverse is None else (src.keys[inverse], src.values[inverse])
        if not dst.is_initialized or dst.keys.dtype != k.dtype:
            dst.lazy_initialization(k[:, :, :0], v[:, :, :0])
        dst.keys[:, :, :P].copy_(k)
        dst.values[:, :, :P].copy_(v)
        dst.cumulative_length.fill_(P)


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, temperature=1.0, top_k=0,
             top_p=1.0, stop_ids=(), generator=None, compile=False, uniforms=None, return_logprobs=False):
    """Sample responses to left-padded prompts (greedy output equals model.generate's; under FSDP
    call it inside `unsharded`). Random numbers: `uniforms` (B, >= max_new_tokens), column t for
    token t, or `generator`. Returns ids (B, R) right-padded with pad_id and a mask (B, R), 1 up to
    and including the first stop id, R <= max_new_tokens; return_logprobs: also each token's
    log-prob at the temperature from the sampler's own logits (the trainer measures the gap).
    Against model.generate (bench/sampler.py): 1. each distinct prompt is prefilled once, its keys
    and values copied to its G repeats; 2. a static cache written in place, "all stopped?" read
    every 8 tokens on a GPU; 3. compile=True: the decode step compiled (the cache length rounded
    up so nearby lengths share a graph), on CUDA replayed as a CUDA graph, under autocast from bf16
    copies of the weights (_bf16_decoder)."""
    (B, P), device = prompt_ids.shape, prompt_ids.device
    L = P + max_new_tokens
    if compile:  # round up to a multiple of L/8 to L/4 (54 -> 56, 300 -> 320)
        q = max(8, 2 ** (L.bit_length() - 3))
        L = -(-L // q) * q
    kw = dict(logits_to_keep=1) if common._accepts(model, "logits_to_keep") else {}
    stops = torch.tensor([eos_id, *stop_ids], device=device)
    uniforms = None if uniforms is None else uniforms.to(device)

    # 1. prefill the distinct prompts, then give each row its prompt's keys and values
    rows, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    dedup = len(rows) < B
    ids, mask = (rows[:, :P], rows[:, P:]) if dedup else (prompt_ids, prompt_mask)
    cache, L = _decode_cache(model, B, L, persistent=compile)  # L: the cache's slots, >= P + max_new_tokens
    if cache is None:  # sliding-window layers: prefill into a fresh static cache, then reorder it
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=L)
        logits = _next_logits(model, ids, mask, common.position_ids_from_mask(mask), cache=cache, kw=kw)  # (U, V)
        if dedup:
            cache.reorder_cache(inverse)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True, **kw)
        logits = out.logits[:, -1]  # (U, V)
        _fill_cache(cache, out.cache, inverse if dedup else None, P)
        del out
    if dedup:
        logits = logits[inverse]  # (B, V)

    # 2. decode; slots of the static cache past the current token are hidden by the causal mask
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, L - P)], 1)  # (B, L)
    pos = prompt_mask.sum(-1, keepdim=True)  # (B, 1) position of the first response token
    step = _step_fn(compile, device)
    decoder = _bf16_decoder(model) if compile and torch.is_autocast_enabled(device.type) else model
    graphs = compile and device.type == "cuda"
    check_every = 8 if device.type == "cuda" else 1
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    response_mask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=device)
    logps = torch.zeros((B, max_new_tokens), dtype=torch.float, device=device) if return_logprobs else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    bad = torch.zeros((), dtype=torch.bool, device=device)  # any row with non-finite logits
    for t in range(max_new_tokens):
        u = None if uniforms is None else uniforms[:, t]
        tok = sample_token(logits, temperature, top_k=top_k, top_p=top_p, generator=generator, u=u,
                           bad=bad).masked_fill(done, pad_id)
        tokens[:, t] = tok
        if return_logprobs:
            logps[:, t] = torch.log_softmax(logits.float() / (temperature or 1.0), -1).gather(-1, tok[:, None]).squeeze(-1)
        response_mask[:, t] = ~done  # the stop token itself counts
        done = done | torch.isin(tok, stops)
        if t == max_new_tokens - 1 or (t % check_every == check_every - 1 and done.all()):
            break
        if graphs:  # each step's logits are read before the next replay overwrites them
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(decoder, tok[:, None], mask, pos + t, cache=cache, kw=kw)
    if bad:
        raise RuntimeError(NAN_LOGITS)
    R = int(response_mask.any(0).sum())  # the longest response: its columns are the first R
    if return_logprobs:
        return tokens[:, :R], response_mask[:, :R], logps[:, :R] * response_mask[:, :R]
    return tokens[:, :R], response_mask[:, :R]


# -----------------------------------------------------------------------------
# GRPO's rollouts: the sampled rows of a step, on this rank


@dataclass
class Rollout:
    """The rows of a rollout on this rank, each prompt's G completions contiguous; the prompt block
    left-padded to P tokens and the response block right-padded to R (common.py's layout)."""
    p_ids: torch.Tensor  # (N, P)
    p_mask: torch.Tensor  # (N, P)
    r_ids: torch.Tensor  # (N, R)
    r_mask: torch.Tensor  # (N, R) 1 up to and including the stop token
    r_logps: torch.Tensor  # (N, R) the sampler's log-probs of its tokens
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


def rollout(model, env, cfg, d, step, round_=0):
    """Phase 1: this rank's share of prompts_per_step new prompts, rs_samples or group_size
    completions each, groups contiguous, drawn with the random numbers of the global rollout
    indexed by row (any number of ranks samples the same). Returns the Rollout and its seconds."""
    t0, n_sample = time.time(), cfg.rs_samples or cfg.group_size
    rows = env.order.next(cfg.prompts_per_step)[common.shard_batch(cfg.prompts_per_step, d)]
    prompts = [p for p in env.prompts.select(rows)["prompt"] for _ in range(n_sample)]  # groups contiguous
    u = rollout_uniforms(cfg.prompts_per_step * n_sample, cfg.max_new_tokens,
                         stream_seed(cfg.seed, step, stream=0, round_=round_))
    u = u[common.shard_batch(cfg.prompts_per_step * n_sample, d)]  # (N, max_new_tokens) this rank's rows
    p_ids, _ = data.encode_prompts(env.tokenizer, prompts, cfg.max_prompt_len)
    p_ids, p_mask = (t.to(d.device) for t in common.pad(p_ids, env.tokenizer.pad_token_id, side="left"))  # (N, P)
    kw = dict(eos_id=env.stop_ids[0], pad_id=env.tokenizer.pad_token_id, temperature=cfg.temperature, top_k=cfg.top_k,
              top_p=cfg.top_p, stop_ids=env.stop_ids[1:], uniforms=u, compile=cfg.compile)
    with common.evaluating(model, gather=True), common.autocast(d):
        if env.tool is None:
            r_ids, r_mask, r_logps = generate(model, p_ids, p_mask, cfg.max_new_tokens, return_logprobs=True, **kw)
            r_tool = torch.zeros_like(r_mask)  # (N, R) each
        else:  # the policy's calls run between its turns; r_tool: 1 on the tools' tokens (tool_rollout.py)
            r_ids, r_mask, r_logps, r_tool = tool_rollout.generate_with_tools(
                model, p_ids, p_mask, cfg.max_new_tokens, tokenizer=env.tokenizer, tool=env.tool,
                max_calls=cfg.max_tool_calls, **kw)
    r_mask = truncate_mask(r_ids, r_mask, env.truncate_id)
    stopped = (torch.isin(r_ids, r_ids.new_tensor(env.stop_ids)) & r_mask.bool()).any(-1)  # (N,)
    prompt_idx = torch.tensor(rows, device=d.device).repeat_interleave(n_sample)  # (N,)
    prompt_cut = env.prompt_cut[rows].to(d.device).repeat_interleave(n_sample)  # (N,)
    run.sync(d)  # each phase's clock read after its GPU work is done
    roll = Rollout(p_ids, p_mask, r_ids, r_mask, r_logps, r_tool=r_tool * r_mask, stopped=stopped,
                   prompt_idx=prompt_idx, prompt_cut=prompt_cut, rewards=torch.zeros_like(r_logps[:, 0]), parts={})
    return roll, time.time() - t0
