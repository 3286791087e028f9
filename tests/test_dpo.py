"""dpo.py: every loss type by hand and by gradient, split_hh on hand cases, one concatenated
forward against a naive per-sequence computation, precomputed vs live reference, gradient
accumulation, and subprocess runs (embedded task and an HH-style jsonl) whose checkpoints load."""
import math
from dataclasses import replace

import pytest
import torch

import common
import data
import dpo
from helpers import (assert_runs_agree, checkpoint_config, forward_lengths, fp32_rtol, gamma, logprob_size, read_metrics,
                     run_here, write_jsonl)
from plumbing import cli, models

D = common.Dist()


def softplus(x):
    return math.log1p(math.exp(x))


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# -----------------------------------------------------------------------------
# dpo_loss by hand: h = (pc - pr) - (rc - rr) = [1, -2], beta = 0.5, so beta*h = [0.5, -1]

PC, PR = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
RC, RR = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
BETA = 0.5


@pytest.mark.parametrize("loss_type, smoothing, expected", [
    ("sigmoid", 0.0, [softplus(-0.5), softplus(1.0)]),                   # -log sigmoid(x) = log(1 + e^-x)
    ("sigmoid", 0.1, [0.9 * softplus(-0.5) + 0.1 * softplus(0.5),
                      0.9 * softplus(1.0) + 0.1 * softplus(-1.0)]),      # cDPO
    ("ipo", 0.0, [(1 - 1) ** 2, (-2 - 1) ** 2]),                         # (h - 1/(2*0.5))^2
    ("hinge", 0.0, [1 - 0.5, 1 + 1.0]),                                  # relu(1 - beta*h)
    ("robust", 0.1, [(0.9 * softplus(-0.5) - 0.1 * softplus(0.5)) / 0.8,
                     (0.9 * softplus(1.0) - 0.1 * softplus(-1.0)) / 0.8]),  # rDPO
    # APO-zero: beta * chosen log-ratios [0.25, -0.5], rejected [-0.25, 0.5]
    ("apo_zero", 0.0, [1 - sigmoid(0.25) + sigmoid(-0.25), 1 - sigmoid(-0.5) + sigmoid(0.5)]),
])
def test_dpo_loss_hand_values(loss_type, smoothing, expected):
    torch.testing.assert_close(per_pair_losses(PC, PR, RC, RR, BETA, loss_type, smoothing),
                               torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)
    loss, m = dpo.dpo_loss(PC, PR, RC, RR, BETA, 2, loss_type, smoothing)
    assert loss.item() == pytest.approx(sum(expected) / 2, abs=1e-6) and m["loss"].item() == loss.item()
    # implicit rewards 0.5 * (pc - rc) = [0.25, -0.5] and 0.5 * (pr - rr) = [-0.25, 0.5]
    assert m["rewards/chosen"].item() == pytest.approx(-0.125) and m["rewards/rejected"].item() == pytest.approx(0.125)
    assert m["rewards/margins"].item() == pytest.approx(-0.25) and m["rewards/accuracies"].item() == 0.5
    assert m["logps/chosen"].item() == pytest.approx(-2.0) and m["logps/rejected"].item() == pytest.approx(-1.5)


def per_pair_losses(pc, pr, rc, rr, beta, loss_type="sigmoid", smoothing=0.0):
    """Each pair's loss alone (a global batch of one pair)."""
    return torch.stack([dpo.dpo_loss(pc[i:i + 1], pr[i:i + 1], rc[i:i + 1], rr[i:i + 1], beta, 1, loss_type,
                                     smoothing)[0] for i in range(len(pc))])


def test_dpo_loss_takes_the_global_denominator():
    """Two micro-batches of one global batch of 6 pairs: their losses and metrics add up to the
    whole batch's mean, which is what common.backward relies on."""
    pc, pr, rc, rr = (t.detach() for t in _random_logps(3))
    full, m_full = dpo.dpo_loss(pc, pr, rc, rr, 0.2, 6)
    parts = [dpo.dpo_loss(pc[i:i + 3], pr[i:i + 3], rc[i:i + 3], rr[i:i + 3], 0.2, 6) for i in (0, 3)]
    assert full.item() == pytest.approx(sum(p[0].item() for p in parts), abs=1e-9)
    for k in m_full:
        assert m_full[k].item() == pytest.approx(sum(p[1][k].item() for p in parts), abs=1e-6), k
    assert full.item() == pytest.approx(per_pair_losses(pc, pr, rc, rr, 0.2).mean().item(), abs=1e-9)


