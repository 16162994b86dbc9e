"""``gpulens record -- COMMAND``: exit codes, signal passthrough (kill and a real Ctrl-C on a
pseudo-terminal), rows and the summary, bad input.  Simulated GPUs, small Python children."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl import read_rows

GPULENS = [sys.executable, "-m", "gpulens.cli"]


def env(gpus: int = 2) -> dict[str, str]:
    e = dict(os.environ)
    e.update(GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(gpus), PYTHONUNBUFFERED="1")
    return e


def record(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
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
    # rows of a wall-clock record: on record/elapsed_s, without per-step figures
    elapsed = [r["record/elapsed_s"] for r in lines]
    assert elapsed == sorted(elapsed)
    assert_on_schedule(elapsed[:-1], 0.25)
    assert not any(k == "train/global_step" or k.startswith("perf/") for r in lines for k in r)
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
    out, err = proc.communicate(timeout=120)
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
        (["--bogus", "--", "true"], 2, "unrecognized arguments: --bogus (see 'gpulens record"),
        (["--interval", "1", "--summary-interval", "0.5"], 2, "--summary-interval (0.5 s) must"),
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


# -- beside a training: no command, until a signal -------------------------------------------

def start_beside(*args: str, extra_env: dict[str, str] | None = None,
                 gpus: int = 2) -> subprocess.Popen[str]:
    e = env(gpus)
    e.update(extra_env or {})
    return subprocess.Popen([*GPULENS, "record", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)


def threads_not_blocking(pid: int, sig: signal.Signals) -> list[str]:
    """The threads of ``pid`` other than its main one whose signal mask lets ``sig`` through
    (the main thread takes it in ``sigtimedwait``, which unblocks it while waiting)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name == str(pid):
            continue
        try:
            status = dict(line.split(":\t", 1) for line in
                          (task / "status").read_text().splitlines() if ":\t" in line)
        except FileNotFoundError:
            continue  # the thread ended
        if not int(status["SigBlk"], 16) >> (sig - 1) & 1:
            out.append(f"{task.name} {status['Name'].strip()}")
    return out


def assert_on_schedule(elapsed: list[float], interval: float) -> None:
    """Rows on the wall clock every ``interval`` s from the start: none early, most on time,
    none far behind.  (A loaded machine wakes a thread late now and then: the full suite beside
    two busy processes put one row 0.116 s behind a 0.2 s tick, the rest within 2 ms.  A
    hiccup longer than an interval restarts the cadence, and every later row is late by it:
    the median check then fails, so the tolerance is in effect one interval.)"""
    late = [e - interval * (i + 1) for i, e in enumerate(elapsed)]
    assert late and min(late) > -0.05, late
    assert statistics.median(late) < 0.06 and max(late) < 0.4, late


