"""Packed training passes (common.pack, response_logprobs(packed=True), micro_batches,
packing_works): the packed log-probs, entropies, losses and gradients equal the padded ones in
fp32 on GPT-2 (tiny), the Llama- and Qwen2-shaped user models (RoPE, GQA) and SmolLM2's shapes;
a model whose attention ignores restarting position ids is detected and stays padded."""
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import shared_prompt
import tasks
from helpers import (adam_drift, assert_gradients_agree, assert_layouts_agree, assert_runs_agree, checkpoint_config,
                     checkpoint_weights, forward_lengths, fp32_rtol, gradient_lengths, logit_size, logprob_size,
                     max_abs_diff, read_metrics, run_here, run_script, write_jsonl)
from plumbing import models


def _batch(vocab, lengths, seed=0):
    """A prompt-response batch of distinct lengths (prompts 2-9, responses 1-7 tokens), ids in [3, vocab)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in lengths]
    return common.join_prompt_response(prompts, responses, pad_id=0)


LENGTHS = [(5, 3), (2, 7), (9, 1), (4, 4), (3, 6)]


def _models(user_models, smollm2_small):
    tiny = models.load_model("tiny", tasks.char_tokenizer())
    with torch.no_grad():  # a random GPT-2 barely uses positions; scale them up so that getting them wrong shows
        tiny.transformer.wpe.weight.mul_(25)
    yield "tiny", tiny
    for name, path in (("llama", user_models["llama"]), ("qwen2", user_models["qwen2"]), ("smollm2", smollm2_small)):
        torch.manual_seed(0)
        yield name, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_pack_puts_real_tokens_back_to_back_with_restarting_positions():
    ids, mask, _ = common.join_prompt_response([[5, 6], [7]], [[8], [9, 10]], pad_id=0)  # (2, 4): [5 6 8 0] [0 7 9 10]
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask))
    model = models.load_model("tiny", tasks.char_tokenizer())
    index = common.pack(model, dict(kw))
    assert index.tolist() == [[0, 1, 2, -1], [-1, 3, 4, 5]]
    index = common.pack(models.packed_attention(model), kw)
    flat, pos = kw["input_ids"], kw["position_ids"]
    assert kw["attention_mask"] is None and kw["cu_seq_lens_q"].tolist() == [0, 3, 6]  # the rows' bounds (sdpa_packed)
    assert flat.tolist() == [[5, 6, 8, 7, 9, 10]] and pos.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert index.tolist() == [[0, 1, 2, -1], [-1, 3, 4, 5]]


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_packed_logprobs_losses_and_gradients_equal_the_padded_ones(user_models, smollm2_small, entropy_grad):
    """Per model: log-probs and entropies of the real response tokens, a masked token-mean loss and
    every parameter's gradient (through the entropy or not), packed against padded (fp32, 1e-5).
    Planted: position ids that do not restart (one long sequence: rows see each other) fail on
    every model (next test)."""
    for name, model in _models(user_models, smollm2_small):
        assert models.packing_works(model, torch.device("cpu")), name
        ids, attn, resp = _batch(model.config.vocab_size, LENGTHS)
        R = resp.shape[1]
        grads, out = [], []
        for packed in (False, True):
            model.zero_grad()
            logps, ent = common.response_logprobs(model, ids, attn, R, temperature=0.7, with_entropy=True,
                                                  entropy_grad=entropy_grad, packed=packed)
            loss = ((logps + 0.1 * ent) * resp).sum() / resp.sum()
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
            out.append((logps * resp, ent * resp, loss))
        # float32's rounding of the two layouts (helpers.fp32_rtol over the model's sums), of the
        # log-probs' terms' size; the gradients in norm
        T = ids.shape[1]
        for padded, packed in zip(out[0], out[1]):
            assert_layouts_agree(packed, padded, fp32_rtol(forward_lengths(model.config, T)),
                                 1.1 * logprob_size(model, 0.7), name)
        assert_gradients_agree(grads[1], grads[0], fp32_rtol(gradient_lengths(model.config, T, ids.numel(), 0)), name)
        assert (out[1][0] != 0).sum() == resp.sum()  # every real response token scored, padding 0


def test_packed_rows_that_see_each_other_differ(user_models, smollm2_small, monkeypatch):
    """The planted bug behind the test above: position ids that do not restart per row make one long
    causal sequence; the packed log-probs then differ from the padded ones on every model."""
    real_pack = common.pack

    def no_restart(model, kw):
        index = real_pack(model, kw)
        kw["position_ids"] = torch.arange(kw["input_ids"].shape[1])[None]
        return index

    monkeypatch.setattr(common, "pack", no_restart)
    for name, model in _models(user_models, smollm2_small):
        ids, attn, resp = _batch(model.config.vocab_size, LENGTHS)
        with torch.no_grad():
            padded = common.response_logprobs(model, ids, attn, resp.shape[1]) * resp
            packed = common.response_logprobs(model, ids, attn, resp.shape[1], packed=True) * resp
        assert (packed - padded).abs().max() > 1e-3, name


def test_packed_attention_keeps_to_each_row(user_models, smollm2_small, monkeypatch):
    """models.packed_attention (each packed row's own causal attention, runs of rows of one length as
    one batch, where SDPA would attend over the whole pack under a block-diagonal mask): log-probs and
    gradients equal the padded ones on every model, and the rows' bounds were read. Planted: bounds
    moved by one token (a row's last token given to the next row) make them differ."""
    lengths = [(5, 3), (5, 3), (2, 7), (9, 1), (4, 4), (4, 4), (4, 4), (3, 6)]  # runs of 8, then 9, 10, 8 x 3, 9
    for name, model in _models(user_models, smollm2_small):
        models.packed_attention(model)
        assert model.config._attn_implementation == "sdpa_packed", name
        ids, attn, resp = _batch(model.config.vocab_size, lengths)
        out = []
        for packed in (False, True):
            model.zero_grad()
            logps = common.response_logprobs(model, ids, attn, resp.shape[1], packed=packed) * resp
            logps.sum().backward()
            out.append((logps.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
        T = ids.shape[1]  # float32's rounding of the two layouts: the log-probs', the gradients' in norm
        assert_layouts_agree(out[1][0], out[0][0], fp32_rtol(forward_lengths(model.config, T)), logprob_size(model), name)
        assert_gradients_agree(out[1][1], out[0][1], fp32_rtol(gradient_lengths(model.config, T, ids.numel(), 0)), name)
        assert models._BOUNDS[1] == [0, *attn.sum(-1).cumsum(0).tolist()], name
    real_pad = torch.nn.functional.pad

    def moved(x, pad, *args, **kwargs):  # common's bounds (B + 1,): every inner bound one token early
        out = real_pad(x, pad, *args, **kwargs)
        return torch.cat([out[:1], out[1:-1] - 1, out[-1:]]) if pad == (1, 0) else out

    monkeypatch.setattr(torch.nn.functional, "pad", moved)
    with torch.no_grad():
        wrong = common.response_logprobs(model, ids, attn, resp.shape[1], packed=True) * resp
    assert (wrong - out[0][0]).abs().max() > 1e-3


class OwnMask(torch.nn.Module):
    """A model that builds its own all-ones attention mask (as models outside transformers' masking
    utilities do): transformers then sees no packed sequences and lets rows attend to each other."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_a_model_that_ignores_restarting_positions_is_detected(user_models, capsys):
    model = AutoModelForCausalLM.from_pretrained(user_models["llama"], dtype=torch.float32)
    assert models.use_packing(True, [model, None], common.Dist())
    own = OwnMask(model)
    assert not models.packing_works(own, torch.device("cpu"))
    assert not models.use_packing(True, [model, own], common.Dist())
    assert "--padding_free off: OwnMask" in capsys.readouterr().out
    assert not models.use_packing(False, [own], common.Dist())


def test_micro_batches_cut_by_tokens():
    """Consecutive rows of at most rows_per_forward * T real tokens (a longer row alone); padded:
    rows_per_forward rows each."""
    attn = torch.zeros(6, 10, dtype=torch.long)
    for i, n in enumerate([10, 3, 4, 9, 2, 2]):
        attn[i, :n] = 1
    rows = torch.arange(6)
    got = common.micro_batches(rows, attn, 1, common.Dist(), packed=True)  # budget 10 tokens
    assert [r.tolist() for r in got] == [[0], [1, 2], [3], [4, 5]]
    assert [r.tolist() for r in common.micro_batches(rows, attn, 4, common.Dist())] == [[0, 1, 2, 3], [4, 5]]
    assert [r.tolist() for r in common.micro_batches(rows.flip(0), attn, 2, common.Dist(), packed=True)] == \
        [[5, 4, 3, 2, 1], [0]]  # 20 tokens, then 10


def test_planned_logprobs_packed_equal_padded(user_models):
    model = AutoModelForCausalLM.from_pretrained(user_models["qwen2"], dtype=torch.float32)
    ids, attn, resp = _batch(model.config.vocab_size, LENGTHS * 2, seed=1)
    R, d, rows = resp.shape[1], common.Dist(), torch.arange(len(ids))[None]  # one mini-batch
    got, want = (shared_prompt.planned_logprobs(model, ids, attn, R, shared_prompt.plan(
        rows, ids, attn, R, 3, d, packed=packed, models=[model]), d) for packed in (True, False))
    assert_layouts_agree(got * resp, want * resp, fp32_rtol(forward_lengths(model.config, ids.shape[1])),
                         logprob_size(model))


def test_micro_batches_as_many_as_the_rank_that_needs_most(monkeypatch):
    """Under FSDP every rank runs as many forwards: a rank whose rows fit in fewer micro-batches than
    another's halves its fullest until it has as many (here the all-reduce's maximum is 4)."""
    def all_reduce(n, op):
        n.fill_(max(int(n), 4))

    monkeypatch.setattr(common.dist, "all_reduce", all_reduce)
    attn = torch.zeros(6, 10, dtype=torch.long)
    for i, n in enumerate([2, 3, 4, 9, 2, 2]):
        attn[i, :n] = 1
    got = common.micro_batches(torch.arange(6), attn, 2, common.Dist(world_size=2), packed=True)  # 20 tokens, then 2
    assert [r.tolist() for r in got] == [[0, 1], [2], [3, 4], [5]]  # (0..5) of 20 tokens halved, then (2..5)


def _config(hidden, attn="sdpa"):
    """A model as packing_pays sees it: its width and attention kernel."""
    config = SimpleNamespace(hidden_size=hidden, _attn_implementation=attn)
    config.get_text_config = lambda: config
    return SimpleNamespace(config=config)


def _mask(lengths, T):
    return (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()


def _flops(model, attn, rows_per_forward):
    """An independent count of each layout's matmul FLOPs per layer: 24 h^2 a token (projections and
    MLP) and 4 h a query-key pair; padded micro-batches of rows_per_forward rows compute T x T pairs
    a row, packed ones (as micro_batches cuts them) n x n for their n tokens, or under sdpa_packed
    (each row's attention on its own) each row's L x L."""
    h, T = model.config.hidden_size, attn.shape[1]
    padded = sum(24 * h * h * len(r) * T + 4 * h * len(r) * T * T
                 for r in common.micro_batches(torch.arange(len(attn)), attn, rows_per_forward, common.Dist()))
    rowwise = model.config._attn_implementation == "sdpa_packed"
    packed = sum(24 * h * h * int(attn[r].sum()) + 4 * h * (int((attn[r].sum(-1) ** 2).sum()) if rowwise
                                                           else int(attn[r].sum()) ** 2)
                 for r in common.micro_batches(torch.arange(len(attn)), attn, rows_per_forward, common.Dist(), True))
    return packed, padded


def test_packing_pays_where_it_computes_fewer_flops(monkeypatch):
    """SDPA and eager compute a packed micro-batch's whole N x N pairs: packing is chosen exactly
    where an independent FLOP count of both layouts says it computes less (no padding at T = 1536
    and h = 1536: padded; the docstring's 23% threshold on either side), always under flash
    attention's varlen kernels, and on the sum over ranks (a rank with full rows packs when the other
    rank's padding outweighs it; without the all-reduce it would not). Under sdpa_packed (each packed
    row attends on its own: plumbing.models._packed_sdpa) packing never computes more, and always packs."""
    wide, rowwise = _config(1536), _config(1536, "sdpa_packed")
    for lengths, T, r in [([1536] * 4, 1536, 4), ([1210] * 4, 1536, 4), ([1150] * 4, 1536, 4),
                          ([1536, 200, 100, 50], 1536, 4), ([30, 12, 7, 64, 3, 60], 64, 2), ([64] * 6, 64, 2)]:
        attn = _mask(lengths, T)
        packed, padded = _flops(wide, attn, r)
        if abs(packed - padded) > 0.01 * padded:  # the estimate bounds a cut's pairs; exact away from a tie
            assert common.packing_pays(wide, attn, r, common.Dist()) == (packed < padded), (lengths, T, r)
        packed, padded = _flops(rowwise, attn, r)
        assert packed <= padded and common.packing_pays(rowwise, attn, r, common.Dist()), (lengths, T, r)
    assert not common.packing_pays(wide, _mask([1210] * 4, 1536), 4, common.Dist())  # 21% padding: padded
    assert common.packing_pays(wide, _mask([1150] * 4, 1536), 4, common.Dist())  # 25%: packed
    assert common.packing_pays(_config(1536, "flash_attention_2"), _mask([1536] * 4, 1536), 4, common.Dist())
    full, sparse = _mask([1536] * 4, 1536), _mask([100] * 4, 1536)
    other = torch.stack([s.sum(dtype=torch.float64) for s in (sparse, full)])  # the other rank's raw sums
    def all_reduce(cost):  # the other rank's costs, computed as the function computes its own
        w, N = 1 / (6 * 1536), other[0]
        cost += torch.stack([N * (1 + w * N.clamp(max=4 * 1536)), N.new_tensor(4 * 1536 * (1 + w * 1536))])
    monkeypatch.setattr(common.dist, "all_reduce", all_reduce)
    assert not common.packing_pays(wide, full, 4, common.Dist())
    assert common.packing_pays(wide, full, 4, common.Dist(world_size=2))


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_grpo_padding_free_equals_padded(tmp_path, user_models, model, monkeypatch):
    """grpo.py at the embedded task's 2 passes over 2 mini-batches (the reference, old-policy and update
    passes), with --grad_accum 2 and --beta 0.05, padding-free against --no-padding_free (prompts
    not shared, which would take every pass here: tests/test_shared_prompt.py has them), on GPT-2
    and on the Llama-shaped model (RoPE, GQA): the same rewards, loss, KL, grad norm every step
    and the same final weights (fp32). The token-cut micro-batches change which rows share a
    forward, not the sums (every normaliser counts the global mini-batch's tokens)."""
    rows = [{"prompt": r["prompt"], "reward_fn": "digits"} for r in tasks.prompt_rows(16)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    runs, packs, real_pack = [], [], common.pack
    # at lr 0 every pass of every step runs on the same weights in both runs, so every metric is
    # compared within float32's rounding of the layouts (at lr > 0 a step's later passes would
    # differ by Adam's drift of rounding noise, which no bound short of the weights' holds)
    monkeypatch.setattr(common, "pack", lambda *a: packs.append(packs.pop() + 1) or real_pack(*a))
    asked = []  # every pass packed, as under flash attention; what each pass asks packing_pays about
    monkeypatch.setattr(common, "packing_pays", lambda m, attn, r, d: asked.append((len(attn), r, d)) or True)
    for flag in ("--padding_free", "--no-padding_free"):
        packs.append(0)
        out = tmp_path / flag
        proc = run_here(["grpo.py", "--model", model if model == "tiny" else user_models[model], "--dataset", data,
                         "--steps", "2", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8",
                         "--max_prompt_len", "64", "--grad_accum", "2", "--beta", "0.05", "--lr", "0",
                         "--num_iterations", "2", "--num_mini_batches", "2", "--no-shared_prompt",
                         "--warmup_steps", "0", "--eval_every", "100", "--out_dir", str(out),
                         flag])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "--padding_free off" not in proc.stdout
        assert (packs.pop() > 0) == (flag == "--padding_free")
        runs.append(out)
    # once per mini-batch of 8 rows (the plan every pass of the step runs), cut at grad_accum 2's 4 rows a
    # forward, every rank summing
    assert {(n, r, type(d)) for n, r, d in asked} == {(8, 4, common.Dist)}
    assert len(asked) == 2 * 2  # 2 steps x 2 mini-batches: not again for each pass
    one, two = ([r for r in read_metrics(out) if "loss" in r] for out in runs)
    assert len(one) == 2 and all(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in one)
    config = checkpoint_config(runs[0])
    assert_runs_agree(one, two, config, length=64 + 8, lr=0, updates=4, tokens=4 * 72, norm_terms=0,
                      keys=("reward", "loss", "kl", "grad_norm", "completions/mean_length"),
                      scales={"loss": [1.5], "kl": [0.05 * 2 * logprob_size(AutoModelForCausalLM.from_config(config))]})


def test_reward_scores_packed_equal_padded(user_models):
    """The score at each row's last real token, packed against padded, with the gradient of a
    loss on the scores (the reward model's head and body), on the Llama-shaped score model, under
    SDPA and under sdpa_packed (--packed_attention: each row attends on its own, its bounds read)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(user_models["llama_rm"], dtype=torch.float32)
    assert models.packing_works(model, torch.device("cpu"))
    ids, attn, _ = _batch(model.config.vocab_size, LENGTHS)
    for attention in ("sdpa", "sdpa_packed"):
        if attention == "sdpa_packed":
            models.packed_attention(model)
            models._BOUNDS[:] = None, None
        assert model.config._attn_implementation == attention
        out = []
        for packed in (False, True):
            model.zero_grad()
            scores = common.reward_scores(model, ids, attn, packed=packed)
            (scores * torch.arange(1.0, 6.0)).sum().backward()
            out.append((scores.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
        T = ids.shape[1]  # float32's rounding of the two layouts: the scores', the gradients' in norm
        assert_layouts_agree(out[1][0], out[0][0], fp32_rtol(forward_lengths(model.config, T)), logit_size(model), attention)
        assert_gradients_agree(out[1][1], out[0][1], fp32_rtol(gradient_lengths(model.config, T, ids.numel(), 0)),
                               attention)
    assert models._BOUNDS[1] == [0, *attn.sum(-1).cumsum(0).tolist()]


def _offline_argv(script, folder, models):
    """The user-path runs of sft.py (Llama, messages), reward.py (Llama, a new score head) and
    dpo.py (Qwen2, a live reference), each with --grad_accum 2."""
    import test_sft
    import test_user_path

    if script == "sft":
        return [*test_sft.two_rank_argv(folder, models), "--grad_accum", "2", "--steps", "2", "--eval_every", "100",
                "--warmup_steps", "0"]
    if script == "reward":
        return test_user_path.reward_argv(folder, models)
    # packing alone: chosen and rejected share their prompt, computed once where that computes less (shared_prompt,
    # tests/test_shared_prompt.py), which these pairs' prompts would choose
    return test_user_path.dpo_argv(folder, models, "--no-precompute_ref", "--grad_accum", "2", "--no-shared_prompt")


@pytest.mark.parametrize("script", ["sft", "reward", "dpo"])
def test_offline_scripts_padding_free_equal_padded(tmp_path, user_models, script, monkeypatch):
    """sft.py, reward.py and dpo.py (chosen and rejected in one packed forward, the live reference
    too) padding-free against --no-padding_free: every step's loss and grad norm, and the final
    weights (fp32)."""
    runs, packs, real_pack = [], [], common.pack
    monkeypatch.setattr(common, "pack", lambda *a: packs.append(packs.pop() + 1) or real_pack(*a))
    asked = []  # every pass packed, as under flash attention; what each pass asks packing_pays about
    monkeypatch.setattr(common, "packing_pays", lambda m, attn, r, d: asked.append((len(attn), r, d)) or True)
    for flag in ("--padding_free", "--no-padding_free"):
        packs.append(0)
        (tmp_path / flag).mkdir()
        argv = [*_offline_argv(script, tmp_path / flag, user_models), flag]
        proc = run_here(argv)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "--padding_free off" not in proc.stdout
        assert (packs.pop() > 0) == (flag == "--padding_free")
        runs.append(argv[argv.index("--out_dir") + 1])
    # a micro-batch, its rows (DPO, RM: 2 per pair), summed over the ranks (one rank's rows must not decide alone)
    assert asked and all(n == r and isinstance(d, common.Dist) for n, r, d in asked)
    one, two = ([r for r in read_metrics(out) if "loss" in r] for out in runs)
    assert len(one) >= 2
    # step 1 at the same weights within float32's rounding of the layouts, later losses and the
    # weights within Adam's drift too (helpers.assert_runs_agree, adam_drift)
    lr, logps = max(r["lr"] for r in one), ["logps/chosen", "logps/rejected"]
    assert_runs_agree(one, two, checkpoint_config(runs[0]), length=128 + 20, lr=lr, norm_terms=0,
                      scales={"loss": logps} if script == "dpo" else {})
    assert max_abs_diff(checkpoint_weights(runs[0]), checkpoint_weights(runs[1])) <= adam_drift(lr, len(one))


def save_under_packed_attention(folder, tokenizer, out):
    """A model of folder put under sdpa_packed, one packed forward through _packed_sdpa, then saved
    into out (unless out is folder: a script's own export, as it wrote it) with its fp32 logits of
    a fixed batch beside it (want.pt)."""
    model = models.packed_attention(models.load_model(str(folder), tokenizer))  # registered, set
    assert model.config._attn_implementation == "sdpa_packed"
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        common.response_logprobs(model, ids, torch.ones_like(ids), 4, packed=True)
        logits = model(input_ids=ids).logits
    if str(out) != str(folder):
        model.save_pretrained(out)
    # the fresh process's plain SDPA against this one: float32's rounding of two layouts, of the logits' terms
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logit_size(model)
    torch.save(dict(logits=logits, tol=tol), f"{out}/want.pt")


LOAD = """
import sys, torch
from transformers import AttentionInterface, AutoModelForCausalLM
assert "sdpa_packed" not in AttentionInterface._global_mapping and "common" not in sys.modules
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    want = torch.load(folder + "/want.pt")  # logits under sdpa_packed, and the bound of its rounding against these
    assert (got - want["logits"]).abs().max() <= want["tol"], ((got - want["logits"]).abs().max(), want["tol"])
    print(folder, model.config._attn_implementation)
"""


def test_a_checkpoint_saved_under_sdpa_packed_loads_without_it(tmp_path, user_models):
    """--packed_attention sets sdpa_packed, registered in its own process only. A checkpoint saved by a
    script (save_pretrained after a packed forward through _packed_sdpa, on the Llama-shaped model;
    and sft.py's final export on GPT-2) loads in a fresh process that imports nothing of this project
    with plain AutoModelForCausalLM.from_pretrained, as SDPA, with the same logits (within float32's
    rounding of the two attentions: helpers.fp32_rtol, logit_size): no file
    of the checkpoint names sdpa_packed (a config naming it would not load there). The saves run in
    this process; only the load needs an interpreter of its own."""
    llama = tmp_path / "llama"
    save_under_packed_attention(user_models["llama"], AutoTokenizer.from_pretrained(user_models["llama"]), llama)
    sft = tmp_path / "sft"
    proc = run_here(["sft.py", "--model", "tiny", "--steps", "1", "--batch_size", "2", "--eval_every", "100",
                     "--packed_attention", "--out_dir", str(sft)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    save_under_packed_attention(sft / "checkpoint", tasks.char_tokenizer(), sft / "checkpoint")
    for folder in (llama, sft / "checkpoint"):
        assert not [f for f in folder.iterdir() if f.suffix == ".json" and "sdpa_packed" in f.read_text()], folder
    proc = run_script(["-c", LOAD, str(llama), str(sft / "checkpoint")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(llama), "sdpa", str(sft / "checkpoint"), "sdpa"]
