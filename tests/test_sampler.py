"""Tests of the rollout sampler (sampling.generate, sampling.sample_token).

Greedy output against model.generate for GPT-2 (absolute positions) and GPT-NeoX (rotary);
sampled output draw for draw against a cache-free reference loop; the distribution of draws
against softmax(logits / T) by a chi-square test; top-k / top-p, stop tokens, early exit.
"""
import copy
import math
import os
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

import common
import sampling
import kv_cache
import shared_prompt
from helpers import ROOT, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, dynamo_eager, forward_lengths, fp32_rtol, logprob_size, run_script
from bench.steps import real_divergences
from plumbing import models, rundir

pytestmark = pytest.mark.session_fixtures("smollm2")  # request.getfixturevalue: tests/two_processes.py

V, PAD, EOS = 16, 0, 1


def _gpt2(n_layer=2):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_layer=n_layer, n_embd=32, n_head=2, n_positions=64,
                                       bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)).eval()
    with torch.no_grad():  # a random GPT-2 barely uses positions; scale them so that wrong ones show
        model.transformer.wpe.weight.mul_(25)
    return model


def _neox():
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=V, num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=64, bos_token_id=EOS,
                                            eos_token_id=EOS, pad_token_id=PAD)).eval()


MODELS = {"gpt2": _gpt2, "neox": _neox}

# ragged lengths (left padding) and a repeated prompt (prefilled once)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [5, 6, 7], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _hf_greedy(model, ids, mask, n):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         eos_token_id=EOS, pad_token_id=PAD)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_matches_hf_generate(name):
    model = MODELS[name]()
    ids, mask = common.pad(PROMPTS, PAD, side="left")
    ours, ours_mask = sampling.generate(model, ids, mask, 24, EOS, PAD, temperature=0)
    ref = _hf_greedy(model, ids, mask, 24)
    assert torch.equal(ours, ref[:, :ours.shape[1]])
    # top_k=1 sampling at temperature 1 is greedy too, whatever the random numbers
    top1, top1_mask = sampling.generate(model, ids, mask, 24, EOS, PAD, temperature=1.0, top_k=1,
                                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1, ours) and torch.equal(top1_mask, ours_mask)
    # with no EOS, every row runs to the end
    ours, ours_mask = sampling.generate(model, ids, mask, 24, -1, PAD, temperature=0)
    assert ours.shape == (len(PROMPTS), 24) and ours_mask.all()


def _reference_loop(model, prompts, n, eos_id, stop_ids, generator, **knobs):
    """A sampler without a cache: the whole sequence through the model for every token."""
    rows = [list(p) for p in prompts]
    done = [False] * len(rows)
    out, out_mask = [[] for _ in rows], [[] for _ in rows]
    for _ in range(n):
        ids, mask = common.pad(rows, PAD, side="left")
        logits = model(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask)).logits
        tok = sampling.sample_token(logits[:, -1], generator=generator, **knobs).tolist()
        for i, t in enumerate(tok):
            out[i].append(PAD if done[i] else t)
            out_mask[i].append(0 if done[i] else 1)
            rows[i].append(t)
            done[i] = done[i] or t in (eos_id, *stop_ids)
        if all(done):
            break
    return torch.tensor(out), torch.tensor(out_mask)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(top_p=0.8)])
def test_sampling_matches_a_cache_free_loop_draw_for_draw(name, knobs):
    model = MODELS[name]()
    ids, mask = common.pad(PROMPTS, PAD, side="left")
    stop_ids = (4, 9)  # with V = 16, rows stop early, at different steps
    with torch.no_grad():
        want, want_mask = _reference_loop(model, PROMPTS, 20, EOS, stop_ids, torch.Generator().manual_seed(1),
                                          **knobs)
    got, got_mask = sampling.generate(model, ids, mask, 20, EOS, PAD, stop_ids=stop_ids,
                                      generator=torch.Generator().manual_seed(1), **knobs)
    assert torch.equal(got, want) and torch.equal(got_mask, want_mask)


