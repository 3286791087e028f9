"""Expected peak memory per device of each script, phase by phase, from a model's shape and the
script's own flags (its Config's defaults unless given).

    python -m bench memory --model llama-3-8b --world 8 --max_prompt_len 512 --max_new_tokens 1024
    python -m bench memory --model path/to/config.json --world 1 --launcher python --script grpo
    python -m bench memory --table      # what fits 1 and 8 80-GB GPUs: GPT-2 large, Qwen2.5-1.5B, Llama-3-8B
    python -m bench memory --table --readme   # the README's shorter table
    python tests/memory_trace.py --check  # the model against the scripts' own step on fake tensors
    python -m bench memory --validate   # the CPU model against the peaks measured here (bench/results)

The tables are written as bench/results/memory-cpu-{table,readme}.json too (`python -m bench report`
renders them); `python -m bench steps` draws the model's peak beside each measured one.

Every term, phase by phase, is listed in docs/distributed.md ("What the model counts") and beside
its line below; tests/test_memory_model.py checks the GPU model against each script's own step traced
on fake tensors (tests/memory_trace.py), and `--validate` the CPU model against measured peaks.
"""
import argparse
import ast
import dataclasses
import json
import os
import sys

import transformers

from bench import harness

ROOT = harness.ROOT
GIB = 2**30

SHAPES = {  # layers, hidden, heads, kv heads, MLP width, vocabulary, tied embeddings, gated MLP, learned positions
    "gpt2": dict(L=12, h=768, heads=12, kv_heads=12, I=3072, V=50257, tied=True, gated=False, pos=1024),
    "gpt2-large": dict(L=36, h=1280, heads=20, kv_heads=20, I=5120, V=50257, tied=True, gated=False, pos=1024),
    "qwen2.5-1.5b": dict(L=28, h=1536, heads=12, kv_heads=2, I=8960, V=151936, tied=True, gated=True, pos=0),
    "llama-3-8b": dict(L=32, h=4096, heads=32, kv_heads=8, I=14336, V=128256, tied=False, gated=True, pos=0),
}


def shape_of(name):
    """A built-in shape, or a Hugging Face config.json (GPT-2 or Llama-style names)."""
    if name in SHAPES:
        return SHAPES[name]
    with open(name) as f:
        c = json.load(f)
    h = c.get("hidden_size", c.get("n_embd"))
    heads = c.get("num_attention_heads", c.get("n_head"))
    gated = c.get("model_type") not in ("gpt2", "gpt_neox", "opt")
    return dict(L=c.get("num_hidden_layers", c.get("n_layer")), h=h, heads=heads,
                kv_heads=c.get("num_key_value_heads", heads),
                I=c.get("intermediate_size") or c.get("n_inner") or 4 * h, V=c["vocab_size"],
                tied=c.get("tie_word_embeddings", True), gated=gated,
                pos=c.get("n_positions", 0) if c.get("model_type") == "gpt2" else 0)


def n_params(s):
    """(all parameters, one block's, the root's: embeddings, positions, final norm, untied head)."""
    kv = s["kv_heads"] * s["h"] // s["heads"]
    block = 2 * s["h"] * s["h"] + 2 * s["h"] * kv + (3 if s["gated"] else 2) * s["h"] * s["I"] + 4 * s["h"]
    root = s["V"] * s["h"] * (1 if s["tied"] else 2) + s["pos"] * s["h"] + 2 * s["h"]
    return s["L"] * block + root, block, root


