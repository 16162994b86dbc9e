"""``gpulens record -- COMMAND``: exit codes, signal passthrough (kill and a real Ctrl-C on a
pseudo-terminal), rows and the summary, bad input.  Simulated GPUs, small Python children."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.jsonl import read_rows

GPULENS = [sys.executable, "-m", "gpulens.cli"]


def env(gpus: int = 2) -> dict[str, str]:
    e = dict(os.environ)
    e.update(GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(gpus), PYTHONUNBUFFERED="1")
    return e


def record(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPULENS, "record", *args], capture_output=True, text=True, env=env(),
                          timeout=timeout)


@pytest.mark.parametrize("code", [0, 3, 42])
def test_exit_code_passthrough(code: int) -> None:
    proc = record("--interval", "0.2", "--", sys.executable, "-c",
                  f"import sys; sys.exit({code})")
    assert proc.returncode == code, proc.stderr
    assert f"(exit code {code})" in proc.stderr


def test_child_killed_by_signal_gives_128_plus_n() -> None:
    proc = record("--interval", "0.2", "--", sys.executable, "-c",
                  "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == 128 + signal.SIGKILL


def test_rows_summary_json_and_markdown(tmp_path: Path) -> None:
    rows, sj, sm = tmp_path / "rows.jsonl", tmp_path / "s.json", tmp_path / "s.md"
    proc = record("--interval", "0.25", "--sink", f"jsonl:{rows}", "--work", "5000", "--unit",
                  "samples", "--summary-json", str(sj), "--summary-md", str(sm), "--",
                  sys.executable, "-c", "import time; time.sleep(1.6); print('child says hi')")
    assert proc.returncode == 0, proc.stderr
    assert "child says hi" in proc.stdout  # the child's output is untouched
    lines = read_rows(rows)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, len(steps) + 1))
    assert 6 <= len(steps) <= 9  # 1.6 s / 0.25 s, plus the tail
    assert all("gpu/0/power_w" in r and "gpu/1/util_pct" in r for r in lines)
    # the rows' windows cover the child's life
    data = json.loads(sj.read_text())
    assert data["command"][0] == sys.executable and data["exit_code"] == 0
    assert data["rows"] == len(lines)
    assert data["duration_s"] == pytest.approx(data["ended"] - data["started"], abs=0.3)
    assert 1.5 < data["duration_s"] < 4
    assert len(data["gpus"]) == 2
    for g in data["gpus"]:
        assert g["name"].startswith("Simulated")
        assert 0 < g["activity_mean_pct"] <= g["activity_max_pct"] <= 100
        assert g["activity_metric"] == "sm_active_pct"
        assert 0 < g["power_mean_w"] <= g["power_max_w"]
        assert g["mem_peak_gb"] > 0 and g["temp_max_c"] > 0
        assert g["energy_source"] == "counter"
        # energy agrees with mean power x time within 25 %
        assert g["energy_wh"] * 3600 == pytest.approx(g["power_mean_w"] * data["duration_s"],
                                                      rel=0.25)
        assert g["throttle_pct"] is not None and g["throttled_s"] is not None
    eff = data["efficiency"]
    assert eff["unit"] == "samples" and eff["work"] == 5000
    total_j = sum(g["energy_wh"] for g in data["gpus"]) * 3600
    assert eff["per_joule"] == pytest.approx(5000 / total_j)
    assert "per_second_per_watt" not in eff  # one efficiency figure: per joule
    assert eff["per_second"] == pytest.approx(5000 / data["duration_s"])
    md = sm.read_text()
    assert "| GPU | Activity mean / max |" in md and "samples/J" in md and "Exit code: 0" in md
    assert "Simulated H100" in proc.stderr and "Throttled (why)" in proc.stderr


CHILD_WITH_HANDLERS = r"""
import signal, sys, time
got = []
def h(signum, frame):
    got.append(signum)
signal.signal(signal.SIGINT, h)
signal.signal(signal.SIGTERM, h)
print("ready", flush=True)
deadline = time.time() + 20
while not got and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # a second copy of the signal would land here
print("got", [signal.Signals(s).name for s in got], flush=True)
sys.exit(10 + len(got))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_sent_to_gpulens_reaches_child_once(sig: signal.Signals) -> None:
    proc = subprocess.Popen([*GPULENS, "record", "--interval", "0.2", "--", sys.executable,
                             "-c", CHILD_WITH_HANDLERS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env())
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert f"got ['{sig.name}']" in out, err
    assert proc.returncode == 11, err  # the child's code; gpulens itself did not die
    assert "Traceback" not in err


def test_ctrl_c_in_a_terminal_reaches_child_once(tmp_path: Path) -> None:
    """A real Ctrl-C: the pty's line discipline signals the foreground process group, which
    holds gpulens and the child; gpulens must not send a second SIGINT."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: session leader on the pty, exec gpulens
        os.execvpe(GPULENS[0], [*GPULENS, "record", "--interval", "0.2", "--summary-json",
                                str(tmp_path / "s.json"), "--", sys.executable, "-c",
                                CHILD_WITH_HANDLERS], env(1))
    out = b""
    deadline = time.time() + 60
    sent = False
    status = None
    while time.time() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            out += chunk
        if not sent and b"ready" in out:
            time.sleep(0.3)
            os.write(fd, b"\x03")  # Ctrl-C typed at the terminal
            sent = True
        wpid, st = os.waitpid(pid, os.WNOHANG)
        if wpid == pid:
            status = st
            break
    os.close(fd)
    assert status is not None, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "got ['SIGINT']" in text, text
    assert os.waitstatus_to_exitcode(status) == 11, text
    assert json.loads((tmp_path / "s.json").read_text())["exit_code"] == 11


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "no command given"),
        (["--"], 2, "no command given"),
        (["--", "no-such-command-xyz"], 127, "command not found: no-such-command-xyz"),
        (["--sink", "nosuch:1", "--", "true"], 2, "unknown sink 'nosuch:1'"),
        (["--gpus", "7", "--", "true"], 2, "GPU 7 does not exist"),
        (["--gpus", "a,b", "--", "true"], 2, "GPU indices are comma-separated"),
        (["--interval", "-1", "--", "true"], 2, "must be a positive number"),
        (["--interval", "nan", "--", "true"], 2, "must be a positive number"),
        (["--unit", "bananas", "--", "true"], 2, "invalid choice"),
        (["--summary-json", "/nonexistent/dir/s.json", "--", "true"], 2, "cannot write summary"),
    ],
)
def test_bad_input(args: list[str], code: int, message: str) -> None:
    proc = record(*args)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_prometheus_sink_while_recording_has_gpu_but_no_training_series() -> None:
    """The child scrapes its parent's exporter: GPU series, no gpulens_train_* (rows count
    intervals here, not training steps)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = (
        "import time, urllib.request\n"
        "deadline = time.time() + 20\n"
        "text = ''\n"
        "while time.time() < deadline and 'gpulens_gpu_power_watts{' not in text:\n"
        "    time.sleep(0.2)\n"
        "    try:\n"
        f"        text = urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read()"
        ".decode()\n"
        "    except OSError:\n"
        "        pass\n"
        "print('gpu' if 'gpulens_gpu_power_watts{' in text else 'nogpu',"
        " 'train' if 'gpulens_train' in text else 'notrain')\n"
    )
    proc = record("--interval", "0.2", "--sink", f"prometheus:{port}", "--", sys.executable,
                  "-c", child)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "gpu notrain"