def wait_for_rows(path: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(read_rows(path)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} rows in {path} after {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_beside_training_records_until_a_signal_and_exits_0(tmp_path: Path,
                                                            sig: signal.Signals) -> None:
    rows, sj = tmp_path / "rows.jsonl", tmp_path / "s.json"
    proc = start_beside("--gpus", "0,1", "--interval", "0.2", "--sink", f"jsonl:{rows}",
                        "--summary-json", str(sj))
    wait_for_rows(rows, 4)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    lines = read_rows(rows)
    assert [r["step"] for r in lines] == list(range(1, len(lines) + 1))
    elapsed = [r["record/elapsed_s"] for r in lines]
    # the first interval is one interval long, and so are the others (the last: the tail)
    assert_on_schedule(elapsed[:-1], 0.2)
    assert not any(k == "train/global_step" or k.startswith("perf/") for r in lines for k in r)
    assert all("gpu/0/power_w" in r and "gpu/1/power_w" in r for r in lines)
    # the live line: one a row (stderr is not a terminal), newest sample of each GPU
    live = [x for x in err.splitlines() if x.startswith("[")]
    assert len(live) >= 3 and all("gpu0 SM" in x and "gpu1 SM" in x for x in live), err
    assert "gpulens record (beside a training)" in err  # the summary at the end
    data = json.loads(sj.read_text())
    assert data["command"] == [] and data["exit_code"] == 0 and data["rows"] == len(lines)


def test_beside_training_no_console_gpus_and_summary_interval(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    proc = start_beside("--gpus", "1", "--interval", "0.1", "--no-console",
                        "--summary-interval", "0.5", "--sink", f"jsonl:{rows}")
    wait_for_rows(rows, 15)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not [x for x in err.splitlines() if x.startswith("[")], err  # no live line
    assert err.count("gpulens record: the last 0.5 s") >= 2, err
    lines = read_rows(rows)
    gpus = {k.split("/")[1] for r in lines for k in r if k.startswith("gpu/")}
    assert gpus == {"1"}


def test_beside_training_wandb_rows_on_elapsed_seconds(tmp_path: Path) -> None:
    from tests.support.wandb_offline import OFFLINE_ENV
    from tests.support.wandb_reader import (
        read_history,
        read_metric_definitions,
        wait_for_finished_run,
    )

    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    rows = tmp_path / "rows.jsonl"
    proc = start_beside("--interval", "0.2", "--no-console", "--sink", "wandb", "--sink",
                        f"jsonl:{rows}", extra_env={**OFFLINE_ENV, "WANDB_DIR": str(wandb_dir)},
                        gpus=1)
    wait_for_rows(rows, 4)
    # a thread that does not block SIGTERM (wandb's import starts one) would take the signal
    # while the main thread is between waits, and its default action ends the process (exit -15)
    assert threads_not_blocking(proc.pid, signal.SIGTERM) == []
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    path = wait_for_finished_run(wandb_dir)
    history = [h for h in read_history(path) if "record/elapsed_s" in h]
    jsonl = read_rows(rows)
    assert [h["record/elapsed_s"] for h in history] == [r["record/elapsed_s"] for r in jsonl]
    assert not any(k in h for h in history for k in ("train/global_step", "gpulens/step",
                                                      "perf/steps", "perf/step_time_s"))
    defs = {d.name: d.step_metric for d in read_metric_definitions(path) if d.name}
    assert defs["gpu/0/power_w"] == "record/elapsed_s"


def test_mlflow_rows_of_a_record(tmp_path: Path, mlflow_tracking: Any) -> None:
    proc = record("--interval", "0.2", "--sink", "mlflow", "--", sys.executable, "-c",
                  "import time; time.sleep(1.0)")
    assert proc.returncode == 0, proc.stderr
    (run,) = mlflow_tracking.runs()
    client = mlflow_tracking.client()
    elapsed = client.get_metric_history(run.info.run_id, "record/elapsed_s")
    # the tracker view of wall-clock rows: job figures in a section "gpu" of their own
    power = client.get_metric_history(run.info.run_id, "gpu/power_w_mean")
    assert len(elapsed) == len(power) >= 4
    assert sorted(m.step for m in power) == list(range(1, len(power) + 1))
    assert client.get_metric_history(run.info.run_id, "perf/steps") == []
    assert client.get_metric_history(run.info.run_id, "train/global_step") == []


# -- tracker set-up errors: one line, before anything is created -----------------------------

def test_wandb_without_login_is_one_line_and_nothing_is_made(tmp_path: Path,
                                                             mlflow_tracking: Any) -> None:
    from tests.support.wandb_offline import OFFLINE_ENV

    rows = tmp_path / "rows.jsonl"
    e = env(1)
    e.update({k: v for k, v in OFFLINE_ENV.items() if k != "WANDB_MODE"})
    e.update(HOME=str(tmp_path / "home"), WANDB_DIR=str(tmp_path / "wandb-dir"),
             WANDB_MODE="online", WANDB_API_KEY="", WANDB_CONFIG_DIR=str(tmp_path / "cfg"))
    (tmp_path / "home").mkdir()
    (tmp_path / "wandb-dir").mkdir()
    proc = subprocess.run([*GPULENS, "record", "--sink", "mlflow", "--sink", f"jsonl:{rows}",
                           "--sink", "wandb", "--", "true"], capture_output=True, text=True,
                          env=e, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "wandb login" in proc.stderr and "WANDB_MODE=offline" in proc.stderr
    assert not rows.exists()
    assert mlflow_tracking.runs() == []
    assert not list((tmp_path / "wandb-dir").iterdir())


def test_unreachable_mlflow_is_one_line_and_nothing_is_made(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = tmp_path / "rows.jsonl"
    e = env(1)
    e["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.run([*GPULENS, "record", "--sink", f"jsonl:{rows}", "--sink", "mlflow",
                           "--", "true"], capture_output=True, text=True, env=e, timeout=120)
    assert time.monotonic() - t0 < 150  # not MLflow's minutes of retries (bounds a hang)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"cannot reach the MLflow tracking server at http://127.0.0.1:{port}" in proc.stderr
    assert not rows.exists()
