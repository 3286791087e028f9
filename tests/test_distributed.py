"""Distributed runs past one device: what every rank must agree on, checked with torchrun on the
CPU (gloo). The workers are in tests/dist_worker.py."""
import sys

import pytest

from helpers import (HANG_GUARD_S, SUBPROCESS_ENV_NO_TOKENIZER_THREADS, adam_drift, assert_runs_agree, checkpoint_config,
                     checkpoint_weights, max_abs_diff, read_metrics, run_script)
from helpers import chat_rows, ctrl_c_after_first_save, run_many, write_jsonl
from test_robustness import FAST, run_fast
from plumbing import cli


def run_worker(name, *args, nproc=2, timeout=HANG_GUARD_S):
    return run_script(["tests/dist_worker.py", name, *map(str, args)], nproc, timeout,
                      env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)


def test_ranks_that_see_different_out_dirs_stop_with_one_error_not_a_hang(tmp_path):
    """Node-local folders: rank 0 finds a checkpoint to resume, rank 1 none. Both stop at once,
    each naming what every rank saw, instead of one resuming and the run hanging at its first
    mismatched collective."""
    r = run_worker("out_dir_seen_differently", tmp_path)  # a rank that resumed alone would hang, not say this
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} stopped: the ranks see different files" in r.stdout, r.stdout + r.stderr
    assert "rank 0 on " in r.stdout and ": --out_dir a checkpoint at step 4; rank 1 on " in r.stdout
    assert ": --out_dir holding checkpoint)" in r.stdout and "on a file system all nodes share" in r.stdout


def test_ranks_that_see_different_data_stop_with_one_error(tmp_path):
    """Node-local data files: 200 rows on one node, 150 on the other, under the same path. The
    ranks trained without a word on different rows; now each data file is fingerprinted and
    every rank stops with the same message naming the flag."""
    r = run_worker("data_seen_differently", tmp_path)
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} stopped: the ranks see different files (rank 0 on " in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("--dataset ") >= 4  # each rank's line names it for both ranks


def folder_args(tmp_path, models):
    """sft.py on the Llama-3-shaped folder (helpers.build_user_models) and conversational rows."""
    rows = write_jsonl(tmp_path / "messages.jsonl", chat_rows(64, "sft"))
    return ["--model", models["llama"], "--dataset", rows, "--eval_dataset", "sort", "--max_prompt_len", "128"]


def test_resume_on_another_world_size_ends_with_the_same_weights(tmp_path, user_models):
    """The sharded training state (torch.distributed.checkpoint) written by 2 processes and by 1,
    stopped right after the step-2 checkpoint, resumed from a copy each: 2 -> 2, 2 -> 1 and
    1 -> 2. The same losses at steps 3 and 4 and the same final weights as the uninterrupted run
    the checkpoint came from: exactly on the same world size; across, step 3 (at the checkpoint's
    weights) within float32's rounding of the two layouts, step 4 and the weights within Adam's
    drift too (helpers.assert_runs_agree, adam_drift). Weights alone would not show lost Adam
    moments: steps 3 and 4 would still move, by other amounts; step 3's grad norm and step 4's loss
    do. Three of the runs share one torchrun (helpers.run_many)."""
    import shutil

    args = ["--steps", "4", "--save_every", "2", *folder_args(tmp_path, user_models)]
    killed = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "killed2")], nproc=2, crash="after_save:1")
    assert killed.returncode != 0 and read_metrics(tmp_path / "killed2")[-1]["step"] == 2, killed.stderr[-2000:]
    with ctrl_c_after_first_save():  # on 1 process: stopped in this process
        killed = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "killed1")])
    assert killed.returncode == 130 and read_metrics(tmp_path / "killed1")[-1]["step"] == 2, killed.stderr[-2000:]
    cases = {"2to2": ("killed2", "full2"), "1to2": ("killed1", "full1"), "2to1": ("killed2", "full2")}
    for run, (source, _) in cases.items():
        shutil.copytree(tmp_path / source, tmp_path / run)
    runs = [["full2", "sft.py", *FAST["sft.py"], *args, "--out_dir", str(tmp_path / "full2")]]
    runs += [[run, "sft.py", *FAST["sft.py"], *args, "--out_dir", str(tmp_path / run), "--resume"]
             for run in ("2to2", "1to2")]
    on2, codes = run_many(runs, tmp_path / "codes.json", nproc=2)
    assert codes == {"full2": 0, "2to2": 0, "1to2": 0}, on2.stdout[-2000:] + on2.stderr[-3000:]
    assert run_fast("sft.py", args + ["--out_dir", str(tmp_path / "full1")]).returncode == 0
    on1 = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "2to1"), "--resume"])
    assert on1.returncode == 0, on1.stderr[-3000:]
    assert "written by 1 rank(s), resumed on 2" in on2.stdout and "resumed on 2" not in on2.stdout.replace(
        "written by 1 rank(s), resumed on 2", "")  # 2 -> 2 says nothing
    assert "written by 2 rank(s), resumed on 1" in on1.stdout
    for run, (_, full) in cases.items():  # each against the uninterrupted run its checkpoint came from
        want, got = read_metrics(tmp_path / full), read_metrics(tmp_path / run)
        assert [r["step"] for r in got] == [r["step"] for r in want], run
        worst = max_abs_diff(checkpoint_weights(tmp_path / full), checkpoint_weights(tmp_path / run))
        if run == "2to2":  # exact: the same float operations in the same order
            assert [r.get("loss") for r in got] == [r.get("loss") for r in want] and worst == 0, run
            continue
        # steps 3 and 4 from the same step-2 state on another world size: step 3 at equal weights,
        # within float32's rounding of the layouts, step 4 and the weights within Adam's drift too
        lr = max(r.get("lr", 0) for r in want)
        assert_runs_agree(want[-2:], got[-2:], checkpoint_config(tmp_path / full), length=128 + 20, lr=lr, start=2)
        assert worst <= adam_drift(lr, 2, t0=2), run


