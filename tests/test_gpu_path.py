"""What a GPU would catch, caught on the CPU: tensors of mixed devices (the `meta` device refuses
mixing like CUDA does, and refuses host syncs), bf16 logits under autocast, LoRA forwards that
compute every position's logits, frozen FSDP roots left gathered, the sampler's non-finite
check, the persistent decode cache, and the one-command GPU check's CPU behaviour."""
import itertools
from dataclasses import replace

import pytest
import torch

import common
import lm_head
import environment
import grpo
import sampling
import shared_prompt
import tasks
import gpu_check
from helpers import OpOutputs, failed_run_ends, forward_lengths, fp32_rtol, free_port, logprob_size, read_metrics, write_jsonl
from plumbing import cli, models, rundir

META = common.Dist(device=torch.device("meta"))


@pytest.fixture(scope="module")
def tiny():
    tok = tasks.char_tokenizer()
    torch.manual_seed(0)
    return models.load_model("tiny", tok).eval(), tok


def test_grpo_math_runs_on_one_device_without_host_syncs():
    """Every tensor these functions create is made on their inputs' device, and none reads a
    value back to the host (meta tensors refuse both: torch.stack of meta and CPU, .item())."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(4, 3, generator=g).to("meta")
    adv, m = grpo.group_advantages(rewards, "batch", global_norm=True, d=META)
    assert adv.device.type == "meta" and all(v.device.type == "meta" for v in m.values())
    mean, std = grpo._global_mean_std(rewards, META)
    assert mean.device.type == std.device.type == "meta"
    assert common.ranking_accuracy(rewards[:, 0], rewards[:, 1]).device.type == "meta"
    sums = common.add_metrics({}, m)
    assert all(v.device.type == "meta" for v in common.add_metrics(sums, m, weight=0.5).values())
    mask = torch.ones(6, 5, device="meta")
    for agg in grpo.LOSS_AGGS:
        assert grpo.loss_normaliser(mask, agg, 5, META).device.type == "meta"
    lp = torch.randn(6, 5, generator=g).to("meta")
    loss, m = grpo.grpo_loss(lp, lp, lp, torch.zeros(6, device="meta"), mask, grpo.loss_normaliser(mask, "token_mean", 5, META),
                             beta=0.1, entropy=lp, entropy_coef=0.01)
    assert loss.device.type == "meta" and all(torch.is_tensor(v) and v.device.type == "meta" for v in m.values())
    # the variants: every policy term and ratio level, the masks and weights, the advantage estimators
    adv = torch.zeros(6, device="meta")
    cfg = replace(cli.with_defaults(grpo.Config()), off_policy_mask_threshold=0.5, vllm_importance_sampling_correction=True,
                  vllm_importance_sampling_clip_min=0.5)
    for mode in grpo.IS_MODES:  # the policy term's weights: every mask and correction at once
        w, wm = grpo.policy_weights(replace(cfg, vllm_importance_sampling_mode=mode), lp, lp, lp, adv, mask=mask,
                                    keep=grpo.top_entropy_mask(lp, mask, 0.2, META, width=7), n_tokens=mask.sum())
        assert w.device.type == "meta" and all(v.device.type == "meta" for v in wm.values())
    for loss_type, level in itertools.zip_longest(grpo.LOSS_TYPES, grpo.IS_LEVELS, fillvalue="token"):
        loss, m = grpo.grpo_loss(lp, lp, lp, adv, mask, 30.0, loss_type=loss_type, level=level,
                                 clip_ratio_c=3.0 if loss_type == "grpo" else 0.0, pg_weights=w)
        assert loss.device.type == "meta" and all(v.device.type == "meta" for v in m.values())
    for estimator in grpo.ADV_ESTIMATORS:
        assert grpo.group_advantages(rewards, "none", d=META, estimator=estimator)[0].device.type == "meta"
    assert grpo.overlong_penalty(mask.sum(-1), 5, 2, 1.0).device.type == "meta"


def test_ranking_accuracy_counts_ties_half():
    c, r = torch.tensor([1.0, 2.0, 0.5, 3.0]), torch.tensor([0.0, 2.0, 1.0, 1.0])  # win, tie, loss, win
    assert common.ranking_accuracy(c, r).item() == pytest.approx(2.5 / 4)


def test_metrics_reduce_from_device_tensors_and_floats():
    sums = common.add_metrics({}, {"a": torch.tensor(0.125), "c": torch.tensor(2.0, dtype=torch.float64)})
    sums = common.add_metrics(sums, {"a": torch.tensor(0.25)}, weight=0.5)  # micro-batches add up on the device
    got = common.reduce_metrics(sums, common.Dist(), maxes={"m": torch.tensor(7.0)}, same={"b": 3})
    assert got == {"a": 0.25, "c": 2.0, "m": 7.0, "b": 3.0}


def test_lm_head_logits_are_fp32_under_bf16_autocast(tiny):
    """Under bf16 autocast the kept positions' logits are fp32 sums of bf16 products (the hidden
    states and the weight in bf16, as autocast casts a linear's operands, accumulated in fp32, never
    rounded to bf16): log-probs equal that computation done by hand, to the rounding of fp32 sums of
    H terms, and differ from bf16-rounded logits by more (so the check has teeth)."""
    model, tok = tiny
    model = models.load_model("tiny", tok).eval()
    with torch.no_grad():  # logits of GPT-2's size (tens): where bf16's step is 0.125-0.5
        model.transformer.wte.weight.mul_(40)
    assert type(model.lm_head) is lm_head.FP32Head
    ids, attn, resp = common.join_prompt_response([tok("sort 3 1 2 =")["input_ids"]] * 2,
                                                  [tok(" 1 2 3")["input_ids"], tok(" 3 2")["input_ids"]], tok.pad_token_id)
    R = resp.shape[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = common.response_logprobs(model, ids, attn, R)
        h = model.transformer(input_ids=ids, attention_mask=attn,
                              position_ids=common.position_ids_from_mask(attn)).last_hidden_state[:, -(R + 1):-1]
    x, w = h.bfloat16().double(), model.lm_head.weight.bfloat16().double()
    logits = x @ w.T  # (B, R, V): the bf16 products summed exactly (float64)
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, -R:, None]).squeeze(-1)
    rounded = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, ids[:, -R:, None]).squeeze(-1)
    # an fp32 sum of H terms is off by at most H eps32 sum|x_i w_i| (Higham, Thm 3.1), and a log-softmax
    # moves by at most twice its inputs' largest error
    bound = 2 * x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T).max().item()
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= bound, bound
    assert (rounded - want).abs().max() > 10 * bound


def _naive_head(x, w, b, labels, temperature, truncate):
    """The head's log-probs and entropies from whole fp64 logits, autograd's gradients."""
    z = (x.double() @ w.double().T + (0 if b is None else b.double())) / temperature
    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    zt = z if truncate is None else truncate(z, labels).double()
    return zt.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1), ent


@pytest.mark.parametrize("temperature, top_p, bias", [(1.0, 1.0, False), (0.7, 1.0, True), (0.7, 0.8, False)])
def test_the_fused_head_scores_tokens_without_their_logits(temperature, top_p, bias):
    """lm_head._HeadLogprobs (the LM head, log-softmax and gather in chunks of tokens, the backward
    recomputing each chunk): log-probs and entropies equal those of whole fp64 logits, at a
    temperature and under a sampler's top-p (truncated and renormalised; the entropy the full
    distribution's), and so do the gradients of the weight, bias and hidden states of a loss of both
    (the entropy's too: an entropy bonus), to fp32's rounding of sums over H and V terms. No op of
    the forward or the backward makes a tensor of the tokens x V logits' size: 64 tokens in chunks
    of 8."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 64, 16, 50
    x = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 2).requires_grad_()
    b = (torch.randn(V, generator=g) if bias else torch.zeros(V)).requires_grad_(bias)
    labels = torch.randint(0, V, (N,), generator=g)
    c, e = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    truncate = sampling.truncation(top_p=top_p)
    with OpOutputs() as ops:
        logp, ent = lm_head._HeadLogprobs.apply(x, w, b if bias else None, labels, torch.float32, temperature, truncate,
                                               True, True, 8)
        ((logp.double() * c).sum() + (ent.double() * e).sum()).backward()
    assert ops.largest() < N * V, ops.largest()
    got = [logp, ent, x.grad, w.grad] + ([b.grad] if bias else [])
    for t in [x, w, b]:
        t.grad = None
    want_logp, want_ent = _naive_head(x, w, b if bias else None, labels, temperature, truncate)
    ((want_logp * c).sum() + (want_ent * e).sum()).backward()
    want = [want_logp, want_ent, x.grad, w.grad] + ([b.grad] if bias else [])
    eps, scale = torch.finfo(torch.float32).eps, (x.abs() @ w.abs().T).max().item() / temperature
    # fp32 logits are off by H eps |x||w| (a sum of H products); log-probs, entropies and their
    # gradients are smooth in them with constants of order log V and |c| + |e|, and a gradient's sum
    # over N tokens or V entries adds N (or V) eps of its terms
    bound = 8 * (H * scale + N + V) * eps * max(1.0, scale) * (1 + c.abs().max().item() + e.abs().max().item())
    for name, a, b_ in zip(["logp", "entropy", "x.grad", "w.grad", "b.grad"], got, want):
        assert (a.double() - b_.double()).abs().max() <= bound * max(1.0, b_.abs().max().item()), (name, bound)
    if top_p < 1:
        assert (truncate(x.detach() @ w.detach().T, labels) == float("-inf")).any()  # the rule dropped tokens


