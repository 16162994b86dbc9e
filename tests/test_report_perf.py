"""The report's throughput and MFU section: run-level figures that are the run's work over its
time (not means of ratios), MFU's denominator stated from the record's header, tokens per joule
as the one efficiency figure, the engine's alerts with their advice; from hand-made records and
from a real monitor run (simulated GPUs) checked in headless Chromium."""

from __future__ import annotations

import json
import math
import re
import time
from html import escape
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.cli import main
from gpulens.report import load_jsonl, render_html, render_markdown, summarize
from gpulens.report.text import figure
from gpulens.testing import Constant, SimulatedNVML
from tests.support.jsonl import read_lines, read_rows
from tests.test_report import check_page_in_chromium
from tests.test_report_truth import T0, header, row, write

META = {"dtype": "bf16", "flops_per_token": 6.0e9, "peak_gpu": "H100 SXM5 80GB",
        "peak_dtype": "bf16", "peak_tflops": 989.4,
        "peak_source": "NVIDIA H100 Tensor Core GPU Architecture whitepaper"}


def perf_run(path: Path, run_id: str = "r1", meta: dict[str, Any] | None = None,
             start: float = T0, mfu: bool = True, flops: bool = True) -> Path:
    """20 steps alternating 0.1 s and 0.9 s: the short ones do 3000 tokens (30,000 tokens/s,
    500 W, tensor pipes 80 % busy), the long ones 900 (1,000 tokens/s, 100 W, 10 % busy), so a
    mean of the rows' ratios differs from the run's work over its time."""
    head = header(run_id, start)
    head["meta"] = META if meta is None else meta
    lines: list[dict[str, Any]] = [head]
    t = start
    for s in range(1, 21):
        dt, tokens = (0.1, 3000.0) if s % 2 else (0.9, 900.0)
        energy = 500.0 * dt if s % 2 else 100.0 * dt
        t += dt
        values = {"train/loss": 2.0 - s / 100, "perf/step_time_s": dt, "perf/steps": 1,
                  "gpu/0/util_pct": 90.0, "gpu/0/energy_j": energy,
                  "gpu/0/tensor_active_pct": 80.0 if s % 2 else 10.0,
                  "perf/tokens_per_s": tokens / dt, "perf/tokens_per_j": tokens / energy}
        tflops = tokens * 6.0e9 / dt / 1e12
        if flops:
            values.update({"perf/tflops": tflops, "perf/tflops_job": tflops})
        if flops and mfu:
            values.update({"perf/mfu_pct": 100 * tflops / 989.4,
                           "perf/mfu_clock_adjusted_pct": 100 * tflops / 989.4 / 0.9,
                           "perf/mfu_when_tensor_active_pct":
                               100 * (100 * tflops / 989.4) / (80.0 if s % 2 else 10.0)})
        lines.append(row(run_id, s, t, **values))
    return write(path, lines)


def test_run_figures_are_work_over_time_not_means_of_ratios(tmp_path: Path) -> None:
    s = summarize(load_jsonl(perf_run(tmp_path / "p.jsonl")))
    tp = s.throughput
    assert tp is not None and tp.unit == "tokens" and tp.windows == 20
    # 10 x 3000 + 10 x 900 tokens in 10 x 0.1 + 10 x 0.9 s: 39,000 tokens in 10 s. The mean of
    # the rows' rates would be (30,000 + 1,000) / 2 = 15,500 tokens/s.
    assert tp.work == pytest.approx(39_000)
    assert tp.per_s == pytest.approx(3_900)
    # energy 10 x 50 + 10 x 90 = 1400 J: 39,000 / 1400 tokens/J (not the mean of 60 and 10)
    assert tp.per_j == pytest.approx(39_000 / 1400)
    flops = 39_000 * 6.0e9
    assert tp.tflops == pytest.approx(flops / 10 / 1e12)
    assert tp.mfu_pct == pytest.approx(100 * flops / 10 / 1e12 / 989.4)
    assert tp.mfu_clock_adjusted_pct == pytest.approx(tp.mfu_pct / 0.9)
    # tensor pipes busy 80 % of 1 s + 10 % of 9 s = 1.7 s of 10 s; MFU while busy: the FLOPs
    # over (1.7 s x peak)
    assert tp.tensor_active_pct == pytest.approx(17.0)
    assert tp.mfu_when_tensor_active_pct == pytest.approx(100 * tp.mfu_pct / 17.0)
    # the one efficiency figure is the engine's tokens per joule
    e = s.efficiency
    assert e is not None and e.source == "engine" and e.unit == "tokens"
    assert e.per_joule == pytest.approx(39_000 / 1400)


