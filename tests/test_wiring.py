"""The wiring, tested through the scripts: what grpo.py, dpo.py and sft.py pass to their pure
functions, recorded by wrappers during short in-process runs, against an independent computation
from the run's own tokens (the tool spans found from the tag ids, a row's stop found from its
EOS, the teacher's and the student's log-probs recomputed row by row at the temperature); the
random streams a step draws from; the data order across a resume. Each test names the one-line
change it catches."""
import pytest
import torch
from transformers import GPT2LMHeadModel

import common
import data
import dpo
import environment
import grpo
import sampling
import sft
import shared_prompt
import tasks
from helpers import (ctrl_c_after_first_save, forward_lengths, fp32_rtol, gamma, logprob_size, read_metrics, run_here,
                     write_jsonl)
from test_grpo import write_digits_prompts
from test_grpo_tools import tool_spans
from plumbing import models


def leaning_gpt2(folder, lean, seed=None):
    """tasks.calculator_gpt2 with the output layer's first column (its input held at 1) set to
    `lean` (token text -> logit) on top of it, or with seed, drawn at random for every token: a
    model unlike the calculator's. Its folder, as a string."""
    tasks.calculator_gpt2(folder)
    tok = models.load_tokenizer(str(folder))
    model = GPT2LMHeadModel.from_pretrained(folder)
    with torch.no_grad():
        if seed is not None:
            model.lm_head.weight[:, 0] = torch.randn(model.lm_head.weight.shape[0],
                                                     generator=torch.Generator().manual_seed(seed))
        for text, logit in lean.items():
            model.lm_head.weight[tok.get_vocab()[text], 0] = logit
    model.save_pretrained(folder)
    return str(folder)


def naive_logprobs(model, ids, attn, R, temperature):
    """(B, R) log-probs at the temperature of each row's response tokens, each row run alone and
    unpadded (no padding or position ids to get right); 0 on the response's padding."""
    out = torch.zeros(ids.shape[0], R, dtype=torch.float64)
    P = ids.shape[1] - R
    with torch.no_grad():
        for i in range(ids.shape[0]):
            p, n = int(attn[i, :P].sum()), int(attn[i, P:].sum())
            seq = torch.cat([ids[i, P - p:P], ids[i, P:P + n]])
            logits = model(input_ids=seq[None]).logits[0, p - 1:p - 1 + n].double() / temperature
            out[i, :n] = torch.log_softmax(logits, -1).gather(-1, seq[p:, None]).squeeze(-1)
    return out


def clone_draws(generator, n=8):
    """The next n float64 U(0, 1) numbers of a generator, drawn from a copy (it is left as it is)."""
    return torch.rand(n, dtype=torch.float64, generator=torch.Generator().set_state(generator.get_state()))


