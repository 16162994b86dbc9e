"""Rows that really arrive in W&B (offline run file read back) and MLflow (a real server)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.sinks.mlflow import MlflowSink, mlflow_key
from gpulens.testing import SimulatedNVML
from tests.support.mlflow_server import MlflowTracking
from tests.support.wandb_reader import (
    WandbFileError,
    find_run_file,
    read_history,
    read_metric_definitions,
    wait_for_finished_run,
)


def _history_of(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The run's history, once wandb-core has written the run's exit record."""
    return read_history(wait_for_finished_run(wandb_dir, run_id))


def _train(mon: gpulens.Monitor, steps: int, dt: float = 0.05) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, learning_rate=0.1, grad_norm=3.0)


def _gpu_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpulens's rows: each carries its step (the per-GPU detail is on some rows only)."""
    return [h for h in history if "gpulens/step" in h]


def test_wandb_rows_on_their_own_step_axis(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    run.log({"custom": 1.0})  # the user's own logging goes on beside gpulens
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=2)) as mon:
        _train(mon, 5)
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    history = read_history(path)
    rows = _gpu_rows(history)
    assert [h["gpulens/step"] for h in rows] == [1, 2, 3, 4, 5]
    assert all("train/gpu_sm_active_pct_mean" in h and "train/loss" in h for h in rows)
    assert "gpu/1/sm_active_pct" in rows[0]  # the detail: at most once a second
    assert not any("train/global_step" in h for h in history)  # HF's key, never ours
    assert rows[-1]["train/loss"] == pytest.approx(0.2)
    assert history[0]["custom"] == 1.0 and history[0]["_step"] == 0
    # one row per record, and no more records than rows (+ the user's one)
    assert len(history) == 6
    defs = {d.name: d for d in read_metric_definitions(path) if d.name}
    assert defs["gpulens/step"].hidden
    # perf/step_time_s is shown as train/step_time_s, and not logged twice (01368f6)
    for key in ("gpu/0/power_w", "gpu/1/sm_active_pct", "host/cpu_pct", "perf/steps",
                "train/step_time_s", "train/loss"):
        assert defs[key].step_metric == "gpulens/step", key
    assert "perf/step_time_s" not in defs


def _user_and_gpulens(run: Any, mon: gpulens.Monitor, steps: int, *, user_step: bool,
                      user_first: bool, dt: float = 0.04) -> None:
    """A training loop that logs to W&B itself (with or without ``step=``) and to gpulens."""
    for step in range(1, steps + 1):
        time.sleep(dt)
        user = {"user/loss": 1.0 / step, "user/at": float(step)}
        if user_first:
            run.log(user, step=step) if user_step else run.log(user)
        mon.log(step, loss=1.0 / step)
        if not user_first:
            run.log(user, step=step) if user_step else run.log(user)


@pytest.mark.parametrize("user_first", [True, False], ids=["user-first", "gpulens-first"])
def test_wandb_user_logging_with_step_loses_nothing(wandb_offline: Path,
                                                    user_first: bool) -> None:
    """Issue 10: gpulens's rows must never move W&B's step past a user who passes ``step=``
    (W&B drops a log for a step below its current one)."""
    import wandb

    run = wandb.init(project="gpulens-test")
    steps = 40
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        _user_and_gpulens(run, mon, steps, user_step=True, user_first=user_first)
    run.log({"user/after": 1.0})  # logging goes on after gpulens stopped
    run_id = run.id
    wandb.finish()
    history = read_history(wait_for_finished_run(wandb_offline, run_id))
    user = [h for h in history if "user/loss" in h]
    # every one of the user's values, on the step the user gave
    assert [(h["_step"], h["user/at"]) for h in user] == [(s, s) for s in range(1, steps + 1)]
    assert all(h["user/loss"] == pytest.approx(1.0 / h["_step"]) for h in user)
    assert sum("user/after" in h for h in history) == 1
    # every gpulens row, once, with its true step, beside the loss of that step
    rows = _gpu_rows(history)
    assert sorted(h["gpulens/step"] for h in rows) == list(range(1, steps + 1))
    assert all(h["train/loss"] == pytest.approx(1.0 / h["gpulens/step"]) for h in rows)


