"""Tests of common.py: config parsing, padding and positions, log-probs, sampling, loading."""
import csv
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
import lm_head
import data
import dpo
import environment
import sampling
import sft
import tasks
from helpers import HANG_GUARD_S, ROOT, SUBPROCESS_ENV, forward_lengths, fp32_rtol, logprob_size, write_jsonl
from plumbing import checkpoints, cli, models, rundir


# -----------------------------------------------------------------------------
# parse_config


@dataclass
class _Cfg:
    lr: float = 1e-3
    """peak learning rate"""
    steps: int = 10
    """optimizer steps"""
    name: str = "tiny"
    """model name"""
    flag: bool = True
    """a switch"""
    maybe: str | None = None
    """an optional path"""


def test_parse_config_defaults_and_forms():
    assert cli.parse_config(_Cfg, []) == _Cfg()
    assert cli.parse_config(_Cfg, ["--lr", "1e-6"]).lr == 1e-6
    assert cli.parse_config(_Cfg, ["--lr=2e-6", "--steps=3"]) == _Cfg(lr=2e-6, steps=3)
    assert cli.parse_config(_Cfg, ["--no-flag"]).flag is False
    assert cli.parse_config(_Cfg, ["--no-flag", "--flag"]).flag is True
    assert cli.parse_config(_Cfg, ["--maybe", "x.jsonl"]).maybe == "x.jsonl"
    assert cli.parse_config(_Cfg, ["--maybe", "none"]).maybe is None


@pytest.mark.parametrize("argv, named", [(["--lrr", "1"], "--lrr"), (["--steps", "ten"], "--steps"),
                                         (["--lr"], "--lr"), (["--l", "1"], "--l")])
def test_parse_config_errors_name_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_config(_Cfg, argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_parse_config_help_comes_from_field_docs(capsys):
    with pytest.raises(SystemExit):
        cli.parse_config(_Cfg, ["--help"])
    out = capsys.readouterr().out
    assert "peak learning rate" in out and "an optional path" in out and "--no-flag" in out


# -----------------------------------------------------------------------------
# padding and positions


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert common.position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]


def test_pad_sides():
    ids, mask = common.pad([[1, 2], [3]], pad_id=0, side="left")
    assert ids.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[1, 1], [0, 1]]
    ids, mask = common.pad([[1, 2], [3]], pad_id=0, side="right")
    assert ids.tolist() == [[1, 2], [3, 0]] and mask.tolist() == [[1, 1], [1, 0]]
    with pytest.raises(ValueError):
        common.pad([[1, 2, 3]], 0, length=2)


def test_join_prompt_response_has_no_padding_in_the_middle():
    prompts, responses = [[5, 6, 7], [8]], [[1], [2, 3, 4]]
    ids, mask, resp = common.join_prompt_response(prompts, responses, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 0, 0], [0, 0, 8, 2, 3, 4]]
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert resp.tolist() == [[1, 0, 0], [1, 1, 1]]
    for row in mask.tolist():  # the real tokens of each row are one contiguous run
        s = "".join(map(str, row)).strip("0")
        assert set(s) == {"1"}


# -----------------------------------------------------------------------------
# log-probs


def _naive_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("shape, chunk", [((2, 7, 11), 2**24), ((3, 5, 13), 13 * 4 + 1), ((2, 64, 50257), 2**24),
                                          ((1, 9, 50257), 50257 * 2)])
def test_logprobs_from_logits_matches_naive(shape, chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=g) * 3
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    fast = lm_head.logprobs_from_logits(logits, labels, chunk_elems=chunk)
    # chunked against whole: float32's rounding of the log-sum-exp's V terms, of a log-prob's terms' size
    size = 2 * logits.abs().max().item() + math.log(shape[-1])
    torch.testing.assert_close(fast, _naive_logprobs(logits, labels), rtol=0, atol=fp32_rtol([shape[-1]]) * size)


def test_logprobs_from_logits_gradient_matches_naive():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 17, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 17, (4, 6), generator=g)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    (lm_head.logprobs_from_logits(a, labels, chunk_elems=17 * 5) * w).sum().backward()
    b = logits.clone().requires_grad_()
    (torch.log_softmax(b, -1).gather(-1, labels[..., None]).squeeze(-1) * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_logprobs_from_bf16_logits_are_computed_in_fp32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 8, 50257, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 50257, (2, 8), generator=g)
    out = lm_head.logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    size = 2 * logits.float().abs().max().item() + math.log(50257)  # as above, the bf16 values exact in fp32
    torch.testing.assert_close(out, _naive_logprobs(logits, labels), rtol=0, atol=fp32_rtol([50257]) * size)


def test_entropy_from_logits_matches_naive():
    logits = torch.randn(3, 4, 29, generator=torch.Generator().manual_seed(3))
    p = logits.softmax(-1)
    size = 2 * logits.abs().max().item() + math.log(29)  # an entropy's terms: p log p, |log p| at most this
    torch.testing.assert_close(lm_head.entropy_from_logits(logits, chunk_elems=29 * 2), -(p * p.log()).sum(-1),
                               rtol=0, atol=fp32_rtol([29, 29]) * size)


@pytest.fixture(scope="module")
def tiny():
    tok = tasks.char_tokenizer()
    torch.manual_seed(0)
    model = models.load_model("tiny", tok).eval()
    # a random GPT-2 barely uses positions; scale them up so that getting them wrong shows
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(25)
    return model, tok


def _rows(tok):
    prompts = [tok(p)["input_ids"] for p in ["sort 3 1 =", "sort 9 8 7 6 5 =", "sort 1 2 ="]]
    responses = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in [" 1 3", " 5", " 1 2"]]
    return prompts, responses


