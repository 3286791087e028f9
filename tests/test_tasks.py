import itertools
import math
import random
import zlib

import pytest

import tasks
from tasks import (DEDUP_PROB, EDIT_PROB, PREF_TEMPERATURE, REWARD_FNS, bayes_accuracy,
                   format_reward, is_test_prompt, parse_prompt, preference_rows, prompt_rows,
                   random_prompt, sft_rows, sort_reward, target_completion, task_rows)

GENERATORS = [sft_rows, preference_rows, prompt_rows]


def has_repeat(prompt):
    digits = parse_prompt(prompt)
    return len(set(digits)) < len(digits)


def gold_gap(row):
    return sort_reward(row["prompt"], row["chosen"]) - sort_reward(row["prompt"], row["rejected"])


# -----------------------------------------------------------------------------
# prompts and rewards

def test_parse_and_target_hand_cases():
    assert parse_prompt("sort 7 3 9 1 =") == [7, 3, 9, 1]
    assert target_completion("sort 7 3 9 1 =") == " 1 3 7 9"
    assert target_completion("sort 3 1 3 =") == " 1 3 3"
    assert target_completion("sort 0 0 0 0 0 0 0 0 =") == " 0 0 0 0 0 0 0 0"


@pytest.mark.parametrize("bad", [
    "", "sort 7 3 =", "sort 1 2 3 4 5 6 7 8 9 =", "sort 12 3 4 =", "sort 1 2 3",
    "sorted 1 2 3 =", "sort a b c =", "sort 1  2 3 =", " sort 1 2 3 =", "sort 1 2 3 = 1 2 3",
])
def test_malformed_prompt_raises(bad):
    with pytest.raises(ValueError, match="not a sort prompt"):
        parse_prompt(bad)
    with pytest.raises(ValueError):
        sort_reward(bad, " 1 2 3")


@pytest.mark.parametrize("prompt, completion, expected", [
    ("sort 7 3 9 1 =", " 1 3 7 9", 1.0),      # exact
    ("sort 3 1 3 =", " 1 3 3", 1.0),          # exact with a repeat
    ("sort 3 1 3 =", " 1 3", 2 / 3),          # the demonstrator's dedup flaw
    ("sort 7 3 9 1 =", " 9 7 3 1", 0.0),      # reversed: no position right
    ("sort 7 3 9 1 =", " 1 3 9 7", 2 / 4),    # last two swapped
    ("sort 7 3 9 1 =", " 1 3 7 9 9", 4 / 5),  # one extra item
    ("sort 7 3 9 1 =", " 1 3", 2 / 4),        # too short
    ("sort 7 3 9 1 =", "", 0.0),              # empty
    ("sort 7 3 9 1 =", "   ", 0.0),           # whitespace only
    ("sort 7 3 9 1 =", " a b c d", 0.0),      # garbage tokens
    ("sort 7 3 9 1 =", " 1 x 7 9", 3 / 4),    # one garbage token
    ("sort 7 3 9 1 =", " 1,3,7,9", 0.0),      # one big item
    ("sort 7 3 9 1 =", "1 3 7 9", 1.0),       # reward ignores exact spacing (format_reward does not)
])
def test_sort_reward_hand_cases(prompt, completion, expected):
    assert sort_reward(prompt, completion) == pytest.approx(expected, abs=1e-12)


def test_sort_reward_bounded():
    rng = random.Random(0)
    for _ in range(2000):
        prompt = random_prompt(rng)
        tokens = [rng.choice("0123456789x") for _ in range(rng.randint(0, 10))]
        r = sort_reward(prompt, "".join(" " + t for t in tokens))
        assert 0.0 <= r <= 1.0
        assert sort_reward(prompt, target_completion(prompt)) == 1.0


@pytest.mark.parametrize("completion, expected", [
    (" 1 3 3", 1.0), (" 3 3 1", 1.0), (" 9 9 9", 1.0),   # right shape, order irrelevant
    (" 1 3", 0.0), (" 1 3 3 3", 0.0),                       # wrong length
    (" 1 33", 0.0), (" 1 3 x", 0.0), ("", 0.0),             # not single digits
    ("1 3 3", 0.0), (" 1 3 3 ", 0.0), (" 1  3 3", 0.0),     # wrong spacing
])
def test_format_reward_hand_cases(completion, expected):
    assert format_reward("sort 3 1 3 =", completion) == expected