def record_grpo(cfg):
    """grpo.main(cfg) in this process, recording what the step gives its pure functions, per call:
    planned_logprobs (ids, attention mask, output: the reference's, the old policy's, the
    teacher's, in that order), reward's rewards, group_advantages' rewards and output,
    minibatch_rows' rows and its generator's next draws, grpo_loss's advantages, mask and knobs
    with the micro-batch's ids and attention mask (from the response_logprobs just before it), the
    sampler's uniforms of each (step, round), and each prompt's rejection-sampling draws."""
    seen = {k: [] for k in ("logprobs", "reward", "adv", "minibatches", "deal", "loss", "uniforms", "rs")}
    orig = {name: getattr(mod, name) for mod, name in [
        (shared_prompt, "planned_logprobs"), (grpo, "reward"), (grpo, "group_advantages"), (grpo, "minibatch_rows"),
        (grpo, "grpo_loss"), (grpo, "rejection_sample"), (common, "response_logprobs"), (environment, "rollout"),
        (sampling, "rollout_uniforms")]}
    shared = {"response_logprobs": shared_prompt.response_logprobs}  # the passes' and the update's forwards
    last = {}  # (rows that share a prompt compute it once), recorded alike

    def planned_logprobs(model, ids, attn, *args, **kwargs):
        out = orig["planned_logprobs"](model, ids, attn, *args, **kwargs)
        seen["logprobs"].append((ids, attn, out))
        return out

    def recorded_forward(fn):
        def response_logprobs(model, ids, attn, *args, **kwargs):
            last["ids"], last["attn"] = ids, attn
            return fn(model, ids, attn, *args, **kwargs)
        return response_logprobs

    def reward(*args, **kwargs):
        roll = orig["reward"](*args, **kwargs)
        seen["reward"].append(roll.rewards.clone())
        return roll

    def group_advantages(rewards, *args, **kwargs):
        adv, metrics = orig["group_advantages"](rewards, *args, **kwargs)
        seen["adv"].append((rewards.flatten().clone(), adv.flatten().clone()))
        return adv, metrics

    def minibatch_rows(n_rows, n_minibatches, generator, *args, **kwargs):
        seen["deal"].append(clone_draws(generator))
        rows = orig["minibatch_rows"](n_rows, n_minibatches, generator, *args, **kwargs)
        seen["minibatches"].append(rows)
        return rows

    def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs):
        seen["loss"].append(dict(ids=last["ids"], attn=last["attn"], adv=advantages.clone(), mask=mask.clone(), **kwargs))
        return orig["grpo_loss"](logps, old_logps, ref_logps, advantages, mask, *args, **kwargs)

    def rejection_sample(*args, generator, **kwargs):
        seen["rs"].append((last["round"], torch.stack([clone_draws(g) for g in generator])))  # (prompts, 8)
        return orig["rejection_sample"](*args, generator=generator, **kwargs)

    def rollout(*args, step, round_=0, **kwargs):
        last["round"], last["in_rollout"] = (step, round_), True
        try:
            return orig["rollout"](*args, step=step, round_=round_, **kwargs)
        finally:
            last["in_rollout"] = False

    def rollout_uniforms(*args, **kwargs):
        u = orig["rollout_uniforms"](*args, **kwargs)
        if last.get("in_rollout"):  # not the held-out evaluation's draws
            seen["uniforms"].append((last["round"], u))
        return u

    with pytest.MonkeyPatch.context() as mp:
        for mod, name, fn in [(shared_prompt, "planned_logprobs", planned_logprobs), (grpo, "reward", reward),
                              (grpo, "group_advantages", group_advantages), (grpo, "minibatch_rows", minibatch_rows),
                              (grpo, "grpo_loss", grpo_loss), (grpo, "rejection_sample", rejection_sample),
                              (common, "response_logprobs", recorded_forward(orig["response_logprobs"])),
                              (shared_prompt, "response_logprobs", recorded_forward(shared["response_logprobs"])),
                              (environment, "rollout", rollout), (sampling, "rollout_uniforms", rollout_uniforms)]:
            mp.setattr(mod, name, fn)
        grpo.main(cfg)
    return seen


# -----------------------------------------------------------------------------
# grpo.py with --tools, a teacher, the KL in the reward and truncated completions masked


@pytest.fixture(scope="module")
def tools_teacher_run(tmp_path_factory):
    """grpo.py for 2 steps (2 passes x 2 mini-batches each) with the calculator, a teacher unlike
    the student, --teacher_coef 0.5, temperature 0.7, the KL in the reward, truncated completions
    left out of the loss and epsilon_low != epsilon_high; the policy leans to EOS a little more than
    the calculator's, so that rows stop after a call as well as before one and without one."""
    tmp = tmp_path_factory.mktemp("wiring_tools")
    policy = leaning_gpt2(tmp / "policy", {"<eos>": 3.0})
    teacher = leaning_gpt2(tmp / "teacher", {}, seed=1)
    cfg = grpo.Config(model=policy, teacher=teacher, teacher_coef=0.5, temperature=0.7, tools="calculator",
                      mask_truncated_completions=True, kl_in_reward=True, beta=0.5, epsilon_low=0.1, epsilon_high=0.3,
                      dataset=write_digits_prompts(tmp / "p.jsonl", 8), out_dir=str(tmp / "g"), steps=2,
                      prompts_per_step=4, group_size=4, max_prompt_len=64, max_new_tokens=16, lr=1e-2, warmup_steps=0,
                      eval_every=100, n_eval_pairs=4)
    return cfg, record_grpo(cfg), models.load_tokenizer(policy)


def own_tokens(ids, attn, R, tok):
    """(B, R): 1 on the policy's own response tokens: the attention mask with the tool spans,
    found from the tag ids, set to 0; and (B, 1) 1 where the row stopped (an EOS in it)."""
    resp, mask = ids[:, -R:], attn[:, -R:]
    stopped = ((resp == tok.eos_token_id) & mask.bool()).any(-1, keepdim=True)
    return mask * (1 - tool_spans(resp, tok)), stopped.long()


