"""A run a user can watch (plumbing/logs.py): the step line's `step k/N | elapsed | ETA`, the
heartbeat while a step runs (an injected clock), grpo.py --log_completions (completions.jsonl
against the rewards the step logged, and across a resume) and the closing summary."""
import json
import re
import types

import pytest

from helpers import chat_rows, gamma, read_metrics, run_here, write_jsonl
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


# -----------------------------------------------------------------------------
# a real run: grpo.py on a Llama-shaped folder, its step lines, completions and summary


def grpo_argv(tmp_path, models, out, *extra):
    data = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(16, "prompt"))  # the digits rule: rewards vary
    return ["grpo.py", "--model", models["llama"], "--dataset", data, "--steps", "3", "--prompts_per_step", "2",
            "--group_size", "4", "--max_prompt_len", "128", "--max_new_tokens", "8", "--temperature", "1.0",
            "--eval_every", "2", "--warmup_steps", "0", "--lr", "1e-4", "--log_completions", "8", "--out_dir",
            str(out), *extra]


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_grpo_step_lines_completions_and_summary_across_a_resume(tmp_path, user_models, monkeypatch):
    """Each step line opens `step k/3 | elapsed | ETA` (0s at the last; elapsed and ETA what
    metrics.jsonl's times give). --log_completions 8 (all of a step's rows here): 8 rows a step, each
    completion's reward the digits rule of its text, their mean the step's logged `reward`, its
    prompt the data's. A run interrupted after step 3 (checkpoint at step 2) and resumed keeps
    exactly 8 rows a step, step 3's those the first attempt drew. The summary names the steps,
    the final metrics, the files and the plot command."""
    out = tmp_path / "run"
    monkeypatch.setattr(rundir.Run, "finish", lambda self, model=None: (_ for _ in ()).throw(KeyboardInterrupt))
    first = run_here(grpo_argv(tmp_path, user_models, out, "--save_every", "2"))
    assert first.returncode == 130, first.stdout[-2000:] + first.stderr[-2000:]
    monkeypatch.undo()
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
