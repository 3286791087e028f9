"""The sampler's static KV cache and the model it decodes with, kept at fixed addresses through a
run so that a compiled decode step's CUDA graphs replay them: DecodeCache (the cache of the largest
call, its layers in the compute dtype, a view per batch shape with that shape's Rows, the per-row state
of a decode loop) and decoder (a copy of the model that decodes lean: decode_attention's GQA without
copies, bf16 weights under autocast, outside FSDP under torchrun). sampling.py's loops use them.
"""
import copy
import weakref

import torch
import transformers
import transformers.masking_utils
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lm_head


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
            and not getattr(config, "attn_logit_softcapping", None) and static_layers(model)
            and all(type(m).__module__.startswith("transformers.models.") for m in model.modules()
                    if hasattr(m, "layer_idx")))


def _linear_weights(model):
    return [m.weight for m in model.modules() if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"]


_DECODERS = weakref.WeakKeyDictionary()  # model -> (the module the compiled step runs, [(its tensor, the model's)])


def decoder(model):
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
    if bf16 and isinstance(head, lm_head.FP32Head) and head.bias is None:  # its own bf16 weight: a tied embedding stays fp32
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
    if isinstance(model.get_output_embeddings(), lm_head.FP32Head):
        decoder.get_output_embeddings().__class__ = lm_head.FP32Head
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


def static_layers(model):
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


def decode_cache(model, B, L, like, persistent, reserve=(0, 0)):
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
        slots = max(rounded(L), reserve[1], held.slots if held else 0)  # nearby lengths share a graph
        del held
        _DECODE_CACHES[model] = held = DecodeCache(model, rows, slots, layout)
    cache, rows = held.view(B)
    return cache, rows, held.slots


def fill_cache(cache, prefill, inverse, P):
    """Copy the prefill's keys and values (U distinct prompts, P tokens) into slots [0, P) of the
    static cache, row i taking prompt inverse[i]; in place, so the cache keeps its addresses."""
    for dst, src in zip(cache.layers, prefill.layers):
        k, v = (src.keys, src.values) if inverse is None else (src.keys.index_select(0, inverse),
                                                               src.values.index_select(0, inverse))
        dst.keys[:, :, :P].copy_(k)
        dst.values[:, :, :P].copy_(v)
        dst.cumulative_length.fill_(P)
        del k, v  # before the next layer's are made: one layer's copies at a time


def rounded(n):
    """n rounded up to a multiple of n/8 to n/4 (54 -> 56, 300 -> 320): nearby lengths share a compiled graph."""
    q = max(8, 2 ** (n.bit_length() - 3))
    return -(-n // q) * q