def test_left_padded_batch_matches_rows_alone(tiny, monkeypatch):
    model, tok = tiny
    prompts, responses = _rows(tok)

    def batched_vs_alone():
        ids, mask, resp = common.join_prompt_response(prompts, responses, tok.pad_token_id)
        batch = common.response_logprobs(model, ids, mask, resp.shape[1])
        worst = 0.0
        for i in range(len(prompts)):
            ids1, mask1, resp1 = common.join_prompt_response([prompts[i]], [responses[i]], tok.pad_token_id)
            alone = common.response_logprobs(model, ids1, mask1, resp1.shape[1])[0]
            worst = max(worst, (batch[i, :len(responses[i])] - alone).abs().max().item())
        return worst

    # float32's rounding of the two layouts (helpers.fp32_rtol over the model's sums) of the log-probs' terms' size
    assert batched_vs_alone() <= fp32_rtol(forward_lengths(model.config, 16)) * logprob_size(model)
    # the same comparison without position ids (GPT-2 then counts pad tokens as positions) fails
    monkeypatch.setattr(common, "position_ids_from_mask", lambda mask: None)
    assert batched_vs_alone() > 1e-3


def test_response_logprobs_match_a_full_forward(tiny):
    model, tok = tiny
    prompts, responses = _rows(tok)
    ids, mask, resp = common.join_prompt_response(prompts, responses, tok.pad_token_id)
    got = common.response_logprobs(model, ids, mask, resp.shape[1], temperature=0.7)
    logits = model(ids, attention_mask=mask, position_ids=common.position_ids_from_mask(mask)).logits
    R = resp.shape[1]
    want = _naive_logprobs(logits[:, -R - 1:-1] / 0.7, ids[:, -R:])
    tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logprob_size(model, 0.7)  # two layouts
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_response_logprobs_of_a_model_without_logits_to_keep(tiny):
    """A model whose forward takes no logits_to_keep (a wrapper module, as many custom models are):
    every position's logits are computed and the R before the response kept; log-probs and
    entropies equal those of the logits_to_keep path, at temperature 1 and 0.7. Planted: the
    fallback's slice one position late (`slice(-n_response, None)`) fails here."""
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache)

    model, tok = tiny
    plain = Wrapper(model)
    assert common._accepts(model, "logits_to_keep") and not common._accepts(plain, "logits_to_keep")
    ids, mask, resp = common.join_prompt_response(*_rows(tok), tok.pad_token_id)
    for T in (1.0, 0.7):
        want = common.response_logprobs(model, ids, mask, resp.shape[1], T, with_entropy=True)
        got = common.response_logprobs(plain, ids, mask, resp.shape[1], T, with_entropy=True)
        tol = fp32_rtol(forward_lengths(model.config, ids.shape[1])) * logprob_size(model, T)  # two layouts
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


# -----------------------------------------------------------------------------
# sampling


