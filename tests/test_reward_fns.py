"""grpo.py's reward functions as TRL users write them (--reward_fn module:function, several with
--reward_weights, None for "does not apply", async ones), the held-out evaluation of --eval_dataset
or a local file's hash split, and the answer column (`solution`, --answer_column). The call-site
tests run the script on a Llama-shaped folder (conftest.py's user_models) with conversational rows,
and check what the functions received and what was logged against a computation from the calls
themselves (each function writes what it got and returned to a log)."""
import json
import math
import re

import pytest
import torch

import data
import environment
import grpo
import reward_fns
from helpers import (TWO_RANK_RUNS, assert_runs_agree, checkpoint_config, gamma, question, read_metrics, run_here,
                     write_jsonl)

REWARDS = '''
import asyncio, json, os

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls%s.jsonl" % os.environ.get("RANK", "0"))


def _log(name, prompts, completions, ids, solution, out):
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(fn=name, prompts=prompts, completions=completions, ids=ids, solution=solution,
                                out=out)) + "\\n")
    return out


def length(prompts, completions, completion_ids, solution, **kwargs):
    """distinct values: the completion's token count plus its row's solution / 10"""
    return _log("length", prompts, completions, completion_ids, solution,
                [len(ids) + int(s) / 10 for ids, s in zip(completion_ids, solution)])


def odd_only(prompts, completions, completion_ids, solution, **kwargs):
    """applies to rows with an odd solution only"""
    return _log("odd_only", prompts, completions, completion_ids, solution,
                [float(s) if int(s) % 2 else None for s in solution])


async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c[0]["content"])) for c in completions]


def boom(prompts, completions, solution, **kwargs):
    if "9" in solution:
        raise RuntimeError("cannot score 9")
    return [0.0] * len(completions)
'''


