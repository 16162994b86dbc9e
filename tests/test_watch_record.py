"""``gpulens watch --record RUN.jsonl``: the training's latest step, loss, throughput, MFU and
the advice rules firing beside the node's GPUs, followed from the JSONL record a real monitor
writes (simulated GPUs), in a real terminal (tmux) at 80 columns; the reader that tails the
record (partial lines, new runs, replaced files, bounded reads); the plain mode; bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpulens.report.tail import RecordTail
from tests.test_watch import GPULENS, ROOT, capture, env, gpu_lines, settled, tmux, wait_for

__all__ = ["tmux"]  # the fixture, imported for the tests below

T0 = 1_700_000_000.0
META = {"dtype": "bf16", "peak_gpu": "H100 SXM5 80GB", "peak_dtype": "bf16",
        "peak_tflops": 989.4}


def head(run_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"event": "run_start", "run_id": run_id, "time": T0, "hostname": "n1",
            "backend": "nvml", "interval": 0.5, "gpus": [], "meta": meta or META}


def row(run_id: str, step: int, **values: float) -> dict[str, Any]:
    base = {"train/loss": 3.0 - step / 100, "perf/tokens_per_s": 16384.0 + step,
            "perf/mfu_pct": 31.6, "perf/tflops": 312.5, "alerts/input_bound": 0.0}
    return {"run_id": run_id, "step": step, "time": T0 + step, **base, **values}


def alert(run_id: str, step: int, name: str = "input_bound") -> dict[str, Any]:
    return {"event": "alert", "run_id": run_id, "step": step, "time": T0 + step, "name": name,
            "state": "firing", "severity": "warning", "message": "the GPUs wait for data",
            "advice": "more DataLoader workers", "data": {}}


def append(path: Path, *lines: dict[str, Any], raw: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines) + raw)


def test_the_tail_follows_steps_alerts_runs_and_a_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "gpu.jsonl"
    tail = RecordTail(path)
    st = tail.poll()
    assert not st.exists and st.step is None  # not written yet: waiting
    append(path, head("a"), row("a", 1), row("a", 2))
    st = tail.poll()
    assert (st.run_id, st.step, st.meta["peak_tflops"]) == ("a", 2, 989.4)
    assert st.values["perf/tokens_per_s"] == 16386.0 and st.firing == []
    # a line still being written is not read until it is whole
    line = json.dumps(row("a", 3, **{"alerts/input_bound": 1.0}))
    append(path, alert("a", 3), raw=line[:40])
    assert tail.poll().step == 2
    append(path, raw=line[40:] + "\n")
    st = tail.poll()
    assert st.step == 3 and st.firing == ["input_bound"] and st.fired_at("input_bound") == 3
    # the run ends; a second run in the same file starts afresh
    append(path, {"event": "run_end", "run_id": "a", "time": T0 + 4, "rows": 3})
    assert tail.poll().ended
    append(path, head("b", {"dtype": "fp8"}), row("b", 1))
    st = tail.poll()
    assert (st.run_id, st.step, st.ended, st.firing, st.meta) == ("b", 1, False, [], {
        "dtype": "fp8"})
    assert list(st.events) == []
    # the file is replaced by a shorter one (a new training, same name): read from its start
    path.unlink()
    append(path, head("c"), row("c", 5))
    st = tail.poll()
    assert (st.run_id, st.step) == ("c", 5)


def test_the_first_read_is_bounded_to_the_end_of_a_long_record(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    append(path, head("a"), *(row("a", s) for s in range(1, 20_001)))
    size = path.stat().st_size
    assert size > 2 << 20
    tail = RecordTail(path, initial_bytes=64 << 10)
    st = tail.poll()  # 64 KiB read, one row parsed (its time: benchmarks/unit_timings.py)
    assert st.step == 20_000 and st.run_id == "a"
    assert st.meta == {}  # the header lies before the part read: unknown, never guessed
    append(path, row("a", 20_001))
    assert tail.poll().step == 20_001


def test_plain_mode_adds_the_training_to_each_line(tmp_path: Path) -> None:
    path = tmp_path / "gpu.jsonl"
    append(path, head("a"), row("a", 6), alert("a", 7),
           row("a", 7, **{"alerts/input_bound": 1.0, "perf/mfu_pct": 41.25}))
    proc = subprocess.run([*GPULENS, "watch", "--interval", "0.2", "--count", "1", "--record",
                           str(path)], capture_output=True, text=True, env=env(), timeout=240,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert re.search(r" gpu1 SM \d+% .* \| train step 7 loss 2\.93 tok/s 16391 MFU 41\.2% "
                     r"TFLOP/s/GPU 312 alerts input_bound$", line), line
    assert f"following the training record {path}" in proc.stderr


def test_a_directory_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([*GPULENS, "watch", "--record", str(tmp_path)], capture_output=True,
                          text=True, env=env(), timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"gpulens watch: error: --record {tmp_path} is a directory, "
                                   "not a JSONL record")


TRAINING = """
import math, sys, time
import gpulens
from gpulens.testing import SimulatedNVML
from gpulens.testing import Constant