def test_only_rank_0_reads_the_weights_and_every_rank_gets_them(tmp_path):
    """GPT-2 (tied input and output embeddings) and Llama (rotary frequencies in a buffer no
    state dict holds), each saved to a folder, loaded on 2 ranks with load_model(..., d)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from helpers import family_tokenizer

    tok = family_tokenizer("bpe")
    for config in ("GPT2Config", "LlamaConfig"):
        cfg = getattr(transformers, config)(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                            n_inner=64)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / config)
        tok.save_pretrained(tmp_path / config)
    r = run_worker("loaded_from_rank0", tmp_path / "GPT2Config", tmp_path / "LlamaConfig")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for config in ("GPT2Config", "LlamaConfig"):
        assert f"{config}: rank 0 ok: read before sharding" in r.stdout, r.stdout
        assert f"{config}: rank 1 ok: meta before sharding" in r.stdout, r.stdout


def test_every_rank_stops_at_the_generation_configs_end_ids_for_a_hub_model(tmp_path):
    """A hub id whose generation_config.json adds an end-of-turn id to config.json's EOS: rank 0
    reads the model with from_pretrained (and so the generation config); the other ranks build
    theirs from config.json on the meta device. They read generation_config.json only from a
    local folder, so under a hub id rank 1 sampled past the end of turn that rank 0 stopped at.
    The hub here is a cache folder (HF_HUB_OFFLINE), as a downloaded model sits on disk."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    import tasks

    tok = tasks.char_tokenizer()
    end_of_turn = tok.convert_tokens_to_ids("|")
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tasks.char_gpt2_config(tok, n_layer=1, n_embd=32, n_head=2))
    model.generation_config.eos_token_id = [tok.eos_token_id, end_of_turn]
    model.save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    env = {**SUBPROCESS_ENV_NO_TOKENIZER_THREADS, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = run_script(["tests/dist_worker.py", "stop_ids", "org/tiny"], 2, HANG_GUARD_S, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} stops at {[tok.eos_token_id, end_of_turn]}" in r.stdout, r.stdout
    assert "org--tiny" not in os.listdir(tmp_path)  # read through the cache, not a local path


def test_hsdp_2_by_2_matches_one_process(tmp_path, user_models):
    """--hsdp 2 on 4 ranks: a (replicate 2, shard 2) mesh, parameters sharded within each pair
    and gradients averaged across the pairs; the same losses and final weights as 1 process. Two
    micro-batches per step: each is reduce-scattered within its pair, the all-reduce across pairs
    waits for the second (common.backward)."""
    args = ["--steps", "2", "--warmup_steps", "0", "--grad_accum", "2", *folder_args(tmp_path, user_models)]
    one = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    four = run_fast("sft.py", args + ["--out_dir", str(tmp_path / "hsdp"), "--hsdp", "2"], nproc=4)
    assert four.returncode == 0, four.stderr[-3000:]
    assert "world size 4 (HSDP: 2 replicas x 2 shards)" in four.stdout
    want, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "hsdp")
    lr = max(r.get("lr", 0) for r in want)  # within float32's rounding of the layouts and Adam's drift
    assert_runs_agree(want, got, checkpoint_config(tmp_path / "one"), length=128 + 20, lr=lr)
    assert max_abs_diff(checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "hsdp")) <= adam_drift(lr, 2)