def reward_argv(folder, models, *extra):
    """grpo.py on 20 conversational rows with a `solution` column (rows 13 and 19 hash into the
    held-out 5%), three functions of a user's file: length and odd_only weighted 1 and 0.5, the
    async judge at 0 (logged only)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "myrewards.py").write_text(REWARDS)
    rows = [{"prompt": question(i), "solution": str(i + 7)} for i in range(20)]
    path, fns = write_jsonl(folder / "q.jsonl", rows), folder / "myrewards.py"
    return ["grpo.py", "--model", models["llama"], "--dataset", path, "--steps", "2", "--prompts_per_step", "4",
            "--group_size", "4", "--max_prompt_len", "128", "--max_new_tokens", "8", "--temperature", "0.7",
            "--eval_every", "1", "--warmup_steps", "0", "--lr", "1e-4", "--out_dir", str(folder / "run"),
            "--reward_fn", f"{fns}:length,{fns}:odd_only,{fns}:judge",
            "--reward_weights", "length:1,odd_only:0.5,judge:0", *extra]


TWO_RANK_RUNS["grpo_reward_fns"] = reward_argv


def calls(folder, rank=0):
    with open(folder / f"calls{rank}.jsonl") as f:
        return [json.loads(line) for line in f]


def nanmean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


def test_user_reward_functions_get_what_trl_passes_and_their_weighted_sum_is_the_reward(tmp_path, user_models,
                                                                                        two_ranks):
    """Each call gets the rows' prompts as written (messages), the completions as TRL passes them
    after a conversational prompt ([{"role": "assistant", ...}]: a swap of prompts and completions
    fails here), the completion ids, and the `solution` column aligned with the prompts. The logged
    rewards/<name>/mean, /std and `reward` are those computed from what the functions returned
    (None left out; weights 1 and 0.5). The held-out rows (the hash split) are evaluated greedily
    then sampled at every evaluation: eval/greedy/... and eval/... are the means of those calls.
    torchrun, 2 ranks: each rank calls the functions on its own rows, and the rewards, each
    function's mean and the evaluation, sampled included (its draws seeded by --seed alone), are
    those of 1 process."""
    from transformers import AutoTokenizer

    proc = run_here(reward_argv(tmp_path, user_models))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, log = read_metrics(tmp_path / "run"), calls(tmp_path)
    tok = AutoTokenizer.from_pretrained(user_models["llama"])
    held = {json.dumps(question(i)) for i in range(20) if data.held_out(question(i))}
    assert len(held) == 2
    for c in log:
        for p, comp, ids, s in zip(c["prompts"], c["completions"], c["ids"], c["solution"]):
            assert p == question(int(s) - 7)  # the prompt as written, with its own row's solution
            assert isinstance(comp, list) and comp[0]["role"] == "assistant" and len(comp) == 1
            assert tok.decode(ids, skip_special_tokens=True).strip() == comp[0]["content"].strip()
    train = [c for c in log if json.dumps(c["prompts"][0]) not in held]
    evals = [c for c in log if json.dumps(c["prompts"][0]) in held]
    assert all(json.dumps(p) not in held for c in train for p in c["prompts"]) and len(train) == 4  # 2 fns x 2 steps
    def by_fn(cs):  # the calls of one batch, each function's: they run at once, in any order
        return {c["fn"]: c["out"] for c in cs}

    def tol(xs):  # the rewards are float32 (each rounded), their means summed in float32 or float64
        xs = [abs(x) for x in xs if x is not None]
        return gamma(len(xs) + 2) * max(xs)

    for step, k in zip(rows[1:], (0, 2)):  # the calls of each step, 2 functions each
        out = by_fn(train[k:k + 2])
        length, odd = out["length"], out["odd_only"]
        assert len(length) == 16 and None in odd and any(odd)  # some rows apply, some do not
        total = [a + 0.5 * (b or 0) for a, b in zip(length, odd)]
        assert step["rewards/length/mean"] == pytest.approx(nanmean(length), abs=tol(length))
        assert step["rewards/odd_only/mean"] == pytest.approx(nanmean(odd), abs=tol(odd))
        odds = [x for x in odd if x is not None]
        std = math.sqrt(sum((x - nanmean(odds)) ** 2 for x in odds) / (len(odds) - 1))
        assert step["rewards/odd_only/std"] == pytest.approx(std, abs=2 * tol(odd))  # moved by each x at most as much
        assert step["reward"] == pytest.approx(sum(total) / 16, abs=tol(total))
        assert step["rewards/judge/mean"] > 0
    assert [r["step"] for r in rows] == [0, 1, 2] and len(evals) == 2 * 2 * 3  # 2 fns, greedy + sampled, 3 evals
    for r, k in zip(rows, range(0, 12, 4)):  # greedy, then sampled
        greedy, sampled = by_fn(evals[k:k + 2]), by_fn(evals[k + 2:k + 4])
        assert r["eval/greedy/rewards/length/mean"] == pytest.approx(nanmean(greedy["length"]), abs=tol(greedy["length"]))
        assert r["eval/rewards/length/mean"] == pytest.approx(nanmean(sampled["length"]), abs=tol(sampled["length"]))
        assert r["eval/rewards/odd_only/mean"] == pytest.approx(nanmean(sampled["odd_only"]),
                                                                abs=tol(sampled["odd_only"]))
        total = [a + 0.5 * (b or 0) for a, b in zip(sampled["length"], sampled["odd_only"])]
        assert r["eval/reward"] == pytest.approx(nanmean(total), abs=tol(total))
    folder = two_ranks("grpo_reward_fns")
    two = read_metrics(folder / "run")
    rollout = ["reward", "rewards/length/mean", "rewards/odd_only/mean", "rewards/judge/mean"]
    # step 1's rollout and step 0's evaluation at the starting weights (the same completions: their
    # rewards within float32's rounding), the losses within rounding and Adam's drift (|A| <= 1.5
    # in a group of 4): helpers.assert_runs_agree
    assert_runs_agree(rows, two, checkpoint_config(tmp_path / "run"), length=128 + 8, lr=1e-4,
                      keys=[*rollout, "loss", "eval/reward", "eval/greedy/reward", "eval/rewards/odd_only/mean"],
                      start_keys=rollout, scales={"loss": [1.5]})
    ranks = [{json.dumps(p) for c in calls(folder, r) for p in c["prompts"]} for r in (0, 1)]
    assert ranks[0] and ranks[1] and ranks[0] != ranks[1]


def test_a_function_and_a_reward_model_without_weights_both_count_and_completion_ids_keep_the_stop_token(
        tmp_path, user_models):
    """--reward_fn FILE:length --reward_model RM and no --reward_weights: TRL's default, every reward
    at weight 1, so each step's reward is rewards/length/mean + rewards/model/mean (the weighted sum
    of float32 rewards, then their group means: within gamma_10 of their magnitudes). The policy
    leans to its end of turn (helpers.calculator_llama), so some completions stop: each function
    gets completion_ids as TRL passes them (GRPOTrainer's completion_mask keeps the first EOS):
    the sampled tokens with the stop token, max_new_tokens of them where none came. Planted and
    failing here: the reward model left out of the sum (reward_fns.parse_weights), the stop token
    cut from completion_ids (environment.score)."""
    from transformers import AutoTokenizer

    argv = reward_argv(tmp_path, user_models)
    for flag, value in (("--model", user_models["llama_calculator"]), ("--steps", "1"),
                        ("--reward_fn", f"{tmp_path / 'myrewards.py'}:length")):
        argv[argv.index(flag) + 1] = value
    i = argv.index("--reward_weights")
    del argv[i:i + 2]
    proc = run_here([*argv, "--reward_model", user_models["llama_rm"], "--eval_every", "100"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = read_metrics(tmp_path / "run")[1]
    length, model = step["rewards/length/mean"], step["rewards/model/mean"]
    bound = gamma(10) * (length + abs(model) + step["rewards/model/std"])  # |reward| <= length + |model|
    assert abs(step["reward"] - (length + model)) <= bound and abs(model) > 100 * bound, step
    tok = AutoTokenizer.from_pretrained(user_models["llama"])
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")}
    ids = [row for c in calls(tmp_path) for row in c["ids"]]
    assert all((row[-1] in stops or len(row) == 8) and not stops & set(row[:-1]) for row in ids), ids
    assert sum(row[-1] in stops for row in ids) >= 2, ids  # the case holds stopped completions


def test_a_function_that_raises_stops_the_run_naming_it_and_the_row(tmp_path, user_models):
    """boom raises on the row whose solution is 9: the file's row 3 (of 4, all drawn at step 1),
    found by calling it again row by row."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": question(i), "solution": str(i + 7)} for i in range(4)])
    proc = run_here(["grpo.py", "--model", user_models["llama"], "--dataset", path, "--steps", "1",
                     "--prompts_per_step", "4", "--group_size", "2", "--max_new_tokens", "4", "--max_prompt_len", "128",
                     "--reward_fn", f"{tmp_path / 'myrewards.py'}:boom", "--out_dir", str(tmp_path / "run")])
    assert proc.returncode != 0
    assert f"--reward_fn boom raised on {path} row 3: RuntimeError: cannot score 9" in proc.stderr