def test_wandb_user_logging_without_step_loses_nothing(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    steps = 40
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        _user_and_gpulens(run, mon, steps, user_step=False, user_first=True)
    run_id = run.id
    wandb.finish()
    history = read_history(wait_for_finished_run(wandb_offline, run_id))
    user = [h for h in history if "user/loss" in h]
    assert [h["user/at"] for h in user] == list(range(1, steps + 1))  # all, in order
    # ... on the steps W&B gives them without gpulens: gpulens never committed a record of
    # its own in between (its rows joined the user's, or waited until the monitor stopped)
    assert [h["_step"] for h in user] == list(range(steps))
    assert sorted(h["gpulens/step"] for h in _gpu_rows(history)) == list(range(1, steps + 1))


@pytest.mark.parametrize("user_step", [True, False], ids=["step", "no-step"])
def test_wandb_rows_written_off_the_training_thread_beside_fast_user_logging(
        wandb_offline: Path, user_step: bool) -> None:
    """The W&B sink writes from the engine process, attached to the user's run (``run.log``
    costs ~1 ms of CPU per row): the training process's run never logs a gpulens row, and a
    user logging every ~3 ms on the training thread still loses nothing and every row keeps a
    record of its own."""
    import threading

    import wandb

    run = wandb.init(project="gpulens-test")
    ours: list[str] = []  # the thread of each row's run.log while the loop runs
    training = False
    real_log = run.log

    def spy(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if "gpulens/step" in data and training:
            ours.append(threading.current_thread().name)
        return real_log(data, *args, **kwargs)

    run.log = spy  # type: ignore[method-assign]
    steps = 250
    with gpulens.Monitor(interval=0.02, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        training = True
        _user_and_gpulens(run, mon, steps, user_step=user_step, user_first=True, dt=0.003)
        training = False  # stop() may write the last rows from the caller's thread
    run_id = run.id
    wandb.finish()
    assert mon.isolation == "process" and ours == [], set(ours)
    history = read_history(wait_for_finished_run(wandb_offline, run_id))
    user = [h for h in history if "user/loss" in h]
    assert [h["user/at"] for h in user] == list(range(1, steps + 1))
    expected = list(range(1, steps + 1)) if user_step else list(range(steps))
    assert [h["_step"] for h in user] == expected
    rows = _gpu_rows(history)
    assert sorted(h["gpulens/step"] for h in rows) == list(range(1, steps + 1))
    assert all(h["train/loss"] == pytest.approx(1.0 / h["gpulens/step"]) for h in rows)


def test_wandb_user_define_metric_keeps_its_axis(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    run.define_metric("user/epoch_step")
    run.define_metric("user/*", step_metric="user/epoch_step")
    run.define_metric("*", step_metric="user/epoch_step", step_sync=True)
    steps = 30
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        for step in range(1, steps + 1):
            time.sleep(0.04)
            run.log({"user/loss": 1.0 / step, "user/epoch_step": float(step)})
            mon.log(step, loss=1.0 / step)
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    history = read_history(path)
    user = [h for h in history if "user/loss" in h]
    assert [(h["user/epoch_step"], round(1 / h["user/loss"])) for h in user] == [
        (s, s) for s in range(1, steps + 1)]
    rows = _gpu_rows(history)
    assert sorted(h["gpulens/step"] for h in rows) == list(range(1, steps + 1))
    defs = {d.name: d for d in read_metric_definitions(path) if d.name}
    assert defs["gpu/0/power_w"].step_metric == "gpulens/step"
    assert "user/loss" not in defs  # the user's own definitions are left alone


def test_wandb_without_a_run_starts_and_finishes_one(wandb_offline: Path) -> None:
    import wandb

    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        _train(mon, 3)
        assert mon.isolation == "process"
        assert wandb.run is None  # the run is the engine process's: made and finished there
    assert wandb.run is None
    history = read_history(wait_for_finished_run(wandb_offline))  # the only run
    assert [h["gpulens/step"] for h in _gpu_rows(history)] == [1, 2, 3]


def test_wandb_init_after_start_is_told_the_rows_went_elsewhere(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``Monitor.start()`` before ``wandb.init()``: the engine logs into a run of its own
    (as documented), and the user's run gets no GPU row.  That used to go unsaid (two runs,
    the user's without GPU charts); now start() says it at INFO and stop() with a WARNING
    naming the user's run."""
    import wandb

    with caplog.at_level("INFO", logger="gpulens"):
        mon = gpulens.Monitor(interval=0.05, sinks=["wandb"],
                              backend=SimulatedNVML(gpus=1)).start()
        run = wandb.init(project="gpulens-test")
        for step in range(1, 4):
            time.sleep(0.05)
            run.log({"loss": 1.0 / step}, step=step)
            mon.log(step, loss=1.0 / step)
        mon.stop()
    run_id = run.id
    wandb.finish()
    assert not _gpu_rows(_history_of(wandb_offline, run_id))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any(level == "INFO" and "no W&B run is active at start()" in m for level, m in said)
    assert any(level == "WARNING" and f"not to your run {run_id}" in m for level, m in said)


def test_wandb_run_of_a_thread_engine_is_this_process(wandb_offline: Path) -> None:
    """``isolation="thread"``: the sink runs in this process, so the run it starts is
    ``wandb.run`` here, and the user's own run is written as it is (never pickled)."""
    import wandb

    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1),
                         isolation="thread") as mon:
        _train(mon, 3)
        deadline = time.monotonic() + 60
        while wandb.run is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert wandb.run is not None
        run_id = wandb.run.id
    assert wandb.run is None
    history = _history_of(wandb_offline, run_id)
    assert [h["gpulens/step"] for h in _gpu_rows(history)] == [1, 2, 3]

    run = wandb.init(project="gpulens-test")
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1),
                         isolation="thread") as mon:
        _train(mon, 3)
    run_id = run.id
    wandb.finish()
    history = _history_of(wandb_offline, run_id)
    assert [h["gpulens/step"] for h in _gpu_rows(history)] == [1, 2, 3]


@pytest.mark.parametrize("how", ["init", "env"])
def test_wandb_disabled_writes_nothing_and_says_nothing_wrong(
        how: str, wandb_offline: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``wandb.init(mode="disabled")`` (W&B switched off, a no-op run), or ``WANDB_MODE=
    disabled`` and no run (the engine's ``wandb.init()`` gets the no-op run): the sink writes
    nothing, without a warning, as W&B itself does, and says so at INFO once."""
    import wandb

    run = None
    if how == "init":
        run = wandb.init(mode="disabled")
    else:
        monkeypatch.setenv("WANDB_MODE", "disabled")
    with caplog.at_level("INFO", logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        _train(mon, 4)
        if run is not None:
            run.log({"user/loss": 1.0})
    wandb.finish()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == []
    assert "the W&B run is disabled" in caplog.text
    assert mon.sink_stats["wandb"].dropped == 0
    assert not list(wandb_offline.rglob("*.wandb"))


def test_wandb_run_finished_before_stop_is_told_and_stop_stays_bounded(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The user finishes their run while the monitor still writes to it from the engine: the
    attached run gets no answers any more (W&B's own wait is 30 s a call).  The sink waits at
    most 5 s once, says so, and counts the rows it could not write; stop() stays bounded."""
    import wandb

    run = wandb.init(project="gpulens-test")
    mon = gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1))
    mon.start()
    step, deadline = 0, time.monotonic() + 60
    while not _gpu_rows(_live_history(wandb_offline, run.id)):  # the engine has attached
        assert time.monotonic() < deadline, "no gpulens row reached the run in 60 s"
        step += 1
        time.sleep(0.05)
        run.log({"user/loss": 1.0 / step})
        mon.log(step, loss=1.0 / step)
    run_id = run.id
    wandb.finish()
    for later in range(step + 1, step + 5):
        time.sleep(0.05)
        mon.log(later, loss=1.0 / later)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="gpulens"):
        mon.stop()
    took = time.monotonic() - t0
    print("TOOK", took, "steps", step)
    assert took < 15, took
    told = " ".join(r.getMessage() for r in caplog.records)
    assert "W&B did not answer within 5 s" in told, told
    assert mon.sink_stats["wandb"].dropped >= 1, mon.sink_stats
    assert _gpu_rows(_history_of(wandb_offline, run_id))  # those written before the finish


