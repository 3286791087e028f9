"""Tests of sft.py: the loss mask and normaliser, and real runs of the script in subprocesses."""
import dataclasses

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import sft
import tasks
from helpers import (HANG_GUARD_S, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, TWO_RANK_RUNS, adam_drift, assert_runs_agree,
                     chat, chat_rows, checkpoint_config, checkpoint_weights, forward_lengths, fp32_rtol, max_abs_diff,
                     read_metrics, run_here, run_script, write_jsonl)
from plumbing import cli, models

pytestmark = pytest.mark.session_fixtures("smollm2")  # request.getfixturevalue: tests/two_processes.py

FAST = ["--n_train", "256", "--n_eval", "8", "--batch_size", "8", "--max_response_len", "20", "--warmup_steps", "2"]


def run_sft(args, nproc=1, timeout=HANG_GUARD_S):
    """python sft.py ARGS: in this process (helpers.run_here), under torchrun when nproc > 1."""
    if nproc == 1:
        return run_here(["sft.py", *args])
    return run_script(["sft.py", *args], nproc, timeout, env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)


def test_loss_mask_covers_exactly_the_completion_and_eos():
    tok = tasks.char_tokenizer()
    ds = data.load_data("sort", "train", ["prompt", "completion"], kind="sft", n=4, seed=0)
    cfg = sft.Config(max_prompt_len=64, max_response_len=32)
    prompts, completions, masks = sft.encode_sft(ds, tok, cfg, "sort")
    ids, attn, resp = sft.make_batch(prompts, completions, masks, [0, 1, 2, 3], tok.pad_token_id, "cpu")
    R = resp.shape[1]
    for i, row in enumerate(ds):
        labels = ids[i, -R:][resp[i].bool()].tolist()  # the tokens the loss is taken on
        assert labels[-1] == tok.eos_token_id
        assert tok.decode(labels[:-1]) == row["completion"]
        context = ids[i, :-R][attn[i, :-R].bool()].tolist()  # everything before: the prompt alone
        assert tok.decode(context) == row["prompt"]


def test_accumulated_loss_equals_the_full_batch_token_mean():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    full = -(logps * mask).sum() / mask.sum()  # naive token mean of the whole batch
    n = mask.sum()
    parts = sum(sft.sft_loss(logps[i:i + 2], mask[i:i + 2], n)[0] for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)
    # a per-micro-batch mean (the classic bug) would differ whenever token counts differ
    naive = sum(sft.sft_loss(logps[i:i + 2], mask[i:i + 2], mask[i:i + 2].sum())[0] for i in range(0, 6, 2)) / 3
    assert abs(naive - full) > 1e-4


