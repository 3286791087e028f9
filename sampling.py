"""The sampler: a lean KV-cached loop for rollouts and greedy evaluation (what
model.generate() does, minus its per-step overhead), shared by grpo.py, reward.py's
normalisation and every script's evaluation; the cache and the model copy its compiled step
reads: kv_cache.py. Its speed against model.generate: `python -m bench rollout`; its
correctness: tests/test_sampler.py, tests/test_decode_step.py.
"""
import contextlib
import functools
import hashlib

import torch
from transformers import StaticCache

import common
import kv_cache
import lm_head
import shared_prompt
import tools


def stream_seed(seed, step, stream, index=0, round_=0):
    """Seed of a step's stream (0: sampling; 1: rejection sampling of global prompt `index`; 2: mini-batch deal) in
    round round_: hashed to the 32 bits a CPU generator (mt19937) keeps; two keys collide with probability 2^-32."""
    return int(hashlib.blake2b(f"{seed},{step},{stream},{round_},{index}".encode(), digest_size=4).hexdigest(), 16)


def rollout_uniforms(n_rows, n_tokens, seed):
    """U(0, 1) draws (n_rows, n_tokens), float64, one per row and token of a global batch: each
    rank indexes its own rows, so 1 process and 8 draw the same rollout."""
    return torch.rand(n_rows, n_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


NAN_LOGITS = "sample_token: logits with NaN or +inf, or all -inf (a diverged model, or a bad --top_k/--top_p mask)"


# -----------------------------------------------------------------------------
# the truncation rule (--min_p, --top_k, --top_p), once: the sampler draws from the distribution it
# keeps, and the trainer replays it on its own logits (grpo.py --sampling_replay) so that both compute
# the log-probs of one policy, the behaviour policy that sampled


def kept_tokens(logits, top_k=0, top_p=1.0, min_p=0.0):
    """Which tokens the rule keeps, bool (..., V), from fp32 logits at the temperature, in vLLM's
    order: min-p on the whole distribution (p >= min_p x the largest p), then the top_k most likely,
    then the smallest set of the most likely of those whose probability, renormalised, reaches
    top_p. Ties at the k-th logit are all kept."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p > 0:
        probs = logits.softmax(-1)
        keep &= ~(probs < min_p * probs.amax(-1, keepdim=True))
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        keep &= ~(logits < kth)  # not >=: a NaN logit stays, for the caller's check
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits.masked_fill(~keep, float("-inf")), descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        keep &= ~drop.scatter(-1, idx, drop)
    return keep


def truncate_logits(logits, labels=None, top_k=0, top_p=1.0, min_p=0.0):
    """fp32 logits (..., V) at the temperature with the tokens kept_tokens drops at -inf: their
    log_softmax is the behaviour policy's log-prob, log(p / kept mass) on the kept set. The rule is
    found without a gradient, in chunks of rows (a sort of V per row: 2^26 logits at a time on a
    GPU, as lm_head.logprobs_from_logits chunks); the gradient flows through the kept logits.
    labels (...): tokens kept whatever the rule says (the trainer's replay: a sampled token its own
    logits would drop, where they differ from the sampler's, keeps a finite log-prob, as prime-rl's
    replay keeps its labels)."""
    logits = logits.float()
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])
        rows = lm_head.chunk_rows(flat, None)
        keep = torch.cat([kept_tokens(flat[i:i + rows], top_k, top_p, min_p)
                          for i in range(0, flat.shape[0], rows)]).view(logits.shape)
        if labels is not None:
            keep.scatter_(-1, labels[..., None], True)
    return logits.masked_fill(~keep, float("-inf"))


def truncation(top_k=0, top_p=1.0, min_p=0.0):
    """The rule as common.response_logprobs' `truncate` knob, fn(logits, labels) -> logits, or None
    where it keeps every token (no sort, no copy)."""
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0:
        return None
    return functools.partial(truncate_logits, top_k=top_k, top_p=top_p, min_p=min_p)


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, u=None, bad=None, min_p=0.0,
                 return_logprob=False):
    """One token per row from (B, V) logits (temperature 0: greedy), by inverting the float64 CDF
    with one uniform number per row (`u`, or from `generator`): torch.multinomial draws one per
    vocabulary entry, slow on CPU (`python -m bench rollout`). Non-finite logits raise, or with `bad` (a
    bool tensor on the device) set it, for generate to raise after its loop (no sync per token).
    return_logprob: also the token's log-prob under the distribution it was drawn from, (B,): at
    the temperature, truncated to what the rule keeps and renormalised (greedy: log softmax(logits))."""
    if temperature == 0:
        tok = logits.argmax(-1)
        if return_logprob:
            return tok, torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k > 0 or top_p < 1.0 or min_p > 0:
        logits = logits.masked_fill(~kept_tokens(logits, top_k, top_p, min_p), float("-inf"))
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
    tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    if return_logprob:
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    return tok


def _next_logits(model, input_ids, attention_mask, position_ids, cache, kw):
    """(B, T) ids through the model with a KV cache -> (B, V) logits of the token after them."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 cache=cache, use_cache=True, **kw).logits[:, -1]


def _next_token(model, input_ids, attention_mask, position_ids, cache, kw, u, draw):
    """The tool loop's decode step: the forward (_next_logits), then a token per row drawn from its
    logits (sample_token with the knobs `draw`, from the uniforms u, None when greedy). Returns the
    tokens (B,), their log-probs (B,) and a flag: some row's logits were non-finite."""
    logits = _next_logits(model, input_ids, attention_mask, position_ids, cache=cache, kw=kw)
    nonfinite = torch.zeros((), dtype=torch.bool, device=logits.device)
    tok, logp = sample_token(logits, u=u, bad=nonfinite, return_logprob=True, **draw)
    return tok, logp, nonfinite


def _next_token_unfused(*args, **kwargs):
    """_next_token with attention as matmul -> softmax -> matmul (SDPA's math backend), which
    inductor fuses on CPU: faster than the CPU flash kernel (bench/results/sampler-*.json)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return _next_token(*args, **kwargs)


def _draws(uniforms, generator, temperature, B, device):
    """fn(columns) -> the tool loop's uniforms of a decode step's draw: uniforms' column of each row
    (columns: an int, or (B,) per row), or B drawn from `generator` as sample_token would draw them;
    None when greedy (no draw)."""
    if temperature == 0:
        return lambda columns: None
    if uniforms is None:
        return lambda columns: torch.rand((B, 1), dtype=torch.float64, device=device, generator=generator)
    return lambda columns: (uniforms[:, columns] if isinstance(columns, int) else
                            uniforms.gather(1, columns[:, None]).squeeze(1))


def _decode(model, rows, cache, kw, draw, pad_id, logits=None):
    """generate's decode step, all on the device: the forward of every row's last token (or the
    prefill's `logits`, for the first), a token per row drawn from the uniforms of its column (greedy
    at temperature 0), a done row's token replaced by pad, and everything recorded in `rows` in place:
    the token, its log-prob under the distribution it was drawn from, done (a token in rows.stops),
    the next feed and position, the column. Compiled, the forward, the draw and this bookkeeping are
    one graph: nothing runs outside it a token."""
    if logits is None:
        logits = _next_logits(model, rows.tok[:, None], rows.attn if kw.get("prompts") is None else None,
                              rows.pos[:, None], cache=cache, kw=kw)  # (B, V)
    u = rows.u.index_select(1, rows.col) if draw["temperature"] else None  # (B, 1)
    tok, logp = sample_token(logits, u=u, bad=rows.bad, return_logprob=True, **draw)
    tok = tok.masked_fill(rows.done, pad_id)
    rows.ids.index_copy_(1, rows.col, tok[:, None])
    rows.logps.index_copy_(1, rows.col, logp[:, None])
    rows.done.logical_or_(torch.isin(tok, rows.stops))
    rows.tok.copy_(tok)
    rows.pos.add_(1)
    rows.col.add_(1)


def _decode_unfused(*args, **kwargs):
    """_decode with attention as SDPA's math backend, which inductor fuses on CPU (_next_token_unfused)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return _decode(*args, **kwargs)


GPU_CHECK_EVERY = 8  # decode steps between host reads ("all stopped?", the calls) on a GPU: a read drains its queue
_compiled = {}  # (function, GPU path) -> its torch.compile, made once; dynamo keeps a graph per model and shape


def _gpu(device):
    """Whether decoding on `device` takes the GPU's path: CUDA graphs, a host read every
    GPU_CHECK_EVERY steps, every row's own copy of its prompt (tests take it on the CPU)."""
    return device.type == "cuda"


def _compile(fn, gpu):
    """torch.compile of a decode step. On a GPU a CUDA graph ("reduce-overhead": one replay for the
    hundreds of kernel launches of a token, reading the static cache and Rows in place); on CPU its
    graph's wrapper in C++ (cpp_wrapper: its Python cost ~6% of a step), attention as SDPA's math
    backend (the *_unfused twins)."""
    if gpu:
        return torch.compile(fn, dynamic=False, mode="reduce-overhead")
    return torch.compile({_decode: _decode_unfused, _next_token: _next_token_unfused}[fn], dynamic=False,
                         options={"cpp_wrapper": True})


def _step_fn(fn, compile, device):
    """The decode step `fn` (_decode, or the tool loop's _next_token): eager, or compiled (_compile)."""
    if not compile:
        return fn
    key = (fn, _gpu(device))
    if key not in _compiled:
        _compiled[key] = _compile(fn, _gpu(device))
    return _compiled[key]


def _skip_guards(step):
    """Entered after a rollout's first compiled decode step, left at its end: dynamo's guards
    unchecked. They check that a compiled graph fits its inputs (the model, the cache, shapes and
    dtypes), which stay the same through a rollout, and cost ~1 ms a step on CPU, ~10% of the tiny
    model's (`python -m bench rollout`). The first step checks them (and compiles if none fits); the next
    steps run the graph it chose (set_stance's skip_guard_eval_unsafe); the next rollout checks them
    again. Once the step has dynamo's recompile_limit graphs (shapes), a new shape's first step runs
    eagerly, leaving no graph to skip to (dynamo would raise): the guards stay on."""
    code = getattr(getattr(step, "_torchdynamo_orig_callable", None), "__code__", None)
    if code is not None and (len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
                             < torch._dynamo.config.recompile_limit):
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, temperature=1.0, top_k=0,
             top_p=1.0, stop_ids=(), generator=None, compile=False, uniforms=None, return_logprobs=False, min_p=0.0,
             check_every=None, reserve=(0, 0)):
    """Sample responses to left-padded prompts (greedy output equals model.generate's; under FSDP
    call it inside `unsharded`). Random numbers: `uniforms` (B, >= max_new_tokens), column t for
    token t, or `generator`. Returns ids (B, R) right-padded with pad_id and a mask (B, R), 1 up to
    and including the first stop id, R <= max_new_tokens; return_logprobs: also each token's
    log-prob under the distribution it was drawn from (the behaviour policy: at the temperature,
    truncated by top_k / top_p / min_p and renormalised, sample_token), from the sampler's own logits.
    Against model.generate (`python -m bench rollout`): 1. each distinct prompt is prefilled once, its keys
    and values copied to its G repeats (compiled on CPU, where the rows come in runs of a prompt as
    GRPO's groups do: kept once, read by shared_prompt.attention); 2. a static cache written in
    place, "all stopped?" read every check_every tokens (None: 8 on a GPU, where a read drains the
    queue, else 1), its only host sync (tests/test_dispatch.py); 3. compile=True: the decode step
    (_decode: forward, draw and bookkeeping) compiled, on CUDA replayed as a CUDA graph, from a copy of
    the model that decodes lean (_decoder), over a cache held through the run (DecodeCache, at least
    `reserve` = (rows, slots) from the first call: one graph per batch shape), its guards checked once
    a call (_skip_guards)."""
    device = prompt_ids.device
    kw = dict(logits_to_keep=1) if common._accepts(model, "logits_to_keep") else {}
    B, n = prompt_ids.shape[0], max_new_tokens
    # 1. prefill
    logits, cache, rows, prompts = _prefill(model, prompt_ids, prompt_mask, n, compile=compile, kw=kw,
                                            reserve=reserve)
    if prompts is not None:
        kw = {**kw, "prompts": prompts}
    if temperature and uniforms is None:  # the generator's draws, a column a token (as B at a time would come)
        uniforms = torch.rand((n, B), generator=generator, dtype=torch.float64, device=device).T
    rows.start(prompt_mask, None if uniforms is None else uniforms.to(device), pad_id, (eos_id, *stop_ids),
               shared=prompts is not None)

    # 2. decode; slots of the static cache past the current token are hidden by the causal mask
    step = _step_fn(_decode, compile, device)
    decoder = kv_cache.decoder(model) if compile else model
    check_every = check_every or (GPU_CHECK_EVERY if _gpu(device) else 1)
    draw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    with contextlib.ExitStack() as rollout, shared_prompt.decoding(decoder, prompts is not None):
        _decode(decoder, rows, cache, kw, draw=draw, pad_id=pad_id, logits=logits)  # token 0, from the prefill's logits
        for t in range(1, n):
            if t % check_every == 0 and bool(rows.done.all()):  # the loop's one host read
                break
            if compile and _gpu(device):  # each step's outputs are read before the next replay overwrites them
                torch.compiler.cudagraph_mark_step_begin()
            step(decoder, rows, cache, kw, draw=draw, pad_id=pad_id)
            if t == 1 and compile:  # the graph is chosen for the call: the next steps skip its guards
                rollout.enter_context(_skip_guards(step))
    if rows.bad:
        raise RuntimeError(NAN_LOGITS)
    ids, mask = rows.response(n)
    R = int(mask.any(0).sum())  # the longest response: its columns are the first R
    if return_logprobs:
        return ids[:, :R], mask[:, :R], rows.logps[:, :R] * mask[:, :R]
    return ids[:, :R], mask[:, :R]


