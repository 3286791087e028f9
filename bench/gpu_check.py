"""One command that proves the GPU path: correctness runs first, then the benchmarks in bf16.

On a machine with a CUDA GPU (under 20 minutes on one H100):

    python bench/gpu_check.py                  # everything below; a summary table at the end
    python bench/gpu_check.py --only checks    # the runs that must work (no benchmarks)
    python bench/gpu_check.py --only bench     # the benchmarks alone

Checks, each a real run of a script whose metrics are read back:
1. the embedded pipeline (`python pipeline.py`, every stage, its tables);
2. GRPO with every knob that touches devices: reward model + rule weights, global
   normalisation, batch reward scaling, rejection sampling, top-p, an entropy bonus, activation
   checkpointing, reference refresh and the compiled (CUDA-graph) decode step;
3. GRPO with `--lora` and `--kl_in_reward`;
4. `torchrun --nproc_per_node 1` (FSDP2 of one) with `--offload_frozen`, killed right after
   its first checkpoint (tests/crash.py) and resumed: every step logged once, the checkpoint loads;
5. learning rate 0, under `python` (autocast) and under torchrun (FSDP2's bf16 parameters):
   the policy never moves, so KL to the reference and the clip ratios must be ~0 (bf16 logits
   give KL ~1e-3 and spurious clipping; the LM head runs in fp32: common.FP32Head).
Benchmarks (bench/*.py, results in bench/results/*-cuda.json naming the GPU): the sampler
against model.generate, whole steps of every script with MFU against the measured bf16 matmul
peak and peak GPU memory, log-prob gathering, GRPO and DPO against TRL, DPO on GPT-2 large.

Without a GPU it refuses, unless `--cpu`: checks 2, 3 and 5 on the random tiny model (what
tests/test_gpu_path.py runs), so that the command itself is tested.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
LR0_TOL = {"kl": 1e-4, "clip_ratio/low": 1e-3, "clip_ratio/high": 1e-3}  # lr 0: the policy is the reference


def run(cmd, log, timeout=1800, ok=(0,)):
    """Run a command from the repo root; stream its output to `log`; raise naming the log on failure."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if code not in ok:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited {code} (log {log}):\n{tail}")
    return time.time() - t0


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *args]


def checks(tmp, cpu, pipeline=True):
    """The runs that must work on a GPU. Returns rows (name, seconds, what was verified)."""
    py = [sys.executable]
    rows = []
    if cpu:  # the random tiny policy and a reward model trained for two steps: the runs are what is checked
        policy, rm = "tiny", os.path.join(tmp, "rm")
        run(py + ["reward.py", "--model", "tiny", "--out_dir", rm, "--steps", "2", "--batch_size", "8",
                  "--n_train", "64", "--n_eval", "8", "--eval_every", "1000", "--no-normalize"], rm + ".log")
    elif not pipeline:  # a small SFT policy and reward model to start from, as the pipeline would give
        policy = os.path.join(tmp, "sft")
        run(py + ["sft.py", "--out_dir", policy, "--steps", "30", "--n_train", "512", "--n_eval", "8",
                  "--eval_every", "1000"], os.path.join(tmp, "sft.log"))
        rm = os.path.join(tmp, "rm")
        run(py + ["reward.py", "--model", policy, "--out_dir", rm, "--steps", "10", "--n_train", "256",
                  "--n_eval", "16", "--eval_every", "1000", "--no-normalize"], os.path.join(tmp, "rm.log"))
    else:
        runs = os.path.join(tmp, "runs")
        sec = run(py + ["pipeline.py", "--runs", runs], os.path.join(tmp, "pipeline.log"), timeout=1500)
        with open(os.path.join(runs, "results.md")) as f:
            print(f.read(), flush=True)
        rows.append(("pipeline (every stage)", sec, "finished; tables above"))
        policy, rm = os.path.join(runs, "sft"), os.path.join(runs, "rm")
    small = ["--model", policy, "--prompts_per_step", "8", "--group_size", "4", "--n_eval", "16",
             "--n_eval_pairs", "16", "--eval_every", "2"]

    # 2. every knob that touches devices, in one run
    out = os.path.join(tmp, "grpo_knobs")
    argv = py + ["grpo.py", *small, "--out_dir", out, "--steps", "4", "--reward_model", rm,
                 "--reward_weights", "rule:1.0,model:0.5", "--global_norm", "--scale_rewards", "batch",
                 "--rs_samples", "8", "--top_p", "0.95", "--entropy_coef", "0.01", "--activation_checkpointing",
                 "--ref_refresh_every", "2", "--no_eos_penalty", "0.1"]
    sec = run(argv + ([] if cpu else ["--compile"]), out + ".log")
    m = metrics(out)
    assert [r["step"] for r in m] == list(range(5)), f"{out}: steps {[r['step'] for r in m]}"
    assert all(k in m[-1] for k in ("reward/rule", "reward/model", "entropy", "eval/accuracy")), m[-1].keys()
    rows.append(("GRPO, every device knob" + ("" if cpu else " + --compile"), sec,
                 f"4 steps; reward {m[-1]['reward']:.3f}, kl {m[-1]['kl']:.4f}"))

    # 3. LoRA with the KL in the reward (on a CPU, tests/test_grpo.py::test_script_lora_checkpoint_is_merged
    #    runs these flags)
    if not cpu:
        out = os.path.join(tmp, "grpo_lora")
        sec = run(py + ["grpo.py", *small, "--out_dir", out, "--steps", "2", "--lora", "--kl_in_reward"],
                  out + ".log")
        m = metrics(out)
        assert "reward/kl_penalty" in m[-1], m[-1].keys()
        rows.append(("GRPO --lora --kl_in_reward", sec, f"2 steps; kl penalty {m[-1]['reward/kl_penalty']:.4f}"))

    # 4. FSDP2 of one with offloaded frozen models: killed after its first checkpoint, resumed
    if not cpu:
        out = os.path.join(tmp, "grpo_offload")
        argv = [*small, "--out_dir", out, "--steps", "4", "--save_every", "2", "--reward_model", rm,
                "--offload_frozen", "--eval_every", "4"]
        run(torchrun("tests/crash.py", "after_save:1", "grpo.py", *argv), out + ".log", ok=(1, 9))
        killed_at = max(r["step"] for r in metrics(out))
        sec = run(torchrun("grpo.py", *argv, "--resume"), out + "-resume.log")
        steps = [r["step"] for r in metrics(out)]
        assert steps == list(range(5)), f"{out}: steps after resume {steps}"
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint"))
        rows.append(("torchrun x1, --offload_frozen, kill + --resume", sec,
                     f"killed after step {killed_at}; steps 0-4 once each; checkpoint loads"))

    # 5. learning rate 0: KL and clipping must be ~0 (two passes over two mini-batches: the
    #    old log-probs and the trained ones come from different batch layouts)
    launchers = [("python", py)] + ([] if cpu else [("torchrun x1 (FSDP2 bf16)", torchrun())])
    for name, launcher in launchers:
        out = os.path.join(tmp, "grpo_lr0_" + name.split()[0])
        sec = run(launcher + ["grpo.py", *small, "--out_dir", out, "--steps", "3", "--lr", "0",
                              "--num_iterations", "2", "--num_mini_batches", "2", "--beta", "0.04"], out + ".log")
        m = [r for r in metrics(out) if r["step"] > 0]
        worst = {k: max(abs(r[k]) for r in m) for k in LR0_TOL}
        bad = {k: v for k, v in worst.items() if v > LR0_TOL[k]}
        assert not bad, f"{out}: at lr 0 {bad} exceed {LR0_TOL}"
        rows.append((f"GRPO at lr 0, {name}", sec, ", ".join(f"max {k} {v:.1e}" for k, v in worst.items())))
    return rows


