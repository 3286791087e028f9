"""shared_prompt: each distinct prompt computed once for the rows that share it. Its log-probs,
entropies and gradients against common.response_logprobs' padded forward (the independent
computation: every row's prompt computed again), on GPT-2 (absolute positions), Llama, Qwen2 and
SmolLM2's shape (RoPE, grouped-query attention), with left-padded prompts of several lengths and
right-padded responses; the planted bug: rows given another prompt's keys and values."""
import functools
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import shared_prompt
import tasks
from helpers import (adam_drift, assert_gradients_agree, assert_layouts_agree, assert_runs_agree, checkpoint_config,
                     checkpoint_weights, forward_lengths, fp32_rtol, gradient_lengths, logprob_size, max_abs_diff,
                     read_metrics, run_here, write_jsonl)
from plumbing import models


def _groups(vocab, prompt_lens=(5, 2, 9), group=3, seed=0):
    """Groups of `group` rows after one prompt each (prompts of prompt_lens tokens, left-padded),
    responses of 1-4 tokens (right-padded): ids, attention mask (B, P+R), response mask (B, R)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i, n in enumerate(prompt_lens):
        p = torch.randint(3, vocab, (n,), generator=g).tolist()
        for k in range(group):
            prompts.append(p)
            responses.append(torch.randint(3, vocab, (1 + (i + k) % 4,), generator=g).tolist())
    return common.join_prompt_response(prompts, responses, pad_id=0)


def _models(user_models, smollm2_small):
    yield "tiny", models.load_model("tiny", tasks.char_tokenizer())
    for name, path in (("llama", user_models["llama"]), ("qwen2", user_models["qwen2"]), ("smollm2", smollm2_small)):
        torch.manual_seed(0)
        yield name, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_shared_prompt_logprobs_and_gradients_equal_the_padded_ones(user_models, smollm2_small, entropy_grad):
    """Log-probs and entropies of the real response tokens at temperature 0.7, a masked token-mean
    loss through both, and every parameter's gradient: shared prompts against the padded forward
    (fp32, 1e-5)."""
    for name, model in _models(user_models, smollm2_small):
        ids, attn, resp = _groups(model.config.vocab_size)
        out = []
        for fn in (common.response_logprobs, functools.partial(shared_prompt.response_logprobs, shared=True)):
            model.zero_grad()
            logps, ent = fn(model, ids, attn, resp.shape[1], temperature=0.7, with_entropy=True,
                            entropy_grad=entropy_grad)
            loss = ((logps + 0.1 * ent) * resp).sum() / resp.sum()
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            out.append((logps.detach() * resp, ent.detach() * resp, loss.detach(), grads))
        # float32's rounding of the two layouts (helpers.fp32_rtol over the model's sums), of the
        # log-probs' terms' size (entropies and the loss no larger); the gradients in norm
        T = ids.shape[1]
        for padded, shared in zip(out[0][:3], out[1][:3]):
            assert_layouts_agree(shared, padded, fp32_rtol(forward_lengths(model.config, T)),
                                 1.1 * logprob_size(model, 0.7), name)
        assert_gradients_agree(out[1][3], out[0][3], fp32_rtol(gradient_lengths(model.config, T, ids.numel(), 0)), name)


def test_planned_and_sequence_logprobs_equal_common_ones(user_models):
    """The no-gradient passes (micro-batches of 4 rows: groups cut across them, shared where that
    computes less) and DPO's summed log-probs (chosen and rejected after one prompt) against common's
    padded forward of each row."""
    model = AutoModelForCausalLM.from_pretrained(user_models["qwen2"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size, prompt_lens=(4, 7, 3, 6), group=3, seed=1)
    d, R = common.Dist(), resp.shape[1]
    plan = shared_prompt.plan(torch.arange(len(ids))[None], ids, attn, R, 4, d, models=[model])
    assert [bool(s) for _, _, s in plan] == [True]
    with torch.no_grad():
        want = torch.cat([common.response_logprobs(model, ids[i:i + 1], attn[i:i + 1], R) for i in range(len(ids))])
    got = shared_prompt.planned_logprobs(model, ids, attn, R, plan, d)
    rtol = fp32_rtol(forward_lengths(model.config, ids.shape[1]))  # float32's rounding of two layouts
    assert_layouts_agree(got * resp, want * resp, rtol, logprob_size(model))
    order = torch.tensor([0, 2, 4, 1, 3, 5])  # DPO's layout: chosen of pairs 0-2, then their rejected
    batch = [x[order] for x in _groups(model.config.vocab_size, prompt_lens=(4, 7, 3), group=2, seed=2)]
    layout = shared_prompt.layout(batch, d, models=[model])
    assert layout == (False, [0, 1, 2, 0, 1, 2])  # chosen i and rejected i: pair i's prompt
    with torch.no_grad():  # sums of R log-probs: R of their sizes, one sum more
        R = batch[2].shape[1]
        assert_layouts_agree(shared_prompt.sequence_logprobs(model, batch, d, *layout),
                             common.sequence_logprobs(model, batch, d),
                             fp32_rtol(forward_lengths(model.config, batch[0].shape[1]) + [R]), R * logprob_size(model))


def test_rows_of_distinct_prompts_take_the_padded_forward(user_models):
    """No two rows share a prompt: common.response_logprobs itself, the same floats."""
    model = AutoModelForCausalLM.from_pretrained(user_models["llama"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size, group=1)
    with torch.no_grad():
        assert torch.equal(shared_prompt.response_logprobs(model, ids, attn, resp.shape[1], shared=True),
                           common.response_logprobs(model, ids, attn, resp.shape[1]))


def test_rows_given_another_prompts_keys_differ(user_models):
    """The planted bug: groups that put rows of other prompts together (each row continuing from its
    group's first row's prompt). And the structure each caller gives (GRPO's rollout: rows r // G;
    DPO's pairs: rows i and B + i) is the one comparing the prompts finds, on their own layouts."""
    model = AutoModelForCausalLM.from_pretrained(user_models["llama"], dtype=torch.float32).eval()
    ids, attn, resp = _groups(model.config.vocab_size)
    R = resp.shape[1]
    with torch.no_grad():
        want = common.response_logprobs(model, ids, attn, R) * resp
        got = shared_prompt.response_logprobs(model, ids, attn, R, shared=[0] * len(ids)) * resp
    assert (got - want).abs().max() > 1e-3
    assert shared_prompt.groups_of(ids, attn, ids.shape[1] - R) == [r // 3 for r in range(len(ids))]  # G = 3
    plan = shared_prompt.plan(torch.arange(len(ids))[None], ids, attn, R, 4, common.Dist(), models=[model],
                              group_size=3)
    found = shared_prompt.plan(torch.arange(len(ids))[None], ids, attn, R, 4, common.Dist(), models=[model])
    assert [[c.tolist() for c in chunks] for chunks, _, _ in plan] == [[c.tolist() for c in chunks] for chunks, _, _ in found]
    assert [s for _, _, s in plan] == [s for _, _, s in found] and plan[0][2]
    order = torch.tensor([0, 3, 6, 1, 4, 7])  # two rows of each prompt, in DPO's layout
    assert shared_prompt.layout([x[order] for x in (ids, attn, resp)], common.Dist(), models=[model])[1] == \
        shared_prompt.groups_of(ids[order], attn[order], ids.shape[1] - R)


def _long_tail(vocab, group=4, n_prompts=4, seed=3):
    """Groups of `group` rows after prompts of 24 and 30 tokens, responses of 1 to 6 tokens (most
    short): packing would cut micro-batches of more rows than a padded one holds."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(n_prompts):
        p = torch.randint(3, vocab, (24 + 6 * (i % 2),), generator=g).tolist()
        for k in range(group):
            prompts.append(p)
            responses.append(torch.randint(3, vocab, (6 if k == 0 else 1 + k % 3,), generator=g).tolist())
    return common.join_prompt_response(prompts, responses, pad_id=0)


def _independent_flops(model, ids, attn, R, chunks, shared, packed):
    """FLOPs per layer of the forwards each micro-batch takes, in packing_pays' units (a token's
    projections and MLP; a query-key pair 1 / (6 h) of one), counted from the rows themselves:
    shared, each distinct prompt's sequence of its P tokens and g response slots of R (g: the most rows
    a prompt has), each token over the whole sequence (a 4-D mask's dense attention); packed under
    sdpa_packed, each row's own tokens over themselves; padded, every row's T over T."""
    import collections

    P, T, w = ids.shape[1] - R, ids.shape[1], 1 / (6 * model.config.hidden_size)
    total = 0.0
    for r in chunks:
        counts = collections.Counter(tuple(x) for x in torch.cat([ids[r, :P], attn[r, :P]], 1).tolist())
        U, L = len(counts), P + max(counts.values()) * R
        if shared and U < len(r):
            total += U * L * (1 + w * L)
        elif packed:
            total += sum(n * (1 + w * n) for n in attn[r].sum(-1).tolist())
        else:
            total += len(r) * T * (1 + w * T)
    return total


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_share_prompts_within_a_padded_micro_batch_where_that_computes_less(packed):
    """(a) The memory budget: shared micro-batches hold at most rows_per_forward rows, the padded
    micro-batch's, even where packing cuts micro-batches of more rows by tokens (the planted bug:
    the shared forward run on packing's cut, more rows padded than the budget). The choice: the
    cut of fewer FLOPs by an independent count of both (sharing over packing here; with prompts
    shorter than responses, packing's); every row once, in order; torchrun and activation
    checkpointing: common's cut, not shared."""
    model = models.packed_attention(models.load_model("tiny", tasks.char_tokenizer()))  # packed rows: their own
    ids, attn, resp = _long_tail(model.config.vocab_size)
    R, rows, d = resp.shape[1], torch.arange(len(ids)), common.Dist()
    chunks, shared = shared_prompt.micro_batches(rows, ids, attn, R, 4, d=d, packed=packed, models=[model])
    assert torch.equal(torch.cat(chunks), rows)
    assert shared and all(len(r) <= 4 for r in chunks)
    cut = common.micro_batches(rows, attn, 4, d, packed)
    assert not packed or max(len(r) for r in cut) > 4  # packing's cut holds more rows than the budget here
    assert _independent_flops(model, ids, attn, R, chunks, True, packed) < \
        _independent_flops(model, ids, attn, R, cut, False, packed)
    # long responses after a one-token prompt: packing computes less than sharing
    short = _groups(model.config.vocab_size, prompt_lens=(1, 1), group=2)
    got = shared_prompt.micro_batches(torch.arange(4), *short[:2], short[2].shape[1], 2, d=d, packed=True, models=[model])
    assert got[1] is False
    assert shared_prompt.micro_batches(rows, ids, attn, R, 4, d=common.Dist(world_size=2), models=[model])[1] is False
    assert shared_prompt.micro_batches(rows, ids, attn, R, 4, d=d, models=[model], enabled=False)[1] is False
    checkpointed = models.packed_attention(models.load_model("tiny", tasks.char_tokenizer()))
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})  # shard_model's
    assert shared_prompt.micro_batches(rows, ids, attn, R, 4, d=d, models=[checkpointed])[1] is False
    # one decision for every model of the pass: a frozen reference that could share follows the policy that cannot
    assert shared_prompt.micro_batches(rows, ids, attn, R, 4, d=d, models=[checkpointed, model])[1] is False
    assert shared_prompt.micro_batches(rows, ids, attn, R, 4, d=d, models=[model, None])[1]


