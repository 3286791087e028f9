"""The command line: one flat Config dataclass per script, its field docstrings the --help, its
ranges checked, its unset flags filled (fill_defaults); a script's start (start) and its run under
Ctrl-C, SIGTERM and SIGHUP (script)."""
import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import signal
import sys
import textwrap
import typing

import torch

import common
from plumbing import checkpoints, errors, lengths, logs, models, rundir, trl_defaults, trl_flags


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
    lr_scheduler_type: typing.Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    """the lr after --warmup_steps' linear climb from 0: cosine or linear decay to 0 at the last step, or constant;
    `constant` has no warmup (transformers' get_scheduler, TRL's name and values)"""
    num_train_epochs: float = 0.0
    """passes over the training rows (prompts for grpo.py): sets --steps to that many passes of whole batches once
    the rows are loaded (0: --steps decides) (TRL's name) [>= 0]"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: no clipping) [>= 0]"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30% more compute)"""
    padding_free: bool | typing.Literal["auto"] = "auto"
    """each micro-batch's rows back to back in one sequence, position ids restarting per row, cut at a padded
    micro-batch's tokens: no compute on padding, the same log-probs to float rounding (TRL's padding_free), in each
    pass where that computes fewer FLOPs (always under flash attention; SDPA and eager compute a packed micro-batch's
    N x N attention); off, with a line, for a model whose attention lets packed rows see each other. auto: true on a
    CPU; on a GPU the faster of packed and padded, timed once on the first micro-batch (plumbing/speed.py)"""
    compile_layers: bool | typing.Literal["auto"] = "auto"
    """torch.compile each transformer block's forward (regional compilation, as torchtitan: FSDP2's hooks stay outside
    it, every block runs one graph), in every training and log-prob pass: a block's ops fuse into a few kernels, and a
    small model's step on a GPU is bound by its kernel launches (the first steps pay the compile, tens of seconds).
    auto: on a GPU, not on a CPU (plumbing/speed.py)"""
    packed_attention: bool = False
    """with --padding_free under SDPA: each packed row attends over its own tokens (one SDPA call per run of rows of
    one length, plumbing.models.packed_attention), not over the whole pack under a block-diagonal mask, so every pass
    with padding packs; its calls can cost more than they save (the embedded GPT-2's DPO: 2.3x slower on CPU;
    SmolLM2's update pass on an H200: 0.57x the padded speed, where the pack-wide mask gives 1.63x)"""
    hsdp: int = 0
    """under torchrun: shard each model within groups of this many ranks (the GPUs of a node) and replicate across
    the groups, so parameter all-gathers stay on intra-node links (0: shard over all ranks) [>= 0]"""
    timeout_minutes: float = 60.0
    """under torchrun: how long a rank waits in one collective for the others (while rank 0 alone reads the weights,
    another decodes a long rollout or runs a slow reward function) before the job fails; at most a week (0, 10080]"""
    # --- LoRA (peft: pip install peft) ---
    lora: bool = False
    """train LoRA adapters (arXiv:2106.09685) on the frozen model; the export merges them into the weights (it loads
    with AutoModelFor* alone); dpo.py's and grpo.py's reference is the same network with the adapters off; reward.py's
    score head trains whole, as TRL's reward trainer (peft's SEQ_CLS task)"""
    lora_r: int = 16
    """LoRA rank [>= 1]"""
    lora_alpha: float = 32.0
    """LoRA scale numerator (scale = alpha / r) [> 0]"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input, in the passes that compute gradients only (the reference, old log-probs,
    sampling and evaluation see no dropout). TRL's default is 0.05; 0 here, as every dropout here (models.no_dropout):
    with it a policy's log-probs differ from its own no-gradient pass [0, 1)"""
    lora_target_modules: str = "all-linear"
    """the layers that get adapters: all-linear (every linear layer but the output head), or module names, comma- or
    space-separated (q_proj,v_proj). TRL's default (none) is peft's list for the architecture: q_proj,v_proj on Llama
    and Qwen2, c_attn on GPT-2"""
    # --- run ---
    out_dir: str = "runs/run"
    """where metrics.jsonl and the checkpoint/ folder go"""
    save_every: int = 0
    """also write a resumable checkpoint every this many steps (0: by --save_minutes alone) [>= 0]"""
    save_minutes: float | None = None
    """write a resumable checkpoint (sharded weights, optimizer, data position) after the first step that ends this
    many minutes of training after the last one, so that a run stopped in any way (Ctrl-C, kill, crash, a lost node)
    resumes with --resume from at most that long ago (0: none by time). Default 10, 0 with grpo.py's --lora (its
    checkpoint cannot be resumed) [>= 0]"""
    save_dtype: typing.Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the exported weights in checkpoint/; the resumable state stays fp32"""
    resume: bool = False
    """continue the run whose checkpoint is in out_dir"""
    overwrite: bool = False
    """replace the checkpoint and metrics already in out_dir"""
    wandb: bool = False
    """also log to Weights & Biases (as --report_to wandb)"""
    report_to: str = "none"
    """where the metrics go besides out_dir/metrics.jsonl, under its names: any of wandb, tensorboard (event files in
    out_dir/tensorboard), trackio, comma-separated, or none (TRL's flag; each an optional install: pip install wandb,
    tensorboard or trackio)"""
    trust_remote_code: bool = False
    """allow a hub model's own Python code to run"""


