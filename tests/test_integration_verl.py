"""``MergingLogger``: a verl-style ``logger.log(data, step)`` goes through at once, and the GPU
row of each step follows as a call of its own, at the same step, only to the trackers."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpulens import Monitor
from gpulens.integrations.verl import MergingLogger, RowHandoff
from gpulens.sinks.layout import HEADLINES, TrackerLayout
from gpulens.testing import MemorySink
from tests.support.wait import wait_until
from tests.support.wandb_offline import reset_wandb
from tests.support.wandb_reader import find_run_file, read_history

ON = {"trainer": {"enable_gpu_monitoring": True, "gpu_monitor_interval": 0.05}}
GPU_KEY = "train/gpu_util_pct_mean"
"""A key of every GPU row in the trackers' view (the default key set)."""
ROW_WAIT_S = 600.0
"""``max_delay_s`` of the loggers of tests that count every row: a late row is waited for (the
calls after it queue behind it; ``log()`` never blocks), so a row is given up on only if it
never comes (``close()`` stops the monitor, which finishes every row), not because a loaded
machine starved this process or the engine for longer than the default 10 s."""


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")


def is_gpu(data: dict[str, Any]) -> bool:
    """A GPU row's call, in the default view or with every key (``GPULENS_TRACKER_KEYS=all``)."""
    return GPU_KEY in data or "gpu/0/util_pct" in data


class Recorder:
    """A tracking logger without backends that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls.append((step, dict(data)))

    def user_calls(self) -> list[tuple[int, dict[str, Any]]]:
        return [(s, d) for s, d in self.calls if not is_gpu(d)]

    def gpu_calls(self) -> list[tuple[int, dict[str, Any]]]:
        return [(s, d) for s, d in self.calls if is_gpu(d)]


class BackendTracking:
    """Like verl's ``Tracking``: named backends in ``logger``, ``log(data, step, backend=None)``
    sends to every backend, or to those named in ``backend``."""

    def __init__(self, names: list[str]) -> None:
        self.logger = {name: Recorder() for name in names}

    def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
        for name, rec in self.logger.items():
            if backend is None or name in backend:
                rec.log(data=data, step=step)


def assert_rows_follow_their_step(calls: list[tuple[int, dict[str, Any]]]) -> None:
    """A step's GPU row goes out after that step's own call and before any later step's."""
    for i, (step, data) in enumerate(calls):
        if is_gpu(data):
            assert any(s == step and not is_gpu(d) for s, d in calls[:i]), (step, calls)
            assert not any(s > step for s, _ in calls[:i]), (step, [s for s, _ in calls])


def test_calls_go_through_at_once_and_rows_follow_on_their_step() -> None:
    rec = Recorder()
    logger = MergingLogger.from_config(rec, ON, max_delay_s=ROW_WAIT_S)
    for step in range(1, 9):
        logger.log(data={"actor/loss": float(step), "gpu/0/util_pct_mine": -1.0}, step=step)
    logger.close()
    assert [s for s, _ in rec.user_calls()] == list(range(1, 9))
    assert all(d == {"actor/loss": float(s), "gpu/0/util_pct_mine": -1.0}
               for s, d in rec.user_calls())  # the trainer's call, untouched
    # the first call starts the first window; every later step gets its row, once
    assert [s for s, _ in rec.gpu_calls()] == list(range(2, 9))
    assert logger.rows_missing == 0
    for _, data in rec.gpu_calls():  # the trackers' view, not the row's own names
        assert "train/step_time_s" in data and "train/gpu_sm_active_pct_mean" in data
        assert not any(k.startswith(("gpu/", "perf/", "host/")) for k in data), sorted(data)
        assert "train/loss" not in data  # the trainer logs its own scalars
    assert_rows_follow_their_step(rec.calls)


def test_nothing_waits_for_a_later_call_when_steps_are_long() -> None:
    """verl's steps last seconds: each call goes out at once, and the row of a step goes out
    at the next call (before that step's metrics), not held back any longer."""
    rec = Recorder()
    # rows reach this process's sinks together: when this one has a step's row, so has the
    # logger's hand-off, and the step has lasted longer than its row took to be finished
    arrived = MemorySink()
    logger = MergingLogger.from_config(rec, ON, sinks=[arrived])
    for step in range(1, 5):
        time.sleep(0.05)  # the step's own work, so that its window holds GPU samples
        logger.log(data={"actor/loss": 1.0}, step=step)
        assert rec.calls[-1] == (step, {"actor/loss": 1.0})  # forwarded inside log()
        if step > 2:
            assert [s for s, _ in rec.gpu_calls()] == list(range(2, step))
        if step > 1:  # the first call starts the first window: no row of its own
            wait_until(lambda s=step: s in [r.step for r in arrived.rows], timeout=120,
                       what=f"the row of step {step} in this process")
    logger.close()
    assert [s for s, _ in rec.gpu_calls()] == [2, 3, 4]