@pytest.mark.parametrize("script", ["grpo", "dpo"])
def test_scripts_sharing_prompts_equal_not_sharing(tmp_path, user_models, script, monkeypatch):
    """grpo.py (the reference pass and the update; 2 passes over 2 mini-batches, --grad_accum 2,
    --beta 0.05) on the Llama-shaped model, and dpo.py (the policy and a live reference) on the
    Qwen2-shaped one: --shared_prompt against --no-shared_prompt, every step's loss, KL and grad norm
    and the final weights (fp32, 1e-5); the shared runs did compute prompts once."""
    import test_user_path

    shared = []
    real = shared_prompt._slots
    monkeypatch.setattr(shared_prompt, "_slots", lambda *a: shared.append(1) or real(*a))
    runs = []
    for flag in ("--shared_prompt", "--no-shared_prompt"):
        folder = tmp_path / flag
        folder.mkdir()
        if script == "grpo":
            rows = [{"prompt": r["prompt"], "reward_fn": "digits"} for r in tasks.prompt_rows(16)]
            argv = ["grpo.py", "--model", user_models["llama"], "--dataset", write_jsonl(folder / "p.jsonl", rows),
                    "--steps", "2", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8",
                    "--max_prompt_len", "64", "--grad_accum", "2", "--beta", "0.05", "--lr", "0",
                    "--warmup_steps", "0", "--eval_every", "100", "--out_dir", str(folder / "run")]
        else:
            argv = test_user_path.dpo_argv(folder, user_models, "--no-precompute_ref", "--grad_accum", "2")
        n = len(shared)
        proc = run_here([*argv, flag])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (len(shared) > n) == (flag == "--shared_prompt")
        runs.append(folder / "run")
    one, two = ([r for r in read_metrics(out) if "loss" in r] for out in runs)
    assert len(one) >= 2 and all(r["grad_norm"] > 0 for r in one)
    # within float32's rounding of the layouts and Adam's drift (helpers.assert_runs_agree); grpo.py
    # at lr 0, where every pass of every step runs on the same weights and every metric is compared
    lr, config = max(r["lr"] for r in one), checkpoint_config(runs[0])
    logps = ["logps/chosen", "logps/rejected"] if script == "dpo" else [1.5]  # a loss's terms: log-probs, advantages
    assert_runs_agree(one, two, config, length=128 + 16, lr=lr, norm_terms=0, scales={"loss": logps, "kl": [1.0]},
                      keys=("loss", "grad_norm") + (("kl",) if script == "grpo" else ()))
    assert max_abs_diff(checkpoint_weights(runs[0]), checkpoint_weights(runs[1])) <= adam_drift(lr, len(one))