def start(cfg):
    """A script's first lines: every flag within the range --help states and among its choices
    (before anything is loaded or written), out_dir writable, torchrun's process group (or a world
    of one), the seed. Returns the common.Dist. The log is one line per step: transformers'
    progress bars of each load and save ("Loading weights", "Writing model shards") are switched off."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    filled = fill_defaults(cfg, lengths.model_shape(cfg))
    try:
        check_ranges(cfg)
        check_schedule(cfg)
        check_saves(cfg)
        check_extras(cfg)
        check_out_dir(cfg)
    except (ValueError, ModuleNotFoundError) as e:
        raise rundir.refusal(e)
    d = common.setup_distributed(timeout_minutes=cfg.timeout_minutes, hsdp=cfg.hsdp)
    logs.start_heartbeat(d)  # a long phase before the run logs (a GGUF conversion, dpo.py's reference) says so
    if filled:
        common.print0(filled)
    checkpoints.wait_group(d)  # made here, where a multi-node setup that cannot make it fails at once
    common.set_seed(cfg.seed)
    return d


EMBEDDED_MODEL, EMBEDDED_TASK = "tiny", "sort"  # the 0.8M GPT-2 and the task whose values a Config's DEFAULTS hold


def fill_defaults(cfg, shape=(None, False)):
    """The flags a run left unset (None) that its Config's DEFAULTS name (the learning rate and the
    token limits), set in place: the embedded task's own values when the run trains `--model tiny`
    (or a checkpoint of it: shape, lengths.model_shape's) or on `--dataset sort` (tuned on them:
    lr 1e-4 and 24 new tokens for GRPO), else TRL 1.16's defaults, what a user who names a model
    and data of their own expects (GRPO lr 1e-6, 512 completion tokens). Lengths filled that do not
    fit the model's context (shape) are cut to fit (lengths.fit). Returns the banner's lines naming
    each value and where it came from, and, for a model of your own, the defaults here that are not
    TRL's, each with the flag that gives TRL's (trl_defaults.differences); "" when nothing to say."""
    context, tiny = shape
    kind = preset(cfg, tiny)
    filled = {k: v for k, v in type(cfg).DEFAULTS[kind].items() if getattr(cfg, k) is None}
    for k, v in filled.items():
        setattr(cfg, k, v)
    lines = [lengths.fit(cfg, filled, context)] + ([fit_warmup(cfg)] if hasattr(cfg, "warmup_steps") else [])
    lines.append(fill_saves(cfg))
    if kind == "trl":
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)} | type(cfg).DEFAULTS["trl"]
        world = int(os.environ.get("WORLD_SIZE", 1))
        lines.insert(0, "not TRL 1.16's defaults here (the flag in brackets gives TRL's): "
                     + "; ".join(trl_defaults.differences(script_name(type(cfg)), cfg, defaults, world)))
    if filled:
        source = "TRL 1.16's, for a model and data of your own" if kind == "trl" else (
            f"the embedded task's (--model {EMBEDDED_MODEL} or --dataset {EMBEDDED_TASK}"
            + (f"; --model {cfg.model} is a checkpoint of {EMBEDDED_MODEL})" if tiny and cfg.model != EMBEDDED_MODEL
               else ")"))
        lines.insert(0, f"defaults, {source}: {' '.join(map(shown, filled.items()))} (pass a flag to "
                        f"change one)")
    return "\n".join(line for line in lines if line)


def preset(cfg, tiny=False):
    """Which of its Config's DEFAULTS a run takes: "embedded" for `--model tiny` (tiny: or a checkpoint
    of it) or `--dataset sort`, else "trl"."""
    embedded = getattr(cfg, "model", "") == EMBEDDED_MODEL or getattr(cfg, "dataset", "") == EMBEDDED_TASK or tiny
    return "embedded" if embedded else "trl"


def script_name(cls):
    """The file name without .py of the script whose Config cls is: sft, reward, dpo, grpo."""
    return os.path.splitext(os.path.basename(getattr(sys.modules[cls.__module__], "__file__", None) or "run"))[0]


SAVE_MINUTES = 10.0  # --save_minutes' default: a kill loses at most 10 minutes; a save of SmolLM2-135M's state (1.6 GB)
# took 8-10 s on 2 CPU cores, 1.5% of that


def fill_saves(cfg):
    """--save_minutes left unset, set in place: SAVE_MINUTES, a checkpoint by the clock, not by
    steps (TRL's save_steps 500 is 4 hours of SmolLM2's 31-s step on 2 CPU cores and 4 minutes of a
    0.5-s GPU step: a count of steps loses another span of work on every model and machine); 0 with grpo.py's
    --lora, whose checkpoint holds merged weights and cannot be resumed. Returns the banner line
    saying how checkpoints are written and how a run is stopped; "" under an explicit 0 and no
    --save_every."""
    lora = lora_unresumable(cfg)
    if cfg.save_minutes is None:
        cfg.save_minutes = 0.0 if lora else SAVE_MINUTES
    when = [f"every {cfg.save_minutes:g} minutes of training (--save_minutes)"] * bool(cfg.save_minutes)
    when += [f"every {cfg.save_every} steps (--save_every)"] * bool(cfg.save_every)
    if not when:
        return "--lora: no resumable checkpoint before the end (its adapters are merged into the weights it saves)" \
            if lora else ""
    refresh = getattr(cfg, "ref_refresh_every", 0)  # grpo.py: a checkpoint at a refresh only (rundir.Run.due)
    when += ["at the last step"] * (not refresh or cfg.steps % refresh == 0)
    when = f"{', '.join(when[:-1])} and {when[-1]}" if len(when) > 1 else when[0]
    return (f"checkpoints: a resumable one {when}, into "
            f"{os.path.join(cfg.out_dir, 'checkpoint')}; "
            f"Ctrl-C, or `kill PID` for a run in the background, ends the run with the command that resumes it")


def shown(flag_value):
    """A flag and its value as on a command line: `--lr 1e-06`, `--reference`, `--no-reference`."""
    k, v = flag_value
    return (f"--{k}" if v else f"--no-{k}") if isinstance(v, bool) else f"--{k} {v:g}"


def optimizer_steps(cfg):
    """The optimizer steps a run takes, the length of its lr schedule: --steps, times GRPO's
    num_iterations x num_mini_batches updates per rollout."""
    return cfg.steps * getattr(cfg, "num_iterations", 1) * getattr(cfg, "num_mini_batches", 1)


def fit_warmup(cfg):
    """A --warmup_steps left at its Config's default (50 for sft.py, tuned for its 700 steps) that is
    not shorter than the run would keep the lr below its peak to the last step (the first step of a
    warmup is at lr 0: a 1-step run would train nothing); it is cut to a tenth of the run's optimizer
    steps, in place. Returns the banner line saying so ("" when it fits). A value given that does
    not fit is refused (check_schedule)."""
    default, total = type(cfg).__dataclass_fields__["warmup_steps"].default, optimizer_steps(cfg)
    if cfg.warmup_steps != default or not 0 < total <= default:
        return ""
    cfg.warmup_steps = total // 10
    return (f"--warmup_steps {default}, the default, is not shorter than the run's {total} optimizer steps: "
            f"{cfg.warmup_steps} (a tenth of them) instead; pass --warmup_steps to choose")


def check_schedule(cfg):
    """Refuse a --warmup_steps that is not shorter than the run's optimizer steps: the lr climbs
    from 0 for warmup_steps steps and peaks at step warmup_steps + 1, so such a run never trains at
    --lr (a 1-step run trains at lr 0), naming both flags and the numbers."""
    if not hasattr(cfg, "warmup_steps"):
        return
    total = optimizer_steps(cfg)
    if cfg.warmup_steps >= total > 0:
        per = (f" x --num_iterations {cfg.num_iterations} x --num_mini_batches {cfg.num_mini_batches} = {total} "
               f"optimizer steps" if total != cfg.steps else " optimizer steps")
        raise ValueError(f"--warmup_steps {cfg.warmup_steps} is not shorter than the run (--steps {cfg.steps}{per}): "
                         f"the lr would climb from 0 to the end and never reach --lr {cfg.lr:g}; pass --warmup_steps "
                         f"below {total} (0: no warmup) or more --steps")


OPTIONAL_EXTRAS = {"wandb": ("wandb", "pip install wandb"), "lora": ("peft", "pip install peft")}


def lora_unresumable(cfg):
    """grpo.py's --lora, whose checkpoint holds the adapters merged into the weights and cannot be
    resumed (its Config's LORA_RESUMES; sft.py's, reward.py's and dpo.py's resume: tests/test_lora.py)."""
    return bool(getattr(cfg, "lora", False)) and not getattr(type(cfg), "LORA_RESUMES", True)


def check_saves(cfg):
    """Refuse --save_minutes with grpo.py's --lora (as conflicts.grpo refuses its --save_every): its
    checkpoint holds the adapters merged into the weights, and cannot be resumed."""
    if lora_unresumable(cfg) and cfg.save_minutes:
        raise ValueError(f"--save_minutes {cfg.save_minutes:g} with --lora: its checkpoint holds the adapters merged "
                         f"into the weights, and cannot be resumed; pass --save_minutes 0")


def check_extras(cfg):
    """Refuse a flag whose optional package is not installed (--wandb: wandb, --lora: peft, each of
    --report_to's), at the start, before a model loads or anything is written into out_dir, with
    the pip line; and a --report_to value that is none of logs.REPORTERS."""
    import importlib.util

    for flag, (package, pip) in OPTIONAL_EXTRAS.items():
        if getattr(cfg, flag, False) and importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"--{flag} needs the package {package}, which is not installed: {pip}")
    for name in logs.reporters(cfg):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"--report_to {name} needs the package {name}, which is not installed: "
                                      f"{logs.REPORTERS[name]}")


def check_out_dir(cfg):
    """Refuse an --out_dir this user cannot create or write (the nearest folder on its path that
    exists is not writable, or is a file), before anything is loaded: a PermissionError's traceback
    came at the end of the data's loading. (Root passes os.access everywhere but a read-only file
    system: script() names what the OS refuses then.)"""
    path = os.path.abspath(cfg.out_dir or ".")
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out_dir {cfg.out_dir} cannot be written: {path} is "
                         f"{'not a folder' if not os.path.isdir(path) else 'not writable by this user'}; pass a folder "
                         f"you can write")


def steps_from_epochs(cfg, n_rows):
    """TRL's --num_train_epochs, once the n_rows training rows (grpo.py: prompts) are loaded:
    --steps = ceil(epochs x the steps of one pass), a pass drawing whole batches (data.DataOrder:
    the rows left over sit that pass out), set in place with a line; --warmup_steps then fitted
    and checked against the new length, as at the start (fit_warmup, check_schedule). Nothing
    without the flag."""
    if not cfg.num_train_epochs:
        return
    flag, batch = ("--prompts_per_step", cfg.prompts_per_step) if hasattr(cfg, "prompts_per_step") else (
        "--batch_size", cfg.batch_size)
    per_pass, rows = n_rows // batch, "prompts" if hasattr(cfg, "prompts_per_step") else "rows"
    cfg.steps = max(1, math.ceil(cfg.num_train_epochs * per_pass))
    common.print0(f"--num_train_epochs {cfg.num_train_epochs:g}: {per_pass} steps a pass over the {n_rows} training "
                  f"{rows} at {flag} {batch} (whole batches: {n_rows % batch} {rows} sit each pass out): --steps "
                  f"{cfg.steps}")
    line = fit_warmup(cfg) if hasattr(cfg, "warmup_steps") else ""
    if line:
        common.print0(line)
    check_schedule(cfg)


def with_defaults(cfg):
    """A copy of cfg with its unset flags filled (fill_defaults), for code that reads a Config
    without running it (benchmarks, the memory model)."""
    cfg = dataclasses.replace(cfg)
    fill_defaults(cfg)
    return cfg


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


def _command():
    """The command that started this process, without --resume and --overwrite: `python ...`, or
    torchrun's (add your rendezvous flags on several nodes)."""
    args = " ".join(a for a in sys.argv if a not in ("--resume", "--overwrite"))
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return f"python {args}"
    local, nodes = os.environ["LOCAL_WORLD_SIZE"], int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    return f"torchrun {f'--nnodes {nodes} ' if nodes > 1 else ''}--nproc_per_node {local} {args}"


