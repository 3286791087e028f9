"""
The embedded toy task: sort a short list of digits.

    prompt:     "sort 7 3 9 1 ="       (3 to 8 digits 0-9, repeats allowed)
    completion: " 1 3 7 9"             (EOS is appended as a token by the scripts)

The task is small enough to train on a CPU yet has a gold reward we can compute
exactly, so every stage of the RLHF pipeline can be checked against the truth.

The demonstrator (SFT data) has a systematic flaw: when a digit repeats, it often
writes it only once ("sort 3 1 3 =" -> " 1 3"). Imitation copies this flaw
faithfully; only a reward signal (a reward model trained on preferences, or the
rule-based reward in GRPO) can push the policy past its demonstrator.

Preference labels are noisy in a known way: a simulated annotator prefers
completion 1 over 2 with the Bradley-Terry probability
sigmoid((r1 - r2) / PREF_TEMPERATURE) of their gold rewards. Because the noise
model is known, bayes_accuracy() gives the best pairwise accuracy any reward
model can reach, a ceiling to compare a trained one against.

Train and test are split by a stable hash of the prompt, so they never overlap.
Pure stdlib on purpose at import: data generation needs no torch; the tiny model at the end
imports transformers when it is built.
"""

import math
import random
import re
import zlib

import tools

DEDUP_PROB = 0.6  # demonstrator writes each repeated digit once, when the prompt has repeats
EDIT_PROB = 0.1  # demonstrator additionally makes one random slip (replace a digit or swap two)
MAX_EDITS = 3  # preference completions are the right answer plus 0..MAX_EDITS random edits
DEDUP_WEIGHT = 3  # the flaw is 3x likelier than any other edit, so preferences punish it often
# Annotator noise: 0.39 flips 25.2% of labels (lower reward chosen), measured on 20k train pairs.
PREF_TEMPERATURE = 0.39
SPLITS = ("train", "test")
SPLIT_SEED_OFFSET = {"train": 0, "test": 1_000_003}  # train and test streams differ for one seed

_PROMPT_RE = re.compile(r"sort((?: \d){3,8}) =")

# -----------------------------------------------------------------------------
# prompts, answers, rewards