def test_two_calls_at_one_step_do_not_stall() -> None:
    """verl's SFT trainer logs training, then validation, at the same step."""
    rec = Recorder()
    logger = MergingLogger.from_config(rec, ON, max_delay_s=ROW_WAIT_S)
    for step in range(1, 9):
        time.sleep(0.05)
        for kind in ("train", "val"):
            # the time of each call, beside one call a step: benchmarks/unit_timings.py
            logger.log(data={f"{kind}/loss": float(step)}, step=step)
    logger.close()
    users = rec.user_calls()
    assert [(s, next(iter(d))) for s, d in users] == [
        (s, f"{k}/loss") for s in range(1, 9) for k in ("train", "val")]
    assert [s for s, _ in rec.gpu_calls()] == list(range(2, 9))  # one row a step, none lost
    assert logger.rows_missing == 0
    assert_rows_follow_their_step(rec.calls)


def test_start_step_from_the_first_call_or_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed at step 100: the first row counts only the steps run since (every key:
    ``perf/steps`` is not in the default view)."""
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "all")
    rec = Recorder()
    logger = MergingLogger.from_config(rec, ON, max_delay_s=ROW_WAIT_S)
    for step in range(101, 104):
        time.sleep(0.05)
        logger.log(data={"actor/loss": 1.0}, step=step)
    logger.close()
    assert [(s, d["perf/steps"]) for s, d in rec.gpu_calls()] == [(102, 1), (103, 1)]

    rec = Recorder()
    logger = MergingLogger.from_config(rec, ON, start_step=100, max_delay_s=ROW_WAIT_S)
    for step in range(101, 104):
        time.sleep(0.05)
        logger.log(data={"actor/loss": 1.0}, step=step)
    logger.close()
    assert [(s, d["perf/steps"]) for s, d in rec.gpu_calls()] == [(101, 1), (102, 1), (103, 1)]


def test_gpu_keys_go_to_the_trackers_not_the_console() -> None:
    tracking = BackendTracking(["console", "wandb", "mlflow"])
    logger = MergingLogger.from_config(tracking, ON, max_delay_s=ROW_WAIT_S)
    for step in range(1, 5):
        time.sleep(0.05)
        logger.log(data={"actor/loss": float(step)}, step=step)
    logger.close()
    console, wandb, mlflow = (tracking.logger[n] for n in ("console", "wandb", "mlflow"))
    assert console.calls == [(s, {"actor/loss": float(s)}) for s in range(1, 5)]
    for rec in (wandb, mlflow):
        assert [s for s, _ in rec.user_calls()] == [1, 2, 3, 4]
        assert [s for s, _ in rec.gpu_calls()] == [2, 3, 4]

    tracking = BackendTracking(["console", "wandb"])
    logger = MergingLogger.from_config(tracking, ON, gpu_backends=["console"],
                                       max_delay_s=ROW_WAIT_S)
    for step in (1, 2):
        time.sleep(0.05)
        logger.log(data={"actor/loss": 1.0}, step=step)
    logger.close()
    assert [s for s, _ in tracking.logger["console"].gpu_calls()] == [2]
    assert tracking.logger["wandb"].gpu_calls() == []
    with pytest.raises(ValueError, match="not backends of this logger"):
        MergingLogger.from_config(BackendTracking(["console"]), ON, gpu_backends=["wandb"])


def test_nothing_lost_when_the_logger_is_dropped_without_close() -> None:
    """verl's fit() keeps its logger in a local variable and just returns."""
    rec = Recorder()

    def fit() -> None:
        logger = MergingLogger.from_config(rec, ON, max_delay_s=ROW_WAIT_S)
        for step in range(1, 7):
            time.sleep(0.05)
            logger.log(data={"actor/loss": 1.0}, step=step)

    fit()
    gc.collect()
    assert [s for s, _ in rec.user_calls()] == list(range(1, 7))
    assert [s for s, _ in rec.gpu_calls()] == list(range(2, 7))