GRACE = 5.0  # seconds a signalled run has to end by itself before it is ended at once (_watch)
_FORGETS_AT_FORK = []  # whether os.register_at_fork has the hook that unsets the wakeup fd in a forked child


def script(main, cls):
    """Parse the command line into cls and run main. A Ctrl-C (SIGINT), a SIGTERM (a scheduler's,
    `kill PID`'s, or torchrun's as it stops) or a SIGHUP (the terminal or ssh session closed) ends
    the run with one line naming the last resumable checkpoint and the command that continues from
    it, not a traceback; exit status 130, 143 or 129; within GRACE seconds, also in a step that
    spends minutes in one C call (_watch). A signal is left alone where the shell asked for that:
    a background job `cmd &` starts with SIGINT ignored, `nohup cmd` with SIGHUP ignored, and the
    run goes on (`kill PID` stops it). A user's mistake (a flag's value, a busy out_dir, a data
    row, a missing chat template, lengths: errors.user_error) ends with its message alone, once,
    exit status 1. A run that fails leaves out_dir as `Run.abandon` says."""
    import threading

    cfg = parse_config(cls)
    rundir.INTERRUPTED, installed = None, {}
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGHUP, signal.SIG_DFL)):
        if signal.getsignal(sig) is default:  # not when ignored, nor when a caller installed its own
            installed[sig] = signal.signal(sig, rundir.on_signal)
    ending, done, wakeup = threading.Event(), threading.Event(), None
    if installed:
        if not _FORGETS_AT_FORK:  # a child forked without exec must not write its signals into this pipe
            os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))
            _FORGETS_AT_FORK.append(True)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=_watch, args=(read_fd, cfg, set(installed), ending, done), daemon=True).start()
    try:
        main(cfg)
    except BaseException as e:
        ending.set()
        for r in rundir.RUNS:
            r.abandon()
        # a Ctrl-C can surface as another exception: one raised by a context's __exit__ that the
        # KeyboardInterrupt was unwinding through (torch.save's zip writer: "unexpected pos"),
        # which torch.distributed.checkpoint then wraps; the handler's record says what it was
        if not (isinstance(e, KeyboardInterrupt) or rundir.INTERRUPTED):
            if hasattr(e, "frames"):  # a reward function failed (reward_fns.failed): its own frames, not the trainer's
                print(e.frames, end="", file=sys.stderr, flush=True)
            message = errors.user_error(e, cfg.out_dir)
            if message is not None:
                errors.say(message)
                sys.exit(1)
            if "Timed out" in str(e):  # gloo's words; NCCL's watchdog ends the process itself, saying "timeout"
                e.add_note(f"a collective waited longer than --timeout_minutes {cfg.timeout_minutes} for another "
                           f"rank: raise it where a rank is slow (a long rollout, rank 0 reading a large model alone)")
            raise
        common.print0("\n" + interrupted_line(cfg, rundir.INTERRUPTED or signal.SIGINT), file=sys.stderr)
        sys.exit(128 + (rundir.INTERRUPTED or signal.SIGINT))
    finally:
        done.set()
        logs.end_heartbeat()
        rundir.RUNS.clear()
        if wakeup is not None:
            signal.set_wakeup_fd(wakeup)
            os.close(write_fd)  # the watcher's read returns: it ends
        for sig, old in installed.items():
            signal.signal(sig, old)