def test_random_prompt_covers_lengths():
    rng = random.Random(0)
    lengths = {len(parse_prompt(random_prompt(rng))) for _ in range(500)}
    assert lengths == set(range(3, 9))


# -----------------------------------------------------------------------------
# splits and determinism

@pytest.mark.parametrize("gen", GENERATORS)
def test_splits_disjoint(gen):
    train = gen(2000, seed=0, split="train")
    test = gen(300, seed=0, split="test")
    assert not any(is_test_prompt(r["prompt"]) for r in train)
    assert all(is_test_prompt(r["prompt"]) for r in test)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_test_split_is_about_ten_percent():
    rng = random.Random(1)
    for prompt in ["sort 7 3 9 1 =", "sort 3 1 3 =", "sort 0 0 0 =", "sort 1 2 3 4 5 6 7 8 ="]:
        assert is_test_prompt(prompt) == (zlib.crc32(prompt.encode()) % 10 == 0)  # the split is part of the spec
    share = sum(is_test_prompt(random_prompt(rng)) for _ in range(20000)) / 20000
    assert 0.08 < share < 0.12


@pytest.mark.parametrize("gen", GENERATORS)
def test_deterministic_by_seed(gen):
    assert gen(200, seed=5) == gen(200, seed=5)
    assert gen(200, seed=5) != gen(200, seed=6)
    assert gen(200, seed=5, split="test") == gen(200, seed=5, split="test")


def test_bad_split_raises():
    for gen in GENERATORS:
        with pytest.raises(ValueError, match="split"):
            gen(3, split="valid")


def test_task_rows_dispatch():
    assert task_rows("sort", "sft", 50, seed=2) == sft_rows(50, seed=2)
    assert task_rows("sort", "preference", 50, seed=2, split="test") == preference_rows(50, seed=2, split="test")
    assert task_rows("sort", "prompt", 50, seed=2) == prompt_rows(50, seed=2)
    with pytest.raises(ValueError, match="reverse"):
        task_rows("reverse", "sft", 5)
    with pytest.raises(ValueError, match="dpo"):
        task_rows("sort", "dpo", 5)


# -----------------------------------------------------------------------------
# SFT demonstrations and the demonstrator's flaw

def test_sft_flaw_rate():
    rows = sft_rows(4000, seed=0)
    rep = [r for r in rows if has_repeat(r["prompt"])]
    norep = [r for r in rows if not has_repeat(r["prompt"])]
    assert len(rep) > 1000 and len(norep) > 500
    # edits never change the length, so a shortened answer is exactly a dedup decision
    short = sum(len(r["completion"].split()) < len(parse_prompt(r["prompt"])) for r in rep) / len(rep)
    assert abs(short - DEDUP_PROB) < 0.04
    dedup_answer = lambda p: "".join(f" {d}" for d in sorted(set(parse_prompt(p))))
    exact_dedup = sum(r["completion"] == dedup_answer(r["prompt"]) for r in rep) / len(rep)
    assert DEDUP_PROB * (1 - EDIT_PROB) - 0.04 < exact_dedup < DEDUP_PROB + 0.04
    # without repeats the demonstrator is right except for its rare random slips
    exact = sum(r["completion"] == target_completion(r["prompt"]) for r in norep) / len(norep)
    assert 1 - EDIT_PROB - 0.04 < exact < 1.0


def test_sft_completions_are_well_formed():
    for r in sft_rows(500, seed=1):
        assert format_reward(r["prompt"], r["completion"]) == 1.0 or has_repeat(r["prompt"])
        assert r["completion"].startswith(" ")


# -----------------------------------------------------------------------------
# preference pairs and label noise

