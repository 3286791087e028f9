"""reward.py: the Bradley-Terry loss by hand and by gradient, scoring independent of padding,
the normalisation, and a subprocess run whose checkpoint loads as a Hugging Face reward model."""
import math
from dataclasses import replace

import pytest
import torch

import common
import data
import reward
from helpers import U32, forward_lengths, fp32_rtol, logit_size, read_metrics, run_here
from plumbing import cli, models

D = common.Dist()


def softplus(x):
    return math.log1p(math.exp(x))


# -----------------------------------------------------------------------------
# bt_loss


def test_bt_loss_hand_values():
    r_c, r_r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])  # differences +1, -2
    loss, m = reward.bt_loss(r_c, r_r, n_pairs=2)
    # -log sigmoid(x) = log(1 + e^-x)
    assert loss.item() == pytest.approx((softplus(-1) + softplus(2)) / 2, abs=1e-6)
    assert m["accuracy"].item() == 0.5
    assert m["margin"].item() == pytest.approx(-0.5)
    assert m["rewards/chosen"].item() == pytest.approx(0.5)
    assert m["rewards/rejected"].item() == pytest.approx(1.0)
    assert all(not v.requires_grad for v in m.values())


def test_bt_loss_takes_the_global_denominator():
    """Two micro-batches of one global batch of 4 pairs (on one rank or two): their losses and
    metrics add up to the whole batch's mean, which is what common.backward relies on."""
    r_c, r_r = torch.tensor([1.0, 0.0, 3.0, -1.0]), torch.tensor([0.0, 2.0, 1.0, -1.5])
    full, m_full = reward.bt_loss(r_c, r_r, n_pairs=4)
    parts = [reward.bt_loss(r_c[i:i + 2], r_r[i:i + 2], n_pairs=4) for i in (0, 2)]
    assert full.item() == pytest.approx(sum(p[0].item() for p in parts), abs=1e-7)
    for k in m_full:
        assert m_full[k].item() == pytest.approx(sum(p[1][k].item() for p in parts), abs=1e-7), k
    assert full.item() == pytest.approx(sum(softplus(-x) for x in (1.0, -2.0, 2.0, 0.5)) / 4, abs=1e-6)


def test_bt_loss_margin_and_centring_hand_values():
    r_c, r_r = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    loss, m = reward.bt_loss(r_c, r_r, 2, margin=torch.tensor([0.5, 1.0]))  # logits 0.5, -3
    assert loss.item() == pytest.approx((softplus(-0.5) + softplus(3)) / 2, abs=1e-6)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == pytest.approx(-0.5)  # metrics ignore the margin
    loss, _ = reward.bt_loss(r_c, r_r, 2, center_coef=0.01)  # + 0.01 * mean(1^2, 2^2)
    assert loss.item() == pytest.approx((softplus(-1) + softplus(2)) / 2 + 0.01 * 2.5, abs=1e-6)


def test_bt_loss_gradient_closed_form():
    torch.manual_seed(0)
    B, c = 6, 0.05
    r_c = torch.randn(B, dtype=torch.float64, requires_grad=True)
    r_r = torch.randn(B, dtype=torch.float64, requires_grad=True)
    margin = torch.rand(B, dtype=torch.float64)
    loss, _ = reward.bt_loss(r_c, r_r, B, margin, c)
    g_c, g_r = torch.autograd.grad(loss, [r_c, r_r])
    with torch.no_grad():
        s = torch.sigmoid(-(r_c - r_r - margin))  # d/dx [-log sigmoid(x)] = -sigmoid(-x)
        center = 2 * c * (r_c + r_r)
        torch.testing.assert_close(g_c, (-s + center) / B)
        torch.testing.assert_close(g_r, (s + center) / B)


def test_bt_loss_gradcheck():
    torch.manual_seed(1)
    r_c = torch.randn(5, dtype=torch.float64, requires_grad=True)
    r_r = torch.randn(5, dtype=torch.float64, requires_grad=True)
    margin = torch.rand(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: reward.bt_loss(a, b, 5, margin, 0.1)[0], (r_c, r_r))


# -----------------------------------------------------------------------------
# scoring: padding side does not matter, one concatenated forward equals two


@pytest.fixture(scope="module")
def tiny_rm():
    torch.manual_seed(0)
    tok = models.load_tokenizer("tiny")
    model = models.load_model("tiny", tok, kind="new_reward").eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a new head is near zero: make scores differ
    return tok, model


