"""Logging a run: metrics.jsonl and a step line on rank 0 (wandb when asked), each phase's wall time
and peak GPU memory (Clock), and how the models are spread, for the banners."""
import dataclasses
import json
import os
import time

import torch


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


class Clock:
    """Each phase's wall time and peak GPU memory within a step, read off a script's loop without
    timers in it: `clock.split("rollout")` ends the phase "rollout" (after the device's queued work:
    CUDA runs asynchronously), adding the seconds since the previous split to time/rollout and the
    peak since then to mem/rollout_gib (GPU only); lap() returns them, with time/step (the first
    split of the step to the last), and starts the next step."""

    def __init__(self, d):
        self.d, self.t0, self.last, self.seconds, self.peaks = d, None, None, {}, {}

    def split(self, phase=None):
        sync(self.d)
        now, peak = time.time(), peak_memory(self.d)  # peak_memory starts a new window
        if phase is not None and self.last is not None:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
        self.t0, self.last = self.t0 or now, now

    def lap(self):
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        if self.d.device.type == "cuda":
            out |= {f"mem/{k}_gib": v for k, v in self.peaks.items()}
        out["time/step"] = (self.last or 0.0) - (self.t0 or 0.0)
        self.t0, self.last, self.seconds, self.peaks = None, None, {}, {}
        return out