def test_mfu_while_busy_only_from_rows_that_carry_it(tmp_path: Path) -> None:
    """An FP32 run's rows carry no MFU-while-busy (the engine leaves it out): the summary shows
    tensor activity but no quotient of its own making."""
    path = perf_run(tmp_path / "p.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines:
        line.pop("perf/mfu_when_tensor_active_pct", None)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tp = summarize(load_jsonl(path)).throughput
    assert tp is not None and tp.mfu_pct is not None
    assert tp.tensor_active_pct == pytest.approx(17.0)
    assert tp.mfu_when_tensor_active_pct is None


def test_the_page_states_mfus_denominator_and_the_efficiency(tmp_path: Path) -> None:
    record = load_jsonl(perf_run(tmp_path / "p.jsonl"))
    s = summarize(record)
    page, md = render_html(record, s), render_markdown(record, s)
    for chart in ("chart-tokens", "chart-tflops", "chart-mfu", "chart-mfu-tensor"):
        assert re.search(rf'id="{chart}".*?data-points="20"', page), chart
    # MFU, the clock-adjusted MFU and the tensor-pipe activity on one chart
    mfu = re.search(r'id="chart-mfu".*?</figure>', page)
    assert mfu and mfu.group(0).count("<polyline") == 3
    assert 'data-label="tensor active (GPM, mean of GPUs)"' in mfu.group(0)
    said = ("MFU = achieved model TFLOP/s per GPU / 989.4 TFLOP/s, the dense bf16 peak of one "
            "H100 SXM5 80GB. Peak from: NVIDIA H100 Tensor Core GPU Architecture whitepaper. "
            "Model FLOPs: 6e+09 FLOPs per token")
    assert said in page and said in md
    assert f"<th>Efficiency</th><td>{figure(39_000 / 1400)} tokens/J</td>" in page
    assert f"efficiency: {figure(39_000 / 1400)} tokens/J" in md
    assert "<th>Throughput</th><td>3,900 tokens/s (all GPUs)</td>" in page
    assert "throughput: 3,900 tokens/s" in md and "MFU: 2.37% (clock-adjusted 2.63%)" in md
    assert '<div class="v">2.37 %</div><div class="l">MFU (of the dense bf16 peak)' in page
    assert re.search(r"\| MFU \| `[▁-█]+` \| ", md)


def test_work_handed_in_is_the_efficiency_the_engines_mfu_stays(tmp_path: Path) -> None:
    path = perf_run(tmp_path / "p.jsonl")
    md = tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(tmp_path / "r.html"), "--markdown", str(md),
                 "--work", "14000", "--unit", "tokens"]) == 0
    text = md.read_text()
    assert "efficiency: 10 tokens/J" in text  # 14,000 tokens / 1400 J, as asked
    assert "throughput: 1,400 tokens/s" in text and "throughput: 3,900" not in text
    assert "MFU: 2.37%" in text