def interrupted_line(cfg, sig, cut=()):
    """The line a run stopped by signal `sig` ends with: the last resumable checkpoint in out_dir
    and the command that continues from it, or that there is none yet; cut: (the step whose
    checkpoint a second signal cut short; None: the final export's), said first."""
    ckpt = models.resolve_checkpoint(cfg.out_dir)
    try:
        state = checkpoints.trainer_state(ckpt) if cfg.out_dir else None
    except ValueError:
        state = None
    exported = any(r.exported for r in rundir.RUNS)  # the final export is written
    what = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}.get(sig, "interrupted")
    if cut:
        what += (f" again while {'the final export' if cut[0] is None else f'the checkpoint of step {cut[0]}'} was "
                 f"written: that save was cut short")
    if exported and not cut:
        line = f"{what} after the final export: {ckpt} holds the trained model (nothing is left to resume)"
    elif state is not None:
        line = f"{what}. Last checkpoint: {ckpt} (step {state['step']}); continue with: {_command()} --resume"
    elif cfg.save_minutes or cfg.save_every:
        line = (f"{what} before its first resumable checkpoint in {cfg.out_dir} (one is written every "
                f"{f'--save_minutes {cfg.save_minutes:g}' if cfg.save_minutes else ''}"
                f"{' and ' if cfg.save_minutes and cfg.save_every else ''}"
                f"{f'--save_every {cfg.save_every} steps' if cfg.save_every else ''})")
    else:
        line = f"{what} before any resumable checkpoint in {cfg.out_dir} (--save_minutes or --save_every writes them)"
    if cut and state is None:
        line = f"{what}, and no resumable checkpoint remains in {cfg.out_dir}"
    if "LOCAL_WORLD_SIZE" in os.environ:
        line += "\n(a traceback of torchrun's that may follow reports the same signal)"
    return line


