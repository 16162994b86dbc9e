"""A machine where no NVIDIA driver answers (``GPULENS_SIMULATED_GPUS=0``: the simulator's
``nvmlInit`` fails as it does without a driver), met from every entry point.

* A GPU named by number that does not exist is a one-line error before anything runs: the API
  (``Monitor(gpus=...)``), ``gpulens watch|record|serve --gpus`` (the HF and Lightning
  callbacks: in their own test files).  Without ``gpus`` a training run still gets its host
  and training figures, with one WARNING.
* ``gpulens watch`` with no GPU is one error line, with no WARNING about "training metrics"
  before it, and on a terminal it breaks between words, not inside one.
* The engine process's end is told in words ("killed by SIGKILL"), never "exit code None".
"""

from __future__ import annotations

import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpulens
from gpulens.testing import MemorySink
from gpulens.transport.process import how_it_ended

GPULENS = [sys.executable, "-m", "gpulens.cli"]
NO_DRIVER = {"GPULENS_BACKEND": "simulated", "GPULENS_SIMULATED_GPUS": "0"}


def no_driver_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, **NO_DRIVER, **extra)


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in NO_DRIVER.items():
        monkeypatch.setenv(name, value)


def test_monitor_with_gpus_that_do_not_exist_fails_at_start(no_driver: None) -> None:
    mon = gpulens.Monitor(gpus=[0, 1], interval=0.05)
    with pytest.raises(ValueError, match=r"^GPU 0 does not exist: no NVIDIA driver answered"):
        mon.start()
    assert not mon.running


def test_monitor_without_gpus_keeps_host_and_training_rows(
        no_driver: None, caplog: pytest.LogCaptureFixture) -> None:
    sink = MemorySink()
    with (caplog.at_level(logging.WARNING, logger="gpulens"),
          gpulens.Monitor(interval=0.05, sinks=[sink]) as mon):
        assert mon.context is not None and mon.context.gpus == ()
        mon.log(1, loss=2.0)
    (row,) = sink.rows
    assert row.values["train/loss"] == 2.0 and "host/cpu_pct" in row.values
    assert not any(k.startswith("gpu/") for k in row.values)
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(told) == 1 and "NVML could not be initialised" in told[0], told


def test_require_gpu_makes_no_gpu_an_error(no_driver: None,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with (caplog.at_level(logging.WARNING, logger="gpulens"),
          pytest.raises(ValueError, match=r"^no GPU to monitor: no NVIDIA driver answered")):
        gpulens.Monitor(interval=0.05, require_gpu=True).start()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("command", [
    ["watch", "--plain", "--count", "3"],
    ["record", "--interval", "0.2", "--", sys.executable, "-c", "pass"],
    ["serve", "--port", "0", "--interval", "0.2"],
])
def test_cli_gpus_that_do_not_exist_is_one_line_exit_2(command: list[str]) -> None:
    name = command[0]
    proc = subprocess.run([*GPULENS, *command[:1], "--gpus", "0,1", *command[1:]],
                          capture_output=True, text=True, env=no_driver_env(), timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"gpulens {name}: error: GPU 0 does not exist: no NVIDIA driver answered (NVML could "
        "not be initialised: simulated NVML error 9)"], proc.stderr
    assert proc.stdout == ""


def test_watch_without_a_gpu_is_one_error_and_no_warning() -> None:
    proc = subprocess.run([*GPULENS, "watch", "--plain", "--count", "3"], capture_output=True,
                          text=True, env=no_driver_env(), timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("gpulens watch: error: no GPU to monitor: no NVIDIA driver answered")
    assert "WARNING" not in proc.stderr and "training" not in proc.stderr


def _read_terminal(fd: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    """Everything written to the pseudo-terminal until ``proc`` ended and the output drained."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode().replace("\r\n", "\n")


def test_messages_on_an_80_column_terminal_break_between_words(tmp_path: Path) -> None:
    """stderr on a pseudo-terminal of 80 columns: the error and a WARNING come in lines of at
    most 80 characters, each ending at the end of a word (the next line goes on after two
    spaces), and joined they are the message written without a terminal."""
    script = tmp_path / "warn.py"
    script.write_text(
        "import sys\n"
        "from gpulens.log import logger\n"
        "logger.warning('gpulens: a warning long enough to need three lines on a terminal of "
        "eighty columns, so that where its lines break can be seen: here, then there, and "
        "at last somewhere around this end')\n"
        "from gpulens.cli import main\n"
        "sys.exit(main(['watch', '--plain', '--count', '1']))\n")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=follower,
                                env=no_driver_env(COLUMNS="80", LINES="24"))
        os.close(follower)
        text = _read_terminal(leader, proc)
        assert proc.wait(30) == 2
    finally:
        os.close(leader)
    lines = text.rstrip("\n").split("\n")
    assert len(lines) >= 5, text
    assert all(len(line) <= 80 for line in lines), text
    starts = [i for i, line in enumerate(lines) if line.startswith("gpulens")]
    assert [lines[i].split(":")[1] for i in starts] == [" WARNING", " error"], text
    for i, line in enumerate(lines):
        if i not in starts:
            assert line.startswith("  ") and line[2] != " ", text
        if i + 1 < len(lines) and i + 1 not in starts:
            # the break fell between two words: no word was cut in two
            assert not line.endswith(" ") and re.match(r"  \S", lines[i + 1]), text
    joined = re.sub(r"\n  ", " ", text.rstrip("\n")).split("\n")
    assert joined[0].startswith("gpulens: WARNING: a warning long enough")
    assert joined[0].endswith("somewhere around this end")
    assert joined[1].startswith("gpulens watch: error: no GPU to monitor")


def test_how_the_engine_process_ended_is_said_in_words() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert how_it_ended(ended, wait_s=30) == "exit code 3"
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; "
                               "os.kill(os.getpid(), signal.SIGTERM)"])
    assert how_it_ended(killed, wait_s=30) == "killed by SIGTERM"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert how_it_ended(alive, wait_s=0.01) == ("it closed its pipe and had not exited "
                                                    "0.01 s later")
    finally:
        alive.kill()
        alive.wait()


def test_engine_process_killed_is_told_with_its_signal(caplog: pytest.LogCaptureFixture) -> None:
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated").start()
        try:
            transport = mon._transport
            assert transport is not None and transport.isolation == "process"
            pid = getattr(transport, "pid", None)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)  # it ignores SIGTERM (a launcher's, to its group)
            deadline = time.monotonic() + 30
            while (not any("ended unexpectedly" in r.getMessage() for r in caplog.records)
                   and time.monotonic() < deadline):
                mon.log(1, loss=1.0)
                time.sleep(0.05)
        finally:
            mon.stop()
    told = [r.getMessage() for r in caplog.records if "ended unexpectedly" in r.getMessage()]
    assert len(told) == 1, told
    assert "(killed by SIGKILL)" in told[0] and "None" not in told[0], told[0]