BENCHES = [  # (name, argv): every benchmark in bf16 on the GPU
    ("sampler, GPT-2 small, 16 prompts x G=8, 64 tokens",
     ["bench/sampler.py", "--model", "gpt2-small-random", "--n_prompts", "16", "--G", "8", "--new_tokens", "64",
      "--compile", "--tag", "gpt2-small"]),
    ("sampler, tiny, 8 prompts x G=8, 32 tokens", ["bench/sampler.py", "--compile"]),
    ("whole steps, tiny and GPT-2 small", ["bench/steps.py", "--models", "tiny,gpt2-small-random", "--steps", "6",
                                           "--batch_size", "16"]),
    ("DPO, GPT-2 large", ["bench/steps.py", "--algos", "dpo", "--models", "gpt2-large-random", "--steps", "6",
                          "--batch_size", "16", "--prompt_len", "384", "--response_len", "128", "--tag", "large-dpo"]),
    ("log-prob gathering", ["bench/logprobs.py"]),
    ("GRPO and DPO against TRL, GPT-2 small", ["bench/trl_compare.py", "--models", "gpt2-small-random", "--steps", "4",
                                              "--batch_size", "8", "--group_size", "8", "--prompt_len", "128",
                                              "--response_len", "64", "--tag", "small"]),
]


def benches(tmp):
    rows = []
    for name, argv in BENCHES:
        log = os.path.join(tmp, "bench-" + argv[0].split("/")[1].replace(".py", "") + f"-{len(rows)}.log")
        try:
            sec = run([sys.executable, *argv], log, timeout=900)
            with open(log) as f:
                print(f"--- {name}\n" + "".join(f.readlines()[-12:]), flush=True)
            rows.append((name, sec, "ok: " + " ".join(argv)))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failing benchmark must not hide the rest
            print(f"--- {name} FAILED\n{e}", flush=True)
            rows.append((name, 0.0, "FAILED: see output above"))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["checks", "bench"], help="run one part only")
    p.add_argument("--cpu", action="store_true", help="no GPU: checks 2 and 5 on a tiny model (for the tests)")
    p.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                   help="start the checks from a small SFT run instead of the whole pipeline")
    p.add_argument("--keep", default="", help="keep the runs and logs in this folder instead of a temporary one")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False). Run it on a "
                         "machine with a GPU, or pass --cpu for the small CPU subset.")
    if args.cpu and args.only == "bench":
        raise SystemExit("gpu_check: --cpu runs the checks only; the benchmarks' CPU figures come from bench/*.py")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "CPU"
    print(f"gpu_check on {device}, torch {torch.__version__}", flush=True)
    tmp = args.keep or tempfile.mkdtemp(prefix="gpu_check-")
    os.makedirs(tmp, exist_ok=True)
    t0, rows, failed = time.time(), [], None
    try:
        if args.only != "bench":
            rows += checks(tmp, args.cpu, args.pipeline)
        if args.only != "checks" and not args.cpu:
            rows += benches(tmp)
    except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as e:
        failed = e
    print("\n| check | seconds | result |\n|---|---|---|")
    for name, sec, what in rows:
        print(f"| {name} | {sec:.0f} | {what} |")
    summary = {"device": device, "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M"),
               "total_s": round(time.time() - t0), "rows": rows, "failed": None if failed is None else str(failed)}
    if not args.cpu:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "gpu_check-cuda.json"), "w") as f:
            json.dump(summary, f, indent=1)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    if failed is not None:
        raise SystemExit(f"gpu_check FAILED after {time.time() - t0:.0f}s: {failed}")
    print(f"gpu_check passed in {time.time() - t0:.0f}s on {device}")


if __name__ == "__main__":
    main()