def prompt_text(prompt):
    """A row's prompt as the rules read it: the text, or of a conversation (a list of messages, as
    TRL passes it) the content of its last "user" message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    if not users:
        raise ValueError('a conversation without a "user" message')
    return users[-1]

def parse_prompt(prompt):
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a sort prompt: {prompt!r}")
    return [int(d) for d in m.group(1).split()]

def _completion(items):
    return "".join(" " + str(x) for x in items)

def target_completion(prompt):
    return _completion(sorted(parse_prompt(prompt)))

def sort_reward(prompt, completion, answer=None):
    """Share of positions holding the right digit; the max() punishes both missing and extra items."""
    target = [str(d) for d in sorted(parse_prompt(prompt_text(prompt)))]
    items = completion.split()
    if not items:
        return 0.0
    matches = sum(a == b for a, b in zip(items, target))
    return matches / max(len(items), len(target))

def format_reward(prompt, completion, answer=None):
    """1.0 for the right shape (" d d d", one digit per prompt digit), whatever the order."""
    n = len(parse_prompt(prompt_text(prompt)))
    return float(re.fullmatch(r"(?: \d)*", completion) is not None and len(completion) == 2 * n)

def digits_reward(prompt, completion, answer=None):
    """Share of the completion's characters that are digits: a rule reward for any prompt text
    (the benchmarks' synthetic rows use it)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


def parse_number(text):
    """A number written the ways answers write it ("1,234", "$5", "3.50", "-2", "7."), as a
    float; None when there is none."""
    m = re.search(_NUMBER, text.replace("$", ""))
    return None if m is None else float(m.group(0).replace(",", ""))


def final_answer(text):
    """The final answer of a worked solution, as GSM8K and R1-style prompts ask for it: the
    content of the last \\boxed{...}, else what follows the last "####", else the last number."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return parse_number(boxed[-1])
    if "####" in text:
        return parse_number(text.rsplit("####", 1)[1])
    numbers = re.findall(_NUMBER, text.replace("$", ""))
    return float(numbers[-1].replace(",", "")) if numbers else None


def reference_number(answer):
    """The number a row's reference `answer` holds: a JSON number (not a bool) as it is, the
    final answer of a text; None when there is none."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer) if math.isfinite(answer) else None
    return final_answer(answer) if isinstance(answer, str) else None


def math_reward(prompt, completion, answer=None):
    """1.0 when the completion's final answer equals the row's reference `answer` numerically
    (GSM8K's "... #### 72", a bare number, or a JSON number), else 0.0: the correctness reward of
    verifiable-reward RL (DeepSeek-R1, arXiv:2501.12948; TRL's accuracy_reward)."""
    want, got = reference_number(answer), final_answer(completion)
    return float(want is not None and got is not None and abs(want - got) <= 1e-6 * max(1.0, abs(want)))


_THINK = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def think_format_reward(prompt, completion, answer=None):
    """1.0 for the R1 layout `<think>...</think><answer>...</answer>` (whitespace around the tags
    allowed, nothing else outside them), else 0.0 (DeepSeek-R1's format reward)."""
    return float(_THINK.fullmatch(completion) is not None)

_ENDS_WITH_NUMBER = re.compile(rf"[\s\S]*?(?:{_NUMBER})\s*\.?\s*")


def number_format_reward(prompt, completion, answer=None):
    """1.0 when the completion ends with a number (a full stop after it allowed): its answer is
    where a reader, and final_answer(), look for it; a reply cut off mid-sentence scores 0."""
    return float(_ENDS_WITH_NUMBER.fullmatch(completion.replace("$", "")) is not None)

# Rule rewards: fn(prompt, completion, answer=None) -> float, `answer` being the row's reference
# (its `answer` column, else `solution`, or --answer_column's) for the rules that need one.
REWARD_FNS = {"sort": sort_reward, "sort_format": format_reward, "digits": digits_reward, "math": math_reward,
              "number_format": number_format_reward, "think_format": think_format_reward}
NEEDS_SORT_PROMPT = ("sort", "sort_format")
NEEDS_ANSWER = ("math",)

def check_rule_rows(reward_fns, prompts, source, answers=None, flag=None):
    """Every row's rule exists and can score its row, checked when the data is loaded: a bad row
    found at step 2 would have cost a run. The sort rules parse the prompt (of a conversation, its
    last user message); `math` needs an answer (the answer column) that is or holds a number. flag:
    the --reward_fn that gave every row its rule, named instead of the row's `reward_fn`."""
    for i, (fn, prompt) in enumerate(zip(reward_fns, prompts)):
        who = flag or f"reward_fn {fn!r}"
        if fn not in REWARD_FNS:
            raise ValueError(f"{source} row {i + 1}: reward_fn {fn!r} is not one of {sorted(REWARD_FNS)}")
        if fn in NEEDS_SORT_PROMPT:
            try:
                parse_prompt(prompt_text(prompt))
            except ValueError as e:
                raise ValueError(f"{source} row {i + 1}: {who} cannot score this prompt ({e})") from None
        if fn in NEEDS_ANSWER:
            answer = answers[i] if answers is not None else None
            if reference_number(answer) is None:
                what = "has no `answer` column" if answers is None else f"has no number in its answer {answer!r}"
                raise ValueError(f"{source} row {i + 1}: {who} {what}")

def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))

# -----------------------------------------------------------------------------
# splits and prompt sampling

def is_test_prompt(prompt):
    # crc32 rather than hash(): Python's str hash changes with every process
    return zlib.crc32(prompt.encode()) % 10 == 0

def random_prompt(rng):
    digits = [rng.randrange(10) for _ in range(rng.randint(3, 8))]
    return "sort " + " ".join(map(str, digits)) + " ="

def _rng(seed, split):
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(seed + SPLIT_SEED_OFFSET[split])

def _in_split(rng, split, draw=random_prompt, text=lambda x: x):
    """draw(rng) until text(draw) falls in `split`: rejection sampling keeps the distribution
    uniform within each split."""
    while True:
        x = draw(rng)
        if is_test_prompt(text(x)) == (split == "test"):
            return x

# -----------------------------------------------------------------------------
# edits: the ways a completion can go wrong

def _has_repeat(items):
    return len(set(items)) < len(items)

def _dedup(items, rng):
    return list(dict.fromkeys(items))  # keeps the first occurrence of each digit, in order

def _drop(items, rng):
    i = rng.randrange(len(items))
    return items[:i] + items[i + 1:]

def _replace(items, rng):
    i = rng.randrange(len(items))
    return items[:i] + [rng.randrange(10)] + items[i + 1:]

def _swap(items, rng):
    i = rng.randrange(len(items) - 1)
    return items[:i] + [items[i + 1], items[i]] + items[i + 2:]

def _insert(items, rng):
    i = rng.randrange(len(items) + 1)
    return items[:i] + [rng.randrange(10)] + items[i:]

def _random_edit(items, rng, edits):
    # only edits that make sense for this list; dropping the last item would leave nothing
    allowed = [e for e in edits
               if not (e is _dedup and not _has_repeat(items))
               and not (e is _drop and len(items) < 2)
               and not (e is _swap and len(items) < 2)]
    weights = [DEDUP_WEIGHT if e is _dedup else 1 for e in allowed]
    edit = rng.choices(allowed, weights)[0]
    return edit(items, rng)

