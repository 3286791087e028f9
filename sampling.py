"""The sampler: a lean KV-cached loop for rollouts and greedy evaluation (what
model.generate() does, minus its per-step overhead), shared by grpo.py, reward.py's
normalisation and every script's evaluation. Its speed against model.generate:
bench/sampler.py; its correctness: tests/test_sampler.py.
"""
import contextlib
import copy
import functools
import hashlib
import weakref

import torch
import transformers
from torch.distributed.fsdp import FSDPModule
import transformers.masking_utils
from transformers import AutoModelForCausalLM, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import common
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
    GPU, as common.logprobs_from_logits chunks); the gradient flows through the kept logits.
    labels (...): tokens kept whatever the rule says (the trainer's replay: a sampled token its own
    logits would drop, where they differ from the sampler's, keeps a finite log-prob, as prime-rl's
    replay keeps its labels)."""
    logits = logits.float()
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])
        rows = common._chunk_rows(flat, None)
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
    vocabulary entry, slow on CPU (bench/sampler.py). Non-finite logits raise, or with `bad` (a
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


class Rows:
    """What generate's decode loop keeps of each row, on the device: the token it feeds next and that
    token's position, done rows, the non-finite flag, the column written next (a tensor, so that a
    compiled step reads it without recompiling), the draws' uniforms, the attention mask over the
    cache's slots, and the response so far: ids and log-probs, (B, W) each. Compiled, one Rows per
    batch shape lives beside its cache view (DecodeCache) at fixed addresses that the step updates in
    place, so that a CUDA graph replays it with no input to copy; eager, one a call."""

    def __init__(self, B, W, L, device):
        def zeros(dtype, *shape):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tok, self.pos, self.col = zeros(torch.long, B), zeros(torch.long, B), zeros(torch.long, 1)
        self.done, self.bad = zeros(torch.bool, B), zeros(torch.bool)
        self.u, self.attn = zeros(torch.float64, B, W), zeros(torch.long, B, L)
        self.ids, self.logps, self.stops = zeros(torch.long, B, W), zeros(torch.float, B, W), None

    def tensors(self):
        return [self.tok, self.pos, self.col, self.done, self.bad, self.u, self.attn, self.ids, self.logps]

    def start(self, prompt_mask, uniforms, pad_id, stops, shared=False):
        """In place, for a new call: nothing written, each row's first response position, the uniforms'
        first columns, the stop ids, the attention mask: the prompt's real tokens, then every slot (the
        causal mask hides those past the token fed; shared: no mask, the cache holds the responses'
        slots only)."""
        P = prompt_mask.shape[1]
        self.tok.fill_(pad_id), self.col.zero_(), self.done.zero_(), self.bad.zero_()
        self.pos.copy_(prompt_mask.sum(-1) - 1)  # _decode adds 1 before the first token is fed
        self.ids.fill_(pad_id), self.logps.zero_()
        self.stops = torch.tensor(stops, device=self.tok.device)
        if uniforms is not None:
            k = min(uniforms.shape[1], self.u.shape[1])
            self.u[:, :k].copy_(uniforms[:, :k])
        if not shared:
            self.attn[:, :P].copy_(prompt_mask)
            self.attn[:, P:].fill_(1)

    def response(self, n):
        """The first n columns' ids and their mask: 1 up to and including each row's first stop id."""
        ids = self.ids[:, :n]
        stop = torch.isin(ids, self.stops).long()
        return ids.clone(), (stop.cumsum(-1) - stop == 0).long()  # clones: Rows are the next call's


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
    model's (bench/sampler.py). The first step checks them (and compiles if none fits); the next
    steps run the graph it chose (set_stance's skip_guard_eval_unsafe); the next rollout checks them
    again. Once the step has dynamo's recompile_limit graphs (shapes), a new shape's first step runs
    eagerly, leaving no graph to skip to (dynamo would raise): the guards stay on."""
    code = getattr(getattr(step, "_torchdynamo_orig_callable", None), "__code__", None)
    if code is not None and (len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
                             < torch._dynamo.config.recompile_limit):
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