def test_preference_rows_noise_model():
    rows = preference_rows(4000, seed=0)
    gaps = [gold_gap(r) for r in rows]
    assert all(g != 0 for g in gaps)
    assert all(r["chosen"] != r["rejected"] for r in rows)
    flip = sum(g < 0 for g in gaps) / len(gaps)
    expected = sum(1 / (1 + math.exp(abs(g) / PREF_TEMPERATURE)) for g in gaps) / len(gaps)
    assert 0.2 < expected < 0.3
    assert abs(flip - expected) < 0.03
    # the noise must depend on the gap: big gaps flip less often than small ones
    small = [g for g in gaps if abs(g) <= 0.25]
    big = [g for g in gaps if abs(g) >= 0.5]
    assert sum(g < 0 for g in big) / len(big) < sum(g < 0 for g in small) / len(small) - 0.1


def test_preference_rows_contain_exact_answers_and_the_flaw():
    rows = preference_rows(2000, seed=1)
    with_exact = sum(target_completion(r["prompt"]) in (r["chosen"], r["rejected"]) for r in rows)
    assert with_exact / len(rows) >= 0.25
    deduped = sum(
        any(c.split() == list(dict.fromkeys(target_completion(r["prompt"]).split()))
            for c in (r["chosen"], r["rejected"]))
        for r in rows if has_repeat(r["prompt"]))
    assert deduped > 100


@pytest.mark.parametrize("seed, temperature", [(0, PREF_TEMPERATURE), (3, PREF_TEMPERATURE), (7, 0.1)])
def test_bayes_accuracy_matches_enumeration(seed, temperature):
    rows = preference_rows(6, seed=seed)
    rewards = [(sort_reward(r["prompt"], r["chosen"]), sort_reward(r["prompt"], r["rejected"])) for r in rows]
    best = 0.0
    for rule in itertools.product([0, 1], repeat=len(rows)):  # 1 = call "rejected" the better one
        acc = 0.0
        for pick, (rc, rr) in zip(rule, rewards):
            picked, other = (rr, rc) if pick else (rc, rr)
            acc += 1 / (1 + math.exp(-(picked - other) / temperature))  # P(label agrees with the rule)
        best = max(best, acc / len(rows))
    assert abs(best - bayes_accuracy(rows, temperature)) < 1e-12


def test_bayes_accuracy_range():
    acc = bayes_accuracy(preference_rows(500, seed=0, split="test"))
    assert 0.7 < acc < 0.8  # about 1 - flip rate


# -----------------------------------------------------------------------------
# GRPO prompts

def test_prompt_rows():
    rows = prompt_rows(300, seed=0)
    assert all(r["reward_fn"] in REWARD_FNS for r in rows)
    assert all(set(r) == {"prompt", "reward_fn"} for r in rows)
    for r in rows:
        fn = REWARD_FNS[r["reward_fn"]]
        assert fn(r["prompt"], target_completion(r["prompt"])) == 1.0
    assert {"sort", "sort_format", "digits"} <= set(REWARD_FNS)


def test_digits_reward_hand_cases():
    assert REWARD_FNS["digits"]("any prompt", " 1 2") == 0.5
    assert REWARD_FNS["digits"]("any prompt", "123") == 1.0
    assert REWARD_FNS["digits"]("any prompt", "") == 0.0
    assert tasks.REWARD_FNS["sort_format"] is format_reward


def test_rule_rows_are_checked_naming_the_row():
    """grpo.py checks every row's rule when it loads the data: an unknown rule or a prompt the rule
    cannot score is named by source and row, not found at the step that draws it."""
    tasks.check_rule_rows(["sort", "digits"], ["sort 3 1 2 =", "sort 9 9 1 ="], "p.jsonl")
    with pytest.raises(ValueError, match=r"p.jsonl row 2: reward_fn 'srot' is not one of"):
        tasks.check_rule_rows(["sort", "srot"], ["sort 3 1 2 =", "sort 3 1 2 ="], "p.jsonl")
    with pytest.raises(ValueError, match=r"p.jsonl row 3: reward_fn 'sort' cannot score this prompt"):
        tasks.check_rule_rows(["sort"] * 3, ["sort 3 1 2 =", "sort 4 1 2 =", "write a poem"], "p.jsonl")