def test_stop_tokens_are_kept_and_everything_after_is_masked():
    model = _gpt2()
    ids, mask = common.pad(PROMPTS * 8, PAD, side="left")
    stop_ids = [4, 9]  # a list, as grpo.py passes its truncate token; both occur in PROMPTS, where they stop nothing
    out, out_mask = sampling.generate(model, ids, mask, 30, EOS, PAD, stop_ids=stop_ids,
                                    generator=torch.Generator().manual_seed(0))
    lengths = out_mask.sum(1)
    for row, m, n in zip(out.tolist(), out_mask.tolist(), lengths.tolist()):
        assert m == [1] * n + [0] * (len(m) - n)  # a prefix
        assert all(t == PAD for t in row[n:])
        stops = [i for i, t in enumerate(row[:n]) if t in (EOS, *stop_ids)]
        assert stops in ([], [n - 1])  # the first stop token is the last kept one
        assert stops or n == len(m)
    assert lengths.min() < lengths.max()  # rows stopped at different steps


def test_early_exit_and_one_prefill_per_distinct_prompt():
    model = _gpt2()
    batches = []
    model.register_forward_pre_hook(lambda m, args, kwargs: batches.append(kwargs["input_ids"].shape), with_kwargs=True)
    prompts = [p for p in PROMPTS for _ in range(4)]  # G = 4 samples per prompt
    ids, mask = common.pad(prompts, PAD, side="left")
    out, out_mask = sampling.generate(model, ids, mask, 50, EOS, PAD, stop_ids=tuple(range(2, V)),
                                    generator=torch.Generator().manual_seed(0))
    distinct = len({tuple(p) for p in PROMPTS})
    assert batches[0] == (distinct, ids.shape[1])  # the prefill sees each distinct prompt once
    assert all(b == (len(prompts), 1) for b in batches[1:])
    R = out.shape[1]
    assert R < 50 and len(batches) == R  # stopped once every row had stopped: 1 prefill + R - 1 steps
    assert out_mask[:, -1].any()  # the last step was needed by some row


def _chi2_limit(df, z=3.3):
    """Wilson-Hilferty upper quantile of chi-square(df) at z standard deviations (p ~ 5e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_counts_match(counts, probs):
    """Pearson chi-square of counts against probs over the cells with an expected count >= 5."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= 5
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    assert counts[probs == 0].sum() == 0  # zero-probability tokens are never drawn
    assert stat < _chi2_limit(int(keep.sum()) - 1), f"chi-square {stat:.1f} over {int(keep.sum())} cells"


@pytest.mark.parametrize("T, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 0, 1.0), (1.0, 6, 1.0),
                                             (1.0, 0, 0.7), (0.8, 8, 0.9)])
def test_sample_token_distribution(T, top_k, top_p):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 2
    probs = torch.softmax(logits[0] / T, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    if top_p < 1:  # the smallest prefix of the sorted probabilities reaching top_p
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before > top_p]] = False
    want = torch.where(keep, probs, 0.0)
    want = want / want.sum()
    draws = sampling.sample_token(logits.expand(20000, V), T, top_k, top_p, torch.Generator().manual_seed(3))
    _assert_counts_match(torch.bincount(draws, minlength=V).double(), want)


