"""How training ended reaches the tracker run gpulens began itself (no run was active at
start): MLflow's status ``FINISHED``, ``FAILED`` (training raised) or ``KILLED`` (Ctrl-C, or the
training process vanished), read back from a real MLflow server.  A run the user began is
theirs to end, and is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.finalizers import exit_outcome
from gpulens.model import outcome_of
from gpulens.testing import SimulatedNVML
from tests.support.mlflow_server import MlflowTracking
from tests.support.wait import wait_until
from tests.support.wandb_reader import read_exit_code, read_history, wait_for_finished_run


def _train(mon: gpulens.Monitor, steps: int) -> None:
    for step in range(1, steps + 1):
        time.sleep(0.05)
        mon.log(step, loss=1.0 / step)


def _steps(tracking: MlflowTracking, run_id: str) -> list[int]:
    history = tracking.client().get_metric_history(run_id, "train/energy_per_step_j")
    return sorted(m.step for m in history)


@pytest.mark.parametrize("isolation", ["process", "thread"])
@pytest.mark.parametrize(("raised", "status"), [
    (None, "FINISHED"), (RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_a_with_block_ends_gpulens_own_mlflow_run_as_training_ended(
        mlflow_tracking: MlflowTracking, isolation: str, raised: BaseException | None,
        status: str) -> None:
    try:
        with gpulens.Monitor(interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=1),
                             isolation=isolation) as mon:
            _train(mon, 2)
            if raised is not None:
                raise raised
    except (RuntimeError, KeyboardInterrupt) as exc:
        assert exc is raised
    (run,) = mlflow_tracking.runs()
    assert run.info.status == status
    assert _steps(mlflow_tracking, run.info.run_id) == [1, 2]  # the rows, as before


@pytest.mark.parametrize(("raised", "code"), [(None, 0), (RuntimeError("boom"), 1)])
def test_a_with_block_ends_gpulens_own_wandb_run_with_an_exit_code(
        wandb_offline: Path, raised: BaseException | None, code: int) -> None:
    """No W&B run at start: the engine's own, finished at stop with exit code 1 where
    training raised (W&B shows it failed), 0 else."""
    try:
        with gpulens.Monitor(interval=0.05, sinks=["wandb"],
                             backend=SimulatedNVML(gpus=1)) as mon:
            _train(mon, 2)
            if raised is not None:
                raise raised
    except RuntimeError as exc:
        assert exc is raised
    path = wait_for_finished_run(wandb_offline)
    assert read_exit_code(path) == code
    assert [h["gpulens/step"] for h in read_history(path) if "gpulens/step" in h] == [1, 2]


def test_a_users_own_mlflow_run_is_left_to_the_user(mlflow_tracking: MlflowTracking) -> None:
    import mlflow

    with pytest.raises(RuntimeError, match="boom"), mlflow.start_run() as run:
        with gpulens.Monitor(interval=0.05, sinks=["mlflow"],
                             backend=SimulatedNVML(gpus=1)) as mon:
            _train(mon, 2)
            raise RuntimeError("boom")
        assert mlflow.get_run(run.info.run_id).info.status == "RUNNING"
    assert mlflow.get_run(run.info.run_id).info.status == "FAILED"  # MLflow's own doing


SCRIPT = """
import os, sys, time
import gpulens
from gpulens.testing import SimulatedNVML
from mlflow import MlflowClient

mon = gpulens.Monitor(interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=1)).start()
for step in (1, 2):
    time.sleep(0.05)
    mon.log(step, loss=1.0)
# the engine opened its MLflow sink (a run of its own): on a loaded machine importing MLflow
# there can take longer than the 2 s a monitor left running gets at exit
client = MlflowClient()
while not client.search_runs([client.get_experiment_by_name(
        os.environ["MLFLOW_EXPERIMENT_NAME"]).experiment_id]):
    time.sleep(0.1)
print("logged", flush=True)
{end}
"""


def _run_script(folder: Path, end: str,
                tracking: MlflowTracking) -> subprocess.CompletedProcess[str]:
    script = folder / "train.py"
    script.write_text(SCRIPT.format(end=textwrap.dedent(end)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking.uri,
           "MLFLOW_EXPERIMENT_NAME": tracking.experiment_name}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=folder)


@pytest.mark.parametrize(("end", "code", "status"), [
    ("", 0, "FINISHED"),                                   # a script that never calls stop()
    ("raise RuntimeError('boom')", 1, "FAILED"),           # ... and ends on an exception
    ("raise KeyboardInterrupt", 130, "KILLED"),            # ... or on Ctrl-C
    ("try:\n    raise RuntimeError('caught')\nexcept RuntimeError:\n    pass", 0, "FINISHED"),
])
def test_a_script_that_ends_without_stop_ends_the_run_as_the_script_did(
        tmp_path: Path, mlflow_tracking: MlflowTracking, end: str, code: int,
        status: str) -> None:
    """The monitor's exit hook stops it; Python has set ``sys.last_value`` by then where the
    script ends on an exception nobody caught (not for one that was caught)."""
    proc = _run_script(tmp_path, end, mlflow_tracking)
    assert proc.returncode in (code, -signal.SIGINT), proc.stderr
    runs = mlflow_tracking.runs()
    assert len(runs) == 1, proc.stderr
    (run,) = runs
    assert run.info.status == status, proc.stderr
    assert _steps(mlflow_tracking, run.info.run_id) == [1, 2]


def test_a_training_process_killed_leaves_its_run_killed_not_running(
        tmp_path: Path, mlflow_tracking: MlflowTracking) -> None:
    """SIGKILL (the OOM killer, a scheduler's kill): no exit hook runs; the engine process sees
    the training process gone, writes what it holds and ends the run ``KILLED``."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(end="time.sleep(120)"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_tracking.uri,
           "MLFLOW_EXPERIMENT_NAME": mlflow_tracking.experiment_name}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "logged"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    def ended() -> Any:
        runs = mlflow_tracking.runs()
        return runs[0] if runs and runs[0].info.status != "RUNNING" else None

    run = wait_until(ended, timeout=60, what="the engine to end the run")
    assert run.info.status == "KILLED"
    assert _steps(mlflow_tracking, run.info.run_id) == [1, 2]


