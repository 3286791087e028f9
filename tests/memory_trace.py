"""Peak memory per GPU of each script's step, measured without a GPU: the scripts' own functions
(common.shard_model, response_logprobs, the losses, backward, optimizer_step; grpo.py's reference,
teacher and update passes and dpo.py's forwards, sharing prompts as the scripts do (shared_prompt; `_shared`
sets what fake tensors cannot say: the rows' prompts and the cut), add_lora and its base cast once (environment.frozen_in_bf16); the
sampler's prefill, cache and bf16 decoder) run on fake tensors (torch's FakeTensorMode: shapes
and dtypes, no storage) under a fake process group of W
ranks, FSDP2 included, and torch's MemTracker (FSDPMemTracker under torchrun) adds up the live
bytes per phase. bench/memory.py's model is checked against it (`check`, tests/test_memory_model.py): a test
oracle, kept beside the tests that use it.

    python tests/memory_trace.py --model llama-3-8b --world 8 --script grpo --max_new_tokens 1024
    python tests/memory_trace.py --model gpt2 --launcher python --script grpo --lora True --tools calculator
    python tests/memory_trace.py --check   # the model, phase by phase, at CHECKS (bench/results/memory-check.md)

A GPU's choices on fake CPU tensors: bf16 compute (FSDP2's MixedPrecisionPolicy, or autocast under
`python`), bf16 frozen models under torchrun, the fp32-output head matmul and log_softmax + gather
(lm_head.on_gpu), and a flash-attention kernel (keeps its output and log-sum-exp, not the
probabilities). Not counted: CUDA's context and the allocator's fragmentation (memory.fits adds
them). A call of the sampler is its prefill and one decode step into the full static cache: the
cache is allocated whole before the first token, so later tokens add only a step's logits. GRPO's
rollout is one call; with --tools (sampling.generate_with_tools: one loop, a call's result fed to
its row token by token) its cache has sampling.tool_steps' slots past the prompt, the waits for the
host a GPU's check period allows.
With --compile the persistent cache and the bf16 decoder copies are sampling's own, kept by it
between steps; the decode step runs uncompiled (the memory is its inputs').
"""
import argparse
import contextlib
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import lm_head  # noqa: E402
from bench import memory  # noqa: E402
import shared_prompt  # noqa: E402

GIB = 2**30


@contextlib.contextmanager
def _as_on_a_gpu(d):
    """The patches that make fake CPU tensors take a GPU's paths (see the module docstring), undone
    on leaving. Under `python` no move to the device (the fake tensors are on it already)."""
    def autocast(d, enabled=True):
        return torch.autocast("cpu", dtype=torch.bfloat16) if enabled and not d.torchrun else contextlib.nullcontext()

    def no_move(model, d, cpu_offload=False, activation_checkpointing=False):
        if activation_checkpointing:  # shard_model's
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        return model

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(lm_head, "on_gpu", lambda t: True))
        stack.enter_context(mock.patch.object(common, "bf16_supported", lambda device: True))
        stack.enter_context(mock.patch.object(common, "autocast", autocast))
        if not d.torchrun:
            stack.enter_context(mock.patch.object(common, "shard_model", no_move))
        stack.enter_context(torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION))
        yield


@contextlib.contextmanager
def _shared(prompt_of):
    """shared_prompt's choices on fake tensors, whose values (and so torch.unique's and the micro-batch
    cut's) are unknown: the rows' prompts as the script's batch has them (prompt_of(i) for the i-th row
    of a forward; full-length rows, where sharing computes less), and micro-batches of rows, the
    shared path's, wherever it can run."""
    def prompts(ids, attn, n_prompt):
        of = [prompt_of(i) for i in range(len(ids))]
        distinct = sorted(set(of))
        first = [of.index(u) for u in distinct]
        inverse = torch.tensor([distinct.index(u) for u in of], device=ids.device)
        return torch.cat([ids[first, :n_prompt], attn[first, :n_prompt]], 1), inverse

    def micro_batches(rows, ids, attn, n_response, rows_per_forward, d, packed=False, models=(), enabled=True,
                      groups=None):
        chunks = common.micro_batches(rows, attn, rows_per_forward, d)
        if not (enabled and shared_prompt._possible(models, 1, d)):
            return chunks, False
        return chunks, [[prompt_of(i) for i in range(len(c))] for c in chunks]

    with mock.patch.object(shared_prompt, "prompts", prompts), \
            mock.patch.object(shared_prompt, "micro_batches", micro_batches):
        yield