def test_response_logprobs_never_hold_the_responses_logits(tiny, monkeypatch):
    """The update's and the reference's log-probs (common.response_logprobs, padded and packed, and
    shared_prompt's responses) with their entropies and gradients: no op of the forward or backward
    makes a floating tensor of the response tokens x V logits' size, with chunks of 2 tokens
    (CHUNK_LOGITS; the default is 2^26 logits a chunk on a GPU: 256 MiB, against 10 GB for
    Qwen's 151,936 entries at 16K response tokens)."""
    model, tok = tiny
    model = models.load_model("tiny", tok).train()
    V = model.lm_head.weight.shape[0]

    monkeypatch.setattr(lm_head, "CHUNK_LOGITS", {"cpu": 2 * V, "gpu": 2 * V})
    prompt = tok("sort 3 1 2 4 5 6 =")["input_ids"]
    ids, attn, resp = common.join_prompt_response([prompt] * 4, [tok(" 1 2 3 4 5 6")["input_ids"]] * 4, tok.pad_token_id)
    for kw in (dict(packed=False), dict(packed=True), dict(shared=True)):
        with OpOutputs() as ops:
            logps, ent = shared_prompt.response_logprobs(model, ids, attn, resp.shape[1], with_entropy=True,
                                                         entropy_grad=True, **kw)
            (logps.sum() + ent.sum()).backward()
        # the largest floating tensor over the vocabulary an op makes (no view): a chunk's 2 tokens, or one
        # position a row (shared prompts' first response token: 4 rows)
        largest = ops.largest(lambda shape, dtype: shape[-1:] == (V,), views=False)
        assert largest <= len(ids) * V < resp.numel() * V, (kw, largest)