def test_the_truncated_mask_is_the_policys_own_tokens_of_stopped_rows(tools_teacher_run):
    """--mask_truncated_completions with --tools: every mask grpo_loss is given equals the
    response's attention mask with the tool spans zeroed, times "the row has an EOS". Planted:
    `loss_mask = roll.r_mask * roll.stopped[:, None].long()` (tool tokens of stopped rows trained
    on) fails here."""
    _, seen, tok = tools_teacher_run
    tool_in_stopped = truncated = 0
    for call in seen["loss"]:
        R = call["mask"].shape[1]
        own, stopped = own_tokens(call["ids"], call["attn"], R, tok)
        assert torch.equal(call["mask"], (own * stopped).float())
        tool_in_stopped += int(((call["attn"][:, -R:] - own) * stopped).sum())
        truncated += int((1 - stopped).sum())
    assert tool_in_stopped > 10 and truncated > 4, (tool_in_stopped, truncated)  # the check has teeth


def test_the_kl_in_the_reward_sums_over_the_policys_own_tokens(tools_teacher_run):
    """--kl_in_reward with --tools: what group_advantages is given equals each row's reward minus
    beta x the k3 KL summed over its own tokens (tool spans found from the tag ids zeroed), from the
    old and reference log-probs the step computed. At step 2 the policy has moved and the KL on the
    tool tokens is not 0. Planted: `* roll.r_mask` for `* own` fails here."""
    cfg, seen, tok = tools_teacher_run
    on_tools = 0.0
    for step in range(cfg.steps):
        (ids, attn, ref), (_, _, old) = seen["logprobs"][3 * step:3 * step + 2]
        R = ref.shape[1]
        own, _ = own_tokens(ids, attn, R, tok)
        k3 = torch.exp(ref - old) - (ref - old) - 1
        want = seen["reward"][step] - cfg.beta * (k3 * own).sum(-1)
        # the same log-probs, k3 and sums in another order: float32's rounding of R + 1 terms' sizes
        tol = gamma(R + 3) * (seen["reward"][step].abs() + cfg.beta * (k3.abs() * own).sum(-1))
        assert ((seen["adv"][step][0] - want).abs() <= tol).all(), (seen["adv"][step][0] - want).abs().max()
        on_tools += float((k3 * (attn[:, -R:] - own)).sum())
    assert on_tools > 1e-3, on_tools  # a KL summed over the tool tokens as well would differ


def test_the_teachers_advantage_is_coef_times_teacher_minus_student_at_the_temperature(tools_teacher_run):
    """--teacher, --teacher_coef 0.5, --temperature 0.7: at step 1 (the policy still the model it
    started from) the advantage of every token grpo_loss is given equals its row's group advantage
    plus 0.5 x (log q - log pi) on the loss mask, both log-probs recomputed here row by row at
    temperature 0.7 from the two folders. Planted, each fails here: teacher and student swapped
    in the call of distill_advantages; the coefficient applied twice; the teacher scored at
    temperature 1."""
    cfg, seen, tok = tools_teacher_run
    student, teacher = (GPT2LMHeadModel.from_pretrained(f).eval() for f in (cfg.model, cfg.teacher))
    ids, attn, _ = seen["logprobs"][0]
    R = seen["loss"][0]["mask"].shape[1]
    own, stopped = own_tokens(ids, attn, R, tok)
    distill = cfg.teacher_coef * (naive_logprobs(teacher, ids, attn, R, cfg.temperature)
                                  - naive_logprobs(student, ids, attn, R, cfg.temperature)) * own * stopped
    want = seen["adv"][0][1][:, None] + distill  # (rows, R)
    # the step's log-probs (its layout) against these row by row: float32's rounding of the two,
    # of each log-prob's terms' size, for the teacher's and the student's, times the coefficient
    rtol = fp32_rtol(forward_lengths(student.config, ids.shape[1]))
    tol = cfg.teacher_coef * rtol * (logprob_size(teacher, cfg.temperature) + logprob_size(student, cfg.temperature))
    calls = iter(seen["loss"])
    for rows in seen["minibatches"][:1] * cfg.num_iterations:  # step 1's passes, each over its mini-batches
        for r in rows:  # one micro-batch per mini-batch
            got = next(calls)["adv"]
            torch.testing.assert_close(got.double(), want[r], rtol=0, atol=tol)
    assert distill.abs().max() > 1  # the teacher is unlike the student: the check has teeth


def test_the_clip_range_reaches_the_loss_as_given(tools_teacher_run):
    """--epsilon_low 0.1 --epsilon_high 0.3: each reaches grpo_loss under its own name (the KL is
    in the reward: beta 0 in the loss). Planted: the two swapped in loss_knobs fails here."""
    cfg, seen, _ = tools_teacher_run
    assert len(seen["loss"]) == cfg.steps * cfg.num_iterations * cfg.num_mini_batches
    for call in seen["loss"]:
        assert (call["epsilon_low"], call["epsilon_high"], call["beta"]) == (0.1, 0.3, 0)


