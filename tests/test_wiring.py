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
import grpo
import run
import sampling
import sft
import tasks
from helpers import read_metrics, run_here, write_jsonl
from test_grpo import write_digits_prompts
from test_grpo_tools import tool_spans

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def leaning_gpt2(folder, lean, seed=None):
    """tasks.calculator_gpt2 with the output layer's first column (its input held at 1) set to
    `lean` (token text -> logit) on top of it, or with seed, drawn at random for every token: a
    model unlike the calculator's. Its folder, as a string."""
    tasks.calculator_gpt2(folder)
    tok = data.load_tokenizer(str(folder))
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


def record_grpo(cfg, **also):
    """grpo.main(cfg) in this process, recording per call what the update gives its pure functions:
    batched_logprobs (ids, attention mask, output; the reference, the old policy, the teacher, in
    that order), reward's rewards, group_advantages' rewards and output, minibatch_rows, and
    grpo_loss (the micro-batch's ids and mask from the response_logprobs just before it, its
    advantages, mask and knobs); `also`: name -> (module, function name, fn(record, *args, **kw)),
    further recorders."""
    seen = {k: [] for k in ("logprobs", "reward", "adv", "minibatches", "loss", *also)}
    orig = {name: getattr(mod, name) for mod, name in [(grpo, "batched_logprobs"), (grpo, "reward"),
                                                       (grpo, "group_advantages"), (grpo, "minibatch_rows"),
                                                       (grpo, "grpo_loss"), (common, "response_logprobs")]}
    last = {}

    def batched_logprobs(model, ids, attn, *args, **kwargs):
        out = orig["batched_logprobs"](model, ids, attn, *args, **kwargs)
        seen["logprobs"].append((ids, attn, out))
        return out

    def reward(*args, **kwargs):
        roll, seconds = orig["reward"](*args, **kwargs)
        seen["reward"].append(roll.rewards.clone())
        return roll, seconds

    def group_advantages(rewards, *args, **kwargs):
        adv, metrics = orig["group_advantages"](rewards, *args, **kwargs)
        seen["adv"].append((rewards.flatten().clone(), adv.flatten().clone()))
        return adv, metrics

    def minibatch_rows(*args, **kwargs):
        rows = orig["minibatch_rows"](*args, **kwargs)
        seen["minibatches"].append(rows)
        return rows

    def response_logprobs(model, ids, attn, *args, **kwargs):
        last["ids"], last["attn"] = ids, attn
        return orig["response_logprobs"](model, ids, attn, *args, **kwargs)

    def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs):
        seen["loss"].append(dict(ids=last["ids"], attn=last["attn"], adv=advantages.clone(), mask=mask.clone(), **kwargs))
        return orig["grpo_loss"](logps, old_logps, ref_logps, advantages, mask, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for name, fn in [("batched_logprobs", batched_logprobs), ("reward", reward), ("group_advantages", group_advantages),
                         ("minibatch_rows", minibatch_rows), ("grpo_loss", grpo_loss)]:
            mp.setattr(grpo, name, fn)
        mp.setattr(common, "response_logprobs", response_logprobs)
        for name, (mod, attr, fn) in also.items():
            inner = getattr(mod, attr)
            mp.setattr(mod, attr, lambda *a, _fn=fn, _inner=inner, _rec=seen[name], **kw: _fn(_rec, _inner, *a, **kw))
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
                      prompts_per_step=4, group_size=4, max_new_tokens=16, lr=1e-2, warmup_steps=0, eval_every=100,
                      n_eval_pairs=4)
    return cfg, record_grpo(cfg), data.load_tokenizer(policy)


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
        torch.testing.assert_close(seen["adv"][step][0], want, rtol=1e-5, atol=1e-6)
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
    calls = iter(seen["loss"])
    for rows in seen["minibatches"][:cfg.num_iterations]:  # step 1's passes
        for r in rows:  # one micro-batch per mini-batch
            got = next(calls)["adv"]
            torch.testing.assert_close(got.double(), want[r], rtol=1e-4, atol=1e-4)
    assert distill.abs().max() > 1  # the teacher is unlike the student: the check has teeth


def test_the_clip_range_reaches_the_loss_as_given(tools_teacher_run):
    """--epsilon_low 0.1 --epsilon_high 0.3: each reaches grpo_loss under its own name (the KL is
    in the reward: beta 0 in the loss). Planted: the two swapped in loss_knobs fails here."""
    cfg, seen, _ = tools_teacher_run
    assert len(seen["loss"]) == cfg.steps * cfg.num_iterations * cfg.num_mini_batches
    for call in seen["loss"]:
        assert (call["epsilon_low"], call["epsilon_high"], call["beta"]) == (0.1, 0.3, 0)