def _prefill(model, prompt_ids, prompt_mask, max_new_tokens, compile, kw, reserve=(0, 0)):
    """generate's step 1: each distinct prompt prefilled once. Returns the (B, V) logits of each row's
    first response token, a static cache, its Rows (their attention mask over the cache's slots) and
    shared_prompt.PromptKV or None. Either each row gets a copy of its prompt's keys and values in a
    cache of L >= P + max_new_tokens slots, or, compiled on CPU where the rows come in runs of equal
    prompts (shared_prompt.runs), each prompt's keys and values stay stored once (PromptKV, read by
    shared_prompt.attention) and the cache holds the responses' slots only. Not on CUDA: under its
    graphs that paid on one of three shapes (docs/gpu.md)."""
    B, P = prompt_ids.shape
    share = compile and not _gpu(prompt_ids.device)
    G = shared_prompt.runs(model, prompt_ids, prompt_mask) if share else 0
    if G:
        return _prefill_shared(model, prompt_ids[::G], prompt_mask[::G], G, max_new_tokens, compile=compile, kw=kw,
                               reserve=reserve)
    L = P + max_new_tokens  # slots it needs; compiled, the held cache's (DecodeCache: >= L, rounded up)
    uniq, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    dedup = len(uniq) < B
    ids, mask = (uniq[:, :P], uniq[:, P:]) if dedup else (prompt_ids, prompt_mask)
    if not kv_cache.static_layers(model):  # sliding-window layers: prefill into a fresh static cache, then reorder it
        cache = StaticCache(config=model.config, max_cache_len=L)
        logits = _next_logits(model, ids, mask, common.position_ids_from_mask(mask), cache=cache, kw=kw)  # (U, V)
        if dedup:
            cache.reorder_cache(inverse)
        rows = kv_cache.Rows(B, L, L, prompt_ids.device)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True,
                    **kw)
        logits = out.logits[:, -1]  # (U, V)
        cache, rows, L = kv_cache.decode_cache(model, B, L, out.cache, persistent=compile, reserve=reserve)  # L >= P + new
        kv_cache.fill_cache(cache, out.cache, inverse if dedup else None, P)
        del out
    if dedup:
        logits = logits.index_select(0, inverse)  # (B, V)
    return logits, cache, rows, None