# -----------------------------------------------------------------------------
# what the compiled step reads: a copy of the model that decodes lean, a cache held through the run


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one new token per row over a static cache, as transformers' SDPA path runs it in
    eager mode (pack_gqa): the r query heads that share a key/value head go as r rows of one query,
    (B, H_kv, r, D), so that the cache is read once as it is. Under torch.compile transformers takes
    repeat_kv instead, a copy of every layer's whole cache at the query heads' count each token (3x for
    SmolLM2, 7x for Qwen2.5-0.5B). The query in the cache's dtype: under bf16 autocast RoPE's fp32
    cos/sin make it fp32. attention_mask: sdpa_mask's, (B, 1, 1, S) bool or None. Several query tokens
    (a prefill): transformers' SDPA attention."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout or kwargs.get("softcap") or kwargs.get("sliding_window") or "s_aux" in kwargs:
        raise ValueError("sampling.decode_attention: no dropout, softcapping, sliding window or attention sinks")
    (B, H, _, D), Hkv = query.shape, key.shape[1]
    q = query.to(key.dtype).reshape(B, Hkv, H // Hkv, D)  # (B, H_kv, r, D): a view, heads in GQA's order
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2), None  # (B, 1, H, D), as transformers' attention functions return it


transformers.AttentionInterface.register("decode", decode_attention)
transformers.masking_utils.AttentionMaskInterface.register("decode", transformers.masking_utils.sdpa_mask)


def _lean_attention(model):
    """Whether decode_attention may stand in for the model's attention: SDPA or eager without
    softcapping, in transformers' own modules of a text model (which look their attention function up
    by the config's name), every layer full attention (shared_prompt.runs' conditions)."""
    config = model.config.get_text_config()
    return (config is model.config and config._attn_implementation in ("sdpa", "eager")
            and not getattr(config, "attn_logit_softcapping", None) and _static_layers(model)
            and all(type(m).__module__.startswith("transformers.models.") for m in model.modules()
                    if hasattr(m, "layer_idx")))


def _linear_weights(model):
    return [m.weight for m in model.modules() if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"]


_DECODERS = weakref.WeakKeyDictionary()  # model -> (the module the compiled step runs, [(its tensor, the model's)])


def _decoder(model):
    """What the compiled decode step runs: a copy of the model whose attention is decode_attention,
    refreshed from the model in place at each call, so that its addresses stay those its CUDA graphs
    were recorded with. Under torchrun (FSDP2, inside common.unsharded) a copy outside FSDP, whose
    hooks would cut the step into a graph per block and whose gathered weights move between rollouts:
    every weight and buffer copied from the gathered ones (bf16 under FSDP's MixedPrecisionPolicy: 2
    bytes a weight held through the run). Under bf16 autocast (one GPU, `python`), bf16 copies of the
    linear weights and the head (inside a graph autocast would cast every weight on every token: its
    cast cache serves eager code only), the embeddings and norms the model's own, so that the residual
    stream is autocast's. Otherwise the model's own tensors, shared."""
    if model not in _DECODERS:
        _DECODERS[model] = _fsdp_copy(model) if _is_fsdp(model) else _autocast_copy(model)
    decoder, pairs = _DECODERS[model]
    with torch.no_grad():
        for dst, src in pairs:
            if hasattr(src, "full_tensor"):
                raise RuntimeError("sampling.generate(compile=True) under FSDP runs inside common.unsharded(model)")
            dst.copy_(src)
    return decoder


def _is_fsdp(model):
    return isinstance(model, FSDPModule)


def _autocast_copy(model):
    bf16 = torch.is_autocast_enabled(next(model.parameters()).device.type)
    head = model.get_output_embeddings()
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}  # shared, not copied
    pairs = []
    if bf16:
        for w in _linear_weights(model):
            memo[id(w)] = torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
            pairs.append((memo[id(w)], w))
    decoder = copy.deepcopy(model, memo)
    for m in decoder.modules():  # a compiled block's forward (common.compile_blocks) is bound to the model's block
        vars(m).pop("forward", None)
    if bf16 and isinstance(head, common.FP32Head) and head.bias is None:  # its own bf16 weight: a tied embedding stays fp32
        w = torch.nn.Parameter(head.weight.detach().to(torch.bfloat16), requires_grad=False)
        decoder.get_output_embeddings().weight = w
        pairs.append((w, head.weight))
    if _lean_attention(model):
        decoder.config._attn_implementation = "decode"
    return decoder.eval(), pairs


