"""``benchmarks/tune_gpu.py --smoke``: every arm of the GPU benchmark (gpulens tune, brute
force, Lightning's Tuner, HF's auto_find_batch_size, head to head, before/after an OOM) runs on
a CPU with a tiny GPT-2 and an out-of-memory error injected from batch 8. No figure is
asserted (a CPU says nothing about a GPU); the structure and the OOM edges are."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support.inprocess import run_main

ROOT = Path(__file__).resolve().parents[1]


def test_tune_gpu_smoke(tmp_path: Path) -> None:
    """In this process (``tests.support.inprocess``): torch, transformers and Lightning are
    not imported again, and what the script changes in the process is put back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.pop("OUT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = run_main(ROOT / "benchmarks" / "tune_gpu.py", ["--smoke", "--out", str(tmp_path)],
                   tmp_path, env, preload=("torch", "transformers", "transformers.trainer",
                                           "lightning.pytorch", "accelerate"))
    assert "| tune |" in out
    data = json.loads((tmp_path / "tune_gpu.json").read_text())
    assert data["tune"]["oom_batch"] == 8 and data["brute_force"]["oom_batch"] == 8
    assert data["brute_force"]["complete"] and data["brute_force"]["best"] is not None
    assert data["lightning"]["batch_size"] == 4  # power mode: 2, 4, then 8 ran out of memory
    assert data["hf"]["batch_size"] == 7 and data["hf"]["error"] is None  # 8 x 0.9
    assert set(data["head_to_head"]) == {"tune", "brute force best", "lightning", "hf"}
    assert data["after_oom"]["oom"]["status"] == "oom"
    assert data["after_oom"]["before"]["status"] == data["after_oom"]["after"]["status"] == "ok"
    verdict = data["verdict"]
    assert verdict["no_crash"] is True and verdict["crashes"] == []
    for key in ("choice_vs_best_pct", "time_ratio", "after_oom_pct"):
        assert isinstance(verdict[key], float)
    md = (tmp_path / "tune_gpu.md").read_text()
    assert "| tune |" in md and "| brute force best |" in md and "| lightning | 4 |" in md
    assert '<svg class="chart"' in (tmp_path / "tune_report.html").read_text()