def test_response_logprobs_fused_equal_the_logits_path(tiny, monkeypatch):
    """common.response_logprobs through the fused head (FP32Head.request) gives the log-probs and
    entropies of its logits path (common.scored_logits, taken where a model rescales its logits) to the
    bit in fp32, padded and packed, and their gradients to fp32's rounding of the same sums."""
    model, tok = tiny
    model = models.load_model("tiny", tok).train()
    ids, attn, resp = common.join_prompt_response([tok("sort 3 1 2 =")["input_ids"], tok("sort 9 8 =")["input_ids"]],
                                                  [tok(" 1 2 3")["input_ids"], tok(" 8 9 9")["input_ids"]], tok.pad_token_id)
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(lm_head, "fused_head", lambda m: None)
        for packed in (False, True):
            model.zero_grad()
            logps, ent = common.response_logprobs(model, ids, attn, resp.shape[1], temperature=0.8, with_entropy=True,
                                                  entropy_grad=True, packed=packed)
            ((logps * resp).sum() + (ent * resp).sum()).backward()
            out[fused, packed] = [logps.detach() * resp, ent.detach() * resp, model.lm_head.weight.grad.clone(),
                                  model.transformer.h[0].attn.c_attn.weight.grad.clone()]
    # in fp32 the same ops in the same order (F.linear, log_softmax and gather, the entropy's logsumexp): the same
    # floats; the gradients by hand against autograd's: float32's rounding of their sums, as vectors (by norm)
    H, V = model.config.n_embd, model.config.vocab_size
    size = logprob_size(model, 0.8)
    for packed in (False, True):
        for name, a, b in zip(("log-probs", "entropies"), out[True, packed], out[False, packed]):
            assert torch.equal(a, b), (name, packed, (a - b).abs().max())
        for a, b in zip(out[True, packed][2:], out[False, packed][2:]):
            assert (a - b).norm() <= fp32_rtol(forward_lengths(model.config, ids.shape[1]) + [H, V]) * b.norm() * size


def test_fp32_head_checkpoint_loads_as_a_plain_linear(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.lm_head) is torch.nn.Linear
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_grpo_at_lr_0_has_no_kl_and_no_clipping_under_autocast(tmp_path, monkeypatch):
    """A GRPO run at learning rate 0 under bf16 autocast (on the CPU here; common.autocast turns
    it on for GPUs): the policy never moves, so rho = 1 and KL = 0 up to rounding although the
    old log-probs and the trained ones come from different batch layouts."""
    monkeypatch.setattr(common, "autocast", lambda d, enabled=True: torch.autocast("cpu", dtype=torch.bfloat16))
    cfg = grpo.Config(model="tiny", out_dir=str(tmp_path / "g"), steps=2, prompts_per_step=4, group_size=4,
                      num_iterations=2, num_mini_batches=2, lr=0.0, n_eval=4, n_eval_pairs=4, eval_every=100,
                      n_train=64, max_new_tokens=12)
    grpo.main(cfg)
    rows = [r for r in read_metrics(tmp_path / "g") if r["step"] > 0]
    assert len(rows) == 2
    for r in rows:  # every pass on the update's own micro-batches, the reference a copy: exact, bf16 too
        assert r["kl"] == 0 and r["clip_ratio/low"] == 0 and r["clip_ratio/high"] == 0, r


def test_lora_forward_computes_only_the_kept_logits(tiny):
    """A PeftModel's forward takes **kwargs: logits_to_keep must still reach the model, so the
    LM head sees the R positions before the response, not all P+R (a (B, P+R, V) tensor per forward)."""
    pytest.importorskip("peft")
    _, tok = tiny
    model = models.add_lora(models.load_model("tiny", tok), 4, 8.0)
    assert common._accepts(model, "logits_to_keep")
    seen = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    ids, attn, resp = common.join_prompt_response([tok("sort 3 1 2 =")["input_ids"]], [tok(" 1 2 3")["input_ids"]],
                                                  tok.pad_token_id)
    common.response_logprobs(model, ids, attn, resp.shape[1])
    handle.remove()
    assert seen == [resp.shape[1]]


