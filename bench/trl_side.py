"""TRL 1.16's side of a race, run in a process of its own (`python -m bench.trl_side SPEC RESULT`): its
GRPOTrainer or DPOTrainer on the model folder and rows ours reads, each optimizer step timed by a
callback between two device syncs, and what it ran (dtypes, autocast, optimizer, checkpointing) for
the record; and `--check`: a one-step GRPO and DPO trainer built on a tiny model, naming the package
that is missing where one cannot be (accelerate, pyarrow, datasets ...), not only whether trl imports.

Matched to ours (`trl`): gradient checkpointing off and ours' fused AdamW (betas 0.9, 0.95), cosine
schedule without warm-up, fp32 on a CPU and bf16 autocast over fp32 weights on a GPU (`bf16=True`: as
ours' common.autocast). At its own defaults (`trl-defaults`): GRPOConfig's and DPOConfig's, gradient
checkpointing on, AdamW's betas (0.9, 0.999), GRPO's beta 0 (no reference model), DPO's live reference;
the workload (batch, lengths, steps, learning rate) is the race's on both.
"""
import json
import os
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from bench import harness


def config_args(spec):
    """The TrainingArguments of spec: the workload always, ours' optimizer and no checkpointing unless
    spec["defaults"] (TRL's own), and the flags of a `trl --FLAG` variant translated."""
    cuda = torch.cuda.is_available()
    args = dict(output_dir=spec["out_dir"], max_steps=spec["steps"], learning_rate=spec["lr"], seed=0,
                bf16=spec["dtype"] == "bf16", save_strategy="no", eval_strategy="no", logging_strategy="no",
                report_to="none", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=cuda)
    if not spec["defaults"]:
        args |= dict(gradient_checkpointing=False, optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.95,
                     weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=0)
    flags = spec["flags"]
    args |= {"gradient_checkpointing": True} if "--activation_checkpointing" in flags else {}
    return args


class StepTimer(TrainerCallback):
    """Each optimizer step's wall time (generation, forwards, backward, the optimizer), and the peak."""

    def __init__(self, device):
        self.device, self.step_s, self.peak_gpu = device, [], 0

    def on_step_begin(self, args, state, control, **kw):
        harness.sync(self.device)
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        harness.sync(self.device)
        self.step_s.append(time.perf_counter() - self.t0)
        self.peak_gpu = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0


def what_ran(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    ref = getattr(trainer, "ref_model", None)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {"optimizer_steps": trainer.state.global_step, "gradient_checkpointing": model.is_gradient_checkpointing,
            "param_dtype": str(next(model.parameters()).dtype), "mixed_precision": str(trainer.accelerator.mixed_precision),
            "forward_autocast": hasattr(model, "_original_forward"),  # Accelerate's autocast wrapper keeps the original
            "reference": None if ref is None else str(next(ref.parameters()).dtype),
            "optimizer": type(opt).__name__, "betas": opt.defaults.get("betas"), "fused": opt.defaults.get("fused"),
            "beta": trainer.beta, "torch_threads": torch.get_num_threads()}


def run(spec):
    """One TRL run of spec (bench/steps.py writes it): per-step seconds, token counts, peak, what ran."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    device = harness.device_of()
    tok = harness.models.load_tokenizer(spec["model"])
    load = lambda: AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)  # noqa: E731
    with open(spec["data"]) as f:
        rows = [json.loads(line) for line in f]
    timer, out, flags = StepTimer(device), {}, spec["flags"]
    if spec["script"] == "grpo":
        calls = []

        def digits(prompts, completions, completion_ids, reward_fn, **kwargs):
            """Ours' rule reward (tasks.REWARD_FNS by the row's column) in TRL's signature; counts the tokens."""
            calls.append([sum(len(tok(p)["input_ids"]) for p in prompts), sum(len(c) for c in completion_ids)])
            return [harness.tasks.REWARD_FNS[f](p, c) for f, p, c in zip(reward_fn, prompts, completions)]

        B, G = spec["rows"], spec["group_size"]
        # TRL 1.16's defaults are ours' for a model of your own: one pass of one mini-batch a rollout (one
        # optimizer step), temperature 1, no top-p or top-k, epsilon 0.2 both ways, DAPO's token mean, beta 0
        args = GRPOConfig(**config_args(spec), per_device_train_batch_size=B * G, num_generations=G,
                          max_completion_length=spec["response_len"], beta=spec["beta"] or 0.0, use_vllm=False,
                          log_completions=False, remove_unused_columns=False)
        data = Dataset.from_list([{"prompt": r["prompt"], "reward_fn": r["reward_fn"]} for r in rows])
        trainer = GRPOTrainer(model=load(), reward_funcs=[digits], args=args, train_dataset=data,
                              processing_class=tok, callbacks=[timer])
        trainer.train()
        out["tokens"] = [p + c for p, c in calls]
        out["completion_len"] = [c / (B * G) for _, c in calls]
    elif spec["script"] == "dpo":
        precompute = "--precompute_ref" in flags
        args = DPOConfig(**config_args(spec), per_device_train_batch_size=spec["rows"],
                         beta=spec["beta"] if spec["beta"] is not None else 0.1,
                         max_length=spec["prompt_len"] + spec["response_len"], truncation_mode="keep_start",
                         precompute_ref_log_probs=precompute, padding_free="--padding_free" in flags)
        data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
        # a live reference loaded as ours loads it; precomputed: none kept, so that TRL frees it as ours does
        t0 = time.perf_counter()
        trainer = DPOTrainer(model=load(), ref_model=None if precompute else load(), args=args, train_dataset=data,
                             processing_class=tok, callbacks=[timer])
        out["precompute_s"] = time.perf_counter() - t0 if precompute else None
        trainer.train()
        out["padding_free_in_effect"] = trainer.padding_free  # 1.16 takes the flag, warns and pads
    else:
        raise SystemExit(f"trl: {spec['script']}.py has no TRL side here (grpo and dpo)")
    return out | {"step_s": timer.step_s, "peak_gpu_bytes": timer.peak_gpu, "what_ran": what_ran(trainer)}


def check():
    """A one-step GRPO and DPO trainer on the tiny model, each built and run: {"ok", "missing", "error"}."""
    with tempfile.TemporaryDirectory() as work:
        try:
            folder = harness.model_folder("tiny", work)
            data = harness.make_data(os.path.join(work, "rows.jsonl"), [(8, 4)] * 8)
            for script in ("grpo", "dpo"):
                run(dict(script=script, model=folder, data=data, out_dir=os.path.join(work, script), steps=1, lr=1e-6,
                         beta=None, rows=2, group_size=2, prompt_len=8, response_len=4, flags=[],
                         defaults=False, dtype="bf16" if torch.cuda.is_available() else "fp32"))
        except ImportError as e:  # ModuleNotFoundError too: its name is the package to carry (docs/gpu.md)
            return {"ok": False, "missing": e.name or str(e), "error": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001  what failed, named, for the race's rows
            return {"ok": False, "missing": None, "error": f"{type(e).__name__}: {str(e)[-500:]}"}
    import trl

    return {"ok": True, "missing": None, "error": None, "trl": trl.__version__}


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    if sys.argv[1] == "--check":
        result = check()
    else:
        with open(sys.argv[1]) as f:
            result = run(json.load(f))
    with open(sys.argv[-1], "w") as f:
        json.dump(result, f)