def _fsdp_copy(model):
    params = dict(model.named_parameters())
    with torch.device("meta"):
        decoder = AutoModelForCausalLM.from_config(copy.deepcopy(model.config))
    dtype, device = next(iter(params.values())).dtype, next(iter(params.values())).device
    made = {}  # meta tensor -> its empty one on the device (tied weights: one)
    for m in decoder.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
            setattr(m, name, made[id(p)])
        for name, b in list(m.named_buffers(recurse=False)):
            m.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device),
                              persistent=name not in m._non_persistent_buffers_set)
    if isinstance(model.get_output_embeddings(), common.FP32Head):
        decoder.get_output_embeddings().__class__ = common.FP32Head
    mine = dict(decoder.named_parameters())
    if mine.keys() != params.keys():
        raise ValueError(f"sampling: compiled decoding under torchrun copies the model outside FSDP, but a "
                         f"{type(decoder).__name__} built from its config has other weights (LoRA's adapters, remote "
                         f"code?): run without --compile")
    buffers = dict(model.named_buffers())
    pairs = [(mine[k], params[k]) for k in mine] + [(b, buffers[k]) for k, b in decoder.named_buffers()]
    if _lean_attention(decoder):
        decoder.config._attn_implementation = "decode"
    return decoder.eval(), pairs


def compilable_under_fsdp(model):
    """Whether _decoder can copy this model outside FSDP (plumbing/speed.py's `auto` under torchrun): a
    causal LM of transformers' own code, without adapters."""
    return not hasattr(model, "peft_config") and any(c.__module__.startswith("transformers.models.")
                                                     for c in type(model).__mro__)


def _static_layers(model):
    """Every layer of the model's static cache a full-attention StaticLayer (none a sliding window's)."""
    return all(type(layer) is StaticLayer for layer in StaticCache(config=model.config, max_cache_len=1).layers)


class _CastingLayer(StaticLayer):
    """A static cache layer that stores keys and values in its own dtype whatever the attention hands
    it: the compute dtype (bf16 under autocast), where RoPE's fp32 cos/sin make the keys fp32 beside
    bf16 values, and a cache of fp32 keys would be cast whole at every step, in every layer."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args, **kwargs)


class DecodeCache:
    """A static KV cache of `rows` rows and `slots` slots, its layers laid out like a prefill's cache
    (heads, head sizes) in the compute dtype, and each batch shape's view of it: (cache of its first B
    rows at the full cache's addresses, Rows). Compiled decoding keeps one per model for the whole run
    (`reserve` sizes it from the flags at its first call: every rollout and evaluation of the run fits),
    so that each shape the step is compiled for keeps the addresses its CUDA graph was recorded with
    (cudagraph trees re-record at every decode step where a static input moved: 63 times in a 64-token
    rollout on an H200, docs/gpu.md), and is held once, not once per shape."""

    def __init__(self, model, rows, slots, layout):
        self.rows, self.slots, self.layout, self.views = rows, slots, layout, {}
        self.full = StaticCache(config=model.config, max_cache_len=slots)
        for layer, (dtype, device, h_kv, d_k, d_v) in zip(self.full.layers, layout):  # (rows, heads, slots, head size) each
            layer.__class__ = _CastingLayer
            layer.lazy_initialization(torch.empty(rows, h_kv, 0, d_k, dtype=dtype, device=device),
                                      torch.empty(rows, h_kv, 0, d_v, dtype=dtype, device=device))

    def view(self, B):
        """The cache of the first B rows, at the full cache's addresses, and its Rows."""
        if B not in self.views:
            view = copy.copy(self.full)
            view.layers = [copy.copy(layer) for layer in self.full.layers]
            for layer in view.layers:
                layer.batch_size, layer.keys, layer.values = B, layer.keys[:B], layer.values[:B]
                torch._dynamo.mark_static_address(layer.keys)  # as StaticLayer marks its own: read in place by a graph
                torch._dynamo.mark_static_address(layer.values)
            rows = Rows(B, self.slots, self.slots, self.full.layers[0].keys.device)
            for t in rows.tensors():
                torch._dynamo.mark_static_address(t)
            self.views[B] = view, rows
        return self.views[B]


_DECODE_CACHES = weakref.WeakKeyDictionary()  # model -> DecodeCache (compiled decoding)