# -----------------------------------------------------------------------------
# grpo.py with Dr. GRPO's constant normaliser, rejection and dynamic sampling: the random streams


@pytest.fixture(scope="module")
def streams_run(tmp_path_factory):
    """grpo.py for 2 steps of --loss_agg constant with --rs_samples 6 and --dynamic_sampling (half
    the prompts scored by the sort rule, which the policy never satisfies: groups of equal
    rewards, replaced in later rounds), 2 passes x 2 mini-batches; the policy leans to EOS, so
    every completion stops well before --max_new_tokens 16."""
    tmp = tmp_path_factory.mktemp("wiring_streams")
    rows = [{"prompt": r["prompt"], "reward_fn": ("sort", "digits")[i % 2]} for i, r in enumerate(tasks.prompt_rows(24))]
    cfg = grpo.Config(model=leaning_gpt2(tmp / "policy", {"<eos>": 5.0}), dataset=write_jsonl(tmp / "p.jsonl", rows),
                      loss_agg="constant", rs_samples=6, dynamic_sampling=True, max_num_gen_batches=3,
                      out_dir=str(tmp / "g"), steps=2, prompts_per_step=4, group_size=4, max_prompt_len=64,
                      max_new_tokens=16, lr=1e-2, warmup_steps=0, eval_every=100, n_eval_pairs=4)
    return cfg, record_grpo(cfg)


def test_dr_grpos_normaliser_is_max_new_tokens_per_row(streams_run):
    """--loss_agg constant (Dr. GRPO): every normaliser grpo_loss is given is --max_new_tokens x
    the mini-batch's rows, whatever the rollout's width; here every completion stopped early, so
    the rollout is narrower than --max_new_tokens. Planted: the width R in its place fails here."""
    cfg, seen = streams_run
    assert len(seen["loss"]) == cfg.steps * cfg.num_iterations * cfg.num_mini_batches
    for call in seen["loss"]:
        rows, R = call["mask"].shape
        assert R < cfg.max_new_tokens  # the check has teeth
        assert call["normaliser"].item() == cfg.max_new_tokens * rows


def test_each_prompts_rejection_sampling_draws_its_own_numbers(streams_run):
    """--rs_samples: the generators of the prompts of a step, in every round of every step, draw
    different numbers (fields packed above bit 31 of the seed, which a CPU generator drops, would
    give them all one stream)."""
    _, seen = streams_run
    draws = torch.cat([d for _, d in seen["rs"]])  # (prompts x rounds x steps, 8)
    assert len(draws) == 16  # 4 prompts x 2 rounds x 2 steps
    repeats = len(draws) - len({tuple(r) for r in draws.tolist()})
    assert repeats == 0, f"{repeats} of {len(draws)} prompts' generators repeat another's draws"


def test_a_dynamic_sampling_round_draws_new_numbers(streams_run):
    """--dynamic_sampling: a round after the first samples with uniforms none of which the first
    round of its step drew (the same stream for every round would resample round 0's draws)."""
    _, seen = streams_run
    first = {key[0]: u for key, u in seen["uniforms"] if key[1] == 0}
    later = [(key[0], u) for key, u in seen["uniforms"] if key[1] > 0]
    assert later  # rounds were added
    for step, u in later:
        again = set(u.flatten().tolist()) & set(first[step].flatten().tolist())
        assert not again, f"step {step}: a later round draws {len(again)} of round 0's uniforms again"


def test_the_minibatch_deal_is_not_the_samplers_stream(streams_run):
    """The mini-batch deal's generator draws numbers that neither the sampler's uniforms nor any
    rejection-sampling generator of its step drew."""
    cfg, seen = streams_run
    for step in range(1, cfg.steps + 1):
        deal = seen["deal"][step - 1]  # the step's draws
        used = [u.flatten()[:64] for key, u in seen["uniforms"] if key[0] == step]
        used += [d.flatten() for key, d in seen["rs"] if key[0] == step]
        again = set(deal.tolist()) & set(torch.cat(used).tolist())
        assert not again, f"step {step}: the deal draws {len(again)} of the sampler's numbers again"


# -----------------------------------------------------------------------------
# sft.py: the denominator, and the data order across a resume


def sft_rows(n):
    """n prompt/completion rows whose completions have 1 to 6 characters."""
    return [{"prompt": f"sort {i} {i + 1} =", "completion": " " + "7" * (1 + i % 6)} for i in range(n)]