FIT_THAT_RAISES = textwrap.dedent("""
    import json, sys, time
    from gpulens.integrations.verl import MergingLogger

    class FileTracking:  # a file backend and a W&B one, as verl's Tracking would have
        def __init__(self, path):
            import wandb
            self.f = open(path, "a")
            wandb.init(project="gpulens-test")
        def log(self, data, step):
            import wandb
            self.f.write(json.dumps({"step": step, **data}) + "\\n")
            self.f.flush()
            wandb.log(data, step=step)

    def fit(tracking):
        logger = MergingLogger.from_config(
            tracking, {"trainer": {"enable_gpu_monitoring": True,
                                   "gpu_monitor_interval": 0.05}})
        for step in range(1, 31):
            time.sleep(0.02)
            if step == 30:
                raise RuntimeError("boom at step 30")
            logger.log(data={"actor/loss": 1.0 / step}, step=step)

    fit(FileTracking(sys.argv[1]))
""")


def test_nothing_lost_when_fit_raises_without_close(tmp_path: Path,
                                                   wandb_offline: Path) -> None:
    """The exception keeps the logger alive in its traceback; the calls still waiting go out
    at interpreter exit, before W&B's own exit hook closes its run."""
    script, out = tmp_path / "fit.py", tmp_path / "calls.jsonl"
    script.write_text(FIT_THAT_RAISES)
    import os

    env = {**os.environ, "GPULENS_BACKEND": "simulated", "GPULENS_SIMULATED_GPUS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "boom at step 30" in proc.stderr
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["step"] for c in calls if GPU_KEY not in c] == list(range(1, 30))
    assert [c["step"] for c in calls if GPU_KEY in c] == list(range(2, 30))
    history = read_history(find_run_file(wandb_offline))
    assert [h["_step"] for h in history] == list(range(1, 30))
    assert [h["_step"] for h in history if GPU_KEY in h] == list(range(2, 30))


def test_off_passes_straight_through() -> None:
    rec = Recorder()
    logger = MergingLogger.from_config(rec, {"trainer": {"enable_gpu_monitoring": False}})
    assert logger.monitor is None
    logger.log(data={"actor/loss": 1.0}, step=1)
    assert rec.calls == [(1, {"actor/loss": 1.0})]
    logger.close()


def test_a_rank_without_a_tracker_still_monitors() -> None:
    """verl's SFT trainer (torchrun) makes ``Tracking`` on its logging rank only; the other
    ranks pass ``None`` so that their monitors start and log the same steps as rank 0's."""
    arrived = MemorySink()
    logger = MergingLogger.from_config(None, ON, sinks=[arrived], max_delay_s=ROW_WAIT_S)
    assert logger.monitor is not None
    for step in range(1, 5):
        time.sleep(0.05)
        logger.log(data={"train/loss": 1.0}, step=step)
    assert logger.monitor.running
    logger.close()
    assert not logger.monitor.running
    assert [r.step for r in arrived.rows] == [2, 3, 4]  # the monitor ran on this rank


def test_a_row_that_does_not_come_in_time_is_given_up() -> None:
    rec = Recorder()
    handoff = RowHandoff()
    logger = MergingLogger(rec, Monitor(interval=0.05, sinks=[handoff]), handoff,
                           max_delay_s=1e-9)
    for step in range(1, 5):
        logger.log(data={"actor/loss": 0.0}, step=step)
    logger.close()
    assert [s for s, _ in rec.calls] == [1, 2, 3, 4]
    assert logger.rows_missing == 3
    assert all(set(d) == {"actor/loss"} for _, d in rec.calls)


def test_handoff_must_be_among_the_monitor_sinks() -> None:
    with pytest.raises(ValueError, match="RowHandoff"):
        MergingLogger(Recorder(), Monitor(interval=0.05), RowHandoff())


def test_wandb_gets_one_record_per_step_on_the_trainer_step(wandb_offline: Path) -> None:
    import wandb

    class Tracking:  # what verl's Tracking does for its wandb backend
        def log(self, data: dict[str, Any], step: int) -> None:
            wandb.log(data=data, step=step)

    wandb.init(project="gpulens-test")
    logger = MergingLogger.from_config(Tracking(), ON, max_delay_s=ROW_WAIT_S)
    for step in range(1, 7):
        time.sleep(0.05)
        logger.log(data={"actor/loss": 1.0 / step}, step=step)
    logger.close()
    reset_wandb()
    history = read_history(find_run_file(wandb_offline))
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert all(h["actor/loss"] == pytest.approx(1.0 / h["_step"]) for h in history)
    assert [h["_step"] for h in history if GPU_KEY in h] == [2, 3, 4, 5, 6]


def test_the_first_log_starts_the_monitor_on_the_engine_process_spawned_at_wrapping() -> None:
    """verl's monitor starts at the first ``log()``, inside training: its engine process is
    spawned when the logger is wrapped, and that start takes it."""
    from gpulens.transport import spawn

    logger = MergingLogger.from_config(Recorder(), ON, max_delay_s=ROW_WAIT_S)
    spare = spawn._spare
    assert spare is not None, "wrapped, not yet started: a spare engine process waits"
    logger.log(data={"actor/loss": 1.0}, step=1)
    try:
        assert logger.monitor._transport.pid == spare.proc.pid
        assert spawn._spare is None
    finally:
        logger.close()


