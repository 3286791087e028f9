"""Exact where the math says 0, on every rank.

1. At equal weights the reference's, the old policy's and the teacher's log-probs are the policy's
   to the bit: every pass over a rollout runs the update's own micro-batches (shared_prompt.plan),
   one layout for every model (padded, packed or sharing prompts), and the head reads a contiguous
   input whether or not its weight needs a gradient. So a run whose advantages are all 0 leaves every
   weight bit-identical at the default flags: GRPO under a constant reward (KL, its gradient and log
   rho exactly 0; a group of equal rewards exactly 0 advantage), DPO on pairs whose chosen is their
   rejected (dpo_loss's `same`). Before, float noise of ~1e-7 in the KL's gradient became lr-sized
   Adam steps in random directions (kl 7e-5, 0.0165, ... at a constant reward).
2. No rank decides alone whether a collective runs: on data built so that one rank's rows would pack
   and the other's not, every script on 2 ranks finishes and matches 1 process. These 2-rank runs
   share one torchrun under TORCH_DISTRIBUTED_DEBUG=DETAIL, which turns a collective called by one
   rank only into an error naming both ranks' collectives at once (dpo.py at 3c74a6b hung there
   forever: rank 0 in FSDP's all-gather, rank 1 in micro_batches' all-reduce).
"""
import copy
import json
import math

import pytest
import torch

import common
import data
import dpo
import grpo
import shared_prompt
import sft
from helpers import (SUBPROCESS_ENV_NO_TOKENIZER_THREADS, adam_drift, assert_runs_agree, chat, checkpoint_config,
                     checkpoint_weights, max_abs_diff, question, read_metrics, run_here, run_script, write_jsonl)
from plumbing import cli, models

D = common.Dist()


# -----------------------------------------------------------------------------
# 1. the frozen passes are the policy's own to the bit