@torch.no_grad()
def test_score_independent_of_padding(tiny_rm):
    tok, model = tiny_rm
    seq = tok("sort 3 1 2 = 1 2 3")["input_ids"]
    longer = tok("sort 9 8 7 6 5 4 3 = 3 4 5 6 7 8 9")["input_ids"]
    alone = common.reward_scores(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
    tol = fp32_rtol(forward_lengths(model.config, len(longer))) * logit_size(model)  # two layouts' rounding
    for side in ("left", "right"):
        ids, mask = common.pad([seq, longer], tok.pad_token_id, side=side)
        scores = common.reward_scores(model, ids, mask)
        torch.testing.assert_close(scores[0], alone[0], atol=tol, rtol=0)
    assert abs(alone.item()) > 1e-3  # the comparison means something


@torch.no_grad()
def test_concatenated_pair_forward_equals_separate(tiny_rm):
    tok, model = tiny_rm
    prompts = ["sort 3 1 2 =", "sort 9 9 1 0 =", "sort 5 5 5 ="]
    chosen, rejected = [" 1 2 3", " 0 1 9 9", " 5 5 5"], [" 3 2", " 0 1 9", " 5 5 5 5 5 5"]
    pairs = data.encode_pairs({"prompt": prompts, "chosen": chosen, "rejected": rejected}, tok, 64, 32, "test")
    scores = reward.score_pairs(model, pairs, tok.pad_token_id, D, batch_size=2)  # (3, 2)
    tol = fp32_rtol(forward_lengths(model.config, 32)) * logit_size(model)  # two layouts' rounding
    for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected)):
        for j, resp in enumerate((c, r)):
            ids = tok(p)["input_ids"] + tok(resp)["input_ids"] + [tok.eos_token_id]
            alone = common.reward_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            torch.testing.assert_close(scores[i, j], alone[0], atol=tol, rtol=0)


def test_normalization_gives_mean_zero_std_one(tiny_rm, tmp_path):
    tok, model = tiny_rm
    torch.manual_seed(3)
    policy = models.load_model("tiny", tok)
    policy.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    cfg = replace(cli.with_defaults(reward.Config()), normalize_policy=str(tmp_path / "policy"), max_response_len=8, eval_batch_size=8)
    prompts = [f"sort {i} {i + 1} 3 =" for i in range(7)]
    gain, bias, mean, std = reward.normalization(model, tok, cfg, prompts, D)
    assert gain == pytest.approx(1 / std) and bias == pytest.approx(-mean / std) and std > 1e-3
    try:  # the same samples (seeded) scored through the stored gain and bias
        model.config.reward_gain, model.config.reward_bias = gain, bias
        _, _, mean2, std2 = reward.normalization(model, tok, cfg, prompts, D)
    finally:
        model.config.reward_gain, model.config.reward_bias = 1.0, 0.0
    # the same scores s (the same samples, the same layout) through s g + b in float32: each within
    # 2 u (|s| g + |b|), and |s - mean| <= sqrt(n) std over n samples (population std)
    n = len(prompts)
    bound = 2 * 2 * U32 * (2 * abs(mean) / std + math.sqrt(n))  # both s g + b and the float64 stats after
    assert mean2 == pytest.approx(0.0, abs=bound) and std2 == pytest.approx(1.0, abs=bound)


def test_normalization_uses_the_population_std_of_known_scores(tiny_rm, monkeypatch):
    """The test above is self-consistent: a std with Bessel's n - 1 gives a gain that the same
    formula then reads back as std 1. Scores fixed by hand pin the formula itself: the reward
    handed to GRPO is meant to have mean 0 and std 1 over the samples, i.e. the population std."""
    tok, model = tiny_rm
    scores = [1.0, 2.0, 3.0, 4.0, 10.0]  # mean 4; squared deviations 9 4 1 0 36, population variance 50 / 5 = 10
    fed = iter(scores + [999.0])  # the last chunk's padding row (common.map_rows): computed, its score dropped

    def known_scores(model, ids, attn):
        return torch.tensor([next(fed) for _ in range(len(ids))])  # the next scores, one per row

    monkeypatch.setattr(common, "reward_scores", known_scores)
    # 5 prompts in batches of 2: the sums are carried over 3 batches, the last padded to 2 rows
    cfg = replace(cli.with_defaults(reward.Config()), normalize_policy="tiny", max_response_len=4, eval_batch_size=2)
    gain, bias, mean, std = reward.normalization(model, tok, cfg, [f"sort {i} 1 2 =" for i in range(5)], D)
    assert next(fed, None) is None  # every score was used, each once
    assert mean == pytest.approx(4.0) and std == pytest.approx(math.sqrt(10.0))  # n - 1 would give sqrt(12.5)
    assert gain == pytest.approx(1 / math.sqrt(10.0)) and bias == pytest.approx(-4.0 / math.sqrt(10.0))


# -----------------------------------------------------------------------------
# the script end to end