def test_first_token_of_generate_follows_the_model():
    model = _neox()
    prompt = [5, 6, 7, 8]
    ids, mask = common.pad([prompt] * 20000, PAD, side="left")
    out, _ = sampling.generate(model, ids, mask, 1, EOS, PAD, temperature=0.8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    _assert_counts_match(torch.bincount(out[:, 0], minlength=V).double(), torch.softmax(logits / 0.8, -1))


def test_sample_token_refuses_nan_logits():
    logits = torch.zeros(2, V)
    logits[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        sampling.sample_token(logits)


@pytest.mark.parametrize("branch", ["cpu", "cuda"])
def test_compiled_step_matches_eager(monkeypatch, branch):
    """Greedy answers of the compiled step equal the eager step's. "cuda": the GPU's path (sampling._gpu:
    the step compiled in "reduce-overhead" mode) run on CPU tensors, where inductor leaves out the CUDA
    graph: the path's code, short of the graph."""
    monkeypatch.setattr(sampling, "_compiled", {})
    if branch == "cuda":
        monkeypatch.setattr(sampling, "_gpu", lambda device: True)
    model = _gpt2(n_layer=1)  # compiling takes ~10 s whatever the size: tracing dominates
    ids, mask = common.pad(PROMPTS, PAD, side="left")
    eager, eager_mask = sampling.generate(model, ids, mask, 12, EOS, PAD, temperature=0)
    compiled, compiled_mask = sampling.generate(model, ids, mask, 12, EOS, PAD, temperature=0, compile=True)
    assert torch.equal(compiled, eager) and torch.equal(compiled_mask, eager_mask)


def test_compiled_sampling_matches_eager():
    """The compiled decode step draws inside its graph (inductor's softmax, float64 cumsum and
    search, sampling._next_token): from the same uniforms it samples the eager step's tokens, at a
    temperature and under top-p, with the same log-probs. The prompts come G = 3 times each, as
    GRPO lays them out: compiled on CPU, each prompt's keys and values are kept once
    (shared_prompt.attention) and the static cache holds the 16 response slots alone."""
    model = _gpt2(n_layer=1)
    ids, mask = common.pad([p for p in PROMPTS for _ in range(3)], PAD, side="left")
    u = sampling.rollout_uniforms(len(ids), 12, seed=3)
    kw = dict(temperature=0.7, top_p=0.9, uniforms=u, return_logprobs=True)
    eager = sampling.generate(model, ids, mask, 12, EOS, PAD, **kw)
    compiled = sampling.generate(model, ids, mask, 12, EOS, PAD, compile=True, **kw)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert len(set(eager[0].flatten().tolist())) > 5  # sampled, not one token throughout
    # inductor's kernels against eager ones: float32's rounding of two layouts of the log-probs' terms
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1] + 12)) * logprob_size(model, 0.7)
    torch.testing.assert_close(compiled[2], eager[2], rtol=0, atol=tol)
    held = kv_cache._DECODE_CACHES[model]
    assert (held.rows, held.slots) == (len(ids), 16)  # responses only


@pytest.mark.parametrize("name", ["llama", "qwen2", "smollm2_small"])
def test_shared_prompts_sample_what_whole_rows_do_on_user_architectures(name, user_models, request, monkeypatch):
    """Compiled decoding with each prompt's keys and values kept once (RoPE, grouped-query heads, a
    BPE tokenizer's chat prompts of four lengths, each for G = 3 rows) samples the eager sampler's
    tokens (a copy of the prompt in every row's cache) from the same uniforms, with its log-probs.
    Dynamo's eager backend: the traced step is the one inductor compiles, in seconds."""
    folder = request.getfixturevalue(name) if name == "smollm2_small" else user_models[name]
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok).eval()
    dynamo_eager(monkeypatch)
    texts = [tok.apply_chat_template([{"role": "user", "content": "sort " + " ".join("97531"[:k])}], tokenize=False,
                                     add_generation_prompt=True) for k in range(1, 5) for _ in range(3)]
    ids, mask = common.pad(sampling.encode_prompts(tok, texts, 128)[0], tok.pad_token_id, side="left")
    assert shared_prompt.runs(model, ids, mask) == 3
    kw = dict(temperature=0.7, uniforms=sampling.rollout_uniforms(len(ids), 10, seed=1), return_logprobs=True)
    eager = sampling.generate(model, ids, mask, 10, tok.eos_token_id, tok.pad_token_id, **kw)
    shared = sampling.generate(model, ids, mask, 10, tok.eos_token_id, tok.pad_token_id, compile=True, **kw)
    assert torch.equal(shared[0], eager[0]) and torch.equal(shared[1], eager[1])
    assert len(set(eager[0].flatten().tolist())) > 5
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1] + 10)) * logprob_size(model, 0.7)  # two layouts
    torch.testing.assert_close(shared[2], eager[2], rtol=0, atol=tol)


def test_prompts_are_kept_once_only_for_runs_of_a_prompt_and_transformers_own_attention():
    """shared_prompt.runs: G for rows in runs of G equal prompts; 0 (each row a copy) for prompts
    not in equal runs (a prompt in two runs is kept twice), and for attention modules that are not
    transformers' own (remote code may not look its attention function up by the config's name: it
    would attend without the prompt)."""
    model = _gpt2(n_layer=1)
    a, b = [5, 6, 7], [8, 9]
    for rows, G in (([a, a, b, b], 2), ([a, a, a], 3), ([a, b, a, b], 0), ([a, a, b], 0), ([a, a, b, b, b, b], 2)):
        ids, mask = common.pad(rows, PAD, side="left")
        assert shared_prompt.runs(model, ids, mask) == G, rows
    ids, mask = common.pad([a, a], PAD, side="left")
    attention = model.transformer.h[0].attn
    attention.__class__ = type("RemoteAttention", (type(attention),), {})  # defined here, not in transformers
    assert shared_prompt.runs(model, ids, mask) == 0