def test_sample_token_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sampling.sample_token(logits, 1.0, 0, 0.75, g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    draws = torch.stack([sampling.sample_token(logits, 1.0, 2, 1.0, g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1}


# -----------------------------------------------------------------------------
# loading and checkpoints


def test_char_tokenizer_round_trips(tmp_path):
    tok = tasks.char_tokenizer()
    text = "sort 7 3 9 1 = 1 3 7 9\nTL;DR: ok!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids and again.eos_token_id == tok.eos_token_id
    assert again.pad_token_id == tok.pad_token_id != tok.eos_token_id


def test_tokenizer_that_does_not_match_the_model_is_refused(tmp_path):
    tok = tasks.char_tokenizer()
    small = tasks.char_gpt2_config(tok)
    small.vocab_size = 40
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not match the model"):
        models.load_model(str(tmp_path), tok)


def test_save_checkpoint_replaces_atomically_and_loads(tmp_path, tiny):
    model, tok = tiny
    d = common.Dist()
    checkpoints.save_checkpoint(model, tok, tmp_path, d)
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(1.0)
    path = checkpoints.save_checkpoint(model, tok, tmp_path, d)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # no .tmp / .old left behind
    loaded = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(loaded.transformer.ln_f.bias, model.transformer.ln_f.bias)
    assert models.resolve_checkpoint(str(tmp_path)) == path
    with torch.no_grad():
        model.transformer.ln_f.bias.sub_(1.0)


def test_load_data_local_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f" c{i}", "extra": i} for i in range(5)]
    ds = data.load_data(write_jsonl(tmp_path / "d.jsonl", rows), "train", ["prompt", "completion"])
    assert ds["prompt"] == [r["prompt"] for r in rows] and ds["completion"] == [r["completion"] for r in rows]
    ds.to_parquet(str(tmp_path / "d.parquet"))
    again = data.load_data(str(tmp_path / "d.parquet"), "train", ["prompt", "completion"])
    assert again["completion"] == ds["completion"]


def test_load_data_embedded_task():
    ds = data.load_data("sort", "test", ["prompt", "completion"], kind="sft", n=7, seed=3)
    assert len(ds) == 7 and all(p.startswith("sort ") for p in ds["prompt"])


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b"}, {"prompt": "c"}],
     r"d\.jsonl row 3: missing field 'completion'"),
    ([{"prompt": "a", "completion": "b"}, '{"prompt": "a", "completion": '], r"d\.jsonl line 2: not valid JSON"),
    (['["a", "b"]'], r"d\.jsonl line 1: expected a JSON object"),
    ([{"prompt": "a", "completion": 3}], r"d\.jsonl row 1: field is int, not a string: 'completion'"),
    ([{"prompt": "a"}, {"prompt": "b"}], r"missing column\(s\) \['completion'\]"),
])
def test_load_data_bad_rows_name_file_row_and_field(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        data.load_data(path, "train", ["prompt", "completion"])


def test_load_data_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.load_data(str(tmp_path / "nope.jsonl"), "train", ["prompt"])


@pytest.mark.parametrize("name, content, match", [
    ("d.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n',
     r"d\.jsonl line 2: not UTF-8 text \(byte 0xe9\)"),
    ("d.json", b'[{"prompt": "a",\n "completion": "b"},\n {"prompt": "\xff"}]', r"d\.json line 3: not UTF-8"),
    ("d.json", b'[{"prompt": "a", "completion": "b"},\n {"prompt": }]', r"d\.json line 2: not valid JSON"),
    ("d.json", b'{"prompt": "a", "completion": "b"}', r"d\.json: expected a JSON list of objects"),
    ("d.jsonl", b"", r"d\.jsonl is empty"),
    ("d.jsonl", b"\n\n", r"d\.jsonl \(train\): no rows"),
    ("d.csv", b"prompt,completion\n", r"d\.csv \(train\): no rows"),
    ("d.txt", b"prompt completion", r"d\.txt: unknown file type; data files are \.jsonl, \.json, \.csv, \.parquet"),
    ("d.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ["b"]}\n',
     r"d\.jsonl row 2: field 'completion' is list, while earlier rows hold str"),
])
def test_load_data_bad_files_are_named_with_the_line(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=match):
        data.load_data(str(tmp_path / name), "train", ["prompt", "completion"])


def test_a_directory_is_not_a_data_file(tmp_path):
    (tmp_path / "rows.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"rows\.jsonl is a directory; pass one data file"):
        data.load_data(str(tmp_path / "rows.jsonl"), "train", ["prompt"])
    with pytest.raises(FileNotFoundError, match=r"no such file or folder \(a local path, not a hub id\)"):
        data.load_data(str(tmp_path / "nothing" / "here"), "train", ["prompt"])


def test_csv_json_and_jsonl_read_alike_and_stay_out_of_the_datasets_cache(tmp_path, monkeypatch):
    """Local files are read in memory: `load_dataset("json", data_files=...)` wrote an Arrow copy
    of every new file into the user's datasets cache."""
    import datasets

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    rows = [{"prompt": f"p,{i}", "chosen": f" c{i}", "rejected": f' "r{i}"', "margin": i / 2} for i in range(5)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:  # quoted commas, quotes and leading spaces
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for ext in ("jsonl", "json", "csv", "parquet"):
        ds = data.load_pairs(str(tmp_path / f"d.{ext}"), "train")
        assert ds.to_list() == rows, ext
    assert not cache.exists() or not any(cache.rglob("*"))


def test_a_local_file_without_a_held_out_one_is_split_by_prompt_hash(tmp_path, capsys):
    rows = [{"prompt": f"question {i // 2}", "completion": f" answer {i}"} for i in range(400)]  # 2 rows per prompt
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train = data.load_data(path, "train", ["prompt", "completion"], holdout=True)
    test = data.load_data(path, "test", ["prompt", "completion"], holdout=True)
    train, test = train.to_dict(), test.to_dict()
    assert not set(train["prompt"]) & set(test["prompt"])  # a prompt is on one side only
    assert sorted(train["completion"] + test["completion"]) == sorted(r["completion"] for r in rows)
    assert 0.01 < len(test["prompt"]) / len(rows) < 0.12  # 5% of the prompts, by hash (here 12 rows)
    assert test["prompt"] == [p for p in (r["prompt"] for r in rows) if data.held_out(p)]
    assert f"the {len(test['prompt'])} of 400 rows whose prompt hashes into the held-out 5% are kept for evaluation" in \
        capsys.readouterr().out
    assert len(data.load_data(path, "train", ["prompt", "completion"])) == 400  # no split without holdout
    write_jsonl(tmp_path / "one.jsonl", rows[:2])  # one prompt: nothing to hold out, said (tests/test_first_day.py)
    for side in ("train", "test"):
        assert len(data.load_data(str(tmp_path / "one.jsonl"), side, ["prompt", "completion"], holdout=True)) == 2
    assert "its 2 rows are too few to split (one prompt): training on all of them, eval/* is measured" in \
        capsys.readouterr().out


def test_empty_prompts_are_refused_naming_the_source():
    tok = tasks.char_tokenizer()  # no BOS: an empty prompt has no tokens
    with pytest.raises(ValueError, match=r"rows\.jsonl: 2 of 3 prompts are empty \(no tokens\)"):
        sampling.encode_prompts(tok, ["", "a", ""], 8, "rows.jsonl")


def test_transformer_blocks_found_inside_a_wrapper(tiny):
    model, _ = tiny

    class Policy(torch.nn.Module):  # an LM held as a submodule, as a PeftModel holds it
        def __init__(self, lm):
            super().__init__()
            self.lm_model = lm

    blocks = common.transformer_blocks(Policy(model))
    assert len(blocks) == model.config.n_layer and all(type(b).__name__ == "GPT2Block" for b in blocks)


def test_activation_checkpointing_recomputes_blocks_of_a_loaded_checkpoint(tmp_path):
    """from_pretrained returns a model in eval mode, where HF skips checkpointing: shard_model must
    switch it on for real. Each block's MLP is then entered twice per forward + backward (a pre-hook:
    the block's own hooks stay outside the checkpoint, and the recompute stops early, before the
    MLP returns), and the gradients are those of the plain model."""
    tok = tasks.char_tokenizer()
    torch.manual_seed(0)
    models.load_model("tiny", tok).save_pretrained(tmp_path)
    ids = torch.randint(3, len(tok), (2, 9))
    grads, calls = [], []
    for ac in (False, True):
        model = common.shard_model(models.load_model(str(tmp_path), tok), common.Dist(), activation_checkpointing=ac)
        n = []
        common.transformer_blocks(model)[0].mlp.register_forward_pre_hook(lambda *_: n.append(1))
        common.response_logprobs(model, ids, torch.ones_like(ids), 4).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        calls.append(len(n))
    assert calls == [1, 2]
    assert torch.equal(grads[0], grads[1])  # exact: the recompute repeats the forward's float operations


@pytest.mark.parametrize("n, world, batch", [(15, 2, 4), (7, 3, 2), (2, 4, 1), (9, 1, 4), (8, 2, 8)])
def test_map_rows_equal_forward_counts_and_every_row_once(n, world, batch, monkeypatch):
    """Each rank's results, as the all-reduce would sum them: every row's value exactly once (the
    padding rows computed but dropped), the same number of calls on every rank (FSDP's collective
    gathers hang otherwise), all of one size (a compiled decode step meets one batch shape)."""
    monkeypatch.setattr(common, "all_reduce_sum", lambda x, d: x)  # the ranks' outputs, summed below
    calls, outs, sizes = [], [], set()
    for r in range(world):
        seen = []

        def fn(rows, seen=seen):
            seen.append(list(rows))
            return torch.tensor([[10.0 * i + 1, 1.0] for i in rows])  # (b, 2): a value and a count per row

        outs.append(common.map_rows(fn, n, common.Dist(rank=r, world_size=world), batch))
        calls.append(len(seen))
        sizes.update(len(rows) for rows in seen)
    assert len(set(calls)) == 1  # every rank runs as many forwards
    assert len(sizes) == 1 and max(sizes) <= batch, sizes
    total = sum(outs)
    assert total[:, 1].tolist() == [1.0] * n  # each row counted once over all ranks
    assert total[:, 0].tolist() == [10.0 * i + 1 for i in range(n)]


def _fake_gpus(monkeypatch, n_gpus):
    """CUDA with n_gpus devices as setup_distributed sees it; returns the devices it selects."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpus)
    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    return picked


@pytest.mark.parametrize("local_rank, n_gpus", [(1, 1), (3, 2)])
def test_setup_distributed_refuses_a_local_rank_without_a_gpu(monkeypatch, local_rank, n_gpus):
    """torchrun --nproc_per_node 2 on a one-GPU machine: rank 1 must stop, with a message that says
    what to change, before it selects a device or joins a process group."""
    picked = _fake_gpus(monkeypatch, n_gpus)
    for name, value in {"RANK": local_rank, "WORLD_SIZE": local_rank + 1, "LOCAL_RANK": local_rank}.items():
        monkeypatch.setenv(name, str(value))
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # without them a process group fails at once, never waits
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=rf"LOCAL_RANK {local_rank} but only {n_gpus} CUDA device.*"
                                            rf"--nproc_per_node at most {n_gpus}.*CUDA_VISIBLE_DEVICES"):
        common.setup_distributed()
    assert picked == []
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("local_rank, n_gpus", [(0, 1), (1, 2)])
def test_setup_distributed_takes_the_gpu_of_its_local_rank(monkeypatch, local_rank, n_gpus):
    picked = _fake_gpus(monkeypatch, n_gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.delenv("RANK", raising=False)  # plain `python`: no process group to start
    assert common.setup_distributed().device == torch.device("cuda", local_rank)
    assert picked == [torch.device("cuda", local_rank)]


# -----------------------------------------------------------------------------
# optimisation helpers: the learning-rate schedule, gradient clipping, rollout draws


def test_lr_schedule_is_linear_warmup_then_cosine_by_hand():
    """Every step's lr against the formula written out: an off-by-one in the warmup (peak one step
    late, or a first step at lr / warmup instead of 0) trains every run a little differently and
    passes any test that only checks the run finishes."""
    import math

    lr, warmup, total = 0.5, 3, 8
    param = torch.nn.Parameter(torch.zeros(1))
    opt, sched = common.make_optimizer([param], lr, 0.0, warmup, total)
    seen = []
    for _ in range(total + 1):  # the lr each optimizer step 0..total-1 uses, and the one after the last
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [lr * s / warmup if s < warmup else 0.5 * lr * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
                for s in range(total + 1)]
    assert expected[:4] == [0.0, lr / 3, 2 * lr / 3, lr]  # the hand formula itself: 0, ramp, peak at `warmup`
    assert seen == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "constant_with_warmup"])
def test_each_lr_scheduler_type_is_transformers_get_scheduler_to_the_bit(kind):
    """--lr_scheduler_type (TRL's name and values; `linear` is TRL's default, refused on the old
    tree) gives every step the lr transformers' get_scheduler of that name gives (what TRL's
    trainer runs), to the bit: the same float operations, on warmups of 0, 1 and 3 and runs longer
    and shorter than them. And by hand: linear falls by lr / (total - warmup) a step after the peak."""
    from transformers import get_scheduler

    for warmup, total in ((0, 5), (1, 6), (3, 10), (3, 2)):
        ours = common.make_optimizer([torch.nn.Parameter(torch.zeros(1))], 0.3, 0.0, warmup, total, schedule=kind)
        theirs_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        theirs = get_scheduler(kind, theirs_opt, num_warmup_steps=warmup, num_training_steps=total)
        for step in range(total + 2):
            assert ours[0].param_groups[0]["lr"] == theirs_opt.param_groups[0]["lr"], (kind, warmup, total, step)
            for opt, sched in (ours, (theirs_opt, theirs)):
                opt.step()
                sched.step()
    opt, sched = common.make_optimizer([torch.nn.Parameter(torch.zeros(1))], 0.5, 0.0, 1, 5, schedule="linear")
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.0, 0.5, 0.375, 0.25, 0.125, 0.0], abs=1e-15)


def _module_with_grads(weight_grad, bias_grad):
    m = torch.nn.Linear(2, 2)
    m.weight.grad = torch.tensor(weight_grad)
    m.bias.grad = torch.tensor(bias_grad)
    return m


def test_clip_grad_norm_returns_the_pre_clip_norm_and_scales_to_max_norm():
    # one global norm over all parameters: sqrt(3^2 + 4^2) = 5, not a norm per tensor
    m = _module_with_grads([[3.0, 0.0], [0.0, 0.0]], [0.0, 4.0])
    norm = common.clip_grad_norm(m, 1.0)
    assert norm.item() == pytest.approx(5.0)  # what the logs show: the norm before clipping
    # every gradient scaled by the same 1/5, so the direction is kept and the global norm is max_norm
    torch.testing.assert_close(m.weight.grad, torch.tensor([[0.6, 0.0], [0.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.bias.grad, torch.tensor([0.0, 0.8]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("max_norm", [10.0, 0.0])  # below the norm's size; 0 means no clipping
def test_clip_grad_norm_leaves_small_gradients_and_max_norm_zero_alone(max_norm):
    m = _module_with_grads([[3.0, 0.0], [0.0, 0.0]], [0.0, 4.0])
    assert common.clip_grad_norm(m, max_norm).item() == pytest.approx(5.0)
    assert m.weight.grad.tolist() == [[3.0, 0.0], [0.0, 0.0]] and m.bias.grad.tolist() == [0.0, 4.0]


def test_rollout_uniforms_are_distinct_per_row_and_token_and_seeded():
    """One fresh draw per row and token: a row reused for every row (every prompt sampling the same
    completion) or a draw reused along a row would still look uniform to a histogram."""
    u = sampling.rollout_uniforms(6, 5, seed=1)
    assert u.shape == (6, 5) and u.dtype == torch.float64
    assert ((u >= 0) & (u < 1)).all()
    assert torch.unique(u).numel() == u.numel()  # no two draws alike: rows differ, columns differ
    torch.testing.assert_close(sampling.rollout_uniforms(6, 5, seed=1), u, atol=0, rtol=0)  # seeded: repeatable
    assert not torch.equal(sampling.rollout_uniforms(6, 5, seed=2), u)


# -----------------------------------------------------------------------------
# flag ranges: stated in each field's docstring (so --help shows them), enforced by one check


SCRIPT_CONFIGS = [("sft", "sft.Config"), ("reward", "reward.Config"), ("dpo", "dpo.Config"), ("grpo", "grpo.Config"),
                  ("pipeline", "pipeline.Config")]


def _configs():
    import importlib

    return [(name, getattr(importlib.import_module(name), "Config")) for name, _ in SCRIPT_CONFIGS]


def _numeric_fields():
    for name, cls in _configs():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float, int | None, float | None):
                yield name, cls, f.name


def test_every_numeric_flag_states_its_range():
    missing = [f"{name}.py --{field}" for name, cls, field in _numeric_fields()
               if cli.field_range(cli._field_docs(cls)[field]) is None]
    assert not missing, missing


def _outside_and_inside(text):
    """Values just outside and just inside a range's text, computed here from the text alone."""
    if text.startswith("[>"):
        op, bound = text[1:-1].split()
        b = float(bound)
        return ([b - 1, b] if op == ">" else [b - 1]), ([b + 1] if op == ">" else [b, b + 1])
    lo, hi = (float(x) for x in text[1:-1].split(", "))
    outside = [lo - 0.1, hi + 0.1] + ([lo] if text[0] == "(" else []) + ([hi] if text[-1] == ")" else [])
    inside = [(lo + hi) / 2] + ([lo] if text[0] == "[" else []) + ([hi] if text[-1] == "]" else [])
    return outside, inside


@pytest.mark.parametrize("name, cls, field", list(_numeric_fields()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_flag_range_is_enforced(name, cls, field):
    text, _ = cli.field_range(cli._field_docs(cls)[field])
    assert f"{text}" in cli._field_docs(cls)[field]  # what --help shows
    outside, inside = _outside_and_inside(text)
    tp = typing.get_type_hints(cls)[field]
    tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # `int | None`: a default to fill
    for v in outside:
        if tp is int and v != int(v):
            continue
        with pytest.raises(ValueError, match=rf"--{field} \S+ is out of range {re.escape(text)}"):
            cli.check_ranges(dataclasses.replace(cls(), **{field: tp(v)}))
    for v in inside:
        if tp is int and v != int(v):
            continue
        cli.check_ranges(dataclasses.replace(cls(), **{field: tp(v)}))  # no error


@pytest.mark.parametrize("script, argv", [
    ("dpo", ["--beta", "0"]), ("dpo", ["--beta", "-0.3"]), ("dpo", ["--loss_type", "ipo", "--beta", "0"]),
    ("grpo", ["--beta", "-1"]), ("sft", ["--steps", "0"]), ("reward", ["--steps", "-3"]), ("sft", ["--batch_size", "0"]),
    ("grpo", ["--prompts_per_step", "0"]), ("dpo", ["--grad_accum", "0"]), ("reward", ["--eval_every", "0"]),
    ("grpo", ["--max_new_tokens", "0"]), ("sft", ["--max_response_len", "0"]), ("dpo", ["--max_prompt_len", "0"]),
])
def test_degenerate_values_are_refused_naming_the_flag(script, argv):
    """The values issue 13 found accepted: each refused by the range check, whatever else the flags say."""
    import importlib

    module = importlib.import_module(script)
    cfg = cli.parse_config(module.Config, argv)
    with pytest.raises(ValueError, match=f"{argv[-2]} {argv[-1]}\\S* is out of range"):
        cli.check_ranges(cfg)


def test_out_of_range_flag_stops_the_script_before_anything_is_written(tmp_path):
    r = subprocess.run([sys.executable, "dpo.py", "--beta", "0", "--out_dir", str(tmp_path / "o")], cwd=ROOT,
                       env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode != 0 and "--beta 0.0 is out of range [> 0]" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_model_of_the_wrong_kind_is_refused_by_name(tmp_path):
    """A causal LM given as the reward model would score with a random head (transformers only
    notes "newly initialized"); a reward model given as the policy has no LM head. reward.py's
    start from an SFT checkpoint (a new head on purpose) stays allowed."""
    tok = tasks.char_tokenizer()
    for kind, folder in (("causal", tmp_path / "lm"), ("new_reward", tmp_path / "rm")):
        models.load_model("tiny", tok, kind=kind).save_pretrained(folder)
        tok.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"lm is not a reward model \(GPT2LMHeadModel\).*reward.py"):
        models.load_model(str(tmp_path / "lm"), tok, kind="reward")
    with pytest.raises(ValueError, match=r"rm is a reward model \(GPT2ForSequenceClassification\), not a causal LM"):
        models.load_model(str(tmp_path / "rm"), tok, kind="causal")
    with pytest.raises(ValueError, match="`tiny` has no trained score head"):
        models.load_model("tiny", tok, kind="reward")
    assert models.load_model(str(tmp_path / "lm"), tok, kind="new_reward").config.num_labels == 1
    assert models.load_model(str(tmp_path / "rm"), tok, kind="reward").config.num_labels == 1


def test_resume_without_a_checkpoint_starts_fresh_without_the_old_rows(tmp_path):
    """--resume on a folder with metrics but no checkpoint (killed before its first save) is a
    fresh run: its step rows must not follow the old ones (steps 0-20 appeared twice). The old
    rows are not deleted either: they move, with the folder, to out_dir.replaced-<time>."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n')
    try:
        job = rundir.Run(cli.with_defaults(sft.Config(model="tiny", out_dir=str(out), resume=True)), common.Dist())
        assert job.resume_from is None
        assert job.begin(None, None, None, None, None) == 1
        job.logger.close()
    finally:
        rundir.release()  # releases the out_dir lock this process took
    assert (out / "metrics.jsonl").read_text() == ""
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (aside / "metrics.jsonl").read_text().count("step") == 2


def test_resume_refuses_other_flags_and_inputs_and_keeps_the_history(tmp_path, tiny):
    """--resume with another --lr kept the old base lr (the scheduler's state) while
    run_config.json recorded the new one; another --dataset crashed after overwriting it; a data
    file shortened, or another checkpoint put where --model points, went on silently from other
    rows or weights. The flags that define the run, and what its model and data flags name, must
    be the checkpoint's; the flags that may change are recorded; a --steps the checkpoint has
    already reached is refused instead of exporting it as final."""
    import shutil

    model, tok = tiny
    d = common.Dist()
    data_file = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(8)])
    (tmp_path / "base").mkdir()
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    out = tmp_path / "out"
    cfg = cli.with_defaults(sft.Config(model=str(tmp_path / "base"), dataset=data_file, out_dir=str(out), steps=4,
                                      eval_every=100, lr=1e-3))
    opt, sched = common.make_optimizer(model.parameters(), 1e-3, 0.0, 0, 4)
    order = data.DataOrder(8, 0)
    try:
        job = rundir.Run(cfg, d)
        job.begin(model, tok, opt, sched, order)
        path = job.save(step=2)
        job.logger.close()
    finally:
        rundir.release()
    config = json.loads((out / "run_config.json").read_text())
    assert set(config["inputs"]) == {"model", "dataset"}

    def refused(match, **change):
        try:
            with pytest.raises(ValueError, match=re.escape(match)):
                rundir.Run(dataclasses.replace(cfg, resume=True, **change), d)
        finally:
            rundir.release()
        assert json.loads((out / "run_config.json").read_text()) == config  # a refused resume writes nothing

    refused("--lr 0.001 (the run) vs 0.002 (now)", lr=2e-3)
    refused("--n_train 50000 (the run) vs 5 (now)", n_train=5)
    refused("--batch_size 64 (the run) vs 32 (now); --seed 0", batch_size=32, seed=1)
    refused("is at step 2, and --steps 2 ends there", steps=2)
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(6)])  # shortened
    refused(f"--dataset {data_file} no longer holds what the run started from")
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(8)])  # put back
    shutil.copy(tmp_path / "base" / "config.json", tmp_path / "config.json")
    torch.manual_seed(1)
    models.load_model("tiny", tok).save_pretrained(tmp_path / "base")  # another checkpoint where --model points
    refused(f"--model {tmp_path / 'base'} no longer holds what the run started from")
    model.save_pretrained(tmp_path / "base")
    try:
        again = dataclasses.replace(cfg, resume=True, steps=8, eval_every=3, grad_accum=2)
        job = rundir.Run(again, d)
        assert job.resume_from == path
        assert job.begin(model, tok, opt, sched, order) == 3
        job.logger.close()
    finally:
        rundir.release()
    config = json.loads((out / "run_config.json").read_text())
    assert config["steps"] == 8 and config["lr"] == 1e-3
    assert [h["resumed_at_step"] for h in config["history"]] == [None, 2]
    assert config["history"][1]["changed"] == {"steps": [4, 8], "grad_accum": [1, 2], "eval_every": [100, 3]}


def test_resume_refuses_another_teacher_where_the_run_s_pointed(tmp_path, tiny):
    """--teacher names a model the advantages are computed from: another checkpoint put where it
    points must stop a resume as another --model does, not change the target silently."""
    import grpo

    model, tok = tiny
    for name in ("base", "teacher"):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    cfg = cli.with_defaults(grpo.Config(model=str(tmp_path / "base"), teacher=str(tmp_path / "teacher"),
                                        out_dir=str(tmp_path / "out"), steps=4))
    try:
        job = rundir.Run(cfg, common.Dist())
        job.begin(model, tok, *common.make_optimizer(model.parameters(), 1e-3, 0.0, 0, 4), data.DataOrder(8, 0))
        job.save(step=2)
        job.logger.close()
    finally:
        rundir.release()
    assert "teacher" in json.loads((tmp_path / "out" / "run_config.json").read_text())["inputs"]
    torch.manual_seed(1)
    models.load_model("tiny", tok).save_pretrained(tmp_path / "teacher")
    try:
        with pytest.raises(ValueError, match=re.escape(f"--teacher {tmp_path / 'teacher'} no longer holds")):
            rundir.Run(dataclasses.replace(cfg, resume=True), common.Dist())
    finally:
        rundir.release()


@pytest.mark.parametrize("script", ["sft", "reward", "dpo", "grpo", "pipeline"])
def test_help_shows_every_flag(script, capsys):
    """--help renders every field's docstring (a "%" in one broke argparse's formatting)."""
    module = __import__(script)
    with pytest.raises(SystemExit) as e:
        cli.parse_config(module.Config, ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f"--{f.name}" in out for f in dataclasses.fields(module.Config))
    if script == "sft":
        assert "held-out 5%" in out


def test_the_docs_list_the_flags_a_resume_may_change():
    readme = open(os.path.join(ROOT, "docs", "distributed.md")).read()
    section = readme[readme.index("## Resuming"):]
    section = section[:section.find("\n#", 1) % (len(section) + 1)]  # to the next heading, or the end
    assert all(f"`--{k}`" in section for k in rundir.RESUME_MAY_CHANGE), section


def test_model_paths_that_cannot_be_hub_ids_are_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "killed").mkdir()  # an out_dir whose run never wrote a checkpoint
    (tmp_path / "model.safetensors").write_text("")
    check = lambda **kw: models.check_model_paths(dpo.Config(**kw), "model", "ref_model")  # noqa: E731
    cases = [(dict(), "--model runs/sft does not exist. It is the default, where `python sft.py` writes"),
             (dict(model="runs/sftt"), "--model runs/sftt: no such folder"),
             (dict(model="./my-model"), "--model ./my-model: no such folder"),
             (dict(model="/nowhere/model"), "--model /nowhere/model: no such folder"),
             (dict(model="runs/killed"), "--model runs/killed holds no checkpoint"),
             (dict(model="model.safetensors"), "--model model.safetensors is a file"),
             (dict(model="tiny", ref_model="runs/sft/"), "--ref_model runs/sft/: no such folder")]
    for kw, message in cases:
        with pytest.raises((FileNotFoundError, ValueError), match=re.escape(message)):
            check(**kw)
    for name in ("tiny", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct"):  # hub ids go on to the hub
        check(model=name)


def test_a_second_run_on_a_busy_out_dir_is_refused_and_touches_nothing(tmp_path):
    """While a run holds out_dir (here this test process, through the same lock), a second run on
    it stops at once, naming the holder, and leaves the first run's files as they were."""
    out = tmp_path / "run"
    rundir.lock_out_dir(str(out))
    try:
        (out / "metrics.jsonl").write_text('{"step": 0}\n')
        r = subprocess.run([sys.executable, "sft.py", "--model", "tiny", "--steps", "1", "--out_dir", str(out)],
                           cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert r.returncode != 0, r.stdout[-1000:]
        assert f"is in use by another run (pid {os.getpid()} on" in r.stderr, r.stderr[-2000:]
        assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
        assert sorted(os.listdir(out)) == [".lock", "metrics.jsonl"]
    finally:
        rundir._LOCKS.pop().close()


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    (tmp_path / ".lock").write_text("pid 999999 on nowhere, started long ago: sft.py\n")  # its process is gone
    rundir.lock_out_dir(str(tmp_path))
    try:
        assert f"pid {os.getpid()} on" in (tmp_path / ".lock").read_text()
    finally:
        rundir._LOCKS.pop().close()


@pytest.mark.parametrize("kind", ["bpe", "bos", "bos_eos", "metaspace"])
def test_prompts_get_one_bos_no_eos_and_keep_it_when_cut(kind):
    """Llama-3- and Gemma-style tokenizers add BOS: a rendered chat template already holds one,
    and tokenizing it again gave [bos, bos, ...]; a post-processor that appends EOS left EOS
    between prompt and response; cutting a long prompt from the left cut its BOS away."""
    from helpers import family_tokenizer

    tok = family_tokenizer(kind)
    head = [] if kind == "bpe" else [tok.bos_token_id]
    body = tok("hello world", add_special_tokens=False)["input_ids"]
    ids, cut = sampling.encode_prompts(tok, ["hello world", tok.bos_token + "hello world"], 64)
    assert cut == [False, False] and ids[0] == head + body
    assert ids[1] == head + body if head else ids[1][-len(body):] == body
    long = " ".join(["the quick brown fox"] * 10)
    body = tok(long, add_special_tokens=False)["input_ids"]
    ids, cut = sampling.encode_prompts(tok, [long], 8)
    assert cut == [True] and ids == [head + body[-(8 - len(head)):]]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_dropped_in_a_finaliser_ends_the_run_at_the_end_of_its_step(monkeypatch):
    """The Ctrl-C test once hung: a KeyboardInterrupt raised while Python ran a finaliser is
    printed as "Exception ignored" and dropped, and training went on. cli.script records the
    signal (rundir.on_signal); the step's check (Run.check, every script's, each step) raises it
    again, and a step without a signal goes on."""
    import signal
    import types

    monkeypatch.setattr(rundir, "INTERRUPTED", None)
    job = types.SimpleNamespace(last_ckpt=None)
    rundir.Run.check(job, 1, {"loss": 0.5})  # no signal: nothing

    class Finalised:
        def __del__(self):
            rundir.on_signal(signal.SIGINT, None)  # the signal lands here, inside a __del__

    Finalised()  # the KeyboardInterrupt goes to sys.unraisablehook, not to us
    with pytest.raises(KeyboardInterrupt):
        rundir.Run.check(job, 2, {"loss": 0.5})


def test_map_rows_cuts_chunks_to_the_logits_they_make():
    sizes = []

    def fn(rows):
        sizes.append(len(rows))
        return torch.tensor(rows, dtype=torch.float64)[:, None]

    for per_row, want in ((0, [5, 5]), (lm_head.EVAL_LOGITS // 3, [3, 3, 3, 3]), (lm_head.EVAL_LOGITS + 1, [1] * 10)):
        sizes.clear()
        out = common.map_rows(fn, 10, common.Dist(), 8, logits_per_row=per_row)
        assert sizes == want and out[:, 0].tolist() == list(range(10))


def test_every_evaluation_forward_keeps_its_logits_under_the_budget(tiny, monkeypatch):
    """SFT's held-out loss (default 256 rows per forward), DPO's pair log-probs and GRPO's pairwise
    accuracy (2 sequences per pair) cut their forwards so that their fp32 logits stay under
    lm_head.EVAL_LOGITS (1 GiB: 2 rows at R = 1024, V = 128k; 256 rows were 62 GiB). Here the
    budget is 2 rows of the longest response: every forward has at most 2 sequences, and the
    values equal those of whole batches."""
    model, tok = tiny
    prompts = [tok(f"sort {i} {i % 3} =")["input_ids"] for i in range(7)]
    longest, shorter = tok(" 1 2 3 4 5 6|")["input_ids"], tok(" 1 2|")["input_ids"]
    completions = [longest if i == 3 else shorter for i in range(7)]
    pairs = (prompts, completions, [shorter] * 7)
    encoded = (prompts, completions, [[1] * len(c) for c in completions])  # sft's: every completion token trained
    d, rows_seen = common.Dist(), []
    forward = common.response_logprobs

    def counted(m, ids, *args, **kw):
        rows_seen.append(ids.shape[0])
        return forward(m, ids, *args, **kw)

    whole = (sft.eval_loss(model, encoded, tok.pad_token_id, d, 256),
             dpo.all_pair_logps(model, pairs, tok.pad_token_id, d, 64),
             environment.pairwise_accuracy(model, model, pairs, tok.pad_token_id, d, batch_size=128))
    monkeypatch.setattr(common, "response_logprobs", counted)
    monkeypatch.setattr(lm_head, "EVAL_LOGITS", 2 * len(longest) * model.config.vocab_size)
    cut = (sft.eval_loss(model, encoded, tok.pad_token_id, d, 256),
           dpo.all_pair_logps(model, pairs, tok.pad_token_id, d, 64),
           environment.pairwise_accuracy(model, model, pairs, tok.pad_token_id, d, batch_size=128))
    assert rows_seen and max(rows_seen) <= 2, rows_seen
    # in chunks of 2 rows against whole batches: float32's rounding of the two layouts, of the terms'
    # sizes (a mean of log-probs; sums of at most len(longest) of them)
    rtol = fp32_rtol(forward_lengths(model.config, 32) + [len(longest)])
    assert cut[0] == pytest.approx(whole[0], abs=rtol * logprob_size(model)) and cut[2] == whole[2]
    torch.testing.assert_close(cut[1], whole[1], rtol=0, atol=rtol * len(longest) * logprob_size(model))


def test_logprobs_on_a_gpu_are_log_softmax_and_gather_where_it_fits(monkeypatch):
    """On a GPU (its `meta` stand-in) the fused log_softmax + gather is faster than chunks (0.83x
    forward, 0.50x with the backward on an H100): taken where the (N, V) tensor fits
    lm_head.EVAL_LOGITS, chunks above it; on a CPU always chunks (bench/test_micro.py)."""
    chunked = lm_head._SelectiveLogSoftmax.apply

    def path(device, budget):
        calls = []
        monkeypatch.setattr(lm_head, "EVAL_LOGITS", budget)
        monkeypatch.setattr(lm_head._SelectiveLogSoftmax, "apply", lambda *a: calls.append(1) or chunked(*a))
        logits = torch.randn(2, 5, 11, device=device, requires_grad=True)
        out = lm_head.logprobs_from_logits(logits, torch.zeros(2, 5, dtype=torch.long, device=device))
        assert out.shape == (2, 5) and out.dtype == torch.float32
        return "chunks" if calls else "log_softmax"

    assert path("meta", 2**28) == "log_softmax"
    assert path("meta", 2 * 5 * 11 - 1) == path("cpu", 2**28) == "chunks"
