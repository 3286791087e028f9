"""Peak host memory per rank while a model is loaded, checkpointed and resumed on several
processes: this repository's way against the way it was done before, side by side in one run.

    python bench/load_memory.py                      # GPT-2 large (774M, fp32), 2 processes, CPU
    python bench/load_memory.py --layers 12 --width 768 --heads 12     # GPT-2 small

- "rank 0 reads" (models.load_model(..., d) + shard_model): rank 0 reads the weights, the
  other ranks build the model on the meta device and receive their shards by broadcast. The
  training state is a sharded torch.distributed.checkpoint: each rank writes and reads only
  its shards.
- "every rank reads" (before): every rank reads the whole model, then shards it; the optimizer
  state is gathered whole to rank 0 and written with torch.save, and on resume every rank
  torch.loads all of it.

Each phase is a fresh measurement of the peak resident set (VmHWM, reset between phases by
/proc/self/clear_refs), in GiB, per rank. The model is built from a GPT-2 config and saved once
into --dir (its weights are random: memory does not depend on them). CPU, gloo: the host side
of what a GPU run does (on a GPU the same copies sit in host memory before moving).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import checkpoints, models, rundir  # noqa: E402


def peak_gib():
    """The peak resident set since the last reset, GiB (Linux)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return kb / 2**20


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def worker(mode, folder, out):
    import torch
    import torch.distributed as dist

    import common
    import data

    d = common.setup_distributed()
    torch.manual_seed(0)

    def report(phase):  # a line per phase: a run the kernel kills keeps what it measured
        print("ROW " + json.dumps({"mode": mode, "rank": d.rank, "phase": phase, "gib": peak_gib()}), flush=True)

    reset_peak()
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok, d=d if mode == "rank0" else None)
    model = common.shard_model(model, d)
    report("load")
    optimizer, scheduler = common.make_optimizer(model.parameters(), 1e-5, 0.0, 0, 10)
    ids = torch.randint(0, len(tok), (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    common.optimizer_step(model, optimizer, scheduler, 1.0)  # Adam moments exist from here
    order = data.DataOrder(8, 0)
    reset_peak()
    if mode == "rank0":
        checkpoints.save_checkpoint(model, tok, out, d, optimizer, scheduler, 1, order)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        checkpoints.save_checkpoint(model, tok, out, d)  # the export, as before: gathered to rank 0
        full = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if d.is_main:
            torch.save({"optimizer": full}, os.path.join(out, "checkpoint", "training_state.pt"))
        del full
        dist.barrier()
    report("save")
    reset_peak()
    if mode == "rank0":
        checkpoints.load_training_state(os.path.join(out, "checkpoint"), model, optimizer, scheduler, order, d)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = torch.load(os.path.join(out, "checkpoint", "training_state.pt"), weights_only=True, map_location="cpu")
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
        del state
    report("resume")
    del model, optimizer
    dist.barrier()
    rundir.release()


def build(folder, layers, width, heads):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return
    tok = models.load_tokenizer("tiny")
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/load_memory")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    folder = os.path.join(args.dir, f"gpt2-{args.layers}x{args.width}")
    build(folder, args.layers, args.width, args.heads)
    n_params = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    print(f"model: GPT-2 {args.layers} layers x {args.width} ({n_params / 2**30:.2f} GiB of fp32 weights), "
          f"{args.nproc} processes")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    rows = []
    for mode in ("every", "rank0"):
        out = os.path.join(args.dir, f"run-{mode}")
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                            os.path.abspath(__file__), "--worker", mode, folder, out],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        rows += [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW ")]
        killed = "Signal 9" in r.stderr or "SIGKILL" in r.stderr
        print(f"  {mode}: {time.time() - t0:.0f} s, exit {r.returncode}{' (a rank was killed: out of memory)' if killed else ''}")
        if r.returncode != 0 and not killed:
            sys.exit(r.stdout[-3000:] + r.stderr[-5000:])
    names = {"every": "every rank reads (before)", "rank0": "rank 0 reads, sharded state (now)"}
    got = {(r["mode"], r["rank"], r["phase"]): r["gib"] for r in rows}
    print("\n| way | rank | load + shard | save (export + training state) | resume |\n|---|---|---|---|---|")
    for mode in ("every", "rank0"):
        for rank in range(args.nproc):
            cells = [f"{got[mode, rank, ph]:.2f}" if (mode, rank, ph) in got else "killed (out of memory)"
                     for ph in ("load", "save", "resume")]
            print(f"| {names[mode]} | {rank} | " + " | ".join(cells) + " |")
    print(f"\npeak resident set per phase and rank, GiB ({os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB machine)")


if __name__ == "__main__":
    main()