@pytest.fixture(scope="module")
def sft_resumed_run(tmp_path_factory):
    """sft.py on 6 rows in batches of 4 (each step a new epoch's permutation), 2 micro-batches a
    step: stopped by a Ctrl-C right after its step-2 checkpoint, then resumed for step 3; recording
    the rows each step draws and what each sft_loss call is given (its mask's tokens, the
    denominator)."""
    tmp = tmp_path_factory.mktemp("wiring_sft")
    rows = write_jsonl(tmp / "sft.jsonl", sft_rows(6))
    argv = ["sft.py", "--dataset", rows, "--eval_dataset", rows, "--n_eval", "2", "--batch_size", "4", "--grad_accum", "2",
            "--steps", "3", "--save_every", "2", "--lr", "1e-3", "--warmup_steps", "0", "--out_dir", str(tmp / "run")]
    drawn, losses = [], []
    next_rows, loss_fn = data.DataOrder.next, sft.sft_loss

    def recording_next(self, k):
        drawn.append(next_rows(self, k))
        return drawn[-1]

    def recording_loss(logps, mask, n_tokens):
        losses.append((len(drawn), int(mask.sum()), n_tokens))
        return loss_fn(logps, mask, n_tokens)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data.DataOrder, "next", recording_next)
        mp.setattr(sft, "sft_loss", recording_loss)
        with ctrl_c_after_first_save():
            killed = run_here(argv)
        assert killed.returncode == 130, killed.stderr
        resumed = run_here(argv + ["--resume"])
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    return drawn, losses, read_metrics(tmp / "run")


def test_a_resumed_run_crossing_an_epoch_draws_the_uninterrupted_order(sft_resumed_run):
    """Killed at step 2 and resumed, sft.py draws the rows an uninterrupted run draws: each step
    the first 4 of a new permutation of the 6 rows by a generator seeded with --seed (0), made
    here with torch alone. Planted: the order's generator not restored in
    DataOrder.load_state_dict (step 3 permutes as step 2 did) fails here."""
    drawn, _, _ = sft_resumed_run
    gen = torch.Generator().manual_seed(0)
    assert drawn == [torch.randperm(6, generator=gen)[:4].tolist() for _ in range(3)]


def test_sfts_denominator_is_the_global_batchs_completion_tokens(sft_resumed_run):
    """Every sft_loss call of a step is given as its denominator the completion (+ EOS) tokens of
    the step's whole batch: the sum of the masks of its micro-batches; so the logged token count
    too. Planted: one more position per row (`len(train_c[i]) + 1`) fails here."""
    _, losses, metrics = sft_resumed_run
    assert len(losses) == 3 * 2
    for step in (1, 2, 3):
        calls = [(tokens, n) for s, tokens, n in losses if s == step]
        assert all(n == sum(t for t, _ in calls) for _, n in calls), (step, calls)
        assert [m["tokens"] for m in metrics if m["step"] == step] == [calls[0][1]]


# -----------------------------------------------------------------------------
# dpo.py: the lengths of chosen and rejected


def test_dpo_gives_the_loss_each_sides_own_length(tmp_path):
    """--loss_type sigmoid_norm (SimPO and RPO read the same lengths): the lengths dpo_loss is
    given are, in order, the response tokens of the chosen and of the rejected rows of the batch
    the policy scored (its response mask). Chosen longer than rejected in some pairs, shorter in
    others. Planted: the two swapped in dpo.py's main fails here."""
    pairs = [{"prompt": f"sort {i} 1 =", "chosen": " 1" * (1 + i % 3), "rejected": " 9" * (3 - i % 3)} for i in range(12)]
    cfg = dpo.Config(model="tiny", dataset=write_jsonl(tmp_path / "pairs.jsonl", pairs), loss_type="sigmoid_norm",
                     steps=1, batch_size=4, grad_accum=2, n_eval=2, warmup_steps=0, out_dir=str(tmp_path / "run"))
    seen, calls = {}, []
    scores, loss_fn = shared_prompt.sequence_logprobs, dpo.dpo_loss  # the training forwards'

    def recording_scores(model, batch, d, *args, **kwargs):
        seen["resp"] = batch[2]
        return scores(model, batch, d, *args, **kwargs)

    def recording_loss(*args, lengths, **kwargs):
        calls.append((seen["resp"].sum(-1).float().chunk(2), lengths))
        return loss_fn(*args, lengths=lengths, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shared_prompt, "sequence_logprobs", recording_scores)
        mp.setattr(dpo, "dpo_loss", recording_loss)
        dpo.main(cfg)
    assert len(calls) == 2
    for (chosen, rejected), lengths in calls:
        torch.testing.assert_close(lengths, (chosen, rejected), rtol=0, atol=0)
    assert any((c != r).any() for (c, r), _ in calls)  # the check has teeth
