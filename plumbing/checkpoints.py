"""Checkpoints, Hugging Face native, written so that a kill never leaves a broken one and read so
that a checkpoint folder from elsewhere can run no code: the sharded training state
(torch.distributed.checkpoint) every --save_every steps, the final export (save_pretrained), and
`python -m plumbing export OUT_DIR [DEST]`, the export of a resumable checkpoint."""
import dataclasses
import enum
import functools
import json
import os
import random
import shutil
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

import common
from plumbing import models


RUN_FILES = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "run_config.json")


def write_json(path, obj):
    """Write a JSON file whole or not at all (a temporary file renamed into place)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def trainer_state(folder):
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


WAIT_GROUP = []


def wait_group(d):
    """The gloo group, with a 2-hour timeout, in which ranks wait while rank 0 alone writes files
    (a full export of a large model can outlast --timeout_minutes). Made by cli.start."""
    if d.world_size > 1 and not WAIT_GROUP:
        WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=timedelta(hours=2)))
    return WAIT_GROUP[0] if WAIT_GROUP else None


def wait_for_rank0(d):
    """A barrier for the ranks that wait while rank 0 alone writes files."""
    if d.world_size > 1:
        dist.barrier(group=wait_group(d))


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
                                 f"{damaged(folder)}") from None
            raise


# The classes a checkpoint's .metadata holds (torch.distributed.checkpoint's own, and the torch
# types of its tensors): anything else in the pickle is refused before it is unpickled.
_METADATA_CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")}


def damaged(folder):
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
    so. Returns the metadata. Python 3.11.2 (Debian 12's) pickles the enum member it holds as
    builtins.getattr(enum class, name): getattr is admitted for exactly that, a member of an
    allowed enum by its name, and nothing else (tests/fixtures/dcp_metadata-*.pickle)."""
    import pickle

    class Refused(pickle.UnpicklingError):
        pass

    def enum_member(cls, name):  # how Python 3.11.2 (not 3.11.7) pickles an enum member: getattr(cls, name)
        if isinstance(cls, enum.EnumMeta) and (cls.__module__, cls.__qualname__) in _METADATA_CLASSES and \
                isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise Refused(f"builtins.getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r}) is not an "
                      f"enum member of a checkpoint's metadata")

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                       torch.dtype)):
                return super().find_class(module, name)
            if (module, name) == ("builtins", "getattr"):
                return enum_member
            raise Refused(f"{module}.{name} is not part of a checkpoint's metadata")

    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint: it has no .metadata (the index of its "
                                f"shards); {damaged(folder)}")
    try:
        with open(path, "rb") as f:
            return Restricted(f).load()
    except Refused as e:
        raise ValueError(f"{path} is not a checkpoint's metadata ({e}); refusing to read it, as it could run "
                         f"code") from None
    except Exception as e:  # cut short (EOFError, "pickle data was truncated") or overwritten
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {damaged(folder)}") from None


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
            raise FileNotFoundError(f"{path} is missing: {damaged(folder)}")
        if os.path.getsize(path) < end:
            raise ValueError(f"{path} is cut short ({os.path.getsize(path)} bytes; its .metadata places data up to byte "
                             f"{end}): {damaged(folder)}")


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
                    config=None, dtype=None, inputs=None, choices=None):
    """Write out_dir/checkpoint: with an optimizer, the resumable training state (--save_every),
    else a Hugging Face export (model + tokenizer, loadable by AutoModel*). Collective.

    - The export is gathered to rank 0's CPU memory only and written by rank 0, in `dtype`
      (--save_dtype; None keeps the training dtype). The other ranks wait on wait_for_rank0.
      Only at the end: at 8B it is 32 GB through one rank while the others wait. A resumable
      checkpoint has the config and tokenizer beside its state; `export` writes its weights.
    - `sharded/`: model and optimizer state as a torch.distributed.checkpoint, each rank writing
      its own shards (no rank holds the whole optimizer state); it loads on any world size.
      The model state here is the fp32 master copy, whatever dtype the export has.
    - `training_state.pt` (small): scheduler, every rank's RNG state, the step, the data order;
      `trainer_state.json`: the step, the run's flags (`config`) and what its model and data
      flags named (`inputs`), which --resume compares, and what `auto` chose (`choices`), which it keeps.
    Everything is written into checkpoint.tmp/ and renamed into place: a kill while writing leaves
    the previous checkpoint/ (or, between the two renames, checkpoint.old/, which
    models.resolve_checkpoint finds); so does a write that fails (a full disk: the error says so).
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = os.path.join(out_dir, "checkpoint")
    tmp, old = path + ".tmp", path + ".old"
    what = f"the checkpoint of step {step}" if optimizer is not None else "the final export"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    doing, state = "gathering the model's weights", {}
    try:
        state = full_state_dict(model, d) if optimizer is None else {}  # empty on ranks other than 0 under FSDP
        extra = None
        if optimizer is not None:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            doing = f"writing the sharded model and optimizer state into {os.path.join(tmp, 'sharded')}"
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
            doing = (f"writing the {'config and tokenizer' if optimizer is not None else 'weights, config and tokenizer'} "
                     f"into {tmp}" + (" (LoRA's adapters merged into the weights first: models.merged_state)"
                                      if optimizer is None and hasattr(model, "peft_config") else ""))
            _write_export(model, tokenizer, tmp, state, dtype, weights=optimizer is None)
            if extra is not None:
                doing = f"writing {os.path.join(tmp, 'training_state.pt')} and trainer_state.json"
                torch.save(extra, os.path.join(tmp, "training_state.pt"))
                write_json(os.path.join(tmp, "trainer_state.json"),
                            {"step": step, "config": dataclasses.asdict(config) if config else {}, "inputs": inputs or {},
                             "choices": choices or {}})
            doing = f"moving {tmp} into place as {path}"
            if os.path.isdir(path):
                shutil.rmtree(old, ignore_errors=True)
                os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    except (Exception, CheckpointException) as e:
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(e, what, doing, out_dir) from e
    except BaseException:  # a Ctrl-C that struck inside (rundir.saving lets a signal's wait for the end)
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    del state
    wait_for_rank0(d)
    return path


def _save_failed(e, what, doing, out_dir):
    """The error of a save that failed: what failed, while doing what, where (the exception says), and
    which checkpoint remains (none is claimed where there is none). A full disk is said so where it is
    (ENOSPC, or less than 64 MiB free: torch's writers then say "unexpected pos"); an OSError stays one."""
    import errno

    free = shutil.disk_usage(out_dir).free if os.path.isdir(out_dir) else None
    full = getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) or (free is not None and free < 2**26)
    found = models.resolve_checkpoint(out_dir)
    try:
        state = trainer_state(found) if os.path.isfile(os.path.join(found, "config.json")) else False
    except ValueError:
        state = False
    if state is False:
        remains = f"{out_dir} held no checkpoint before it"
    else:
        remains = f"The last checkpoint, {found} ({'the final export' if state is None else 'step %d' % state['step']}), is untouched"
    space = f"; {free / 2**20:.0f} MiB are free there" if full and free is not None else ""
    message = (f"{'no space left on the device: ' if full else ''}writing {what} failed while {doing} "
               f"({type(e).__name__}: {e}){space}. {remains[0].upper()}{remains[1:]}")
    return (OSError if isinstance(e, OSError) else RuntimeError)(message)


