"""``MergingLogger``: GPU rows merged into a verl-style ``logger.log(data, step)`` call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpulens import Monitor
from gpulens.integrations.verl import MergingLogger, RowHandoff
from tests.support.wandb_offline import reset_wandb
from tests.support.wandb_reader import find_run_file, read_history

ON = {"trainer": {"enable_gpu_monitoring": True, "gpu_monitor_interval": 0.05}}


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")


class Recorder:
    """A tracking logger that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls.append((step, data))


def test_each_step_logged_once_in_order_with_its_gpu_row() -> None:
    rec = Recorder()
    logger = MergingLogger.from_config(rec, ON)
    for step in range(1, 9):
        logger.log(data={"actor/loss": float(step), "gpu/0/util_pct": -1.0}, step=step)
    logger.close()
    assert [s for s, _ in rec.calls] == list(range(1, 9))
    assert logger.rows_missing == 0
    for step, data in rec.calls:
        assert data["actor/loss"] == float(step)
        assert data["gpu/0/util_pct"] == -1.0  # the trainer's own key wins on a clash
        assert "gpu/0/power_w" in data and "perf/step_time_s" in data
        assert not any(k.startswith("train/") for k in data)


def test_off_passes_straight_through() -> None:
    rec = Recorder()
    logger = MergingLogger.from_config(rec, {"trainer": {"enable_gpu_monitoring": False}})
    assert logger.monitor is None
    logger.log(data={"actor/loss": 1.0}, step=1)
    assert rec.calls == [(1, {"actor/loss": 1.0})]
    logger.close()


def test_a_row_that_does_not_come_in_time_is_given_up() -> None:
    rec = Recorder()
    handoff = RowHandoff()
    logger = MergingLogger(rec, Monitor(interval=0.05, sinks=[handoff]), handoff,
                           max_delay_s=1e-9)
    for step in range(1, 5):
        logger.log(data={"actor/loss": 0.0}, step=step)
    logger.close()
    assert [s for s, _ in rec.calls] == [1, 2, 3, 4]
    assert logger.rows_missing == 4
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
    logger = MergingLogger.from_config(Tracking(), ON)
    for step in range(1, 7):
        logger.log(data={"actor/loss": 1.0 / step}, step=step)
    logger.close()
    reset_wandb()
    history = read_history(find_run_file(wandb_offline))
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert all("actor/loss" in h and "gpu/0/util_pct" in h for h in history)
