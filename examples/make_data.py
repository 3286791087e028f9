"""Writes the example data sets of the README's recipe "your data on SmolLM2", in TRL's formats:
sft.jsonl (conversational `messages`, some of them two exchanges long), pairs.jsonl (a
conversational prompt with a chosen and a rejected answer) and prompts.jsonl (a conversational
prompt and its `solution`, the column TRL's math data sets have). 48 rows each, from one seed:
`python examples/make_data.py` writes the same bytes again."""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import tasks  # noqa: E402


def answer(question, value):
    """An assistant's answer that shows its step and ends in the number."""
    return f"{question.removeprefix('What is ').rstrip('?')} = {value}. The answer is {value}." \
        if question.startswith("What is") else f"The answer is {value}."


def write(name, rows):
    with open(os.path.join(HERE, name), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main(n=48, seed=0):
    rng = random.Random(seed)
    sft, pairs, prompts = [], [], []
    for i in range(n):
        q, a = tasks.arith_problem(rng)
        messages = [{"role": "user", "content": q + tasks.ARITH_INSTRUCTION},
                    {"role": "assistant", "content": answer(q, a)}]
        if i % 3 == 0:  # a follow-up exchange: every assistant turn is trained on
            q2, a2 = tasks.arith_problem(rng)
            messages += [{"role": "user", "content": "Next one: " + q2},
                         {"role": "assistant", "content": answer(q2, a2)}]
        sft.append({"messages": messages})
        q, a = tasks.arith_problem(rng)
        wrong = a + rng.choice([-2, -1, 1, 2, 10])
        pairs.append({"prompt": [{"role": "user", "content": q + tasks.ARITH_INSTRUCTION}],
                      "chosen": [{"role": "assistant", "content": answer(q, a)}],
                      "rejected": [{"role": "assistant", "content": answer(q, wrong)}]})
        q, a = tasks.arith_problem(rng)
        prompts.append({"prompt": [{"role": "user", "content": q + tasks.ARITH_INSTRUCTION}], "solution": str(a)})
    write("sft.jsonl", sft)
    write("pairs.jsonl", pairs)
    write("prompts.jsonl", prompts)


if __name__ == "__main__":
    main()
