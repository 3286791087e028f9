"""grpo.py --generation_micro_batch_size N: each rank samples its rollout (and the evaluation's
completions) in chunks of at most N rows, so the sampler's KV cache holds N rows, not all of the
rank's. Each chunk draws with its own rows' random numbers (sampling.rollout_uniforms, one row of
draws per global row), so the chunked rollout is the one-call rollout: the same ids, masks, tool
masks and stops, and the sampler's log-probs up to the float noise of a matmul over fewer rows
(the CPU's GEMM takes another kernel below 4 rows). Run through the script on the Llama-shaped
folder, plain and calling the calculator, and on 2 ranks (chunked) against 1 process (not)."""
import json

import pytest
import torch
from helpers import TWO_RANK_RUNS, checkpoint_config, forward_lengths, fp32_rtol, logprob_size, read_metrics
from test_grpo import assert_same_run, grpo_argv
from test_grpo_tools import tool_flags
from test_user_path import grpo_argv as chat_grpo_argv

import environment
import grpo
import kv_cache

N = 3  # rows per chunk: 16 rows a rollout (8 a rank) in chunks of 2 and 3 that cut groups of 4 in two


def chunked_tools(folder, models):
    return grpo_argv(folder / "run", *tool_flags(folder, models), "--generation_micro_batch_size", str(N))


TWO_RANK_RUNS["grpo_tools_chunked"] = chunked_tools


def recorded_run(argv):
    """grpo.py in this process; its metrics, every rollout it sampled (environment.rollout's
    tensors) and the rows of every KV cache the sampler made (kv_cache.decode_cache)."""
    cfg = grpo.cli.parse_config(grpo.Config, argv[1:])
    rolls, cache_rows = [], []
    rollout, decode_cache = environment.rollout, kv_cache.decode_cache

    def recording_rollout(*args, **kwargs):
        roll = rollout(*args, **kwargs)
        rolls.append({k: v.clone() for k, v in vars(roll).items() if torch.is_tensor(v)})
        return roll

    def recording_cache(model, B, L, like, persistent, reserve=(0, 0)):
        cache_rows.append(B)
        return decode_cache(model, B, L, like, persistent, reserve)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(environment, "rollout", recording_rollout)
        mp.setattr(kv_cache, "decode_cache", recording_cache)
        grpo.main(cfg)
    out = argv[argv.index("--out_dir") + 1]
    return read_metrics(out), rolls, cache_rows


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, user_models):
    """The calculator caller's run in one call a rollout and in chunks of N rows."""
    tmp = tmp_path_factory.mktemp("tools")
    one = recorded_run(grpo_argv(tmp / "one", *tool_flags(tmp, user_models)))
    chunked = recorded_run(grpo_argv(tmp / "chunked", *tool_flags(tmp, user_models), "--generation_micro_batch_size",
                                     str(N)))
    return one, chunked