def test_wandb_rows_beside_a_user_logging_every_step_all_land_on_their_steps(
        wandb_offline: Path) -> None:
    """A user logging every 0.1 s while the engine finishes rows in bursts: every row lands,
    on its own step, and every user record keeps its values.  How many rows find a user's
    record while training depends on the machine's load (the placer's timing is tested
    without it in ``test_wandb_run.py``); on an idle machine it is most of them."""
    import wandb

    run = wandb.init(project="gpulens-test")
    steps = 60
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        for step in range(1, steps + 1):
            time.sleep(0.1)
            run.log({"user/loss": 1.0 / step})
            mon.log(step, loss=1.0 / step)
    run_id = run.id
    wandb.finish()
    rows = _gpu_rows(_history_of(wandb_offline, run_id))
    assert sorted(h["gpulens/step"] for h in rows) == list(range(1, steps + 1))
    user = [h for h in _history_of(wandb_offline, run_id) if "user/loss" in h]
    assert [round(1 / h["user/loss"]) for h in user] == list(range(1, steps + 1))


def _live_history(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The records wandb-core has written so far (none while the file is cut mid-record)."""
    try:
        return read_history(find_run_file(wandb_dir, run_id))
    except (FileNotFoundError, WandbFileError):
        return []


def _history(tracking: MlflowTracking, run_id: str, key: str) -> list[Any]:
    return list(tracking.client().get_metric_history(run_id, key))


def test_mlflow_rows_on_training_steps(mlflow_tracking: MlflowTracking) -> None:
    import mlflow

    with mlflow.start_run() as run, gpulens.Monitor(
        interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=2)
    ) as mon:
        _train(mon, 4)
    run_id = run.info.run_id
    power = _history(mlflow_tracking, run_id, "train/gpu_power_w_mean")  # the tracker view
    assert sorted(m.step for m in power) == [1, 2, 3, 4]
    assert all(70 <= m.value <= 700 for m in power)
    loss = _history(mlflow_tracking, run_id, "train/loss")
    assert sorted((m.step, round(m.value, 4)) for m in loss) == [
        (1, 1.0), (2, 0.5), (3, 0.3333), (4, 0.25)]
    # the user's run stays the user's: still recorded as one run in this experiment
    assert len(mlflow_tracking.runs()) == 1


def test_mlflow_without_active_run_makes_one(mlflow_tracking: MlflowTracking) -> None:
    with gpulens.Monitor(interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=1)) as mon:
        _train(mon, 2)
    (run,) = mlflow_tracking.runs()
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in _history(mlflow_tracking, run.info.run_id,
                                           "train/energy_per_step_j")) == [1, 2]


def test_mlflow_key_is_valid() -> None:
    assert mlflow_key("gpu/0/power_w") == "gpu/0/power_w"
    assert mlflow_key("train/loss@top:1") == "train/loss_top_1"


# test_mlflow_server_gone_mid_run: tests/test_faults.py (one dying server for two tests)


# -- set-up errors: one line, before anything is created -------------------------------------

NO_LOGIN_SCRIPT = """
import sys
import gpulens
from gpulens.sinks.wandb import WandbSink
try:
    WandbSink().check()
except ValueError as e:
    print("check:", e)
else:
    print("check: ok")
if sys.argv[1:] == ["monitor"]:
    import os
    try:
        gpulens.Monitor(interval=0.05, sinks=["mlflow", "jsonl:" + os.environ["ROWS"],
                                               "wandb"]).start()
    except ValueError as e:
        print("start:", e)
"""


def _no_login_env(tmp_path: Path, mode: str) -> dict[str, str]:
    import os

    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_MODE=mode, WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(home / "cfg"), WANDB_SILENT="true",
               GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="1",
               ROWS=str(tmp_path / "rows.jsonl"))
    return env


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_wandb_check_says_how_to_log_in(tmp_path: Path, mode: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", NO_LOGIN_SCRIPT], capture_output=True,
                          text=True, env=_no_login_env(tmp_path, mode), timeout=240)
    assert proc.returncode == 0, proc.stderr
    if mode == "offline":
        assert proc.stdout.strip() == "check: ok"
    else:
        (line,) = proc.stdout.strip().splitlines()
        assert "wandb login" in line and "WANDB_MODE=offline" in line
    assert not (tmp_path / "wandb").exists()  # nothing made


def test_monitor_with_wandb_without_login_leaves_nothing_half_made(
        tmp_path: Path, mlflow_tracking: MlflowTracking) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", NO_LOGIN_SCRIPT, "monitor"],
                          capture_output=True, text=True,
                          env=_no_login_env(tmp_path, "online"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    start = [x for x in proc.stdout.splitlines() if x.startswith("start:")]
    assert len(start) == 1 and "wandb login" in start[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "rows.jsonl").exists()
    assert mlflow_tracking.runs() == []


def test_mlflow_check_unreachable_server_is_one_line(mlflow_tracking: MlflowTracking) -> None:
    import socket

    MlflowSink().check()  # the session's server answers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot reach the MLflow tracking server at "
                       f"http://127.0.0.1:{port}") as err:
        MlflowSink(tracking_uri=f"http://127.0.0.1:{port}").check()
    assert time.monotonic() - t0 < 60  # bounds a hang: not MLflow's minutes of retries
    assert "\n" not in str(err.value)
    assert mlflow_tracking.runs() == []


@pytest.mark.parametrize("how", ["finally", "with"])
def test_wandb_finish_in_a_crash_before_the_sink_attached_keeps_the_rows(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    """Training raises in its first steps, before the engine's W&B sink has
    attached (its open takes ~0.7 s), and the user's ``finally: wandb.finish()`` (or ``with
    wandb.init():``) finishes the run before the monitor's exit hook: the monitor stops first
    (W&B's early teardown hook), so its rows reach the run."""
    import wandb

    jsonl = wandb_offline / "rows.jsonl"
    run = wandb.init(project="gpulens-test")
    run_id = run.id
    mon = gpulens.Monitor(interval=0.05, sinks=["wandb", f"jsonl:{jsonl}"],
                          backend=SimulatedNVML(gpus=1))

    def train() -> None:
        mon.start()
        for step in range(1, 4):
            time.sleep(0.02)
            run.log({"user/loss": 1.0 / step}, step=step)
            mon.log(step, loss=1.0 / step)
        raise RuntimeError("crash at step 3")

    with caplog.at_level("INFO", logger="gpulens"), pytest.raises(RuntimeError):
        if how == "with":
            with run:
                train()
        else:
            try:
                train()
            finally:
                wandb.finish()
    history = _history_of(wandb_offline, run_id)
    assert sorted(h["gpulens/step"] for h in _gpu_rows(history)) == [1, 2, 3]
    assert [h["user/loss"] for h in history if "user/loss" in h] == [1.0, 0.5, 1 / 3]
    assert not mon.running, "the monitor is stopped inside wandb.finish()"
    told = " ".join(r.getMessage() for r in caplog.records)
    assert "the monitor stops first" in told, told
    assert mon.sink_stats["wandb"].written == 3 and mon.sink_stats["wandb"].dropped == 0
    assert len(jsonl.read_text().splitlines()) >= 3


def test_wandb_finish_without_a_crash_leaves_the_monitor_running(wandb_offline: Path) -> None:
    """The hook stops the monitor only while an exception propagates: a run finished in the
    middle of training leaves the monitor (and its other sinks) running."""
    import wandb

    wandb.init(project="gpulens-test")
    with gpulens.Monitor(interval=0.05, sinks=["jsonl:" + str(wandb_offline / "r.jsonl"),
                                               "wandb"],
                         backend=SimulatedNVML(gpus=1)) as mon:
        mon.log(1, loss=1.0)
        try:
            raise KeyError("handled before the finish")
        except KeyError:
            pass
        wandb.finish()
        assert mon.running
    assert mon.sink_stats["jsonl:" + str(wandb_offline / "r.jsonl")].written == 1