def test_a_bad_reward_fn_or_weight_is_refused_naming_the_flag_before_anything_is_written(tmp_path):
    (tmp_path / "myrewards.py").write_text(REWARDS)
    fns = tmp_path / "myrewards.py"
    for argv, message in (
            (["--reward_fn", "nosuchmodule:f"], "--reward_fn nosuchmodule:f: cannot load it: importing module "
             "'nosuchmodule' failed: ModuleNotFoundError: No module named 'nosuchmodule'\n"),
            (["--reward_fn", f"{fns}:nope"], f"--reward_fn {fns}:nope: cannot load it: module {str(fns)!r} has no 'nope'"),
            (["--reward_fn", "math,srot"], "'srot' is neither a rule"),
            (["--reward_fn", f"{fns}:length,{fns}:odd_only", "--reward_weights", "length:1"],
             "gives no weight to --reward_fn's odd_only"),
            (["--reward_fn", f"{fns}:length", "--reward_weights", "length:1,lenght:2"], "expected parts like")):
        proc = run_here(["grpo.py", "--model", "tiny", *argv, "--out_dir", str(tmp_path / "o")])
        assert proc.returncode != 0 and message in proc.stderr, (argv, proc.stderr[-2000:])
        assert not (tmp_path / "o").exists()
    # a rule's error names the flag that gave every row its rule, not "row 1" of a `reward_fn` column
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "sort 3 1 =", "answer": "x"}])
    cfg = grpo.Config(dataset=path, reward_fn=f"math,{fns}:length")
    with pytest.raises(ValueError, match=r"p.jsonl row 1: --reward_fn math has no number in its answer 'x'"):
        environment.load_prompts(cfg, rules=False, fns=reward_fns.load_reward_fns(cfg.reward_fn))


