"""grpo.py --tools: a policy that calls the calculator mid-answer. The tools' tokens reach the
loss, the KL and the importance ratios masked out (checked against the tool spans found in the
token ids themselves, not against the sampler's own mask), and 2 processes reproduce 1 while
their ranks make different numbers of calls, so run different numbers of decode turns."""
import pytest
import torch
from helpers import TWO_RANK_RUNS, checkpoint_config, read_metrics
from test_grpo import assert_same_run, grpo_argv, write_digits_prompts

import common
import grpo
import sampling
import shared_prompt
import tools
from plumbing import models


def tool_flags(folder, models):
    """The Llama-shaped calculator caller (helpers.calculator_llama), read from its folder."""
    return ("--model", models["llama_calculator"], "--dataset", write_digits_prompts(folder / "prompts.jsonl", 16),
            "--tools", "calculator", "--max_new_tokens", "24", "--lr", "1e-4", "--warmup_steps", "0",
            "--seed", "1")  # a seed whose rollouts' calls per row differ by rank (the test below)


TWO_RANK_RUNS["grpo_tools"] = lambda folder, models: grpo_argv(folder / "run", *tool_flags(folder, models))


def tool_spans(r_ids, tok):
    """1 on every token of a tool's result, found in the ids: from an opening result tag right after
    a call's closing tag (where a result goes; a row whose call gets none ends there) through the
    next closing result tag, or the row's end (a result cut at --max_new_tokens). A result tag the
    policy samples anywhere else is its own token (the calculator's policy sometimes does)."""
    call_close, opening, closing = map(tok.convert_tokens_to_ids, (tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE))
    spans = torch.zeros_like(r_ids)
    for i, row in enumerate(r_ids.tolist()):
        inside = False
        for j, t in enumerate(row):
            inside = inside or (t == opening and j > 0 and row[j - 1] == call_close)
            spans[i, j] = int(inside)
            inside = inside and t != closing
    return spans


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, user_models):
    """grpo.py --tools in this process, with the flags of the 2-rank run, recording what the
    loss is given (each micro-batch's ids, attention mask and loss mask) and the calls each row
    of each rollout made."""
    tmp = tmp_path_factory.mktemp("tools")
    cfg = grpo.cli.parse_config(grpo.Config, grpo_argv(tmp / "run", *tool_flags(tmp, user_models))[1:])
    seen, calls = {}, []
    loss_fn, gen = grpo.grpo_loss, sampling.generate_with_tools

    def recording(logprobs):  # common's forward, and shared_prompt's where a micro-batch's rows share prompts
        def recording_logprobs(model, ids, attn, *args, **kwargs):
            seen["ids"], seen["attn"] = ids, attn
            return logprobs(model, ids, attn, *args, **kwargs)
        return recording_logprobs

    def recording_loss(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs):
        seen.setdefault("loss", []).append((seen["ids"], seen["attn"], mask.clone()))
        return loss_fn(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs)

    def recording_generate(*args, **kwargs):
        out = gen(*args, **kwargs)
        if out[3].shape[0] == cfg.prompts_per_step * cfg.group_size:  # a rollout, not an evaluation's held-out rows
            calls.append(sampling.tool_calls(out[3]))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "response_logprobs", recording(common.response_logprobs))
        mp.setattr(shared_prompt, "response_logprobs", recording(shared_prompt.response_logprobs))
        mp.setattr(grpo, "grpo_loss", recording_loss)
        mp.setattr(sampling, "generate_with_tools", recording_generate)
        grpo.main(cfg)
    return read_metrics(tmp / "run"), seen["loss"], calls, user_models["llama_calculator"]


def test_the_loss_kl_and_ratios_never_see_a_tools_tokens(tool_run):
    """Every mask grpo_loss is given (the policy term, the KL and the importance ratios all take
    theirs from it) equals the response's attention mask with each result span, found here
    from the tag ids, set to 0. Planted bug: the loss mask taken from the response mask alone
    (`own = roll.r_mask`), as a loop that forgets the tool's tokens would, fails here."""
    _, loss_inputs, _, folder = tool_run
    tok = models.load_tokenizer(folder)
    n_tool = 0
    for ids, attn, mask in loss_inputs:
        R = mask.shape[1]
        spans = tool_spans(ids[:, -R:], tok)
        assert torch.equal(mask, (attn[:, -R:] * (1 - spans)).float())
        n_tool += int(spans.sum())
    assert n_tool > 20  # the check has teeth: tool tokens were in the batches


def test_two_processes_match_one_with_tool_calls_at_different_turns(tool_run, two_ranks):
    """FSDP2 on 2 ranks against 1 process with the calculator: the rows of each rank make
    different numbers of calls (so its sampler runs a different number of turns: rank 0's rows
    and rank 1's are the two halves of each rollout), yet no rank waits on another (the weights
    are gathered once per rollout, no collective while decoding) and rewards, losses and grad
    norms agree step for step."""
    one, _, calls, _ = tool_run
    two = read_metrics(two_ranks("grpo_tools") / "run")
    # within helpers.assert_runs_agree's bounds: a folder model of one's own, TRL's one optimizer step a step
    assert_same_run(one, two, keys=("reward", "reward_std", "completions/mean_length", "loss", "grad_norm",
                                    "tools/call_frequency"),
                    config=checkpoint_config(two_ranks("grpo_tools") / "run"), updates=1)
    assert any(c[:len(c) // 2].max() != c[len(c) // 2:].max() for c in calls), calls  # turns differ by rank
    assert all(0 < r["tools/call_frequency"] < 2 for r in one if "loss" in r)


def test_a_tokenizer_without_the_tags_as_tokens_is_refused_naming_the_flag(tmp_path):
    """The sampler stops at the closing tag like at an end-of-turn id, so it must be one token: a
    tokenizer that splits it is refused before any rollout, with what to do."""
    from helpers import run_here

    proc = run_here(grpo_argv(tmp_path / "run", "--tools", "calculator"))
    assert proc.returncode != 0 and "--tools calculator" in proc.stderr and "add the tags" in proc.stderr, proc.stderr