def _prefill_shared(model, ids, mask, G, max_new_tokens, compile, kw, reserve=(0, 0)):
    """_prefill of U distinct prompts, each for G consecutive rows, kept once each (PromptKV),
    left-padded to a rounded length under compile so that nearby prompt lengths share a graph; the
    static cache: B = U x G rows of max_new_tokens response slots or more (compiled: the held cache's), from slot 0."""
    P, B = ids.shape[1], ids.shape[0] * G
    if compile:
        pad = kv_cache.rounded(P) - P
        ids, mask = torch.nn.functional.pad(ids, (pad, 0)), torch.nn.functional.pad(mask, (pad, 0))
    out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True, **kw)
    cache, rows, S = kv_cache.decode_cache(model, B, max_new_tokens, out.cache, persistent=compile, reserve=(reserve[0], 0))
    for layer in cache.layers:
        layer.cumulative_length.fill_(0)
    prompts = shared_prompt.PromptKV([layer.keys for layer in out.cache.layers],
                                     [layer.values for layer in out.cache.layers], mask.bool(), cache)
    return out.logits[:, -1].repeat_interleave(G, 0), cache, rows, prompts


# -----------------------------------------------------------------------------
# tool calls inside a rollout (grpo.py --tools): the sampler stops a row at the closing tag of a
# call, the tool runs on the text the row wrote since the last opening tag (the calls of one turn at
# once, in the tool's worker processes: tools.call_tools), its result goes in as tokens of a result
# tag pair, and the row continues from its exact tokens (what the model wrote is never
# re-tokenised), until it ends its turn, has made max_calls calls, or has max_new_tokens response
# tokens in all. The result's tokens come back masked (`tool_mask`): no log-prob, no loss, no KL, no
# importance ratio of the policy's is taken on them. Under FSDP, inside `common.evaluating(model,
# gather=True)` like generate: no collective runs while decoding, so ranks whose rows call the tool
# a different number of times never wait for each other.


