"""Logging a run: metrics.jsonl and a step line on rank 0 (step k/N, elapsed time, ETA; wandb,
TensorBoard, trackio when asked: --report_to), a heartbeat line while a long step or phase runs
(`phase`: what it is, how far along), sampled completions (completions.jsonl), the run's closing
summary, each phase's wall time and peak GPU memory (Clock), and how the models are spread, for
the banners."""
import dataclasses
import json
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch

import common
import sampling

# While a step runs, rank 0 prints a line after this many seconds with nothing printed, and again
# after as many more: a 13-minute rollout says it is alive without a progress bar, and the lines
# stay readable in a log file. Printed only, never in metrics.jsonl.
HEARTBEAT_SECONDS = 30.0

PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plots", "plot.py")


class Phase:
    """A part of a run that can outlast a heartbeat (an evaluation, dpo.py's reference log-probs, a
    checkpoint's write), as its heartbeat line names it: `evaluation 40/72, 45s, ETA 36s`. Its
    progress is the rows of the common.map_rows passes run inside it, `done` of `total` (each pass's
    rows join the total as it starts). `step`: the step it belongs to, where that is not the one the
    loop is in (a checkpoint is written after its step's line)."""

    def __init__(self, name, step=None, now=time.time):
        self.name, self.step, self.total, self.done, self.t0 = name, step, 0, 0, now()
        self.pass_done, self.pass_n = 0, 0

    def rows_done(self, done, n):
        """A map_rows pass of n rows inside this phase has done `done` of them (a new pass once the
        last one ended)."""
        if self.pass_done >= self.pass_n:
            self.pass_done, self.pass_n, self.total = 0, n, self.total + n
        self.done += done - self.pass_done
        self.pass_done = done

    def text(self, now):
        """`name done/total, elapsed, ETA left` (`name, elapsed` before any row)."""
        spent, line = now - self.t0, self.name
        if self.total:
            line += f" {self.done}/{self.total}"
        line += f", {duration(spent)}"
        if 0 < self.done < self.total:
            line += f", ETA {duration(spent / self.done * (self.total - self.done))}"
        return line


PHASES = []  # the phases this process is in now, innermost last: what its heartbeat names
TOOK = {}  # the seconds each phase took the last time it ran, by name (a Logger's ETA counts those after the last step)
SAVING = "saving checkpoint"  # the phase of a resumable checkpoint's write (plumbing/rundir.py)


@contextmanager
def phase(name, step=None, now=time.time):
    """`with logs.phase("evaluation"):`, or `@logs.phase("evaluation")` on a function: the
    heartbeat names the block while it runs, with its progress (Phase), and the time it took is
    kept (TOOK)."""
    p = Phase(name, step=step, now=now)
    PHASES.append(p)
    try:
        yield p
    finally:
        PHASES.remove(p)
        TOOK[name] = now() - p.t0


def innermost():
    """The phase running now (the heartbeat's thread reads it while the loop's thread changes
    PHASES: one slice, atomic), or None."""
    last = PHASES[-1:]
    return last[0] if last else None


def _rows_done(done, n):
    p = innermost()
    if p is not None:
        p.rows_done(done, n)


common.ROWS_DONE.append(_rows_done)


class Heartbeat:
    """Rank 0's line when nothing has been printed for `heartbeat` seconds (0: never), naming the
    phase that runs (`phase`): from a script's start (cli.start) until its run's Logger, which
    names the step too, takes over. Printed only."""

    def __init__(self, is_main, heartbeat=HEARTBEAT_SECONDS, now=time.time):
        self.now, self.heartbeat, self.lock, self.stop = now, heartbeat, threading.Lock(), threading.Event()
        self.t_said = now()
        if is_main and heartbeat:
            threading.Thread(target=self._watch, daemon=True, name="heartbeat").start()

    def say(self, text):
        """Print a line from rank 0 (a step line, a heartbeat, a table), whole: the heartbeat
        thread and the loop never interleave within a line."""
        with self.lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self.t_said = self.now()

    def beat(self):
        """The innermost phase's line (Phase.text) once it has run `heartbeat` seconds with nothing
        printed by this heartbeat; else None (no phase: loading, which prints its own lines)."""
        now, p = self.now(), innermost()
        if p is None or not self.heartbeat or now - max(self.t_said, p.t0) < self.heartbeat:
            return None
        return p.text(now)

    def _watch(self):
        while not self.stop.wait(min(1.0, self.heartbeat / 4)):
            line = self.beat()
            if line:
                self.say(line)

    def close(self):
        self.stop.set()