def test_sft_runs_and_its_checkpoint_loads(tmp_path):
    out = tmp_path / "sft"
    r = run_sft(["--out_dir", str(out), "--steps", "4", "--eval_every", "2", *FAST])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("step ") >= 5  # a line per step, plus the step-0 eval
    rows = read_metrics(out)
    assert [m["step"] for m in rows] == [0, 1, 2, 3, 4]
    assert all(0 <= m["eval/exact_match"] <= 1 for m in rows if "eval/exact_match" in m)
    # trained, in the right direction: the held-out loss falls from 4.63 to 3.30 (measured), and
    # rises (to 6.15) with the loss's sign flipped
    eval_loss = [m["eval/loss"] for m in rows if "eval/loss" in m]  # steps 0, 2, 4
    assert eval_loss[-1] < eval_loss[0] - 0.5, eval_loss
    # `lr` is the rate each step's update used (warmup 2 of 4 steps: 0, lr/2, lr, then cosine), not
    # the scheduler's next one, which the log showed one step early
    lr = sft.Config.DEFAULTS["embedded"]["lr"]  # the embedded task's (--dataset sort)
    assert [m["lr"] for m in rows[1:]] == pytest.approx([0, lr / 2, lr, lr / 2], abs=1e-12)
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    tok = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert model.config.vocab_size == len(tok)
    ids = tok("sort 3 1 =", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_unknown_flag_is_named():
    r = run_sft(["--lerning_rate", "1e-3"])
    assert r.returncode == 2
    assert "sft.py: unknown flag --lerning_rate; did you mean --lr (TRL: --learning_rate)?" in r.stderr


def test_jsonl_row_missing_completion_is_named(tmp_path):
    data = tmp_path / "demos.jsonl"
    write_jsonl(data, [{"prompt": "a", "completion": " b"}, {"prompt": "c"}])
    r = run_sft(["--model", "tiny", "--dataset", str(data), "--out_dir", str(tmp_path / "o"), "--steps", "1"])
    assert r.returncode != 0
    assert f"{data} row 2: missing field 'completion'" in r.stderr
    assert not (tmp_path / "o" / "checkpoint").exists()


def test_grad_accum_gives_the_full_batch_loss_and_gradient(tmp_path):
    """One batch as 1 micro-batch or as 4: the same loss and the same gradient norm. Dividing each
    micro-batch by its own token count (the classic bug) weights a token of a short micro-batch more
    and still trains, so every other test passes; the logged loss is summed apart from the backward
    (nll_sum / n_tokens) and would not show it, the gradient norm does."""
    args = ["--steps", "1", "--eval_every", "1", *FAST, "--warmup_steps", "0", "--n_eval", "2", "--seed", "3"]
    for accum in (1, 4):  # in this process: the two runs differ in --grad_accum only
        sft.main(cli.parse_config(sft.Config, args + ["--out_dir", str(tmp_path / str(accum)),
                                                         "--grad_accum", str(accum)]))
    (a,), (b,) = ([m for m in read_metrics(tmp_path / str(accum)) if m["step"] == 1] for accum in (1, 4))
    assert a["tokens"] == b["tokens"]  # the same global batch
    # within float32's rounding of the two layouts (helpers.assert_runs_agree: the grad norm's 1.1e-4
    # of its size, the norm's own sum alike in both); the per-micro-batch mean moved it by 4e-4
    assert_runs_agree([a], [b], checkpoint_config(tmp_path / "1"), length=64, lr=0, tokens=8 * 64, norm_terms=0)


TWO_RANK_ARGS = ["--steps", "3", "--eval_every", "3", *FAST, "--n_eval", "7", "--eval_batch_size", "1",
                 "--max_prompt_len", "128", "--eval_dataset", "sort", "--lr", "1e-4"]


def two_rank_argv(folder, models):
    """The Llama-3-shaped folder (helpers.build_user_models) on conversational `messages` rows
    rendered with its template; held out: the embedded task's rows, whose greedy answers are scored."""
    rows = write_jsonl(folder / "messages.jsonl", chat_rows(64, "sft"))
    return ["sft.py", *TWO_RANK_ARGS, "--model", models["llama"], "--dataset", rows, "--out_dir", str(folder / "two")]


TWO_RANK_RUNS["sft"] = two_rank_argv


def test_two_processes_match_one_process(tmp_path, user_models, two_ranks):
    """FSDP2 over 2 gloo processes on the same global batch, from a checkpoint folder rank 0 reads
    alone: same loss per step, same weights, same evaluation. With 7 eval rows at one row per
    forward the ranks hold 4 and 3: a strided split would run 4 forwards on rank 0 and 3 on rank 1,
    and rank 0's last FSDP all-gather would wait for a rank that never comes (the run hangs until
    the timeout). The 2-rank run is conftest.py's `two_ranks`."""
    argv = two_rank_argv(tmp_path, user_models)
    one = run_sft(argv[1:-2] + ["--out_dir", str(tmp_path / "one"), "--grad_accum", "2"])
    assert one.returncode == 0, one.stderr
    two = two_ranks("sft") / "two"
    m1, m2 = read_metrics(tmp_path / "one"), read_metrics(two)
    assert [m["step"] for m in m1 if "eval/loss" in m] == [0, 3]  # the evaluation at the start and at the end
    # the micro-batches of --grad_accum 2 are the ranks' (step 1 measured equal to the bit, the
    # weights 4e-9 apart), but the grad norm's sum over FSDP's shards is not the whole tensors':
    # within the bounds of helpers.assert_runs_agree; the weights within adam_drift
    assert_runs_agree(m1, m2, checkpoint_config(tmp_path / "one"), length=128 + 20, lr=1e-4,
                      keys=("loss", "grad_norm", "eval/loss"), tokens=4 * (128 + 20))
    assert m1[0]["eval/exact_match"] == m2[0]["eval/exact_match"]  # eval generation under FSDP too (greedy)
    assert max_abs_diff(checkpoint_weights(tmp_path / "one"), checkpoint_weights(two)) <= adam_drift(1e-4, 3)


@pytest.mark.parametrize("args, match", [(["--batch_size", "6", "--grad_accum", "4"], "must be divisible")])
def test_bad_batch_arithmetic_is_explained(tmp_path, args, match):
    r = run_sft(["--out_dir", str(tmp_path), "--steps", "1", *args])
    assert r.returncode != 0 and match in r.stderr


def test_sft_on_a_local_file_holds_out_rows_by_hash(tmp_path, capsys):
    """Without --eval_dataset, eval/loss came from the first training rows. Now the rows whose
    prompt hashes into 5% are held out and not trained on; with --eval_dataset, all are trained."""
    rows = [{"prompt": f"sort {i % 10} {i // 10} =", "completion": f" {min(i % 10, i // 10)}"} for i in range(100)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    held = sum(data.held_out(r["prompt"]) for r in rows)
    assert 0 < held < 20
    cfg = sft.Config(model="tiny", dataset=path, steps=1, batch_size=4, n_eval=50, warmup_steps=0,
                     out_dir=str(tmp_path / "split"))
    sft.main(cfg)
    out = capsys.readouterr().out
    assert f"{100 - held} train rows" in out and f"the {held} of 100 rows whose prompt hashes" in out
    sft.main(dataclasses.replace(cfg, eval_dataset=path, out_dir=str(tmp_path / "given")))
    assert "100 train rows" in capsys.readouterr().out
    split, given = read_metrics(tmp_path / "split"), read_metrics(tmp_path / "given")
    assert split[0]["eval/loss"] != given[0]["eval/loss"]  # other rows: the held-out ones, not the first 50


# -----------------------------------------------------------------------------
# TRL's formats: every assistant turn of a conversation, every token of a text


THREE_TURNS = chat(("system", "Answer with a number."), ("user", "What is 2 + 7?"), ("assistant", "9"),
                   ("user", "And 3 + 7?"), ("assistant", "It is 10."), ("user", "And 12 + 7?"), ("assistant", "19, I think"))
END_OF_TURN = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>\n", "smollm2": "<|im_end|>\n"}
"""what each template writes after an assistant turn's content, up to the next turn"""


def trained_runs(tok, completion, mask):
    """The text of each run of consecutive tokens the loss is taken on."""
    runs, run = [], []
    for t, m in zip(completion + [None], mask + [0]):
        if m:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


@pytest.mark.parametrize("name", ["llama", "qwen2", "smollm2"])
def test_every_assistant_turn_of_a_conversation_is_trained_on_and_nothing_else(name, user_models, request):
    """TRL's assistant-only loss on a three-turn `messages` row, with the Llama-3- and Qwen2-shaped
    folders' templates and SmolLM2-Instruct's own (a default system turn when there is none): the
    tokens the loss is on are exactly the three assistant turns, each with its end of turn; the
    row is the conversation as the template writes it, nothing lost or added."""
    folder = request.getfixturevalue("smollm2") if name == "smollm2" else user_models[name]
    tok = models.load_tokenizer(folder)
    for msgs in (THREE_TURNS, THREE_TURNS[1:]):  # with and without a system turn
        ds = data.split_messages(datasets.Dataset.from_list([{"messages": msgs}]), "rows.jsonl", every_turn=True)
        prompts, completions, masks = sft.encode_sft(ds, tok, sft.Config(max_prompt_len=512, max_response_len=512),
                                                     "rows.jsonl")
        turns = [m["content"] + END_OF_TURN[name] for m in msgs if m["role"] == "assistant"]
        assert trained_runs(tok, completions[0], masks[0]) == turns
        assert tok.decode(prompts[0] + completions[0]) == tok.apply_chat_template(msgs, tokenize=False)


def naive_nll(model, ids, trained):
    """The NLL sum of the tokens at positions `trained` of one sequence, and their count, from
    one plain forward (log_softmax in float64)."""
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return -sum(logps[t - 1, ids[t]].item() for t in trained), len(trained)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sft_s_loss_on_conversations_and_texts_is_the_naive_nll_of_their_trained_tokens(name, user_models, tmp_path):
    """One step of sft.py on four three-turn conversations, then on four `text` rows: the logged
    loss equals a naive token mean computed from the whole text tokenised at once. A conversation's
    tokens are those whose characters lie in an assistant turn (content and end of turn, found by
    searching the text); a text's are all but the first, and the EOS after it (TRL's language
    modelling: Llama's BOS is the first, Qwen2 adds none, so there the text's first token is)."""
    folder = user_models[name]
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    convs = [[THREE_TURNS[0]] + [dict(m, content=f"{m['content']} ({i})") for m in THREE_TURNS[1:]] for i in range(4)]
    texts = [f"the quick brown fox {i} is a test" for i in range(4)]
    for fmt, rows in (("messages", convs), ("text", texts)):
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", [{fmt: r} for r in rows])
        sft.main(sft.Config(model=folder, dataset=path, eval_dataset=path, steps=1, batch_size=4, n_eval=4,
                            warmup_steps=0, max_prompt_len=512, max_response_len=512, out_dir=str(tmp_path / fmt)))
        nll = n = 0
        for r in rows:
            if fmt == "text":
                ids = tok(r)["input_ids"] + [tok.eos_token_id]
                trained = range(1, len(ids))
            else:
                text = tok.apply_chat_template(r, tokenize=False)
                enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                spans, at = [], 0
                for m in r[1:]:
                    if m["role"] == "assistant":
                        start = text.index(m["content"] + END_OF_TURN[name], at)
                        at = start + len(m["content"] + END_OF_TURN[name])
                        spans.append((start, at))
                ids = enc["input_ids"]
                trained = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if any(s <= a < b <= e for s, e in spans)]
                assert tok.decode([ids[t] for t in trained]) == "".join(text[s:e] for s, e in spans)
            row_nll, row_n = naive_nll(model, ids, trained)
            nll, n = nll + row_nll, n + row_n
        # the script's batch and the naive whole-text forward: float32's rounding of two layouts
        assert read_metrics(tmp_path / fmt)[1]["loss"] == pytest.approx(
            nll / n, abs=fp32_rtol(forward_lengths(model.config, 512)) * abs(nll / n)), fmt


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_row_and_turn(user_models):
    """A template that drops the reasoning of earlier assistant turns (as Qwen3's does) renders a
    turn one way when it is last and another once later turns follow: its tokens have no place in
    the conversation, and the row is refused rather than trained on the wrong tokens."""
    tok = models.load_tokenizer(user_models["qwen2"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not "
                         "loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = chat(("user", "2 + 7?"), ("assistant", "<think>nine</think>9"), ("user", "3 + 7?"), ("assistant", "10"))
    ds = data.split_messages(datasets.Dataset.from_list([{"messages": THREE_TURNS[1:]}, {"messages": msgs}]),
                             "rows.jsonl", every_turn=True)
    with pytest.raises(ValueError, match=r"rows.jsonl row 2: the chat template renders message 2 \(an assistant turn\) "
                                         r"differently once later turns follow it"):
        data.assistant_turns(ds, tok, "rows.jsonl")
