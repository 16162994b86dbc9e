"""``gpulens report``: reading JSONL back, the summary numbers, HTML checked in headless Chromium,
Markdown, and bad input."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.cli import main
from gpulens.report import load_jsonl, render_html, render_markdown, summarize
from tests.support.jsonl import read_rows

T0 = 1_700_000_000.0


def write_rows(path: Path, steps: int = 120, gpus: int = 2, gpm: bool = True,
               junk: bool = True) -> Path:
    """A hand-made record: 0.5 s windows, known power/energy, a loss curve, some junk lines."""
    with path.open("w") as f:
        for s in range(1, steps + 1):
            row: dict[str, float | int] = {
                "step": s, "time": T0 + s * 0.5, "train/global_step": s,
                "train/loss": 3 * math.exp(-s / 40) + 0.3,
                "train/learning_rate": 1e-4 * (1 - s / (steps + 10)),
                "train/grad_norm": 1 + (s % 7) / 7, "perf/step_time_s": 0.5, "perf/steps": 1,
            }
            for g in range(gpus):
                p = f"gpu/{g}/"
                row.update({
                    p + "util_pct": 95.0 - 10 * g, p + "mem_used_gb": 10.0 + s / 100 + g,
                    p + "mem_used_gb_max": 10.5 + s / 100 + g, p + "mem_pct": 25.0,
                    p + "power_w": 300.0 + 100 * g, p + "power_w_max": 350.0 + 100 * g,
                    p + "power_limit_w": 700.0, p + "energy_j": (300.0 + 100 * g) * 0.5,
                    p + "temp_c": 50.0 + s / 10, p + "temp_c_max": 51.0 + s / 10,
                    p + "sm_clock_mhz": 1980.0,
                    p + "throttle_pct": 50.0 if s > steps // 2 else 0.0,
                    p + "throttle_power_pct": 50.0 if s > steps // 2 else 0.0,
                    p + "throttle_thermal_pct": 0.0,
                })
                if gpm:
                    row[p + "sm_active_pct"] = 80.0 - 10 * g
                    row[p + "tensor_active_pct"] = 60.0 - 10 * g
            f.write(json.dumps(row) + "\n")
            if junk and s == 10:
                f.write('{"step": 11, "time": \n')  # a torn line
                f.write("[1, 2, 3]\n")
                f.write('{"step": "x", "time": 1}\n')
    return path


def test_load_skips_malformed_lines(tmp_path: Path) -> None:
    record = load_jsonl(write_rows(tmp_path / "run.jsonl"))
    assert len(record.rows) == 120
    assert record.skipped == 3
    assert [r.step for r in record.rows[:3]] == [1, 2, 3]


def test_summary_numbers(tmp_path: Path) -> None:
    s = summarize(load_jsonl(write_rows(tmp_path / "run.jsonl")))
    assert s.rows == 120 and s.steps == 120
    assert s.first_step == 1 and s.last_step == 120
    assert s.duration_s == pytest.approx(60.0)  # 120 windows of 0.5 s
    g0, g1 = s.gpus
    assert g0.activity_metric == "sm_active_pct"
    assert g0.activity_mean_pct == pytest.approx(80.0)
    assert g1.tensor_active_mean_pct == pytest.approx(50.0)
    assert g0.util_mean_pct == pytest.approx(95.0)
    assert g0.mem_peak_gb == pytest.approx(10.5 + 1.2)
    assert g0.mem_total_gb == pytest.approx((10.01) / 0.25)
    assert g1.power_mean_w == pytest.approx(400.0) and g1.power_max_w == pytest.approx(450.0)
    assert g0.temp_max_c == pytest.approx(51.0 + 12.0)
    assert g0.energy_wh == pytest.approx(300 * 60 / 3600)
    assert g0.energy_source == "counter"
    assert s.energy_wh == pytest.approx(700 * 60 / 3600)
    assert s.energy_per_step_j == pytest.approx(350.0)
    assert g0.throttle_pct == pytest.approx(25.0)
    assert g0.throttled_power_s == pytest.approx(15.0)
    assert g0.throttle_reasons() == "power cap 15.0 s"
    assert s.loss_first == pytest.approx(3 * math.exp(-1 / 40) + 0.3)


def test_summary_without_gpm_or_energy_uses_util_and_power(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "run.jsonl", gpm=False, junk=False)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for row in lines:
        for k in [k for k in row if k.endswith("/energy_j")]:
            del row[k]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summarize(load_jsonl(path))
    assert s.gpus[0].activity_metric == "util_pct"
    assert s.gpus[0].activity_mean_pct == pytest.approx(95.0)
    assert s.gpus[0].tensor_active_mean_pct is None
    assert s.gpus[0].energy_source == "power x time"
    assert s.gpus[0].energy_wh == pytest.approx(300 * 60 / 3600)


def test_markdown(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "run.jsonl")
    out = tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(tmp_path / "r.html"), "--markdown", str(out)]) == 0
    md = out.read_text()
    assert md.startswith("### gpulens report: run.jsonl")
    assert "| GPU | Activity mean / max |" in md
    assert "| 0 | 80.0% / 80.0% SM active | 60.0% |" in md
    assert "power cap 15.0 s" in md
    assert "energy: 11.7 Wh" in md
    assert "3 malformed line(s) skipped" in md
    assert re.search(r"\| loss \| `[▁-█]+` \|", md)


def test_markdown_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_rows(tmp_path / "run.jsonl", junk=False)
    assert main(["report", str(path), "--markdown"]) == 0
    assert "| GPU |" in capsys.readouterr().out
    assert (tmp_path / "run.html").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "/nonexistent/run.jsonl"], "no such file: /nonexistent/run.jsonl"),
        (["report", "/"], "is a directory"),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "gpulens.cli", *args], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_unreadable_and_empty_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("garbage\n")
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "skipped 1 malformed line(s)" in err and "no rows in" in err
    if os.geteuid() != 0:  # root reads anything
        locked = write_rows(tmp_path / "locked.jsonl")
        locked.chmod(0)
        assert main(["report", str(locked)]) == 2
        assert "cannot read" in capsys.readouterr().err
    assert main(["report", str(write_rows(tmp_path / "ok.jsonl")), "-o",
                 str(tmp_path / "missing-dir" / "r.html")]) == 2
    assert "cannot write HTML report" in capsys.readouterr().err


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return exe


def _chromium_args(tmp_path: Path) -> list[str]:
    return [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]


def check_page_in_chromium(html: Path, tmp_path: Path, min_charts: int) -> str:
    """Dump the DOM after scripts ran and take a screenshot; returns the DOM."""
    proc = subprocess.run(
        [*_chromium_args(tmp_path), "--enable-logging=stderr", "--v=0", "--dump-dom",
         html.as_uri()], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert 'data-js="ok"' in dom, "the page's script did not run to its end"
    assert re.search(r'<div id="js-errors" hidden=""></div>', dom), "the page logged JS errors"
    assert "Uncaught" not in proc.stderr
    assert "net::ERR" not in proc.stderr, "the page tried to fetch something"
    counts = [int(n) for n in re.findall(r'<svg class="chart"[^>]*data-points="(\d+)"', dom)]
    assert len(counts) >= min_charts
    assert all(c > 0 for c in counts), counts
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [*_chromium_args(tmp_path), f"--screenshot={shot}", "--window-size=1280,2200",
         html.as_uri()], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    return dom


def test_html_in_chromium(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "run.jsonl")
    out = tmp_path / "report.html"
    assert main(["report", str(path), "-o", str(out)]) == 0
    html = out.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch
    dom = check_page_in_chromium(out, tmp_path, min_charts=9)
    for chart in ("chart-loss", "chart-lr", "chart-grad-norm", "chart-activity", "chart-memory",
                  "chart-power", "chart-temp", "chart-throttle"):
        assert f'id="{chart}"' in dom
    # 120 points per line: loss 1, activity 2 GPUs x (SM + tensor), power 2 x (power + limit)
    assert re.search(r'id="chart-loss".*?data-points="120"', dom)
    assert re.search(r'id="chart-activity".*?data-points="480"', dom)
    assert dom.count('<tr data-gpu="') == 2
    # hover read-out: a synthetic mouse move over the middle of the loss chart
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", (
        "<script>var s=document.querySelector('#chart-loss svg'),r=s.getBoundingClientRect();"
        "s.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width*0.55,"
        "clientY:r.top+r.height/2,bubbles:true}));"
        "document.body.setAttribute('data-tip',document.getElementById('tip').textContent);"
        "</script></body>")))
    dom = check_page_in_chromium(probe, tmp_path, min_charts=9)
    tip = re.search(r'<body data-tip="([^"]*)"', dom)
    assert tip, "hover script did not run"
    m = re.fullmatch(r"step (\d+)\ntrain/loss: ([\d.]+)", tip.group(1).replace("&#10;", "\n")
                     .replace("\r", ""))
    assert m, tip.group(1)
    step, shown = int(m.group(1)), float(m.group(2))
    assert 55 < step < 75
    expected = 3 * math.exp(-step / 40) + 0.3
    assert shown == pytest.approx(expected, rel=0.03)


def test_long_run_is_downsampled_and_stays_small(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "run.jsonl", steps=20_000, gpus=1, junk=False)
    record = load_jsonl(path)
    html = render_html(record, summarize(record))
    assert len(html) < 400_000
    counts = [int(n) for n in re.findall(r'data-points="(\d+)"', html)]
    assert counts and max(counts) <= 2 * 800
    assert "GPU 0" in render_markdown(record, summarize(record))


def test_report_of_a_real_monitor_run(tmp_path: Path) -> None:
    """Rows written by a real Monitor (simulated GPUs) through the JSONL sink."""
    import gpulens

    path = tmp_path / "run.jsonl"
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[f"jsonl:{path}"]) as mon:
        for step in range(1, 61):
            time.sleep(0.02)
            mon.log(step, loss=2.0 * math.exp(-step / 20), learning_rate=1e-3, grad_norm=0.7)
    rows = read_rows(path)
    assert len(rows) == 60
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(html), "--markdown", str(md)]) == 0
    summary = summarize(load_jsonl(path))
    assert [g.gpu for g in summary.gpus] == ["0", "1"]
    for g in summary.gpus:
        energy_j = sum(r[f"gpu/{g.gpu}/energy_j"] for r in rows if f"gpu/{g.gpu}/energy_j" in r)
        assert g.energy_wh == pytest.approx(energy_j / 3600)
        assert g.activity_metric == "sm_active_pct"
        assert g.mem_total_gb == pytest.approx(85.9, abs=0.1)
    assert summary.steps == 60
    assert "| 0 · Simulated H100 80GB HBM3 | " in md.read_text() and "loss" in md.read_text()
    dom = check_page_in_chromium(html, tmp_path, min_charts=9)
    assert re.search(r'id="chart-loss".*?data-points="60"', dom)
    # the backend and the GPU models, stated plainly: these were simulated GPUs
    assert "SIMULATED GPUs" in dom and 'id="simulated"' in dom
    assert "2 x Simulated H100 80GB HBM3" in dom and "backend: simulated" in dom
    assert "**SIMULATED GPUs**" in md.read_text() and "backend: simulated" in md.read_text()


def test_a_loss_that_goes_nan_or_inf_is_said_not_hidden(tmp_path: Path) -> None:
    """A diverging run: the JSONL keeps a NaN or infinite loss as ``null``; the report says in
    its headline how many rows had one and from which step, and charts the finite points."""
    import gpulens

    path = tmp_path / "run.jsonl"
    losses = {1: 2.0, 2: 1.5, 3: math.nan, 4: math.inf, 5: 1.0, 6: -math.inf, 7: 0.5}
    with gpulens.Monitor(backend="simulated", interval=0.02, sinks=[f"jsonl:{path}"]) as mon:
        for step, loss in losses.items():
            time.sleep(0.02)
            mon.log(step, loss=loss, grad_norm=0.7)
    assert [r.get("train/loss") for r in read_rows(path)] == [2.0, 1.5, None, None, 1.0, None,
                                                              0.5]
    summary = summarize(load_jsonl(path))
    assert summary.not_finite == {"train/loss": [3, 3]}
    assert (summary.loss_first, summary.loss_last, summary.loss_min) == (2.0, 0.5, 0.5)
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(html), "--markdown", str(md)]) == 0
    assert "loss: NOT FINITE (NaN or inf) in 3 row(s), first at step 3" in md.read_text()
    dom = check_page_in_chromium(html, tmp_path, min_charts=5)
    assert "loss not finite in 3 row(s), first at step 3" in dom
    assert re.search(r'id="chart-loss".*?data-points="4"', dom)


def test_run_sums_that_cover_some_gpus_say_how_many(tmp_path: Path) -> None:
    """GPU 0 cannot report power or energy: the run's energy and mean power are GPU 1's, and
    the headline says they cover 1 of 2 GPUs (not "all GPUs")."""
    import gpulens
    from gpulens.testing import SimulatedNVML

    path = tmp_path / "run.jsonl"
    sim = SimulatedNVML(gpus=2, not_supported={0: [
        "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetSamples"]})
    with gpulens.Monitor(backend=sim, interval=0.05, sinks=[f"jsonl:{path}"]) as mon:
        for step in range(1, 11):
            time.sleep(0.05)
            mon.log(step, loss=1.0 / step)
    summary = summarize(load_jsonl(path))
    by_gpu = {g.gpu: g for g in summary.gpus}
    assert by_gpu["0"].energy_wh is None and by_gpu["1"].energy_wh is not None
    assert (summary.energy_gpus, summary.power_gpus) == (1, 1)
    assert summary.energy_wh == pytest.approx(by_gpu["1"].energy_wh)
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(html), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert re.search(r"energy: [^·]+ \(1 of 2 GPUs\)", text), text
    assert re.search(r"mean power: \d+ W \(1 of 2 GPUs\)", text), text
    page = html.read_text()
    assert "mean GPU power (1 of 2 GPUs)" in page and "GPU energy (1 of 2 GPUs)" in page


def test_report_of_a_gpulens_record_run(tmp_path: Path) -> None:
    """Rows from `gpulens record` are intervals, not training steps: GPU charts only, no
    per-step figures."""
    rows = tmp_path / "rec.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "record", "--quiet", "--interval", "0.1",
         "--sink", f"jsonl:{rows}", "--", sys.executable, "-c", "import time; time.sleep(1)"],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="3"),
    )
    assert proc.returncode == 0, proc.stderr
    html, md = tmp_path / "rec.html", tmp_path / "rec.md"
    assert main(["report", str(rows), "-o", str(html), "--markdown", str(md)]) == 0
    page = html.read_text()
    assert "<h2>GPUs, by elapsed time (seconds since the start)</h2>" in page
    # x is elapsed seconds (the rows' own record/elapsed_s, else time since the start)
    x1 = [float(x) for x in re.findall(r'data-x1="([^"]+)"', page)]
    assert x1 and all(0.9 < x < 5 for x in x1), x1
    assert 'data-xlabel="elapsed s"' in page and 'data-xlabel="step"' not in page
    assert 'id="chart-loss"' not in page and 'id="chart-step-time"' not in page
    assert "energy per step" not in page and "steps" not in _kpi_labels(page)
    assert "energy/step" not in md.read_text() and "steps:" not in md.read_text()
    dom = check_page_in_chromium(html, tmp_path, min_charts=5)
    assert dom.count('<tr data-gpu="') == 3


def _kpi_labels(page: str) -> list[str]:
    return re.findall(r'<div class="l">([^<]*)</div>', page)


def test_report_efficiency_with_work(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "run.jsonl", junk=False)
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    assert main(["report", str(path), "-o", str(html), "--markdown", str(md), "--work", "84000",
                 "--unit", "tokens"]) == 0
    # 700 W for 60 s = 42 kJ; 84000 tokens / 42000 J = 2 tokens/J: one figure, one unit
    text, page = md.read_text(), html.read_text()
    assert "efficiency: 2 tokens/J" in text and "throughput: 1,400 tokens/s" in text
    assert "<th>Efficiency</th><td>2 tokens/J</td>" in page
    assert "<th>Throughput</th><td>1,400 tokens/s</td>" in page
    for shown in (text, page):  # the same unit twice under two names: gone
        assert "per W" not in shown and "per watt" not in shown
    assert '<div class="v">2 tokens/J</div><div class="l">efficiency (tokens per joule)' in page


def test_gpu_lost_mid_run_counts_its_own_time_not_the_runs(tmp_path: Path) -> None:
    """GPU 1 leaves after 20 of 120 steps (a GPU lost: its keys stop).  The run's mean power
    is the energy over the run's time, not the sum of each GPU's mean over its own rows, and
    GPU 1's throttled seconds are of the 10 s it was seen, not of the run's 60 s."""
    path = write_rows(tmp_path / "run.jsonl", junk=False)
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        row = json.loads(line)
        if row["step"] > 20:
            row = {k: v for k, v in row.items() if not k.startswith("gpu/1/")}
        else:
            row["gpu/1/throttle_pct"] = row["gpu/1/throttle_power_pct"] = 100.0
        kept.append(json.dumps(row))
    path.write_text("\n".join(kept) + "\n")
    s = summarize(load_jsonl(path))
    g0, g1 = s.gpus
    assert s.duration_s == pytest.approx(60.0)
    assert g1.power_mean_w == pytest.approx(400.0)  # while it was there
    assert s.energy_wh == pytest.approx((300 * 60 + 400 * 10) / 3600)
    assert s.power_mean_w == pytest.approx(300.0 + 400.0 * 10 / 60)
    assert s.energy_wh is not None and s.duration_s is not None
    assert s.power_mean_w == pytest.approx(s.energy_wh * 3600 / s.duration_s)
    assert g1.throttle_pct == pytest.approx(100.0)
    assert g1.throttled_power_s == pytest.approx(10.0)  # not 100 % of 60 s
    assert g0.throttled_power_s == pytest.approx(15.0)