def _world(world, launcher):
    """A fake process group of `world` ranks (collectives do nothing) and this rank's Dist."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    torchrun = launcher == "torchrun"
    if torchrun:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    d = common.Dist(rank=0, world_size=world if torchrun else 1, device=torch.device("cpu"), torchrun=torchrun)
    if torchrun:
        d.mesh  # made outside FakeTensorMode (it reads its ranks from a real tensor)
    return d


def _build(shape, kind="causal"):
    """The model transformers builds from the shape's config, as models.load_model leaves it."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = memory.hf_config(shape)
    if kind == "causal":
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.get_output_embeddings().__class__ = lm_head.FP32Head
    else:
        config.num_labels, config.pad_token_id = 1, 0
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _batch(rows, prompt_len, response_len, d):
    """Ids, mask and response mask of `rows` full-length sequences, (rows, P+R), (rows, R)."""
    ids = torch.zeros(rows, prompt_len + response_len, dtype=torch.long, device=d.device)
    return ids, torch.ones_like(ids), torch.ones(rows, response_len, device=d.device)


def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """torch's MemTracker less its per-module statistics (which allow one forward per module
        and step): every tensor's live bytes (FSDP2's all-gathers and storage resizes included),
        and the peak of each `with tracker.phase(name):` block."""

        def __init__(self, *external):
            super().__init__()
            self.track_external(*external)
            self.peaks, self.kinds = {}, {}  # kinds: the peak's bytes by MemTracker's categories

        def _pre_fw_hook(self, *args):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

        @contextlib.contextmanager
        def phase(self, name, measure=True):
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
            yield
            if not measure:  # the first step, before AdamW's moments exist
                return
            snaps = self.get_tracker_snapshot("peak").values()
            peak = sum(snap["Total"] for snap in snaps)
            if peak >= self.peaks.get(name, 0):
                self.peaks[name] = peak
                self.kinds[name] = {k: sum(snap.get(k, 0) for snap in snaps) for snap in snaps for k in snap}

    return Tracker


@contextlib.contextmanager
def _grad_hooks_released():
    """MemTracker's module tracker hooks the gradient of every module input and output that requires
    grad, and the hook and the autograd nodes it watches hold each other: a leaf no backward reaches
    (the embeddings' output, which transformers makes require grad under activation checkpointing,
    in no-grad passes too), or one a backward has reached and its gradient (LoRA's), would outlive
    its step here, never in a run (18 GiB on Qwen2.5-1.5B at 512 + 1024 tokens, LoRA and AC). No hook
    in a no-grad pass, and each backward's hooks removed once it is done; only the split of a phase's
    bytes into activations and temporaries reads them."""
    from torch.distributed._tools import mod_tracker

    register, backward, hooks = mod_tracker.register_multi_grad_hook, common.backward, []

    def register_when_grad(*args, **kwargs):
        if torch.is_grad_enabled():
            hooks.append(register(*args, **kwargs))
            return hooks[-1]

    def backward_then_release(*args, **kwargs):
        out = backward(*args, **kwargs)
        for hook in hooks:
            hook.remove()
        hooks.clear()
        return out

    with mock.patch.object(mod_tracker, "register_multi_grad_hook", register_when_grad), \
            mock.patch.object(common, "backward", backward_then_release):
        yield