def _groups(vocab, prompt_lens, group, response_lens, seed=0):
    """Rows in groups of `group` sharing a left-padded prompt, each with its own right-padded response."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens for _ in range(group)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in response_lens]
    return common.join_prompt_response(prompts, responses, pad_id=0)


@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2"])
def test_a_frozen_copy_gives_the_policys_logprobs_to_the_bit_in_every_layout(name, user_models):
    """The policy's update forward (train mode, a gradient) against its frozen copy's no-grad pass
    (common.freeze: the reference) and the policy's own no-grad pass (the old policy), padded, packed
    and sharing prompts: torch.equal. The shared path's prompt forward kept its last position as a
    strided slice, which matmul folds into one mm for a head whose weight needs a gradient and runs as
    bmm for a frozen one: 2.4e-7 apart on the Llama folder at 3c74a6b."""
    tok = models.load_tokenizer("tiny" if name == "tiny" else user_models[name])
    policy = models.load_model("tiny" if name == "tiny" else user_models[name], tok)
    ref = common.freeze(copy.deepcopy(policy), D)
    ids, attn, resp = _groups(policy.config.vocab_size, (5, 9, 3), 3, (4, 7, 2, 7, 1, 5, 6, 3, 7))
    R, rows = resp.shape[1], torch.arange(len(ids))
    for packed, shared in ((False, False), (True, False), (False, True)):
        policy.train()
        want = shared_prompt.response_logprobs(policy, ids, attn, R, with_entropy=True, packed=packed, shared=shared)[0]
        assert want.requires_grad
        plan = [([rows], packed, [shared] if shared else False)]  # True: the chunk's groups found from its rows
        for model in (ref, policy):
            got = shared_prompt.planned_logprobs(model, ids, attn, R, plan, D)
            assert torch.equal(got * resp, want.detach() * resp), (name, packed, shared, (got - want).abs().max())


def test_the_first_update_of_every_rollout_sees_rho_exactly_1(tmp_path, user_models):
    """GRPO with 2 passes over 2 mini-batches and a reward that varies (advantages not 0): at each
    rollout's first optimizer step the policy is the rollout policy, so log rho = log pi - log pi_old
    is 0 to the bit on every token, in whatever layout the run picked (on the Llama folder, shared
    prompts and packing); at step 1 the reference is the policy too, KL 0 to the bit. The old
    policy's pass run in a layout of its own (all rows padded, one forward) gave log rho 4.8e-7 on the
    Llama folder, float noise that Adam scales into lr-sized steps: that planted bug fails here (the
    constant-reward tests below passed on it: their advantages are 0, whatever rho)."""
    inputs, loss_fn = [], grpo.grpo_loss

    def recording_loss(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs):
        m = mask.bool()
        inputs.append(((logps - old_logps)[m].abs().max().item(), (logps - ref_logps)[m].abs().max().item()))
        return loss_fn(logps, old_logps, ref_logps, advantages, mask, *args, **kwargs)

    args = GRPO_MODELS["llama"](tmp_path, user_models)  # the embedded model's layouts agree to the bit anyway
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "grpo_loss", recording_loss)
        _run(["grpo.py", *args, "--reward_fn", "digits", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
              "--lr", "1e-3", "--warmup_steps", "0", "--eval_every", "100", "--n_eval", "4", "--n_eval_pairs", "4",
              "--out_dir", str(tmp_path / "run")])
    assert len(inputs) == 2 * 2 * 2  # steps x passes x mini-batches
    assert inputs[0] == (0, 0) and inputs[4][0] == 0, inputs  # each rollout's first update: rho = 1; step 1: ref = pi
    assert inputs[5][0] > 0 and inputs[4][1] > 0, inputs  # the policy moved: within a rollout, and from the reference


@pytest.mark.parametrize("unscored", [False, True])
@pytest.mark.parametrize("rewards", [[0.3] * 8, [0.1] * 8, [0.7] * 6, [1 / 3] * 8])
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(rewards, unscored):
    """8 x 0.3 averages to 0.3 + 3e-8 in float32, which the std's eps (1e-4) turned into advantages of
    3e-4: a constant reward trained. Now exactly 0 for every estimator and scaling, beside a group
    whose rewards differ (which keeps its own), and counted in frac_reward_zero_std; also with an
    unscored completion (None: NaN) in the group, whose mean and std are taken over the scored ones
    (8 x 0.3 and a None gave 3e-4 with grpo, 3.4e-4 rloo, 9.9e-4 maxrl, and counted as not zero std)."""
    r = torch.tensor([rewards, [0.0, 1.0] * (len(rewards) // 2)])
    if unscored:
        r = torch.cat([r, torch.tensor([[math.nan], [1.0]])], 1)
    for estimator in ("grpo", "rloo", "maxrl"):
        for scale in ("group", "batch", "none"):
            adv, metrics = grpo.group_advantages(r, scale=scale, estimator=estimator)
            assert torch.equal(adv[0], torch.zeros(r.shape[1])), (estimator, scale, adv[0])
            assert adv[1].abs().min() > 0.1 and metrics["frac_reward_zero_std"] == 0.5, (estimator, scale, metrics)


def test_a_pair_whose_chosen_is_its_rejected_has_no_gradient():
    """dpo_loss with `same`: h and its gradient are exactly 0 for such a pair, for every loss type
    (the rejected log-probs are the chosen's own, so the two terms cancel in one float subtraction);
    without it, log-probs an ulp apart give h != 0; the other pairs keep their gradient."""
    pc = torch.tensor([-3.0, -5.0, -2.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-3.0000001, -7.0, -2.0], dtype=torch.float64, requires_grad=True)  # pair 0: an ulp-ish apart
    rc, rr = torch.tensor([-3.5, -5.5, -2.5], dtype=torch.float64), torch.tensor([-3.5000002, -6.0, -2.5],
                                                                                 dtype=torch.float64)
    same = torch.tensor([True, False, True])
    lengths = (torch.tensor([2.0, 3.0, 4.0]), torch.tensor([2.0, 5.0, 4.0]))
    for loss_type in dpo.LOSS_TYPES:
        loss, m = dpo.dpo_loss(pc, pr, rc, rr, beta=0.3, n_pairs=3, loss_type=loss_type, lengths=lengths, same=same)
        gc, gr = torch.autograd.grad(loss, (pc, pr))
        assert gc[0] == gr[0] == gc[2] == gr[2] == 0, (loss_type, gc, gr)
        assert gc[1] != 0 and gr[1] != 0, loss_type
        loss, _ = dpo.dpo_loss(pc, pr, rc, rr, beta=0.3, n_pairs=3, loss_type=loss_type, lengths=lengths)
        assert torch.autograd.grad(loss, pc)[0][0] != 0, loss_type  # the check has teeth


# -----------------------------------------------------------------------------
# 1. runs whose advantages are all 0 leave every weight as it was


CONSTANT = '''
def constant(prompts, completions, **columns):
    return [0.3] * len(completions)
'''


def _constant_reward(folder):
    (folder / "constant.py").write_text(CONSTANT)
    return f"{folder / 'constant.py'}:constant"


def _run(argv):
    proc = run_here(argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r for r in read_metrics(argv[argv.index("--out_dir") + 1]) if "loss" in r]


GRPO_MODELS = {  # the embedded model at its defaults; the Llama folder at the embedded task's algorithm defaults
    # (a reference, 2 passes over 2 mini-batches, padding-free and shared prompts), and with activation
    # checkpointing (the policy cannot share prompts there; its reference could)
    "tiny": lambda folder, models: ["--model", "tiny", "--max_new_tokens", "8"],
    "llama": lambda folder, models: ["--model", models["llama"], "--dataset", write_jsonl(
        folder / "p.jsonl", [{"prompt": question(i)} for i in range(16)]), "--max_prompt_len", "64", "--max_new_tokens",
        "8", "--beta", "0.04", "--num_iterations", "2", "--num_mini_batches", "2", "--temperature", "0.7"],
    "llama_checkpointing": lambda folder, models: [*GRPO_MODELS["llama"](folder, models), "--activation_checkpointing"],
}


@pytest.mark.parametrize("name", sorted(GRPO_MODELS))
def test_grpo_under_a_constant_reward_leaves_every_weight_bit_identical(tmp_path, user_models, name):
    """A reward of 0.3 for every completion: 3 steps of 2 passes x 2 mini-batches at lr 1e-3 end with
    the weights of the same run at lr 0, bit for bit; kl, loss and grad norm 0 at every step. At
    3c74a6b the KL's gradient was float noise (the reference pass cut its micro-batches otherwise,
    and equal rewards' advantages were 3e-4): kl 7e-5, 0.0165, 0.0020 on the embedded model."""
    args = [*GRPO_MODELS[name](tmp_path, user_models), "--reward_fn", _constant_reward(tmp_path), "--steps", "3",
            "--prompts_per_step", "4", "--group_size", "4", "--warmup_steps", "0", "--eval_every", "100", "--n_eval",
            "4", "--n_eval_pairs", "4"]
    rows = _run(["grpo.py", *args, "--lr", "1e-3", "--out_dir", str(tmp_path / "trained")])
    _run(["grpo.py", *args, "--lr", "0", "--out_dir", str(tmp_path / "lr0")])
    assert [(r["kl"], r["loss"], r["grad_norm"], r["frac_reward_zero_std"]) for r in rows] == [(0, 0, 0, 1)] * 3
    assert max_abs_diff(checkpoint_weights(tmp_path / "trained"), checkpoint_weights(tmp_path / "lr0")) == 0


def same_pairs(folder, n=16):
    """Conversational pairs whose chosen is their rejected: no preference anywhere."""
    return write_jsonl(folder / "same.jsonl", [{"prompt": question(i), "chosen": chat(("assistant", f"{i + 7} or so")),
                                                "rejected": chat(("assistant", f"{i + 7} or so"))} for i in range(n)])


@pytest.mark.parametrize("reference", ["--precompute_ref", "--no-precompute_ref"])
def test_dpo_on_pairs_whose_chosen_is_their_rejected_leaves_every_weight_bit_identical(tmp_path, user_models,
                                                                                        reference):
    """3 steps at lr 1e-3 on the Qwen2 folder (shared prompts and packing where they compute less, as
    by default) end with the lr-0 run's weights, bit for bit; every margin 0 and accuracy 0.5. At
    3c74a6b the two rows' gradients cancelled only to float noise, which Adam scaled up."""
    pairs = same_pairs(tmp_path)
    args = ["--model", user_models["qwen2"], "--dataset", pairs, "--eval_dataset", pairs, "--steps", "3",
            "--batch_size", "8", "--warmup_steps", "0", "--max_prompt_len", "64", "--max_response_len", "16",
            "--n_eval", "8", "--eval_every", "100", reference]
    rows = _run(["dpo.py", *args, "--lr", "1e-3", "--out_dir", str(tmp_path / "trained")])
    _run(["dpo.py", *args, "--lr", "0", "--out_dir", str(tmp_path / "lr0")])
    assert all(r["rewards/margins"] == 0 and r["rewards/accuracies"] == 0.5 and r["grad_norm"] == 0 for r in rows)
    assert max_abs_diff(checkpoint_weights(tmp_path / "trained"), checkpoint_weights(tmp_path / "lr0")) == 0


def test_each_micro_batch_of_dpo_gets_the_same_flags_of_its_own_pairs(tmp_path, user_models):
    """dpo.py on pairs of which every third's chosen is its rejected, shuffled into 2 micro-batches a
    step: each dpo_loss call's `same` is True exactly for the pairs of its micro-batch whose chosen
    and rejected rows hold the same tokens, read from the batch data.pair_batch built for it. The
    flags of the data set's first pairs fed to every micro-batch (planted) train the wrong pairs:
    test_dpo_on_pairs_whose_chosen_is_their_rejected_... passed on it, every pair being the same."""
    rows = [{"prompt": question(i), "chosen": chat(("assistant", f"{i + 7} or so")),
             "rejected": chat(("assistant", f"{i + 7} or so" if i % 3 == 0 else f"{i + 8}, I think"))} for i in range(16)]
    pairs = write_jsonl(tmp_path / "mixed.jsonl", rows)
    seen, pair_batch, loss_fn = [], data.pair_batch, dpo.dpo_loss

    def recording_batch(*args, **kwargs):
        seen[:] = [pair_batch(*args, **kwargs)]
        return seen[0]

    def checking_loss(*args, same=None, **kwargs):
        ids, attn, _ = seen[0]
        B = len(ids) // 2
        want = [torch.equal(ids[i], ids[B + i]) and torch.equal(attn[i], attn[B + i]) for i in range(B)]
        flags.append((same.tolist(), want))
        return loss_fn(*args, same=same, **kwargs)

    flags = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "pair_batch", recording_batch)
        mp.setattr(dpo, "dpo_loss", checking_loss)
        _run(["dpo.py", "--model", user_models["qwen2"], "--dataset", pairs, "--eval_dataset", pairs, "--steps", "2",
              "--batch_size", "8", "--grad_accum", "2", "--max_prompt_len", "64", "--max_response_len", "16",
              "--n_eval", "8", "--eval_every", "100", "--out_dir", str(tmp_path / "run")])
    assert len(flags) == 2 * 2 and all(got == want for got, want in flags), flags
    assert any(True in want and False in want for _, want in flags)  # micro-batches of both kinds of pair


