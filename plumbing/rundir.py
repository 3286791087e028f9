"""The run folder: out_dir holds one run (its lock, run_config.json, metrics.jsonl, completions.jsonl,
checkpoint/), checked before anything is written (overwrite, resume, what every rank sees), locked
for the run's life, and written at the run's ends (Run.begin, Run.log, Run.save, Run.finish)."""
import dataclasses
import json
import math
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import common
from plumbing import checkpoints, logs, models


# Flags a resumed run may change: how far it goes (--steps extends it; the cosine decay is then
# recomputed for the new total), how it is split into micro-batches and kept in memory (the same
# gradient up to rounding), how often it evaluates, saves and logs. Every other flag defines the
# run, and --resume refuses a difference (docs/distributed.md, "Resuming").
RESUME_MAY_CHANGE = ("steps", "grad_accum", "activation_checkpointing", "offload_frozen", "compile", "compile_layers",
                     "eval_every", "eval_batch_size", "save_every", "save_minutes", "save_dtype", "hsdp", "timeout_minutes",
                     "out_dir", "wandb", "report_to", "trust_remote_code", "log_completions", "generation_micro_batch_size",
                     "reward_fn_timeout")


# the flags that name a model or data: what each names is recorded, by content, with the run
INPUT_FLAGS = ("model", "ref_model", "reward_model", "teacher", "normalize_policy", "dataset", "eval_dataset",
               "eval_pairs", "chat_template")


DATA_FLAGS = ("dataset", "eval_dataset", "eval_pairs", "chat_template")  # hashed whole, whatever their size


RUNS = []  # the runs of this process, for `script` to tidy up after a failure

clock = time.monotonic  # what --save_minutes is measured on (a test drives it by steps)


def refusal(e):
    """e, marked as a refusal: a run that cannot start as asked (a flag's value, a busy or foreign
    out_dir), whose one-line message names what to change; cli.script prints it alone, without a
    traceback. Its type stays what callers catch."""
    e.refusal = True
    return e


def _run_file(name):
    """Whether a run (or `python -m plumbing export`, into export-step-N/) writes a file of this name
    into its out_dir."""
    return (name in checkpoints.RUN_FILES or name in (".lock", "metrics.jsonl.tmp", "run_config.json.tmp")
            or name in ("completions.jsonl", "completions.jsonl.tmp", "tensorboard") or name.startswith("export-step-"))


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
        path = models.gguf_file(value) or value
    except (FileNotFoundError, ModuleNotFoundError):
        path = value
    if os.path.isfile(path):
        return _digest(path, whole)
    if os.path.isdir(path):
        folder = models.resolve_checkpoint(path)
        files = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
        return "|".join(f"{n}:{_digest(os.path.join(folder, n))}" for n in files)
    return value


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


INTERRUPTED = None  # the signal that interrupted the run (SIGINT, SIGTERM or SIGHUP), once one has
SAVING = []  # the step whose checkpoint this process is writing (None: the final export), while it is


def on_signal(signum, frame):
    """A signal ends the run at once (a KeyboardInterrupt), but not inside a checkpoint's write
    (saving), which ends first: a SmolLM2 save can take a minute on a loaded machine, and a Ctrl-C
    there lost it. A second signal cuts the write (cli._watch)."""
    global INTERRUPTED
    INTERRUPTED = signum
    if not SAVING:
        raise KeyboardInterrupt


@contextmanager
def saving(step):
    """The block writes step's checkpoint (None: the final export): a signal waits for its end
    (on_signal), and the run ends right after it, naming it."""
    SAVING.append(step)
    try:
        yield
    finally:
        SAVING.pop()
    raise_if_interrupted()


def raise_if_interrupted():
    """Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is; inside a finaliser
    (a __del__ or weakref callback, run often while checkpoints are written) it is printed as
    "Exception ignored" and dropped, and the run went on. cli.script records every signal, and
    Run.check raises one that was dropped at the end of the step."""
    if INTERRUPTED:
        raise KeyboardInterrupt