@pytest.mark.parametrize(
    ("meta", "flops", "why"),
    [
        ({"flops_per_token": 6.0e9}, True,
         "No MFU: the run's compute dtype was not given (Monitor(dtype=\"bf16\"))"),
        ({"dtype": "bf16", "flops_per_token": 6.0e9}, True,
         "No MFU: gpulens has no bf16 peak for this GPU, and never borrows another card's"),
        ({"dtype": "bf16"}, False, "No MFU: the rows have no model FLOPs (give "
         "Monitor(flops_per_token=...) or log(step, flops=...))"),
    ],
)
def test_why_there_is_no_mfu(tmp_path: Path, meta: dict[str, Any], flops: bool,
                             why: str) -> None:
    record = load_jsonl(perf_run(tmp_path / "p.jsonl", meta=meta, mfu=False, flops=flops))
    s = summarize(record)
    assert s.throughput is not None and s.throughput.mfu_pct is None
    page, md = render_html(record, s), render_markdown(record, s)
    assert why in md and escape(why) in page
    assert 'id="chart-mfu"' not in page and 'id="chart-tokens"' in page


def test_runs_with_different_peaks_each_say_theirs(tmp_path: Path) -> None:
    path = perf_run(tmp_path / "two.jsonl", "ra")
    perf_run(path, "rb", meta={**META, "dtype": "fp8", "peak_dtype": "fp8",
                               "peak_tflops": 1978.9}, start=T0 + 100)
    record = load_jsonl(path, run="all")
    md = render_markdown(record, summarize(record))
    assert "_run 1 (ra): MFU = achieved model TFLOP/s per GPU / 989.4 TFLOP/s, the dense bf16" in md
    assert "_run 2 (rb): MFU = achieved model TFLOP/s per GPU / 1978.9 TFLOP/s, the dense fp8" in md
    assert record.meta["peak_gpu"] == "H100 SXM5 80GB" and "peak_tflops" not in record.meta


def test_a_real_monitor_run_throughput_mfu_and_the_engines_alert(tmp_path: Path) -> None:
    """A monitor with the run's dtype and FLOPs per token, on simulated GPUs kept 15 % busy:
    its rows carry throughput and MFU, the engine's input-bound rule fires; the report shows
    both, with MFU's denominator from the header and the alert's advice."""
    path = tmp_path / "run.jsonl"
    backend = SimulatedNVML(gpus=2, load=Constant(0.15))
    with gpulens.Monitor(backend=backend, interval=0.05, sinks=[f"jsonl:{path}"], dtype="bf16",
                         flops_per_token=7.44e8) as mon:
        for step in range(1, 41):
            time.sleep(0.08)
            mon.log(step, loss=2.0 * math.exp(-step / 20), tokens=8192)
    rows = read_rows(path)
    alerts = [x for x in read_lines(path) if x.get("event") == "alert"]
    assert [(a["name"], a["state"]) for a in alerts] == [("input_bound", "firing")], alerts
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(html), "--markdown", str(md)]) == 0
    record = load_jsonl(path)
    s = summarize(record)
    tp = s.throughput
    assert tp is not None and tp.windows == len(rows) == 40
    windows = [r["perf/step_time_s"] * r["perf/steps"] for r in rows]
    tokens = sum(r["perf/tokens_per_s"] * w for r, w in zip(rows, windows, strict=True))
    assert tokens == pytest.approx(40 * 8192)
    assert tp.per_s == pytest.approx(tokens / sum(windows))
    energy = sum(r[f"gpu/{g}/energy_j"] for r in rows for g in (0, 1))
    assert s.efficiency is not None and s.efficiency.per_joule == pytest.approx(tokens / energy)
    assert tp.mfu_pct == pytest.approx(100 * tokens * 7.44e8 / sum(windows) / 2 / 989.4e12)
    dom = check_page_in_chromium(html, tmp_path, min_charts=11)
    for chart in ("chart-tokens", "chart-tflops", "chart-mfu"):
        assert re.search(rf'id="{chart}".*?data-points="(40|120)"', dom), chart
    # the first rows' GPM spans hold the start: no MFU-while-busy figure there, the rest have it
    busy = [r["step"] for r in rows if "perf/mfu_when_tensor_active_pct" in r]
    assert 10 <= len(busy) < 40 and busy == list(range(41 - len(busy), 41)), busy
    assert re.search(rf'id="chart-mfu-tensor".*?data-points="{len(busy)}"', dom)
    assert "989.4 TFLOP/s, the dense bf16 peak of one H100 SXM5 80GB" in dom
    # the engine's alert, with what it saw and what to try, in both reports
    assert re.search(r'<tr class="warning"><td>\d+</td><td>[^<]+</td><td>alert · warning</td>'
                     r"<td>input_bound \(firing\)</td><td>input-bound: the GPUs wait for data",
                     dom)
    assert alerts[0]["advice"] in dom.replace("&amp;", "&")
    text = md.read_text()
    assert "| input_bound (firing) | input-bound: the GPUs wait for data" in text
    assert f"| {alerts[0]['advice']} |" in text