# -----------------------------------------------------------------------------
# 2. data on which one rank's rows would pack and the other's not, on 2 ranks


B, STEPS = 8, 2  # rows (pairs) a step, over 2 ranks: 4 each


def place_of_rows(n, batch=B, steps=STEPS, seed=0):
    """(rank, place in the rank's micro-batch) of each of n rows in the first `steps` steps
    (data.DataOrder's rows, shard_batch's slices)."""
    order, place = data.DataOrder(n, seed, batch=batch), {}
    for _ in range(steps):
        for k, i in enumerate(order.next(batch)):
            place[i] = divmod(k, batch // 2)
    return [place[i] for i in range(n)]


def ragged_rows(kind, n=B * STEPS):
    """Rows of one length where rank 1 takes them, and where rank 0 does, one long row a micro-batch
    beside short ones: rank 0's micro-batches are mostly padding (packing pays), rank 1's hold none
    (it does not)."""
    rows = []
    for i, (rank, k) in enumerate(place_of_rows(n)):
        prompt, good, bad = question(1), "8", "9"
        if rank == 0 and k == 0:
            prompt = [{"role": "system", "content": "Answer with a number. " * 6}, *question(i)[1:]]
            good, bad = str(i + 7), " ".join(["the quick brown fox"] * 5)
        elif rank == 0:
            prompt, good, bad = question(i)[1:], str(i + 7), "no"
        if kind == "sft":
            rows.append({"prompt": prompt, "completion": chat(("assistant", bad))})
        else:
            rows.append({"prompt": prompt, "chosen": chat(("assistant", good)), "rejected": chat(("assistant", bad))})
    return rows


def branching_argv(script, folder, models, *extra):
    rows = write_jsonl(folder / f"{script}.jsonl", ragged_rows("sft" if script == "sft" else "pairs"))
    model = models["llama"] if script != "dpo" else models["qwen2"]
    return [f"{script}.py", "--model", model, "--dataset", rows, "--eval_dataset", rows, "--steps", str(STEPS),
            "--batch_size", str(B), "--lr", "1e-4", "--warmup_steps", "0", "--max_prompt_len", "96",
            "--max_response_len", "24", "--n_eval", "8", "--eval_every", "100", "--out_dir", str(folder / "run"),
            *([] if script == "sft" else ["--n_eval_prompts", "4"] if script == "dpo" else ["--n_normalize", "8"]),
            *extra]


BRANCHING = {"sft": ("sft",), "reward": ("reward",), "dpo": ("dpo",), "dpo_live": ("dpo", "--no-precompute_ref")}


def zero_reward_grpo(folder, models=None):
    """The issue's command: every reward 0 (the embedded task, a random policy), at lr 1e-4."""
    return ["grpo.py", "--model", "tiny", "--steps", "3", "--prompts_per_step", "4", "--group_size", "4",
            "--max_new_tokens", "8", "--lr", "1e-4", "--n_eval", "4", "--n_eval_pairs", "4", "--eval_every", "1000",
            "--out_dir", str(folder / "run")]


@pytest.fixture(scope="module")
def branching(tmp_path_factory, user_models):
    """Every run above on 2 ranks, in one torchrun under TORCH_DISTRIBUTED_DEBUG=DETAIL (a collective
    that one rank calls and the other not fails at once, naming both), within a timeout that fails
    the test instead of waiting. Returns folder(NAME) of a run that exited 0."""
    root = tmp_path_factory.mktemp("branching")
    for name in [*BRANCHING, "grpo_zero"]:
        (root / name).mkdir()
    runs = {name: branching_argv(args[0], root / name, user_models, *args[1:]) for name, args in BRANCHING.items()}
    runs["grpo_zero"] = zero_reward_grpo(root / "grpo_zero")
    argv = ["tests/multi_run.py", str(root / "codes.json")]
    for name, run in runs.items():
        argv += ["--", name, *run]
    proc = run_script(argv, nproc=2, timeout=420,
                      env={**SUBPROCESS_ENV_NO_TOKENIZER_THREADS, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    codes = json.loads((root / "codes.json").read_text()) if (root / "codes.json").exists() else {}

    def folder(name):
        assert codes.get(name) == 0, (f"the 2-rank run {name} exited {codes.get(name, 'before it began')}\n"
                                      + proc.stdout[-3000:] + proc.stderr[-3000:])
        return root / name / "run"
    return folder


def _shard_packs(script, folder, models):
    """Whether each rank's micro-batch of each step would pack (common.packing_pays on its rows alone,
    as a rank deciding by itself did), the batches built as the script builds them."""
    args = branching_argv(script, folder, models)[1:]
    cfg = cli.with_defaults(cli.parse_config(sft.Config if script == "sft" else dpo.Config, args))
    tok = models_lib.load_tokenizer(args[1])
    config = models_lib.load_model(args[1], tok).config
    model = type("M", (), {"config": config})()
    if script == "sft":
        train = data.load_data(cfg.dataset, "train", sft.COLUMNS, kind="sft")
        encoded = sft.encode_sft(train, tok, cfg, cfg.dataset)
        batch = lambda rows: sft.make_batch(*encoded, rows, tok.pad_token_id, "cpu")[:2]  # noqa: E731
        per = 1
    else:
        train, test = data.load_preferences(cfg)
        _, _, pairs, _ = data.encode_preferences(train, test, tok, cfg)
        batch = lambda rows: data.pair_batch(pairs, rows, tok.pad_token_id, "cpu")[:2]  # noqa: E731
        per = 2
    order, packs = data.DataOrder(len(train), cfg.seed, batch=B), []
    for _ in range(STEPS):
        rows = order.next(B)
        for shard in (rows[:B // 2], rows[B // 2:]):
            _, attn = batch(shard)
            packs.append(common.packing_pays(model, attn, per * len(shard), D))
    return packs


models_lib = models


@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_the_ragged_rows_make_the_ranks_decide_apart(tmp_path, user_models, script):
    """The premise of the 2-rank tests below: rank 0's micro-batches would pack, rank 1's would not
    (decided on each rank's own rows, as sft.py, reward.py and dpo.py did; reward.py's batches are
    dpo.py's pairs)."""
    (tmp_path / "x").mkdir()
    assert _shard_packs(script, tmp_path / "x", user_models) == [True, False] * STEPS


@pytest.mark.parametrize("name", sorted(BRANCHING))
def test_two_ranks_whose_rows_would_decide_apart_finish_and_match_one_process(tmp_path, user_models, branching,
                                                                             name):
    """On the ragged rows: the 2-rank run ends (dpo.py hung at 3c74a6b, live reference or not) with
    1 process's losses, grad norms and weights, within float32's rounding of the layouts, which
    differ (helpers.assert_runs_agree: step 1's loss and grad norm at the starting weights, the
    last loss within the drift Adam makes of rounding noise), and the weights within adam_drift (a
    bound of 1e-5, a constant, failed on an AMD Zen 3 at 1.84e-5: lr 1e-4, 2 steps)."""
    script, *extra = BRANCHING[name]
    one = _run(branching_argv(script, tmp_path, user_models, *extra))
    two = [r for r in read_metrics(branching(name)) if "loss" in r]
    assert len(one) == len(two) == STEPS
    assert_runs_agree(one, two, checkpoint_config(tmp_path / "run"), length=96 + 24, lr=1e-4)
    assert max_abs_diff(checkpoint_weights(tmp_path / "run"), checkpoint_weights(branching(name))) <= \
        adam_drift(1e-4, STEPS)


def test_grpo_with_every_reward_zero_on_two_ranks_leaves_the_weights_of_one_process(tmp_path, branching):
    """The issue's command (every reward 0): 1 process and 2 ranks both end with the weights they
    started from (the lr-0 run's), bit for bit; at 3c74a6b they ended 6.5e-4 apart, each moved by
    its own float noise."""
    _run(zero_reward_grpo(tmp_path / "one"))
    start = zero_reward_grpo(tmp_path / "start")
    start[start.index("--lr") + 1] = "0"
    _run(start)
    for run in (tmp_path / "one" / "run", branching("grpo_zero")):
        assert max_abs_diff(checkpoint_weights(run), checkpoint_weights(tmp_path / "start" / "run")) == 0
    assert math.isfinite(read_metrics(branching("grpo_zero"))[-1]["loss"])