EARLY = []  # the heartbeat of a script before its Logger (start_heartbeat)


def start_heartbeat(d):
    """The heartbeat from a script's start (cli.start), before its run logs: dpo.py's reference
    log-probs, a GGUF file's conversion. Ends when a Logger starts, or with the script (end_heartbeat)."""
    end_heartbeat()
    EARLY.append(Heartbeat(d.is_main))


def end_heartbeat():
    while EARLY:
        EARLY.pop().close()


REPORTERS = {"wandb": "pip install wandb", "tensorboard": "pip install tensorboard", "trackio": "pip install trackio"}


def reporters(cfg):
    """--report_to's values (TRL's: any of wandb, tensorboard, trackio, comma- or space-separated;
    none) and --wandb's, as a list of REPORTERS' names. ValueError naming a value not among them."""
    given = getattr(cfg, "report_to", "").lower().replace(",", " ").split()
    unknown = [v for v in given if v not in REPORTERS and v != "none"]
    if unknown or ("none" in given and len(given) > 1):
        raise ValueError(f"--report_to {cfg.report_to}: give any of {', '.join(REPORTERS)} (comma-separated), or "
                         f"none{' alone' if not unknown else ''}; TRL's other integrations are not here, and every "
                         f"metric is in out_dir/metrics.jsonl")
    return list(dict.fromkeys([v for v in given if v != "none"] + ["wandb"] * bool(getattr(cfg, "wandb", False))))


class Writer:
    """One of --report_to's loggers: each row's metrics under metrics.jsonl's names, at its step
    (not its `time`: each logger keeps its own clock, and trackio reserves the name). wandb and
    trackio: project rlhf-<script>, the run's flags as its config; TensorBoard: event files in
    out_dir/tensorboard (`tensorboard --logdir out_dir`)."""

    def __init__(self, name, out_dir, cfg):
        self.name, config = name, dataclasses.asdict(cfg)
        project = f"rlhf-{type(cfg).__module__}"
        if name == "wandb":
            import wandb  # optional extras, each checked at the start (cli.check_extras)

            self.run = wandb.init(project=project, config=config)
        elif name == "trackio":
            import trackio

            self.module, self.run = trackio, trackio.init(project=project, config=config)
        else:
            from torch.utils.tensorboard import SummaryWriter

            self.run = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))

    def log(self, step, metrics):
        if self.name == "wandb":
            self.run.log(metrics, step=step)
        elif self.name == "trackio":
            self.module.log(metrics, step=step)
        else:
            for k, v in metrics.items():
                self.run.add_scalar(k, v, global_step=step)
            self.run.flush()

    def close(self):
        if self.name == "wandb":
            self.run.finish()
        elif self.name == "trackio":
            self.module.finish()
        else:
            self.run.close()


