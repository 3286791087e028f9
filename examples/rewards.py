"""Reward functions of the README's recipe, written as for TRL's GRPOTrainer: each gets the
completions (a list of assistant messages for conversational prompts, of strings otherwise) and
every other column of the rows as a keyword list, and returns one float per completion (None
where it does not apply). `grpo.py --reward_fn examples/rewards.py:accuracy,examples/rewards.py:brevity`."""
import re


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy(completions, solution, **kwargs):
    """1 where the completion's last number is the row's `solution`, else 0."""
    numbers = [re.findall(r"-?\d+", _text(c)) for c in completions]
    return [float(bool(n) and n[-1] == s.strip()) for n, s in zip(numbers, solution)]


def brevity(completions, **kwargs):
    """A small push towards short answers: 0 up to 20 words, down to -1 at 120 words."""
    return [max(min((20 - len(_text(c).split())) / 100, 0.0), -1.0) for c in completions]