def test_a_wandb_sink_beside_a_wandb_backend_is_a_clear_error(wandb_offline: Path) -> None:
    """``+trainer.gpu_monitor_sinks=[wandb]`` with a ``Tracking`` whose ``wandb`` backend gets
    the GPU rows: the sink's own records would move W&B's step past the trainer's calls still
    waiting here (seen: ``actor/*`` of steps 6-12 dropped by W&B); refused before training."""
    import wandb

    class Tracking:  # verl's Tracking with its wandb and console backends
        def __init__(self) -> None:
            self.logger = {"wandb": wandb, "console": None}

        def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
            if backend is None or "wandb" in backend:
                wandb.log(data=data, step=step)

    wandb.init(project="gpulens-test")
    cfg = {"trainer": {**ON["trainer"], "gpu_monitor_sinks": ["wandb"]}}
    with pytest.raises(ValueError, match="'wandb' sink"):
        MergingLogger.from_config(Tracking(), cfg)
    # the same sink is fine where the GPU rows do not go to W&B through the logger
    logger = MergingLogger.from_config(Tracking(), cfg, gpu_backends=["console"])
    logger.close()
    reset_wandb()


def test_an_mlflow_sink_beside_an_mlflow_backend_is_a_clear_error() -> None:
    """``+trainer.gpu_monitor_sinks=[mlflow]`` with a ``Tracking`` whose ``mlflow`` backend gets
    the GPU rows: the sink would attach to the trainer's MLflow run and write every GPU figure
    a second time under its tracker view's names (review 23b); refused before training."""

    class Tracking:  # verl's Tracking with its mlflow and console backends
        def __init__(self) -> None:
            self.logger: dict[str, Any] = {"mlflow": object(), "console": None}
            self.calls: list[tuple[dict[str, Any], int]] = []

        def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
            self.calls.append((data, step))

    cfg = {"trainer": {**ON["trainer"], "gpu_monitor_sinks": ["mlflow"]}}
    with pytest.raises(ValueError, match="'mlflow' sink, but the GPU rows already go to MLflow"):
        MergingLogger.from_config(Tracking(), cfg)
    logger = MergingLogger.from_config(Tracking(), cfg, gpu_backends=["console"])
    logger.close()


@pytest.mark.parametrize("keys", [None, "all"])
def test_the_trackers_get_the_view_not_every_key(monkeypatch: pytest.MonkeyPatch,
                                                 keys: str | None) -> None:
    """verl's backends get what the ``"wandb"`` and ``"mlflow"`` sinks write: about ten
    job-level figures in ``train/`` (with 8 GPUs the row has ~265 keys, all in one W&B record
    and MLflow run otherwise, and ``perf/*`` beside verl's own ``perf/*``);
    ``GPULENS_TRACKER_KEYS=all`` gives every key under the row's names."""
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "8")
    if keys is None:
        monkeypatch.delenv("GPULENS_TRACKER_KEYS", raising=False)
    else:
        monkeypatch.setenv("GPULENS_TRACKER_KEYS", keys)
    tracking = BackendTracking(["wandb", "mlflow", "console"])
    logger = MergingLogger.from_config(tracking, ON, max_delay_s=ROW_WAIT_S)
    for step in range(1, 5):
        time.sleep(0.05)
        logger.log(data={"actor/loss": 1.0}, step=step)
    logger.close()
    rows = tracking.logger["mlflow"].gpu_calls()
    assert [s for s, _ in rows] == [2, 3, 4]
    assert rows == tracking.logger["wandb"].gpu_calls()
    assert tracking.logger["console"].gpu_calls() == []
    for _, data in rows:
        if keys is None:
            view = {TrackerLayout().name(h.name) for h in HEADLINES}
            assert set(data) <= view | {k for k in data if k.startswith("alerts/")}, sorted(data)
            assert {GPU_KEY, "train/gpu_sm_active_pct_mean"} <= set(data)
        else:
            assert {f"gpu/{i}/util_pct" for i in range(8)} <= set(data)
            assert len(data) > 200
            assert not any(k.startswith("train/") for k in data)


def test_a_bad_tracker_key_set_is_a_one_line_error_when_the_logger_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "some")
    with pytest.raises(ValueError, match="GPULENS_TRACKER_KEYS"):
        MergingLogger.from_config(Recorder(), ON)