def _write_export(model, tokenizer, folder, state, dtype, weights=True):
    """model.save_pretrained with `state` in `dtype` (None: as it is), and the tokenizer; without
    weights, the config, generation config and tokenizer alone. A LoRA model exports the model it
    wraps, its adapters merged into the weights (models.merged_state): it loads without peft; one
    whose adapter sits on a tied weight exports it untied (models.lora_unties)."""
    untie = weights and bool(models.lora_unties(model))
    if weights and hasattr(model, "peft_config"):
        state, model = models.merged_state(model, state), model.get_base_model()
    if not weights:
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(folder)
    else:
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(folder, state_dict=state)
    dropout = getattr(model, "dropout_config", {})  # trained without (models.no_dropout): the model's own
    if dropout or untie or (weights and dtype is not None):  # the config names the dtype the weights are stored in
        with open(os.path.join(folder, "config.json")) as f:
            cfg_json = json.load(f)
        if weights and dtype is not None:
            cfg_json["dtype"] = str(dtype).removeprefix("torch.")
        if untie:  # both weights are in the file; tied, the head would load as the embedding
            for c in (cfg_json, cfg_json.get("text_config") or {}):  # a multimodal model's text model says it there
                if c is cfg_json or "tie_word_embeddings" in c:
                    c["tie_word_embeddings"] = False
        for name, value in dropout.items():
            *owners, key = name.split(".")
            functools.reduce(dict.__getitem__, owners, cfg_json)[key] = value
        write_json(os.path.join(folder, "config.json"), cfg_json)
    tokenizer.save_pretrained(folder)


