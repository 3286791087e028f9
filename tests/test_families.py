"""The model families users start from, each as a tiny model built from its config (2 layers,
width 64) with a tokenizer of its family's kind trained here (tests/helpers.py::family_tokenizer):
every script trains on plain and on conversational rows, the padded batch scores each row as it
scores the row alone, and a first step is exact where its value is known (DPO's loss is log 2
and GRPO's KL is 0 while the policy equals its reference).

The folders are built once per module and shared by the tests (the matrix must stay cheap).
"""
import math

import pytest
import torch

import common
import data
import dpo
import grpo
import reward
import sft
from helpers import (TURN_TOKENS, chat, checkpoint_config, family_tokenizer, forward_lengths, fp32_rtol, logit_size,
                     logprob_size, question, read_metrics, write_jsonl)
from plumbing import models

pytestmark = pytest.mark.session_fixtures("smollm2")  # request.getfixturevalue: tests/two_processes.py

SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=256)

FAMILIES = {
    # name: (config class, tokenizer kind, chat template, config fields of that family)
    "gpt2": ("GPT2Config", "bpe", "chatml", dict(n_inner=128)),
    "llama3": ("LlamaConfig", "bos", "llama3", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "bpe", "chatml", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "bpe", "chatml", dict(num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", "metaspace", "chatml", dict(num_key_value_heads=2)),
    "pythia": ("GPTNeoXConfig", "bpe", "chatml", {}),
    "opt": ("OPTConfig", "bos", "chatml", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "gemma2": ("Gemma2Config", "bos", "gemma", dict(num_key_value_heads=2, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "metaspace", "gemma", dict(num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", "bos_eos", "chatml", {}),
    # SmolLM2-135M-Instruct's own tokenizer, chat template and config (the `smollm2` fixture), the
    # model cut to 2 layers of width 64 with random weights: a real 49k vocabulary whose BOS
    # (<|im_start|>) opens every turn of the template and whose EOS (<|im_end|>) is also the pad
    "smollm2": ("LlamaConfig", "real", "chatml", dict(num_key_value_heads=2, head_dim=16)),
}



@pytest.fixture(scope="module")
def folders(tmp_path_factory, request):
    """family -> the folder of its tiny model and tokenizer, built on first use."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    built = {}

    def build(family):
        if family not in built:
            config_class, kind, template, extra = FAMILIES[family]
            if kind == "real":  # the checkpoint's tokenizer and config, fewer and narrower layers
                real = request.getfixturevalue(family)
                tok = AutoTokenizer.from_pretrained(real)
                config = AutoConfig.from_pretrained(real, **{**SIZE, **extra})
            else:
                tok = family_tokenizer(kind, chat=template)
                config = getattr(transformers, config_class)(
                    vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, **SIZE, **extra)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            if template != "chatml":  # an instruct checkpoint: generation stops at end of text and end of turn
                model.generation_config.eos_token_id = [tok.eos_token_id,
                                                        tok.convert_tokens_to_ids(TURN_TOKENS[template][-1])]
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            tok.save_pretrained(path)
            built[family] = str(path)
        return built[family]

    return build


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The data files, plain and conversational, for each script."""
    path = tmp_path_factory.mktemp("data")
    n = range(8)
    plain = {
        "sft": [{"prompt": f"What is {i} + 7?", "completion": f" {i + 7}"} for i in n],
        "pairs": [{"prompt": f"What is {i} + 7?", "chosen": f" {i + 7}", "rejected": " no"} for i in n],
        "grpo": [{"prompt": f"What is {i} + 7?", "reward_fn": "digits"} for i in n],
    }
    conversational = {
        "sft": [{"messages": question(i) + chat(("assistant", str(i + 7)))} for i in n],
        "rm": [{"prompt": question(i), "chosen": chat(("assistant", str(i + 7))), "rejected": chat(("assistant", "no"))}
               for i in n],
        "pairs": [{"chosen": question(i) + chat(("assistant", str(i + 7))),
                   "rejected": question(i) + chat(("assistant", "no"))} for i in n],  # implicit prompt
        "grpo": [{"prompt": question(i), "answer": f"#### {i + 7}", "reward_fn": "digits"} for i in n],
    }
    out = {}
    for fmt, rows in (("plain", plain), ("chat", conversational)):
        rows.setdefault("rm", rows["pairs"])
        out[fmt] = {k: write_jsonl(path / f"{fmt}_{k}.jsonl", v) for k, v in rows.items()}
    return out


def padded_vs_alone(score, rows):
    """The largest difference between each row's values in one padded batch and alone (a row's
    values are a scalar, or one per token: the batch holds them followed by padding)."""
    batch, worst = score(rows), 0.0
    for i, row in enumerate(rows):
        alone = score([row])[0]
        worst = max(worst, (batch[i].reshape(-1)[:alone.numel()].reshape(alone.shape) - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_scores_each_row_as_alone(family, folders):
    """Log-probs of the response tokens (left-padded prompts, right-padded responses) and a
    sequence-classification score read at the last real token, for rows of 3 to 11 tokens."""
    from transformers import AutoModelForSequenceClassification

    path = folders(family)
    tok = models.load_tokenizer(path)
    model = models.load_model(path, tok).eval()
    prompts = [tok(p)["input_ids"] for p in ["What is 1 + 7?", "sort 3 1 2 =", "hi"]]
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in [" 8", " 1 2 3 and more", " hello world"]]

    def logprobs(rows):
        ids, mask, resp = common.join_prompt_response([p for p, _ in rows], [r for _, r in rows], tok.pad_token_id)
        with torch.no_grad():
            return common.response_logprobs(model, ids, mask, resp.shape[1]) * resp

    # float32's rounding of two layouts (helpers.fp32_rtol over the model's sums) of the log-probs' terms' size
    rtol = fp32_rtol(forward_lengths(model.config, 16))
    assert padded_vs_alone(logprobs, list(zip(prompts, responses))) <= rtol * logprob_size(model)
    torch.manual_seed(0)
    scorer = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    scorer.config.pad_token_id = tok.pad_token_id

    def scores(rows):
        ids, mask = common.pad([p + r for p, r in rows], tok.pad_token_id, side="right")
        with torch.no_grad():
            return common.reward_scores(scorer, ids, mask)

    assert padded_vs_alone(scores, list(zip(prompts, responses))) <= rtol * logit_size(scorer)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chat_template_renders_one_bos_and_trains_on_the_assistant_turn_only(family, folders):
    """Whatever writes BOS (the template, the tokenizer's post-processor, or both) the prompt
    holds one; the tokens the loss is on are the assistant's answer and the template's end of
    turn, with no EOS appended after it."""
    path = folders(family)
    tok = models.load_tokenizer(path)
    ds = data.split_messages(__import__("datasets").Dataset.from_list(
        [{"messages": question(5) + chat(("assistant", "12"))}]), "rows.jsonl")
    prompts, completions, _ = sft.encode_sft(ds, tok, sft.Config(max_prompt_len=64, max_response_len=32), "rows.jsonl")
    template = FAMILIES[family][2]
    end_of_turn = "<|im_end|>" if template == "chatml" else TURN_TOKENS[template][-1]
    text = tok.apply_chat_template(question(5), tokenize=False, add_generation_prompt=True)
    adds_bos = tok.bos_token_id in tok("x")["input_ids"]  # the post-processor writes one
    writes_bos = "bos_token" in tok.chat_template  # the template writes one
    # one BOS at the start, whoever writes it; SmolLM2's BOS <|im_start|> also opens every later turn
    assert prompts[0][:2] != [tok.bos_token_id] * 2
    assert prompts[0].count(tok.bos_token_id) == max(text.count(tok.bos_token), adds_bos or writes_bos)
    assert tok.decode(completions[0]).startswith("12" + end_of_turn)
    assert completions[0].count(tok.convert_tokens_to_ids(end_of_turn)) == 1
    assert tok.eos_token_id not in completions[0] or tok.eos_token == end_of_turn


@pytest.mark.parametrize("fmt", ["plain", "chat"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_script_trains_each_family(family, fmt, folders, files, tmp_path):
    """Two steps of each script. First steps are checked where their value is known: DPO's loss
    is log 2 with zero margins (policy == reference, computed in separate forwards), GRPO's KL
    and clipped share are 0 (one update per rollout: the rollout's log-probs are the policy's).
    Every run moves the weights (GRPO's through its entropy bonus too: a random model's groups
    often all score 0) and keeps its tokenizer's template."""
    from helpers import checkpoint_weights, max_abs_diff

    path = folders(family)
    f = files[fmt]
    common_args = dict(model=path, steps=2, warmup_steps=0, eval_every=100, max_prompt_len=48)
    runs = {
        "sft": sft.Config(dataset=f["sft"], eval_dataset=f["sft"], batch_size=4, n_eval=2, max_response_len=8,
                          lr=1e-2, **common_args),
        "reward": reward.Config(dataset=f["rm"], eval_dataset=f["rm"], batch_size=4, n_eval=2, normalize=False,
                                max_response_len=8, lr=1e-2, **common_args),
        "dpo": dpo.Config(dataset=f["pairs"], eval_dataset=f["pairs"], batch_size=4, n_eval=2, n_eval_prompts=2,
                          max_response_len=8, lr=1e-2, **common_args),
        "grpo": grpo.Config(dataset=f["grpo"], prompts_per_step=2, group_size=2, max_new_tokens=6, n_eval=2,
                            n_eval_pairs=2, num_iterations=1, num_mini_batches=1, lr=1e-2, beta=0.04,
                            entropy_coef=0.01, **common_args),  # a gradient even when every group ties
    }
    start = checkpoint_weights(path, ".")
    modules = dict(sft=sft, reward=reward, dpo=dpo, grpo=grpo)
    for name, cfg in runs.items():
        cfg.out_dir = str(tmp_path / name)
        modules[name].main(cfg)
        rows = [r for r in read_metrics(cfg.out_dir) if "loss" in r]  # the training steps
        assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), (name, rows)
        if name == "dpo":  # h: the reference's log-probs in another layout, float32's rounding of their terms
            h = fp32_rtol(forward_lengths(checkpoint_config(cfg.out_dir), 48 + 8) + [8]) * (
                abs(rows[0]["logps/chosen"]) + abs(rows[0]["logps/rejected"]))
            assert rows[0]["loss"] == pytest.approx(math.log(2), abs=h) and abs(rows[0]["rewards/margins"]) <= h
        if name == "grpo":  # the reference is a frozen copy, on the update's micro-batches: exact (test_exact.py)
            assert rows[0]["kl"] == 0 and rows[0]["clip_ratio/low"] == rows[0]["clip_ratio/high"] == 0
        weights = checkpoint_weights(cfg.out_dir)
        shared = {k: v for k, v in weights.items() if k in start}
        assert max_abs_diff({k: start[k] for k in shared}, shared) > 1e-4, f"{name} did not change the weights"
        assert models.load_tokenizer(cfg.out_dir).chat_template == models.load_tokenizer(path).chat_template