def tool_steps(max_new_tokens, max_calls, check_every):
    """generate_with_tools' decode steps at most, its cache's slots past the prompt: a row writes
    max_new_tokens tokens at most, and waits fewer than check_every steps for each call's result."""
    return max_new_tokens + max_calls * (check_every - 1)


@torch.no_grad()
def generate_with_tools(model, prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, tokenizer, tool,
                        stop_ids=(), max_calls=2, uniforms=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                        generator=None, compile=False, check_every=None, reserve=(0, 0)):
    """generate with tool calls: returns ids (B, R), mask (B, R) of every response token (the
    model's and the tools'), the model's log-probs (B, R) (0 on tool tokens) and tool_mask (B, R) (1
    on tool tokens; a call's count: tool_calls(tool_mask)). uniforms (B, >= max_new_tokens): column
    n for response token n, whichever step writes it, so a row samples the same on any number of
    ranks. One decode loop for every row, as nanochat's engine feeds a tool's output (its
    forced_tokens): a row that closes a call is fed its result's tokens, one a step, while the
    other rows sample theirs, so the loop runs as many steps as the longest row has tokens (a turn
    per call would run each turn's longest row in turn: 65 decode steps against 47 on
    the tool-calling rollout of `python -m bench steps --model calculator`) and no token is fed twice. The calls closed since the last check
    run on the host at the check (every step on CPU, every 8 on a GPU, as generate reads "all
    stopped?"): a calling row waits idle until then, its slots masked, its positions and random
    numbers its own tokens' (so the waiting changes nothing), and the cache has a slot per step:
    P + max_new_tokens + max_calls x 7 on a GPU. check_every: that period (None: 8 on a GPU, else 1)."""
    close = tools.closing_tag_id(tokenizer)
    (B, P), device, R = prompt_ids.shape, prompt_ids.device, max_new_tokens
    kw = dict(logits_to_keep=1) if common._accepts(model, "logits_to_keep") else {}
    stops = torch.tensor([eos_id, *stop_ids], device=device)
    uniforms = None if uniforms is None else uniforms.to(device)
    check_every = check_every or (GPU_CHECK_EVERY if _gpu(device) else 1)
    n_steps = tool_steps(R, max_calls, check_every)
    # 1. prefill
    logits, cache, rows, prompts = _prefill(model, prompt_ids, prompt_mask, n_steps, compile=compile, kw=kw,
                                            reserve=reserve)
    rows.start(prompt_mask, None, pad_id, (eos_id, *stop_ids), shared=prompts is not None)
    mask, first = rows.attn, P  # the attention mask over the cache's slots; `first`: the first response slot
    if prompts is not None:  # shared_prompt.attention reads the responses' slots from this mask, set in place
        kw, first = {**kw, "prompts": prompts}, 0
        mask = prompts.response_mask = torch.zeros(B, cache.layers[0].max_cache_len, dtype=torch.long, device=device)

    # 2. decode: each step a token per row, sampled, or its result's next token where it is in one
    step = _step_fn(_next_token, compile, device)
    decoder = kv_cache.decoder(model) if compile else model
    graphs = compile and _gpu(device)
    pos = prompt_mask.sum(-1)  # (B,) position of the first response token
    ids = torch.full((B, R + 1), pad_id, dtype=torch.long, device=device)  # column R: the idle rows' writes
    logps = torch.zeros((B, R + 1), dtype=torch.float, device=device)
    tool_mask = torch.zeros((B, R + 1), dtype=torch.long, device=device)
    n = torch.zeros(B, dtype=torch.long, device=device)  # (B,) each row's response tokens so far
    calls = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    waiting = torch.zeros(B, dtype=torch.bool, device=device)  # a call closed, its result not yet in `forced`
    forced = torch.full((B, R), pad_id, dtype=torch.long, device=device)  # each row's last result, fed from f_at
    f_at, f_len = torch.zeros(B, dtype=torch.long, device=device), torch.zeros(B, dtype=torch.long, device=device)
    bad = torch.zeros((), dtype=torch.bool, device=device)  # any row with non-finite logits
    draw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    u = _draws(uniforms, generator, temperature, B, device)
    tok, logp = sample_token(logits, u=u(n), bad=bad, return_logprob=True, **draw)  # a row's draw: its token's column
    with contextlib.ExitStack() as rollout, shared_prompt.decoding(decoder, prompts is not None):
        for t in range(n_steps):
            forcing = f_at < f_len  # (B,) in a result: its next token is taken, not sampled
            tok = torch.where(forcing, forced.gather(1, f_at.clamp(max=R - 1)[:, None]).squeeze(1), tok)
            going = ~(done | waiting)  # the rows that write a token this step
            at = torch.where(going, n, R)[:, None]  # (B, 1)
            ids.scatter_(1, at, tok[:, None])
            logps.scatter_(1, at, logp.masked_fill(forcing, 0.0)[:, None])
            tool_mask.scatter_(1, at, forcing.long()[:, None])
            mask[:, first + t] = ~waiting  # a waiting row's slot empty; a finished row's pad seen (by itself), as generate's
            fed_pos = pos + n.clamp(max=R - 1)  # (B,) the fed token's position (a finished row's: within range)
            sampled = going & ~forcing
            closed = sampled & (tok == close)
            n = n + going
            f_at = f_at + (going & forcing)
            call = closed & (calls < max_calls) & (n < R)  # a call it may make, with room for its result
            calls = calls + call
            waiting = waiting | call
            done = done | (sampled & torch.isin(tok, stops)) | (closed & ~call) | (n >= R)
            finished = calling = False
            if t % check_every == check_every - 1:
                finished, calling = torch.stack([done.all(), waiting.any()]).tolist()  # one host sync
            if finished or t == n_steps - 1:
                break
            if graphs:  # each step's logits are read before the next replay overwrites them
                torch.compiler.cudagraph_mark_step_begin()
            tok, logp, nonfinite = step(decoder, tok.masked_fill(~going, pad_id)[:, None],
                                        None if prompts is not None else mask, fed_pos[:, None],
                                        cache=cache, kw=kw, u=u(n.clamp(max=R - 1)), draw=draw)
            bad |= nonfinite
            if t == 0 and compile:  # the graph is chosen for the rollout: the next steps skip its guards
                rollout.enter_context(_skip_guards(step))
            if calling:  # 3. the calls: run on the host, their results queued for the rows to feed
                rows = waiting.nonzero().squeeze(1)
                have, is_tool, lengths = ids[rows].tolist(), tool_mask[rows].tolist(), n[rows].tolist()
                written = [[x for x, m in zip(r[:k], tl[:k]) if not m] for r, tl, k in zip(have, is_tool, lengths)]
                results = tools.results_tokens(tokenizer, written, tool, [R - k for k in lengths])
                r_ids, r_mask = common.pad(results, pad_id)  # (A, F), F <= R
                forced[rows, :r_ids.shape[1]] = r_ids.to(device)
                f_at, f_len = f_at.index_fill(0, rows, 0), f_len.index_copy(0, rows, r_mask.sum(1).to(device))
                waiting = waiting.index_fill(0, rows, False)
    if bad:
        raise RuntimeError(NAN_LOGITS)
    width = int(n.max())  # the longest response
    own = (torch.arange(width, device=device) < n[:, None]).long()  # (B, width)
    return ids[:, :width], own, logps[:, :width], tool_mask[:, :width]