class Logger(Heartbeat):
    """metrics.jsonl (every metric, one row per step) on rank 0; a step line on stdout with the
    `show` metrics (all when None), opening `step k/N | elapsed | ETA`; --report_to's loggers
    (Writer); a heartbeat thread (HEARTBEAT_SECONDS; 0: none); with --log_completions,
    completions.jsonl. `now` is the clock (tests pass their own); `elapsed`: the run's time before
    this process (a resumed run's last row's), where `time` and `elapsed` go on from.

    ETA = the steps left x the mean wall time per step of this process so far, everything between
    two step lines included (training, evaluation, checkpoints), from the end of the step-0
    evaluation (or from the start, on a resume), and the phases after the last step (an
    evaluation, a checkpoint) as long as the last of each took."""

    def __init__(self, out_dir, cfg, d, show=None, heartbeat=HEARTBEAT_SECONDS, now=time.time, elapsed=0.0):
        end_heartbeat()  # this one takes over
        TOOK.clear()
        self.peak_gib, self.out_dir, self.steps = 0.0, out_dir, cfg.steps
        self.enabled, self.writers, self.show, self.last = d.is_main, [], show, {}
        self.t0 = self.t_steps = now() - elapsed
        self.n_steps, self.step, self.phase, self.t_phase = 0, None, None, now()
        self.completions_file = None
        if self.enabled:
            self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
            if getattr(cfg, "log_completions", 0):
                self.completions_file = open(os.path.join(out_dir, "completions.jsonl"), "a")
            for name in reporters(cfg):
                self.writers.append(Writer(name, out_dir, cfg))
        super().__init__(self.enabled, heartbeat, now)

    def log(self, step, metrics, echo=True):
        if not self.enabled:
            return
        if torch.cuda.is_available():  # the run's peak so far, over the windows a script reset (peak_memory)
            self.peak_gib = max(self.peak_gib, torch.cuda.max_memory_allocated() / 2**30,
                                *(v for k, v in metrics.items() if k.startswith("mem/")))
            metrics = {**metrics, "mem/peak_gib": self.peak_gib}
        now = self.now()
        row = {"step": step, "time": round(now - self.t0, 2), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for w in self.writers:
            w.log(step, metrics)
        if step == 0:  # the evaluation before training: the steps' clock starts after it
            self.t_steps = now
        else:
            self.n_steps += 1
        self.step, self.phase, self.t_phase, self.last = step, None, now, {**self.last, **metrics}
        if echo:
            keys = [k for k in (self.show or metrics) if k in metrics]
            self.say(f"{self.step_line(step, now)} | " + " | ".join(f"{k} {_fmt(metrics[k])}" for k in keys))

    def amend(self, step, metrics):
        """Metrics measured after the last step's line and checkpoint (the final evaluation, reward.py's
        normalisation) join that step's row, the last of metrics.jsonl: the file is rewritten whole
        (a temporary file renamed into place: a kill leaves the row as it was, or amended), the
        loggers get them at that step, and a line shows them."""
        if not self.enabled or not metrics:
            return
        path = os.path.join(self.out_dir, "metrics.jsonl")
        self.file.close()
        with open(path) as f:
            lines = f.read().splitlines(keepends=True)
        row = json.loads(lines[-1]) if lines else {}
        if row.get("step") != step:
            raise RuntimeError(f"{path}: the last row is not step {step}'s, which {', '.join(metrics)} join")
        lines[-1] = json.dumps({**row, **metrics}) + "\n"
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a")
        for w in self.writers:
            w.log(step, metrics)
        self.step, self.last = step, {**self.last, **{k: v for k, v in row.items() if k not in ("step", "time")},
                                      **metrics}
        self.say(f"step {step}/{self.steps}, after training | elapsed {duration(self.now() - self.t0)} | "
                 + " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()))

    def step_line(self, step, now):
        """`step k/N | elapsed 1m05s | ETA 4m50s` (no ETA before the first step)."""
        line = f"step {step}/{self.steps} | elapsed {duration(now - self.t0)}"
        if self.n_steps:
            after = sum(TOOK.get(k, 0.0) for k in ("evaluation", SAVING))  # the phases after the last step
            line += f" | ETA {duration((now - self.t_steps) / self.n_steps * max(self.steps - step, 0) + after)}"
        return line

    def running(self, phase, since):
        """What the loop runs now (Clock.split says; None: not known), for the heartbeat."""
        self.phase, self.t_phase = phase, since

    def beat(self):
        """The heartbeat's line when nothing has been printed for `heartbeat` seconds, else None:
        `step 3/100: rollout running, 45s` (the step the loop is in, never past the last, the phase
        Clock expects and how long it has run; without a phase, how long the step has), or with a
        `phase` running, `step 3/100: evaluation 40/72, 45s, ETA 36s` (Phase.text; a checkpoint's:
        the step it saves)."""
        now = self.now()
        if not self.heartbeat or now - self.t_said < self.heartbeat:
            return None
        p = innermost()
        step = 1 if self.step is None else min(self.step + 1, self.steps)
        if p is not None:
            return f"step {step if p.step is None else p.step}/{self.steps}: {p.text(now)}"
        what = f"{self.phase} running" if self.phase else "running"
        return f"step {step}/{self.steps}: {what}, {duration(now - self.t_phase)}"

    def completions(self, step, roll, env, rewards, parts, n):
        """grpo.py --log_completions n: the first n completions of this rank's rollout (whole
        groups first; other ranks' rows are theirs alone, never gathered), each a row of
        completions.jsonl (step, the prompt as the data set gives it, the completion as the rules
        read it, its reward and each part) and of a table printed under the step line. Rank 0."""
        if not self.enabled or not n:
            return
        rows = completion_rows(step, roll, env, rewards=rewards, parts=parts, n=n)
        self.completions_file.writelines(json.dumps(r) + "\n" for r in rows)
        self.completions_file.flush()
        self.say(completion_table(rows, self.steps))

    def summary(self, checkpoint, wall):
        """The run's last lines (rank 0): its steps and wall time, the final metrics (the step
        line's, and the last evaluation's), where the checkpoint, metrics and completions are, and
        the command that plots them."""
        if not self.enabled or self.step is None:
            return
        keys = [k for k in (self.show or self.last) if k in self.last and not k.startswith(("time/", "mem/", "eval/"))]
        keys += [k for k in self.last if k.startswith("eval/")]  # the last evaluation's, after training's
        first = self.step - self.n_steps + 1
        each = f" ({duration((self.now() - self.t_steps) / self.n_steps)} per step)" if self.n_steps else ""
        done = (f"steps {first}-{self.step} of {self.steps}" if self.n_steps else
                f"the {self.steps} steps were done before this process, which evaluated and exported them")
        lines = [f"done: {done}, {duration(wall)} wall time{each}",
                 "final: " + " | ".join(f"{k} {_fmt(self.last[k])}" for k in keys),
                 f"checkpoint:  {checkpoint}",
                 f"metrics:     {os.path.join(self.out_dir, 'metrics.jsonl')}"]
        if self.completions_file is not None:
            lines.append(f"completions: {os.path.join(self.out_dir, 'completions.jsonl')}")
        lines.append(f"plot:        python {os.path.relpath(PLOT)} {self.out_dir}")
        self.say("\n".join(lines))

    def close(self):
        self.stop.set()  # the heartbeat ends with the run, also with a failed one (Run.abandon)
        if self.enabled and not self.file.closed:
            self.file.close()
            if self.completions_file is not None:
                self.completions_file.close()
            for w in self.writers:
                w.close()


def completion_rows(step, roll, env, rewards, parts, n):
    """The first n rows of a rollout (environment.Rollout) as completions.jsonl rows: the texts
    decoded as environment.score decodes them for the rules (stop tokens left out), rewards (N,)
    and parts {name: (N,)} read in one transfer."""
    n = min(n, roll.r_ids.shape[0])
    ids, mask = roll.r_ids[:n], roll.r_mask[:n]
    is_stop = torch.isin(ids, ids.new_tensor(env.stop_ids))
    texts = sampling.decode_responses(env.tokenizer, ids, mask * (~is_stop).long(), roll.p_ids[:n])
    values = torch.stack([rewards[:n].float(), *(v[:n].float() for v in parts.values())]).tolist()
    return [{"step": step, "prompt": env.own_prompts[i], "completion": text, "reward": values[0][j],
             **{f"reward/{k}": values[1 + m][j] for m, k in enumerate(parts)}}
            for j, (i, text) in enumerate(zip(roll.prompt_idx[:n].tolist(), texts))]


def _clip(text, width, tail=False):
    """A prompt or completion on one line (newlines shown as \\n; a conversation: its last
    message), at most width characters: its tail, or its head and tail."""
    if not isinstance(text, str):
        text = text[-1]["content"] if text else ""
    text = json.dumps(text, ensure_ascii=False)[1:-1]
    if len(text) <= width:
        return text
    keep = width - 3
    return "..." + text[-keep:] if tail else text[:keep // 2] + "..." + text[-(keep - keep // 2):]


def completion_table(rows, steps):
    """The rows of completion_rows as a small table: the rewards, the prompt's end (a
    conversation's last message), the completion's head and tail."""
    parts = [k for k in rows[0] if k.startswith("reward/")]
    head = ["reward", *(k[len("reward/"):] for k in parts)]
    width = [max(7, len(h)) for h in head]
    lines = [f"step {rows[0]['step']}/{steps}: {len(rows)} completions (rank 0's first)",
             "  " + " ".join(h.rjust(w) for h, w in zip(head, width)) + " | " + "prompt".ljust(36) + " | completion"]
    for r in rows:
        nums = " ".join(_fmt(r[k]).rjust(w) for k, w in zip(["reward", *parts], width))
        lines.append(f"  {nums} | {_clip(r['prompt'], 36, tail=True).ljust(36)} | {_clip(r['completion'], 72)}")
    return "\n".join(lines)


def duration(seconds):
    """45s, 4m05s, 2h03m."""
    s = int(round(max(seconds, 0.0)))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s // 60 % 60:02d}m"


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


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


def layout(d):
    """How models are spread, for the run's banner: "" or " (HSDP: 2 replicas x 4 shards)"."""
    if not d.torchrun or d.mesh.ndim == 1:
        return ""
    return f" (HSDP: {d.mesh.shape[0]} replicas x {d.mesh.shape[1]} shards)"


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


class Clock:
    """Each phase's wall time and peak GPU memory within a step, read off a script's loop without
    timers in it: `clock.split("rollout")` ends the phase "rollout" (after the device's queued work:
    CUDA runs asynchronously), adding the seconds since the previous split to time/rollout and the
    peak since then to mem/rollout_gib (GPU only); lap() returns them, with time/step (the first
    split of the step to the last), and starts the next step. With a Logger, each split tells its
    heartbeat which phase runs next: the one that came next in the previous step (none known in
    the first), and after lap() the evaluation."""

    def __init__(self, d, logger=None):
        self.d, self.t0, self.last, self.seconds, self.peaks = d, None, None, {}, {}
        self.logger, self.ended, self.order = logger, [], []

    def split(self, phase=None):
        sync(self.d)
        now, peak = time.time(), peak_memory(self.d)  # peak_memory starts a new window
        if phase is not None and self.last is not None:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
            self.ended.append(phase)
        self.t0, self.last = self.t0 or now, now
        if self.logger is not None:
            n = len(self.ended)
            self.logger.running(self.order[n] if n < len(self.order) else None, now)

    def lap(self):
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        if self.d.device.type == "cuda":
            out |= {f"mem/{k}_gib": v for k, v in self.peaks.items()}
        out["time/step"] = (self.last or 0.0) - (self.t0 or 0.0)
        self.t0, self.last, self.seconds, self.peaks = None, None, {}, {}
        self.order, self.ended = self.ended, []
        if self.logger is not None:
            self.logger.running("evaluation", time.time())  # if the step has one; its log line ends it
        return out