def test_label_smoothing_zero_is_plain_dpo():
    torch.manual_seed(0)
    x = [torch.randn(8) * 5 for _ in range(4)]
    losses = per_pair_losses(*x, beta=0.3, loss_type="sigmoid", smoothing=0.0)
    h = (x[0] - x[1]) - (x[2] - x[3])
    torch.testing.assert_close(losses, -torch.nn.functional.logsigmoid(0.3 * h))


def test_dpo_loss_errors():
    with pytest.raises(ValueError, match="unknown loss_type"):
        dpo.dpo_loss(PC, PR, RC, RR, BETA, 2, "kto")
    with pytest.raises(ValueError, match="sigmoid"):
        dpo.dpo_loss(PC, PR, RC, RR, BETA, 2, "ipo", label_smoothing=0.1)


def _random_logps(seed, B=6):
    g = torch.Generator().manual_seed(seed)
    pc, pr = [(-10 * torch.rand(B, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(2)]
    rc, rr = [-10 * torch.rand(B, generator=g, dtype=torch.float64) for _ in range(2)]
    return pc, pr, rc, rr


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_gradient_closed_form(loss_type):
    pc, pr, rc, rr = _random_logps(1)
    beta, B = 0.2, pc.shape[0]
    loss, _ = dpo.dpo_loss(pc, pr, rc, rr, beta, B, loss_type)
    g_c, g_r = torch.autograd.grad(loss, [pc, pr])
    with torch.no_grad():
        h = (pc - pr) - (rc - rr)
        dh = {"sigmoid": -beta * torch.sigmoid(-beta * h),      # d/dh -log sigmoid(beta h)
              "ipo": 2 * (h - 1 / (2 * beta)),
              "hinge": -beta * (beta * h < 1).double()}[loss_type]
    assert (dh != 0).any()
    torch.testing.assert_close(g_c, dh / B)    # dh/dpc = 1
    torch.testing.assert_close(g_r, -dh / B)   # dh/dpr = -1


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_dpo_gradcheck(loss_type, smoothing):
    pc, pr, rc, rr = _random_logps(2)
    h = (pc - pr) - (rc - rr)
    assert ((0.2 * h - 1).abs() > 1e-3).all()  # away from the hinge's kink
    assert torch.autograd.gradcheck(lambda a, b: dpo.dpo_loss(a, b, rc, rr, 0.2, 6, loss_type, smoothing)[0], (pc, pr))


# -----------------------------------------------------------------------------
# split_hh

M = "\n\nAssistant:"


def test_split_hh_multi_turn():
    head = "\n\nHuman: hi" + M + " hello\n\nHuman: how to sort 3 1 2?" + M
    p, c, r = data.split_hh(head + " 1 2 3", head + " no idea, sorry")
    assert (p, c, r) == (head, " 1 2 3", " no idea, sorry")


def test_split_hh_single_turn_and_empty_response():
    p, c, r = data.split_hh("\n\nHuman: x" + M + " y", "\n\nHuman: x" + M)
    assert (p, c, r) == ("\n\nHuman: x" + M, " y", "")


def test_split_hh_uses_last_marker_of_each():
    # the chosen answer mentions nothing special; both split at their own last marker
    p, c, r = data.split_hh("\n\nHuman: a" + M + " b" + M + " c", "\n\nHuman: a" + M + " b" + M + " d")
    assert (p, c, r) == ("\n\nHuman: a" + M + " b" + M, " c", " d")


def test_split_hh_errors():
    with pytest.raises(ValueError, match="different prompts"):
        data.split_hh("\n\nHuman: a" + M + " b", "\n\nHuman: z" + M + " b")
    with pytest.raises(ValueError, match="rejected dialogue has no"):
        data.split_hh("\n\nHuman: a" + M + " b", "\n\nHuman: a b")
    with pytest.raises(ValueError, match="chosen dialogue has no"):
        data.split_hh("just text", "\n\nHuman: a" + M + " b")


def test_load_pairs_names_the_bad_row(tmp_path):
    path = tmp_path / "hh.jsonl"
    good = {"chosen": "\n\nHuman: a" + M + " b", "rejected": "\n\nHuman: a" + M + " c"}
    bad = {"chosen": "\n\nHuman: a" + M + " b", "rejected": "\n\nHuman: q" + M + " c"}
    write_jsonl(path, [good, good, bad])
    with pytest.raises(ValueError, match=r"hh.jsonl row 3: chosen and rejected"):
        data.load_pairs(str(path), "train", None, 0)
    write_jsonl(path, [good])
    ds = data.load_pairs(str(path), "train", None, 0)
    assert (ds["prompt"], ds["chosen"], ds["rejected"]) == (["\n\nHuman: a" + M], [" b"], [" c"])


# -----------------------------------------------------------------------------
# log-probs: one concatenated forward, and precomputed vs live reference

PROMPTS = ["sort 3 1 2 =", "sort 9 9 1 0 =", "sort 5 5 5 =", "sort 8 1 =", "sort 7 6 5 4 3 2 1 ="]
CHOSEN = [" 1 2 3", " 0 1 9 9", " 5 5 5", " 1 8", " 1 2 3 4 5 6 7"]
REJECTED = [" 3 2", " 0 1 9", " 5 5 5 5 5 5", " 8 1", " 1 2"]


@pytest.fixture(scope="module")
def tiny():
    tok = models.load_tokenizer("tiny")
    torch.manual_seed(0)
    policy = models.load_model("tiny", tok).eval()
    torch.manual_seed(1)
    ref = models.load_model("tiny", tok).eval()
    pairs = data.encode_pairs({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED}, tok, 64, 32, "test")
    return tok, policy, ref, pairs


@torch.no_grad()
def test_pair_logps_equals_naive(tiny):
    tok, policy, _, pairs = tiny
    pc, pr = common.sequence_logprobs(policy, data.pair_batch(pairs, range(5), tok.pad_token_id, "cpu"), D).chunk(2)
    for i in range(5):
        for resp, got in ((CHOSEN[i], pc[i]), (REJECTED[i], pr[i])):
            p, r = tok(PROMPTS[i])["input_ids"], tok(resp)["input_ids"] + [tok.eos_token_id]
            logp = policy(torch.tensor([p + r])).logits[0].log_softmax(-1)  # unpadded, default positions
            naive = sum(logp[len(p) - 1 + t, r[t]] for t in range(len(r)))
            # a sum of len(r) log-probs in two layouts: float32's rounding of their terms' sizes
            tol = fp32_rtol(forward_lengths(policy.config, len(p) + len(r)) + [len(r)]) * len(r) * logprob_size(policy)
            torch.testing.assert_close(got, naive, atol=tol, rtol=0)


def test_precomputed_and_live_reference_give_the_same_loss(tiny):
    tok, policy, ref, pairs = tiny
    ref_all = dpo.all_pair_logps(ref, pairs, tok.pad_token_id, D, batch_size=2)  # (5, 2), other padding
    rows = [4, 0, 2]
    batch = data.pair_batch(pairs, rows, tok.pad_token_id, "cpu")
    pc, pr = common.sequence_logprobs(policy, batch, D).chunk(2)
    with torch.no_grad():
        live = common.sequence_logprobs(ref, batch, D).chunk(2)
    # the reference's sequence log-probs in two layouts (sums of R of them): each within float32's
    # rounding, so h within twice that, and each loss within its slope in h times it (beta for
    # sigmoid and hinge, 2 |h - 1 / (2 beta)| for IPO)
    R = batch[2].shape[1]
    dh = 2 * fp32_rtol(forward_lengths(ref.config, batch[0].shape[1]) + [R]) * R * logprob_size(ref)
    h = (pc - pr) - (live[0] - live[1])
    for loss_type in ("sigmoid", "ipo", "hinge"):
        pre_loss = per_pair_losses(pc, pr, *ref_all[rows].unbind(1), 0.1, loss_type)
        live_loss = per_pair_losses(pc, pr, *live, 0.1, loss_type)
        slope = 2 * (h.abs().max().item() + dh + 1 / (2 * 0.1)) if loss_type == "ipo" else 0.1
        torch.testing.assert_close(pre_loss, live_loss, atol=slope * dh, rtol=0)
        assert (pre_loss - per_pair_losses(pc, pr, pc.detach(), pr.detach(), 0.1, loss_type)).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# the script end to end

# lr 3e-5: Adam turns rounding differences in near-zero gradients into steps of up to lr, and the
# comparisons between runs bound them by lr (helpers.adam_drift)
TINY = ["--model", "tiny", "--n_train", "48", "--steps", "3", "--batch_size", "8", "--warmup_steps", "0",
        "--lr", "3e-5", "--n_eval", "16", "--n_eval_prompts", "4", "--max_response_len", "16", "--eval_every", "100"]


def run_dpo(out, *extra):
    """dpo.py on TINY and extra, in this process; the metrics it logged and its stdout."""
    res = run_here(["dpo.py", "--out_dir", str(out), *TINY, *extra])
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(out), res.stdout


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "base"
    return out, run_dpo(out)[0]


def train_rows(rows):
    return [r for r in rows if "loss" in r]


def test_dpo_script_tiny(base_run):
    from transformers import AutoModelForCausalLM

    out, rows = base_run
    steps = train_rows(rows)
    assert [r["step"] for r in steps] == [1, 2, 3]
    config = AutoModelForCausalLM.from_pretrained(out / "checkpoint").config
    rtol = fp32_rtol(forward_lengths(config, 64 + 16) + [16])  # a layout's rounding of a sum of 16 log-probs
    # policy == reference at step 1, the reference precomputed in another layout: h is rounding
    ln2 = rtol * (abs(steps[0]["logps/chosen"]) + abs(steps[0]["logps/rejected"]))
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=ln2)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert all(math.isfinite(r[key]) for r in steps), key
    start, end = rows[0], rows[-1]
    assert start["step"] == 0 and start["eval/accuracy"] == 0.5  # ties count half
    assert {"eval/accuracy", "eval/bayes_accuracy", "eval/exact_match", "eval/gold_reward"} <= set(end)
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    assert model.config.n_layer == 4

    # the final eval recomputed from the saved policy and the rebuilt reference: h = the policy's
    # log-ratio to the reference of chosen minus that of rejected, pair by pair; its sign flips with
    # chosen and rejected, or policy and reference, swapped. In the script's batches (its
    # --eval_batch_size), so each log-prob is the script's own float operations and h its h exactly:
    # the accuracy exact, the margin within the rounding of its float32 mean
    tok = models.load_tokenizer("tiny")
    cfg = replace(cli.with_defaults(dpo.Config()), max_response_len=16)  # TINY's
    pairs = data.encode_pairs(data.load_pairs("sort", "test", 16, 0), tok, cfg.max_prompt_len, 16, "eval")  # TINY's 16
    common.set_seed(0)  # the initial weights, built as dpo.py builds them
    ref = models.load_model("tiny", tok).eval()
    with torch.no_grad():
        pi, pi_ref = (dpo.all_pair_logps(m, pairs, tok.pad_token_id, D, cfg.eval_batch_size) for m in (model, ref))
    h = (pi[:, 0] - pi[:, 1]) - (pi_ref[:, 0] - pi_ref[:, 1])
    assert (h != 0).all() and (h > 0).any() and (h < 0).any(), h
    assert end["eval/margin"] == pytest.approx(cfg.beta * h.mean().item(), abs=gamma(16 + 2) * cfg.beta * h.abs().mean().item())
    assert end["eval/accuracy"] == (h > 0).float().mean().item(), (end, h)


def test_live_reference_matches_precomputed(base_run, tmp_path):
    rows, stdout = run_dpo(tmp_path / "live", "--no-precompute_ref")
    assert "live reference" in stdout
    # float32's rounding of the reference's two layouts, then Adam's drift (helpers.assert_runs_agree)
    logps = ["logps/chosen", "logps/rejected"]
    assert_runs_agree(train_rows(base_run[1]), train_rows(rows), checkpoint_config(base_run[0]), length=64 + 16, lr=3e-5,
                      keys=("loss", "rewards/margins"), norm_terms=0, scales={"loss": logps, "rewards/margins": logps})


def test_grad_accumulation_keeps_the_normaliser(base_run, tmp_path):
    rows, _ = run_dpo(tmp_path / "accum", "--grad_accum", "4")
    # step 1's loss and grad norm within float32's rounding of the two layouts, later losses within
    # Adam's drift too (helpers.assert_runs_agree); a per-micro-batch normaliser moves them by far more
    assert_runs_agree(train_rows(base_run[1]), train_rows(rows), checkpoint_config(base_run[0]), length=64 + 16,
                      lr=3e-5, norm_terms=0, scales={"loss": ["logps/chosen", "logps/rejected"]})


def test_hh_jsonl_through_dpo(tmp_path):
    from transformers import AutoModelForCausalLM

    rows = []
    for i in range(16):
        head = f"\n\nHuman: what is {i} plus 1?" + M
        long_head = "\n\nHuman: " + "blah " * 30 * (i % 2) + head  # every other prompt is cut on the left
        rows.append({"chosen": long_head + f" {i + 1}", "rejected": long_head + " no"})
    path = write_jsonl(tmp_path / "hh.jsonl", rows)
    out = tmp_path / "hh"
    res = run_here(["dpo.py", "--model", "tiny", "--dataset", path, "--eval_dataset", path, "--out_dir", str(out),
                      "--steps", "2", "--batch_size", "4", "--max_prompt_len", "48", "--max_response_len", "8"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "truncated 8 prompts (left)" in res.stdout
    rows = read_metrics(out)
    assert "eval/accuracy" in rows[-1] and "eval/exact_match" not in rows[-1]  # no gold reward for HH
    # the eval pairs are the training pairs: after one step (the first is at lr 0 in warmup) the
    # policy prefers the chosen answers, accuracy 1.0 and margin 0.043 (measured); with chosen and
    # rejected swapped in the loss, accuracy 0.0 and margin -0.043
    assert rows[-1]["eval/accuracy"] > 0.75 and rows[-1]["eval/margin"] > 0.02, rows[-1]
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")


def test_batch_arithmetic_is_checked():
    with pytest.raises(ValueError, match="divisible by world size 1 x --grad_accum 4"):
        dpo.main(replace(dpo.Config(), model="tiny", batch_size=6, grad_accum=4))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_robust_dpo_is_unbiased_under_flipped_labels(eps):
    """rDPO's point: with each label flipped with probability eps, the expected robust loss (the
    pair as given, weight 1 - eps, and swapped, weight eps) is the clean sigmoid loss, for every
    pair; cDPO's (label smoothing) is not. At eps = 0 it is plain DPO."""
    pc, pr, rc, rr = (t.detach() for t in _random_logps(3))
    clean = per_pair_losses(pc, pr, rc, rr, 0.3)
    given = per_pair_losses(pc, pr, rc, rr, 0.3, "robust", eps)
    swapped = per_pair_losses(pr, pc, rr, rc, 0.3, "robust", eps)
    torch.testing.assert_close((1 - eps) * given + eps * swapped, clean, atol=1e-5, rtol=0)
    if eps:
        c_given = per_pair_losses(pc, pr, rc, rr, 0.3, "sigmoid", eps)
        c_swapped = per_pair_losses(pr, pc, rr, rc, 0.3, "sigmoid", eps)
        assert ((1 - eps) * c_given + eps * c_swapped - clean).abs().max() > 1e-3


def test_apo_zero_raises_the_chosen_and_lowers_the_rejected_each_on_its_own():
    """Unlike DPO, whose gradient depends on the difference of the log-ratios only, APO-zero's
    pushes each: d loss / d log pi(chosen) = -beta s(1 - s) at s = sigmoid(beta * chosen
    log-ratio), d loss / d log pi(rejected) = +beta t(1 - t); moving both log-probs by the same
    amount changes it (it does not change DPO's)."""
    pc, pr = torch.tensor([-1.0, -3.0], requires_grad=True), torch.tensor([-2.0, -1.0], requires_grad=True)
    loss, _ = dpo.dpo_loss(pc, pr, RC, RR, BETA, 2, "apo_zero")
    loss.backward()
    s, t = torch.sigmoid(BETA * (pc.detach() - RC)), torch.sigmoid(BETA * (pr.detach() - RR))
    torch.testing.assert_close(pc.grad, -BETA * s * (1 - s) / 2, atol=1e-6, rtol=0)
    torch.testing.assert_close(pr.grad, BETA * t * (1 - t) / 2, atol=1e-6, rtol=0)
    shifted = dpo.dpo_loss(PC + 1, PR + 1, RC, RR, BETA, 2, "apo_zero")[0]
    assert abs(shifted.item() - loss.item()) > 1e-3
    assert dpo.dpo_loss(PC + 1, PR + 1, RC, RR, BETA, 2)[0].item() == pytest.approx(
        dpo.dpo_loss(PC, PR, RC, RR, BETA, 2)[0].item(), abs=1e-6)