def export(path, dest=None):
    """The Hugging Face export of a resumable checkpoint (its sharded/ state), on one process:

        python -m plumbing export OUT_DIR [DEST]      # DEST: OUT_DIR/export-step-N

    in the run's --save_dtype, loadable by AutoModel* and by every script's --model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    ckpt = models.resolve_checkpoint(path)
    state = trainer_state(ckpt)
    sharded_dir = os.path.join(ckpt, "sharded")
    if state is None and os.path.isfile(os.path.join(ckpt, "config.json")):  # the final save: an export already
        exported = sorted(e.path for e in os.scandir(os.path.dirname(os.path.abspath(ckpt)))
                          if e.is_dir() and e.name.startswith("export-step-"))
        raise FileExistsError(f"{path}: the run has finished, and its checkpoint {ckpt} is already a Hugging Face "
                              f"folder (model and tokenizer: AutoModelForCausalLM.from_pretrained, or --model {path})"
                              f"{'; earlier exports: ' + ', '.join(exported) if exported else ''}; nothing to export")
    if state is None or not os.path.isdir(sharded_dir):
        raise FileNotFoundError(f"{path} holds no resumable checkpoint (trainer_state.json and sharded/)")
    dest = dest or os.path.join(os.path.dirname(os.path.abspath(ckpt)), f"export-step-{state['step']}")
    _check_export_dest(dest)
    config = AutoConfig.from_pretrained(ckpt)
    scores = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    model = (AutoModelForSequenceClassification if scores else AutoModelForCausalLM).from_config(config)
    flags = state["config"]
    if flags.get("lora"):  # the sharded state holds the adapters beside the frozen base: merged on export
        model = models.add_lora(model, flags["lora_r"], flags["lora_alpha"], target_modules=flags["lora_target_modules"])
    weights = _read_sharded(sharded_dir, {"model": get_model_state_dict(model)})
    set_model_state_dict(model, weights["model"])
    _write_export(model, AutoTokenizer.from_pretrained(ckpt), dest, model.state_dict(),
                  export_dtype(flags.get("save_dtype", "float32")))
    return dest


def _check_export_dest(dest):
    """An export goes into a new or empty folder: into a model's folder it would replace its
    weights without a word, into a run's out_dir its config.json would make `--model out_dir` load
    the export instead of the run's checkpoint, and into a folder of tokenizer files it would
    overwrite tokenizer.json while a chat_template.jinja it does not write replaced its template."""
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
    if names:
        raise FileExistsError(f"{dest} already holds files ({', '.join(names)}): an export writes a whole Hugging Face "
                              f"folder (weights, config, tokenizer, chat template), would overwrite them and load "
                              f"the others as its own; pass a new or empty folder as DEST")


def _read_sharded(sharded_dir, state):
    """torch.distributed.checkpoint's load of `sharded_dir` into `state` (its layout: the keys and
    shards to read), in place, and `state`. Only tensors and plain values are read: the metadata
    through a restricted unpickler, everything else with weights_only."""
    import torch.distributed.checkpoint as dcp

    _check_shards(sharded_dir, _check_metadata(sharded_dir))
    with _dcp_call(sharded_dir, reading=True):
        dcp.load(state, checkpoint_id=sharded_dir, planner=_safe_load_planner(), no_dist=not dist.is_initialized())
    return state


def read_training_state(folder):
    """A checkpoint's training_state.pt (scheduler, every rank's RNG state, step, data order), read
    with weights_only: a file holding anything but tensors and plain Python values is refused,
    naming it and the first thing it holds that is not, before any of it is unpickled (torch's own
    message names no file and advises weights_only=False, which would run it)."""
    import pickle
    import re

    path = os.path.join(folder, "training_state.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint: it has no training_state.pt; "
                                f"{damaged(folder)}")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise ValueError(f"{path} holds something other than tensors and plain Python values"
                         f"{f' ({found[1]})' if found else ''}: refusing to unpickle it, as it could run code; "
                         f"{damaged(folder)}") from None
    except (RuntimeError, EOFError) as e:  # a zip archive cut short or overwritten
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): {damaged(folder)}") from None


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
    state = read_training_state(path)
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
