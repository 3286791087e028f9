"""A run a user can watch (plumbing/logs.py): the step line's `step k/N | elapsed | ETA`, the
heartbeat while a step runs (an injected clock), grpo.py --log_completions (completions.jsonl
against the rewards the step logged, and across a resume) and the closing summary."""
import json
import re
import types

import pytest
import torch

from helpers import chat_rows, ctrl_c_after_first_save, gamma, read_metrics, run_here, write_jsonl
from plumbing import logs, rundir
import tasks

STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| elapsed (\S+)(?: \| ETA (\S+))? \|", re.M)


def seconds(text):
    """logs.duration's text back to seconds: 45s, 4m05s, 2h03m."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    h, mnt, s = (int(x or 0) for x in m.groups())
    return 3600 * h + 60 * mnt + s


def test_duration_reads_as_it_is_written():
    assert [logs.duration(s) for s in (0, 44.6, 60, 245, 3599, 3600, 7390)] == \
        ["0s", "45s", "1m00s", "4m05s", "59m59s", "1h00m", "2h03m"]
    assert [seconds(logs.duration(s)) for s in (44.6, 245, 7380)] == [45, 245, 7380]


def test_eta_is_the_steps_left_times_the_mean_step_since_the_first_evaluation(tmp_path, capsys):
    """On an injected clock: the step-0 evaluation (20 s after the start) is not a step; steps of
    10 s then 30 s (an evaluation or a save between two lines counts) give ETAs of 99 x 10 s
    and 98 x 20 s; elapsed counts from the start."""
    clock = FakeClock()
    log = make_logger(tmp_path, clock, heartbeat=0)
    for dt, step in ((20, 0), (10, 1), (30, 2)):
        clock.t += dt
        log.log(step, {"loss": 1.0})
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 0/100 | elapsed 20s | loss 1", "step 1/100 | elapsed 30s | ETA 16m30s | loss 1",
        "step 2/100 | elapsed 1m00s | ETA 32m40s | loss 1"]


# -----------------------------------------------------------------------------
# the heartbeat, on an injected clock: no thread needed but the one test that it prints


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make_logger(tmp_path, clock, is_main=True, heartbeat=30.0):
    cfg = types.SimpleNamespace(steps=100, wandb=False)
    return logs.Logger(str(tmp_path), cfg, types.SimpleNamespace(is_main=is_main), heartbeat=heartbeat, now=clock)


def test_the_heartbeat_speaks_after_30_s_of_silence_naming_the_step_and_phase(tmp_path, capsys):
    """Nothing before HEARTBEAT_SECONDS of silence; then `step k/N: <phase> running, <s>` with the
    phase Clock announced and its own seconds; a printed line (a heartbeat, a step line) starts
    the silence again; never a row of metrics.jsonl."""
    clock = FakeClock()
    log = make_logger(tmp_path, clock, heartbeat=0)  # no thread: beat() is called by hand
    log.heartbeat = 30.0
    clock.t += 29.9
    assert log.beat() is None
    clock.t += 0.2
    assert log.beat() == "step 1/100: running, 30s"  # no step logged yet, no phase known
    log.log(0, {"eval/accuracy": 0.5})
    log.log(1, {"loss": 1.0})
    log.log(2, {"loss": 0.9})
    log.running("rollout", clock.t + 5)
    clock.t += 29
    assert log.beat() is None  # 29 s since the step line
    clock.t += 21
    assert log.beat() == "step 3/100: rollout running, 45s"
    log.say(log.beat())
    clock.t += 29
    assert log.beat() is None  # 29 s since the heartbeat
    clock.t += 2
    assert log.beat() == "step 3/100: rollout running, 1m16s"
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert "running" not in (tmp_path / "metrics.jsonl").read_text()
    assert "step 3/100: rollout running, 45s" in capsys.readouterr().out


def test_the_heartbeat_thread_prints_on_rank_0_only(tmp_path, capsys):
    """The thread prints beat()'s line once the (injected) clock has passed the interval; on
    another rank there is no thread and nothing printed; close() ends it."""
    clock = FakeClock()
    other = make_logger(tmp_path / "r1", clock, is_main=False, heartbeat=0.01)
    log = make_logger(tmp_path, clock, heartbeat=0.01)
    clock.t += 60
    for _ in range(2000):  # up to 20 s for the thread to wake up on a loaded machine
        if "step 1/100: running, 1m00s" in capsys.readouterr().out:
            break
        log.stop.wait(0.01)
    else:
        raise AssertionError("no heartbeat line")
    log.close()
    other.close()
    assert not (tmp_path / "r1").exists()


def test_clock_tells_the_heartbeat_the_phase_that_came_next_last_step(tmp_path):
    """Clock.split ends a phase; the heartbeat's phase is the one that followed it in the previous
    step (none in the first), and the evaluation after lap()."""
    import common

    log = make_logger(tmp_path, FakeClock(), heartbeat=0)
    clock = logs.Clock(common.Dist(), log)
    seen = []
    for _ in range(2):
        clock.split()
        seen.append(log.phase)
        for phase in ("rollout", "reward", "update"):
            clock.split(phase)
            seen.append(log.phase)
        clock.lap()
        seen.append(log.phase)
    assert seen == [None, None, None, None, "evaluation", "rollout", "reward", "update", None, "evaluation"]
    log.close()


def test_a_phase_names_itself_with_its_rows_done_and_its_eta(tmp_path):
    """A phase (logs.phase) that outlasts the heartbeat names itself in its line: a
    common.map_rows pass inside it counts its rows (12 in chunks of 4, 10 s a chunk: 4/12 after
    20 s, ETA 20 s / 4 x 8, on an injected clock), a second pass's rows join the total;
    a checkpoint's names the step it saves, not the one the loop is in; after the last step the
    line never names a step past it (it said `step 4/3: running`). Before a run logs (dpo.py's
    reference, a GGUF conversion), the heartbeat of cli.start names the phase alone, once it has
    run HEARTBEAT_SECONDS."""
    import common

    clock = FakeClock()
    log = make_logger(tmp_path, clock, heartbeat=0)
    log.heartbeat = 30.0
    log.log(0, {"eval/loss": 1.0})
    log.log(1, {"loss": 1.0})
    seen = []

    def chunk(rows):
        clock.t += 10
        log.t_said = clock.t - 30  # silent long enough
        seen.append(log.beat())
        return torch.zeros(len(rows), 1)

    with logs.phase("reference log-probs", now=clock):
        common.map_rows(chunk, 12, common.Dist(), batch_size=4)
        common.map_rows(chunk, 6, common.Dist(), batch_size=3)
    assert seen == ["step 2/100: reference log-probs, 10s", "step 2/100: reference log-probs 4/12, 20s, ETA 40s",
                    "step 2/100: reference log-probs 8/12, 30s, ETA 15s", "step 2/100: reference log-probs 12/12, 40s",
                    "step 2/100: reference log-probs 15/18, 50s, ETA 10s"]
    with logs.phase(logs.SAVING, step=1, now=clock):
        clock.t += 41
        assert log.beat() == "step 1/100: saving checkpoint, 41s"
    assert log.beat() == "step 2/100: running, 1m31s"  # since the step line: Clock's phase, or none
    log.steps = 1
    assert log.beat() == "step 1/1: running, 1m31s"
    log.close()

    early = logs.Heartbeat(is_main=False, now=clock)  # no thread: beat() by hand
    assert early.beat() is None
    with logs.phase("GGUF conversion", now=clock):
        clock.t += 29
        assert early.beat() is None
        clock.t += 1
        assert early.beat() == "GGUF conversion, 30s"
    assert early.beat() is None


def test_the_eta_counts_the_phases_after_the_last_step(tmp_path, capsys):
    """The final evaluation and the last step's checkpoint run after the last step's line: the
    ETA adds the seconds the last evaluation and the last checkpoint took (logs.TOOK), on an
    injected clock: steps of 15 s (10 + a 5-s evaluation) and 13 s (10 + a 3-s save) give
    14 s x 1 + 5 + 3 = 22 s after step 2, and 8 s after the last."""
    clock = FakeClock()
    log = make_logger(tmp_path, clock, heartbeat=0)
    log.steps = 3
    clock.t += 20
    log.log(0, {"eval/loss": 1.0})
    with logs.phase("evaluation", now=clock):
        clock.t += 5
    clock.t += 10
    log.log(1, {"loss": 1.0})
    with logs.phase(logs.SAVING, step=1, now=clock):
        clock.t += 3
    clock.t += 10
    log.log(2, {"loss": 1.0})
    clock.t += 10
    log.log(3, {"loss": 1.0})
    log.close()
    etas = [m.group(4) for m in STEP_LINE.finditer(capsys.readouterr().out)]
    assert etas == [None, "35s", "22s", "8s"]  # 15 x 2 + 5; 14 x 1 + 5 + 3; 0 + 5 + 3


# each script's phases, as its run opens them (tests/test_robustness.py's fast runs of the tiny model)
PHASES_OF = {
    "sft.py": ["evaluation", "saving checkpoint", "evaluation", "final export"],
    "reward.py": ["evaluation", "saving checkpoint", "evaluation", "normalisation", "final export"],
    "dpo.py": ["reference log-probs", "evaluation", "saving checkpoint", "evaluation", "final export"],
    "grpo.py": ["evaluation", "saving checkpoint", "evaluation", "final export"],
}


@pytest.mark.parametrize("script", PHASES_OF)
def test_every_long_phase_of_every_script_names_itself_with_its_rows(tmp_path, monkeypatch, script):
    """dpo.py's precomputed reference ran 3m51s with no line, GRPO's step-0 evaluation 3m53s under
    `step 1/1: running`, reward.py's --normalize pass 12 minutes under `step 3/3: running`. Each
    is now a phase the heartbeat names (logs.phase), in the order the run opens them: the
    step-0 evaluation, the last step's checkpoint, the final evaluation (reward.py's
    normalisation), the export; each evaluation, reference and normalisation counts its rows to
    their total (common.map_rows), which the heartbeat line shows."""
    from test_robustness import FAST

    opened = []

    class Recorded(logs.Phase):
        def __init__(self, name, **kw):
            super().__init__(name, **kw)
            opened.append(self)

    monkeypatch.setattr(logs, "Phase", Recorded)
    r = run_here([script, *FAST[script], "--steps", "1", "--out_dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in opened] == PHASES_OF[script]
    for p in opened:
        counted = p.name in ("evaluation", "reference log-probs", "normalisation")
        assert (p.total > 0 and p.done == p.total) if counted else p.total == 0, (p.name, p.done, p.total)


def test_a_gguf_conversion_is_a_phase(tmp_path, monkeypatch):
    """A GGUF file's conversion at load (models.convert_gguf: SmolLM2's took minutes on a loaded
    machine) is a phase the heartbeat names; here the conversion is found cached (RLHF_CACHE)."""
    from plumbing import models

    opened, real = [], logs.Phase
    monkeypatch.setattr(logs, "Phase", lambda name, **kw: opened.append(name) or real(name, **kw))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    st = gguf.stat()
    cached = tmp_path / "cache" / "gguf" / f"m-{st.st_size:x}-{st.st_mtime_ns:x}"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert models.convert_gguf(str(gguf)) == str(cached)
    assert opened == ["GGUF conversion"]


# -----------------------------------------------------------------------------
# --report_to (TRL's values): wandb, TensorBoard, trackio, each an optional install; time across a resume


def fake_reporters(monkeypatch):
    """Modules wandb, trackio and torch.utils.tensorboard (none is a dependency, and the suite
    must run without them) that record each call as (logger, step or what, metrics), findable
    as installed (importlib.util.find_spec: tensorboard's by its own package name)."""
    import importlib.machinery
    import sys

    calls = []

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)

    class WandbRun:
        def log(self, metrics, step):
            calls.append(("wandb", step, dict(metrics)))

        def finish(self):
            calls.append(("wandb", "finish", None))

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("tensorboard", "init", log_dir))

        def add_scalar(self, tag, value, global_step):
            calls.append(("tensorboard", global_step, {tag: value}))

        def flush(self):
            pass

        def close(self):
            calls.append(("tensorboard", "finish", None))

    module("wandb", init=lambda project, config: calls.append(("wandb", "init", project)) or WandbRun())
    module("trackio", init=lambda project, config: calls.append(("trackio", "init", project)),
           log=lambda metrics, step: calls.append(("trackio", step, dict(metrics))),
           finish=lambda: calls.append(("trackio", "finish", None)))
    module("tensorboard")
    module("torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    return calls


SFT = ["sft.py", "--model", "tiny", "--n_train", "16", "--n_eval", "4", "--batch_size", "4", "--warmup_steps", "0"]


def test_report_to_sends_every_row_to_each_logger_under_the_names_of_metrics_jsonl(tmp_path, monkeypatch):
    """`--report_to tensorboard trackio` (TRL's list form) with `--wandb` (its alias of wandb) was
    refused ("only wandb here"). Each logger now gets every row of metrics.jsonl at its step and
    under its names (the final evaluation's too, which joins the last step's row; not `time`,
    which trackio reserves), and is closed at the end; TensorBoard's files go into
    out_dir/tensorboard."""
    calls = fake_reporters(monkeypatch)
    out = tmp_path / "run"
    r = run_here([*SFT, "--steps", "2", "--out_dir", str(out), "--report_to", "tensorboard", "trackio", "--wandb"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["step"]: {k: v for k, v in row.items() if k not in ("step", "time")} for row in read_metrics(out)}
    assert list(rows) == [0, 1, 2] and "eval/loss" in rows[2]
    for name in ("wandb", "trackio", "tensorboard"):
        got = {}
        for who, step, metrics in calls:
            if who == name and isinstance(step, int):
                got.setdefault(step, {}).update(metrics)
        assert got == rows, name
        assert [what for who, what, _ in calls if who == name and isinstance(what, str)] == ["init", "finish"]
    assert ("tensorboard", "init", str(out / "tensorboard")) in calls and ("trackio", "init", "rlhf-sft") in calls


def test_report_to_without_its_package_or_with_another_value_is_refused_at_the_start(tmp_path, monkeypatch):
    """A logger that is not installed is named with its pip line before anything loads or is
    written; a value none of TRL's three here names them; `none` logs to metrics.jsonl alone."""
    import importlib.util

    if importlib.util.find_spec("trackio") is not None:
        pytest.skip("trackio is installed here")
    out = tmp_path / "run"
    r = run_here([*SFT, "--steps", "1", "--out_dir", str(out), "--report_to", "wandb,trackio"])
    missing = "wandb" if importlib.util.find_spec("wandb") is None else "trackio"
    assert r.returncode == 1 and (f"sft.py: --report_to {missing} needs the package {missing}, which is not installed: "
                                  f"pip install {missing}") in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()
    r = run_here([*SFT, "--steps", "1", "--out_dir", str(out), "--report_to", "mlflow"])
    assert r.returncode == 1 and "--report_to mlflow: give any of wandb, tensorboard, trackio" in r.stderr
    assert not out.exists()
    assert run_here([*SFT, "--steps", "1", "--out_dir", str(out), "--report_to", "none"]).returncode == 0


def test_time_goes_on_across_a_resume(tmp_path):
    """metrics.jsonl's `time` restarted at 0 after --resume. A resumed run's rows go on from the
    last row kept: step 3's time is step 2's plus at least step 3's own wall time (time/step; 0.01
    for the rounding of both times to 2 decimals)."""
    args = [*SFT, "--steps", "4", "--save_every", "2", "--out_dir", str(tmp_path / "run")]
    with ctrl_c_after_first_save():
        assert run_here(args).returncode == 130
    resumed = run_here([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[3]["time"] - rows[2]["time"] >= rows[3]["time/step"] - 0.01, rows


# -----------------------------------------------------------------------------
# a real run: grpo.py on a Llama-shaped folder, its step lines, completions and summary


def grpo_argv(tmp_path, models, out, *extra):
    data = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(16, "prompt"))  # the digits rule: rewards vary
    return ["grpo.py", "--model", models["llama"], "--dataset", data, "--steps", "3", "--prompts_per_step", "2",
            "--group_size", "4", "--max_prompt_len", "128", "--max_new_tokens", "8", "--temperature", "1.0",
            "--eval_every", "2", "--warmup_steps", "0", "--lr", "1e-4", "--log_completions", "8", "--out_dir",
            str(out), *extra]


class NoTimes(dict):
    """logs.TOOK that keeps no phase's time: an ETA of the steps alone."""

    def __setitem__(self, name, seconds):
        pass


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_grpo_step_lines_completions_and_summary_across_a_resume(tmp_path, user_models, monkeypatch):
    """Each step line opens `step k/3 | elapsed | ETA` (0s at the last; elapsed and ETA what
    metrics.jsonl's times give). --log_completions 8 (all of a step's rows here): 8 rows a step, each
    completion's reward the digits rule of its text, their mean the step's logged `reward`, its
    prompt the data's. A run interrupted after step 3's line, before its checkpoint (checkpoint at
    step 2), and resumed keeps exactly 8 rows a step, step 3's those the first attempt drew. The
    summary names the steps, the final metrics, the files and the plot command. (The phases after
    the last step, which the ETA counts as long as they last took, count 0 s here:
    test_the_eta_counts_the_phases_after_the_last_step.)"""
    out = tmp_path / "run"
    save = rundir.Run.save
    monkeypatch.setattr(rundir.Run, "save", lambda self, step=None, model=None: (_ for _ in ()).throw(
        KeyboardInterrupt) if step == 3 else save(self, step, model))
    monkeypatch.setattr(logs, "TOOK", NoTimes())
    first = run_here(grpo_argv(tmp_path, user_models, out, "--save_every", "2"))
    assert first.returncode == 130, first.stdout[-2000:] + first.stderr[-2000:]
    monkeypatch.setattr(rundir.Run, "save", save)
    before = read_rows(out / "completions.jsonl")
    assert [r["step"] for r in before] == [1] * 8 + [2] * 8 + [3] * 8

    lines = [m.groups() for m in STEP_LINE.finditer(first.stdout)]
    metrics = read_metrics(out)  # the held-out 5% of the prompts evaluated at step 0, then 3 steps
    assert [(int(k), int(n)) for k, n, _, _ in lines] == [(r["step"], 3) for r in metrics] == [(0, 3), (1, 3), (2, 3),
                                                                                               (3, 3)]
    assert lines[0][3] is None  # no ETA before a step has run
    for (k, _, elapsed, eta), row in zip(lines[1:], metrics[1:]):  # the mean step since the step-0 evaluation
        assert abs(seconds(elapsed) - row["time"]) <= 1
        assert abs(seconds(eta) - (row["time"] - metrics[0]["time"]) / int(k) * (3 - int(k))) <= 1.01
    assert lines[-1][3] == "0s"

    resumed = run_here(grpo_argv(tmp_path, user_models, out, "--resume", "--save_every", "2"))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    rows, metrics = read_rows(out / "completions.jsonl"), read_metrics(out)
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8 + [3] * 8  # step 3's first rows cut, drawn again
    assert rows[16:] == before[16:]  # a resume draws what the uninterrupted run drew
    prompts = [r["prompt"] for r in chat_rows(16, "prompt")]
    by_step = {m["step"]: m for m in metrics}
    for step in (1, 2, 3):
        mine = [r for r in rows if r["step"] == step]
        for r in mine:
            assert r["reward"] == r["reward/rule"] == pytest.approx(tasks.digits_reward(None, r["completion"]))
            assert r["prompt"] in prompts
        assert [r["prompt"] for r in mine[:4]] == [mine[0]["prompt"]] * 4  # a group's G completions together
        # float32 group means of 8 rewards >= 0, summed: within gamma_10 of their size
        assert sum(r["reward"] for r in mine) / 8 == pytest.approx(by_step[step]["reward"],
                                                                  abs=gamma(8 + 2) * sum(r["reward"] for r in mine) / 8)
    assert any(r["reward"] > 0 for r in rows) and len({r["completion"] for r in rows}) > 12

    table = resumed.stdout[resumed.stdout.index("step 3/3: 8 completions"):]
    assert table.splitlines()[2].lstrip().startswith(logs._fmt(rows[16]["reward"]))
    last = metrics[-1]
    summary = resumed.stdout[resumed.stdout.index("done: "):].splitlines()
    assert summary[0].startswith("done: steps 3-3 of 3, ")
    assert f"loss {logs._fmt(last['loss'])} | grad_norm {logs._fmt(last['grad_norm'])}" in summary[1]
    assert f"reward_std {logs._fmt(last['reward_std'])} | frac_reward_zero_std" in summary[1]
    assert summary[1].startswith("final: loss ") and "time/" not in summary[1]
    assert summary[2:] == [f"checkpoint:  {out / 'checkpoint'}", f"metrics:     {out / 'metrics.jsonl'}",
                           f"completions: {out / 'completions.jsonl'}", f"plot:        python plots/plot.py {out}"]