def test_rules_read_a_conversational_prompt_as_its_last_user_message():
    """TRL passes a reward function the row's own prompt: a string, or the list of messages."""
    conv = [{"role": "system", "content": "Sort the digits."}, {"role": "user", "content": "sort 1 2 3 ="},
            {"role": "assistant", "content": " 1 2 3"}, {"role": "user", "content": "sort 4 8 5 ="}]
    assert sort_reward(conv, " 4 5 8") == 1.0 and sort_reward(conv, " 4 8 5") == 1 / 3
    assert format_reward(conv, " 8 5 4") == 1.0 and format_reward(conv, " 4 5") == 0.0
    tasks.check_rule_rows(["sort", "sort_format"], [conv, conv[:2]], "p.jsonl")
    no_user = [{"role": "system", "content": "sort 4 8 5 ="}]
    with pytest.raises(ValueError, match=r"p.jsonl row 2: reward_fn 'sort_format' cannot score this prompt "
                                         r"\(a conversation without a \"user\" message\)"):
        tasks.check_rule_rows(["sort", "sort_format"], [conv, no_user], "p.jsonl")


@pytest.mark.parametrize("completion, answer, reward", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "Natalia sold 48/2 = 24 clips.\n#### 7", 1.0),
    ("The answer is \\boxed{1,234}.", "#### 1234", 1.0),
    ("Costs $5.50 in all", "5.5", 1.0),
    ("First 12, then 19", "19", 1.0),  # the last number is the answer
    ("\\boxed{18} though 19 is close", "19", 0.0),  # \boxed wins over a later number
    ("#### 20\nor maybe 19", "19", 0.0),  # so does ####
    ("It is 19.", "-19", 0.0),
    ("no number here", "19", 0.0),
    ("19", "", 0.0),  # no reference: never a reward
])
def test_math_reward_reads_the_final_answer_and_compares_numbers(completion, answer, reward):
    assert tasks.math_reward("q", completion, answer) == reward


@pytest.mark.parametrize("completion, reward", [
    ("<think>12 + 7 is 19</think><answer>19</answer>", 1.0),
    ("  <think>\nstep 1\nstep 2\n</think>\n<answer>19</answer>\n", 1.0),
    ("<think>x</think>", 0.0),
    ("<answer>19</answer>", 0.0),
    ("<answer>19</answer><think>x</think>", 0.0),
    ("<think>x</think><answer>19</answer> and more", 0.0),
    ("so <think>x</think><answer>19</answer>", 0.0),
])
def test_think_format_reward_hand_cases(completion, reward):
    assert tasks.think_format_reward("q", completion) == reward


def test_math_rows_need_an_answer_with_a_number():
    tasks.check_rule_rows(["math", "think_format"], ["q1", "q2"], "m.jsonl", ["#### 4", None])
    with pytest.raises(ValueError, match=r"m.jsonl row 1: reward_fn 'math' has no `answer` column"):
        tasks.check_rule_rows(["math"], ["q1"], "m.jsonl")
    with pytest.raises(ValueError, match=r"m.jsonl row 2: reward_fn 'math' has no number in its answer 'none'"):
        tasks.check_rule_rows(["math", "math"], ["q1", "q2"], "m.jsonl", ["#### 4", "none"])


def test_a_numeric_answer_is_a_number():
    """`"answer": 1` in a JSON file is read as the number it is; a bool is not a number."""
    tasks.check_rule_rows(["math"] * 3, ["q1", "q2", "q3"], "m.jsonl", [1, 2.5, 0])
    assert tasks.math_reward("q", "It is 1.", 1) == 1.0 and tasks.math_reward("q", "It is 2.", 1) == 0.0
    assert tasks.math_reward("q", "so 2.50", 2.5) == 1.0 and tasks.math_reward("q", "0", 0) == 1.0
    for bad in (True, float("nan"), [1]):
        with pytest.raises(ValueError, match=r"m.jsonl row 2: reward_fn 'math' has no number in its answer"):
            tasks.check_rule_rows(["math", "math"], ["q1", "q2"], "m.jsonl", [1, bad])
        assert tasks.math_reward("q", "1", bad) == 0.0


