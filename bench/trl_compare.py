"""Whole training steps of our grpo.py and dpo.py against Hugging Face TRL's GRPOTrainer and
DPOTrainer: seconds per step, tokens/s and peak memory, side by side, with ratios.

Both sides train the same random-weight GPT-2 (built from `util.SHAPES` with the
character tokenizer and saved into a temporary folder that both load), on the same synthetic
rows of exact token lengths (`bench/steps.py: make_data`), with the same batch, group size,
lengths, beta, learning rate, AdamW, precision and number of optimizer steps. Every case runs
in a fresh subprocess: ours is the real script, timed from its metrics.jsonl (`time/step`);
TRL is this file in `--child` mode, timed per optimizer step by a TrainerCallback
(on_step_begin -> on_step_end, each after a device sync). The first step is warm-up and left
out; the figure is the median of the rest. Every case runs --repeats times (3), ours and TRL
alternating, the order flipped every repeat (ABBA): each ratio is computed within a repeat, from
runs side by side, and the median over repeats is reported with the range of the repeats. Peak memory is the child's peak RSS (os.wait4) on
CPU; on GPU torch.cuda.max_memory_allocated since the child started (model load, reference,
optimizer state and every step included) on both sides: ours logs it as mem/peak_gib, TRL's
is read at the end of every step.

Precision, like for like: fp32 on CPU. On a GPU both sides keep fp32 weights, gradients and
AdamW state and run the forwards (policy, reference, rollout, DPO's precompute) under bf16
autocast, as a TRL user gets from `bf16=True`: Accelerate wraps the forward of the policy and
of the reference in torch.autocast(bf16), and TRL's generation calls that wrapped forward;
our scripts enter common.autocast (the same torch.autocast) around the same work. Neither
casts the weights to bf16. The checks each run prints confirm it (TRL: param_dtype,
ref_param_dtype, mixed_precision, forward_autocast, ref_forward_autocast).

Cases (TRL is run matched to us, and also with its own default gradient_checkpointing=True):
  GRPO  one rollout of B prompts x G completions (max R new tokens, temperature 1) then exactly
        one optimizer step; beta 0.04 (both run a reference model); token-mean loss over the
        batch (ours token_mean = TRL loss_type="dapo"). Tokens/s counts the prompt and
        completion tokens actually produced (each side's own mean completion length).
  DPO   B pairs of P prompt + R response tokens per step, sigmoid loss, beta 0.1:
        ours --no-precompute_ref vs TRL with a live reference model (like for like), and ours
        default (reference log-probs precomputed once) vs TRL precompute_ref_log_probs=True;
        the one-off precompute time of each is reported apart.

    python bench/trl_compare.py --models tiny --steps 3 --batch_size 8 --group_size 4 --prompt_len 32 --response_len 16
    python bench/trl_compare.py                                      # tiny and GPT-2 small, CPU, fp32
    python bench/trl_compare.py --models gpt2-small-random --batch_size 16 --tag small   # GPU, bf16
    python bench/trl_compare.py --models gpt2-small-random --batch_size 16 --lengths tldr --tag small  # GPU

`--lengths` (bench/lengths.py): `fixed` rows of --prompt_len + --response_len tokens, or each row
its own lengths from `arith` (SmolLM2's arithmetic chat task) or `tldr` (TL;DR's long-tailed
shape), the limits on both sides set to the longest prompt and response (no row is cut). DPO's
tokens/s then counts each step's expected real tokens (rows x the mean pair), the same figure on
both sides; GRPO's, the prompts' mean + each side's measured completions, as with fixed lengths
(a random-weight policy seldom stops, so its completions run to the longest response length).

Padding-free (`-pf` variants): ours with --padding_free (each micro-batch's rows packed into one
sequence, position ids restarting per row), beside ours with --no-padding_free; every run of ours
passes one of the two. TRL 1.16 has none to match: GRPOTrainer has no padding-free or packing
option (experimental AsyncGRPOTrainer packs, but needs a vLLM server and flash-attention kernels
from the Hub), and DPOConfig takes
padding_free=True but DPOTrainer warns and pads anyway ("temporarily unavailable after a
refactor"); `trl-live-pf` asks for it, and its checks print padding_free_in_effect. `--variants`
runs a subset, e.g. `--variants ours,ours-pf,trl`.

Shared prompts (`-noshare` variants): ours by default computes each distinct prompt of a GRPO group
or a DPO pair once and gives its keys and values to every row (shared_prompt.py); `ours-noshare`
and `ours-live-noshare` pass --no-shared_prompt, every row computing its prompt as TRL's does.

TRL is optional (`pip install trl==1.16.0 torch==2.13.0`); without it this prints
"trl is not installed; skipped" and exits 0.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from bench import lengths as length_dists  # noqa: E402
from bench import util  # noqa: E402
from bench.steps import exact_alphabet, gpu_memory, make_data, run_case  # noqa: E402
from plumbing import models  # noqa: E402

GRPO_BETA, DPO_BETA = 0.04, 0.1
TARGETS = {"grpo": 1.5, "dpo": 1.3}  # ours / TRL tokens/s wanted, like for like, at equal or lower memory
VARIANTS = {  # name -> (side, settings) of every case run, in this order; -pf: padding-free (packed) forwards,
    # -noshare: every row's prompt computed (--no-shared_prompt; ours shares a group's or a pair's prompt by default)
    "grpo": {"ours": ("ours", {"padding_free": False, "shared_prompt": True}),
             "ours-noshare": ("ours", {"padding_free": False, "shared_prompt": False}),
             "ours-pf": ("ours", {"padding_free": True, "shared_prompt": True}),
             "ours-compile": ("ours", {"compile": True, "padding_free": False, "shared_prompt": True}),
             "trl": ("trl", {"gc": False}),  # GRPOTrainer 1.16 has no padding-free forward: no trl-pf
             "trl-gc": ("trl", {"gc": True})},
    "dpo": {"ours-live": ("ours", {"precompute": False, "padding_free": False, "shared_prompt": True}),
            "ours-live-noshare": ("ours", {"precompute": False, "padding_free": False, "shared_prompt": False}),
            "ours-live-pf": ("ours", {"precompute": False, "padding_free": True, "shared_prompt": True}),
            "ours-pre": ("ours", {"precompute": True, "padding_free": False, "shared_prompt": True}),
            "ours-pre-pf": ("ours", {"precompute": True, "padding_free": True, "shared_prompt": True}),
            "trl-live": ("trl", {"gc": False, "precompute": False, "padding_free": False}),
            # DPOConfig 1.16 takes padding_free=True but DPOTrainer warns and pads: its checks say so
            "trl-live-pf": ("trl", {"gc": False, "precompute": False, "padding_free": True}),
            "trl-live-gc": ("trl", {"gc": True, "precompute": False, "padding_free": False}),
            "trl-pre": ("trl", {"gc": False, "precompute": True, "padding_free": False})},
}
# (first, second, what, like for like): the tokens/s and memory ratios first / second printed. The second is
# TRL, or our padded run where the pair is ours packed vs padded. The targets apply to the like-for-like ones.
PAIRS = {"grpo": [("ours", "trl", "like for like", True),
                  ("ours-noshare", "trl", "ours computing every row's prompt (--no-shared_prompt) vs TRL", False),
                  ("ours", "ours-noshare", "ours sharing each group's prompt vs computing every row's", False),
                  ("ours-pf", "trl", "ours padding-free vs TRL (padded: GRPOTrainer has no padding-free)", False),
                  ("ours-pf", "ours", "ours padding-free vs ours padded", False),
                  ("ours-compile", "trl", "ours with the rollout's decode step compiled (--compile)", False),
                  ("ours", "trl-gc", "TRL default gradient checkpointing", False)],
         "dpo": [("ours-live", "trl-live", "like for like, live reference", True),
                 ("ours-live-noshare", "trl-live", "ours computing each row's prompt (--no-shared_prompt) vs TRL, live "
                  "reference", False),
                 ("ours-live", "ours-live-noshare", "ours sharing each pair's prompt vs computing each row's, live "
                  "reference", False),
                 ("ours-live-pf", "trl-live-pf", "padding-free asked of both (TRL 1.16 pads anyway), live reference",
                  False),
                 ("ours-live-pf", "trl-live", "ours padding-free vs TRL padded, live reference", False),
                 ("ours-live-pf", "ours-live", "ours padding-free vs ours padded, live reference", False),
                 ("ours-pre", "trl-pre", "like for like, precomputed reference", True),
                 ("ours-pre-pf", "trl-pre", "ours padding-free vs TRL padded, precomputed reference", False),
                 ("ours-pre-pf", "ours-pre", "ours padding-free vs ours padded, precomputed reference", False),
                 ("ours-live", "trl-live-gc", "TRL default gradient checkpointing, live reference", False)]}


def pick_variants(algo, names=None):
    """The variants of `algo` run (--variants, comma-separated; None: all) and the pairs among them."""
    known = list(VARIANTS[algo])
    chosen = known if names is None else [n for n in known if n in names]
    unknown = sorted(set(names or ()) - {n for v in VARIANTS.values() for n in v})
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)}; known: "
                         + "; ".join(f"{a}: {', '.join(v)}" for a, v in VARIANTS.items()))
    if not chosen:
        raise ValueError(f"--variants: none of {algo}'s ({', '.join(known)})")
    return chosen, [pair for pair in PAIRS[algo] if pair[0] in chosen and pair[1] in chosen]


def pair_ratios(runs, first, second, cuda):
    """Tokens/s and peak-memory ratios first / second, one per repeat (runs side by side), their medians."""
    per = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(runs[first], runs[second], strict=True)]
    mem = [mem_of(o, cuda) / mem_of(t, cuda) for o, t in zip(runs[first], runs[second], strict=True)]
    return {"tokens_per_s_ratio": statistics.median(per), "tokens_per_s_ratio_repeats": per,
            "peak_memory_ratio": statistics.median(mem), "peak_memory_ratio_repeats": mem}


# -----------------------------------------------------------------------------
# the model and the data both sides read


def save_model(shape, folder, seed=0):
    """A random-weight GPT-2 of util.SHAPES[shape] with the character tokenizer, or a checkpoint
    (`smollm2`, a folder) with its own tokenizer, saved for both sides."""
    return util.random_checkpoint(shape, folder, seed)


def read_rows(path, columns):
    with open(path) as f:
        return [{c: row[c] for c in columns} for row in map(json.loads, f)]


# -----------------------------------------------------------------------------
# TRL side: runs in a child process (`--child trl_grpo|trl_dpo --spec file.json`)


def _trl_common_args(spec):
    """TrainingArguments both TRL trainers get: ours' optimizer, schedule and precision, no extras."""
    cuda = torch.cuda.is_available()
    return dict(output_dir=spec["tmp"], max_steps=spec["steps"], gradient_accumulation_steps=1,
                learning_rate=spec["lr"], lr_scheduler_type="cosine", warmup_steps=0,  # ours: --warmup_steps 0, cosine
                optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,  # fused AdamW, as ours
                max_grad_norm=1.0, gradient_checkpointing=spec["gc"], bf16=spec["dtype"] == "bf16", fp16=False,
                save_strategy="no", eval_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
                dataloader_num_workers=0, dataloader_pin_memory=cuda, seed=0, disable_dropout=True,
                use_liger_kernel=False, torch_compile=False)