def tool_calls(tool_mask):
    """The calls each row made, (B,): its runs of tool tokens (a result follows every call)."""
    return (tool_mask.diff(dim=1, prepend=tool_mask[:, :1] * 0) == 1).sum(-1)


# -----------------------------------------------------------------------------
# text in, text out: prompts and responses as token ids (with the truncation rules every script
# shares) and back, the stop ids of a model, its responses to prompts, greedy answers scored by a rule


def added_tokens(tokenizer):
    """The ids a tokenizer's post-processor puts before and after every text: Llama and Gemma
    ([bos], []), some SentencePiece set-ups ([bos], [eos]), GPT-2 and Qwen ([], []). Found by
    tokenizing a probe with and without special tokens."""
    full = tokenizer("a b")["input_ids"]
    body = tokenizer("a b", add_special_tokens=False)["input_ids"]
    at = next((i for i in range(len(full) - len(body) + 1) if full[i:i + len(body)] == body), None)
    return ([], []) if at is None else (full[:at], full[at + len(body):])


def encode_prompts(tokenizer, texts, max_len, source="prompts"):
    """Token ids of each prompt, with the special tokens the tokenizer adds in front (BOS) but
    not those it adds at the end (an EOS there would sit between prompt and response), and no
    second BOS when the text holds one already (a rendered chat template). An over-long prompt
    keeps those leading tokens and its last tokens (the end of a prompt is what the response
    follows). Returns (ids, cut): cut[i] says prompt i was cut. A prompt of no tokens is refused:
    the first response token would have no position to be predicted from."""
    head, _ = added_tokens(tokenizer)
    ids = [x if x[:len(head)] == head else head + x
           for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    empty = sum(len(x) == 0 for x in ids)
    if empty:
        raise ValueError(f"{source}: {empty} of {len(ids)} prompts are empty (no tokens): the first response token "
                         f"needs a token before it. Give every row a prompt, or use a tokenizer that adds a BOS token")
    cut = [len(x) > max_len for x in ids]
    keep = len(head) if max_len > len(head) else 0
    return [x if len(x) <= max_len else x[:keep] + x[len(x) - max_len + keep:] for x in ids], cut


def encode_responses(tokenizer, texts, max_len, eos=True):
    """Token ids of each response followed by EOS (not for rendered chat turns, eos=False: they
    end with the template's end-of-turn tokens); an over-long one keeps its first max_len
    tokens (and so loses its end). Returns (ids, number truncated)."""
    end = [tokenizer.eos_token_id] if eos else []
    ids = [x + end for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    n_cut = sum(len(x) > max_len for x in ids)
    return [x[:max_len] for x in ids], n_cut


def decode_responses(tokenizer, response_ids, response_mask, prompt_ids=None):
    """Text of each response, without stop tokens or padding, as it continues its prompt: decoded
    after the prompt's last token (left padding: its last column) and that token's text cut off,
    since a SentencePiece decoder drops the leading space of a text alone (" 19" -> "19")."""
    ids, mask = response_ids.tolist(), response_mask.tolist()
    last = prompt_ids[:, -1].tolist() if prompt_ids is not None else [None] * len(ids)
    texts = []
    for row, keep, p in zip(ids, mask, last):
        r = [t for t, m in zip(row, keep) if m]
        head = tokenizer.decode([p], skip_special_tokens=True) if p is not None else ""
        joint = tokenizer.decode([p] + r, skip_special_tokens=True) if head else ""
        texts.append(joint[len(head):] if head and joint.startswith(head) else
                     tokenizer.decode(r, skip_special_tokens=True))
    return texts


def stop_token_ids(tokenizer, model, truncate_token=""):
    """The ids that end a response, as model.generate stops: EOS, then every id of the generation
    config's eos_token_id (instruct models list end of turn and end of text), then a truncate
    token (a string of one token: grpo.py's --truncate_token) last."""
    ids = [tokenizer.eos_token_id]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if i not in ids:
            ids.append(i)
    if truncate_token:
        t_ids = tokenizer(truncate_token, add_special_tokens=False)["input_ids"]
        if len(t_ids) != 1:
            raise ValueError(f"--truncate_token {truncate_token!r} is {len(t_ids)} tokens; it must be one")
        ids += t_ids
    return ids


def respond(model, tokenizer, prompts, max_prompt_len, max_new_tokens, stops, device, temperature=0.0,
            uniforms=None, tool=None, max_tool_calls=2, compile=False, reserve=(0, 0)):
    """The model's responses to text prompts (a chat already rendered), as text, sampled until one
    of `stops` (stop_token_ids); temperature 0 is greedy, uniforms the rows' draws. With a `tool`
    (tools.load_tool), the calls it makes run (py) and the text holds their results."""
    p_ids, p_mask = common.pad(encode_prompts(tokenizer, prompts, max_prompt_len)[0], tokenizer.pad_token_id,
                               side="left")
    kw = dict(eos_id=stops[0], pad_id=tokenizer.pad_token_id, temperature=temperature, stop_ids=stops[1:],
              uniforms=uniforms, compile=compile, reserve=reserve)
    if tool is None:
        r_ids, r_mask = generate(model, p_ids.to(device), p_mask.to(device), max_new_tokens, **kw)
    else:
        r_ids, r_mask, _, _ = generate_with_tools(model, p_ids.to(device), p_mask.to(device), max_new_tokens,
                                                               tokenizer=tokenizer, tool=tool, max_calls=max_tool_calls, **kw)
    return decode_responses(tokenizer, r_ids, r_mask, p_ids)


def evaluate_generations(model, tokenizer, prompts, reward_fn, d, max_prompt_len, max_new_tokens, batch_size=256,
                         answers=None, own_prompts=None, tool=None, max_tool_calls=2, compile=False, reserve=(0, 0)):
    """Greedy answers to held-out prompts (text, a chat already rendered), scored by a gold reward
    fn(prompt, completion, answer) of tasks.REWARD_FNS, given each row's own prompt (`own_prompts`:
    the messages of a conversational row; default `prompts`) and its `answers` where the rule
    needs one: mean reward and the share of exact answers (reward 1). `tool`: grpo.py's --tools
    (tools.load_tool), whose calls run as in its rollouts."""
    own_prompts = prompts if own_prompts is None else own_prompts

    def score(rows):
        texts = [prompts[i] for i in rows]
        refs = [answers[i] for i in rows] if answers is not None else [None] * len(rows)
        with common.autocast(d):
            replies = respond(model, tokenizer, texts, max_prompt_len=max_prompt_len,
                                   max_new_tokens=max_new_tokens, stops=stops, device=d.device, tool=tool,
                                   max_tool_calls=max_tool_calls, compile=compile, reserve=reserve)
        rewards = [reward_fn(own_prompts[i], c, a) for i, c, a in zip(rows, replies, refs)]
        return torch.tensor([[r, float(r == 1.0)] for r in rewards], dtype=torch.float64, device=d.device)

    stops = stop_token_ids(tokenizer, model)
    with common.evaluating(model, gather=True):
        r = common.map_rows(score, len(prompts), d, batch_size)  # (n, 2)
    gold, exact = r.mean(0).tolist()
    return {"eval/gold_reward": gold, "eval/exact_match": exact}
