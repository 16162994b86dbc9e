"""The JSONL record: a ``run_start`` header from the run's context, the run id on every row,
events as lines of their own, and appending (a second run never overwrites the first)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import gpulens
from gpulens.model import Event, GpuInfo, Row, RunContext
from gpulens.sinks import sink_spec
from gpulens.sinks.jsonl import JsonlSink
from tests.support.jsonl import read_lines, read_rows


def monitored_run(path: Path, steps: int, gpus: int = 2) -> None:
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[f"jsonl:{path}"]) as mon:
        assert mon.context is not None and len(mon.context.gpus) == gpus
        for step in range(1, steps + 1):
            time.sleep(0.02)
            mon.log(step, loss=1.0 / step)


def test_header_from_the_run_context_and_run_id_on_rows(tmp_path: Path) -> None:
    path = tmp_path / "gpu.jsonl"
    before = time.time()
    monitored_run(path, 5)
    lines = read_lines(path)
    head, *rest, end = lines
    body = [r for r in rest if "event" not in r]
    notices = [r for r in rest if r.get("event") == "notice"]  # the engine's, on some rows
    assert all(n["run_id"] == head["run_id"] and n["step"] in range(1, 6) for n in notices)
    assert head["event"] == "run_start"
    assert head["backend"] == "simulated"
    assert before - 1 < head["time"] <= time.time()
    assert head["hostname"] and head["interval"] == 0.02
    assert head["gpulens_version"] == gpulens.__version__
    assert [g["index"] for g in head["gpus"]] == [0, 1]
    for g in head["gpus"]:
        assert g["name"] == "Simulated H100 80GB HBM3"
        assert g["uuid"].startswith("GPU-") and g["pci_bus_id"]
        assert g["mem_total_gb"] == 85.89934592 and g["power_limit_w"] == 700.0
    run_id = head["run_id"]
    assert isinstance(run_id, str) and len(run_id) >= 12
    assert [r["step"] for r in body] == [1, 2, 3, 4, 5]
    assert all(r["run_id"] == run_id and "event" not in r for r in body)
    assert end == {"event": "run_end", "run_id": run_id, "time": end["time"], "rows": 5}


def test_a_second_run_is_appended_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "search.jsonl"
    monitored_run(path, 3)
    monitored_run(path, 4)
    lines = read_lines(path)
    starts = [x for x in lines if x.get("event") == "run_start"]
    assert len(starts) == 2
    first, second = (s["run_id"] for s in starts)
    assert first != second
    rows = read_rows(path)
    assert [(r["run_id"], r["step"]) for r in rows] == (
        [(first, s) for s in (1, 2, 3)] + [(second, s) for s in (1, 2, 3, 4)]
    )


CONTEXT = RunContext(
    gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-1", "00000000:18:00.0", float("nan"), 700.0),),
    hostname="node-1", backend="nvml", interval=0.5,
)


def test_events_are_lines_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    sink = JsonlSink(path, run_id="trial-7")
    sink.open(CONTEXT)
    alert = Event(kind="alert", name="input_bound", state="firing", step=12, time=1_700_000_012.5,
                  message="data wait 41 % of the step", advice="more loader workers",
                  data={"perf/data_wait_pct": 41.0, "x": math.nan})
    notice = Event(kind="notice", name="gpu_lost", state="info", step=12, time=1_700_000_012.6,
                   severity="critical", message="GPU 0 stopped answering")
    sink.write(Row(step=11, time=1_700_000_011.0, values={"train/loss": math.nan}))
    sink.write(Row(step=12, time=1_700_000_012.0, values={"gpu/0/util_pct": 50.0},
                   events=(alert, notice)))
    sink.close()
    head, r11, r12, a, n, end = read_lines(path)
    assert head["run_id"] == "trial-7" and head["backend"] == "nvml"
    assert head["gpus"][0]["mem_total_gb"] is None  # not finite: null, never NaN
    assert r11 == {"run_id": "trial-7", "step": 11, "time": 1_700_000_011.0, "train/loss": None}
    assert r12["gpu/0/util_pct"] == 50.0
    assert a == {"event": "alert", "run_id": "trial-7", "step": 12, "time": 1_700_000_012.5,
                 "name": "input_bound", "state": "firing", "severity": "warning",
                 "message": "data wait 41 % of the step", "advice": "more loader workers",
                 "data": {"perf/data_wait_pct": 41.0, "x": None}}
    assert n["event"] == "notice" and n["severity"] == "critical" and n["data"] == {}
    assert end["event"] == "run_end" and end["rows"] == 2
    assert "NaN" not in path.read_text()


def test_a_torn_last_line_does_not_swallow_the_next_header(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    path.write_text('{"step": 1, "time": 1.0}\n{"step": 2, "ti')  # a job killed mid-line
    sink = JsonlSink(path)
    sink.open(CONTEXT)
    sink.close()
    lines = path.read_text().splitlines()
    assert lines[:2] == ['{"step": 1, "time": 1.0}', '{"step": 2, "ti']
    assert json.loads(lines[2])["event"] == "run_start"
    assert json.loads(lines[3])["event"] == "run_end"


def test_the_engine_process_writes_the_given_run_id(tmp_path: Path) -> None:
    path = tmp_path / "given.jsonl"
    with gpulens.Monitor(backend="simulated", interval=0.02,
                         sinks=[sink_spec("jsonl", path=str(path), run_id="sweep-3")]) as mon:
        assert mon.isolation == "process"
        time.sleep(0.05)
        mon.log(1, loss=1.0)
    assert {x["run_id"] for x in read_lines(path)} == {"sweep-3"}



def test_the_header_carries_the_runs_meta_mfus_denominator(tmp_path: Path) -> None:
    """The run's metadata (dtype, MFU's peak and its source, how FLOPs are counted) is in the
    header, so a report read later can say what MFU was divided by."""
    path = tmp_path / "mfu.jsonl"
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[f"jsonl:{path}"],
                         dtype="bf16", flops_per_token=7.44e8) as mon:
        time.sleep(0.03)
        mon.log(1, loss=1.0, tokens=4096)
    head = read_lines(path)[0]
    meta = head["meta"]
    assert meta["dtype"] == "bf16" and meta["peak_dtype"] == "bf16"
    assert meta["flops_per_token"] == 7.44e8
    assert meta["peak_gpu"] == "H100 SXM5 80GB" and meta["peak_tflops"] == 989.4
    assert "whitepaper" in meta["peak_source"]
    for g in head["gpus"]:  # what tells the card's variant apart, and the clock of the peak
        assert g["default_power_limit_w"] == 700.0 and g["max_sm_clock_mhz"] > 1000


def test_a_run_without_meta_has_an_empty_one_and_no_nan(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    for meta in ({}, {"dtype": "fp16", "peak_tflops": math.nan, "flops_per_token": 12}):
        sink = JsonlSink(path)
        sink.open(RunContext(gpus=CONTEXT.gpus, hostname="n", backend="nvml", interval=0.5,
                             meta=dict(meta)))
        sink.close()
    first, second = (x["meta"] for x in read_lines(path) if x["event"] == "run_start")
    assert first == {}
    assert second == {"dtype": "fp16", "peak_tflops": None, "flops_per_token": 12}
    assert "NaN" not in path.read_text()