def test_outcome_of_an_exception() -> None:
    assert outcome_of(None) == "finished"
    assert outcome_of(ValueError()) == "failed"
    assert outcome_of(KeyboardInterrupt()) == "killed"
    # SystemExit is the exit status: 0 (or none) is a success, as the shell and W&B see it
    assert outcome_of(SystemExit()) == "finished"
    assert outcome_of(SystemExit(0)) == "finished"
    assert outcome_of(SystemExit(3)) == "failed"
    assert outcome_of(SystemExit("a message")) == "failed"


@pytest.mark.parametrize(("code", "status"), [(0, "FINISHED"), (3, "FAILED")])
def test_sys_exit_in_a_with_block_ends_the_run_as_its_exit_status(
        mlflow_tracking: MlflowTracking, code: int, status: str) -> None:
    """``sys.exit(0)`` in the loop (done early, on purpose) is no failure: the process exits 0."""
    with pytest.raises(SystemExit), gpulens.Monitor(
            interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=1),
            isolation="thread") as mon:
        _train(mon, 2)
        sys.exit(code)
    (run,) = mlflow_tracking.runs()
    assert run.info.status == status
    assert _steps(mlflow_tracking, run.info.run_id) == [1, 2]


def test_exit_outcome_is_finished_where_last_value_is_an_earlier_error_shown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In an interactive session ``sys.last_value`` holds any earlier error shown."""
    monkeypatch.setattr(sys, "last_value", RuntimeError("an earlier cell"), raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert exit_outcome() == "failed"
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert exit_outcome() == "finished"


@pytest.mark.filterwarnings(
    # as in tests/test_integration_lightning.py: Lightning's own, with these versions
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
    "ignore:The '.*dataloader' does not have many workers:UserWarning")
def test_lightning_fit_that_raises_ends_gpulens_own_run_failed(
        tmp_path: Path, mlflow_tracking: MlflowTracking,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_exception`` stops the monitor as failed; a ``fit()`` that ends well, finished."""
    pl = pytest.importorskip("lightning.pytorch")
    from gpulens.integrations.lightning import GPUMonitorCallback
    from tests.test_integration_lightning import fit

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    for fail_at in (5, -1):
        callback = GPUMonitorCallback(sinks=["mlflow"], to_loggers=False, interval=0.05)
        if fail_at < 0:
            fit(pl, callback, [], tmp_path, max_steps=8, log_every=2)
        else:
            with pytest.raises(RuntimeError, match="boom"):
                fit(pl, callback, [], tmp_path, max_steps=8, log_every=2, fail_at=fail_at)
    runs = sorted(mlflow_tracking.runs(), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert _steps(mlflow_tracking, runs[0].info.run_id) == [1, 3]


def test_hf_train_that_raised_ends_its_run_failed_at_the_next_train_or_collection(
        tmp_path: Path, mlflow_tracking: MlflowTracking,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face has no exception hook: a ``train()`` that raised leaves the monitor
    running until the next ``train()`` begins (or the callback is collected), which ends the
    failed one's run ``FAILED``."""
    import gc

    from gpulens.integrations.transformers import GPUMonitorCallback
    from tests.test_integration_transformers import Regression, make_trainer

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    callback = GPUMonitorCallback(sinks=["mlflow"], interval=0.05)
    model = Regression(fail_at=5)
    trainer = make_trainer(tmp_path, callback, model=model, max_steps=8, logging_steps=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    model.fail_at = None
    trainer.train()  # the same Trainer again, as in a notebook
    second = GPUMonitorCallback(sinks=["mlflow"], interval=0.05)
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(tmp_path, second, model=Regression(fail_at=3), max_steps=8,
                     logging_steps=2).train()
    del second
    gc.collect()
    runs = sorted(mlflow_tracking.runs(), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED", "FAILED"]
    assert _steps(mlflow_tracking, runs[0].info.run_id) == [2, 4]


def test_hf_mlflow_run_gpulens_started_for_a_train_that_raised_ends_failed(
        tmp_path: Path, mlflow_tracking: MlflowTracking,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``report_to="mlflow"``: Hugging Face starts a run for the first ``train()`` only, the
    callback one for a later call.  That call raising, and no ``train()`` after it, its run
    ends ``FAILED`` when the callback is collected (or at exit), not ``FINISHED`` by MLflow's
    own exit hook, nor left ``RUNNING``."""
    import gc

    from gpulens.integrations.transformers import GPUMonitorCallback
    from tests.test_integration_transformers import Regression, make_trainer

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")  # HF's run ends at once
    callback = GPUMonitorCallback(sinks=["mlflow"], interval=0.05)
    model = Regression()
    trainer = make_trainer(tmp_path, callback, model=model, report_to="mlflow", max_steps=4,
                           logging_steps=2)
    trainer.train()
    model.fail_at = model.calls + 3
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    del trainer, callback
    gc.collect()
    runs = sorted(mlflow_tracking.runs(), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
