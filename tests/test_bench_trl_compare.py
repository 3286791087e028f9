"""bench/trl_compare.py's bookkeeping, without TRL: each ratio is the median of the repeats' own
ratios (runs side by side), not a ratio of medians; a packed-vs-padded pair differs in
--padding_free alone, a shared-vs-not pair in --shared_prompt alone, and our script parses the
flags the bench passes as the settings they name;
--variants runs a subset with the pairs among it and refuses a name it does not know."""
import pytest

import dpo
import grpo
from bench import trl_compare as tc
from plumbing import cli


def _runs(tokens_per_s, rss):
    return [{"tokens_per_s": t, "peak_rss_bytes": m, "peak_gpu_bytes": None} for t, m in zip(tokens_per_s, rss)]


def test_a_ratio_is_the_median_of_the_repeats_ratios():
    runs = {"a": _runs([30, 20, 12], [4, 6, 9]), "b": _runs([10, 20, 3], [8, 3, 9])}
    r = tc.pair_ratios(runs, "a", "b", cuda=False)
    assert r["tokens_per_s_ratio_repeats"] == [3, 1, 4] and r["tokens_per_s_ratio"] == 3  # medians' ratio: 20/10
    assert r["peak_memory_ratio_repeats"] == [0.5, 2, 1] and r["peak_memory_ratio"] == 1
    with pytest.raises(ValueError):  # a repeat missing on one side is an error, not a shorter list
        tc.pair_ratios({"a": runs["a"], "b": runs["b"][:2]}, "a", "b", cuda=False)


@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_pairs_of_ours_differ_in_one_setting(algo):
    """ours packed vs padded differ in padding_free alone, sharing vs not in shared_prompt alone; the
    first of each pair has it on."""
    pairs = [(f, s) for f, s, _, _ in tc.PAIRS[algo] if tc.VARIANTS[algo][s][0] == "ours"]
    differ = set()
    for first, second in pairs:
        (_, a), (_, b) = tc.VARIANTS[algo][first], tc.VARIANTS[algo][second]
        (key,) = [k for k in a if a[k] != b[k]]
        assert a[key] is True and b[key] is False, (first, second)
        differ.add(key)
    assert differ == {"padding_free", "shared_prompt"}  # every algorithm has both pairs


@pytest.mark.parametrize("algo, script", [("grpo", grpo), ("dpo", dpo)])
def test_our_script_parses_the_settings_the_variant_names(algo, script, tmp_path):
    a = type("A", (), dict(prompt_len=40, response_len=8, lr=1e-4, batch_size=2, group_size=2))
    for name, (side, settings) in tc.VARIANTS[algo].items():
        if side != "ours":
            continue
        argv = tc.ours_argv(algo, settings, a, "m", "rows.jsonl", str(tmp_path), 3)
        assert argv[0] == f"{algo}.py"
        cfg = cli.parse_config(script.Config, argv[1:])
        assert cfg.padding_free is settings["padding_free"], name  # explicit either way
        assert cfg.shared_prompt is settings["shared_prompt"], name


def test_variants_picks_a_subset_with_the_pairs_among_it():
    names, pairs = tc.pick_variants("dpo", ["ours-live", "ours-live-pf", "trl-live", "ours"])  # "ours": GRPO's
    assert names == ["ours-live", "ours-live-pf", "trl-live"]
    assert [(f, s) for f, s, _, _ in pairs] == [("ours-live", "trl-live"), ("ours-live-pf", "trl-live"),
                                             ("ours-live-pf", "ours-live")]
    order = tc.order_of(names, pairs)
    assert sorted(order) == sorted(names) and order.index("trl-live") == order.index("ours-live") + 1
    assert tc.pick_variants("grpo")[0] == list(tc.VARIANTS["grpo"])  # none named: all
    with pytest.raises(ValueError, match="--variants: unknown ours-packed"):
        tc.pick_variants("grpo", ["ours", "ours-packed"])
    with pytest.raises(ValueError, match="--variants: none of grpo's"):
        tc.pick_variants("grpo", ["ours-live"])
