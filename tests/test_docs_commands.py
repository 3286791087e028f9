"""The shell commands of README.md and docs/*.md, as a user copies them: every one extracted (the
lines of each ```bash block, `\\` continuations joined, `&&` chains split; and each inline
`python ...` or `torchrun ...` span, a block of its own) and checked.

- Every command of a training script parses: its flags are the script's (cli.parse_config).
- No two training commands of one block write into the same --out_dir (flag or default) unless
  the later one is a --resume: the second would be refused ("already holds a checkpoint").
- The commands this machine can run are run as written, in a scratch folder as the working
  directory, with three substitutions, each a value and never a flag: a hub model becomes a
  model folder of the user_models fixture (Llama- and Qwen2-shaped), a hub data set a local
  .jsonl of its format, and a file the docs ask the user to bring (my_pairs.jsonl) is written
  with the columns they name; `torchrun --nproc_per_node 8 X.py` runs as `python X.py`. Flags
  that set the scale only (--steps 1, a batch of 4, 16 new tokens, 4 held-out rows) are
  appended after the command's own, so that a run takes a second. Each must exit 0 and change
  no file tracked in git.

The suite runs the README's "your own model and data" block and docs/distributed.md's block
(about 15 s); `RLHF_DOCS_ALL=1 python -m pytest -q tests/test_docs_commands.py` runs every
command that can run here, also plots/plot.py (minutes). What is never run
here and why: `NOT_RUN` (installs, the suite itself, several nodes, hub downloads, GPUs, the
pipeline's minutes, a placeholder such as OUT_DIR)."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, gamma, question, run_here, write_jsonl
from plumbing import cli

pytestmark = pytest.mark.session_fixtures("smollm2")  # request.getfixturevalue: tests/two_processes.py

SCRIPTS = ("sft.py", "reward.py", "dpo.py", "grpo.py")

NOT_RUN = [  # (pattern on the command, why it is not run here)
    (r"^(pip|python3? -m (venv|pip)|\. \.venv)", "sets up the environment"),
    (r"-m pytest", "the test suite itself"),
    (r"--nnodes [2-9]|HOST", "several nodes"),
    (r"^python -c .*load_dataset", "downloads a data set from the hub"),
    (r"-m bench\b", "a benchmark: it writes bench/results/ (tests/test_bench.py runs each command on a tiny shape)"),
    (r"-m studies\.", "a study: minutes to hours (its tests: tests/test_offpolicy_exact.py, the smollm2 fixtures)"),
    (r"tests/(gpu_check|memory_trace)\.py", "the GPU check, the memory model's trace (tests/test_gpu_path.py, tests/test_memory_model.py run them)"),
    (r"pipeline\.py", "the pipeline: minutes to an hour (tests/test_pipeline.py runs its stages at small scale)"),
    (r"\b(OUT_DIR|DEST|RUN\d?|RUNS|FILE|N)\b|\.\.\.", "a placeholder the user fills in"),
    (r"--help", "prints the flags (tests/test_common.py reads every script's --help)"),
]

HUB_MODELS = {"Qwen/Qwen2.5-0.5B-Instruct": "llama", "Qwen/Qwen2.5-7B-Instruct": "llama_teacher", "gpt2": "qwen2"}
"""hub model -> user_models folder (the teacher shares its student's tokenizer, as Qwen2.5's sizes do)"""

SCALE = {  # appended after a training command's own flags: the scale, never what the command means
    "sft.py": ["--steps", "1", "--n_train", "64", "--batch_size", "4", "--n_eval", "4"],
    "reward.py": ["--steps", "1", "--n_train", "64", "--batch_size", "4", "--n_eval", "4", "--n_normalize", "4"],
    "dpo.py": ["--steps", "1", "--n_train", "64", "--batch_size", "4", "--n_eval", "4", "--n_eval_prompts", "2"],
    "grpo.py": ["--steps", "1", "--n_train", "64", "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "16", "--n_eval", "2",
                "--n_eval_pairs", "2"],
}


def blocks(path):
    """[(where, [command, ...]), ...] of a Markdown file: a ```bash (or sh, console) block's
    commands, then each inline `python ...` or `torchrun ...` span of the prose as a block of one."""
    found, block, fence, lines = [], None, None, open(path).read().split("\n")
    text = []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if block is None:
                fence, block = line.strip()[3:], (n, [])
            else:
                if fence in ("bash", "sh", "shell", "console"):
                    found.append((f"{os.path.relpath(path, ROOT)}:{block[0]}", commands(block[1])))
                block = None
            continue
        (block[1] if block is not None else text).append(line if block is not None else (n, line))
    for n, line in text:  # prose names commands too (`python grpo.py --tools`, `python x.py`): only these run
        for span in re.findall(r"`((?:python|torchrun) [^`]+)`", line):
            if re.match(r"python (plots/plot\.py|-m (bench|studies)|tests/gpu_check\.py)", span) or (
                    training(span) and parses(*training(span))):
                found.append((f"{os.path.relpath(path, ROOT)}:{n}", commands([span])))
    return found


def commands(lines):
    """A block's commands: comments dropped, `\\` continuations joined, `a && b` as two."""
    out, joined = [], []
    for line in lines:
        joined.append(line.rstrip().removesuffix("\\"))
        if line.rstrip().endswith("\\"):
            continue
        words, joined = shlex.split(" ".join(joined), comments=True), []
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(shlex.join(words[:cut]))
            words = words[cut + 1:]
    return [c for c in out if c]


def parses(script, argv):
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            out_dir(script, argv)
    except SystemExit:
        return False
    return True


def all_blocks():
    return [b for f in ["README.md", *sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))]
            for b in blocks(os.path.join(ROOT, f if f == "README.md" else os.path.join("docs", f)))]