def assert_same_rollouts(one, chunked, folder):
    """The same rollouts; the sampler's log-probs within float32's rounding of a matmul over fewer rows
    (helpers.fp32_rtol over the model's sums, of its log-probs' size: 2e-6 measured)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    tol = fp32_rtol(forward_lengths(model.config, 128 + 24)) * logprob_size(model, temperature=0.7)
    assert len(one) == len(chunked) == 2
    for a, b in zip(one, chunked):
        for k in a:
            if k == "r_logps":
                assert torch.allclose(a[k], b[k], rtol=0, atol=tol), ((a[k] - b[k]).abs().max(), tol)
            else:
                assert torch.equal(a[k], b[k]), k


def assert_same_metrics(m1, m2):
    """Exact, but for the sampler's log-probs against the trainer's (assert_same_rollouts): the same
    rollouts, then the same update (the sampler's log-probs reach no loss without
    --vllm_importance_sampling_correction), the same float operations in the same order."""
    assert [r["step"] for r in m1] == [r["step"] for r in m2]
    for a, b in zip(m1, m2):
        assert {k: v for k, v in a.items() if not k.startswith(("time", "mem/", "rollout/logp_diff"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time", "mem/", "rollout/logp_diff"))}, (a, b)


def test_chunked_rollouts_are_the_one_call_rollouts_on_the_llama_folder(tmp_path, user_models):
    """The Llama-shaped folder (RoPE, GQA, a chat template) on conversational prompts, with
    held-out prompts sampled and scored every step (environment.evaluate_rewards) and a reward
    model: the chunked run samples the same rollouts and logs the same metrics, and no KV cache
    of its has more than N rows (the one-call run's has all 16). Planted: a chunk drawing with the
    first rows' uniforms (u[:n] for u[rows]) changes the ids."""
    extra = ("--reward_model", user_models["llama_rm"], "--reward_weights", "rule:1,model:0.5")
    (tmp_path / "one").mkdir(), (tmp_path / "chunked").mkdir()
    m1, one, rows1 = recorded_run(chat_grpo_argv(tmp_path / "one", user_models, *extra))
    m2, chunked, rows2 = recorded_run(chat_grpo_argv(tmp_path / "chunked", user_models, *extra,
                                                     "--generation_micro_batch_size", str(N)))
    assert_same_rollouts(one, chunked, user_models["llama"])
    assert max(rows1) == 16 and max(rows2) == N, (rows1, rows2)
    assert one[0]["r_mask"].sum(-1).float().std() > 0  # rows of several lengths: chunks of different R are joined
    assert [r["step"] for r in m1] == [0, 1, 2] and "eval/greedy/reward" in m1[-1] and "reward/model" in m1[-1]
    assert_same_metrics(m1, m2)


def test_chunked_rollouts_with_tool_calls_are_the_one_call_rollouts(tool_runs, user_models):
    """The calculator caller: each chunk runs its own tool turns (a chunk whose rows stop calling
    ends its loop early), yet ids, tool masks and stops are the one-call rollout's, and so are the
    metrics, those of the held-out prompts sampled with the tool included."""
    (m1, one, rows1), (m2, chunked, rows2) = tool_runs
    assert_same_rollouts(one, chunked, user_models["llama_calculator"])
    assert max(rows2) == N and max(rows1) == 16, (rows1, rows2)
    assert all(r["r_tool"].sum() > 0 for r in one)  # the tool was called in every rollout
    assert "tools/call_frequency" in m1[-1] and "eval/greedy/reward" in m1[-1]
    assert_same_metrics(m1, m2)


def test_the_embedded_tasks_greedy_evaluation_runs_in_chunks(tmp_path):
    """The embedded task's held-out prompts answered greedily (sampling.evaluate_generations, 8 of
    them) in chunks of N: the same exact-match and gold reward, and no cache of more than N rows."""
    m1, _, rows1 = recorded_run(grpo_argv(tmp_path / "one", "--steps", "1"))
    m2, _, rows2 = recorded_run(grpo_argv(tmp_path / "chunked", "--steps", "1", "--generation_micro_batch_size", str(N)))
    assert max(rows1) == 16 and max(rows2) == N, (rows1, rows2)
    for a, b in zip(m1, m2, strict=True):
        assert (a["eval/exact_match"], a["eval/gold_reward"]) == (b["eval/exact_match"], b["eval/gold_reward"])


def test_two_chunked_ranks_match_one_process_in_one_call(tool_runs, two_ranks):
    """2 ranks under FSDP2, each sampling its 8 rows in chunks of 2 and 3 (the weights gathered once
    for all chunks: no collective between them), against 1 process sampling its 16 in one call."""
    (m1, _, _), _ = tool_runs
    out = two_ranks("grpo_tools_chunked") / "run"
    with open(out / "run_config.json") as f:
        assert json.load(f)["generation_micro_batch_size"] == N
    two = read_metrics(out)
    # 1 process against 2 ranks: helpers.assert_runs_agree's bounds (a folder model of one's own:
    # TRL's one optimizer step a step)
    assert_same_run(m1, two, keys=("reward", "reward_std", "completions/mean_length", "loss", "grad_norm",
                                   "tools/call_frequency"), config=checkpoint_config(out), updates=1)


@pytest.mark.parametrize("n,size,sizes", [(16, 3, [2, 3, 3, 2, 3, 3]), (24, 10, [8, 8, 8]), (5, 0, [5]),
                                          (5, 8, [5]), (7, 1, [1] * 7)])
def test_chunks_cover_the_rows_in_order_at_most_size_each(n, size, sizes):
    cut = environment.chunks(n, size)
    assert [c.stop - c.start for c in cut] == sizes
    assert [i for c in cut for i in range(n)[c]] == list(range(n))
