"""bench/lengths.py, the benchmarks' length distributions (bench/steps.py and bench/trl_compare.py
--lengths): the rows bench/steps.py writes have each row's own token counts, TL;DR's shape stays in
its ranges with a long tail and is the same for a seed, arith's pairs are the recorded ones, the
padding share is counted on a hand case, and the FLOPs of a list of equal rows are fixed-length's."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT

import tasks

sys.path.insert(0, os.path.join(ROOT, "bench"))
import lengths  # noqa: E402
import steps  # noqa: E402


def test_rows_have_each_rows_own_token_lengths(tmp_path):
    tok = tasks.char_tokenizer()
    want = lengths.row_lengths("tldr", 16, seed=3)
    path = steps.make_data(str(tmp_path / "rows.jsonl"), 16, 0, 0, alphabet=steps.exact_alphabet(tok), lengths=want)
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert [(n(r["prompt"]), n(r["chosen"]) + 1, n(r["rejected"]) + 1) for r in rows] == [(p, r, r) for p, r in want]


def test_tldr_is_long_tailed_within_its_ranges_and_fixed_by_the_seed():
    rows = lengths.row_lengths("tldr", 2000, seed=0)
    P, R = [p for p, _ in rows], [r for _, r in rows]
    assert 100 <= min(P) and max(P) <= 500 and 10 <= min(R) and max(R) <= 60
    assert sorted(P)[1000] < sum(P) / len(P) and sorted(R)[1000] < sum(R) / len(R)  # median < mean: a long tail
    assert rows[:50] == lengths.row_lengths("tldr", 50, seed=0) != lengths.row_lengths("tldr", 50, seed=1)
    assert lengths.padding_share(rows, 8) > 0.3  # the case for packing: >= 30% of a padded batch


def test_arith_draws_the_recorded_pairs():
    with open(lengths.ARITH) as f:
        recorded = {tuple(p) for p in json.load(f)["pairs"]}
    rows = lengths.row_lengths("arith", 100, seed=0)
    assert set(rows) <= recorded and len(set(rows)) > 10


def test_padding_share_on_a_hand_case():
    # one batch of 2: prompts padded to 4, responses to 2: 2 x 6 = 12 slots, 3 + 2 + 4 + 1 = 10 real tokens
    assert lengths.padding_share([(3, 2), (4, 1)], 2) == pytest.approx(1 - 10 / 12)
    assert lengths.padding_share(lengths.row_lengths("fixed", 8, 5, 7), 4) == 0


@pytest.mark.parametrize("algo", ["sft", "reward", "dpo", "grpo"])
def test_equal_rows_cost_what_fixed_lengths_cost(algo):
    args = SimpleNamespace(prompt_len=40, response_len=24, batch_size=4, group_size=2)
    cfg = {"n_layer": 2, "n_embd": 16, "body": 5000}
    fixed = steps.step_work(algo, args, cfg, 100)
    assert steps.step_work(algo, args, cfg, 100, lengths=[(40, 24)] * 3) == pytest.approx(fixed)
    if algo != "grpo":  # rows of the same mean length, unequal: attention grows with the square of each row's
        assert steps.step_work(algo, args, cfg, 100, lengths=[(30, 24), (50, 24)])[1] > fixed[1]
