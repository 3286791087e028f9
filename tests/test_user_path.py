"""The path users take: checkpoint folders of real architectures (helpers.build_user_models: a
Llama-3-shaped model with RoPE, GQA, an untied head, a BOS-adding BPE tokenizer, a chat template
and an end-of-turn id beside its EOS; a Qwen2-shaped one with tied embeddings and ChatML; a Llama
reward model and teacher), loaded from a path as users load them (under torchrun rank 0 reads
and broadcasts), trained on conversational rows in TRL's formats. Each script on 2 ranks
reproduces 1 process (the 2-rank runs are conftest.py's `two_ranks`), and every model carries an
attention dropout of 0.1 that no forward may apply (models.no_dropout): at lr 0 the KL to the
reference is 0 and no token is clipped, under `python` and torchrun, with and without activation
checkpointing."""
import json
import math
import os

import pytest
import torch

from helpers import (TWO_RANK_RUNS, adam_drift, assert_runs_agree, chat_rows, checkpoint_config, checkpoint_weights,
                     forward_lengths, fp32_rtol, logprob_size, max_abs_diff, read_metrics, run_here, write_jsonl)
from plumbing import checkpoints, cli, lengths, models


def run_ok(argv):
    """A script in this process (helpers.run_here); its out_dir's metrics rows."""
    proc = run_here(argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = argv[argv.index("--out_dir") + 1]
    return read_metrics(out)




# -----------------------------------------------------------------------------
# reward.py: a reward model started from a causal LM's folder (a new score head), on
# conversational pairs rendered with the Llama-3 template


def reward_argv(folder, models):
    data = write_jsonl(folder / "pairs.jsonl", chat_rows(32, "preference"))
    return ["reward.py", "--model", models["llama"], "--dataset", data, "--eval_dataset", data, "--steps", "3",
            "--batch_size", "8", "--grad_accum", "2", "--lr", "1e-4", "--warmup_steps", "0", "--max_prompt_len", "128",
            "--max_response_len", "16", "--n_eval", "16", "--eval_every", "3", "--n_normalize", "8",
            "--out_dir", str(folder / "run")]


TWO_RANK_RUNS["reward_folder"] = reward_argv


def test_reward_model_from_a_folder_two_processes_match_one(tmp_path, user_models, two_ranks):
    """`torchrun --nproc_per_node 2 reward.py --model FOLDER` crashed at load on both ranks (rank 0
    read the generation config a score model does not have). Now the same losses, accuracies,
    normalisation and weights as 1 process; the export loads as a sequence classifier whose config
    keeps the checkpoint's attention dropout."""
    from transformers import AutoModelForSequenceClassification

    one = run_ok(reward_argv(tmp_path, user_models))
    out = two_ranks("reward_folder") / "run"
    # within float32's rounding and Adam's drift (helpers.assert_runs_agree; accuracies and the
    # normalisation after training have no bound short of the weights'); the weights within adam_drift
    assert_runs_agree(one, read_metrics(out), checkpoint_config(tmp_path / "run"), length=128 + 16, lr=1e-4)
    assert max_abs_diff(checkpoint_weights(tmp_path / "run"), checkpoint_weights(out)) <= adam_drift(1e-4, 3)
    model = AutoModelForSequenceClassification.from_pretrained(out / "checkpoint")
    assert model.config.num_labels == 1 and model.config.attention_dropout == 0.1


# -----------------------------------------------------------------------------
# dpo.py on the Qwen2-shaped folder (tied embeddings, ChatML): the reference precomputed and live


def dpo_argv(folder, models, *extra):
    data = write_jsonl(folder / "pairs.jsonl", chat_rows(32, "preference"))
    return ["dpo.py", "--model", models["qwen2"], "--dataset", data, "--eval_dataset", data, "--steps", "3",
            "--batch_size", "8", "--lr", "3e-4", "--warmup_steps", "0", "--max_prompt_len", "128",
            "--max_response_len", "16", "--n_eval", "16", "--eval_every", "3", "--out_dir", str(folder / "run"), *extra]


TWO_RANK_RUNS["dpo_folder_precomputed"] = dpo_argv
TWO_RANK_RUNS["dpo_folder_live"] = lambda folder, models: dpo_argv(folder, models, "--no-precompute_ref",
                                                                    "--grad_accum", "2")


def test_dpo_from_a_folder_two_processes_match_one_with_either_reference(tmp_path, user_models, two_ranks):
    """1 process with the reference's log-probs precomputed against 2 ranks with them precomputed
    and with a live (sharded) reference: the same loss (ln 2 at step 1: the policy is its
    reference), implicit rewards, eval accuracy and weights."""
    one = run_ok(dpo_argv(tmp_path, user_models))
    config, logps = checkpoint_config(tmp_path / "run"), ["logps/chosen", "logps/rejected"]
    # the policy is its reference: h is the rounding of log-probs' differences (beta <= 1)
    ln2 = fp32_rtol(forward_lengths(config, 128 + 16)) * (abs(one[1]["logps/chosen"]) + abs(one[1]["logps/rejected"]))
    assert one[1]["loss"] == pytest.approx(math.log(2), abs=ln2)
    for name in ("dpo_folder_precomputed", "dpo_folder_live"):
        out = two_ranks(name) / "run"
        assert_runs_agree(one, read_metrics(out), config, length=128 + 16, lr=3e-4,
                          keys=("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "grad_norm"),
                          scales=dict.fromkeys(("loss", "rewards/margins", "rewards/chosen"), logps))
        assert max_abs_diff(checkpoint_weights(tmp_path / "run"), checkpoint_weights(out)) <= adam_drift(3e-4, 3), name


# -----------------------------------------------------------------------------
# grpo.py: conversational prompts, a rule, a reward model and a teacher at once


def grpo_argv(folder, models, *extra):
    data = write_jsonl(folder / "prompts.jsonl", chat_rows(16, "prompt"))
    return ["grpo.py", "--model", models["llama"], "--dataset", data, "--steps", "2", "--prompts_per_step", "4",
            "--group_size", "4", "--max_prompt_len", "128", "--max_new_tokens", "8", "--temperature", "0.7",
            "--eval_every", "1", "--warmup_steps", "0", "--out_dir", str(folder / "run"), *extra]


def grpo_everything(folder, models):
    return grpo_argv(folder, models, "--reward_model", models["llama_rm"], "--reward_weights", "rule:1,model:0.5",
                     "--teacher", models["llama_teacher"], "--teacher_coef", "0.5", "--lr", "1e-4")


def grpo_lr0(folder, models, *extra):
    return grpo_argv(folder, models, "--reward_model", models["llama_rm"], "--lr", "0", "--steps", "1", "--beta", "0.04",
                     "--num_iterations", "2", "--num_mini_batches", "2", *extra)  # a reference, an old policy's pass


TWO_RANK_RUNS["grpo_folder"] = grpo_everything
TWO_RANK_RUNS["grpo_folder_lr0"] = lambda folder, models: grpo_lr0(folder, models, "--activation_checkpointing")


def test_grpo_from_folders_two_processes_match_one(tmp_path, user_models, two_ranks):
    """A Llama policy, a Llama reward model and a Llama teacher, each read from its folder by rank 0
    alone: the rewards (rule and model), the distillation term, the loss, the grad norm and the
    weights of 2 ranks are those of 1 process, and the export keeps the generation config's two
    end ids."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    one = run_ok(grpo_everything(tmp_path, user_models))
    out = two_ranks("grpo_folder") / "run"
    two = read_metrics(out)
    assert [r["step"] for r in one] == [0, 1, 2] and all(r["reward_std"] > 0 for r in one[1:])  # 0: the held-out row
    # step 1 (one optimizer step a step here: TRL's defaults for a model of your own) and step 0's
    # evaluation at the starting weights, tight; the last loss within rounding and Adam's drift. A
    # mean's terms are within its std of it (rewards); the distillation's are log-probs, and the
    # loss's advantages: |A| <= (G - 1) / sqrt(G) = 1.5 in a group of 4, plus 0.5 x a log-prob difference
    size = logprob_size(AutoModelForCausalLM.from_pretrained(user_models["llama"]), temperature=0.7)
    assert_runs_agree(one, two, checkpoint_config(tmp_path / "run"), length=128 + 8, lr=1e-4,
                      keys=("reward", "reward/rule", "reward/model", "distill/reverse_kl", "loss",
                            "eval/rewards/rule/mean", "grad_norm", "completions/mean_length"),
                      start_keys=("reward", "reward/rule", "reward/model", "completions/mean_length"),
                      scales={"reward": ["reward_std"], "reward/model": ["rewards/model/std"],
                              "distill/reverse_kl": [2 * size], "loss": [1.5 + 0.5 * 2 * size]})
    assert max_abs_diff(checkpoint_weights(tmp_path / "run"), checkpoint_weights(out)) <= adam_drift(1e-4, 2)
    assert AutoModelForCausalLM.from_pretrained(out / "checkpoint").config.attention_dropout == 0.1
    assert len(GenerationConfig.from_pretrained(out / "checkpoint").eos_token_id) == 2


def assert_never_moved(rows, folder):
    """lr 0: the policy is its reference and its own old self, so each token's KL is 0 and its
    ratio 1, exactly (fp32 on the CPU, the same kernels), whatever its advantage; the sampler's
    log-probs are the trainer's within float32's rounding of the two layouts (folder: the policy)."""
    from transformers import AutoModelForCausalLM

    (step,) = [r for r in rows if r["step"] == 1]
    model = AutoModelForCausalLM.from_pretrained(folder)
    bound = fp32_rtol(forward_lengths(model.config, 128 + 8)) * logprob_size(model, temperature=0.7)
    assert step["reward_std"] > 0  # advantages that are not 0, which a ratio off 1 would clip
    assert step["kl"] == 0 and step["clip_ratio/low"] == 0 and step["clip_ratio/high"] == 0, step
    assert step["rollout/logp_diff"] < bound, (step, bound)


@pytest.mark.parametrize("ac", [[], ["--activation_checkpointing"]], ids=["eager", "checkpointing"])
def test_no_dropout_at_lr_0_under_python(tmp_path, user_models, ac):
    """The folders' attention dropout of 0.1 reaches SDPA as a float whenever the model is in
    train mode (activation checkpointing needs it): with only nn.Dropout modules zeroed, the KL at
    lr 0 was 1.4e-4 with checkpointing. Two passes over two mini-batches: the old log-probs are a
    forward of their own, so the ratio is computed, not assumed."""
    rows = run_ok(grpo_lr0(tmp_path, user_models, *ac))
    assert_never_moved(rows, user_models["llama"])


def test_no_dropout_at_lr_0_under_torchrun(two_ranks, user_models):
    """Under torchrun rank 1 builds its model from the config on the meta device (train mode, where
    rank 0's from_pretrained gives eval mode), with activation checkpointing."""
    assert_never_moved(read_metrics(two_ranks("grpo_folder_lr0") / "run"), user_models["llama"])


def test_lora_on_a_folder_exports_merged_weights(tmp_path, user_models):
    """--lora on the Llama folder (peft's adapters on every linear layer but the head): the export
    is a plain Llama checkpoint, adapters merged, its weights moved from the folder's."""
    pytest.importorskip("peft")
    rows = run_ok(grpo_argv(tmp_path, user_models, "--lora", "--lr", "1e-2", "--steps", "1", "--eval_every", "5"))
    assert rows[-1]["grad_norm"] > 0
    after, before = (checkpoint_weights(p, name="") for p in (tmp_path / "run" / "checkpoint", user_models["llama"]))
    assert after.keys() == before.keys()  # no adapter left
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-4
    with open(tmp_path / "run" / "checkpoint" / "config.json") as f:
        assert json.load(f)["attention_dropout"] == 0.1


# -----------------------------------------------------------------------------
# dropout, for every family the tests build


def test_every_dropout_field_is_zeroed_and_kept_for_the_export(tmp_path):
    """Configs of several families with every dropout field at 0.1 (attention, hidden, residual,
    embedding, OPT's activation dropout and layerdrop): loaded by models.load_model, two forwards
    of the same tokens in train mode are identical, and the config's values are what the export
    writes back."""
    import transformers
    from transformers import AutoModelForCausalLM

    from helpers import family_tokenizer

    tok = family_tokenizer("bpe")
    shape = dict(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64)
    configs = {"LlamaConfig": dict(attention_dropout=0.1), "Phi3Config": dict(attention_dropout=0.1, resid_pdrop=0.1,
                                                                               embd_pdrop=0.1),
               "GPTNeoXConfig": dict(attention_dropout=0.1, hidden_dropout=0.1),
               "OPTConfig": dict(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, layerdrop=0.1,
                                 ffn_dim=64, word_embed_proj_dim=32),
               "GPT2Config": dict(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, n_inner=64)}
    ids = torch.tensor([tok("sort 3 1 2 = 1 2 3 the quick brown fox")["input_ids"]])
    for name, fields in configs.items():
        config = getattr(transformers, name)(**shape, **fields)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        model = models.load_model(str(tmp_path / name), tok).train()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, model(ids).logits), name
        assert set(fields) - {"ffn_dim", "word_embed_proj_dim", "n_inner"} <= set(model.dropout_config), name
        checkpoints._write_export(model, tok, str(tmp_path / f"{name}-export"), model.state_dict(), None)
        with open(tmp_path / f"{name}-export" / "config.json") as f:
            written = json.load(f)
        assert all(written[k] == v for k, v in model.dropout_config.items()), (name, written)
        assert os.path.isfile(tmp_path / f"{name}-export" / "model.safetensors")


# -----------------------------------------------------------------------------
# the defaults a model named by its user gets


@pytest.mark.parametrize("script, trl", [
    ("sft", dict(lr=2e-5, max_prompt_len=512, max_response_len=512)),
    ("reward", dict(lr=1e-4, max_prompt_len=512, max_response_len=512)),
    ("dpo", dict(lr=1e-6, max_prompt_len=512, max_response_len=512)),
    ("grpo", dict(lr=1e-6, max_prompt_len=512, max_new_tokens=512))])
def test_a_model_and_data_of_your_own_get_trls_defaults(script, trl):
    """Named with a model and data of their own and no other flag, a run trains at TRL 1.16's
    learning rate and lengths, not at the embedded task's (GRPO trained Qwen at lr 1e-4 on prompts
    cut to 64 tokens); the embedded task (`--model tiny` or `--dataset sort`) keeps its own values,
    the README's; a flag given is kept either way."""
    import importlib


    Config = importlib.import_module(script).Config
    own = cli.parse_config(Config, ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", "prompts.jsonl"])
    line = cli.fill_defaults(own)
    assert {k: getattr(own, k) for k in trl} == trl and "TRL 1.16's" in line
    assert all(f"--{k} {v:g}" in line for k, v in trl.items()), line
    readme = {"sft": (1e-3, 32), "reward": (1e-3, 32), "dpo": (1e-4, 32), "grpo": (1e-4, 24)}[script]
    for argv in (["--model", "tiny", "--dataset", "prompts.jsonl"], ["--model", "runs/sft", "--dataset", "sort"]):
        cfg = cli.with_defaults(cli.parse_config(Config, argv))
        assert (cfg.lr, cfg.max_prompt_len, getattr(cfg, "max_new_tokens", getattr(cfg, "max_response_len", None))) \
            == (*readme[:1], 64, readme[1]), argv
    given = cli.with_defaults(cli.parse_config(Config, ["--model", "m", "--dataset", "d.jsonl", "--lr", "3e-4"]))
    assert given.lr == 3e-4 and given.max_prompt_len == 512


def test_the_banner_says_where_the_defaults_came_from(tmp_path, user_models):
    """grpo.py on a folder and a file of prompts, no length flags: the first lines name TRL's values,
    and the run samples up to 512 tokens (a random policy rarely stops: its longest answer is longer
    than the embedded task's 24)."""
    argv = grpo_argv(tmp_path, user_models, "--lr", "0", "--steps", "1")
    argv = [a for a in argv if a not in ("--max_prompt_len", "128", "--max_new_tokens", "8")]
    proc = run_here(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "defaults, TRL 1.16's, for a model and data of your own: --max_prompt_len 512 --max_new_tokens 512" \
        in proc.stdout, proc.stdout[:2000]
    assert read_metrics(tmp_path / "run")[-1]["completions/max_length"] > 24


# -----------------------------------------------------------------------------
# default lengths fitted to the model's context; `tiny` and its checkpoints keep the embedded task's


def test_default_lengths_that_do_not_fit_the_model_are_cut_to_fit():
    """A length filled by default (TRL's 512 + 512) that does not fit the model's context is cut to
    fit, both in the defaults' proportion, or the one filled to the room the one given leaves
    (grpo.py one fewer with a reward model, which scores an EOS after the completion), with a line;
    one given is left for the load to refuse. On the old tree DPO on a 128-position model stopped:
    `--max_prompt_len 512 + --max_response_len 512 = 1024 tokens exceeds the model's context of 128`."""
    import dpo
    import grpo
    import reward
    import sft

    mine = dict(model="mine", dataset="mine.jsonl")
    for Config in (sft.Config, reward.Config, dpo.Config):
        cfg = Config(**mine)
        line = cli.fill_defaults(cfg, (128, False))
        assert (cfg.max_prompt_len, cfg.max_response_len) == (64, 64)
        assert "--max_prompt_len 512 + --max_response_len 512 do not fit the 128 positions of --model mine: " \
               "--max_prompt_len 64 --max_response_len 64 instead" in line
        cfg = Config(**mine, max_prompt_len=100)
        cli.fill_defaults(cfg, (128, False))
        assert (cfg.max_prompt_len, cfg.max_response_len) == (100, 28)
        cfg = Config(**mine, max_prompt_len=100, max_response_len=100)
        assert "do not fit" not in cli.fill_defaults(cfg, (128, False)) and cfg.max_prompt_len == 100  # the load refuses
        cfg = Config(**mine)
        assert "do not fit" not in cli.fill_defaults(cfg, (1024, False)) and cfg.max_prompt_len == 512
    for extra, want in (({}, (64, 64)), ({"reward_model": "rm"}, (63, 64)), ({"max_new_tokens": 8}, (120, 8))):
        cfg = grpo.Config(**mine, **extra)
        cli.fill_defaults(cfg, (128, False))
        assert (cfg.max_prompt_len, cfg.max_new_tokens) == want, extra


def _tiny_checkpoint(path, **shape):
    """`tiny`'s model (or, with shape, a GPT-2 of that shape) saved with its character tokenizer."""
    import tasks
    from transformers import AutoModelForCausalLM

    tok = tasks.char_tokenizer()
    model = AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, **shape)) if shape else \
        models.load_model("tiny", tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_the_models_context_and_whether_it_is_tiny_are_read_from_its_config(tmp_path, user_models):
    """lengths.model_shape: `tiny` and a checkpoint of it (a run's out_dir too) are 128 positions and tiny;
    a GPT-2 of another shape is not tiny; a Llama folder has its max_position_embeddings; a path
    that is not there, or a GGUF file, has no context before the load."""
    import types

    ckpt = _tiny_checkpoint(tmp_path / "run" / "checkpoint")
    other = _tiny_checkpoint(tmp_path / "other", n_layer=1, n_embd=32, n_head=2, n_positions=96)

    def shape(name):
        return lengths.model_shape(types.SimpleNamespace(model=name, trust_remote_code=False))

    assert shape("tiny") == shape(ckpt) == shape(str(tmp_path / "run")) == (128, True)
    assert shape(other) == (96, False) and shape(user_models["llama"]) == (2048, False)
    assert shape(str(tmp_path / "nowhere")) == shape("model.gguf") == (None, False)


def test_dpo_on_a_tiny_checkpoint_keeps_the_embedded_tasks_lengths(tmp_path):
    """The issue's case: dpo.py on a checkpoint of `tiny` (sft.py's out_dir) with a file of pairs
    took TRL's 512 + 512 and stopped at the load (the model has 128 positions); it takes the
    embedded task's values now, as `--model tiny` does, and runs."""
    ckpt = _tiny_checkpoint(tmp_path / "sft" / "checkpoint")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"sort {i % 10} {(i * 7) % 10} =", "chosen": " 1 2",
                                                    "rejected": " 2"} for i in range(40)])
    r = run_here(["dpo.py", "--model", str(tmp_path / "sft"), "--dataset", pairs, "--steps", "1", "--batch_size", "8",
                  "--eval_every", "100", "--out_dir", str(tmp_path / "dpo")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"--model {tmp_path / 'sft'} is a checkpoint of tiny): --lr 0.0001 --max_prompt_len 64 --max_response_len 32" \
        in r.stdout, r.stdout[:2000]
    with open(tmp_path / "dpo" / "run_config.json") as f:
        config = json.load(f)
    assert (config["max_prompt_len"], config["max_response_len"]) == (64, 32)


def test_sft_on_a_small_model_of_your_own_fits_trls_lengths_to_it(tmp_path):
    """A model of your own with 96 positions gets TRL's lengths cut to 48 + 48, said on the
    banner, and trains (refused at the load on the old tree)."""
    other = _tiny_checkpoint(tmp_path / "small", n_layer=1, n_embd=32, n_head=2, n_positions=96)
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"sort {i % 10} 3 =", "completion": " 3"}
                                                 for i in range(40)])
    r = run_here(["sft.py", "--model", other, "--dataset", rows, "--steps", "1", "--batch_size", "8", "--eval_every",
                  "100", "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--max_prompt_len 512 + --max_response_len 512 do not fit the 96 positions" in r.stdout, r.stdout[:2000]
    with open(tmp_path / "run" / "run_config.json") as f:
        config = json.load(f)
    assert (config["max_prompt_len"], config["max_response_len"]) == (48, 48)