def parts(s, script, world=1, launcher="torchrun", device="gpu", seqs=4, prompt_len=512, response_len=512,
          rollout_rows=64, ac=False, offload_frozen=False, lora=False, precompute_ref=True, reward_model=True,
          generation_rows=0, reference=True, shared=0):
    """Bytes per device of each phase's parts, {phase: {part: bytes}}. seqs: sequences of one
    micro-batch (DPO and the reward model: pairs, two sequences each); rollout_rows: GRPO's
    completions per rank in one rollout; generation_rows: the rows of one call of its sampler (0:
    all rollout_rows); shared: the distinct prompts of the update's micro-batch where shared_prompt
    computes each once (0: it does not)."""
    N, n_block, n_root = n_params(s)
    fsdp = launcher == "torchrun"
    W = world if fsdp else 1
    e = 2 if device == "gpu" else 4  # activations: bf16 autocast / FSDP bf16 on a GPU, fp32 on the CPU
    kv = s["kv_heads"] * s["h"] // s["heads"]
    S, R = prompt_len + response_len, response_len
    parts = {}
    if lora:  # the frozen fp32 base (sharded under torchrun); the adapters are small
        parts["parameters"] = 4 * N / W
    else:
        parts["parameters"] = 4 * N / W
        parts["gradients"] = 4 * N / W
        parts["optimizer"] = 8 * N / W
    if fsdp:
        # the root, 2 blocks and a block's unsharded gradients, in bf16 on a GPU (fp32 on the CPU)
        parts["gathered (FSDP)"] = e * (n_root + 3 * n_block)
    frozen_bytes = 0 if offload_frozen else (2 * N / W if fsdp and device == "gpu" else 4 * N / W)
    if not lora and (script == "dpo" and not precompute_ref or script == "grpo" and reference):  # LoRA's: adapters off
        parts["reference"] = frozen_bytes
    if script == "grpo" and reward_model:
        parts["reward model"] = frozen_bytes
    seq_factor = 2 if script in ("dpo", "reward") else 1
    tokens = seqs * seq_factor * S
    if device == "cpu":  # fp32; the CPU's math attention keeps its probabilities
        per_token_layer = e * (6 * s["h"] + 2 * kv + (4 if s["gated"] else 2) * s["I"])
        probs = 4 * s["heads"] * S
    else:  # bf16 (see the docstring); autocast keeps its fp32 norms' inputs and one bf16 cast per linear
        h_bytes = (34 if s["gated"] else 20) if not fsdp else (24 if s["gated"] else 16)
        per_token_layer = h_bytes * s["h"] + (8 if s["gated"] else 10) * s["I"]
        probs = 4 * s["heads"] + 2 * S  # flash attention's log-sum-exp, and the padding mask as a bf16 bias
    if ac:  # each block's input, one block recomputed; at the backward's end, a tied embedding's dense gradient
        # (V x h, fp32) made apart from the head's already in .grad, then added to it
        parts["activations"] = tokens * (s["L"] * e * s["h"] + per_token_layer + probs)
        if s["tied"] and script != "reward":
            parts["embedding gradient"] = 4 * s["V"] * s["h"]
    elif shared:  # shared_prompt: U sequences of a prompt and its rows' responses, Ls tokens each, under an Ls x Ls mask
        Ls = prompt_len + -(-seqs * seq_factor // shared) * response_len
        parts["activations"] = shared * Ls * s["L"] * (per_token_layer + 4 * s["heads"] * Ls)
    else:
        parts["activations"] = tokens * s["L"] * (per_token_layer + probs)
    if script != "reward":  # the fused head's chunks (lm_head._HeadLogprobs): a few fp32 copies of one chunk's logits
        parts["logits"] = head_logits(seqs * seq_factor * R, s["V"], device, grad=True)
    phases = {"update": parts}
    if script == "grpo":
        roll = {k: v for k, v in parts.items() if k not in ("gradients", "activations", "logits")}
        if fsdp:
            roll["gathered (FSDP)"] = e * N  # the whole policy, gathered for the rollout (common.unsharded)
        rows = generation_rows or rollout_rows  # one call of the sampler (environment.sample's chunks)
        roll["KV cache"] = rows * S * s["L"] * 2 * kv * e
        roll["logits"] = 4 * rows * s["V"]
        phases["rollout"] = roll
    return phases


def lora_params(s, r=16):
    """LoRA's adapter parameters (models.add_lora, all-linear: every linear of every block, r x (in + out)
    each; reward.py's score head, trained whole beside them, is h more: left out)."""
    kv = s["kv_heads"] * s["h"] // s["heads"]
    h, I = s["h"], s["I"]
    # q, k, v, o, gate, up, down; GPT-2: c_attn, c_proj, c_fc, c_proj
    per_block = 9 * h + 2 * kv + 3 * I if s["gated"] else 8 * h + 2 * I
    return s["L"] * r * per_block


def gpu_parts(s, script, world=1, launcher="torchrun", seqs=4, prompt_len=512, response_len=512, rollout_rows=64,
              prompts=8, grad_accum=1, ac=False, offload_frozen=False, lora=False, lora_r=16, precompute_ref=True,
              reward_model=True, teacher=False, compile=False, tools=0, generation_rows=0, shared=(0, 0), reference=True,
              old_pass=True):
    """Bytes per GPU of each phase's parts, {phase: {part: bytes}}, bf16 compute (FSDP2's
    MixedPrecisionPolicy under torchrun, autocast under `python`). seqs: sequences of one
    micro-batch (DPO and the reward model: both sequences of each pair); rollout_rows: GRPO's
    completions sampled per rank (--rs_samples of each of its `prompts`, else group_size);
    generation_rows: the rows of one call of its sampler (0: all rollout_rows), a chunk of
    consecutive rows whose groups are contiguous; tools: the calls a row may make (--max_tool_calls
    with --tools; 0: no tool); shared: the distinct prompts of a micro-batch of the update (DPO: of its
    forward) and of one of GRPO's reference pass where shared_prompt computes each once (0: it does not).
    reference: GRPO loads a reference and makes its pass (beta > 0, or --reference; TRL's beta 0: none);
    old_pass: GRPO makes the old policy's pass (several updates a rollout, or a teacher)."""
    N, n_block, n_root = n_params(s)
    fsdp = launcher == "torchrun"
    W = world if fsdp else 1
    h, V, L, I = s["h"], s["V"], s["L"], s["I"]
    head = 0 if s["tied"] else V * h  # what a sequence-classification model lacks (its score head: h)
    if script == "reward":
        N, n_root = N - head, n_root - head
    kv = s["kv_heads"] * h // s["heads"]
    S, R = prompt_len + response_len, response_len
    linear = 2 * h * h + 2 * h * kv + (3 if s["gated"] else 2) * h * I  # a block's linear weights
    # LoRA: the base frozen in fp32, sharded under torchrun as the model it is; gradients and AdamW's moments of
    # the adapters alone; dpo.py's and grpo.py's reference is the policy with its adapters off: no copy
    trained = (lora_params(s, lora_r) if lora else N) / W
    state = {"parameters": 4 * N / W + (4 * trained if lora else 0), "optimizer": 8 * trained}
    frozen = 0 if offload_frozen and fsdp else 2 * N / W if fsdp else 4 * N
    if not lora and (script == "dpo" and not precompute_ref or script == "grpo" and reference):
        state["reference"] = frozen
    if script == "grpo" and reward_model:
        state["reward model"] = frozen * (N - head) / N
    if script == "grpo" and teacher:  # the policy's shape (environment.make_env: models.load_frozen, like the reference)
        state["teacher"] = frozen
    # bf16 weights for compute: FSDP2 gathers the root (embeddings, head; kept until the backward)
    # and two blocks (one computing, one prefetched); autocast caches a bf16 copy of every weight a
    # block's linears use (FP32Head computes in fp32 from the fp32 weight: no copy). A frozen weight
    # (LoRA's base) is cast anew by each op instead, and kept only where the backward needs it
    weights = {"gathered (FSDP)": 2 * (n_root + 2 * n_block)} if fsdp else {"autocast copies": 2 * L * n_block}
    # the rollout's and the log-prob passes': LoRA's frozen base swapped for a bf16 copy made once for the block
    # (environment.frozen_in_bf16; the rollout's not with --compile, which decodes from the decoder copies)
    no_grad_weights = {"bf16 base (cast once)": 2 * L * linear} if lora else weights
    # GRPO --compile: one static KV cache per model kept between rollouts (kv_cache.decode_cache) and,
    # under autocast, bf16 copies of the linear weights kept for the compiled decode (sampling._decoder)
    # bf16 keys and values in the sampler's static cache (sampling._CastingLayer); in a prefill's or a forward's
    # own cache under autocast a RoPE model's keys stay fp32 (its fp32 residual stream makes cos and sin fp32,
    # and q * cos with them)
    kv_bytes = kv * (6 if not fsdp and not s["pos"] else 4)
    # the sampler's call: the distinct prompts prefilled once into a cache of P + R slots; with --tools
    # (sampling.generate_with_tools) the same cache, continued to the end, with 7 slots more per call a row may
    # make (max_tool_calls): the steps a calling row waits for the host to read its call, every 8 on a GPU
    # --generation_micro_batch_size: one chunk of `rows` rows at a time, its distinct prompts at most those
    # of `rows` consecutive rows (a group's rows are consecutive, and a chunk may cut one at either end)
    rows = min(generation_rows or rollout_rows, rollout_rows)
    group = rollout_rows // max(prompts, 1)
    chunk_prompts = min(prompts, -(-(rows - 1) // max(group, 1)) + 1)
    slots = cache_slots(S + 7 * tools, compile)
    cache = rows * slots * L * kv * 4
    kept = {}
    if script == "grpo" and lora and ac:  # transformers makes the embeddings' output a leaf that requires grad;
        # grpo.py's last loss (and log-probs) keep their graph's nodes, and so it and its gradient, to the next update
        kept["last micro-batch's input embeddings"] = 8 * seqs * S * h
    if script == "grpo" and compile:
        kept["compiled KV cache"] = cache
        # sampling._decoder: under autocast bf16 copies of the linear weights and the head; under FSDP2 a
        # gathered bf16 copy of the whole model, outside FSDP
        kept["bf16 decoder copies"] = 2 * N if fsdp else 2 * (L * linear + V * h)
    state_kept = dict(state, **kept)

    # forward and backward of one micro-batch, at the start of the backward
    tokens = seqs * S
    per_token_layer = ((24 if fsdp else 34) if s["gated"] else (16 if fsdp else 20)) * h \
        + (8 if s["gated"] else 10) * I + 4 * s["heads"] + 2 * S
    if lora:  # measured: frozen RMSNorm weights keep no fp32 normalised input (-8h); LoRA's A keeps its own bf16
        # cast of its input, one more than the full model (+2h), and each adapter its r-wide output
        per_token_layer += (-6 * h if s["gated"] else 2 * h) + 2 * lora_r * (7 if s["gated"] else 4)
    fb = dict(state_kept, **weights)  # LoRA: the bf16 base weights autograd saves for the input's gradient
    if grad_accum > 1:
        fb["gradients"] = 4 * trained  # the earlier micro-batches', reduce-scattered
    logits = logits_end = 0  # at the backward's start, and at the forward's end
    if script != "reward":  # the fused head (lm_head._HeadLogprobs): chunks of 2^26 logits, never all of them; the
        # backward's start: a chunk recomputed, its softmax and gradient, and W's fp32 gradient
        logits = head_logits(seqs * R, V, "gpu", grad=True) + (0 if lora else 4 * V * h)  # W's gradient, fp32
        logits_end = head_logits(seqs * R, V, "gpu")
    # FSDP2: the root's gradients (the head's) are made first in the backward and wait for its end, unsharded
    head = {"head gradient (FSDP)": 2 * V * h} if fsdp and script != "reward" and not lora else {}
    if not ac and shared[0]:  # shared_prompt: U sequences of a prompt and its rows' responses (g slots of R), every
        # token under a 4-D mask over its sequence's Ls keys (a bf16 bias of Ls a query, as the padded one's S)
        U = shared[0]
        Ls = prompt_len + -(-seqs // U) * R
        fb["activations"] = L * U * Ls * (per_token_layer - 2 * S + 2 * Ls) + U * Ls * Ls
        tokens = U * Ls  # what the forward computes
    elif not ac:
        fb["activations"] = tokens * L * per_token_layer
    # LoRA, inside a block's backward (the logits freed): each adapter's own gradients beside the frozen path's, the
    # scaled output's and the second input's, two of the MLP's I-wide a token (fitted to the tracker: 7.5-8.6 I bytes
    # under autocast on the three shapes); the peak of reward.py, which has no logits to free first
    adapters = (4 if fsdp else 8) * I * tokens if lora else 0
    if not ac:
        start, end = dict(head, logits=logits), {"logits": logits_end}
        block = {"adapters' gradients (a block's backward)": adapters}
    else:  # each block's input (bf16 under FSDP, fp32 under autocast), then the largest of: the logits and
        # their gradient (the backward's start), one block recomputed, autocast's copies (the forward's end)
        fb.pop("autocast copies", None)
        fb["activations"] = tokens * (2 if fsdp else 4) * h * L
        start = dict(head, **{"largest transient": max(logits, tokens * per_token_layer + adapters)})
        end, block = {"largest transient": logits_end + no_grad_weights.get("autocast copies", 0)}, {}
    fb.update(max(start, end, block, key=lambda parts: sum(parts.values())))
    phases = {"forward and backward": fb}
    phases["optimizer step"] = dict(state_kept, gradients=4 * trained)
    if script != "grpo":
        return phases

    # GRPO: the rollout, the reward model over the rank's rollout, the reference's, old and teacher's log-probs
    rollout_weights = {} if lora and compile else no_grad_weights
    roll = dict(state, **({"gathered (FSDP)": 2 * N} if fsdp else rollout_weights), **kept)  # common.unsharded
    roll["KV cache"] = roll.pop("compiled KV cache", cache)
    # the prefill's own cache of each prompt while the static cache is filled; its forward's largest moment
    # (one layer's MLP and a few hidden states for every token, the constant c fitted to tests/memory_trace.py:
    # GPT-2's Python GELU and autocast's fp32 residual stream keep more) comes before the static cache is
    # made, unless --compile kept it
    roll["prefill cache"] = chunk_prompts * prompt_len * L * kv_bytes
    c = (17 if s["gated"] else 31) if not fsdp else (6 if s["gated"] else 21)
    transients = chunk_prompts * prompt_len * (6 * I + c * h)
    roll["prefill forward"] = transients if compile else max(0, transients - cache)
    # then, filling the static cache (kv_cache.fill_cache: k[inverse]), one layer's prompt keys and values
    # gathered for every row at a time beside the whole cache and the prefill's, or the decode's fp32 logits
    fill = rows * prompt_len * kv_bytes if chunk_prompts < rows else 0
    roll["cache fill or logits"] = max(fill, 4 * rows * V)
    phases["rollout"] = roll
    if reward_model:  # no graph, over every sampled row (environment.learned_rewards); the same transients
        rm = dict(state_kept)
        rm["reward model forward"] = rollout_rows * S * (6 * I + c * h)
        if fsdp:
            rm["gathered (FSDP)"] = 2 * (n_root + 2 * n_block)
        phases["reward model"] = rm
    ref = dict(state_kept, **no_grad_weights)  # the reference's, then the policy's (autocast caches the policy's only)
    # one micro-batch at a time without a graph: the larger of a layer's transients (as the prefill's: 6 I + c h a
    # token, of the padded rows or of shared_prompt's U sequences) and the fused head's chunk
    U = shared[1]
    Ls = prompt_len + -(-seqs // U) * R if U else 0  # a shared sequence's length, its 4-D mask U Ls^2 bools
    ref_tokens = U * Ls if U else seqs * S
    ref["forward"] = max(ref_tokens * (6 * I + c * h), head_logits(seqs * R, V, "gpu")) + U * Ls * Ls
    if reference or old_pass:  # neither pass at beta 0 with one update a rollout (TRL's defaults)
        phases["reference and old log-probs"] = ref
    if teacher:  # frozen: under autocast each op casts a weight anew, none cached
        phases["teacher log-probs"] = dict(state_kept, **(weights if fsdp else {}), forward=ref["forward"])
    return phases


def head_logits(tokens, V, device, grad=False):
    """The fused head's fp32 transients (lm_head._HeadLogprobs): one chunk of min(tokens, 2^26 / V) rows
    (2^22 on a CPU) of logits, its log-softmax and their product for the entropy (3 copies); with a
    gradient, the backward's recomputed chunk, its softmax (the gradient, in place) and the entropy's
    log-softmax and its exp (4 copies)."""
    rows = min(tokens, max(1, (2**26 if device == "gpu" else 2**22) // V))
    return (4 if grad else 3) * 4 * rows * V


def chunk_rows(n, size):
    """The rows of the largest of environment.chunks(n, size): n rows cut into ceil(n / size)
    chunks as even as possible (0: one of all n)."""
    return -(-n // -(-n // size)) if size else n


def cache_slots(L, compile=False):
    """The slots of the static KV cache sampling.generate makes for L tokens: under --compile
    rounded up to a multiple of L/8 to L/4, so that nearby lengths share a compiled graph."""
    if not compile:
        return L
    q = max(8, 2 ** (L.bit_length() - 3))
    return -(-L // q) * q


def hf_config(s):
    """The transformers config of a shape (GPT-2 or, gated, Llama-style; Qwen2 where the
    embeddings are tied and the MLP gated, for its biases)."""
    if not s["gated"]:
        return transformers.GPT2Config(n_layer=s["L"], n_embd=s["h"], n_head=s["heads"], vocab_size=s["V"],
                                       n_positions=s["pos"], n_inner=s["I"])
    kind = transformers.Qwen2Config if s["tied"] else transformers.LlamaConfig
    return kind(num_hidden_layers=s["L"], hidden_size=s["h"], num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"], intermediate_size=s["I"], vocab_size=s["V"],
                tie_word_embeddings=s["tied"])


def script_config(script, **flags):
    """The script's Config at its defaults, with flags (its own names; max_response_len and
    max_new_tokens both name the response length) in place of them. The flags a run fills from
    the model named (lr and the token limits, cli.fill_defaults) take the values of a model of
    your own: TRL's (GRPO: 512 prompt and 512 completion tokens)."""
    Config = harness.SCRIPTS[script].Config
    names = {f.name for f in dataclasses.fields(Config)}
    alias = {"max_response_len": "max_new_tokens"} if script == "grpo" else {"max_new_tokens": "max_response_len"}
    flags = {alias.get(k, k): v for k, v in flags.items()}
    unknown = sorted(k for k in flags if k not in names and k not in SCRIPT_ONLY)
    if unknown:
        raise ValueError(f"{script}.py has no flag(s) {', '.join('--' + k for k in unknown)}")
    return Config(**{**Config.DEFAULTS["trl"], **{k: v for k, v in flags.items() if k in names}})


SCRIPT_ONLY = {"prompts_per_step", "group_size", "num_mini_batches", "reward_model", "lora", "precompute_ref",
               "batch_size", "compile", "teacher", "rs_samples", "tools", "generation_micro_batch_size"}  # other scripts' flags: ignored


def as_on_a_gpu(cfg, launcher):
    """cfg with each `auto` speed flag as a GPU run resolves it (plumbing/speed.py): --compile, but not
    under torchrun with LoRA; the layouts, which it times, counted as the one that holds more: prompts
    shared and rows packed wherever they can be."""
    auto = {"compile": launcher == "python" or not getattr(cfg, "lora", False), "shared_prompt": True,
            "padding_free": True}
    return dataclasses.replace(cfg, **{k: v for k, v in auto.items() if getattr(cfg, k, None) == "auto"})


def parse_flags(argv):
    """["--max_new_tokens", "1024", ...] -> {"max_new_tokens": 1024, ...}, typed by the scripts' Configs."""
    if len(argv) % 2 or not all(a.startswith("--") for a in argv[::2]):
        raise ValueError(f"expected --flag value pairs, got {argv}")
    out = {}
    for k, v in zip(argv[::2], argv[1::2]):
        try:
            out[k[2:]] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k[2:]] = v
    return out


def estimate(s, script, world=1, launcher="torchrun", device="gpu", ac=False, offload_frozen=False, **flags):
    """{phase: {part: bytes}} of `script` at its Config's defaults, overridden by flags (as on its
    command line: max_prompt_len, max_response_len or max_new_tokens, batch_size, grad_accum, ...)."""
    cfg = as_on_a_gpu(script_config(script, **flags), launcher)
    W = world if launcher == "torchrun" else 1
    if script == "grpo":
        prompts = cfg.prompts_per_step // W
        rows = prompts * cfg.group_size
        seqs, R = rows // cfg.num_mini_batches // cfg.grad_accum, cfg.max_new_tokens
        rollout_rows = prompts * (cfg.rs_samples or cfg.group_size)
        generation_rows = chunk_rows(rollout_rows, cfg.generation_micro_batch_size)
    else:
        prompts, rollout_rows, generation_rows = 0, 0, 0
        seqs, R = cfg.batch_size // W // cfg.grad_accum, cfg.max_response_len
    knobs = dict(seqs=seqs, prompt_len=cfg.max_prompt_len, response_len=R, rollout_rows=rollout_rows,
                 generation_rows=generation_rows, ac=ac, offload_frozen=offload_frozen, lora=cfg.lora,
                 precompute_ref=getattr(cfg, "precompute_ref", True), reward_model=bool(getattr(cfg, "reward_model", "")),
                 reference=script == "grpo" and bool(cfg.beta or cfg.reference))
    # shared_prompt (one process, no activation checkpointing): the distinct prompts of a forward. GRPO's update: a
    # group's G rows dealt G / K to each of K mini-batches (grpo.minibatch_rows), consecutive there; its reference
    # pass: G consecutive rows; DPO: a pair's two rows. Full-length rows: wherever rows share one, sharing computes less
    U = (0, 0)
    if W == 1 and not ac and getattr(cfg, "shared_prompt", False) and script in ("grpo", "dpo"):
        dealt = max(1, cfg.group_size // cfg.num_mini_batches) if script == "grpo" else 1  # DPO: seqs counts pairs here
        U = [-(-seqs // dealt), -(-seqs // cfg.group_size) if script == "grpo" else 0]
        U = tuple(u if u < seqs * (1 + (script == "dpo")) else 0 for u in U)
    if device == "cpu":  # the CPU model counts pairs; the GPU model sequences (both of each pair)
        return parts(s, script, world, launcher, device, shared=U[0], **knobs)
    knobs["seqs"] *= 2 if script in ("dpo", "reward") else 1
    knobs["shared"] = U if any(U) else (0, 0)
    old_pass = script == "grpo" and (cfg.num_iterations > 1 or cfg.num_mini_batches > 1 or bool(cfg.teacher))
    return gpu_parts(s, script, world, launcher, grad_accum=cfg.grad_accum, prompts=prompts, old_pass=old_pass,
                     lora_r=cfg.lora_r, teacher=bool(getattr(cfg, "teacher", "")),
                     compile=getattr(cfg, "compile", False), tools=cfg.max_tool_calls if getattr(cfg, "tools", "") else 0,
                     **knobs)


def total(phases, device):
    """(peak bytes, the phase it is in); on the CPU with the process's own 0.45 GiB."""
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    return sum(phases[phase].values()) + (0.45 * GIB if device == "cpu" else 0), phase


def fits(peak, gpu_gib=80):
    """The verdict on a GPU: the estimate + 10% fragmentation + 1 GiB of CUDA context."""
    return peak * 1.1 + GIB <= gpu_gib * GIB


VALIDATE = ("steps-cpu-all", "steps-cpu-large-b2", "steps-cpu-large-b4")  # results of `python -m bench steps`


def validate(names=VALIDATE):
    """Estimate against every CPU peak measured on GPT-2's shapes in these results files (our scripts
    under `python`, fp32), with and without --activation_checkpointing: (largest error, the table)."""
    rows, worst = [], 0.0
    for name in names:
        with open(os.path.join(harness.RESULTS, name + ".json")) as f:
            res = json.load(f)
        for m in res["measurements"]:
            if m["model"] not in ("gpt2-small-random", "gpt2-large-random"):
                continue
            shape, w = SHAPES[{"gpt2-small-random": "gpt2", "gpt2-large-random": "gpt2-large"}[m["model"]]], m["workload"]
            # the flags the steps command gave the script (bench/steps.ours_argv), its other flags at their defaults
            flags = dict(max_prompt_len=w["prompt_len"], **({"beta": w["beta"]} if w["beta"] is not None else {}),
                         **(dict(prompts_per_step=w["rows"], group_size=w["group_size"], max_new_tokens=w["response_len"])
                            if m["script"] == "grpo" else dict(batch_size=w["rows"], max_response_len=w["response_len"])))
            for variant, x in m["variants"].items():
                ac = "--activation_checkpointing" in variant
                peak, phase = total(estimate(shape, m["script"], 1, "python", "cpu", ac=ac, **flags), "cpu")
                measured = sorted(x["peak_gib"])[len(x["peak_gib"]) // 2]
                err = peak / GIB / measured - 1
                worst = max(worst, abs(err))
                rows.append([name, m["script"], m["model"], w["rows"], ac, phase, f"{peak / GIB:.2f}", f"{measured:.2f}",
                             f"{err:+.0%}"])
    return worst, (["results file", "script", "model", "batch", "act. ckpt", "peak phase", "estimate GiB",
                    "measured GiB", "error"], rows)


LONG = dict(max_prompt_len=512, max_new_tokens=1024)  # the table's long setting: 512-token prompts, 1024-token responses
KNOBS = {1: [("python", {}), ("torchrun", {}), ("torchrun", {"ac": True}),
             ("torchrun", {"ac": True, "offload_frozen": True}),
             ("torchrun", {"ac": True, "offload_frozen": True, "grad_accum": 8}),
             ("python", {"lora": True, "ac": True}), ("python", {"lora": True, "ac": True, "grad_accum": 8})],
         8: [("torchrun", {}), ("torchrun", {"ac": True}), ("torchrun", {"ac": True, "grad_accum": 8}),
             ("torchrun", {"ac": True, "offload_frozen": True, "grad_accum": 8})]}
FLAG_NAMES = {"ac": "--activation_checkpointing", "offload_frozen": "--offload_frozen", "lora": "--lora",
              "grad_accum": "--grad_accum"}
SHORT = {"x8": "", "--activation_checkpointing": "AC", "--offload_frozen": "offload", "--grad_accum": "accum",
         "--lora": "LoRA"}  # the README's table: its columns name the GPUs


def cell(s, script, world, setting, flags, short=False):
    """One cell of the tables: the first rung of KNOBS[world] at which the script fits an 80-GB GPU, at
    the defaults or the long setting, and its peak."""
    if setting == "long" and s["pos"] and s["pos"] < sum(LONG.values()):
        return f"n/a ({s['pos']}-token context)"
    flags = dict(flags, **(LONG if setting == "long" else {}))
    for launcher, knobs in KNOBS[world]:
        extra = {k: v for k, v in knobs.items() if k in ("lora", "grad_accum")}
        peak, _ = total(estimate(s, script, world, launcher, ac=knobs.get("ac", False),
                                 offload_frozen=knobs.get("offload_frozen", False), **flags, **extra), "gpu")
        if fits(peak):
            how = [launcher if world == 1 else f"torchrun x{world}"]
            how += [FLAG_NAMES[k] + (f" {extra[k]}" if k == "grad_accum" else "") for k in knobs]
            how = " ".join(how)
            if short:
                how = " ".join(filter(None, (SHORT.get(w, w) for w in how.split())))
            return f"{how}: {peak / GIB:.0f} GiB"
    return "does not fit"


COLUMNS = [("sft.py", "sft", {}), ("reward.py", "reward", {}), ("dpo.py", "dpo", {}), ("grpo.py", "grpo", {}),
           ("grpo.py + reward model", "grpo", {"reward_model": "rm"}),
           ("grpo.py + teacher (its size)", "grpo", {"teacher": "teacher"})]


def table(readme=False):
    """(header, rows): which flags fit each script on 1 and 8 80-GB GPUs, for three model sizes, at the
    scripts' defaults and at 512 + 1024 tokens. readme: the README's shorter table (Qwen2.5-1.5B and
    Llama-3-8B, dpo.py and grpo.py with a rule reward)."""
    settings = ("defaults", "long")
    if readme:
        return (["model", "script", "1 GPU, defaults", "1 GPU, 512 + 1024", "8 GPUs, defaults", "8 GPUs, 512 + 1024"],
                [[shown, f"{script}.py", *(cell(SHAPES[model], script, world, setting, {}, short=True)
                                          for world in (1, 8) for setting in settings)]
                 for model, shown in (("qwen2.5-1.5b", "Qwen2.5-1.5B"), ("llama-3-8b", "Llama-3-8B"))
                 for script in ("dpo", "grpo")])
    return (["model", "GPUs", "lengths"] + [c[0] for c in COLUMNS],
            [[f"{model} ({n_params(SHAPES[model])[0] / 1e9:.2f}B)", str(world), "defaults" if setting == "defaults"
              else "512 + 1024", *(cell(SHAPES[model], script, world, setting, flags) for _, script, flags in COLUMNS)]
             for model in ("gpt2-large", "qwen2.5-1.5b", "llama-3-8b") for setting in settings for world in (1, 8)])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-large", help=f"one of {sorted(SHAPES)} or a config.json path")
    p.add_argument("--script", default="sft,reward,dpo,grpo")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--launcher", default="torchrun", choices=["python", "torchrun"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--offload_frozen", action="store_true")
    p.add_argument("--validate", action="store_true", help="against the CPU peaks measured here (bench/results)")
    p.add_argument("--table", action="store_true")
    p.add_argument("--readme", action="store_true", help="with --table: the README's shorter table")
    p.add_argument("--results", default=harness.RESULTS, help="where the tables are written")
    args, rest = p.parse_known_args(argv)
    flags = parse_flags(rest)  # any script flag: --max_prompt_len 512 --max_new_tokens 1024 --grad_accum 2 ...
    if args.validate:
        worst, (header, rows) = validate()
        print(harness.markdown(header, rows) + f"\nlargest error {worst:.0%}")
        return 1 if worst > 0.2 else 0
    if args.table:  # printed, and written as bench/results/memory-cpu-{table,readme}.json for the report
        header, rows = table(readme=args.readme)
        print(harness.markdown(header, rows), end="")
        harness.save("memory", harness.torch.device("cpu"), "readme" if args.readme else "table",
                     {"header": header, "rows": rows}, argv=["memory", *argv], folder=args.results)
        return 0
    s = shape_of(args.model)
    print(f"{args.model}: {n_params(s)[0] / 1e9:.3f}B parameters; {args.launcher} on {args.world} {args.device}(s)")
    for script in args.script.split(","):
        phases = estimate(s, script, args.world, args.launcher, args.device, ac=args.activation_checkpointing,
                          offload_frozen=args.offload_frozen, **flags)
        peak, phase = total(phases, args.device)
        verdict = f" ({'fits' if fits(peak) else 'does not fit'} on an 80-GB GPU)" if args.device == "gpu" else ""
        print(f"\n{script}.py: peak {peak / GIB:.2f} GiB in its {phase} phase{verdict}")
        for name, parts_ in phases.items():
            print(f"  {name}: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts_.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