class Run:
    """One training run in cfg.out_dir, from its checks to its last checkpoint. Not a trainer: the
    loop stays in each script's main(); a Run holds what the loop's ends need (what to resume,
    the log, when to save, the last good checkpoint).

    Run(cfg, d, model_flags) checks the model flags (models.check_model_paths) and out_dir, locks out_dir
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

    def __init__(self, cfg, d, model_flags=("model",)):
        try:
            self._open(cfg, d, model_flags)
        except (ValueError, FileExistsError, FileNotFoundError, ModuleNotFoundError) as e:
            raise refusal(e)

    def _open(self, cfg, d, model_flags):
        if not cfg.out_dir:
            raise ValueError("--out_dir is empty: pass the folder the run writes into")
        here, there = os.path.realpath(os.getcwd()), os.path.realpath(cfg.out_dir)
        if (here + os.sep).startswith(there.rstrip(os.sep) + os.sep):  # os.rename cannot move it aside
            raise ValueError(f"--out_dir {cfg.out_dir} is the folder this command runs in ({there})"
                             f"{'' if here == there else ', or one above it'}: a run needs a folder of its own "
                             f"(--overwrite moves it aside whole); pass one, e.g. --out_dir runs/NAME")
        models.check_model_paths(cfg, *model_flags)
        self.cfg, self.d, self.out_dir, self.t_start = cfg, d, cfg.out_dir, time.time()
        self.inputs = {f: fingerprint(getattr(cfg, f), whole=f in DATA_FLAGS) for f in INPUT_FLAGS
                       if getattr(cfg, f, None)}
        self.created = not os.path.exists(cfg.out_dir)
        self.locked_new = not os.path.exists(os.path.join(cfg.out_dir, ".lock"))  # a .lock this run adds
        self.started, self.replaced, self.logger, self.home, self.lost, self.exported = False, None, None, None, False, None
        RUNS.append(self)
        if d.is_main:
            lock_out_dir(cfg.out_dir)
        if d.world_size > 1:
            dist.barrier()
        found = models.resolve_checkpoint(cfg.out_dir)
        has_ckpt = os.path.isfile(os.path.join(found, "config.json"))
        held = sorted(set(os.listdir(cfg.out_dir)) - {".lock"}) if os.path.isdir(cfg.out_dir) else ["(no folder)"]
        state = checkpoints.trainer_state(found) if has_ckpt and cfg.resume else None
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
        self.last_ckpt, self.step, self.changed, self.trained = self.resume_from, None, {}, False
        # what `auto` chose for each speed flag (plumbing/speed.py), kept by a resumed run
        self.choices = dict(state.get("choices", {})) if self.resume_from else {}
        if self.resume_from:
            if state is None:
                raise FileNotFoundError(f"{found} has no trainer_state.json (a final checkpoint): it cannot be resumed; "
                                        f"start a new run from it (--model {found})")
            self.step, self.changed = state["step"], _compare(cfg, state, self.inputs, found)
            trained = checkpoints.read_training_state(found)["step"]  # the step the weights and data order are at
            if trained != self.step:  # metrics.jsonl would be cut at the one, training go on from the other
                raise ValueError(f"--resume: {os.path.join(found, 'trainer_state.json')} is at step {self.step} but "
                                 f"{os.path.join(found, 'training_state.pt')} at step {trained} (a file copied from "
                                 f"another checkpoint?): {checkpoints.damaged(found)}")
            # a checkpoint of a run's last step, resumed with the same --steps: what follows the steps runs
            self.trained = self.step == cfg.steps == state["config"].get("steps")
            if self.step >= cfg.steps and not self.trained:
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
        start, elapsed = 1, 0.0
        if self.resume_from:
            start = checkpoints.load_training_state(self.resume_from, model, optimizer, scheduler=scheduler, order=order, d=self.d) + 1
        if self.trained:
            common.print0(f"its {self.step} steps are done: what follows them (the final evaluation, the export) runs now")
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
                _cut_metrics(os.path.join(self.out_dir, "completions.jsonl"), self.step)  # rows past the checkpoint
                elapsed = _cut_metrics(os.path.join(self.out_dir, "metrics.jsonl"), self.step)  # come again
            entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                     "resumed_at_step": self.step, "changed": self.changed}
            checkpoints.write_json(config, {**dataclasses.asdict(self.cfg), "inputs": self.inputs, "choices": self.choices,
                                            "history": history + [entry]})
        checkpoints.wait_for_rank0(self.d)  # also makes its process group now, not hours in at the first save
        self.started = True
        self.logger = logs.Logger(self.out_dir, self.cfg, self.d, show, elapsed=elapsed)  # time goes on from the rows kept
        self.saved_at = clock()  # --save_minutes counts training from here
        self.home = (os.stat(self.out_dir), _LOCKS[-1]) if self.d.is_main else None  # the folder, its lock (check_home)
        return start

    def check_home(self, step):
        """Rank 0, before each write: out_dir must still be the folder this run began in, holding the lock
        it took. A folder deleted or moved away (`rm -rf` mid-run), replaced by another, or whose .lock
        was deleted (another run could then start in it) stops the run naming what happened and what it
        had written there: training on would write metrics into a file no folder holds and a checkpoint
        into a folder made anew, and end with exit status 0 and a run of which nothing is left."""
        if self.home is None or self.lost:
            return
        folder, lock = self.home
        try:
            now = os.stat(self.out_dir)
        except FileNotFoundError:
            now = None
        try:
            locked = os.path.samestat(os.stat(os.path.join(self.out_dir, ".lock")), os.fstat(lock.fileno()))
        except FileNotFoundError:
            locked = False
        if now is not None and os.path.samestat(now, folder) and locked:
            return
        self.lost = True  # abandon leaves the folder alone: it may be another run's now
        wrote = ["run_config.json", f"metrics.jsonl (to step {self.logger.step})" if self.logger.step is not None
                 else "metrics.jsonl"] + ["completions.jsonl"] * (self.logger.completions_file is not None)
        wrote = ", ".join(wrote + ([f"the checkpoint {self.last_ckpt}"] if self.last_ckpt else []))
        if now is not None and os.path.samestat(now, folder):
            raise refusal(RuntimeError(
                f"--out_dir {self.out_dir} lost this run's lock by step {step} (its .lock was deleted or replaced): "
                f"another run could start there. Stopping, rather than training on beside it; what the run wrote "
                f"there ({wrote}) is as it was: run it again with --resume to go on from its last checkpoint"))
        what = "was deleted or moved away" if now is None else "was replaced by another folder"
        raise refusal(RuntimeError(
            f"--out_dir {self.out_dir} {what} by step {step}, while the run went on: what the run wrote there "
            f"({wrote}) is not in it. Stopping, rather than training on into a folder that is not the run's; start "
            f"the run again"))

    def check(self, step, metrics, keys=("loss",)):
        """Stop on a NaN or infinite loss (or other named metric, where the step logs it: grpo.py's kl
        needs a reference), naming the last good checkpoint; end on a signal whose KeyboardInterrupt was
        dropped (raise_if_interrupted)."""
        raise_if_interrupted()
        bad = {k: metrics[k] for k in keys if not math.isfinite(metrics.get(k, 0.0))}  # floats, already on the host
        if bad:
            raise FloatingPointError(f"step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; stopping. "
                                     f"Last good checkpoint: {self.last_ckpt or 'none written yet'}")

    def log(self, step, metrics):
        """Log a step's metrics; write a resumable checkpoint where one is due (due). Collective."""
        self.check_home(step)
        self.logger.log(step, metrics)
        if self.due(step):
            self.last_ckpt = self.save(step)
            self.saved_at = clock()

    def final(self, metrics):
        """What is measured after the last step and its checkpoint (the final evaluation, reward.py's
        normalisation) joins the last step's row (Logger.amend): a run killed here resumes from the
        last step's checkpoint to measure it again (due)."""
        self.logger.amend(self.cfg.steps, metrics)

    def due(self, step):
        """Whether a resumable checkpoint is due after `step`: every --save_every steps, at the first
        step that ends --save_minutes of training after the run began or last saved, and at the last
        step, before what follows it (the final evaluation, reward.py's normalisation, the export:
        minutes on a large model, which a kill then does not lose), where either flag writes
        checkpoints. Rank 0's clock decides for every rank (a save is collective; the ranks' clocks
        differ): one all-reduce of one number a step. A GRPO run with --ref_refresh_every saves by the
        clock, and at the last step, only at a refresh's step: a resumed run rebuilds its reference
        from the checkpoint's weights. Collective."""
        cfg = self.cfg
        if not 0 < step <= cfg.steps:
            return False
        if cfg.save_every and step % cfg.save_every == 0:
            return True
        if not (cfg.save_minutes or cfg.save_every) or step % (getattr(cfg, "ref_refresh_every", 0) or 1):
            return False
        if step == cfg.steps:
            return True
        if not cfg.save_minutes:
            return False
        late = self.d.is_main and clock() - self.saved_at >= 60 * cfg.save_minutes
        if self.d.world_size > 1:
            late = common.all_reduce_sum(torch.tensor([float(late)], device=self.d.device), self.d).item() > 0
        return late

    def save(self, step=None, model=None):
        """A checkpoint: resumable (optimizer, data order) with a step, the final export without.
        Weights that are not finite, or whose outputs on a fixed batch are not (finite_outputs),
        are never written: the last good checkpoint stays the last. A signal waits for its end
        (saving); the heartbeat names it."""
        self.check_home(step or self.cfg.steps)
        with saving(step), logs.phase(logs.SAVING if step else "final export", step=step or self.cfg.steps):
            path = self._save(step, model or self.model)
            self.exported = self.exported if step else path  # before a signal that waited ends the run
            return path

    def _save(self, step, model):
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
                         config=self.cfg, inputs=self.inputs, choices=self.choices) if step else {}
        return checkpoints.save_checkpoint(model, self.tokenizer, self.out_dir, self.d, dtype=checkpoints.export_dtype(self.cfg.save_dtype),
                               **resumable)

    def finish(self, model=None):
        """The final export (model: another module to export, e.g. LoRA merged into the weights),
        then the end of the run. Returns the checkpoint's path. An export that fails keeps the
        trained weights: the last step's checkpoint (due) holds them, or one is written now, and
        the error says where and how to export them."""
        try:
            path = self.save(model=model)
        except Exception as e:
            if not isinstance(e, FloatingPointError):  # weights that are not finite: none worth keeping
                e.add_note(self._kept())
            raise
        self.logger.summary(path, wall=time.time() - self.t_start)
        self.logger.close()
        release()
        return path

    def _kept(self):
        """After a failed export: where the trained weights are, the last step's checkpoint (due),
        written now where there is none, one process runs (on several ranks, whether the others got
        as far is not known) and it can be resumed (not grpo.py's --lora's), and how to export them."""
        steps, ckpt, now = self.cfg.steps, models.resolve_checkpoint(self.out_dir), ""
        try:
            state = checkpoints.trainer_state(ckpt) if os.path.isdir(ckpt) else None
        except ValueError:  # damaged
            state = None
        resumes = not (getattr(self.cfg, "lora", False) and not getattr(type(self.cfg), "LORA_RESUMES", True))
        if not (state and state["step"] == steps) and self.d.world_size == 1 and resumes:
            try:
                ckpt, state, now = self.save(steps), {"step": steps}, " (written after the export failed)"
            except Exception as e:  # the disk is full, or the weights cannot be had
                now = f"; writing them as the step's resumable checkpoint failed too ({type(e).__name__}: {e})"
        if state and state["step"] == steps:
            return (f"The trained weights are kept in {ckpt}, the checkpoint of the last step {steps}{now}: `python -m "
                    f"plumbing export {self.out_dir}` writes their export (into "
                    f"{os.path.join(self.out_dir, f'export-step-{steps}')}), and the same command with --resume tries "
                    f"the final export again")
        return f"No checkpoint of the last step {steps} holds the trained weights{now}"

    def abandon(self):
        """After a failure: a run that wrote nothing removes the lock file it added (and the out_dir
        it created, then empty); one that moved the old contents aside says where they are. A fresh
        run that failed after `begin` but before its first logged step (wandb.init refused, the first
        step out of memory) removes what `begin` wrote too, so that the same command, corrected, is
        not refused for a folder that "is not empty"."""
        if self.logger is not None:
            self.logger.close()  # and its heartbeat
        if not self.d.is_main or self.lost:  # lost: out_dir is not the run's folder any more (check_home)
            return
        metrics = os.path.join(self.out_dir, "metrics.jsonl")
        if self.started and not self.resume_from and not (os.path.isfile(metrics) and os.path.getsize(metrics)):
            for name in ("run_config.json", "metrics.jsonl"):
                if os.path.isfile(os.path.join(self.out_dir, name)):
                    os.remove(os.path.join(self.out_dir, name))
            self.started = False
            self.locked_new |= bool(self.replaced)  # begin made the folder anew, and its lock
            self.created |= bool(self.replaced)
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
    checkpoints.WAIT_GROUP.clear()  # destroyed with the process group
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
        raise refusal(RuntimeError(f"{out_dir} is in use by another run ({holder}): wait for it to end, or pass "
                                   f"another --out_dir")) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)}\n")
    f.flush()
    _LOCKS.append(f)


def _cut_metrics(metrics, step):
    """Keep the rows of metrics.jsonl (or completions.jsonl) up to `step`; a line torn by a kill is
    dropped with a note. Returns the last row's `time` (0.0 without one)."""
    if not os.path.isfile(metrics):
        return 0.0
    keep, last = [], {}
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            try:
                row_step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                common.print0(f"note: {metrics} line {n} is not a complete row (cut by the interruption); dropped")
                continue
            if row_step <= step:
                keep.append(line)
                last = json.loads(line)
    with open(metrics + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(metrics + ".tmp", metrics)
    return float(last.get("time", 0.0))