def test_guards_are_checked_at_each_rollouts_first_step(monkeypatch):
    """Compiled decoding checks dynamo's guards at a rollout's first step only (sampling._guarded).
    Rollouts of other rows, of another length, and of the first shape again, one after another,
    each get their own graph and sample what the eager step does (a guard skipped at a first step
    would run the last rollout's graph: a shape error or other tokens). Dynamo's eager backend:
    the guards are dynamo's whatever compiles the graph, and it traces in seconds."""
    model = _gpt2(n_layer=1)
    dynamo_eager(monkeypatch)
    for rows, new_tokens in [(5, 8), (3, 8), (5, 20), (5, 8)]:
        ids, mask = common.pad(PROMPTS[:rows], PAD, side="left")
        want = sampling.generate(model, ids, mask, new_tokens, EOS, PAD, generator=torch.Generator().manual_seed(rows))
        got = sampling.generate(model, ids, mask, new_tokens, EOS, PAD, generator=torch.Generator().manual_seed(rows),
                                compile=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, new_tokens)


def test_a_smaller_compiled_rollout_after_a_larger_one_samples_what_a_fresh_one_does(monkeypatch):
    """Compiled decoding keeps its static cache through a run, sized for the largest rollout: a
    rollout of 3 rows after one of 5 decodes in part of that cache. Its tokens and log-probs at a
    temperature equal those of the same rollout on a fresh copy of the model (a cache of its own), to
    the bit: both prompts' longest row is 6 tokens, so the same slots and the same float operations.
    Planted and failing here: the smaller rollout reading its cache's values from the keys, which
    kept its tokens and moved its log-probs (by 2.8e-5 here) and passed
    test_guards_are_checked_at_each_rollouts_first_step (it compares tokens only). Dynamo's eager
    backend, as there."""
    model = _gpt2(n_layer=1)
    fresh = copy.deepcopy(model)
    fn = sampling._next_token_unfused
    monkeypatch.setattr(sampling, "_compiled", {fn: torch.compile(fn, backend="eager", dynamic=False)})
    kw = dict(temperature=0.7, return_logprobs=True, compile=True)
    ids, mask = common.pad(PROMPTS[:3] + [[5, 6, 7], [14, 2]], PAD, side="left")  # 5 rows, the longest 6 tokens
    sampling.generate(model, ids, mask, 8, EOS, PAD, uniforms=sampling.rollout_uniforms(5, 8, seed=0), **kw)
    ids, mask = common.pad(PROMPTS[:3], PAD, side="left")  # 3 rows, the longest 6 tokens
    u = sampling.rollout_uniforms(3, 8, seed=1)
    after = sampling.generate(model, ids, mask, 8, EOS, PAD, uniforms=u, **kw)
    alone = sampling.generate(fresh, ids, mask, 8, EOS, PAD, uniforms=u, **kw)
    assert all(torch.equal(a, b) for a, b in zip(after, alone)), [(a - b).abs().max() for a, b in zip(after, alone)]


