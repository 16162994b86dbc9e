"""The report tells the truth: the mean step time, distinct tick labels, labelled axes,
elapsed seconds for wall-clock records, one efficiency figure, the backend and GPU models,
several runs in one file (``--run``), events, and a page that fits 700 px (headless Chromium)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from html import unescape
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.cli import main
from gpulens.report import load_jsonl, render_html, render_markdown, summarize
from tests.test_report import _chromium_args, check_page_in_chromium

T0 = 1_700_000_000.0


def header(run_id: str, t: float, backend: str = "nvml", gpus: int = 1) -> dict[str, Any]:
    return {"event": "run_start", "run_id": run_id, "time": t, "hostname": "node-7",
            "backend": backend, "interval": 0.5, "gpulens_version": "0.1.0",
            "gpus": [{"index": g, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{g}",
                      "pci_bus_id": f"00000000:1{g}:00.0", "mem_total_gb": 85.89934592,
                      "power_limit_w": 700.0} for g in range(gpus)]}


def row(run_id: str | None, step: int, t: float, **values: float) -> dict[str, Any]:
    out: dict[str, Any] = {"step": step, "time": t, **values}
    if run_id is not None:
        out["run_id"] = run_id
    return out


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    with path.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return path


def uneven_run(path: Path, run_id: str = "r1", start: float = T0) -> Path:
    """40 steps whose step times alternate 0.1 s and 0.9 s, logged every step: 20 s in all."""
    lines: list[dict[str, Any]] = [header(run_id, start)]
    t = start
    for s in range(1, 41):
        dt = 0.1 if s % 2 else 0.9
        t += dt
        lines.append(row(run_id, s, t, **{
            "train/loss": 2.0 - s / 100, "perf/step_time_s": dt, "perf/steps": 1,
            "gpu/0/util_pct": 90.0, "gpu/0/power_w": 500.0, "gpu/0/energy_j": 500.0 * dt,
            "gpu/0/mem_used_gb": 40.0, "gpu/0/temp_c": 60.0}))
    lines.append({"event": "run_end", "run_id": run_id, "time": t, "rows": 40})
    return write(path, lines)


def test_mean_step_time_is_duration_over_steps(tmp_path: Path) -> None:
    record = load_jsonl(uneven_run(tmp_path / "uneven.jsonl"))
    s = summarize(record)
    assert s.steps == 40 and s.duration_s == pytest.approx(20.0)
    # 20 s / 40 steps = 0.5 s; weighting each step time by its own length would give
    # (20 x 0.1² + 20 x 0.9²) / 20 = 0.82 s
    assert s.step_time_mean_s == pytest.approx(0.5)
    page = render_html(record, s)
    assert '<div class="v">500 ms</div>' in page
    assert "mean step time: 500 ms" in render_markdown(record, s)


def y_tick_labels(page: str, chart: str) -> list[str]:
    figure = re.search(rf'<figure class="card" id="{chart}">.*?</figure>', page)
    assert figure, chart
    return re.findall(r'<text class="tick[^"]*" x="[\d.]+" y="[\d.]+" text-anchor="end">([^<]+)<',
                      figure.group(0))


def test_tick_labels_are_distinct_and_axes_are_labelled(tmp_path: Path) -> None:
    path = tmp_path / "flat.jsonl"
    lines: list[dict[str, Any]] = [header("flat", T0)]
    for s in range(1, 61):  # a loss that moves in the third decimal: 4.723 down to 4.705
        lines.append(row("flat", s, T0 + s, **{"train/loss": 4.723 - 0.0003 * s,
                                                "train/learning_rate": 2e-5 + 1e-7 * s,
                                                "gpu/0/power_w": 300.0}))
    record = load_jsonl(write(path, lines))
    page = render_html(record, summarize(record))
    for chart in ("chart-loss", "chart-lr", "chart-power"):
        labels = y_tick_labels(page, chart)
        assert len(labels) >= 3 and len(set(labels)) == len(labels), (chart, labels)
    assert y_tick_labels(page, "chart-loss")[:2] == ["4.705", "4.710"]
    # every chart names its axes: x is the step, y its unit
    figures = re.findall(r'<figure class="card" id="([^"]+)">(.*?)</figure>', page)
    assert len(figures) == 3
    for name, body in figures:
        assert re.search(r'class="axis-label x-label"[^>]*>step</text>', body), name
        assert re.search(r'class="axis-label y-label"[^>]*>[^<]+</text>', body), name
    assert re.search(r'class="axis-label y-label"[^>]*>W</text>', page)


def test_a_record_report_uses_elapsed_seconds(tmp_path: Path) -> None:
    # rows of `gpulens record` carry record/elapsed_s; the report puts them on the x-axis
    path = tmp_path / "rec.jsonl"
    lines: list[dict[str, Any]] = [header("rec", T0)]
    for n in range(1, 11):
        lines.append(row("rec", n, T0 + 2.0 * n + 0.3,
                         **{"record/elapsed_s": 2.0 * n, "gpu/0/util_pct": 50.0}))
    record = load_jsonl(write(path, lines))
    page = render_html(record, summarize(record))
    assert 'data-xlabel="elapsed s"' in page
    assert re.search(r'id="chart-activity".*?data-x0="2.0" data-x1="20.0"', page)
    assert re.search(r'class="axis-label x-label"[^>]*>elapsed s</text>', page)
    # an older record without record/elapsed_s and without a header: time - first row time
    old = tmp_path / "old.jsonl"
    write(old, [row(None, n, T0 + 1.5 * n, **{"gpu/0/util_pct": 50.0}) for n in range(1, 9)])
    record = load_jsonl(old)
    page = render_html(record, summarize(record))
    assert re.search(r'id="chart-activity".*?data-x0="0.0" data-x1="10.5"', page)
    assert "backend not recorded" in page and "SIMULATED" not in page


def test_the_hover_read_out_says_elapsed_seconds(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write(path, [header("rec", T0)] + [
        row("rec", n, T0 + n, **{"record/elapsed_s": float(n), "gpu/0/util_pct": 10.0 * n})
        for n in range(1, 11)])
    html = tmp_path / "r.html"
    assert main(["report", str(path), "-o", str(html)]) == 0
    probe = tmp_path / "probe.html"
    probe.write_text(html.read_text().replace("</body>", (
        "<script>var s=document.querySelector('#chart-activity svg'),r=s.getBoundingClientRect();"
        "s.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width*0.5,"
        "clientY:r.top+r.height/2,bubbles:true}));"
        "document.body.setAttribute('data-tip',document.getElementById('tip').textContent);"
        "</script></body>")))
    dom = check_page_in_chromium(probe, tmp_path, min_charts=1)
    tip = re.search(r'<body data-tip="([^"]*)"', dom)
    assert tip, "hover script did not run"
    first = unescape(tip.group(1)).splitlines()[0]
    assert re.fullmatch(r"elapsed s \d+\.\d", first), first


WIDTH_PROBE = (
    "<script>document.body.setAttribute('data-overflow',"
    "String(document.documentElement.scrollWidth-window.innerWidth));</script></body>"
)


def test_the_page_fits_700_px_and_1400_px(tmp_path: Path) -> None:
    """Screenshots at both widths (kept beside the test's files) and no sideways scroll."""
    path = tmp_path / "run.jsonl"
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[f"jsonl:{path}"]) as mon:
        for step in range(1, 31):
            time.sleep(0.02)
            mon.log(step, loss=1.0 / step, learning_rate=1e-3, grad_norm=0.5)
    html = tmp_path / "report.html"
    assert main(["report", str(path), "-o", str(html), "--work", "1e6"]) == 0
    probe = tmp_path / "width.html"
    probe.write_text(html.read_text().replace("</body>", WIDTH_PROBE))
    for width in (700, 1400):
        proc = subprocess.run([*_chromium_args(tmp_path), f"--window-size={width},1600",
                               "--dump-dom", probe.as_uri()],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        overflow = re.search(r'data-overflow="(-?\d+)"', proc.stdout)
        assert overflow, "the probe did not run"
        assert int(overflow.group(1)) <= 0, f"{overflow.group(1)} px of sideways scroll at {width}"
        shot = tmp_path / f"report-{width}.png"
        proc = subprocess.run([*_chromium_args(tmp_path), f"--screenshot={shot}",
                               f"--window-size={width},2400", html.as_uri()],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and shot.read_bytes()[:4] == b"\x89PNG"


def test_backend_and_gpu_models_on_the_report(tmp_path: Path) -> None:
    record = load_jsonl(uneven_run(tmp_path / "real.jsonl"))
    page, md = render_html(record, summarize(record)), render_markdown(record, summarize(record))
    for shown in (page, md):
        assert "backend: nvml" in shown and "NVIDIA H100 80GB HBM3" in shown
        assert "SIMULATED" not in shown
    assert "85.9 GB (80.0 GiB)" in md and "85.9 GB (80.0 GiB)" in page
    assert "host node-7" in page


def three_runs(path: Path) -> Path:
    """An old header-less run, then two runs with headers (the second one simulated)."""
    write(path, [row(None, s, T0 + s, **{"train/loss": 9.0, "gpu/0/util_pct": 1.0})
                 for s in (1, 2)])
    write(path, [header("20261126-080000-aaaaaa", T0 + 100)]
          + [row("20261126-080000-aaaaaa", s, T0 + 100 + s, **{"train/loss": 5.0})
             for s in (1, 2, 3)])
    write(path, [header("20261126-090000-bbbbbb", T0 + 200, backend="simulated")]
          + [row("20261126-090000-bbbbbb", s, T0 + 200 + s, **{"train/loss": 1.0})
             for s in (1, 2, 3, 4)])
    return path


@pytest.mark.parametrize(
    ("run", "losses", "numbers"),
    [
        (None, {1.0}, [3]),
        ("last", {1.0}, [3]),
        ("1", {9.0}, [1]),
        ("2", {5.0}, [2]),
        ("-1", {1.0}, [3]),
        ("20261126-08", {5.0}, [2]),
        ("20261126-090000-bbbbbb", {1.0}, [3]),
        ("all", {9.0, 5.0, 1.0}, [1, 2, 3]),
    ],
)
def test_choosing_a_run(tmp_path: Path, run: str | None, losses: set[float],
                        numbers: list[int]) -> None:
    record = load_jsonl(three_runs(tmp_path / "search.jsonl"), run=run)
    assert [r.number for r in record.runs] == [1, 2, 3]
    assert record.runs[0].run_id is None and record.runs[0].rows == 2
    assert [r.number for r in record.selected] == numbers
    assert {r.values["train/loss"] for r in record.rows} == losses
    assert record.simulated == (3 in numbers)


def test_all_runs_keep_their_own_windows(tmp_path: Path) -> None:
    record = load_jsonl(three_runs(tmp_path / "search.jsonl"), run="all")
    s = summarize(record)
    # run 1 (no header): 2 rows 1 s apart, its first window the median (1 s): 2 s;
    # runs 2 and 3 start at their headers: 3 s and 4 s. The gaps between runs are no window.
    assert s.duration_s == pytest.approx(2 + 3 + 4)
    assert s.runs == 3
    page = render_html(record, s)
    assert "Runs in this file" in page and page.count("<tr class=\"chosen\">") == 3
    # one line per run on the loss chart, never one line across runs
    loss = re.search(r'id="chart-loss".*?</figure>', page)
    assert loss and loss.group(0).count("<polyline") == 3


def test_report_cli_run_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = three_runs(tmp_path / "search.jsonl")
    out = tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(tmp_path / "r.html"), "--markdown", str(out),
                 "--run", "2"]) == 0
    err = capsys.readouterr().err
    assert "holds 3 runs; showing run 2 (20261126-080000-aaaaaa)" in err
    assert "run 2 (20261126-080000-aaaaaa) of 3 in this file" in out.read_text()
    assert "steps: 3 (1 to 3)" in out.read_text()
    help_text = subprocess.run([sys.executable, "-m", "gpulens.cli", "report", "--help"],
                               capture_output=True, text=True, timeout=240).stdout
    assert "--run" in help_text and "all" in help_text