# -----------------------------------------------------------------------------
# arith: the chat task for instruct models


def solve(question):
    """The answer of an arith question, worked out from its words (not by tasks.py)."""
    import re

    m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    m = re.fullmatch(r"(\w+) has (\d+) (\w+) and (gets|gives) (\d+) (?:more|away)\. How many \3 does \1 have "
                     r"(now|left)\?", question)
    assert m, question
    a, b = int(m.group(2)), int(m.group(5))
    assert (m.group(4), m.group(6)) in (("gets", "now"), ("gives", "left")), question
    return a + b if m.group(4) == "gets" else a - b


def test_arith_rows_are_chat_prompts_with_their_right_answer():
    rows = tasks.arith_rows(500, seed=0)
    kinds = set()
    for row in rows:
        (msg,) = row["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith(tasks.ARITH_INSTRUCTION)
        question = msg["content"][:-len(tasks.ARITH_INSTRUCTION)]
        answer = solve(question)
        assert row["answer"] == str(answer) and answer >= 0 and row["reward_fn"] == "math"
        assert REWARD_FNS["math"](None, f"{question[8:-1] if question.startswith('What') else 'So'} = {answer}.",
                                  row["answer"]) == 1.0
        assert REWARD_FNS["math"](None, f"The answer is {answer + 1}", row["answer"]) == 0.0
        kinds.add(question.split()[3] if question.startswith("What is") else question.split()[5])
    assert kinds == {"+", "-", "*", "gets", "gives"}


def test_arith_splits_are_disjoint_and_fixed_by_the_seed():
    train = {r["prompt"][0]["content"] for r in tasks.arith_rows(2000, seed=0)}
    test = [r["prompt"][0]["content"] for r in tasks.arith_rows(300, seed=0, split="test")]
    assert not train & set(test) and len(set(test)) > 100
    assert all(is_test_prompt(q[:-len(tasks.ARITH_INSTRUCTION)]) for q in test)
    assert tasks.arith_rows(50, seed=3) == tasks.arith_rows(50, seed=3) != tasks.arith_rows(50, seed=4)
    assert task_rows("arith", "prompt", 20, seed=1, split="test") == tasks.arith_rows(20, seed=1, split="test")
    with pytest.raises(ValueError, match="unknown kind 'preference' for task 'arith'"):
        task_rows("arith", "preference", 5)


@pytest.mark.parametrize("completion, reward", [
    ("19", 1.0), ("12 + 7 = 19.", 1.0), ("-3", 1.0), ("It is 1,234. ", 1.0), ("$5", 1.0),
    ("so he has 11 + 10 =", 0.0), ("The answer is 12 apples.", 0.0), ("", 0.0), ("To add 81 and 9", 1.0),
    ("19 is the answer", 0.0),
])
def test_number_format_reward_hand_cases(completion, reward):
    assert REWARD_FNS["number_format"](None, completion) == reward


def test_calculator_rows_demonstrate_the_right_call_and_split_by_question():
    """Each demonstration's call computes the row's answer with the calculator and its answer is
    the final number; about tool_share of them call; train and test questions never meet."""
    import tools

    rows = tasks.calculator_rows(400, tool_share=0.5)
    calls = 0
    for r in rows:
        demo = r["completion"][0]["content"]
        assert tasks.math_reward(None, demo, r["answer"]) == 1.0
        if demo.startswith(tools.CALL_OPEN):
            calls += 1
            expr = demo[len(tools.CALL_OPEN):demo.index(tools.CALL_CLOSE)]
            assert tools.calculator(expr) == r["answer"]
    assert 160 < calls < 240
    assert all(tools.CALL_OPEN in r["completion"][0]["content"] for r in tasks.calculator_rows(20))
    train = {r["prompt"][-1]["content"] for r in rows}
    assert not train & {r["prompt"][-1]["content"] for r in tasks.calculator_rows(200, split="test")}
    assert tasks.calculator_rows(3, system=False)[0]["prompt"][0]["role"] == "user"
