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
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPULENS = [sys.executable, "-m", "gpulens.cli"]


def env(gpus: int = 2) -> dict[str, str]:
    return dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(gpus))


def test_plain_lines_without_a_terminal() -> None:
    proc = subprocess.run([*GPULENS, "watch", "--interval", "0.2", "--count", "3"],
                          capture_output=True, text=True, env=env(), timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
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
    _, err = proc.communicate(timeout=30)
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
                          timeout=60, stdin=subprocess.DEVNULL)
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
    base = [exe, "-L", f"gpulens-test-{os.getpid()}", "-f", "/dev/null"]
    try:
        yield base
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30)


def capture(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "watch"], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def wait_for(tmux: list[str], pattern: str, timeout: float = 30) -> str:
    deadline = time.time() + timeout
    screen = ""
    while time.time() < deadline:
        screen = capture(tmux)
        if re.search(pattern, screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} never appeared:\n{screen}")


def test_live_view_in_tmux(tmux: list[str], tmp_path: Path) -> None:
    exit_file = tmp_path / "exit-code"
    cmd = (f"cd {ROOT} && GPULENS_BACKEND=simulated GPULENS_SIMULATED_GPUS=2 "
           f"{sys.executable} -m gpulens.cli watch --interval 0.25 --history 12; "
           f"echo $? > {exit_file}; echo WATCH-EXITED; sleep 60")
    subprocess.run([*tmux, "new-session", "-d", "-s", "watch", "-x", "170", "-y", "30", cmd],
                   check=True, timeout=30)
    # a few intervals, so the history has grown
    wait_for(tmux, r"gpulens watch · .* · simulated · every 0.25 s")
    time.sleep(2.0)
    screen = wait_for(tmux, r"q quits")
    assert "Held down by" in screen and "SM clock" in screen
    for gpu in ("0", "1"):
        line = next(ln for ln in screen.splitlines() if f"│ {gpu} Simulated H100" in ln)
        assert re.search(r"\d+\.\d% SM", line), line
        assert re.search(r"[\d.]+/86 GB", line), line
        assert re.search(r"\d+/700 W", line), line
        assert re.search(r"\d+ °C", line) and re.search(r"\d+ MHz", line), line
        spark = re.search(r"│ ([▁▂▃▄▅▆▇█]+) +│", line)
        assert spark and len(spark.group(1)) >= 4, line  # history is drawn
    assert screen.count("% tensor") == 2
    # the view refreshes: the history grows
    time.sleep(1.0)
    later = capture(tmux)
    assert later != screen
    subprocess.run([*tmux, "send-keys", "-t", "watch", "q"], check=True, timeout=30)
    wait_for(tmux, "WATCH-EXITED", timeout=20)
    assert exit_file.read_text().strip() == "0"
    assert "Traceback" not in capture(tmux)