def test_the_logits_are_never_copied_whole(tiny):
    """The head computes exactly the R positions before the response (logits_to_keep as indices), so
    the (B, R, V) logits are contiguous: the log-prob and entropy passes reshape them without a copy.
    Kept as R+1 positions and sliced, each reshape copied them whole: two extra (B, R, V) fp32
    tensors in GRPO's update, 9 GiB each at Qwen2.5's vocabulary, R = 1024, 16 rows
    (tests/memory_trace.py)."""
    _, tok = tiny
    model = models.load_model("tiny", tok)
    ids, attn, resp = common.join_prompt_response([tok("sort 3 1 2 =")["input_ids"]] * 2,
                                                  [tok(" 1 2 3")["input_ids"], tok(" 1 2")["input_ids"]],
                                                  tok.pad_token_id)
    size = ids.shape[0] * resp.shape[1] * model.config.vocab_size
    with OpOutputs() as ops:
        logps, entropy = common.response_logprobs(model, ids, attn, resp.shape[1], with_entropy=True)
        logps.sum().backward()
    assert logps.shape == entropy.shape == resp.shape
    copies = [func for func, _, outs in ops.seen if func in (torch.ops.aten.clone.default, torch.ops.aten._reshape_copy.default)
              and outs[0][0].numel() >= size]
    assert not copies, copies


def test_frozen_fsdp_root_reshards_after_a_no_grad_forward(tiny, monkeypatch):
    """FSDP2 keeps a root's parameters gathered after forward (backward needs them); a frozen
    model has no backward, so its root must reshard, or the reference and reward model hold a
    full copy of their embeddings (and LM head) for the rest of the step."""
    from torch.distributed.tensor import DTensor

    _, tok = tiny
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    d = common.setup_distributed()
    try:
        ids = torch.tensor([tok("sort 3 1 2 = 1 2 3")["input_ids"]])
        frozen = common.shard_model(models.load_model("tiny", tok).requires_grad_(False).eval(), d)
        trained = common.shard_model(models.load_model("tiny", tok), d)
        with torch.no_grad():
            frozen(input_ids=ids)
            trained(input_ids=ids)
        assert all(isinstance(p, DTensor) for p in frozen.parameters())
        assert not all(isinstance(p, DTensor) for p in trained.parameters())  # FSDP's default for a root
        with common.unsharded(frozen):
            frozen(input_ids=ids)
        with torch.no_grad():
            frozen(input_ids=ids)
        assert all(isinstance(p, DTensor) for p in frozen.parameters())  # unsharded restores it
    finally:
        rundir.release()


def test_non_finite_logits_give_valid_ids_and_a_clear_error(tiny):
    """Inside generate the check is recorded on the device and raised after the loop (a CUDA
    assert would leave the context unusable); meanwhile every drawn id stays in the vocabulary,
    so no out-of-range embedding lookup happens on the next step."""
    logits = torch.randn(3, 7)
    logits[1] = float("nan")
    bad = torch.zeros((), dtype=torch.bool)
    tok_ids = sampling.sample_token(logits, 1.0, generator=torch.Generator().manual_seed(0), bad=bad)
    assert bool(bad) and int(tok_ids.max()) < 7
    model, tok = tiny
    broken = models.load_model("tiny", tok).eval()
    with torch.no_grad():
        broken.lm_head.weight[5] = float("nan")
    ids, mask = common.pad([tok("sort 3 1 =")["input_ids"]] * 2, tok.pad_token_id, side="left")
    with pytest.raises(RuntimeError, match="NaN"):
        sampling.generate(broken, ids, mask, 6, tok.eos_token_id, tok.pad_token_id)


class FakeCudagraphTrees:
    """What cudagraph trees do to a compiled step, on the CPU (torch/_inductor/cudagraph_trees.py):
    a dynamo backend whose every graph binds, at its first run, to the tree manager alive then and
    records the addresses of its static inputs (parameters, the cache's and Rows' tensors: marked
    static); a later run on moved addresses re-records, a run after its manager was shut down raises
    as cudagraph trees do, and a run that mutates an input not marked static is one cudagraph trees
    would skip (`skipped`: "skipping cudagraphs due to mutated inputs"). reset_cudagraph_trees shuts
    the manager down, and so does torch.compiler.reset() on a CUDA machine (torch/_dynamo/__init__.py),
    after dropping dynamo's entries. The sampler takes the GPU's path (sampling._gpu)."""

    def __init__(self, monkeypatch):
        self.manager, self.compiled, self.recorded, self.rerecorded, self.skipped = object(), 0, [], 0, 0
        reset = torch._dynamo.reset
        monkeypatch.setattr("torch._inductor.cudagraph_trees.reset_cudagraph_trees", self.shutdown)
        monkeypatch.setattr(torch._dynamo, "reset", lambda: (reset(), self.shutdown()))
        monkeypatch.setattr(sampling, "_compiled", {})
        monkeypatch.setattr(sampling, "_compile", lambda fn, gpu: torch.compile(fn, backend=self.backend, dynamic=False))
        monkeypatch.setattr(sampling, "_gpu", lambda device: True)

    def shutdown(self):
        self.manager = object()

    def backend(self, gm, example_inputs):
        self.compiled += 1
        shape = tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor))
        graph = {}

        def run(*args):
            static = [a.data_ptr() for a in args if getattr(a, "_dynamo_static_input_type", None)]
            if not graph:
                graph.update(manager=self.manager, static=static)
                self.recorded.append(shape)
            elif graph["manager"] is not self.manager:
                raise AssertionError("Running CUDAGraph after shutdown")
            elif static != graph["static"]:
                graph["static"] = static
                self.rerecorded += 1
            others = [(a, a._version) for a in args if isinstance(a, torch.Tensor)
                      and not getattr(a, "_dynamo_static_input_type", None)]
            out = gm(*args)
            self.skipped += any(a._version != v for a, v in others)
            return out
        return run


