"""bench/gpu_speed.py, the one command for speed on a GPU, kept from rotting between GPU loans: its
CPU subset (tiny shapes, the scripts in this process) runs every section's code, writes its table
and JSON, and a budget spent skips the sections left, naming the command that runs them."""
import json

import pytest

from bench import gpu_speed


def test_gpu_speed_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA GPU.*--cpu"):
        gpu_speed.main([])


def test_gpu_speed_cpu_subset_runs_every_section(tmp_path):
    """decode (ours against model.generate: tokens/s, ops and syncs a step, a profile of each),
    compile (a GPU's only: said so), grpo and dpo (ours at its default flags, twice, alternating;
    TRL where importable, here not: said so), and the files."""
    assert gpu_speed.main(["--cpu", "--results", str(tmp_path)]) == 0
    table = (tmp_path / "gpu-speed-cpu.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    whats = [r[1] for r in rows]
    for want in ("ours eager: 8 rows x 8 tokens", "model.generate: 8 rows x 8 tokens", "ops and host syncs",
                 "profile of 16 decode steps", "grpo.py --compile through evaluations", "qwen2-tiny, ours: tokens/s",
                 "qwen2-tiny: ours / TRL 1.16", "wall time"):
        assert any(w.startswith(want) or want in w for w in whats), (want, table)
    assert sum("qwen2-tiny, ours" in w for w in whats) == 2  # grpo and dpo
    assert not any("FAILED" in w or "skipped" in w for w in whats), table
    details = json.loads((tmp_path / "gpu-speed-cpu.json").read_text())["details"]
    profiles = details["decode"]["profiles"]
    assert set(profiles) == {"ours eager", "model.generate"}
    assert all(p["host_ops"] and p["ops"] > 100 for p in profiles.values()), profiles
    assert [len(details[f"{a} qwen2-tiny"]["ours"]) for a in ("grpo", "dpo")] == [2, 2]  # each repeat a run


def test_gpu_speed_skips_the_sections_past_its_budget(tmp_path):
    assert gpu_speed.main(["--cpu", "--only", "grpo,dpo", "--budget_s", "0", "--results", str(tmp_path)]) == 0
    table = (tmp_path / "gpu-speed-cpu.md").read_text()
    assert "| grpo | grpo qwen2-tiny: skipped |" in table and "--only dpo --shapes qwen2-tiny" in table, table