@pytest.mark.parametrize("G, heads, kv_heads", [(3, 4, 2), (2, 2, 2), (1, 4, 1)])
def test_shared_prompt_attention_is_attention_over_whole_rows(G, heads, kv_heads):
    """shared_prompt.attention (each prompt's keys and values once for its G rows, then each row's
    response slots) against SDPA over whole rows: each row's prompt keys and values copied in front
    of its response slots, one mask. Distinct values throughout: grouped queries (4 heads on 2 or 1
    key/value heads, as Llama's GQA), a left-padded prompt, response slots past the written ones."""
    U, P, S, D, written = 2, 5, 6, 8, 4
    B = U * G
    g = torch.Generator().manual_seed(0)
    query = torch.randn(B, heads, 1, D, generator=g)
    pk, pv = (torch.randn(U, kv_heads, P, D, generator=g) for _ in range(2))
    rk, rv = (torch.randn(B, kv_heads, S, D, generator=g) for _ in range(2))
    pmask = torch.tensor([[False, False, True, True, True], [True] * P])
    layer = types.SimpleNamespace(cumulative_length=torch.tensor(written))
    prompts = shared_prompt.PromptKV([pk], [pv], pmask, types.SimpleNamespace(layers=[layer]))
    got, _ = shared_prompt.attention(types.SimpleNamespace(layer_idx=0), query, rk, rv, None, scaling=0.3,
                                     prompts=prompts)
    row = torch.arange(U).repeat_interleave(G)  # each row's prompt
    k, v = (torch.cat([p[row], r], 2).repeat_interleave(heads // kv_heads, 1) for p, r in ((pk, rk), (pv, rv)))
    real = torch.cat([pmask[row], (torch.arange(S) < written).expand(B, S)], 1)
    want = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=real[:, None, None], scale=0.3)
    # float32's rounding of the two: scores (D terms), the softmax's and the values' sums (P + S keys), of |v|'s size
    assert_layouts_agree(got, want.transpose(1, 2), fp32_rtol([D, P + S, P + S]), pv.abs().max().item() +
                         rv.abs().max().item())