# -----------------------------------------------------------------------------
# data generators

def sft_rows(n, seed=0, split="train"):
    """Demonstrations from the flawed demonstrator (see DEDUP_PROB, EDIT_PROB)."""
    rng = _rng(seed, split)
    rows = []
    for _ in range(n):
        prompt = _in_split(rng, split)
        items = sorted(parse_prompt(prompt))
        if _has_repeat(items) and rng.random() < DEDUP_PROB:
            items = _dedup(items, rng)
        if rng.random() < EDIT_PROB:
            items = _random_edit(items, rng, [_replace, _swap])
        rows.append(dict(prompt=prompt, completion=_completion(items)))
    return rows

def _noisy_completion(prompt, rng):
    items = sorted(parse_prompt(prompt))
    for _ in range(rng.randint(0, MAX_EDITS)):
        items = _random_edit(items, rng, [_dedup, _drop, _replace, _swap, _insert])
    return _completion(items)

def preference_rows(n, seed=0, split="train"):
    """Pairs of completions of different gold reward, labelled by a noisy Bradley-Terry annotator."""
    rng = _rng(seed, split)
    rows = []
    for _ in range(n):
        prompt = _in_split(rng, split)
        while True:  # equal rewards carry no preference signal, so draw again
            c1, c2 = _noisy_completion(prompt, rng), _noisy_completion(prompt, rng)
            r1, r2 = sort_reward(prompt, c1), sort_reward(prompt, c2)
            if r1 != r2:
                break
        if rng.random() < sigmoid((r1 - r2) / PREF_TEMPERATURE):
            rows.append(dict(prompt=prompt, chosen=c1, rejected=c2))
        else:
            rows.append(dict(prompt=prompt, chosen=c2, rejected=c1))
    return rows

def bayes_accuracy(rows, temperature=PREF_TEMPERATURE):
    """Best expected pairwise accuracy on these rows: always pick the higher gold reward,
    and the noisy label still disagrees with probability sigmoid(-|dr| / T)."""
    total = 0.0
    for row in rows:
        dr = sort_reward(row["prompt"], row["chosen"]) - sort_reward(row["prompt"], row["rejected"])
        total += sigmoid(abs(dr) / temperature)
    return total / len(rows)

def test_prompts(n, seed=0):
    """n held-out prompts of the sort task, for greedy answers scored by the gold reward."""
    return [r["prompt"] for r in prompt_rows(n, seed=seed, split="test")]


def against_bayes(accuracy, pairs):
    """A pairwise accuracy on the task's held-out pairs beside the best one any model can reach on
    them (bayes_accuracy), as logged metrics."""
    bayes = bayes_accuracy(pairs)
    return {"eval/bayes_accuracy": bayes, "eval/accuracy_over_bayes": accuracy / bayes}


def prompt_rows(n, seed=0, split="train"):
    """Prompts for on-policy RL (GRPO), each naming the rule-based reward to score it with."""
    rng = _rng(seed, split)
    return [dict(prompt=_in_split(rng, split), reward_fn="sort") for _ in range(n)]

# -----------------------------------------------------------------------------
# arith: a verifiable chat task for real instruct models (pipeline.py --smollm2)
#
#     prompt: [{"role": "user", "content": "What is 7 * 8? Give the final answer as a number."}]
#     answer: "56"                  reward_fn: math (the completion's final number against it)
#
# Small sums, differences and products, and one-step word problems. The sizes are chosen so that
# SmolLM2-135M-Instruct answers 20-60% of them right greedily (measured on 100 prompts of each
# kind: a + b up to 20 51%, a * b up to 9 63%, word problems 19%), so a verifier's reward has room
# to teach and is not all zeros.

ARITH_INSTRUCTION = " Give the final answer as a number."
_NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Zoe")
_ITEMS = ("apples", "books", "coins", "stamps", "pencils", "cards", "marbles", "shells")