def training(command):
    """(script, argv) of a training command, `python X.py ...` or `torchrun [its flags] X.py ...`;
    None for any other."""
    words = shlex.split(command)
    for i, w in enumerate(words):
        if w in SCRIPTS and words[0] in ("python", "torchrun"):
            return w, words[i + 1:]
    return None


def not_run(command):
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command)), None)


def out_dir(script, argv):
    """The --out_dir a training command writes into (its flag, else the script's default)."""
    module = __import__(script.removesuffix(".py"))
    return os.path.normpath(cli.parse_config(module.Config, argv).out_dir)


def test_every_training_command_parses_and_no_two_of_a_block_share_an_out_dir():
    """Every training command of the docs parses (its flags are its script's), and no two of one
    block write into one --out_dir unless the later is a --resume: docs/distributed.md's four
    commands and the README's DPO and two GRPO commands all wrote runs/dpo or runs/grpo, so each
    after the first stopped with "already holds a checkpoint"."""
    shared, seen_training = [], 0
    for where, cmds in all_blocks():
        dirs = {}
        for c in cmds:
            t = training(c)
            if t is None:
                continue
            seen_training += 1
            script, argv = t
            try:
                d = out_dir(script, argv)
            except SystemExit:  # argparse's error, printed above it
                shared.append(f"{where}: `{c}` does not parse")
                continue
            if d in dirs and "--resume" not in argv:
                shared.append(f"{where}: `{c}` writes into {d}, as `{dirs[d]}` does")
            dirs[d] = c
    assert seen_training >= 20, seen_training  # the extraction found the docs' commands
    assert not shared, "\n".join(shared)


def test_the_docs_name_every_command_they_cannot_run_here():
    """Each command is either run (a training script, plots/plot.py) or named in
    NOT_RUN with its reason: a new kind of command in the docs is seen here first."""
    unknown = [f"{where}: {c}" for where, cmds in all_blocks() for c in cmds
               if not (training(c) or not_run(c) or re.match(r"python plots/plot\.py", c))]
    assert not unknown, "\n".join(unknown)


def data_files(folder):
    """The local files the substituted hub data sets and the docs' own file names become."""
    n = range(24)
    pref = [{"prompt": f"What is {i} + 7?", "chosen": f" {i + 7}", "rejected": " no"} for i in n]
    files = {
        "trl-lib/tldr": [{"prompt": f"POST: what is {i} + 7?\nTL;DR:", "completion": f" {i + 7}"} for i in n],
        "trl-lib/tldr-preference": pref,
        "my_pairs.jsonl": pref,  # prompt, chosen, rejected
        "my_prompts.jsonl": [{"prompt": f"What is {i} + 7?", "answer": str(i + 7)} for i in n],  # prompt, answer
        "gsm8k.jsonl": [{"prompt": question(i), "answer": f"{i} + 7 = {i + 7}\n#### {i + 7}"} for i in n],
    }
    return {name: write_jsonl(os.path.join(folder, name.replace("/", "_") + ".jsonl" if "/" in name else name), rows)
            for name, rows in files.items()}


def as_run_here(command, models, files):
    """(script, argv) of a training command as this test runs it: the hub names (and `smollm2`, where the
    test gives a folder for it) substituted, the scale flags appended."""
    script, argv = training(command)
    swap = {**{k: models[v] for k, v in HUB_MODELS.items() | {("smollm2", "smollm2")} if v in models},
            **{k: v for k, v in files.items() if "/" in k}}
    return script, [swap.get(a, a) for a in argv] + SCALE[script]


def tracked_mtimes():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {n: os.stat(os.path.join(ROOT, n)).st_mtime_ns for n in names.split("\0") if n and os.path.exists(
        os.path.join(ROOT, n))}


def run_in(folder, script, argv):
    """`python SCRIPT ARGV` in this process with `folder` as the working directory (where the
    command's relative paths, runs/..., land): (exit code, stdout and stderr)."""
    proc = run_here([script, *argv], cwd=folder)
    return proc.returncode, proc.stdout + proc.stderr