def trace(shape, script, world=1, launcher="torchrun", ac=False, breakdown=False, **flags):
    """{phase: peak bytes} of one step of `script` at its Config's defaults, overridden by flags
    (max_prompt_len, max_response_len or max_new_tokens, batch sizes, grad_accum...). Two
    optimizer steps run; the second (AdamW's moments allocated) is the one measured."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    cfg = memory.as_on_a_gpu(memory.script_config(script, **flags), launcher)
    d = _world(world, launcher)
    with FakeTensorMode(), _as_on_a_gpu(d):
        model = _build(shape, "new_reward" if script == "reward" else "causal")
        frozen = {}  # grpo.py's and dpo.py's frozen models, by role
        if cfg.lora:  # every script: models.with_lora; dpo.py's and grpo.py's reference is the policy, adapters off
            from plumbing import models

            # peft moves each adapter to its base layer's device and dtype with Module.to, which swaps fake
            # tensors and cannot here; the adapters are made there (the fake CPU, fp32) already. reward.py's score
            # head, trained whole, peft deep-copies: a fake tensor's deep copy would belong to a fake mode of its own
            # (an error at the forward, and a segfault in a later trace), so it is cloned in this one
            with mock.patch.object(torch.nn.Module, "to", lambda self, *args, **kwargs: self), \
                    mock.patch.object(FakeTensor, "__deepcopy__", lambda self, memo: self.clone(), create=True):
                model = models.with_lora(model, cfg)
        elif script == "grpo" and (cfg.beta or cfg.reference) or script == "dpo" and not cfg.precompute_ref:
            frozen["reference"] = common.freeze(_build(shape), d)  # a copy of the policy (grpo.py: none at beta 0)
        model = common.shard_model(model, d, activation_checkpointing=ac)
        if script == "grpo" and cfg.reward_model:
            frozen["reward model"] = common.freeze(_build(shape, "reward"), d)
        if script == "grpo" and cfg.teacher:  # environment.make_env: models.load_frozen, the policy's shape here
            frozen["teacher"] = common.freeze(_build(shape), d)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, scheduler = common.make_optimizer(params, 1e-5, 0.0, 1, 10)
        with _tracker_class()(model, optimizer, *frozen.values()) as tracker, _grad_hooks_released():
            STEPS[script](model, optimizer, scheduler, frozen, cfg, d, tracker)
    if dist.is_initialized():
        dist.destroy_process_group()
    if breakdown:
        for name, kinds in tracker.kinds.items():
            print(f"  {name}: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in kinds.items() if v))
    return tracker.peaks


def _steps(model, optimizer, scheduler, cfg, d, tracker, micro_loss):
    """Two optimizer steps of grad_accum micro-batches (micro_loss(): one micro-batch's loss, as the
    script computes it); the second, AdamW's moments made, is measured."""
    for step in range(2):
        with tracker.phase("forward and backward", measure=step == 1):
            for _ in range(cfg.grad_accum):
                common.backward(model, micro_loss(), d)
        with tracker.phase("optimizer step", measure=step == 1):
            common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)


def _sft(model, optimizer, scheduler, frozen, cfg, d, tracker):
    import sft

    def micro_loss():
        ids, attn, resp = _batch(cfg.batch_size // d.world_size // cfg.grad_accum, cfg.max_prompt_len,
                                 cfg.max_response_len, d)
        with common.autocast(d):
            logps = common.response_logprobs(model, ids, attn, resp.shape[1])
        return sft.sft_loss(logps, resp, resp.sum())[0]

    _steps(model, optimizer, scheduler, cfg, d, tracker, micro_loss)