def _timer_callback():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of every optimizer step (generation, forwards, backward, optimizer step), and threads."""

        def __init__(self):
            self.step_s, self.interval_s, self.threads, self.peak_gpu = [], [], [], 0
            self._t0 = self._last_end = None

        def on_step_begin(self, args, state, control, **kw):
            util.sync(args.device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            util.sync(args.device)
            now = time.perf_counter()
            self.step_s.append(now - self._t0)
            if self._last_end is not None:  # end to end: also the batch fetch and callbacks between steps
                self.interval_s.append(now - self._last_end)
            self._last_end = now
            self.threads.append(torch.get_num_threads())
            trainer = getattr(self, "trainer", None)
            if trainer is not None and hasattr(trainer, "_metrics"):  # TRL's own figure, before log() clears it
                self.trl_mean_length = list(trainer._metrics["train"].get("completions/mean_length", []))
            if torch.cuda.is_available():
                self.peak_gpu = torch.cuda.max_memory_allocated()

    return StepTimer()


def _model_checks(trainer, timer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    ref = getattr(trainer, "ref_model", None)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {"optimizer_steps": trainer.state.global_step, "gradient_checkpointing": model.is_gradient_checkpointing,
            "param_dtype": str(next(model.parameters()).dtype), "bf16": trainer.args.bf16,
            "ref_param_dtype": None if ref is None else str(next(ref.parameters()).dtype),
            "mixed_precision": str(trainer.accelerator.mixed_precision), "device": str(trainer.args.device),
            # Accelerate keeps the unwrapped forward here when it wraps the model's forward in autocast
            "forward_autocast": hasattr(model, "_original_forward"),
            "ref_forward_autocast": None if ref is None else hasattr(ref, "_original_forward"),
            "optimizer": type(opt).__name__,
            "optimizer_defaults": {k: opt.defaults.get(k) for k in ("lr", "betas", "fused", "foreach")},
            "weight_decay_of_param_groups": sorted({g["weight_decay"] for g in opt.param_groups}),
            "lr_scheduler": type(trainer.lr_scheduler).__name__, "torch_threads": sorted(set(timer.threads))}


def child_trl_grpo(spec):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import tasks

    tok = models.load_tokenizer(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list(read_rows(spec["data"], ["prompt", "reward_fn"]))
    calls = []  # one entry per generation (= per optimizer step here): token counts TRL produced

    def digits(prompts, completions, completion_ids, reward_fn, **kwargs):
        """The same rule reward as ours (tasks.REWARD_FNS[reward_fn column]) in TRL's signature."""
        calls.append({"rows": len(prompts), "prompt_tokens": sum(len(tok(p)["input_ids"]) for p in prompts),
                      "completion_tokens": sum(len(c) for c in completion_ids)})
        return [tasks.REWARD_FNS[f](p, c) for f, p, c in zip(reward_fn, prompts, completions)]

    phases = {"rollout": [], "generate_and_score": []}

    class TimedGRPOTrainer(GRPOTrainer):
        """Phase times comparable to ours' time/rollout (sampling only) and the rest of the step."""

        def _generate_single_turn(self, *args, **kwargs):
            util.sync(self.accelerator.device)
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            util.sync(self.accelerator.device)
            phases["rollout"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, *args, **kwargs):  # rollout, reward, reference log-probs
            util.sync(self.accelerator.device)
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            util.sync(self.accelerator.device)
            phases["generate_and_score"].append(time.perf_counter() - t0)
            return out

    B, G = spec["batch_size"], spec["group_size"]
    args = GRPOConfig(**_trl_common_args(spec), per_device_train_batch_size=B * G, num_generations=G,
                      steps_per_generation=1, num_iterations=1,  # one rollout feeds exactly one optimizer step
                      max_completion_length=spec["response_len"], temperature=1.0, top_p=1.0, top_k=0,
                      beta=GRPO_BETA, epsilon=0.2, epsilon_high=0.28,  # ours: --epsilon_low 0.2 --epsilon_high 0.28
                      loss_type="dapo",  # token-level mean over the global batch = ours token_mean
                      scale_rewards="group", mask_truncated_completions=False, importance_sampling_level="token",
                      use_vllm=False, log_completions=False, remove_unused_columns=False)
    timer = _timer_callback()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[digits], args=args, train_dataset=train,
                               processing_class=tok, callbacks=[timer])
    timer.trainer = trainer
    trainer.train()
    checks = _model_checks(trainer, timer) | {
        "num_generations": trainer.num_generations, "per_device_train_batch_size": args.per_device_train_batch_size,
        "steps_per_generation": args.steps_per_generation, "generation_batch_size": args.generation_batch_size,
        "num_iterations": trainer.num_iterations, "max_completion_length": trainer.max_completion_length,
        "loss_type": trainer.loss_type, "beta": trainer.beta, "ref_model": type(trainer.ref_model).__name__,
        "use_vllm": trainer.use_vllm, "generations": len(calls),
        "rows_per_generation": sorted({c["rows"] for c in calls}),
        "trl_completions_mean_length": getattr(timer, "trl_mean_length", None),
        "num_input_tokens_seen": trainer.state.num_input_tokens_seen}
    return {"step_s": timer.step_s, "interval_s": timer.interval_s, "calls": calls, "peak_gpu_bytes": timer.peak_gpu,
            "phases": phases, "checks": checks}