def test_reward_functions_of_a_batch_run_at_once_async_ones_too(tmp_path):
    """Two `async def` functions and a plain one (judges behind an API), each in a file of its own
    (the functions of one file share its worker, and run one after the other, as in TRL's one
    process): each marks that it has started and waits for the other two to have started too, which
    only happens if the caller runs them at once (one after another, the first would wait out its 30
    s and return -1s); None comes back as NaN, and a wrong return is named. No clock is read: it
    cannot fail by timing."""
    text = f'''
import asyncio, os, time
FOLDER = {str(tmp_path)!r}

def started(name):  # mark this one started; True once all three are
    open(os.path.join(FOLDER, "started-" + name), "w").close()
    return all(os.path.exists(os.path.join(FOLDER, "started-" + n)) for n in "abc")

async def together(name):
    for _ in range(3000):
        if started(name):
            return True
        await asyncio.sleep(0.01)
    return False

async def a(prompts, completions, **kw):
    return [1.0, None] if await together("a") else [-1.0, -1.0]
async def b(prompts, completions, **kw):
    return [2.0, 3] if await together("b") else [-1.0, -1.0]
def c(prompts, completions, **kw):
    return [len(p) for p in prompts] if asyncio.run(together("c")) else [-1.0, -1.0]
def bad(prompts, completions, **kw):
    return [1.0, "x"]
'''
    for n in "abc":
        (tmp_path / f"slow_{n}.py").write_text(text)
    fns = reward_fns.load_reward_fns(",".join(f"{tmp_path / f'slow_{n}.py'}:{n}" for n in "abc"))
    caller = reward_fns.RewardCaller(fns)
    out = caller(["p", "pp"], ["c", "cc"], [[1], [2]], {}, rows=[4, 9], source="d.jsonl")
    assert out["a"][0] == 1.0 and math.isnan(out["a"][1]) and out["b"] == [2.0, 3.0] and out["c"] == [1.0, 2.0]
    bad = reward_fns.RewardCaller(reward_fns.load_reward_fns(f"{tmp_path / 'slow_a.py'}:bad,math"))
    with pytest.raises(ValueError, match=r"--reward_fn bad returned 'x' for d.jsonl row 9"):
        bad(["p", "pp"], ["c", "cc"], [[1], [2]], {}, rows=[4, 9], source="d.jsonl")


def test_none_is_left_out_of_the_sum_and_of_the_group_as_trl_does():
    """combine: TRL's nansum over functions, NaN where no function scores; group_advantages: an
    unscored completion is left out of its group's mean and std and gets advantage 0 (hand case:
    the others 1, 3, 5 have mean 3 and std 2); a full group is as before."""
    nan = math.nan
    total = environment.combine({"a": torch.tensor([1.0, nan, 2.0]), "b": torch.tensor([nan, nan, 4.0])},
                                {"a": 1.0, "b": 0.5})
    assert total[0] == 1.0 and math.isnan(total[1]) and total[2] == 4.0
    rewards = torch.tensor([[1.0, nan, 3.0, 5.0], [0.0, 1.0, 2.0, 4.0]])
    adv, m = grpo.group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([-2.0, 0.0, 0.0, 2.0]) / (2 + 1e-4))
    assert torch.equal(adv[1], grpo.group_advantages(rewards[1:])[0][0])
    assert m["reward"] == pytest.approx((3 + 7 / 4) / 2) and m["frac_reward_zero_std"] == 0
    rloo, _ = grpo.group_advantages(rewards, scale="none", estimator="rloo")
    assert torch.allclose(rloo[0], torch.tensor([1 - 4.0, 0, 3 - 3.0, 5 - 2.0]))  # r_i - mean of the others


