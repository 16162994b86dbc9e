"""``gpulens watch``: driven in a real terminal through tmux (capture-pane, send-keys q), the
plain one-line-per-interval mode without a terminal, and bad input.  Simulated GPUs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPULENS = [sys.executable, "-m", "gpulens.cli"]


def env(gpus: int = 2) -> dict[str, str]:
    return dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(gpus))


def test_plain_lines_without_a_terminal() -> None:
    proc = subprocess.run([*GPULENS, "watch", "--interval", "0.2", "--count", "3"],
                          capture_output=True, text=True, env=env(), timeout=240,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    # once, on stderr: what is watched, that it is simulated, and what a GB is
    assert proc.stderr.strip() == (
        "gpulens watch: 2 GPU(s) [0: Simulated H100 80GB HBM3, 1: Simulated H100 80GB HBM3] "
        "via simulated (SIMULATED GPUs); memory in GB = 10^9 bytes (85.9 GB = 80.0 GiB)")
    pattern = re.compile(
        r"gpu(\d) SM (\d+)% tensor (\d+)% mem ([\d.]+)/85\.9 GB power (\d+)/700 W temp (\d+) C "
        r"sm (\d+) MHz held (-|power cap|thermal|power cap\+thermal|other)"
    )
    for line in lines:
        found = pattern.findall(line)
        assert [g[0] for g in found] == ["0", "1"], line
        for _, sm, tensor, mem, power, temp, clock, _held in found:
            assert 0 <= int(tensor) <= int(sm) <= 100
            assert 0 < float(mem) < 85.9 and 0 < int(power) <= 700
            assert 20 < int(temp) < 100 and 100 < int(clock) < 3000


def test_plain_mode_stops_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen([*GPULENS, "watch", "--interval", "0.2", "--gpus", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert " gpu1 " in first and " gpu0 " not in first
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "5"], "GPU 5 does not exist: this process sees 2 GPU(s)"),
        (["--gpus", "x"], "GPU indices are comma-separated numbers"),
        (["--interval", "0"], "must be a positive number"),
        (["--count", "0"], "--count must be at least 1"),
    ],
)
def test_bad_input(args: list[str], message: str) -> None:
    proc = subprocess.run([*GPULENS, "watch", *args], capture_output=True, text=True, env=env(),
                          timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    exe = shutil.which("tmux")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tmux is missing in CI (apt-get install -y tmux)")
        pytest.skip("tmux is not installed (apt-get install -y tmux)")
    base = [exe, "-L", f"gpulens-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
    try:
        yield base
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=120)


def capture(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "watch"], capture_output=True,
                          text=True, timeout=120, check=True).stdout


def wait_for(tmux: list[str], pattern: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    screen = ""
    while time.time() < deadline:
        screen = capture(tmux)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} never appeared:\n{screen}")


GPU_LINE = re.compile(
    r"^ +(?P<gpu>\d+)  (?:(?P<name>Simulated H100 80GB HBM3)  )?(?P<label>SM|util) +(?P<act>\d+)%"
    r"  (?:(?P<history>[▁▂▃▄▅▆▇█]+) +)? +(?P<tensor>\d+)%(?: +(?P<dram>\d+)%)?"
    r" +(?P<used>\d+\.\d)/85\.9 GB(?:  (?P<membar>[█░]{6}) +\d+%)?"
    r" +(?P<power>\d+)/700 W(?:  (?P<powerbar>[█░]{6}) +\d+%)?"
    r" +(?P<temp>\d+)°C +(?P<clock>\d+) MHz +(?P<held>-|power cap|thermal|pwr\+therm|other)$"
)


PROCESS_LINE = re.compile(r"^ +(\d+) +(\d+) +\S+ +\d+\.\d GB  python\S* -m gpulens\.cli watch "
                          r"--interval 0\.25 --history \d+$", re.M)


def gpu_lines(screen: str) -> list[re.Match[str]]:
    found = [m for line in screen.splitlines() if (m := GPU_LINE.match(line))]
    for m in found:
        assert 0 <= int(m["tensor"]) <= int(m["act"]) <= 100, m.group(0)
        assert 0 < float(m["used"]) < 85.9 and 0 < int(m["power"]) <= 700, m.group(0)
        assert 20 < int(m["temp"]) < 100 and 100 < int(m["clock"]) < 3000, m.group(0)
    return found


def settled(tmux: list[str], check: Callable[[str], None], timeout: float = 60) -> str:
    """The first screen that passes ``check`` (a capture can catch a frame half drawn, or a
    GPU before its first GPM read); the last failure if none does within ``timeout``."""
    deadline = time.time() + timeout
    while True:
        screen = capture(tmux)
        try:
            check(screen)
            return screen
        except AssertionError as e:
            if time.time() > deadline:
                raise AssertionError(f"{e}\n{screen}") from None
            time.sleep(0.2)


def start_watch(tmux: list[str], name: str, cols: int, rows: int, gpus: int, exit_file: Path,
                history: int = 30) -> None:
    cmd = (f"cd {ROOT} && GPULENS_BACKEND=simulated GPULENS_SIMULATED_GPUS={gpus} "
           f"{sys.executable} -m gpulens.cli watch --interval 0.25 --history {history}; "
           f"echo $? > {exit_file}; echo WATCH-EXITED; sleep 60")
    subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows),
                    cmd], check=True, timeout=120)


def test_live_view_at_80x24_then_wider_then_q(tmux: list[str], tmp_path: Path) -> None:
    exit_file = tmp_path / "exit-code"
    start_watch(tmux, "watch", 80, 24, 2, exit_file)
    wait_for(tmux, r"gpulens watch · SIMULATED GPUs · ")

    def narrow(screen: str) -> None:
        assert all(len(line) <= 80 for line in screen.splitlines())
        assert "…" not in screen  # no figure is cut
        assert re.search(r"GPU +Activity +Tensor +Memory +Power +Temp +SM clock +Held by", screen)
        found = gpu_lines(screen)
        assert [m["gpu"] for m in found] == ["0", "1"]
        assert all(m["label"] == "SM" for m in found)
        assert "GB = 10⁹ bytes: 85.9 GB = 80.0 GiB" in screen and "q quits" in screen

    settled(tmux, narrow)
    # the terminal grows to 200 columns: the view follows, history and bars join
    subprocess.run([*tmux, "resize-window", "-t", "watch", "-x", "200", "-y", "30"], check=True,
                   timeout=120)

    def wide_view(screen: str) -> None:
        found = gpu_lines(screen)
        assert [m["gpu"] for m in found] == ["0", "1"]
        for m in found:
            assert m["history"] and len(m["history"]) >= 4, m.group(0)  # several intervals
            assert m["membar"] and m["powerbar"] and m["dram"] is not None, m.group(0)

    wide = settled(tmux, wide_view)
    deadline = time.time() + 30  # it keeps refreshing (bounds a hang; 0.25 s interval)
    while capture(tmux) == wide:
        assert time.time() < deadline, "the view stopped refreshing"
        time.sleep(0.2)
    subprocess.run([*tmux, "send-keys", "-t", "watch", "q"], check=True, timeout=120)
    wait_for(tmux, "WATCH-EXITED", timeout=20)
    assert exit_file.read_text().strip() == "0"
    assert "Traceback" not in capture(tmux)


@pytest.mark.parametrize(("cols", "rows", "gpus"), [(80, 24, 8), (120, 30, 2), (200, 30, 8)])
def test_every_gpu_on_a_line_at_each_width(tmux: list[str], tmp_path: Path, cols: int,
                                           rows: int, gpus: int) -> None:
    start_watch(tmux, "watch", cols, rows, gpus, tmp_path / "exit-code", history=40)
    wait_for(tmux, r"q quits")  # settled() below waits for the history to have enough

    def check(screen: str) -> None:
        assert all(len(line) <= cols for line in screen.splitlines())
        assert "…" not in screen
        found = gpu_lines(screen)
        assert [m["gpu"] for m in found] == [str(g) for g in range(gpus)]
        assert "SIMULATED GPUs" in screen.splitlines()[0]
        assert f"{gpus} x Simulated H100 80GB HBM3" in screen.splitlines()[0]
        if cols == 80:
            assert not any(m["history"] or m["name"] or m["membar"] for m in found)
            assert "Processes" not in screen
        if cols >= 120:  # wider: the history sparkline, then memory and power bars
            for m in found:
                assert m["history"] and len(m["history"]) >= 6, m.group(0)
                assert m["membar"] and m["powerbar"], m.group(0)
            # and the processes on the GPUs: the simulated GPUs' one is the watch itself
            assert re.search(r"^Processes ─+$", screen, re.M)
            procs = PROCESS_LINE.findall(screen)
            assert [g for g, _ in procs] == [str(g) for g in range(gpus)], screen
            assert len({pid for _, pid in procs}) == 1
        if cols == 200:  # wider still: DRAM bandwidth and the model; history to --history
            for m in found:
                assert m["dram"] is not None and m["name"], m.group(0)
            assert re.search(r"History {25,}", screen)

    settled(tmux, check)
    subprocess.run([*tmux, "send-keys", "-t", "watch", "q"], check=True, timeout=120)
    wait_for(tmux, "WATCH-EXITED", timeout=20)