def test_compiled_decoding_survives_training_evaluation_and_tool_rollouts(tmp_path, monkeypatch):
    """A run's rollouts through the compiled decode step, CUDA graphs faked (FakeCudagraphTrees):
    evaluation of 3 rows, training of 8, evaluation again, tool turns (8 rows, a GPU's 7 idle slots
    per call: more slots), then evaluation, training and tools twice more. Each rollout samples what
    the eager sampler does from a fresh cache; no graph runs on shut-down trees (a return to a
    shape compiled before the cache was replaced: what crashed an H200 run); after the first pass
    of each shape, nothing compiles, records or re-records again."""
    import tools

    folder = tasks.calculator_gpt2(tmp_path / "caller")
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok).eval()
    tool = tools.load_tool("calculator")
    trees = FakeCudagraphTrees(monkeypatch)
    ids, mask = common.pad(sampling.encode_prompts(tok, [r["prompt"] for r in tasks.prompt_rows(4)], 32)[0],
                           tok.pad_token_id, side="left")
    tol = fp32_rtol(forward_lengths(model.config, 32 + 24)) * logprob_size(model)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # 4 prompts x G = 2
    u = sampling.rollout_uniforms(8, 24, seed=0)
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    rollouts = {
        "evaluation": lambda compile: sampling.generate(model, ids[:3], mask[:3], 12, temperature=0.0,
                                                        compile=compile, **kw),
        "training": lambda compile: sampling.generate(model, ids, mask, 12, uniforms=u, return_logprobs=True,
                                                      compile=compile, **kw),
        "tools": lambda compile: sampling.generate_with_tools(model, ids, mask, 24, tokenizer=tok, tool=tool,
                                                              uniforms=u, check_every=8, compile=compile, **kw)}
    counts = []
    for name in ["evaluation", "training", "evaluation", "tools"] + ["evaluation", "training", "tools"] * 3:
        got, want = rollouts[name](True), rollouts[name](False)
        for g, w in zip(got, want):  # log-probs: float32's rounding of the compiled and eager layouts
            assert torch.equal(g, w) if g.dtype != torch.float else torch.allclose(g, w, rtol=0, atol=tol), name
        counts.append((trees.compiled, len(trees.recorded), trees.rerecorded))
    assert sampling.tool_calls(rollouts["tools"](False)[3]).sum() > 0  # the tool rollouts called the tool
    assert counts[-1] == counts[6], counts  # the last two passes compiled and recorded nothing
    assert trees.rerecorded == 0 and trees.skipped == 0, counts