def _reward(model, optimizer, scheduler, frozen, cfg, d, tracker):
    import reward

    def micro_loss():
        ids, attn, _ = _batch(2 * (cfg.batch_size // d.world_size // cfg.grad_accum), cfg.max_prompt_len,
                              cfg.max_response_len, d)
        with common.autocast(d):
            chosen, rejected = common.reward_scores(model, ids, attn).chunk(2)
        return reward.bt_loss(chosen, rejected, cfg.batch_size)[0]

    _steps(model, optimizer, scheduler, cfg, d, tracker, micro_loss)


def _dpo(model, optimizer, scheduler, frozen, cfg, d, tracker):
    import dpo
    from plumbing import models

    def micro_loss():
        batch = _batch(2 * (cfg.batch_size // d.world_size // cfg.grad_accum), cfg.max_prompt_len,
                       cfg.max_response_len, d)
        with _shared(lambda i: i % (len(batch[0]) // 2)):  # chosen i and rejected i: prompt i
            layout = shared_prompt.layout(batch, d, models=[model, frozen.get("reference")], enabled=cfg.shared_prompt)
            pi_c, pi_r = shared_prompt.sequence_logprobs(model, batch, d, *layout).chunk(2)
            ref_c, ref_r = torch.zeros_like(pi_c), torch.zeros_like(pi_r)  # precomputed (or SimPO's none)
            if not cfg.precompute_ref:  # a live reference: a frozen copy, or --lora's policy with its adapters off
                ref = frozen.get("reference", model)
                with models.as_reference(ref):
                    ref_c, ref_r = shared_prompt.sequence_logprobs(ref, batch, d, *layout).chunk(2)
        return dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=cfg.beta, n_pairs=cfg.batch_size)[0]

    _steps(model, optimizer, scheduler, cfg, d, tracker, micro_loss)


def _turn(model, rows, n_prompts, prompt_len, slots, cfg, d):
    """One call of sampling.generate, as far as its memory goes: a static cache of `rows` rows and
    `slots` slots (kv_cache.decode_cache: with --compile the persistent one), the prefill of
    n_prompts distinct prompts of prompt_len tokens copied into it (each to about rows / n_prompts rows),
    and one decode step into the full cache (from the bf16 copies under autocast with --compile)."""
    import kv_cache
    import sampling

    prompts, mask, _ = _batch(n_prompts, prompt_len, 0, d)
    out = model(input_ids=prompts, attention_mask=mask, position_ids=common.position_ids_from_mask(mask),
                use_cache=True, logits_to_keep=1)
    cache, _, slots = kv_cache.decode_cache(model, rows, slots, out.cache, persistent=cfg.compile)
    inverse = None if n_prompts == rows else torch.arange(rows, device=d.device) * n_prompts // rows
    kv_cache.fill_cache(cache, out.cache, inverse, prompt_len)
    logits = out.logits[:, -1] if inverse is None else out.logits[:, -1][inverse]  # (rows, V)
    del out
    decoder = kv_cache.decoder(model) if cfg.compile else model  # sampling.generate's
    full = torch.ones(rows, slots, dtype=torch.long, device=d.device)
    sampling._next_logits(decoder, logits.argmax(-1)[:, None], full, torch.full((rows, 1), prompt_len, device=d.device),
                          cache=cache, kw=dict(logits_to_keep=1))


def _grpo(model, optimizer, scheduler, frozen, cfg, d, tracker):
    """The rollout (prefill of the distinct prompts, one decode step; with --tools into the tool
    loop's cache; with --generation_micro_batch_size the largest of environment.sample's chunks), the reward model's
    forward over the rank's rollout (--rs_samples rows a prompt), the reference's, the old policy's
    and the teacher's log-probs, the update."""
    import environment
    import grpo
    import sampling

    n_local = cfg.prompts_per_step // d.world_size
    rows = n_local * cfg.group_size  # this rank's completions in the update
    sampled = n_local * (cfg.rs_samples or cfg.group_size)  # and in the rollout (rejection sampling keeps rows)
    micro = rows // cfg.num_mini_batches // cfg.grad_accum
    P, R = cfg.max_prompt_len, cfg.max_new_tokens
    # the sampler's largest call: the chunk of the most rows, and of the most distinct prompts (groups contiguous)
    group = cfg.rs_samples or cfg.group_size
    chunks = environment.chunks(sampled, cfg.generation_micro_batch_size)
    chunk = max(c.stop - c.start for c in chunks)
    chunk_prompts = max((c.stop - 1) // group - c.start // group + 1 for c in chunks)
    ref = frozen.get("reference", model if cfg.lora and (cfg.beta or cfg.reference) else None)  # LoRA's: adapters off
    # grpo.minibatch_rows deals each K consecutive rows one to each of K mini-batches: a group's G rows, G / K to
    # each (consecutive there, as here: row i of a micro-batch has prompt i // (G / K))
    dealt = max(1, cfg.group_size // cfg.num_mini_batches)
    for step in range(2):
        with tracker.phase("rollout", measure=step == 1):
            with common.evaluating(model, gather=True), common.autocast(d), torch.no_grad(), \
                    environment.frozen_in_bf16(model, d, enabled=not cfg.compile):  # environment.sample's
                steps = sampling.tool_steps(R, cfg.max_tool_calls, sampling.GPU_CHECK_EVERY) if cfg.tools else R
                _turn(model, chunk, chunk_prompts, P, memory.cache_slots(P + steps, cfg.compile), cfg, d)
        ids, attn, _ = _batch(sampled, P, R, d)
        if cfg.reward_model:
            with tracker.phase("reward model", measure=step == 1), common.autocast(d), torch.no_grad():
                common.reward_scores(frozen["reward model"], ids[:, :-1], attn[:, :-1])  # environment.learned_rewards
        ids, attn, loss_mask = _batch(rows, P, R, d)  # grpo.reward: group_size of each prompt's samples kept
        minibatches = torch.arange(rows, device=ids.device).view(cfg.num_mini_batches, -1)
        with _shared(lambda i: i // dealt):  # grpo.py's plan (sharing: one process, no activation checkpointing)
            plan = shared_prompt.plan(minibatches, ids, attn, R, micro, d, models=[model, frozen.get("teacher")],
                                      enabled=cfg.shared_prompt)
        lp = dict(plan=plan, d=d, temperature=cfg.temperature)
        ref_logps = old_logps = None  # grpo.py's passes: the reference's at beta > 0, the old policy's where it differs
        old_pass = cfg.num_iterations > 1 or cfg.num_mini_batches > 1 or cfg.teacher
        with tracker.phase("reference and old log-probs", measure=step == 1 and (ref is not None or old_pass)), \
                environment.frozen_in_bf16(model, d):
            with environment.reference_context(model, ref), _shared(lambda i: i // dealt):
                if ref is not None:
                    ref_logps = shared_prompt.planned_logprobs(ref, ids, attn, R, **lp)
            if old_pass:
                with _shared(lambda i: i // dealt):
                    old_logps = shared_prompt.planned_logprobs(model, ids, attn, R, **lp)
        adv = torch.zeros(rows, device=d.device)
        if cfg.teacher:
            with tracker.phase("teacher log-probs", measure=step == 1), _shared(lambda i: i // dealt):
                teacher_logps = shared_prompt.planned_logprobs(frozen["teacher"], ids, attn, R, **lp)
                adv = adv[:, None] + grpo.distill_advantages(teacher_logps, old_logps, loss_mask, cfg.teacher_coef)
        for _, _, share in plan:
            with tracker.phase("forward and backward", measure=step == 1):
                for k in range(cfg.grad_accum):
                    r = slice(k * micro, (k + 1) * micro)
                    with common.autocast(d), _shared(lambda i: i // dealt):
                        logps, entropy = shared_prompt.response_logprobs(model, ids[r], attn[r], R, cfg.temperature,
                                                                         with_entropy=True, shared=share and share[k])
                    loss, _ = grpo.grpo_loss(logps.float(), logps.detach().float() if old_logps is None else old_logps[r],
                                             None if ref_logps is None else ref_logps[r], adv[r], loss_mask[r],
                                             normaliser=loss_mask.sum(), entropy=entropy.float(), beta=cfg.beta)
                    common.backward(model, loss, d)
            with tracker.phase("optimizer step", measure=step == 1):
                common.optimizer_step(model, optimizer, scheduler, cfg.grad_clip)


STEPS = {"sft": _sft, "reward": _reward, "dpo": _dpo, "grpo": _grpo}


SCRIPTS = ("sft", "reward", "dpo", "grpo")
CHECKS = [  # (launcher, world, flags, scripts) the model is checked at against this tracker
    *[(launcher, world, flags, SCRIPTS) for launcher, world, flags in [
        ("python", 1, {}), ("torchrun", 8, {}),
        ("python", 1, dict(memory.LONG, reward_model="rm")), ("torchrun", 8, dict(memory.LONG, reward_model="rm")),
        ("python", 1, dict(memory.LONG, ac=True, grad_accum=2)), ("torchrun", 8, dict(memory.LONG, ac=True, grad_accum=2))]],
    # grpo.py's own: a teacher (the policy's shape), rejection sampling's rows, LoRA, --compile, tool calls, the
    # sampler's chunks
    *[(launcher, world, dict(memory.LONG, **flags), ("grpo",)) for launcher, world, flags in [
        ("python", 1, dict(teacher="teacher")), ("torchrun", 8, dict(teacher="teacher")),
        ("python", 1, dict(rs_samples=16, reward_model="rm")), ("torchrun", 8, dict(rs_samples=16, reward_model="rm")),
        ("python", 1, dict(lora=True)), ("python", 1, dict(lora=True, ac=True)), ("python", 1, dict(compile=True)),
        ("python", 1, dict(tools="calculator")), ("torchrun", 8, dict(tools="calculator")),
        ("python", 1, dict(tools="calculator", generation_micro_batch_size=32))]],
    # LoRA in the other scripts, on one GPU and on 8 (dpo.py's live reference: the policy with its adapters off)
    *[(launcher, world, dict(memory.LONG, lora=True, **flags), ("sft", "reward", "dpo")) for launcher, world, flags in [
        ("python", 1, dict(ac=True)), ("torchrun", 8, {}), ("python", 1, dict(precompute_ref=False))]],
]


def shown(flags, ac=False):
    """The flags of a check as on a command line."""
    out = [f"--{k}" if v is True else f"--{k} {v}" for k, v in flags.items() if k not in ("reward_model", "teacher")]
    out += ["--activation_checkpointing"] * ac + ["+ a teacher"] * ("teacher" in flags)
    return " ".join(out + ["+ reward model"] * ("reward_model" in flags)) or "defaults"


def check(shapes=("gpt2-large", "qwen2.5-1.5b", "llama-3-8b"), cases=CHECKS, layers=None):
    """Each phase of bench/memory.py's model against the tracker (the scripts' own code on fake
    tensors) for each (launcher, world, flags, scripts) of cases; layers: build the shapes with this
    many blocks (the tests: faster, same terms). A phase the model lacks counts as -100%. Prints a
    table; returns the largest error of a script's peak and of any phase."""
    print("| model | launcher | flags | script | phase | model GiB | tracker GiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst_peak = worst_phase = 0.0
    for name in shapes:
        s = dict(memory.SHAPES[name], **({"L": layers} if layers else {}))
        for launcher, world, flags, scripts in cases:
            flags = dict(flags)
            ac = flags.pop("ac", False)
            for script in scripts:
                traced = trace(s, script, world, launcher, ac=ac, **flags)
                est = {k: sum(v.values()) for k, v in memory.estimate(s, script, world, launcher, ac=ac, **flags).items()}
                for phase, t in traced.items():
                    err = est.get(phase, 0) / t - 1
                    worst_phase = max(worst_phase, abs(err))
                    model = f"{name} ({layers} layers)" if layers else name
                    print(f"| {model} | {launcher} x{world} | {shown(flags, ac)} | {script} | {phase} | "
                          f"{est.get(phase, 0) / GIB:.2f} | {t / GIB:.2f} | {err:+.1%} |")
                worst_peak = max(worst_peak, abs(max(est.values()) / max(traced.values()) - 1))
    print(f"\nlargest error: a script's peak {worst_peak:.1%}, a phase {worst_phase:.1%}")
    return worst_peak, worst_phase


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-large", help=f"one of {sorted(memory.SHAPES)}")
    p.add_argument("--script", default="sft,reward,dpo,grpo")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--launcher", default="torchrun", choices=["python", "torchrun"])
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="each phase's peak by MemTracker's categories")
    p.add_argument("--check", action="store_true", help="bench/memory.py's model against this tracker, at CHECKS")
    args, rest = p.parse_known_args()
    if args.check:
        sys.exit(1 if check()[0] > 0.1 else 0)
    flags = memory.parse_flags(rest)
    for script in args.script.split(","):
        peaks = trace(memory.SHAPES[args.model], script, args.world, args.launcher, args.activation_checkpointing,
                      args.breakdown, **flags)
        est = memory.estimate(memory.SHAPES[args.model], script, args.world, args.launcher,
                              ac=args.activation_checkpointing, **flags)
        print(f"{script}.py: " + ", ".join(f"{k} {v / GIB:.2f} GiB (model {sum(est[k].values()) / GIB:.2f})"
                                           if k in est else f"{k} {v / GIB:.2f} GiB" for k, v in peaks.items()))


if __name__ == "__main__":
    main()