def child_trl_dpo(spec):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    precompute_s = {}

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):  # runs once, inside __init__
            util.sync(self.accelerator.device)
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            util.sync(self.accelerator.device)
            precompute_s[name] = time.perf_counter() - t0
            return out

    tok = models.load_tokenizer(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    # live: an explicit frozen reference loaded from the same folder; precomputed: none, so that TRL frees it
    # after the precompute (with an explicit one it would keep it for the whole run), as ours does
    ref = None if spec["precompute"] else AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list(read_rows(spec["data"], ["prompt", "chosen", "rejected"]))  # in memory: no cache reuse
    P, R = spec["prompt_len"], spec["response_len"]
    args = DPOConfig(**_trl_common_args(spec), per_device_train_batch_size=spec["batch_size"], beta=DPO_BETA,
                     loss_type=["sigmoid"], label_smoothing=0.0, max_length=P + R, truncation_mode="keep_start",
                     padding_free=spec["padding_free"], precompute_ref_log_probs=spec["precompute"],
                     precompute_ref_batch_size=64,  # ours: --eval_batch_size 64 (its default)
                     use_weighting=False, ld_alpha=None, sync_ref_model=False, activation_offloading=False)
    timer = _timer_callback()
    trainer = TimedDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=train, processing_class=tok,
                              callbacks=[timer])
    lengths = {k: sorted({len(x) for x in trainer.train_dataset[k]})  # token lengths TRL will train on
               for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
    trainer.train()
    checks = _model_checks(trainer, timer) | {
        "per_device_train_batch_size": args.per_device_train_batch_size, "beta": trainer.beta,
        "loss_type": trainer.loss_types, "max_length": args.max_length, "padding_free": args.padding_free,
        "padding_free_in_effect": trainer.padding_free,  # 1.16: False whatever was asked (it warns and pads)
        "precompute_ref_log_probs": args.precompute_ref_log_probs,
        "ref_model_in_training": type(trainer.ref_model).__name__, "token_lengths": lengths}
    return {"step_s": timer.step_s, "interval_s": timer.interval_s, "precompute_s": precompute_s.get("train"),
            "peak_gpu_bytes": timer.peak_gpu, "checks": checks}


def child_imports(side):
    """Peak RSS of the imports alone: the floor under each side's figure."""
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    if side == "trl":
        import trl  # noqa: F401
        from trl import DPOTrainer, GRPOTrainer  # noqa: F401
    else:
        import dpo  # noqa: F401
        import grpo  # noqa: F401
    return {}


# -----------------------------------------------------------------------------
# parent: run every case in a fresh process


def ours_argv(algo, settings, a, model_dir, rows_file, out_dir, steps):
    """Our script's command line for the same work as TRL's config above. TRL evaluates nothing; ours
    evaluates one held-out row before step 1 (the least it takes), outside the timed steps, so that
    its generation adds little to the wall time and its logits nothing to the peak memory."""
    argv = ["--model", model_dir, "--dataset", rows_file, "--out_dir", out_dir, "--overwrite", "--steps", str(steps),
            "--max_prompt_len", str(a.prompt_len), "--lr", str(a.lr), "--warmup_steps", "0", "--grad_clip", "1.0",
            "--weight_decay", "0", "--grad_accum", "1", "--eval_every", "1000000"]
    if algo == "grpo":
        argv += ["--prompts_per_step", str(a.batch_size), "--group_size", str(a.group_size),
                 "--max_new_tokens", str(a.response_len), "--num_iterations", "1", "--num_mini_batches", "1",
                 "--beta", str(GRPO_BETA), "--temperature", "1.0", "--top_k", "0", "--top_p", "1.0",
                 "--epsilon_low", "0.2", "--epsilon_high", "0.28", "--loss_agg", "token_mean", "--kl_estimator", "k3",
                 "--scale_rewards", "group", "--n_eval", "1", "--n_eval_pairs", "1"]
        argv += ["--compile"] if settings.get("compile") else []
    else:
        argv += ["--batch_size", str(a.batch_size), "--max_response_len", str(a.response_len), "--beta", str(DPO_BETA),
                 "--eval_dataset", rows_file,  # train on every row, as TRL does (no hash split)
                 "--loss_type", "sigmoid", "--label_smoothing", "0", "--eval_batch_size", "64", "--n_eval", "1",
                 "--n_eval_prompts", "1", "--precompute_ref" if settings["precompute"] else "--no-precompute_ref"]
    for flag in ("padding_free", "shared_prompt"):  # explicit, whatever the defaults; None: the script's default
        if settings[flag] is not None:
            argv.append(f"--{flag}" if settings[flag] else f"--no-{flag}")
    return [f"{algo}.py", *argv]


def read_ours(out_dir, log_path):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        all_rows = list(map(json.loads, f))
    rows = [r for r in all_rows if r["step"] >= 1]  # step 0: the evaluation before training
    key = "time/step"
    peak_gib, mem_phases = gpu_memory(all_rows)  # None, {} on CPU
    res = {"step_s": [r[key] for r in rows], "time_key": key,
           "phases": {k.split("/", 1)[1]: [r[k] for r in rows] for k in rows[-1] if k.startswith("time/") and k != key},
           "mean_length": [r.get("completions/mean_length") for r in rows],
           "peak_gpu_bytes": (peak_gib or 0) * 2**30, "peak_gpu_gib_phases": mem_phases}
    with open(log_path) as f:
        log = f.read()
    m = re.search(r"reference log-probs of (\d+) train pairs in ([\d.]+)s", log)
    res["precompute_s"] = float(m.group(2)) if m else None
    with open(os.path.join(out_dir, "run_config.json")) as f:
        cfg = json.load(f)
    keys = ("steps", "prompts_per_step", "group_size", "num_iterations", "num_mini_batches", "grad_accum", "batch_size",
            "max_prompt_len", "max_new_tokens", "max_response_len", "beta", "temperature", "loss_agg", "loss_type",
            "precompute_ref", "activation_checkpointing", "padding_free", "lr", "warmup_steps", "weight_decay",
            "grad_clip")
    header = re.search(r"^(grpo|dpo): .*$", log, re.M)  # the script's own account of its batch arithmetic
    res["checks"] = {"logged_steps": len(rows), "config": {k: cfg[k] for k in keys if k in cfg},
                     "header": header.group(0) if header else None,
                     # --padding_free asked and not turned off by the model check (common.use_packing's note)
                     "packed": bool(cfg.get("padding_free")) and "note: --padding_free off" not in log,
                     "torch_threads_env": os.environ.get("OMP_NUM_THREADS")}
    return res


def run_variant(algo, name, side, settings, a, model_dir, rows_file, tmp, dtype, rep=0):
    tag = f"{algo}-{name}-{os.path.basename(model_dir)}-r{rep}"
    out_dir, log = os.path.join(tmp, tag), os.path.join(tmp, tag + ".log")
    steps = a.steps + 1  # one warm-up step, left out
    t0 = time.time()
    if side == "ours":
        peak_rss = run_case(ours_argv(algo, settings, a, model_dir, rows_file, out_dir, steps), log)
        res = read_ours(out_dir, log)
    else:
        spec = {"model": model_dir, "data": rows_file, "tmp": out_dir, "steps": steps, "lr": a.lr, "dtype": dtype,
                "batch_size": a.batch_size, "group_size": a.group_size, "prompt_len": a.prompt_len,
                "response_len": a.response_len, "gc": settings["gc"], "precompute": settings.get("precompute", False),
                "padding_free": settings.get("padding_free", False)}
        spec_path, res_path = out_dir + ".spec.json", out_dir + ".result.json"
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        peak_rss = run_case([os.path.relpath(__file__, util.ROOT), "--child", f"trl_{algo}", "--spec", spec_path,
                             "--result", res_path], log)
        with open(res_path) as f:
            res = json.load(f)
    shutil.rmtree(out_dir, ignore_errors=True)  # a checkpoint of GPT-2 small per run would fill the disk
    times = res["step_s"]
    if len(times) != steps:
        raise RuntimeError(f"{tag}: {len(times)} step times for {steps} steps (see {log})")
    step_s = statistics.median(times[1:])
    B, G, P, R = a.batch_size, a.group_size, a.prompt_mean, a.response_mean  # the means of the rows (fixed: theirs)
    if algo == "grpo":  # rows x (prompt + the completion tokens this side actually produced), timed steps only
        if side == "ours":
            mean_len = statistics.mean(res["mean_length"][1:])
            tokens = B * G * (P + mean_len)
        else:
            calls = res["calls"][1:]
            mean_len = sum(c["completion_tokens"] for c in calls) / sum(c["rows"] for c in calls)
            tokens = statistics.mean(c["prompt_tokens"] + c["completion_tokens"] for c in calls)
    else:  # chosen and rejected, prompt + response (EOS included) each: no padding in these rows
        mean_len, tokens = R, 2 * B * (P + R)
    phases = {k: statistics.median(v[1:]) for k, v in (res.get("phases") or {}).items() if len(v) == steps}
    case = {"algo": algo, "variant": name, "side": side, "settings": settings, "step_seconds": step_s,
            "phase_seconds": phases,
            "step_seconds_all": times, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "mean_completion_len": mean_len, "peak_rss_bytes": peak_rss, "peak_gpu_bytes": res.get("peak_gpu_bytes"),
            "precompute_s": res.get("precompute_s"), "wall_s": time.time() - t0}
    if res.get("peak_gpu_gib_phases"):  # ours, grpo.py on GPU: peak within the rollout and the update
        case["peak_gpu_gib_phases"] = res["peak_gpu_gib_phases"]
    case["checks"] = res["checks"]
    if side == "trl":
        if res.get("interval_s"):
            case["step_end_to_end_seconds"] = statistics.median(res["interval_s"])
    else:
        case["time_key"] = res["time_key"]
    return case


def mem_of(case, cuda):
    return case["peak_gpu_bytes"] if cuda else case["peak_rss_bytes"]


def order_of(names, pairs):
    """The variants `names` in run order, the two of each pair next to each other where they can be."""
    paired = [n for first, second, _, _ in pairs for n in (first, second)]
    return list(dict.fromkeys(paired + list(names)))


def median_run(runs):
    """A variant's repeats as one case: the run of median seconds per step, with every repeat's."""
    by_time = sorted(runs, key=lambda c: c["step_seconds"])
    return by_time[(len(by_time) - 1) // 2] | {"repeats_step_seconds": [c["step_seconds"] for c in runs]}


def print_table(groups, ratios, cuda):
    mem = "peak GPU GiB" if cuda else "peak RSS GiB"
    for (model, algo), a in groups.items():
        print(f"\n{algo.upper()} on {model} (the median repeat)")
        print(f"  {'variant':12s} {'s/step':>8s} {'tok/s':>9s} {'compl.len':>9s} {mem:>12s} {'precompute s':>12s}")
        for c in a.values():
            pre = f"{c['precompute_s']:.2f}" if c.get("precompute_s") is not None else "-"
            print(f"  {c['variant']:12s} {c['step_seconds']:8.3f} {c['tokens_per_s']:9.0f} "
                  f"{c['mean_completion_len']:9.2f} {mem_of(c, cuda) / 2**30:12.3f} {pre:>12s}")
        for r in (r for r in ratios if (r["model"], r["algo"]) == (model, algo)):
            per = r["tokens_per_s_ratio_repeats"]
            spread = f" (repeats {min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""
            verdict = ""
            if r["like_for_like"]:
                ok = r["tokens_per_s_ratio"] >= TARGETS[algo] and r["peak_memory_ratio"] <= 1.0
                verdict = f"  (target >= {TARGETS[algo]}x at <= memory: {'met' if ok else 'NOT met'})"
            print(f"  {r['ours']} / {r['trl']} ({r['what']}): tokens/s x{r['tokens_per_s_ratio']:.2f}{spread}, "
                  f"memory x{r['peak_memory_ratio']:.2f}{verdict}")


def plot(groups, path, title, cuda):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(groups)
    fig, axes = plt.subplots(2, len(keys), figsize=(max(6.5, 4.2 * len(keys)), 7), squeeze=False)
    for j, key in enumerate(keys):
        cases = list(groups[key].values())
        names = [c["variant"] for c in cases]
        colors = ["tab:blue" if c["side"] == "ours" else "tab:orange" for c in cases]
        for i, (vals, label) in enumerate((([c["tokens_per_s"] for c in cases], "tokens/s"),
                                           ([mem_of(c, cuda) / 2**30 for c in cases],
                                            "peak GPU memory (GiB)" if cuda else "peak RSS (GiB)"))):
            ax = axes[i][j]
            bars = ax.bar(range(len(cases)), vals, color=colors)
            ax.bar_label(bars, fmt="%.3g" if i else "%.0f", fontsize=8)
            ax.set_xticks(range(len(cases)), names, rotation=20, fontsize=9)
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
            if i == 0:
                ax.set_title(f"{key[1].upper()}, {key[0]}", fontsize=10)
    fig.suptitle(f"Ours (blue) vs TRL (orange), whole training steps\n{title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", default="grpo,dpo")
    p.add_argument("--models", default="tiny,gpt2-small-random")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps (one more runs first as warm-up)")
    p.add_argument("--batch_size", type=int, default=8, help="GRPO prompts per step / DPO pairs per step")
    p.add_argument("--group_size", type=int, default=4, help="GRPO completions per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--response_len", type=int, default=32,
                   help="GRPO max new tokens / DPO response tokens (EOS included)")
    p.add_argument("--lengths", default="fixed", choices=length_dists.KINDS,
                   help="each row's prompt and response lengths (bench/lengths.py): fixed (--prompt_len + "
                        "--response_len), arith (SmolLM2's arithmetic chat task) or tldr (TL;DR's long-tailed shape)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tag", default="", help="suffix of the results file name (bench/results/trl[-TAG]-cpu.json)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every child (default: torch's)")
    p.add_argument("--repeats", type=int, default=3,
                   help="run every variant this many times, ours and TRL alternating (ABBA); each ratio is the median "
                        "of the repeats' ratios, their range shown")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: fp32 on CPU, bf16 (autocast, fp32 weights) on a GPU that supports it: the "
                        "precision ours runs in, and the only one accepted")
    p.add_argument("--variants", default=None, type=lambda s: s.split(","),
                   help="comma-separated variants to run (default: all; see VARIANTS), e.g. "
                        "ours,ours-pf,trl,ours-live,ours-live-pf,trl-live; pairs whose two variants both run are reported")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        for algo in a.algos.split(","):
            pick_variants(algo, a.variants)
    except (ValueError, KeyError) as e:
        p.error(str(e) if isinstance(e, ValueError) else f"--algos: unknown {e}; one of {', '.join(VARIANTS)}")

    if a.child:  # a TRL case (or an import baseline) in this fresh process
        spec = json.load(open(a.spec)) if a.spec else {}
        fn = {"trl_grpo": child_trl_grpo, "trl_dpo": child_trl_dpo,
              "imports_trl": lambda s: child_imports("trl"), "imports_ours": lambda s: child_imports("ours")}[a.child]
        out = fn(spec)
        if a.result:
            with open(a.result, "w") as f:
                json.dump(out, f)
        return

    try:
        import trl
    except ImportError:
        print("trl is not installed; skipped (pip install trl==1.16.0 torch==2.13.0)")
        return

    device = util.default_device()
    cuda = device.type == "cuda"
    dtype = a.dtype if a.dtype != "auto" else ("bf16" if cuda else "fp32")
    # ours has no precision flag: bf16 autocast on a GPU that supports it, fp32 on CPU; TRL must match
    if dtype != ("bf16" if common.bf16_supported(device) else "fp32"):
        p.error(f"--dtype {dtype}: our scripts run {'bf16' if common.bf16_supported(device) else 'fp32'} on "
                f"{device.type}, so TRL is run in the same precision only")
    if a.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    os.environ["TQDM_DISABLE"] = "1"
    dist = {}  # per algorithm: each row's lengths; the limits both sides get are the longest of any
    for algo in a.algos.split(","):
        n_rows = 512 if algo == "grpo" else a.batch_size * (a.steps + 1)  # see below
        dist[algo] = length_dists.row_lengths(a.lengths, n_rows, a.prompt_len, a.response_len)
    if a.lengths != "fixed":
        a.prompt_len = max(p for rows in dist.values() for p, _ in rows)
        a.response_len = max(r for rows in dist.values() for _, r in rows)
    print(f"lengths {a.lengths}: " + ", ".join(f"{algo} {json.dumps(length_dists.summary(rows, a.batch_size))}"
                                              for algo, rows in dist.items()), flush=True)
    print(f"trl {trl.__version__}, torch {torch.__version__}, {util.device_name(device)}, {dtype}; "
          f"B={a.batch_size} G={a.group_size} P={a.prompt_len} R={a.response_len}, {a.steps} timed steps + 1 warm-up",
          flush=True)
    groups, all_runs, baselines, ratios = {}, [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("ours", "trl"):
            baselines[side] = run_case([os.path.relpath(__file__, util.ROOT), "--child", f"imports_{side}"],
                                       os.path.join(tmp, f"imports-{side}.log"))
        print(f"peak RSS of the imports alone: ours {baselines['ours'] / 2**30:.3f} GiB, "
              f"TRL {baselines['trl'] / 2**30:.3f} GiB", flush=True)
        for model in a.models.split(","):
            model_dir = os.path.join(tmp, model)
            n_params = save_model(model, model_dir)
            for algo in a.algos.split(","):
                # DPO: ours precomputes the reference over the whole file, so it holds just the rows trained on
                n_rows = 512 if algo == "grpo" else a.batch_size * (a.steps + 1)
                rows_file = make_data(os.path.join(tmp, f"{algo}-rows.jsonl"), n_rows, a.prompt_len, a.response_len,
                                      alphabet=exact_alphabet(models.load_tokenizer(model_dir)), lengths=dist[algo])
                a.prompt_mean = statistics.mean(p for p, _ in dist[algo])
                a.response_mean = statistics.mean(r for _, r in dist[algo])
                names, pairs = pick_variants(algo, a.variants)
                runs = {name: [] for name in names}
                for rep in range(a.repeats):
                    # ours and TRL alternate, and the order flips every repeat (ABBA): a slow spell of the
                    # machine, or a drift, then weighs on both sides of every ratio alike
                    for name in (order_of(names, pairs) if rep % 2 == 0 else order_of(names, pairs)[::-1]):
                        side, settings = VARIANTS[algo][name]
                        case = run_variant(algo, name, side, settings, a, model_dir, rows_file, tmp, dtype, rep)
                        case |= {"model": model, "params": n_params, "repeat": rep}
                        runs[name].append(case)
                        all_runs.append(case)
                        print(f"{algo:4s} {model:18s} {name:12s} {case['step_seconds']:8.3f} s/step "
                              f"{case['tokens_per_s']:9.0f} tok/s  compl.len {case['mean_completion_len']:5.1f}  "
                              f"peak {'GPU' if cuda else 'RSS'} {mem_of(case, cuda) / 2**30:6.3f} GiB  "
                              f"({case['wall_s']:.0f}s)"
                              + "".join(f"  {k} {v:.3f}s" for k, v in case["phase_seconds"].items()), flush=True)
                        if rep == 0:
                            who = "TRL" if side == "trl" else "ours"
                            print(f"     {who} ran: {json.dumps(case['checks'])}", flush=True)
                groups[(model, algo)] = {name: median_run(r) for name, r in runs.items()}
                for first, second, what, like in pairs:  # one ratio per repeat, from runs side by side
                    ratios.append({"model": model, "algo": algo, "ours": first, "trl": second, "what": what,
                                   "like_for_like": like} | pair_ratios(runs, first, second, cuda))
    print_table(groups, ratios, cuda)
    config = {k: v for k, v in vars(a).items() if k not in ("child", "spec", "result", "prompt_mean", "response_mean")}
    config |= {"grpo_beta": GRPO_BETA, "dpo_beta": DPO_BETA}
    payload = {"trl": trl.__version__, "dtype": dtype, "config": config,
               "lengths": {algo: length_dists.summary(rows, a.batch_size) for algo, rows in dist.items()},
               "targets": TARGETS, "imports_peak_rss_bytes": baselines,
               "cases": [c for g in groups.values() for c in g.values()], "all_runs": all_runs, "ratios": ratios}
    path = util.write_results("trl" + (f"-{a.lengths}" if a.lengths != "fixed" else "") + (f"-{a.tag}" if a.tag else ""),
                              payload, device)
    plot(groups, path.replace(".json", ".png"),
         f"B={a.batch_size} G={a.group_size} P={a.prompt_len} R={a.response_len} ({a.lengths} lengths), {dtype}, "
         f"{util.device_name(device)}",
         cuda)
    print(f"\nwrote {path} and {path.replace('.json', '.png')}")


if __name__ == "__main__":
    main()