def test_an_hsdp_group_that_does_not_divide_the_world_is_refused_before_joining(monkeypatch):
    import common

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--hsdp 3 must divide the world size 2"):
        common.setup_distributed(hsdp=3)


def test_a_rank_slow_in_generate_waits_for_timeout_minutes(tmp_path):
    """Rank 1 sleeps 2 s in its first generate, as a rank decoding a longer rollout would; rank 0
    waits for it in its next collective, whose limit is --timeout_minutes (here 1; the default,
    60 min, is for rollouts of many thousand tokens and for rank 0 reading a large model alone;
    before the flag every run had 10 minutes). The run completes; inside it, the process group's
    timeout is the flag's (read from the group, not timed: 0.1 minutes here was a deadline a loaded
    machine could outrun) and cli.start has made the group ranks wait in for rank 0's exports
    (before, the first save made it: a setup that cannot failed hours in)."""
    argv = ["grpo.py", "--model", "tiny", "--steps", "1", "--prompts_per_step", "4", "--group_size", "2",
            "--max_new_tokens", "4", "--n_eval", "4", "--n_eval_pairs", "4", "--timeout_minutes", "1",
            "--out_dir", str(tmp_path / "run")]
    r = run_script(["tests/dist_worker.py", "slow_sampler", "2", *argv], 2, HANG_GUARD_S,
                   env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["step"] == 1


def test_a_collective_timeout_names_the_flag(monkeypatch):
    """gloo's timeout error ("Timed out waiting 1200ms for recv ...") gets a note naming
    --timeout_minutes and its value, so that a slow rank is told from a stuck one."""
    import sft

    def main(cfg):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1200ms for recv operation")

    monkeypatch.setattr(sys, "argv", ["sft.py", "--timeout_minutes", "0.02"])
    with pytest.raises(RuntimeError) as e:
        cli.script(main, sft.Config)
    assert "--timeout_minutes 0.02" in "".join(e.value.__notes__)


def test_no_full_size_gradient_survives_a_micro_batch():
    """Gradient accumulation under FSDP2: each micro-batch's gradients are reduce-scattered into
    the rank's shard, so what stays alive between micro-batches is a shard of gradients, not the
    whole model's (which FSDP2 keeps, unsharded, when told not to sync: 30 GiB per GPU at 8B), and
    the accumulated gradient is the global batch's (tests/dist_worker.py accumulated_gradients)."""
    r = run_script(["tests/dist_worker.py", "accumulated_gradients"], 2, HANG_GUARD_S,
                   env=SUBPROCESS_ENV_NO_TOKENIZER_THREADS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count(" ok: ") == 2, r.stdout