@pytest.mark.parametrize(
    ("run", "message"),
    [("7", "no run 7 in"), ("zzz", "no run with id 'zzz' in"),
     ("20261126", "several runs with id '20261126' in")],
)
def test_a_run_that_is_not_there_is_one_line(tmp_path: Path, run: str, message: str) -> None:
    path = three_runs(tmp_path / "search.jsonl")
    proc = subprocess.run([sys.executable, "-m", "gpulens.cli", "report", str(path), "--run", run],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2
    assert message in proc.stderr and "runs: run 1, run 2 (20261126-080000-aaaaaa)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_events_on_the_report(tmp_path: Path) -> None:
    path = uneven_run(tmp_path / "ev.jsonl")
    write(path, [header("r2", T0 + 100), row("r2", 1, T0 + 101, **{"train/loss": 1.0}),
                 {"event": "alert", "run_id": "r2", "step": 1, "time": T0 + 101,
                  "name": "input_bound", "state": "firing", "severity": "warning",
                  "message": "data wait 41 % of the step", "advice": "more loader workers",
                  "data": {"perf/data_wait_pct": 41.0}},
                 {"event": "alert", "run_id": "r1", "step": 3, "time": T0 + 2,
                  "name": "other_run", "state": "firing", "message": "not this run"}])
    record = load_jsonl(path)
    assert [e.name for e in record.events] == ["input_bound"]
    assert record.events[0].data == {"perf/data_wait_pct": 41.0}
    page = render_html(record, summarize(record))
    assert "Alerts and notices" in page and "data wait 41 % of the step" in page
    assert "more loader workers" in page and "not this run" not in page
    assert "| 1 | alert · warning | input_bound (firing) | data wait 41 % of the step |" in (
        render_markdown(record, summarize(record)))


def test_the_summary_sink_says_simulated() -> None:
    from gpulens.report.text import render_markdown_summary, render_text
    from gpulens.sinks.summary import SummarySink

    summary = SummarySink()
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[summary]) as mon:
        time.sleep(0.05)
        mon.log(1, loss=1.0)
    result = summary.result()
    assert result.backend == "simulated"
    assert "GPUs: 2 SIMULATED" in render_text(result)
    assert "GPUs: 2 SIMULATED" in render_markdown_summary(result)