path = sys.argv[1]  # the watch is already waiting for it
with gpulens.Monitor(backend=SimulatedNVML(gpus=1, load=Constant(0.15)), interval=0.05,
                     sinks=[f"jsonl:{path}"], dtype="bf16", flops_per_token=7.44e8) as mon:
    for step in range(1, 61):
        time.sleep(0.08)
        mon.log(step, loss=2.0 * math.exp(-step / 20), tokens=8192)
"""

TRAINING_LINE = re.compile(
    r"^Training  step (?P<step>\d+) · loss (?P<loss>[\d.e-]+) · (?P<rate>[\d.]+k) tok/s · "
    r"MFU (?P<mfu>[\d.]+)%(?: · [^·]+)*$")


def test_live_view_follows_a_training_at_80_columns(tmux: list[str], tmp_path: Path) -> None:
    """A real monitor (simulated GPU 15 % busy, so the engine finds it input-bound) writes the
    record while the watch, started before the file exists, follows it in an 80x24 terminal."""
    record, script = tmp_path / "run" / "gpu.jsonl", tmp_path / "train.py"
    script.write_text(TRAINING)
    exit_file = tmp_path / "exit-code"
    cmd = (f"cd {ROOT} && GPULENS_BACKEND=simulated GPULENS_SIMULATED_GPUS=2 "
           f"{sys.executable} -m gpulens.cli watch --interval 0.25 --record {record}; "
           f"echo $? > {exit_file}; echo WATCH-EXITED; sleep 60")
    subprocess.run([*tmux, "new-session", "-d", "-s", "watch", "-x", "80", "-y", "24", cmd],
                   check=True, timeout=120)
    wait_for(tmux, r"Training: waiting for gpu\.jsonl \(not written yet\)")
    trainer = subprocess.Popen([sys.executable, str(script), str(record)], cwd=ROOT,
                               env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        steps: list[int] = []

        def check(screen: str) -> None:
            assert all(len(line) <= 80 for line in screen.splitlines())
            assert "…" not in screen  # nothing cut
            assert [m["gpu"] for m in gpu_lines(screen)] == ["0", "1"]
            found = [m for line in screen.splitlines() if (m := TRAINING_LINE.match(line))]
            assert len(found) == 1, screen
            m = found[0]
            assert 0 < float(m["loss"]) < 2 and 50 < float(m["rate"][:-1]) < 200
            assert 0 < float(m["mfu"]) < 100
            steps.append(int(m["step"]))

        settled(tmux, check, timeout=120)
        first = steps[-1]

        def later(screen: str) -> None:
            check(screen)
            assert steps[-1] > first, f"still step {first}"

        settled(tmux, later, timeout=120)  # it follows the training as it goes
        assert steps[-1] > steps[0]
        screen = wait_for(tmux, r"Alerts firing: input_bound \(step \d+\)", timeout=120)
        assert re.search(r"^  try \(input_bound\): Feed the GPUs faster", screen, re.M), screen
        assert trainer.wait(timeout=240) == 0, trainer.stderr.read() if trainer.stderr else ""
        screen = wait_for(tmux, r"Training  step 60 · .* · run ended", timeout=20)
        assert all(len(line) <= 80 for line in screen.splitlines())
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=120)
        if trainer.stderr is not None:
            trainer.stderr.close()
    subprocess.run([*tmux, "send-keys", "-t", "watch", "q"], check=True, timeout=120)
    wait_for(tmux, "WATCH-EXITED", timeout=20)
    assert exit_file.read_text().strip() == "0"
    assert "Traceback" not in capture(tmux)