def _watch(read_fd, cfg, signals, ending, done):
    """A thread of `script`'s: Ctrl-C, SIGTERM and SIGHUP end a run within GRACE seconds, also one
    inside a long C call (a forward, a backward, a GGUF de-quantisation, a checkpoint's write).
    Python runs a signal's handler in the main thread, between two bytecodes: a SIGTERM sent during
    a 60-s step ended the run a minute later. This thread hears of each signal at once (the
    interpreter's C handler writes its number to read_fd's pipe: signal.set_wakeup_fd) and, where
    the main thread has not begun to end the run GRACE seconds after the first, or at a second
    signal, ends the process itself (os._exit): the same line and exit status as the main thread's,
    out_dir left as Run.abandon leaves it, no lock file of models.file_lock left. A checkpoint being
    written (rundir.saving) is waited for, however long it takes, saying so: only a second signal cuts
    it short, and the line says so. What it cuts short loses nothing whole: a checkpoint is renamed
    into place once written (checkpoints.save_checkpoint), so the last whole one is the one the line
    names."""
    import select
    import time

    first, deadline = None, None
    try:
        while not done.is_set():
            timeout = None if first is None else max(0.0, deadline - time.monotonic())
            if select.select([read_fd], [], [], timeout)[0]:
                got = os.read(read_fd, 64)
                if not got or done.is_set():  # the run ended: `script` closed the pipe
                    return
                got = [s for s in got if s in signals]
                if not got:
                    continue
                # under torchrun, a Ctrl-C reaches this process twice (the terminal's, torchrun's SIGTERM): a
                # save is cut short by torchrun alone (SIGKILL, 30 s after its SIGTERM)
                relayed = bool(rundir.SAVING) and "LOCAL_WORLD_SIZE" in os.environ
                if first is None:
                    first, deadline = got[0], time.monotonic() + GRACE
                    if rundir.SAVING:
                        step = rundir.SAVING[-1]
                        save = "the final export" if step is None else f"the checkpoint of step {step}"
                        how = ("torchrun's SIGKILL, 30 s after its SIGTERM, cuts it short" if "LOCAL_WORLD_SIZE" in
                               os.environ else "a second signal cuts it short")
                        common.print0(f"\n{signal.Signals(first).name}: {save} is being written; the run ends once "
                                      f"it is ({how})", file=sys.stderr)
                    if len(got) == 1 or relayed:
                        continue
                elif relayed:
                    continue
            elif ending.is_set() or rundir.SAVING:  # the main thread ends the run, or a save first: it decides when
                deadline = time.monotonic() + GRACE
                continue
            if done.is_set():
                return
            cut = rundir.SAVING[-1:]  # the save a second signal cuts short
            for r in list(rundir.RUNS):
                try:
                    r.abandon()
                except Exception:
                    pass
            for path in list(models.LOCK_FILES):
                try:
                    os.remove(path)
                except OSError:
                    pass
            common.print0("\n" + interrupted_line(cfg, first, cut=tuple(cut)), file=sys.stderr)
            os._exit(128 + first)
    finally:
        os.close(read_fd)