def test_past_dynamos_recompile_limit_a_new_shape_decodes_eagerly(monkeypatch):
    """Once the compiled step holds dynamo's recompile_limit graphs, a rollout of a new shape runs its
    first step eagerly (dynamo's fallback) and keeps the guards on for the rest (sampling._guarded):
    it samples what the eager sampler does instead of raising at its second step."""
    model = _gpt2(n_layer=1)
    torch._dynamo.reset()
    dynamo_eager(monkeypatch)
    with torch._dynamo.config.patch(recompile_limit=2):
        for rows in (5, 4, 3):  # the third shape is past the limit
            ids, mask = common.pad(PROMPTS[:rows], PAD, side="left")
            want = sampling.generate(model, ids, mask, 8, EOS, PAD, generator=torch.Generator().manual_seed(rows))
            got = sampling.generate(model, ids, mask, 8, EOS, PAD, generator=torch.Generator().manual_seed(rows),
                                    compile=True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    torch._dynamo.reset()


def _fsdp_worker():
    """Run by torchrun (see below): each rank samples its own prompts with the FSDP2-sharded
    model inside common.unsharded, stopping at a different step from the other rank, eager and
    compiled (from a copy outside FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    d = common.setup_distributed()
    model = _gpt2()
    whole = copy.deepcopy(model)
    common.shard_model(model, d)
    ids, mask = common.pad(PROMPTS[d.rank::2], PAD, side="left")
    n, stop_ids = (6, ()) if d.rank == 0 else (30, (4, 9))

    def sampled(m, compile=False):
        return sampling.generate(m, ids, mask, n, -1, PAD, stop_ids=stop_ids, generator=torch.Generator().manual_seed(0),
                                 compile=compile)

    with common.unsharded(model):
        got = sampled(model)
    want = sampled(whole)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), d.rank
    # the ranks meet again afterwards: the sum of their step counts, each recomputed on every rank
    # by the cache-free loop (draw for draw the same sampler), must come back from the all-reduce.
    # Asserted, not printed: a print passes whatever the collective returns
    with torch.no_grad():
        lengths = [_reference_loop(whole, PROMPTS[r::2], n_r, -1, stops_r, torch.Generator().manual_seed(0))[0].shape[1]
                   for r, (n_r, stops_r) in enumerate([(6, ()), (30, (4, 9))])]
    assert lengths[0] != lengths[1], lengths  # the ranks really stop at different steps
    steps = common.all_reduce_sum(torch.tensor([got[0].shape[1]]), d).item()
    assert steps == sum(lengths), (d.rank, steps, lengths)
    # compiled decoding under torchrun (the GPU's path, dynamo's eager backend): from a copy of the model outside
    # FSDP (sampling._decoder), refreshed from the gathered weights; the same tokens as the whole model's
    sampling._compile = lambda fn, gpu: torch.compile(fn, backend="eager", dynamic=False)
    sampling._gpu = lambda device: True
    for _ in range(2):  # the second call refreshes the same copy in place
        with common.unsharded(model):
            compiled = sampled(model, compile=True)
    decoder, pairs = kv_cache._DECODERS[model]
    assert not isinstance(decoder, FSDPModule) and not any(hasattr(p, "full_tensor") for p in decoder.parameters())
    assert decoder.config._attn_implementation == "decode" and len(pairs) >= len(list(whole.parameters()))
    assert torch.equal(compiled[0], want[0]) and torch.equal(compiled[1], want[1]), d.rank
    common.print0(f"fsdp ok: {steps} steps over 2 ranks ({lengths[0]} + {lengths[1]}), compiled from a copy too")
    del model  # FSDP's device mesh holds the process group: release it before the group is destroyed
    torch.distributed.barrier()
    rundir.release()


def test_generate_under_fsdp2_with_ranks_stopping_at_different_steps():
    r = run_script([os.path.abspath(__file__)], nproc=2,
                   env={**SUBPROCESS_ENV_NO_TOKENIZER_THREADS, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-3000:]
    assert "compiled from a copy too" in r.stdout


if __name__ == "__main__":
    _fsdp_worker()
    # its line printed: skip the interpreter's finalisation, where gloo's threads can std::terminate
    # the process after the group is destroyed (once in a suite run under load; tests/dist_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_rollout_uniforms_make_samples_independent_of_how_rows_are_split():
    """Drawn with sampling.rollout_uniforms, a row's completion depends on its prompt and its global
    index only: the whole batch at once, or split in two as over two ranks (each half padded
    to its own length), gives the same tokens. A per-call generator would not."""
    model = _gpt2()
    n = 12
    u = sampling.rollout_uniforms(len(PROMPTS), n, seed=3)
    whole = sampling.generate(model, *common.pad(PROMPTS, PAD, side="left"), n, EOS, PAD, uniforms=u)
    halves = [sampling.generate(model, *common.pad(PROMPTS[s], PAD, side="left"), n, EOS, PAD, uniforms=u[s])
              for s in (slice(0, 2), slice(2, None))]
    for i, (tok, m) in enumerate(zip(*whole)):
        h, j = (0, i) if i < 2 else (1, i - 2)
        got_tok, got_m = halves[h][0][j], halves[h][1][j]
        assert tok[m.bool()].tolist() == got_tok[got_m.bool()].tolist(), i
    assert not torch.equal(u, sampling.rollout_uniforms(len(PROMPTS), n, seed=4))
    gen = [sampling.generate(model, *common.pad(PROMPTS[s], PAD, side="left"), n, EOS, PAD,
                           generator=torch.Generator().manual_seed(3)) for s in (slice(0, 2), slice(2, None))]
    assert gen[1][0][0].tolist() != whole[0][2][:gen[1][0].shape[1]].tolist()


def test_every_stream_of_a_step_draws_its_own_numbers():
    """sampling.stream_seed over every (seed, step, stream, round, index) of a grid: each seed fits
    the 32 bits a CPU generator (mt19937) keeps, and each seeds a generator whose first draws no
    other's repeat. Fields packed above bit 31 of the seed would give one stream to all of a step's
    streams, rounds and prompts (stream_seed(0, 1, stream=s) for s = 0, 1, 2: the same torch.rand)."""
    keys = [(seed, step, stream, round_, index) for seed in (0, 1) for step in (1, 2, 3) for stream in (0, 1, 2)
            for round_ in (0, 1, 2) for index in range(8)]
    seeds = [sampling.stream_seed(seed, step, stream, index=index, round_=round_)
             for seed, step, stream, round_, index in keys]
    assert all(0 <= s < 2**32 for s in seeds)
    draws = {tuple(torch.rand(2, generator=torch.Generator().manual_seed(s)).tolist()) for s in seeds}
    assert len(draws) == len(keys)
    assert seeds == [sampling.stream_seed(*k[:3], index=k[4], round_=k[3]) for k in keys]  # a function of the key alone


def test_greedy_evaluation_stops_at_every_end_of_turn_id_of_the_generation_config(monkeypatch):
    """Llama-3 and Qwen instruct list two ids in generation_config.eos_token_id (end of turn,
    end of text); stopping only at the tokenizer's EOS ran answers past the end of the turn. The
    ids reach generate as it is called by the evaluation (and grpo.py, reward.py)."""
    import tasks

    tok = tasks.char_tokenizer()
    model = GPT2LMHeadModel(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2))
    end_of_turn = tok.convert_tokens_to_ids("|")
    model.generation_config.eos_token_id = [end_of_turn, tok.eos_token_id]
    assert sampling.stop_token_ids(tok, model) == [tok.eos_token_id, end_of_turn]
    model.generation_config.eos_token_id = end_of_turn  # an int works too
    assert sampling.stop_token_ids(tok, model) == [tok.eos_token_id, end_of_turn]
    seen = []
    real = sampling.generate

    def spy(*args, **kw):
        seen.append((kw["eos_id"], kw["stop_ids"]))
        return real(*args, **kw)

    monkeypatch.setattr(sampling, "generate", spy)
    sampling.evaluate_generations(model, tok, ["sort 3 1 2 ="], tasks.REWARD_FNS["sort"], common.Dist(),
                               max_prompt_len=16, max_new_tokens=4)
    assert seen == [(tok.eos_token_id, [end_of_turn])]


def test_greedy_evaluation_scores_each_prompt_against_its_own_answer():
    """A rule that needs the row's reference (arith's `math`) gets each prompt's own answer,
    across evaluation batches; the mean and the exact share are of those rewards."""
    import tasks

    tok = tasks.char_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2)).eval()
    prompts = [f"q{i} =" for i in range(7)]
    seen = {}

    def rule(prompt, completion, answer=None):
        seen[prompt] = answer
        return 1.0 if int(answer) % 3 == 0 else 0.25

    out = sampling.evaluate_generations(model, tok, prompts, rule, common.Dist(), max_prompt_len=16, max_new_tokens=3,
                                     batch_size=3, answers=[str(10 * i) for i in range(7)])
    assert seen == {f"q{i} =": str(10 * i) for i in range(7)}
    assert out == pytest.approx({"eval/gold_reward": (3 + 4 * 0.25) / 7, "eval/exact_match": 3 / 7})


def test_a_response_decodes_to_exactly_the_text_that_follows_its_prompt():
    """A SentencePiece-style (Metaspace) decoder drops the leading space of a text decoded on its
    own: " 19" after "what is 12 + 7?" came back as "19", and a reward model with another
    tokenizer scored other text than the policy wrote."""
    from helpers import family_tokenizer

    for kind in ("metaspace", "bpe", "bos"):
        tok = family_tokenizer(kind)
        prompt, completion = "what is 12 + 7?", " 19 is the number"
        p = tok(prompt)["input_ids"]
        full = tok(prompt + completion)["input_ids"]
        assert full[:len(p)] == p, kind  # the prompt's tokens are a prefix: the split is exact
        r = torch.tensor([full[len(p):] + [tok.eos_token_id]])
        mask = torch.ones_like(r)
        mask[0, -1] = 0  # the EOS is not text
        p_ids = torch.tensor([[tok.pad_token_id] * 2 + p])  # left-padded, as the sampler's prompts are
        assert sampling.decode_responses(tok, r, mask, p_ids) == [completion], kind
        if kind == "metaspace":  # what decoding alone gave
            assert sampling.decode_responses(tok, r, mask) == [completion.lstrip()]


def test_the_sampler_benchmark_counts_a_divergence_only_past_a_bf16_tie():
    """`python -m bench rollout` compares its greedy rows with model.generate's in bf16, where a near-tie
    of the two largest logits may break either way: a row counts as a real divergence only where
    the reference's top-2 logits at the first differing token are more than one bf16 step apart.
    Identical rows count nothing; a row changed at a clear maximum counts; the same change where
    the two candidates' logits are made exactly equal (their head rows equal) does not."""
    tok = models.load_tokenizer("tiny")
    torch.manual_seed(0)
    model = models.load_model("tiny", tok).eval()
    ids, mask = common.pad([tok("sort 3 1 =")["input_ids"], tok("sort 9 2 =")["input_ids"]], tok.pad_token_id,
                           side="left")
    ref = sampling.generate(model, ids, mask, 6, eos_id=-1, pad_id=tok.pad_token_id, temperature=0)[0]
    assert not real_divergences(model, ids, mask, ref, ref, tok.pad_token_id).any()
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids[:1], ref[:1, :2]], 1)).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    ours = ref.clone()
    ours[0, 2] = runner_up  # row 0 parts at its third token
    assert real_divergences(model, ids, mask, ours, ref, tok.pad_token_id).tolist() == [True, False]
    with torch.no_grad():  # the head rows of the top two tokens made equal: their logits tie exactly
        head = model.get_output_embeddings().weight
        head[runner_up] = head[int(ref[0, 2])]
    assert real_divergences(model, ids, mask, ours, ref, tok.pad_token_id).tolist() == [False, False]


