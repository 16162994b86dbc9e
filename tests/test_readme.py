"""The README is for the person who trains models: short, every picture it shows exists, no
project history or machine paths in it, and its key table names every key a row can hold."""

from __future__ import annotations

import re
import time
from pathlib import Path

import gpulens
from gpulens.integrations.phases import StepPhases
from gpulens.schema import GPU_ROW_KEYS, HOST_KEYS
from gpulens.testing import MemorySink, SimulatedNVML

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_short_with_the_two_commands_and_each_view() -> None:
    assert len(README.splitlines()) < 200
    assert "make demo" in README and "make test" in README
    for view in ("gpulens report", "dashboard", "W&B", "MLflow", "gpulens watch", "Prometheus"):
        assert view in README, view


def test_every_picture_exists_and_the_report_dashboard_and_a_tracker_are_shown() -> None:
    pictures = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", README)
    assert {"docs/img/report.png", "docs/img/dashboard.png"} <= set(pictures)
    assert any("mlflow" in p or "wandb" in p for p in pictures)
    for picture in pictures:
        data = (ROOT / picture).read_bytes()
        assert data.startswith(b"\x89PNG"), picture


def test_no_project_history_and_no_machine_paths() -> None:
    for said in (r"\bissue \d+", r"#\d+\b", r"overwritten", r"/work/", r"/home/", r"/tmp/",
                 r"\bwe\b"):
        assert not re.search(said, README, re.I), said


def _table_keys() -> set[str]:
    """The keys named in the first cells of the README's tables: ``gpu/{i}/power_w``, ``_max``
    (the previous key plus it; after ``<metric>_mean``, in place of ``_mean``),
    ``power_limit_w`` (the cell's prefix plus it), ``(and `_s`)`` (each ``_pct`` key of the
    cell as ``_s``)."""
    keys: set[str] = set()
    for line in README.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", cell)
        prefix, last, in_cell = "", "", []
        for name in names:
            if name == "_s" and "(and" in cell:
                in_cell += [k[: -len("_pct")] + "_s" for k in in_cell if k.endswith("_pct")]
                continue
            if name.startswith("_"):  # after `<metric>_mean`: instead of `_mean`
                key = re.sub(r"_(mean|min|max)$", "", last) + name
            elif "/" in name:
                key = name
                prefix = name.rsplit("/", 1)[0] + "/"
            else:
                key = prefix + name
            if not name.startswith("_"):
                last = key
            in_cell.append(key)
        keys.update(in_cell)
    return keys


def _general(key: str) -> str:
    """A row's key as the table names it: ``gpu/1/power_w`` -> ``gpu/{i}/power_w``."""
    key = re.sub(r"^gpu/\d+/", "gpu/{i}/", key)
    key = re.sub(r"^rank/\d+/", "rank/{r}/", key)
    key = re.sub(r"^alerts/.+$", "alerts/<rule>", key)
    if key.startswith("gpu/all/"):
        return "gpu/all/<metric>" + key[key.rfind("_"):]
    if key.startswith("train/") and key != "train/global_step":
        return "train/<name>"
    return key


def test_the_key_table_names_every_key_a_row_can_hold() -> None:
    """Keys of real rows (2 simulated GPUs, the work and step phases a callback passes), the
    schema's per-GPU and host keys, and the keys of distributed and wall-clock rows."""
    sink = MemorySink()
    phases = StepPhases()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=2),
                         isolation="thread", dtype="bf16", flops_per_token=6e9) as mon:
        for step in range(1, 4):
            phases.resume()
            time.sleep(0.01)
            phases.step_begin()
            time.sleep(0.02)
            phases.before_optimizer()
            phases.step_end()
            mon.log(step, loss=1.0, tokens=4096, samples=4, **phases.collect(1))
    seen = {k for row in sink.rows for k in row.values}
    expected = {_general(k) for k in seen}
    expected |= {f"gpu/{{i}}/{k}" for k in GPU_ROW_KEYS} | {f"host/{k}" for k in HOST_KEYS}
    expected |= {"alerts/<rule>", "record/elapsed_s", "train/global_step", "perf/partial_gpus",
                 "gpu/all/<metric>_sum"}
    # distributed jobs (tests/test_distributed_gather.py makes them): per rank, the job's shape
    expected |= {f"rank/{{r}}/{who}_{what}" for who in ("cpu", "gpu")
                 for what in ("busy_s", "relative_score", "individual_score")}
    expected |= {f"job/{k}" for k in ("ranks", "nodes", "gpus", "world", "partial")}
    expected |= {"gpu/worst{j}/*", "node/worst{j}/*", "rank/slowest{j}/*"}
    named = _table_keys()
    assert not expected - named, sorted(expected - named)
