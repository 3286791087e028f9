"""Conversational data (TRL's formats) through every script: rows of {"role", "content"}
messages rendered with the tokenizer's chat template, on a ChatML tokenizer trained in the test
(tests/helpers.py::family_tokenizer) and a small GPT-2 of its vocabulary."""
import json

import datasets
import pytest
import torch

import data
import dpo
import grpo
import reward
import sft
from helpers import chat, family_tokenizer, question, read_metrics, write_jsonl
from plumbing import cli, models



@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A folder with a 1-layer GPT-2 and the ChatML tokenizer (<|im_end|> ends a turn and is EOS)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    path = tmp_path_factory.mktemp("chat_model")
    tok = family_tokenizer("bos", chat=True)
    config = GPT2Config(vocab_size=len(tok), n_layer=1, n_embd=32, n_head=2, n_positions=256,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_messages_render_to_a_prompt_and_exactly_the_assistant_turn(chat_model):
    """SFT's `messages` rows: the last (assistant) message is the completion; the prompt ends with
    the template's generation prompt; the loss mask covers exactly the assistant turn as the
    template renders it, its end-of-turn token included, and no EOS is added after it."""
    tok = models.load_tokenizer(chat_model)
    rows = [{"messages": question(5) + chat(("assistant", "12"))}]
    ds = data.split_messages(datasets.Dataset.from_list(rows), "rows.jsonl")
    assert ds[0]["prompt"] == question(5) and ds[0]["completion"] == chat(("assistant", "12"))
    text, is_chat = data.render_chat(ds, tok, "rows.jsonl")
    assert is_chat and text[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert text[0]["completion"] == "12<|im_end|>\n"
    prompts, completions, masks = sft.encode_sft(ds, tok, cli.with_defaults(sft.Config()), "rows.jsonl")
    assert prompts[0][:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]  # one BOS
    ids, attn, resp = sft.make_batch(prompts, completions, masks, [0], tok.pad_token_id, "cpu")
    trained = ids[0, -resp.shape[1]:][resp[0].bool()].tolist()
    assert tok.decode(trained) == "12<|im_end|>\n" and trained.count(tok.eos_token_id) == 1


def test_implicit_prompt_conversations_split_at_their_shared_turns(tmp_path, chat_model):
    tok = models.load_tokenizer(chat_model)
    rows = [{"chosen": question(i) + chat(("assistant", str(i + 7))),
             "rejected": question(i) + chat(("assistant", "no"))} for i in range(3)]
    pairs = data.load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows), "train")
    assert pairs[1]["prompt"] == question(1) and pairs[1]["chosen"] == chat(("assistant", "8"))
    text, _ = data.render_chat(pairs, tok, "pairs.jsonl")
    assert (text[1]["chosen"], text[1]["rejected"]) == ("8<|im_end|>\n", "no<|im_end|>\n")
    write_jsonl(tmp_path / "bad.jsonl", [rows[0], {"chosen": chat(("user", "a")), "rejected": chat(("user", "b"))}])
    with pytest.raises(ValueError, match=r"bad.jsonl row 2: the chosen and rejected conversations must share"):
        data.load_pairs(str(tmp_path / "bad.jsonl"), "train")


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": question(1), "completion": chat(("assistant", "8"))},
      {"prompt": "What is 2 + 7?", "completion": chat(("assistant", "9"))}],
     r"rows.jsonl row 2: field 'prompt' is str, while earlier rows hold list"),
    ([{"prompt": [{"role": "user"}], "completion": "8"}],
     r"rows.jsonl row 1: field 'prompt' is a list but not of \{\"role\", \"content\"\} messages"),
    ([{"messages": question(1)}], r"rows.jsonl row 1: `messages` must end with an assistant message"),
])
def test_malformed_conversations_are_named_with_their_row(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        data.load_data(write_jsonl(tmp_path / "rows.jsonl", rows), "train", ["prompt", "completion"])


def test_conversations_without_a_chat_template_name_the_flag(tmp_path):
    tok = family_tokenizer("bpe")  # no template
    ds = datasets.Dataset.from_list([{"prompt": question(1), "completion": chat(("assistant", "8"))}])
    with pytest.raises(ValueError, match=r"rows.jsonl: conversational rows need a chat template.*--chat_template FILE"):
        data.render_chat(ds, tok, "rows.jsonl")
    mixed = datasets.Dataset.from_list([{"prompt": question(1), "completion": "8"}])
    with pytest.raises(ValueError, match=r"columns \['prompt'\] are conversations but \['completion'\] are text"):
        data.render_chat(mixed, family_tokenizer("bos", chat=True), "rows.jsonl")
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert models.load_tokenizer("tiny", chat_template=str(template)).chat_template == template.read_text()
    with pytest.raises(FileNotFoundError, match="--chat_template nope.jinja: no such file"):
        models.load_tokenizer("tiny", chat_template="nope.jinja")


def test_every_script_trains_on_conversational_rows(tmp_path, chat_model, capsys):
    """A step of each script on a local file in a conversational format: SFT's `messages`, the
    reward model's explicit prompt/chosen/rejected conversations, DPO's implicit prompt, GRPO's
    conversational prompts; each logs a finite loss and its checkpoint keeps the template."""
    from transformers import AutoTokenizer

    sft_rows = [{"messages": question(i) + chat(("assistant", str(i + 7)))} for i in range(16)]
    explicit = [{"prompt": question(i), "chosen": chat(("assistant", str(i + 7))), "rejected": chat(("assistant", "no"))}
                for i in range(16)]
    implicit = [{"chosen": question(i) + chat(("assistant", str(i + 7))), "rejected": question(i) + chat(("assistant", "no"))}
                for i in range(16)]
    prompts = [{"prompt": question(i)} for i in range(16)]
    common_args = dict(model=chat_model, steps=1, warmup_steps=0, eval_every=100, max_prompt_len=48)
    runs = [
        (sft, sft.Config(dataset=write_jsonl(tmp_path / "sft.jsonl", sft_rows), batch_size=4, n_eval=4,
                         eval_dataset=str(tmp_path / "sft.jsonl"),
                         max_response_len=8, **common_args), "loss"),
        (reward, reward.Config(dataset=write_jsonl(tmp_path / "rm.jsonl", explicit), batch_size=4, n_eval=4,
                               eval_dataset=str(tmp_path / "rm.jsonl"),
                               normalize=False, max_response_len=8, **common_args), "loss"),
        (dpo, dpo.Config(dataset=write_jsonl(tmp_path / "dpo.jsonl", implicit), batch_size=4, n_eval=4,
                         eval_dataset=str(tmp_path / "dpo.jsonl"), n_eval_prompts=4,
                         max_response_len=8, **common_args), "loss"),
        (grpo, grpo.Config(dataset=write_jsonl(tmp_path / "grpo.jsonl", prompts), reward_fn="digits",
                           prompts_per_step=2, group_size=2, max_new_tokens=6, n_eval_pairs=4, **common_args), "loss"),
    ]
    for module, cfg, key in runs:
        cfg.out_dir = str(tmp_path / module.__name__)
        module.main(cfg)
        row = read_metrics(tmp_path / module.__name__)[-1]
        assert row["step"] == 1 and torch.isfinite(torch.tensor(row[key])), (module.__name__, row)
        saved = AutoTokenizer.from_pretrained(tmp_path / module.__name__ / "checkpoint")
        assert saved.chat_template == models.load_tokenizer(chat_model).chat_template
    json.dumps(capsys.readouterr().out)  # the logs rendered without error