def arith_problem(rng):
    """(question, integer answer) of one of five kinds, equally likely."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        return f"What is {a} + {b}?", a + b
    if kind == 1:
        a = rng.randint(2, 20)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(1, 20)
    if kind == 3:
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    a += b  # never fewer than given away
    return f"{name} has {a} {item} and gives {b} away. How many {item} does {name} have left?", a - b


def arith_rows(n, seed=0, split="train"):
    """Conversational prompt rows (TRL's format) with the reference `answer` and the `math` rule."""
    rng = _rng(seed, split)
    rows = []
    for _ in range(n):
        question, answer = _in_split(rng, split, arith_problem, text=lambda qa: qa[0])  # split by question
        rows.append(dict(prompt=[{"role": "user", "content": question + ARITH_INSTRUCTION}], answer=str(answer),
                         reward_fn="math"))
    return rows


# the calculator task (grpo.py --tools calculator): 3-digit sums and products, which a 135M model
# gets wrong in its head (1% greedy: studies/results/smollm2-tools-baseline.json)
CALCULATOR_SYSTEM = (f"You have a calculator. To use it, write {tools.CALL_OPEN}an arithmetic expression"
                     f"{tools.CALL_CLOSE} and you will get {tools.RESULT_OPEN}its value{tools.RESULT_CLOSE}. Use it for "
                     f"any multiplication or addition of large numbers.")


def calculator_problem(rng):
    """(question, expression, integer answer): a sum or a product of two 3-digit numbers."""
    a, b, op = rng.randint(100, 999), rng.randint(100, 999), rng.choice("+*")
    return f"What is {a} {op} {b}?", f"{a} {op} {b}", a + b if op == "+" else a * b


def calculator_rows(n, seed=0, split="train", system=True, tool_share=1.0):
    """Conversational prompt rows of the calculator task, the tool described in a system turn
    (system=False: the question alone), with the `answer`, the `math` rule and a demonstration
    (`completion`, for the SFT that comes before GRPO): in `tool_share` of the rows the call, its
    result and the answer, in the others the answer alone, as a model that never calls writes it."""
    rng = _rng(seed, split)
    rows = []
    for _ in range(n):
        question, expr, answer = _in_split(rng, split, calculator_problem, text=lambda q: q[0])
        call = f"{tools.CALL_OPEN}{expr}{tools.CALL_CLOSE}{tools.RESULT_OPEN}{answer}{tools.RESULT_CLOSE}"
        demo = (call if rng.random() < tool_share else "") + f"{expr} = {answer}"
        rows.append(dict(prompt=([{"role": "system", "content": CALCULATOR_SYSTEM}] if system else [])
                         + [{"role": "user", "content": question + ARITH_INSTRUCTION}],
                         completion=[{"role": "assistant", "content": demo}], answer=str(answer), reward_fn="math"))
    return rows


TASKS = {"sort": {"sft": sft_rows, "preference": preference_rows, "prompt": prompt_rows},
         "arith": {"prompt": arith_rows}}

def task_rows(name, kind, n, seed=0, split="train"):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}, expected one of {sorted(TASKS)}")
    if kind not in TASKS[name]:
        raise ValueError(f"unknown kind {kind!r} for task {name!r}, expected one of {sorted(TASKS[name])}")
    return TASKS[name][kind](n, seed=seed, split=split)


# -----------------------------------------------------------------------------
# the model that learns the task: a character tokenizer and a small GPT-2, built in code

def char_tokenizer():
    """Printable ASCII plus newline, with <pad>, <eos>, <unk>: no files, no network. Round-trips
    through save_pretrained."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")

TINY_GPT2 = dict(n_layer=4, n_embd=128, n_head=4, n_positions=128)  # 0.8M parameters: enough to learn the task

def char_gpt2_config(tokenizer, **overrides):
    """A GPT-2 config for the character tokenizer, TINY_GPT2's shape unless overridden
    (bench/ builds GPT-2 small and large shapes with it). Dropout is off."""
    from transformers import GPT2Config

    kw = {**TINY_GPT2, "vocab_size": len(tokenizer), **overrides}
    # GPT-2's tanh-approximated GELU as one fused kernel instead of gelu_new's chain of element-wise
    # ops: the same function to 2.4e-7, faster (bench/test_micro.py); checkpoints keep their own
    return GPT2Config(**kw, activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def calculator_gpt2(folder, **shape):
    """A tiny GPT-2 that calls the calculator often, for tests and `python -m bench steps --model calculator`: the
    character tokenizer with the tag pairs as tokens, and an output layer whose first input, held at 1 by the
    final layer norm, leans to digits, '+', the call tags and EOS: most rows call the tool, some
    twice, some never, at different turns. The same from the same seed; its folder, as a string."""
    import torch
    from transformers import GPT2LMHeadModel

    tok = char_tokenizer()
    tok.add_tokens([tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(char_gpt2_config(tok, **{"n_layer": 1, "n_embd": 32, "n_head": 2, **shape},
                                             tie_word_embeddings=False))
    lean = {tools.CALL_OPEN: 2.5, tools.CALL_CLOSE: 3.0, "+": 2.5, tok.eos_token: 1.5, **{str(k): 2.5 for k in range(10)}}
    with torch.no_grad():
        model.transformer.ln_f.weight[0], model.transformer.ln_f.bias[0] = 0.0, 1.0
        model.lm_head.weight[:, 0] = -1.0
        for text, logit in lean.items():
            model.lm_head.weight[tok.convert_tokens_to_ids(text), 0] = logit
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)