def test_the_answer_column_is_answer_else_solution_else_the_flag(tmp_path):
    """`math` reads `solution` (TRL's math sets) where there is no `answer`; --answer_column names
    another; neither is refused naming the file and its columns."""
    def load(rows, **kw):
        path = write_jsonl(tmp_path / "m.jsonl", rows)
        cfg = grpo.Config(dataset=path, reward_fn="math", **kw)
        ds, _ = environment.load_prompts(cfg, rules=True)
        return reward_fns.answer_column(ds, cfg, path, needed=True)

    assert load([{"prompt": "q", "solution": "#### 4"}]) == "solution"
    assert load([{"prompt": "q", "answer": "4", "solution": "x"}]) == "answer"
    assert load([{"prompt": "q", "ref": "4"}], answer_column="ref") == "ref"
    with pytest.raises(ValueError, match=r"m.jsonl: the reward needs an `answer` or `solution` column .* it has "
                                         r"columns \['prompt', 'gold'\]: name the column with --answer_column"):
        load([{"prompt": "q", "gold": "4"}])
    with pytest.raises(ValueError, match=r"the reward needs --answer_column ref"):
        load([{"prompt": "q", "answer": "4"}], answer_column="ref")


def test_eval_dataset_is_scored_by_every_reward(tmp_path):
    """--eval_dataset, a file of its own: its prompts are evaluated (greedy and sampled, with the
    rule's name) and the training file is not split."""
    rows = [{"prompt": f"sort {i} {i + 1} 3 =", "reward_fn": "digits"} for i in range(6)]
    train, test = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows[:3])
    grpo.main(grpo.Config(model="tiny", dataset=train, eval_dataset=test, out_dir=str(tmp_path / "g"), steps=1,
                          prompts_per_step=2, group_size=2, max_new_tokens=4, warmup_steps=0, n_eval_pairs=4))
    first = read_metrics(tmp_path / "g")[0]
    assert first["step"] == 0 and {"eval/reward", "eval/rewards/rule/mean", "eval/greedy/reward",
                                   "eval/greedy/rewards/rule/mean"} <= set(first)