def test_the_gpu_check_script_runs_every_view_quick(tmp_path: Path) -> None:
    """``benchmarks/views_gpu.py --quick`` (the GPU check the lead runs on hardware): on a CPU
    with a simulated GPU its rows' MFU agrees with MFU by hand, and every view shows it."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(GPULENS_BACKEND="simulated",
               PYTHONPATH=os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "views_gpu.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = dict(re.findall(r"^\| ([^|]+) \| ([^|]*) \|$", proc.stdout, re.M))
    assert table["peak (run metadata)"] == "H100 SXM5 80GB, bf16, 989.4 TFLOP/s"
    assert abs(float(table["rows vs by hand"].removesuffix(" %"))) < 3
    rows = float(table["MFU, rows (report, time-weighted) %"])
    assert rows > 1 and float(table["Prometheus gpulens_train_mfu_percent (last row)"]) > 1
    assert table["report states the denominator"] == "yes"
    assert table["watch --record line"].startswith("train step 30 loss ")
    assert {p.name for p in tmp_path.iterdir()} >= {"run.jsonl", "report.html", "report.md",
                                                    "metrics.txt", "watch.txt"}


def test_a_small_mfu_keeps_its_digits_in_every_view(tmp_path: Path) -> None:
    """The demo's figures (a tiny fp32 model on a CPU against an H100's peak): MFU 0.0339 %
    and 0.0136 TFLOP/s per GPU are shown with three significant digits by the report (HTML,
    Markdown, the terminal summary) and by ``gpulens watch --record``, never as 0.0 or 0."""
    from gpulens.cli.watch.training import plain_training, training_pieces
    from gpulens.report.tail import RecordTail
    from gpulens.report.text import render_text

    lines: list[dict[str, Any]] = [{**header("tiny", T0), "meta": META}]
    for s in range(1, 11):
        lines.append(row("tiny", s, T0 + s, **{
            "train/loss": 2.0, "perf/step_time_s": 1.0, "perf/steps": 1,
            "gpu/0/util_pct": 50.0, "gpu/0/energy_j": 100.0, "perf/tokens_per_s": 1000.0,
            "perf/tflops": 0.01361, "perf/tflops_job": 0.01361, "perf/mfu_pct": 0.03391,
            "perf/mfu_clock_adjusted_pct": 0.03512}))
    path = write(tmp_path / "tiny.jsonl", lines)
    record = load_jsonl(path)
    s = summarize(record)
    page, md, text = render_html(record, s), render_markdown(record, s), render_text(s)
    for shown in (md, text):
        assert "achieved: 0.0136 TFLOP/s per GPU" in shown
        assert "MFU: 0.0339% (clock-adjusted 0.0351%)" in shown
    assert "<th>MFU</th><td>0.0339 %</td>" in page
    assert "<th>Achieved</th><td>0.0136 TFLOP/s per GPU; 0.0136 for the job</td>" in page
    assert '<div class="v">0.0339 %</div>' in page
    for view in (page, md, text):
        assert "MFU: 0.0%" not in view and "0.0 %" not in view and " 0 TFLOP" not in view
    status = RecordTail(path).poll()
    assert "MFU 0.0339% TFLOP/s/GPU 0.0136" in plain_training(status, T0 + 11)
    pieces = dict((p, t) for p, t in training_pieces(status, T0 + 11))
    assert pieces[3] == "MFU 0.0339%" and pieces[5] == "0.0136 TFLOP/s/GPU"