# 15 eval pairs and 9 prompts: uneven shares over 2 ranks. lr 3e-5: Adam turns rounding differences
# in near-zero gradients into steps of up to lr, and the 1- vs 2-process weights must agree to 1e-5
TINY = ["--model", "tiny", "--n_train", "64", "--steps", "4", "--batch_size", "8", "--grad_accum", "2",
        "--warmup_steps", "0", "--lr", "3e-5", "--n_eval", "15", "--eval_every", "2", "--n_normalize", "9",
        "--max_response_len", "24", "--eval_batch_size", "4"]


def run_reward(out):
    """reward.py on TINY, in this process; the metrics it logged."""
    res = run_here(["reward.py", "--out_dir", str(out), *TINY])
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(out)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "base"
    return out, run_reward(out)


def test_reward_script_tiny(base_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, rows = base_run
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    evals = [r for r in rows if "eval/accuracy" in r]  # steps 0, 2, 4
    # trained in the right direction: the held-out margin r(chosen) - r(rejected) grows by 0.019
    # from step 0 (measured), and falls by 0.016 with chosen and rejected swapped in the loss
    assert evals[-1]["eval/margin"] > evals[0]["eval/margin"] + 0.005, [r["eval/margin"] for r in evals]
    final = evals[-1]
    assert final["eval/accuracy_over_bayes"] == pytest.approx(final["eval/accuracy"] / final["eval/bayes_accuracy"])
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)

    model = AutoModelForSequenceClassification.from_pretrained(out / "checkpoint")
    tok = AutoTokenizer.from_pretrained(out / "checkpoint")
    assert model.config.num_labels == 1
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # one row per step: the normalisation joins the last
    norm = [r for r in rows if "normalize/gain" in r][0]
    assert model.config.reward_gain == pytest.approx(norm["normalize/gain"])
    assert model.config.reward_bias == pytest.approx(norm["normalize/bias"])
    ids = torch.tensor([tok("sort 3 1 2 = 1 2 3")["input_ids"]])
    assert common.reward_scores(model, ids, torch.ones_like(ids)).shape == (1,)


# 20 steps at the default lr on 1024 pairs: eval accuracy on 200 held-out pairs (step 0 scores 0.51)
# reaches 0.585 on this code, and 0.385 with chosen and rejected swapped in the loss (measured)
LEARN = ["--model", "tiny", "--n_train", "1024", "--steps", "20", "--batch_size", "32", "--warmup_steps", "2",
         "--lr", "1e-3", "--n_eval", "200", "--eval_every", "100", "--no-normalize", "--max_response_len", "24",
         "--eval_batch_size", "100"]


def test_reward_model_learns_the_right_direction(tmp_path):
    """A reward model that learns chosen < rejected trains just as smoothly (the BT loss falls,
    every norm is finite) and passes every shape and equality test; only held-out accuracy shows
    it. 0.53 sits between the two measured accuracies, with margin on both sides."""
    reward.main(cli.parse_config(reward.Config, ["--out_dir", str(tmp_path), *LEARN]))  # in this process
    final = [r for r in read_metrics(tmp_path) if "eval/accuracy" in r][-1]
    assert final["step"] == 20
    assert final["eval/accuracy"] > 0.53 and final["eval/margin"] > 0, final


def test_batch_arithmetic_is_checked():
    cfg = replace(cli.with_defaults(reward.Config()), model="tiny", batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="divisible"):
        reward.main(cfg)


def test_reward_model_trains_on_anthropic_hh_rows(tmp_path, capsys):
    """Rows with only `chosen` and `rejected` dialogues (Anthropic HH) are split at their last
    "\\n\\nAssistant:" into prompt and responses, as in dpo.py: 40 rows, every one trained on
    (the file is also the held-out set here), with their prompts ending at the marker."""
    from helpers import write_jsonl

    turn = "\n\nAssistant:"
    rows = [{"chosen": f"\n\nHuman: what is {i} plus 1?{turn} {i + 1}",
             "rejected": f"\n\nHuman: what is {i} plus 1?{turn} no"} for i in range(40)]
    path = write_jsonl(tmp_path / "hh.jsonl", rows)
    pairs = data.load_pairs(path, "train")
    assert pairs["prompt"][3] == f"\n\nHuman: what is 3 plus 1?{turn}" and pairs["chosen"][3] == " 4"
    reward.main(reward.Config(model="tiny", dataset=path, eval_dataset=path, steps=2, batch_size=8, n_eval=40,
                              n_normalize=8, warmup_steps=0, out_dir=str(tmp_path / "rm")))
    assert "40 train pairs, 40 eval pairs" in capsys.readouterr().out
    last = read_metrics(tmp_path / "rm")[-1]
    assert last["step"] == 2 and 0.0 <= last["eval/accuracy"] <= 1.0
