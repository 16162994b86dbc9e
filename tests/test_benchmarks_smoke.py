"""Smoke tests of the benchmark scripts: they run on the CPU with simulated GPUs and print their
figures. No timing is asserted (the figures depend on the machine); the structure is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
NUMBER = r"-?\d+(?:\.\d+)?"


def run_script(name: str, tmp_path: Path, *args: str, timeout: float = 120) -> str:
    """Run ``benchmarks/<name> --quick ...`` in a subprocess; return its stdout."""
    env = dict(os.environ)
    env.pop("OUT", None)
    env.update(
        GPULENS_BACKEND="simulated",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        MLFLOW_TRACKING_URI=(tmp_path / "mlruns").as_uri(),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def table_rows(out: str, first_col: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell, for the table whose header starts so."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in out.splitlines():
        if line.startswith(f"| {first_col} |"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif in_table:
            break
    return rows


def test_bench_log_quick_prints_every_figure(tmp_path: Path) -> None:
    out = run_script("bench_log.py", tmp_path, "--json", str(tmp_path / "log.json"),
                     "--tracemalloc")
    rows = table_rows(out, "figure")
    assert re.fullmatch(rf"{NUMBER} us", rows["log() median, 8 simulated GPUs, 10 Hz"][0])
    assert re.fullmatch(rf"{NUMBER} ms/step", rows["5 ms step loop, without gpulens"][0])
    assert re.fullmatch(
        rf"{NUMBER} ms/step", rows["5 ms step loop, with gpulens (log every step)"][0]
    )
    assert re.fullmatch(NUMBER, rows["loop time ratio with / without (medians)"][0])
    growth = [k for k in rows if k.startswith("RSS growth")]
    assert growth and re.fullmatch(rf"{NUMBER} MiB", rows[growth[0]][0])
    assert re.match(r"[+-]\d+ \(of \d+\)",
                    rows["objects tracked by the GC: growth over the same rows"][0])
    fig = json.loads((tmp_path / "log.json").read_text())
    assert fig["log_calls"] == 300
    # every logged row reached the sink: the figure is about a complete run
    assert fig["mem_rows_written"] == fig["mem_rows"] and fig["mem_drained"]
    assert "mem_traced_growth_kib" in fig
    assert 0.5 < fig["loop_ratio"] < 2.0


def test_overhead_quick_runs_every_variant_or_says_why(tmp_path: Path) -> None:
    out = run_script("overhead_gpu.py", tmp_path, "--json", str(tmp_path / "overhead.json"),
                     timeout=240)
    rows = table_rows(out, "variant")
    assert set(rows) == {"none", "gpulens", "gpulens_thread", "wandb", "mlflow", "nvitop",
                         "lightning", "lightning_dsm"}
    for name in ("none", "gpulens", "gpulens_thread", "lightning", "lightning_dsm"):
        assert re.fullmatch(NUMBER, rows[name][0]), (name, rows[name])
        # per-round ratio: median [95 % interval]
        assert re.fullmatch(rf"{NUMBER} \[{NUMBER}, {NUMBER}\]", rows[name][3]), rows[name]
    # gpulens wrote rows with GPU figures from the simulated backend, in both isolations
    for name in ("gpulens", "gpulens_thread"):
        assert re.search(r"\d+ rows, backend simulated, [1-9]\d* gpu/0 keys", rows[name][-1])
    # gpulens against every other monitor that ran, round by round
    versus = table_rows(out, "gpulens vs")
    ran = {n for n, cells in rows.items() if cells[0] != "skipped"}
    assert set(versus) == ran - {"none", "gpulens", "lightning"}
    for cells in versus.values():
        assert re.fullmatch(rf"[+-]{NUMBER}", cells[0]) and re.fullmatch(r"\d+ of 2", cells[2])
    for name, cells in rows.items():  # a peer either ran (a number) or says why not
        assert re.fullmatch(NUMBER, cells[0]) or (cells[0] == "skipped" and cells[-1]), name
    data = json.loads((tmp_path / "overhead.json").read_text())
    g = data["variants"]["gpulens"]
    assert g["baseline"] == "none" and g["steps"] == 2 * 6 and g["ratio"] > 0
    assert data["variants"]["lightning_dsm"]["baseline"] == "lightning"
    assert data["meta"]["quick"] is True


def test_fidelity_quick_prints_steps_and_checks(tmp_path: Path) -> None:
    out = run_script("fidelity_gpu.py", tmp_path, "--json", str(tmp_path / "fidelity.json"))
    steps = table_rows(out, "step")
    assert [v[0] for v in steps.values()] == ["busy", "idle"] * 3
    assert all(re.fullmatch(NUMBER, v[2]) for v in steps.values())  # sm_active_pct
    checks = table_rows(out, "check")
    assert "busy steps: gpulens sm_active_pct >= 80" in checks
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert data["backend"] == "simulated" and len(data["steps"]) == 6


def test_pipe_wake_prints_both_readers(tmp_path: Path) -> None:
    out = run_script("pipe_wake.py", tmp_path)
    rows = table_rows(out, "reader")
    assert set(rows) == {"sleeps in read", "polls"}
    for cells in rows.values():
        assert re.fullmatch(NUMBER, cells[0]) and re.fullmatch(NUMBER, cells[1])