def run_block(where, cmds, folder, models):
    """Run a block's commands in order in folder; [(command, status)], status "ok", the reason
    it was not run, or the failure. Asserts that no file tracked in git changed."""
    files, results = data_files(folder), []
    for c in cmds:
        why = not_run(c)
        if why:
            results.append((c, f"not run: {why}"))
            continue
        before = tracked_mtimes()
        if training(c):
            code, log = run_in(folder, *as_run_here(c, models, files))
        else:  # plots/plot.py: a process of its own, from the repository as the docs say
            r = subprocess.run([sys.executable, *shlex.split(c)[1:]], cwd=ROOT, capture_output=True, text=True,
                               timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
            code, log = r.returncode, r.stdout + r.stderr
        changed = sorted(n for n, t in tracked_mtimes().items() if before.get(n) != t)
        assert not changed, f"{where}: `{c}` rewrote files tracked in git: {changed}"
        results.append((c, "ok" if code == 0 else f"FAILED ({code}): {log[-700:]}"))
    return results


def the_block(heading_file, first_words):
    (found,) = [(w, c) for w, c in all_blocks() if w.startswith(heading_file) and c and c[0].startswith(first_words)]
    return found


@pytest.mark.parametrize("file, first", [("README.md", "python sft.py --model Qwen"),
                                         ("README.md", "python sft.py --model smollm2"),
                                         ("docs/distributed.md", "python grpo.py")],
                         ids=["readme-own-data", "readme-recipe", "distributed"])
def test_a_docs_block_runs_as_written(tmp_path, user_models, request, file, first):
    """The README's "your own model and data" block (SFT -> reward model -> DPO -> GRPO with a rule
    and with the learned reward, each from the SFT run), its recipe "your data on SmolLM2" (SFT ->
    DPO -> GRPO with the reward functions of examples/rewards.py, on the examples/ files; SmolLM2's
    tokenizer, template and architecture at 2 layers) and docs/distributed.md's block (grpo.py on
    one process, on torchrun's single process with --offload_frozen, on 8: here one) each run in
    order, as written but for the substitutions, and each exits 0 without touching a tracked file.
    The recipe's GRPO run logs its completions: each reward there is what the user's functions
    give that completion. docs/distributed.md's block starts from `runs/sft`, the pipeline's SFT
    stage: a one-step `sft.py --model tiny` stands for it."""
    import shutil

    where, cmds = the_block(file, first)
    models = dict(user_models)
    if file == "docs/distributed.md":
        code, log = run_in(tmp_path, "sft.py", ["--model", "tiny", "--out_dir", "runs/sft", *SCALE["sft.py"]])
        assert code == 0, log[-2000:]
    if "smollm2" in first:  # run from the repository's root, as the README says: examples/ beside it
        models["smollm2"] = request.getfixturevalue("smollm2_small")
        shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    results = run_block(where, cmds, tmp_path, models)
    failed = [f"`{c}`: {s}" for c, s in results if s != "ok" and not s.startswith("not run")]
    assert not failed, "\n\n".join(failed)
    assert sum(s == "ok" for _, s in results) >= 3, results
    if "smollm2" in first:
        sys.path.insert(0, str(tmp_path / "examples"))
        try:
            import rewards as user_rewards
        finally:
            sys.path.pop(0)
        rows = [json.loads(line) for line in open(tmp_path / "runs" / "my-grpo" / "completions.jsonl")]
        solution = {json.dumps(r["prompt"]): r["solution"] for r in map(json.loads, open(tmp_path / "examples" / "prompts.jsonl"))}
        logged = json.loads(open(tmp_path / "runs" / "my-grpo" / "metrics.jsonl").readlines()[-1])
        assert {"rewards/accuracy/mean", "rewards/brevity/mean", "eval/reward"} <= set(logged), logged
        assert len(rows) == 4, rows  # --log_completions 4, one step
        for r in rows:  # a conversational prompt's completion reaches the functions as TRL passes it
            completion = [{"role": "assistant", "content": r["completion"]}]
            want = {"accuracy": user_rewards.accuracy([completion], [solution[json.dumps(r["prompt"])]])[0],
                    "brevity": user_rewards.brevity([completion])[0]}
            # each reward rounded to float32, then their sum: within gamma_3 of their sizes
            bound = gamma(3) * (abs(want["accuracy"]) + abs(want["brevity"]))
            assert r["reward"] == pytest.approx(want["accuracy"] + want["brevity"], abs=bound), r


@pytest.mark.skipif(not os.environ.get("RLHF_DOCS_ALL"), reason="minutes: RLHF_DOCS_ALL=1 runs every docs command")
def test_every_docs_command_that_can_run_here_runs(tmp_path, user_models):
    """Every block of the README and docs/, each in a scratch folder of its own; prints what ran
    and what was not run, and why."""
    report, failed = [], []
    for i, (where, cmds) in enumerate(all_blocks()):
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        for c, status in run_block(where, cmds, folder, user_models):
            report.append(f"{where}\t{status.splitlines()[0][:100]}\t{c}")
            if status != "ok" and not status.startswith("not run"):
                failed.append(f"{where}: `{c}`: {status}")
    print("\n".join(report))
    json.dump(report, open(os.path.join(os.environ.get("RLHF_DOCS_REPORT", str(tmp_path)), "docs_commands.json"), "w"),
              indent=1)
    assert not failed, "\n\n".join(failed)