def test_grpo_compile_compiles_each_shape_once_through_long_tailed_prompts_evaluations_and_resume(
        tmp_path, monkeypatch, user_models):
    """grpo.py --compile on a Qwen2-shaped model (RoPE, GQA, a BPE chat template), CUDA graphs faked
    (FakeCudagraphTrees): prompts whose lengths follow a long tail (most short, a few 3-6x longer,
    met at whatever step the data order brings them), evaluations every step of 5 held-out prompts in
    chunks of 2 (--eval_batch_size: 2, 2 and 1 padded to 2), greedy and sampled; killed after step
    2's checkpoint, then --resume to step 6 in a fresh state, a new process's. The decode cache is
    sized from the flags at the first call and never replaced, so each run compiles and records one
    graph per batch shape it meets (rows, greedy or sampled) and none after its second step, none
    re-records, and no graph mutates an input that is not static (which cudagraph trees would skip)."""
    trees = FakeCudagraphTrees(monkeypatch)
    g = torch.Generator().manual_seed(0)
    lengths = ((1.0 + 0.8 * torch.randn(64, generator=g)).exp().clamp(1, 24).round().int() + 1).tolist()  # log-normal
    rows = [{"prompt": "sort " + " ".join(str((i * 7 + k) % 10) for k in range(n)), "reward_fn": "digits"}
            for i, n in enumerate(lengths)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    argv = ["--model", user_models["qwen2"], "--dataset", prompts, "--steps", "6", "--prompts_per_step", "4",
            "--group_size", "2", "--max_new_tokens", "10", "--max_prompt_len", "96", "--eval_every", "1",
            "--n_eval", "5", "--eval_batch_size", "2", "--save_every", "1", "--compile", "--out_dir", str(tmp_path / "run")]
    seen, calls = [], []  # after each rollout and evaluation: (what, compilations, recordings); each generate's shape
    rollout, evaluate, generate = environment.rollout, environment.evaluate, sampling.generate

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            if name == "rollout" and [s[0] for s in seen].count("rollout") == 2 and "--resume" not in argv:
                raise KeyboardInterrupt  # killed after step 2's checkpoint
            out = fn(*args, **kwargs)
            seen.append((name, trees.compiled, len(trees.recorded)))
            return out
        return wrapped

    monkeypatch.setattr(environment, "rollout", counted("rollout", rollout))
    monkeypatch.setattr(environment, "evaluate", counted("evaluate", evaluate))
    monkeypatch.setattr(sampling, "generate", lambda model, ids, *a, **k: calls.append(
        (len(ids), k.get("temperature", 1.0) == 0, ids.shape[1])) or generate(model, ids, *a, **k))
    with pytest.raises(KeyboardInterrupt):
        grpo.main(cli.parse_config(grpo.Config, argv))
    failed_run_ends()
    first, first_calls, seen[:], calls[:] = list(seen), list(calls), [], []
    torch.compiler.reset()  # a new process: no graph, no trees
    trees.shutdown()
    compiled_before = trees.compiled
    argv.append("--resume")
    grpo.main(cli.parse_config(grpo.Config, argv))
    assert [s[0] for s in first] == ["evaluate", "rollout", "evaluate", "rollout", "evaluate"], first  # steps 0-2
    assert [s[0] for s in seen] == ["rollout", "evaluate"] * 4, seen  # steps 3-6
    assert len({c[2] for c in first_calls + calls}) > 2  # the prompt blocks' widths differ from call to call
    for run, run_calls, base in ((first, first_calls, 0), (seen, calls, compiled_before)):
        shapes = {c[:2] for c in run_calls}
        assert run[-1][1] - base <= len(shapes) and run[-1][1:] == run[2][1:], (run, shapes)  # none after step 2
    assert trees.rerecorded == 0 and trees.skipped == 0, (trees.rerecorded, trees.skipped)


def test_grpo_compile_runs_through_evaluations_tool_turns_and_resume(tmp_path, monkeypatch):
    """grpo.py --compile --tools, CUDA graphs faked (FakeCudagraphTrees), evaluating every step (the
    file's held-out prompts, greedy and sampled: 3 rows, training 8): killed after step 2's
    checkpoint, then --resume (to step 5) in a fresh state, a new process's. Both runs end; from
    each run's third rollout or evaluation on (the first two meet its shapes: each may replace the
    cache with a larger one, and the shapes compile again), nothing compiles, records or re-records."""
    trees = FakeCudagraphTrees(monkeypatch)
    folder = tasks.calculator_gpt2(tmp_path / "caller")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"], "reward_fn": "digits"}
                                                       for r in tasks.prompt_rows(64)])
    argv = ["--model", folder, "--dataset", prompts, "--tools", "calculator", "--steps", "5", "--prompts_per_step", "4",
            "--group_size", "2", "--max_new_tokens", "12", "--max_prompt_len", "48", "--eval_every", "1",
            "--save_every", "1", "--compile", "--out_dir", str(tmp_path / "run")]
    seen = []  # after each rollout and evaluation: (what, compilations, recordings, re-recordings)
    rollout, evaluate, sample = environment.rollout, environment.evaluate, sampling.generate_with_tools

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            if name == "rollout" and [s[0] for s in seen].count("rollout") == 2 and "--resume" not in argv:
                raise KeyboardInterrupt  # killed after step 2's checkpoint
            out = fn(*args, **kwargs)
            seen.append((name, trees.compiled, len(trees.recorded), trees.rerecorded))
            return out
        return wrapped

    monkeypatch.setattr(environment, "rollout", counted("rollout", rollout))
    monkeypatch.setattr(environment, "evaluate", counted("evaluate", evaluate))
    calls = []
    monkeypatch.setattr(sampling, "generate_with_tools", lambda *a, **k: calls.append(k["compile"]) or sample(*a, **k))
    with pytest.raises(KeyboardInterrupt):
        grpo.main(cli.parse_config(grpo.Config, argv))
    failed_run_ends()
    first, seen[:] = list(seen), []
    torch.compiler.reset()  # a new process: no graph, no trees
    trees.shutdown()
    argv.append("--resume")
    grpo.main(cli.parse_config(grpo.Config, argv))
    assert [s[0] for s in first] == ["evaluate", "rollout", "evaluate", "rollout", "evaluate"], first  # steps 0-2
    assert [s[0] for s in seen] == ["rollout", "evaluate"] * 3, seen  # steps 3-5
    assert calls and all(calls), calls  # every rollout ran the compiled tool loop
    assert first[-1][1:] == first[2][1:] and seen[-1][1:] == seen[2][1:], (first, seen)
    assert first[-1][3] == seen[-1][3] == 0, (first, seen)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 3, 4, 5]


def test_gpu_check_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA GPU.*--cpu"):
        gpu_check.main([])


@pytest.fixture
def cpu_check(tmp_path):
    """tests/gpu_check.py --cpu in this process (the scripts' runs too): (exit status, the table it wrote)."""
    def check(*args):
        code = gpu_check.main(["--cpu", "--results", str(tmp_path), "--keep", str(tmp_path / "work"), *args])
        return code, (tmp_path / "gpu-check-cpu.md").read_text()
    return check


def rows_of(table, *words):
    """The table's lines that name every word."""
    return [line for line in table.splitlines() if line.startswith("| (") and all(w in line for w in words)]


def test_gpu_check_runs_picks_grpo_runs_by_index(cpu_check):
    """--runs 1 runs the plan's second grpo.py run (activation checkpointing) and no other: a GPU
    lease of minutes picks some of the nine."""
    code, table = cpu_check("--only", "b", "--runs", "1")
    assert code == 0, table
    runs = {line.split("|")[2].split(":")[0].strip() for line in rows_of(table, "(b)")}
    assert runs == {"grpo.py qwen2 tiny, python --activation_checkpointing"}, table
    with pytest.raises(SystemExit):  # an index past the plan, refused before anything is built
        gpu_check.main(["--cpu", "--runs", "9"])