def test_compiled_decoding_under_autocast_reads_bf16_weights_cast_once_per_rollout(monkeypatch):
    """Under plain `python --compile` on a GPU the decode step runs inside autocast, and a compiled
    graph casts every fp32 weight to bf16 on every token (autocast's cast cache serves eager code
    only). generate decodes from sampling._decoder's copy: bf16 copies of the linear weights and of the
    head (its own: the tied embedding stays the model's fp32) made once, refreshed in place per call
    (fixed addresses for the CUDA graph), the same numbers. On the CPU, with CPU autocast standing in and
    the step left uncompiled (its inputs are what a graph would see): no weight cast in a decode
    forward, logits equal to autocast's own, refreshed after an update, the embeddings shared."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import tasks

    tok = tasks.char_tokenizer()
    model = models.load_model("tiny", tok)
    weights = {p.data_ptr() for p in model.parameters()}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                self.n += 1
            return func(*args, **(kwargs or {}))

    ids = torch.tensor([tok("sort 3 1 2 =")["input_ids"]] * 2)
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    seen = []
    monkeypatch.setattr(sampling, "_step_fn", lambda fn, compile, device: lambda m, *a, **k: (
        seen.append(m), fn(m, *a, **k))[1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sampling.generate(model, ids, mask, 4, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=0,
                          compile=True)
        decoder = kv_cache.decoder(model)
        assert seen and all(m is decoder for m in seen)  # every decode step, not the model
        with Casts() as casts:
            got = decoder(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert casts.n == 0
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # autocast casting its weights
        assert torch.equal(got, want)
    linears = [m.weight for m in decoder.modules() if type(m).__name__ == "Conv1D"] + [decoder.lm_head.weight]
    assert len(linears) > 1 and all(w.dtype == torch.bfloat16 for w in linears)
    assert decoder.transformer.wte.weight is model.transformer.wte.weight  # the embeddings shared, fp32
    assert decoder.config._attn_implementation == "decode" and model.config._attn_implementation != "decode"
    ptrs = [w.data_ptr() for w in linears]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    assert kv_cache.decoder(model) is decoder and [w.data_ptr() for w in linears] == ptrs
    src = [m.weight for m in model.modules() if type(m).__name__ == "Conv1D"] + [model.lm_head.weight]
    assert all(torch.equal(w, s.to(torch.bfloat16)) for w, s in zip(linears, src))