def test_a_column_named_like_an_argument_trl_passes_is_refused_naming_it_and_the_file(tmp_path):
    """A data column named `prompts`, `completions` or `completion_ids` would reach a user's
    function twice: refused when the prompts load, naming the column and the file; with rules
    alone (no function is called) the file loads. Before: `TypeError: dict() got multiple values
    for keyword argument 'completions'` at step 1, naming neither."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    fns = reward_fns.load_reward_fns(f"{tmp_path / 'myrewards.py'}:judge")
    for column in ("prompts", "completions", "completion_ids"):
        path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": f"sort {i} 1 =", column: "x"} for i in range(3)])
        cfg = grpo.Config(dataset=path, reward_fn=f"{tmp_path / 'myrewards.py'}:judge")
        with pytest.raises(ValueError, match=rf"^{path}: the column '{column}' has the name of an argument every "
                                             r"--reward_fn function is given .*: rename the column$"):
            environment.load_prompts(cfg, rules=False, fns=fns)
        ds, _ = environment.load_prompts(grpo.Config(dataset=path, reward_fn="digits"), rules=True)
        assert column in ds.column_names


def test_none_or_nan_for_every_row_is_said_once_and_a_reward_infinite_in_float32_is_refused(tmp_path, capsys):
    """A function returning None (or NaN) for every completion of a batch: a warning naming it and
    the rows, once (TRL warns); some None: no warning. 1e39 (inf in float32, the rewards' dtype) or
    float('inf'): an error naming the function, the value and the row; float32's largest finite
    number passes. Before: no word (the run trained on zero advantages, logging `reward 0`), and
    1e39 passed the check until the loss was NaN."""
    path = tmp_path / "returns.py"
    path.write_text("import math\n\ndef f(prompts, completions, value, **kw):\n    return value\n")
    caller = reward_fns.RewardCaller(reward_fns.load_reward_fns(f"{path}:f"))

    def call(values, rows=(3, 5)):
        return caller(["p"] * len(values), ["c"] * len(values), [[1]] * len(values), {"value": values}, rows=list(rows),
                      source="d.jsonl")["f"]

    assert call([None, 1.0])[1] == 1.0 and capsys.readouterr().err == ""
    assert all(math.isnan(v) for v in call([None, None]))
    said = capsys.readouterr().err
    assert said == ("warning: --reward_fn f returned None (or NaN) for every completion of a batch (d.jsonl rows 3, 5): "
                    "they are left out of every mean, and a completion that no reward scores has advantage 0 (TRL warns "
                    "alike; said once)\n")
    call([math.nan, math.nan])
    assert capsys.readouterr().err == ""  # once
    largest = 3.4028234663852886e38  # float32's largest finite number
    assert call([largest, -largest]) == [largest, -largest]
    for bad in (1e39, -3.5e38, math.inf):
        with pytest.raises(ValueError, match=rf"^--reward_fn f returned {re.escape(repr(bad))} for d.jsonl row 5: a "
                                             r"reward is a number finite in float32"):
            call([1.0, bad])


def test_a_tensor_or_an_array_of_rewards_is_taken_as_trl_takes_it(tmp_path):
    """A 1-D torch tensor (TRL's torch.tensor takes one; its items are 0-d tensors) and a numpy
    array are read as their numbers. Before: the tensor was refused ("returned tensor(1.5)")."""
    (tmp_path / "arrays.py").write_text("import numpy, torch\n\n"
                                        "def t(prompts, completions, **kw):\n    return torch.tensor([1.5, -2.0])\n\n"
                                        "def a(prompts, completions, **kw):\n    return numpy.array([0.25, 3.0])\n")
    fns = reward_fns.load_reward_fns(f"{tmp_path / 'arrays.py'}:t,{tmp_path / 'arrays.py'}:a")
    out = reward_fns.RewardCaller(fns)(["p", "q"], ["c", "d"], [[1], [2]], {}, rows=[1, 2], source="d.jsonl")
    assert out == {"t": [1.5, -2.0], "a": [0.25, 3.0]}


def test_a_reward_file_imports_its_neighbours_and_a_users_tasks_py_is_the_users(tmp_path, monkeypatch):
    """rewards.py beside the helper.py it imports loads in both spec forms (its path; its name,
    from the working directory), as `python rewards.py` would import it; a user's tasks.py or
    data.py in the working directory is the user's, not the project's module of that name.
    Before: "No module named 'helper'" in both forms, and `tasks:f` loaded the project's tasks.py
    (which has no f)."""
    (tmp_path / "helper.py").write_text("BONUS = 0.5\n")
    (tmp_path / "rewards.py").write_text("import helper\n\n"
                                         "def f(prompts, completions, **kw):\n    return [helper.BONUS] * len(prompts)\n")
    for name in ("tasks", "data"):
        (tmp_path / f"{name}.py").write_text(f"def {name}_fn(prompts, completions, **kw):\n"
                                             f"    return [7.0] * len(prompts)\n")

    def scores(spec):
        caller = reward_fns.RewardCaller(reward_fns.load_reward_fns(spec))
        return caller(["p"], ["c"], [[1]], {}, rows=[1], source="d.jsonl")

    assert scores(f"{tmp_path / 'rewards.py'}:f") == {"f": [0.5]}
    monkeypatch.chdir(tmp_path)
    assert scores("rewards:f") == {"f": [0.5]}
    assert scores("tasks:tasks_fn,data:data_fn") == {"tasks_fn": [7.0], "data_fn": [7.0]}