def _decode_cache(model, B, L, like, persistent, reserve=(0, 0)):
    """(cache, Rows, slots): a static KV cache of B rows and L or more slots, laid out like `like`'s
    layers (the prefill's cache) in the compute dtype (autocast's, else the values'), and the Rows of a
    decode loop. persistent (compiled decoding): the model's DecodeCache, made at the first call with
    at least `reserve` (rows, slots) and never shrunk; a call that needs more (one the reservation did
    not foresee) replaces it, and every graph recorded on the old one goes with it
    (torch.compiler.reset(): the CUDA graph trees shut down and dynamo's entries dropped; an entry kept
    would run its shape's graph on the dead trees, "Running CUDAGraph after shutdown" on an H200):
    each shape compiles and records once more."""
    device = like.layers[0].keys.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
        like.layers[0].values.dtype
    layout = [(dtype, device, x.keys.shape[1], x.keys.shape[-1], x.values.shape[-1]) for x in like.layers]
    if not persistent:
        cache = DecodeCache(model, B, L, layout)
        return cache.full, Rows(B, L, L, device), L
    held = _DECODE_CACHES.get(model)
    if held is None or B > held.rows or L > held.slots or layout != held.layout:
        if held is not None:  # the old one goes before a new one is made, with every graph recorded on it
            held.views.clear()
            torch.compiler.reset()
        rows = max(B, reserve[0], held.rows if held else 0)
        slots = max(_rounded(L), reserve[1], held.slots if held else 0)  # nearby lengths share a graph
        del held
        _DECODE_CACHES[model] = held = DecodeCache(model, rows, slots, layout)
    cache, rows = held.view(B)
    return cache, rows, held.slots


def _fill_cache(cache, prefill, inverse, P):
    """Copy the prefill's keys and values (U distinct prompts, P tokens) into slots [0, P) of the
    static cache, row i taking prompt inverse[i]; in place, so the cache keeps its addresses."""
    for dst, src in zip(cache.layers, prefill.layers):
        k, v = (src.keys, src.values) if inverse is None else (src.keys.index_select(0, inverse),
                                                               src.values.index_select(0, inverse))
        dst.keys[:, :, :P].copy_(k)
        dst.values[:, :, :P].copy_(v)
        dst.cumulative_length.fill_(P)
        del k, v  # before the next layer's are made: one layer's copies at a time


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
    Against model.generate (bench/sampler.py): 1. each distinct prompt is prefilled once, its keys
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
    decoder = _decoder(model) if compile else model
    check_every = check_every or (GPU_CHECK_EVERY if _gpu(device) else 1)
    draw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    with contextlib.ExitStack() as rollout, shared_prompt.decoding(decoder, prompts is not None):
        _decode(decoder, rows, cache, kw, draw, pad_id, logits=logits)  # token 0, from the prefill's logits
        for t in range(1, n):
            if t % check_every == 0 and bool(rows.done.all()):  # the loop's one host read
                break
            if compile and _gpu(device):  # each step's outputs are read before the next replay overwrites them
                torch.compiler.cudagraph_mark_step_begin()
            step(decoder, rows, cache, kw, draw, pad_id)
            if t == 1 and compile:  # the graph is chosen for the call: the next steps skip its guards
                rollout.enter_context(_skip_guards(step))
    if rows.bad:
        raise RuntimeError(NAN_LOGITS)
    ids, mask = rows.response(n)
    R = int(mask.any(0).sum())  # the longest response: its columns are the first R
    if return_logprobs:
        return ids[:, :R], mask[:, :R], rows.logps[:, :R] * mask[:, :R]
    return ids[:, :R], mask[:, :R]


def _rounded(n):
    """n rounded up to a multiple of n/8 to n/4 (54 -> 56, 300 -> 320): nearby lengths share a compiled graph."""
    q = max(8, 2 ** (n.bit_length() - 3))
    return -(-n // q) * q


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
    if not _static_layers(model):  # sliding-window layers: prefill into a fresh static cache, then reorder it
        cache = StaticCache(config=model.config, max_cache_len=L)
        logits = _next_logits(model, ids, mask, common.position_ids_from_mask(mask), cache=cache, kw=kw)  # (U, V)
        if dedup:
            cache.reorder_cache(inverse)
        rows = Rows(B, L, L, prompt_ids.device)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True,
                    **kw)
        logits = out.logits[:, -1]  # (U, V)
        cache, rows, L = _decode_cache(model, B, L, out.cache, persistent=compile, reserve=reserve)  # L >= P + new
        _fill_cache(cache, out.cache, inverse if dedup else None, P)
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
        pad = _rounded(P) - P
        ids, mask = torch.nn.functional.pad(ids, (pad, 0)), torch.nn.functional.pad(mask, (pad, 0))
    out = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask), use_cache=True, **kw)
    cache, rows, S = _decode_cache(model, B, max_new_tokens, out.cache, persistent=compile, reserve=(reserve[0], 0))
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
    bench/tool_step.py's rollout) and no token is fed twice. The calls closed since the last check
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
    decoder = _decoder(model) if compile else model
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