def test_gpu_check_cpu_subset_passes(cpu_check):
    """The GPU check's own code on tiny Qwen2- and Llama-shaped folders: (a) the sampler against
    the training forward and the mini-batch deal, (b) grpo.py at lr 0 with and without activation
    checkpointing and with --teacher, (e) dpo.py at lr 0 with a precomputed and a live reference, (f)
    a frozen copy's pass against the policy's, padded, packed and sharing prompts; every row passes."""
    code, table = cpu_check()
    assert code == 0, table
    assert table.startswith("# tests/gpu_check.py on CPU") and "**FAIL**" not in table
    for check, n in (("(a)", 6), ("(b)", 13), ("(e)", 4), ("(f)", 3)):
        assert len(rows_of(table, check, "| pass |")) == n, table


def _scaled_reference(freeze):
    """common.freeze (or load_frozen) with the frozen model's weights x 1.5: a reference that is
    not the policy, as a reference built from the wrong checkpoint or cast would be."""
    def wrapped(*args, **kwargs):
        model = freeze(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        return model
    return wrapped


def _shifted_old_logprobs(batched):
    """shared_prompt.planned_logprobs with the policy's (old) log-probs 0.5 too low, the reference's right."""
    def wrapped(model, *args, **kwargs):
        out = batched(model, *args, **kwargs)
        return out - 0.5 if any(p.requires_grad for p in model.parameters()) else out
    return wrapped


def _decode_ignoring_padding(next_logits):
    """The sampler's decode step attending to the prompts' left padding."""
    return lambda model, ids, mask, pos, cache, kw: next_logits(model, ids, torch.ones_like(mask), pos, cache, kw)


def _bf16_decode_ignoring_padding(next_logits):
    """The sampler's decode step attending to the padding under autocast only, as a kernel that only
    bf16 inputs reach (SDPA picks another backend for them on a GPU) ignoring the mask would: right
    in fp32, wrong in bf16, where the absolute bound could not tell it from bf16's rounding."""
    def step(model, ids, mask, pos, cache, kw):
        bf16 = torch.is_autocast_enabled(ids.device.type)
        return next_logits(model, ids, torch.ones_like(mask) if bf16 else mask, pos, cache, kw)
    return step


def _one_row_dealt_twice(deal):
    def wrapped(*args, **kwargs):
        rows = deal(*args, **kwargs).clone()
        rows[0, 1] = rows[0, 0]
        return rows
    return wrapped


PLANTS = {  # name: (where, what, the checks to run, the rows that must fail, rows that must still pass)
    "kl": (common, "freeze", _scaled_reference, "b", ["KL to the reference"], ["clip_ratio"]),
    "clipping": (shared_prompt, "planned_logprobs", _shifted_old_logprobs, "b", ["clip_ratio", "logp_diff"],
                 ["KL to the reference"]),
    "sampler": (sampling, "_next_logits", _decode_ignoring_padding, "a", ["fp32, TF32 off", "each side's error"],
                ["contiguous chunks"]),
    "bf16 sampler": (sampling, "_next_logits", _bf16_decode_ignoring_padding, "a", ["each side's error"],
                     ["fp32, TF32 off", "contiguous chunks"]),
    "deal": (grpo, "minibatch_rows", _one_row_dealt_twice, "a", ["contiguous chunks"], ["fp32, TF32 off"]),
    "dpo": (models, "load_frozen", _scaled_reference, "e", ["loss - ln 2", "rewards/margins"], []),
    "exact": (common, "freeze", _scaled_reference, "f", ["frozen copy vs the policy's"], []),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_gpu_check_fails_on_a_planted_bug(cpu_check, monkeypatch, plant):
    """Each check fails, and the command exits 1, on the bug it is there for: a KL (a reference
    that is not the policy), clipping (old log-probs off by 0.5), a sampler that attends to
    padding, a sampler that does so under autocast only (its fp32 rows still pass), a deal
    that drops a row, a DPO reference that is not the policy, a frozen copy that is not the policy
    ((f)); the checks the plant does not touch still pass."""
    module, name, plant_fn, only, failing, passing = PLANTS[plant]
    monkeypatch.setattr(module, name, plant_fn(getattr(module, name)))
    code, table = cpu_check("--only", only)
    assert code == 1, table
    for what in failing:
        assert rows_of(table, what) and all("**FAIL**" in line for line in rows_of(table, what)), (what, table)
    for what in passing:
        assert rows_of(table, what) and all("| pass |" in line for line in rows_of(table, what)), (what, table)


def test_gpu_check_reads_compilations_and_cuda_graph_recordings_from_torch_logs():
    """(d)'s reader on hand-written output in TORCH_LOGS's format (torch 2.11 and 2.13 word the
    recording differently): every compilation counted (a restart [0/0_1] is not one; the ids start
    again after torch.compiler.reset(), kv_cache.decode_cache's when its cache grows), split with
    the recordings at the `step 2` line; re-recordings (a static input moved: the H200's first (d)
    run had 254) and skipped graphs apart. After step 2 nothing may compile or record."""
    def log(*lines):
        return "\n".join(lines) + "\n"

    trace = "I1125 14:03:09.495000 7499 torch/_dynamo/symbolic_convert.py:5335] [{}] Step 1: torchdynamo start " \
            "tracing _next_logits /repo/sampling.py:78"
    record = "V1125 14:03:09.6 7499 torch/_inductor/cudagraph_trees.py:2403] [0/0] [__cudagraphs] {}"
    step = "step {}/4 | elapsed 9s | ETA 4s | reward 0.1 | kl 0 | clip_ratio/low 0 | clip_ratio/high 0"
    recording = record.format("Recording function=0, mode=INFERENCE, cuda_graph_id=0, inputs: [...]")
    good = log(trace.format("0/0"), trace.format("0/0_1"), record.format("Running warmup function=0, mode=INFERENCE"),
               recording, step.format(0), trace.format("0/0"), recording, trace.format("0/1"),  # reset, then grown
               record.format("Recording cudagraph tree for graph without symints"),
               record.format("Recording function 0 of graph recording id 3"),  # torch 2.11's wording
               step.format(1), step.format(2), step.format(3), step.format(4))
    assert gpu_check.compile_report(good) == dict(compiled=3, compiled_after=0, frames=["_next_logits"], recorded=3,
                                                  recorded_after=0, rerecorded=0, skipped=0)
    assert all(r["ok"] for r in gpu_check.compile_rows("run", good))
    after = step.format(2) + "\n"
    recorded_late = good.replace(after, after + log(recording))
    compiled_late = good.replace(after, after + log(trace.format("0/2")))
    rerecorded = good + log(record.format("Re-recording function=0, mode=INFERENCE, reason=static input moved"))
    recompiled = log(*(trace.format(f"0/{i}") for i in range(4))) + good
    skipped = good.replace("Running warmup", "skipping cudagraphs due to mutated inputs. Running warmup")
    unfinished = good.replace(after, "")
    for bad, ok in ((recorded_late, [False, False]), (compiled_late, [False, False]), (rerecorded, [True, False]),
                    (recompiled, [False, True]), (skipped, [True, False]), (unfinished, [False, False])):
        assert [r["ok"] for r in gpu_check.compile_rows("run", bad)] == ok, bad
    assert gpu_check.compile_report(rerecorded)["rerecorded"] == 1
    assert gpu_check.compile_report(recompiled)["compiled"] == 7 and gpu_check.compile_report(unfinished)["recorded_after"] is None


def test_gpu_check_memory_bound_is_ten_percent_and_one_gib():
    assert gpu_check.mem_within(10.8, 9.0) and gpu_check.mem_within(7.2, 9.0)  # 9 GiB within 1.9
    assert not gpu_check.mem_within(11.0, 9.0) and not gpu_check.mem_within(7.0, 9.0)
    assert gpu_check.mem_within(0.99, 0.0) and not gpu_check.mem_within(1.01, 0.0)


def test_the_fp32_head_on_bf16_weights_makes_no_fp32_copy_of_the_weight():
    """FSDP2 gathers bf16 weights; the LM head's logits are fp32 (lm_head.FP32Head). On a GPU
    (here its `meta` stand-in) that is one matmul with an fp32 result: no op of the forward or
    backward makes an fp32 tensor the weight's size (casting it cost ~2 GB written and read per
    decoded token at a 150k vocabulary, and kept that copy for the backward). On a CPU the same
    autograd function gives the fp32 linear's logits exactly, and its gradients up to the bf16
    rounding of the logits' gradient."""
    V, H = 64, 16
    head = lm_head.FP32Head(H, V, bias=False, device="meta", dtype=torch.bfloat16)
    x = torch.randn(2, 3, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with OpOutputs() as ops:
        logits = head(x)
        logits.sum().backward()
    assert logits.dtype == torch.float32 and x.grad.dtype == head.weight.grad.dtype == torch.bfloat16
    weight_sized = [func for func, _, outs in ops.seen for shape, dtype in outs if (shape, dtype) == ((V, H), torch.float32)]
    assert not weight_sized, weight_sized

    torch.manual_seed(0)
    head = lm_head.FP32Head(H, V, bias=False, dtype=torch.bfloat16)
    x = torch.randn(2, 3, H, dtype=torch.bfloat16, requires_grad=True)
    x32, w32 = x.detach().float().requires_grad_(), head.weight.detach().float().requires_grad_()
    g = torch.randn(2, 3, V)
    want = torch.nn.functional.linear(x32, w32)
    logits = head(x)
    assert torch.equal(logits, want)
    logits.backward(g)
    want.backward(g)
    # the logits' gradient rounded to bf16 (u = 2^-8 of each), then each product summed and rounded
    # to bf16 once more: within 2 u of the sum of its terms' magnitudes (fp32's rounding far below)
    u = 2.0 ** -8
    bound_x = 2 * u * (g.abs() @ w32.detach().abs())  # (2, 3, H)
    bound_w = 2 * u * torch.einsum("btv,bth->vh", g.abs(), x32.detach().abs())  # (V, H)
    assert ((x.grad.float() - x32.grad).abs() <= bound_x).all()
    assert ((head.weight.grad.float() - w32.grad).abs() <= bound_w).all()