def parse_config(cls, argv=None):
    """Build a Config from the command line: `--lr 1e-6`, `--lr=1e-6`, `--flag` / `--no-flag`,
    `--x none` (or `--x ""`) for an optional field, one of a Literal's values for a field typed
    with one; TRL's name of a flag where it means the same (`--learning_rate`, trl_flags), and a
    TRL flag that means nothing here (`--bf16`) with a note. A value of the wrong type or not among
    the choices exits with an error that names it (argparse); every unknown flag, and every TRL
    flag that means something else here, with one message naming the script, each flag and what
    was meant (trl_flags), printed once under torchrun, exit status 2. TRL's flags whose value here
    follows from the world size, the accumulation and the defaults (`--per_device_train_batch_size`,
    `--max_length`: trl_flags.computed) are set here, with a note. A Config's own flags are listed
    before the shared ones."""
    docs, hints, script = _field_docs(cls), typing.get_type_hints(cls), script_name(cls)
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def refuse(message):  # once under torchrun; argparse's own printed the usage of every flag (50 lines for grpo.py)
        errors.say(message.removeprefix(f"{script}.py: "), f"{script}.py")
        sys.exit(2)

    parser.error = lambda message: refuse(f"{message} (--help lists every flag)")
    shared = {f.name for f in dataclasses.fields(SharedConfig)} - set(cls.__dict__.get("__annotations__", {}))
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name in shared):
        tp = hints[f.name]
        optional = type(None) in typing.get_args(tp)
        if optional:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=(docs.get(f.name, " ") + trl_flags.help_note(script, f.name)).replace("%", "%%"),
                  dest=f.name)  # argparse formats %
        if f.name in getattr(cls, "DEFAULTS", {}).get("trl", {}):  # fill_defaults': both values, not "None"
            embedded, trl = (shown((f.name, cls.DEFAULTS[k][f.name])) for k in ("embedded", "trl"))
            kw["help"] += (f" (default: {embedded} with --model {EMBEDDED_MODEL} (or a checkpoint of it) or --dataset "
                           f"{EMBEDDED_TASK}, else {trl}{trl_defaults.preset_note(script, f.name, cls.DEFAULTS['trl'])})"
                           f"%(default).0s")
        if tp is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kw)
            continue
        if tp in AUTO_BOOL:  # --flag, --no-flag, --flag true|false|auto
            parser.add_argument(f"--{f.name}", nargs="?", const=True, type=auto_bool, metavar="{true,false,auto}", **kw)
            parser.add_argument(f"--no-{f.name}", dest=f.name, action="store_false", help=argparse.SUPPRESS)
            continue
        if typing.get_origin(tp) is typing.Literal:
            parser.add_argument(f"--{f.name}", choices=typing.get_args(tp), **kw)
            continue
        convert = tp
        if optional:
            convert = lambda s, tp=tp: None if s.lower() in ("none", "") else tp(s)
            convert.__name__ = tp.__name__
        parser.add_argument(f"--{f.name}", type=convert, metavar=tp.__name__.upper(), **kw)
    bools = {f.name for f in dataclasses.fields(cls) if hints[f.name] is bool or hints[f.name] in AUTO_BOOL}
    try:
        argv, notes, computed = trl_flags.translate(script, sys.argv[1:] if argv is None else list(argv),
                                                    {f.name for f in dataclasses.fields(cls)} | {f"no-{b}" for b in bools},
                                                    bools)
        cfg = cls(**vars(parser.parse_args(argv)))
        notes += trl_flags.computed(script, cfg, computed, int(os.environ.get("WORLD_SIZE", 1)),
                                    cls.DEFAULTS[preset(cfg, lengths.model_shape(cfg)[1])] if computed else {})
    except ValueError as e:
        refuse(str(e))
    for note in notes:
        common.print0(note)
    return cfg


AUTO_BOOL = (bool | typing.Literal["auto"], typing.Literal["auto"] | bool)  # a speed flag: plumbing/speed.py


def auto_bool(text):
    """true / false (TRL's spellings: 1, yes, ...) or auto, for a speed flag."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False, "auto": "auto"}.get(
        text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of true, false, auto")
    return value


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
        choices = (True, False, "auto") if hints[f.name] in AUTO_BOOL else choices
        if choices and value not in choices:
            bad.append(f"--{f.name} {value!r} is not one of {', '.join(map(str, choices))}")
    if bad:
        raise ValueError("; ".join(bad))


def micro_batch(batch_size, grad_accum, d):
    """Rows per micro-batch on each rank; the global batch must split evenly over ranks and
    accumulation steps (checked up front, naming the flags)."""
    if batch_size % (d.world_size * grad_accum):
        raise ValueError(f"--batch_size {batch_size} must be divisible by world size {d.world_size} x --grad_accum "
                         f"{grad_accum}")
    return batch_size // (d.world_size * grad_accum)
