"""The Lightning callback, for both ``lightning.pytorch`` and the standalone ``pytorch_lightning``:
real tiny ``Trainer`` and ``LightningCLI`` runs, rows read back from the CSV logger's file, a
real MLflow server on loopback and an offline W&B run file."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.jsonl import read_rows
from tests.support.mlflow_server import MlflowTracking
from tests.support.shared_run import shared_run
from tests.support.wandb_offline import reset_wandb
from tests.support.wandb_reader import find_run_file, read_history

pytestmark = pytest.mark.filterwarnings(
    # Lightning 2.6.6 with torch 2.13: a deprecation inside Lightning's own pytree helper
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
    # Lightning's hint that the tiny loaders have no workers
    "ignore:The '.*dataloader' does not have many workers:UserWarning",
    "ignore:The number of training batches .* is smaller than the logging interval:UserWarning",
)

PACKAGES = {
    "lightning": ("lightning.pytorch", "gpulens.integrations.lightning"),
    "pytorch_lightning": ("pytorch_lightning", "gpulens.integrations.pytorch_lightning"),
}
GPU_KEY = "gpu/0/util_pct"
VIEW_GPU_KEY = "gpu_util_pct_mean"  # the tracker view's key for W&B's and MLflow's loggers


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")


@pytest.fixture(params=sorted(PACKAGES))
def pkg(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """(the Lightning package, the gpulens module for it)."""
    pl_name, ours = PACKAGES[request.param]
    pl = pytest.importorskip(pl_name)
    return pl, importlib.import_module(ours)


def classes(pl: Any) -> tuple[type[Any], type[Any]]:
    """A regression module logging ``train_loss`` every step, and its data module."""

    class Regressor(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, fail_at: int = -1) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)
            self.fail_at = fail_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == self.fail_at:
                raise RuntimeError("boom")
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Points(pl.LightningDataModule):  # type: ignore[misc, name-defined]
        def __init__(self, n: int = 512, batch_size: int = 8) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(n, 8, generator=gen)
            self.data = torch.utils.data.TensorDataset(x, x.sum(-1))
            self.batch_size = batch_size

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

        def val_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.data, batch_size=64)

    return Regressor, Points


def fit(pl: Any, callback: Any, loggers: list[Any], tmp_path: Path, *, max_steps: int = 12,
        log_every: int = 4, accumulate: int = 1, fail_at: int = -1,
        val_every: int | None = None) -> Any:
    module_cls, data_cls = classes(pl)
    val: dict[str, Any] = {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    if val_every is not None:
        val = {"val_check_interval": val_every, "limit_val_batches": 2}
    trainer = pl.Trainer(
        max_steps=max_steps, log_every_n_steps=log_every, accumulate_grad_batches=accumulate,
        **val,
        logger=loggers, callbacks=[callback], accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module_cls(fail_at=fail_at), datamodule=data_cls())
    return trainer


def csv_rows(logger: Any) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def steps_with(rows: list[dict[str, str]], key: str) -> list[int]:
    return sorted({int(r["step"]) for r in rows if r.get(key)})


def test_callbacks_subclass_their_own_package(pkg: tuple[Any, Any]) -> None:
    pl, ours = pkg
    import lightning.pytorch as lp
    import pytorch_lightning as ptl

    callback = ours.GPUMonitorCallback()
    assert isinstance(callback, pl.Callback)
    other = ptl if pl is lp else lp
    assert not isinstance(callback, other.Callback)


def test_rows_reach_every_logger_on_the_module_log_steps(
    pkg: tuple[Any, Any], tmp_path: Path, mlflow_tracking: MlflowTracking
) -> None:
    pl, ours = pkg
    csv_logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    mlf_logger = pl.loggers.MLFlowLogger(experiment_name=mlflow_tracking.experiment_name,
                                         tracking_uri=mlflow_tracking.uri)
    sink = tmp_path / "gpu.jsonl"
    fit(pl, ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
        [csv_logger, mlf_logger], tmp_path, max_steps=12, log_every=4)

    rows = csv_rows(csv_logger)
    assert steps_with(rows, "train_loss") == [3, 7, 11]  # Lightning's own logging steps
    assert steps_with(rows, GPU_KEY) == [3, 7, 11]
    assert steps_with(rows, "perf/data_wait_pct") == [3, 7, 11]
    assert not any(k.startswith("train/") for k in rows[0])  # the module's metrics stay its own

    # MLflow's logger gets the tracker view: job-level figures as bare keys beside the
    # module's own train_loss, no per-GPU charts (the CSV logger above has every key)
    client = mlflow_tracking.client()
    (run,) = mlflow_tracking.runs()
    loss_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    gpu_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id,
                                                                  VIEW_GPU_KEY))
    assert loss_steps == gpu_steps == [3, 7, 11]
    assert not client.get_metric_history(run.info.run_id, GPU_KEY)

    lines = read_rows(sink)
    assert [r["step"] for r in lines] == [3, 7, 11]
    # the first row too covers the 4 optimizer steps before it (Lightning's step 3 is the 4th)
    assert [r["perf/steps"] for r in lines] == [4, 4, 4]
    # the extra sink gets the training keys Lightning gave its loggers at that step
    logged = {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}
    assert [r["train/train_loss"] for r in lines] == pytest.approx([logged[s] for s in (3, 7, 11)])
    assert all(r["train/epoch"] == 0 for r in lines)


def test_gradient_accumulation_logs_on_optimizer_steps(pkg: tuple[Any, Any],
                                                       tmp_path: Path) -> None:
    pl, ours = pkg
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    fit(pl, ours.GPUMonitorCallback(interval=0.05), [logger], tmp_path, max_steps=6,
        log_every=2, accumulate=3)
    rows = csv_rows(logger)
    assert steps_with(rows, "train_loss") == steps_with(rows, GPU_KEY) == [1, 3, 5]


def test_gpm_false_leaves_the_gpm_activity_out_of_the_rows(pkg: tuple[Any, Any],
                                                          tmp_path: Path) -> None:
    """``gpm=False``: the rows keep utilization but carry no GPM activity (the default does)."""
    pl, ours = pkg
    seen = {}
    for gpm in (True, False):
        logger = pl.loggers.CSVLogger(str(tmp_path), name=f"csv-{gpm}")
        fit(pl, ours.GPUMonitorCallback(interval=0.05, gpm=gpm), [logger], tmp_path / str(gpm),
            max_steps=8)
        rows = csv_rows(logger)
        assert steps_with(rows, GPU_KEY) == [3, 7]
        seen[gpm] = steps_with(rows, "gpu/0/sm_active_pct")
    assert seen == {True: [3, 7], False: []}


def test_validation_leaves_the_training_rows_alone(pkg: tuple[Any, Any],
                                                   tmp_path: Path) -> None:
    pl, ours = pkg
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    fit(pl, ours.GPUMonitorCallback(interval=0.05), [logger], tmp_path, max_steps=12,
        log_every=4, val_every=6)
    rows = csv_rows(logger)
    assert steps_with(rows, "val_loss") == [5, 11]
    assert steps_with(rows, "train_loss") == steps_with(rows, GPU_KEY) == [3, 7, 11]


def test_validation_inside_fit_is_no_wait_for_data(pkg: tuple[Any, Any],
                                                   tmp_path: Path) -> None:
    """Validation during fit (0.25 s a batch here, two batches every two steps) is left out of
    the data wait, as the docstring says (``trainer.training`` is False inside it, which once
    kept the wait running through it: data_wait_s ~0.25 s a step and an input_bound alert on
    a run with no input wait at all)."""
    import time

    pl, ours = pkg
    module_cls, data_cls = classes(pl)

    class SlowValidation(module_cls):  # type: ignore[misc, valid-type]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            time.sleep(0.25)
            super().validation_step(batch, batch_idx)

    sink = tmp_path / "gpu.jsonl"
    trainer = pl.Trainer(
        max_steps=8, log_every_n_steps=2, val_check_interval=2, limit_val_batches=2,
        num_sanity_val_steps=0, logger=False, accelerator="cpu", devices=1,
        callbacks=[ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path))
    trainer.fit(SlowValidation(), datamodule=data_cls())
    lines = read_rows(sink)
    assert [r["step"] for r in lines] == [1, 3, 5, 7]
    # rows 3-7 each hold a validation (0.5 s): none of it is a wait for data
    assert all(r["perf/data_wait_s"] < 0.08 for r in lines), [r["perf/data_wait_s"]
                                                              for r in lines]
    assert not any(r.get("alerts/input_bound") for r in lines)


@pytest.mark.parametrize("when", ["validation", "train-steps"])
def test_checkpoint_saves_are_no_wait_for_data(pkg: tuple[Any, Any], tmp_path: Path,
                                              when: str) -> None:
    """``ModelCheckpoint`` saves after this callback's hooks (Lightning puts it last), at
    validation's end or every N training steps; a slow disk (0.3 s a save here, a plugin's
    write) is no wait for data: the rows' ``perf/data_wait_s`` stay small (they read ~0.15 s a
    step, and input_bound could fire)."""
    import time

    pl, ours = pkg
    module_cls, data_cls = classes(pl)

    class SlowDisk(pl.plugins.TorchCheckpointIO):  # type: ignore[misc, name-defined]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.3)
            super().save_checkpoint(*args, **kwargs)

    sink = tmp_path / "gpu.jsonl"
    if when == "validation":
        saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1)
        val: dict[str, Any] = {"val_check_interval": 2, "limit_val_batches": 1}
    else:
        saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1,
                                             every_n_train_steps=2)
        val = {"limit_val_batches": 0}
    trainer = pl.Trainer(
        max_steps=8, log_every_n_steps=2, num_sanity_val_steps=0, logger=False,
        accelerator="cpu", devices=1, plugins=[SlowDisk()],
        callbacks=[ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05), saves],
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), **val)
    trainer.fit(module_cls(), datamodule=data_cls())
    assert len(list((tmp_path / "ck").iterdir())) >= 3  # the saves ran
    lines = read_rows(sink)
    assert [r["step"] for r in lines] == [1, 3, 5, 7]
    assert all(r["perf/data_wait_s"] < 0.08 for r in lines), [r["perf/data_wait_s"]
                                                              for r in lines]
    assert "save_checkpoint" not in vars(trainer)  # the trainer's own method again


def test_a_stop_set_after_this_callback_still_gets_its_row(pkg: tuple[Any, Any],
                                                           tmp_path: Path) -> None:
    """A callback after gpulens's sets ``should_stop`` at the tenth batch (as Lightning's own
    Timer does for ``max_time``): Lightning logs that batch's step although it is no logging
    step, and so does gpulens, at ``on_train_end``, with the steps since its last row."""
    pl, ours = pkg
    module_cls, data_cls = classes(pl)

    class StopAtTen(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 10:
                trainer.should_stop = True

    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    sink = tmp_path / "gpu.jsonl"
    trainer = pl.Trainer(
        max_steps=40, log_every_n_steps=4, limit_val_batches=0, num_sanity_val_steps=0,
        logger=[logger], accelerator="cpu", devices=1,
        callbacks=[ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05),
                   StopAtTen()],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path))
    trainer.fit(module_cls(), datamodule=data_cls())
    rows = csv_rows(logger)
    assert steps_with(rows, "train_loss") == steps_with(rows, GPU_KEY) == [3, 7, 9]
    lines = read_rows(sink)
    assert [(r["step"], r["perf/steps"]) for r in lines] == [(3, 4), (7, 4), (9, 2)]
    assert lines[-1]["train/train_loss"] == pytest.approx(
        float(next(r["train_loss"] for r in rows if r.get("train_loss") and r["step"] == "9")))


def test_wandb_logger_gets_rows_on_trainer_global_step(tmp_path: Path,
                                                       wandb_offline: Path) -> None:
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback

    logger = pl.loggers.WandbLogger(save_dir=str(wandb_offline), project="gpulens-test")
    fit(pl, GPUMonitorCallback(interval=0.05), [logger], tmp_path, max_steps=12, log_every=4)
    reset_wandb()
    history = read_history(find_run_file(wandb_offline))
    loss = [h["trainer/global_step"] for h in history if "train_loss" in h]
    gpu = [h["trainer/global_step"] for h in history if VIEW_GPU_KEY in h]
    assert loss == gpu == [3, 7, 11]
    assert not any(GPU_KEY in h for h in history)  # the tracker view, not every key
    assert [h["_step"] for h in history] == list(range(len(history)))


def test_tracker_keys_all_gives_the_wandb_logger_every_key(tmp_path: Path,
                                                           wandb_offline: Path) -> None:
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback

    logger = pl.loggers.WandbLogger(save_dir=str(wandb_offline), project="gpulens-test")
    fit(pl, GPUMonitorCallback(interval=0.05, tracker_keys="all"), [logger], tmp_path,
        max_steps=12, log_every=4)
    reset_wandb()
    history = read_history(find_run_file(wandb_offline))
    assert [h["trainer/global_step"] for h in history if GPU_KEY in h] == [3, 7, 11]
    assert [h["perf/steps"] for h in history if GPU_KEY in h] == [4, 4, 4]


def test_resumed_fit_counts_only_its_own_steps(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback

    module_cls, data_cls = classes(pl)
    common: dict[str, Any] = {
        "log_every_n_steps": 4, "limit_val_batches": 0, "num_sanity_val_steps": 0,
        "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
        "enable_model_summary": False, "default_root_dir": str(tmp_path), "logger": False,
    }
    first = pl.Trainer(max_steps=6, enable_checkpointing=False, **common)
    first.fit(module_cls(), datamodule=data_cls(n=48))  # 6 batches: ends with the epoch
    ckpt = tmp_path / "at6.ckpt"
    first.save_checkpoint(str(ckpt))
    sink = tmp_path / "gpu.jsonl"
    resumed = pl.Trainer(max_steps=16, enable_checkpointing=False,
                         callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)],
                         **common)
    resumed.fit(module_cls(), datamodule=data_cls(n=48), ckpt_path=str(ckpt))
    lines = read_rows(sink)
    # steps 7-8 (Lightning's 6-7), then 9-12 and 13-16
    assert [(r["step"], r["perf/steps"]) for r in lines] == [(7, 2), (11, 4), (15, 4)]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning",
                            "ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.parametrize("saved", ["every-n-train-steps", "after-validation"])
def test_a_fit_resumed_inside_an_epoch_counts_only_its_own_steps(saved: str,
                                                                  tmp_path: Path) -> None:
    """``ModelCheckpoint`` saves inside an epoch (every N training steps; after a validation
    inside the epoch) before Lightning counts the batch's step; a resumed fit's step count is
    corrected after ``on_train_start``. The first row counts only the steps it covers."""
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback

    module_cls, data_cls = classes(pl)
    common: dict[str, Any] = {
        "log_every_n_steps": 2, "num_sanity_val_steps": 0, "accelerator": "cpu",
        "devices": 1, "enable_progress_bar": False, "enable_model_summary": False,
        "default_root_dir": str(tmp_path), "logger": False,
    }
    if saved == "every-n-train-steps":
        every: dict[str, Any] = {"every_n_train_steps": 4}
        common["limit_val_batches"] = 0
    else:
        every = {"monitor": None}
        common.update(val_check_interval=4, limit_val_batches=1)
    saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{step}",
                                         save_top_k=-1, **every)
    first = pl.Trainer(max_steps=5, callbacks=[saves], **common)
    first.fit(module_cls(), datamodule=data_cls(n=80))  # 10 batches an epoch
    sink = tmp_path / "gpu.jsonl"
    resumed = pl.Trainer(max_steps=10, enable_checkpointing=False,
                         callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)],
                         **common)
    resumed.fit(module_cls(), datamodule=data_cls(n=80),
                ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    # steps 5-6 (Lightning's 4-5), 7-8, 9-10
    assert [(r["step"], r["perf/steps"]) for r in read_rows(sink)] == [(5, 2), (7, 2), (9, 2)]


def test_jsonl_rows_hold_the_training_step_metrics_only(tmp_path: Path) -> None:
    """``train/*`` of a row are the metrics Lightning logs at that training step: not a
    validation's ``val_loss`` logged steps before (``trainer.logged_metrics`` keeps it)."""
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback

    sink = tmp_path / "gpu.jsonl"
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    fit(pl, GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05), [logger], tmp_path,
        max_steps=12, log_every=2, val_every=5)
    rows = csv_rows(logger)
    assert steps_with(rows, "val_loss") == [4, 9]
    lines = read_rows(sink)
    assert [r["step"] for r in lines] == [1, 3, 5, 7, 9, 11]
    assert all("train/train_loss" in r for r in lines)
    assert [r["step"] for r in lines if "train/val_loss" in r] == []


def test_no_logger_and_no_sinks_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    """A Trainer without a logger and a callback without sinks: the rows go nowhere, and the
    user is told so (once), not left to find an empty run."""
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback
    from gpulens.log import reset_warnings

    reset_warnings()
    with caplog.at_level("WARNING", logger="gpulens"):
        fit(pl, GPUMonitorCallback(interval=0.05), [], tmp_path, max_steps=4, log_every=2)
    assert [r for r in caplog.records if "written nowhere" in r.getMessage()]


def test_the_monitor_starts_on_the_engine_process_spawned_when_fit_began(
    pkg: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``setup("fit")`` spawns a spare engine process; ``on_train_start`` starts the monitor on
    it (``gpulens.transport.spawn``) instead of waiting for a new interpreter."""
    from gpulens.transport import spawn

    pl, ours = pkg
    spares: list[int] = []
    real_prepare = spawn.prepare

    def prepare() -> bool:
        made = real_prepare()
        if spawn._spare is not None:
            spares.append(spawn._spare.proc.pid)
        return made

    monkeypatch.setattr(spawn, "prepare", prepare)
    callback = ours.GPUMonitorCallback(interval=0.05)
    seen: list[int] = []

    class Look(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, *args: Any) -> None:
            seen.append(callback.monitor._transport.pid)

    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    module_cls, data_cls = classes(pl)
    trainer = pl.Trainer(max_steps=8, log_every_n_steps=4, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=[logger], callbacks=[callback, Look()],
                         accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module_cls(), datamodule=data_cls())
    assert len(spares) == 1 and set(seen) == set(spares)
    assert spawn._spare is None
    assert steps_with(csv_rows(logger), GPU_KEY) == [3, 7]


def test_exception_stops_the_monitor(pkg: tuple[Any, Any], tmp_path: Path) -> None:
    pl, ours = pkg
    sink = tmp_path / "gpu.jsonl"
    callback = ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], to_loggers=False,
                                       interval=0.05)
    started: list[Any] = []
    original = callback.on_train_start

    def spy(trainer: Any, module: Any) -> None:
        original(trainer, module)
        started.append(callback.monitor)

    callback.on_train_start = spy
    with pytest.raises(RuntimeError, match="boom"):
        fit(pl, callback, [], tmp_path, max_steps=12, log_every=2, fail_at=7)
    (monitor,) = started
    assert not monitor.running and callback.monitor is None
    assert [r["step"] for r in read_rows(sink)] == [1, 3, 5]


def write_cli_script(tmp_path: Path, pl_name: str) -> Path:
    """A LightningCLI program (the classes of this test file, importable by path)."""
    script = tmp_path / "cli_main.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        f"import {pl_name} as pl\n"
        f"from {pl_name}.cli import LightningCLI\n"
        "from tests.test_integration_lightning import classes\n"
        "Regressor, Points = classes(pl)\n"
        "LightningCLI(Regressor, Points, save_config_callback=None)\n"
    )
    return script


CLI_TRAINER_ARGS = [
    "--trainer.max_steps=8", "--trainer.log_every_n_steps=4", "--trainer.accelerator=cpu",
    "--trainer.devices=1", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false",
]


# the two tests of one package are an xdist group: the worker that makes the launch runs both
@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.xdist_group(f"lightning-cli-{name}"))
    for name in sorted(PACKAGES)])
def cli_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``fit`` per package and session of the LightningCLI program in a new interpreter, as
    a user runs it from a shell (each launch imports torch and Lightning: ~5 s of CPU), with a
    ``GPUMonitorCallback`` added both ways a user adds one:

    * in the YAML config (``class_path`` / ``init_args``): its rows go to its JSONL sink
      ``gpu.jsonl`` only (``to_loggers: false``);
    * on the command line (``--trainer.callbacks+=...``): its rows go to the CSV logger the
      command line names (under ``logs/``), and nowhere else (no sinks).

    So the CSV logger's GPU keys come from the command-line callback alone, and the JSONL
    record from the YAML one alone. Returns the folder the program ran in."""
    name = request.param
    pl_name, ours = PACKAGES[name]
    if importlib.util.find_spec(pl_name.partition(".")[0]) is None:  # no import: ~4 s of CPU
        pytest.skip(f"{pl_name} is not installed")

    def fit(folder: Path) -> None:
        config = folder / "config.yaml"
        config.write_text(
            "trainer:\n"
            "  callbacks:\n"
            f"    - class_path: {ours}.GPUMonitorCallback\n"
            "      init_args:\n"
            "        interval: 0.05\n"
            "        to_loggers: false\n"
            f"        sinks: ['jsonl:{folder / 'gpu.jsonl'}']\n"
        )
        script = write_cli_script(folder, pl_name)
        done = subprocess.run(
            [sys.executable, str(script), "fit", f"--config={config}", *CLI_TRAINER_ARGS,
             f"--trainer.logger={pl_name}.loggers.CSVLogger",
             f"--trainer.logger.save_dir={folder / 'logs'}",
             f"--trainer.callbacks+={ours}.GPUMonitorCallback",
             "--trainer.callbacks.interval=0.05"],
            capture_output=True, text=True, timeout=240, cwd=folder,
            env=dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="1",
                     OMP_NUM_THREADS="1"))  # one intra-op thread: see run_example, test_examples
        assert done.returncode == 0, done.stderr[-4000:]

    return shared_run(tmp_path_factory, f"lightning-cli-{name}", fit)


def test_lightning_cli_adds_callback_from_command_line(cli_run: Path) -> None:
    (metrics,) = (cli_run / "logs").rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    assert steps_with(rows, "train_loss") == steps_with(rows, GPU_KEY) == [3, 7]


def test_lightning_cli_adds_callback_from_yaml(cli_run: Path) -> None:
    assert [r["step"] for r in read_rows(cli_run / "gpu.jsonl")] == [3, 7]


def test_bad_arguments_fail_at_construction() -> None:
    from gpulens.integrations.lightning import GPUMonitorCallback

    with pytest.raises(ValueError, match="interval"):
        GPUMonitorCallback(interval=-1)
    with pytest.raises(ValueError, match="backend"):
        GPUMonitorCallback(backend="nvidia")


def test_a_gpu_that_does_not_exist_stops_fit_before_any_step(
        pkg: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver answers (GPULENS_SIMULATED_GPUS=0) and the callback names GPUs 0 and 1:
    ``fit()`` raises the one-line error before the first step, and no record is made."""
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "0")
    pl, ours = pkg
    sink = tmp_path / "gpu.jsonl"
    callback = ours.GPUMonitorCallback(sinks=[f"jsonl:{sink}"], gpus=[0, 1], interval=0.05)
    with pytest.raises(ValueError, match=r"^GPU 0 does not exist: no NVIDIA driver answered"):
        fit(pl, callback, [], tmp_path)
    assert callback.monitor is None
    assert not sink.exists()


def test_a_cut_of_the_batch_work_takes_its_own_batches_later() -> None:
    """``cut()`` (a row written later): the sums so far move out, the next batches stay for
    the next take; the module's own ``tokens_per_batch`` is asked once a batch."""
    from gpulens.integrations._lightning_common import _BatchWork

    class Module:
        def tokens_per_batch(self, batch: Any) -> int:
            return int(batch["n"])

    work = _BatchWork(Module())
    work.observe({"n": 3})
    work.observe({"n": 4})
    part = work.cut()
    work.observe({"n": 10})
    work.settle()
    assert part.take_deferred() == {"tokens": 7}
    assert work.take_deferred() == {"tokens": 10}
    assert part.take_deferred() == {} and work.take_deferred() == {}


def _stopping_fit(pl: Any, ours: Any, tmp_path: Path, stopper: Any, **options: Any
                  ) -> tuple[list[int], list[int]]:
    """A fit with ``stopper`` after gpulens's callback: the steps of Lightning's own
    ``train_loss`` and of the GPU rows, from the CSV logger."""
    module_cls, data_cls = classes(pl)
    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    kwargs: dict[str, Any] = {"max_steps": 40, "log_every_n_steps": 4, "limit_val_batches": 0,
                              "num_sanity_val_steps": 0, **options}
    trainer = pl.Trainer(logger=[logger], accelerator="cpu", devices=1,
                         callbacks=[ours.GPUMonitorCallback(interval=0.05), stopper],
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path), **kwargs)
    trainer.fit(module_cls(), datamodule=data_cls())
    rows = csv_rows(logger)
    return steps_with(rows, "train_loss"), steps_with(rows, GPU_KEY)


@pytest.mark.parametrize("case", ["micro-batch", "validation-end", "min-steps"])
def test_rows_follow_lightning_whichever_hook_stops_training(case: str,
                                                             tmp_path: Path) -> None:
    """A stop Lightning logs no training metrics for (set on a gradient-accumulation micro-
    batch; in ``on_validation_end``, after Lightning logged the batch, as EarlyStopping does)
    gets no row; a stop that does not end training yet (``min_steps``), which Lightning
    logs, gets its row. The GPU rows' steps are Lightning's ``train_loss`` steps."""
    import lightning.pytorch as pl

    from gpulens.integrations import lightning as ours

    options: dict[str, Any] = {}

    class Stop(pl.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if case == "micro-batch" and trainer.global_step == 10 \
                    and trainer.fit_loop._should_accumulate():
                trainer.should_stop = True
            if case == "min-steps" and trainer.global_step == 5:
                trainer.should_stop = True

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if case == "validation-end" and trainer.global_step >= 10:
                trainer.should_stop = True

    if case == "micro-batch":
        options = {"accumulate_grad_batches": 2}
    elif case == "validation-end":
        options = {"val_check_interval": 5, "limit_val_batches": 1}
    else:
        options = {"min_steps": 10}
    train, gpu = _stopping_fit(pl, ours, tmp_path, Stop(), **options)
    assert train and gpu == train


class _Logger:
    """A Lightning logger's ``log_metrics`` / ``save``, recording what it got; ``fail``: an
    exception its first call for each of these steps raises."""

    def __init__(self, fail: dict[int, BaseException] | None = None) -> None:
        self.got: list[int] = []
        self.fail = dict(fail or {})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step in self.fail:
            raise self.fail.pop(step)
        self.got.append(step)

    def save(self) -> None:
        pass


@pytest.mark.parametrize("fault", [ConnectionError("down"), KeyboardInterrupt()])
def test_a_row_one_logger_refused_is_retried_only_there(fault: BaseException) -> None:
    """Two loggers, the second raises at a row (a tracker down; a Ctrl-C inside its write):
    the row is written again, as the writer retries it, to the second only: the first never
    gets a step twice. The sink names its loggers in warnings."""
    from gpulens.integrations._lightning_common import LoggersSink
    from gpulens.model import Row
    from gpulens.sinks import sink_label

    first, second = _Logger(), _Logger(fail={7: fault})
    sink = LoggersSink([first, second])
    rows = [Row(step=s, time=float(s), values={"gpu/0/util_pct": 50.0}) for s in (3, 7)]
    sink.write(rows[0])
    with pytest.raises(type(fault)):
        sink.write(rows[1])
    sink.write(rows[1])  # the retry
    assert first.got == second.got == [3, 7]
    assert sink_label(sink) == "Lightning loggers (_Logger, _Logger)"


def test_subclasses_of_the_tracker_loggers_get_the_tracker_view() -> None:
    """A subclass of W&B's or MLflow's logger (a common way to set defaults) gets the tracker
    view like the class itself; other loggers get every key."""
    from gpulens.integrations._lightning_common import LoggersSink
    from gpulens.model import Row

    class WandbLogger(_Logger):
        pass

    class MyWandbLogger(WandbLogger):
        pass

    class CSVLogger(_Logger):
        pass

    got: dict[str, list[dict[str, float]]] = {}
    loggers = [MyWandbLogger(), CSVLogger()]
    for lg in loggers:
        def log_metrics(metrics: dict[str, float], step: int, name: str = type(lg).__name__
                        ) -> None:
            got.setdefault(name, []).append(metrics)
        lg.log_metrics = log_metrics  # type: ignore[method-assign]
    sink = LoggersSink(loggers)
    sink.write(Row(step=3, time=0.0, values={GPU_KEY: 50.0, "perf/step_time_s": 0.1}))
    assert GPU_KEY in got["CSVLogger"][0]
    assert GPU_KEY not in got["MyWandbLogger"][0] and VIEW_GPU_KEY in got["MyWandbLogger"][0]


def test_wandb_and_mlflow_loggers_get_the_run_metadata_and_the_alerts(
        tmp_path: Path, wandb_offline: Path, mlflow_tracking: MlflowTracking,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the W&B and MLflow sinks give their runs, through Lightning's own loggers: the
    run's metadata (W&B config "gpulens", MLflow params ``gpulens.*``), the W&B tag
    ``simulated-gpus`` for simulated GPUs, and each alert (W&B ``run.alert``, MLflow tag
    ``gpulens.alert.<rule>``, firing then resolved). Before, they got rows only."""
    import time

    import lightning.pytorch as pl

    from gpulens.integrations._lightning_common import LoggersSink
    from gpulens.model import Event, GpuInfo, Row, RunContext
    from tests.support.wandb_reader import read_alerts, read_config, read_tags

    wandb_logger = pl.loggers.WandbLogger(save_dir=str(wandb_offline), project="gpulens-test")
    mlf_logger = pl.loggers.MLFlowLogger(experiment_name=mlflow_tracking.experiment_name,
                                         tracking_uri=mlflow_tracking.uri)
    context = RunContext(gpus=(GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-0",
                                       pci_bus_id="0:0"),),
                         hostname="node-1", backend="simulated", interval=0.5, meta={})

    def alert(state: str, step: int) -> Event:
        return Event(kind="alert", name="input_bound", state=state, step=step,
                     time=time.time(), severity="warning", message="data wait 41 %",
                     advice="more DataLoader workers")

    import threading

    from gpulens.sinks import mlflow as mlflow_sink
    from gpulens.sinks import wandb_run

    threads: list[str] = []  # where the network calls run: never the training thread

    def spy(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)
        return call

    for module, name in ((mlflow_sink, "write_run_params"), (mlflow_sink, "alert_tags"),
                         (wandb_run, "write_run_metadata"), (wandb_run, "send_alert")):
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    sink = LoggersSink([wandb_logger, mlf_logger])
    sink.open(context)
    for step, events in ((1, ()), (2, (alert("firing", 2),)), (3, ()),
                         (4, (alert("resolved", 4),))):
        sink.write(Row(step=step, time=time.time(),
                       values={GPU_KEY: 50.0, "alerts/input_bound": float(step in (2, 3))},
                       events=events))
    sink.close()
    # metadata twice, one W&B alert, MLflow tags for the firing and the resolved row
    assert len(threads) == 5 and set(threads) == {"gpulens-lightning-extras"}, threads
    run_id = wandb_logger.experiment.id
    reset_wandb()
    path = find_run_file(wandb_offline, run_id)
    assert read_config(path)["gpulens"]["backend"] == "simulated"
    assert "simulated-gpus" in read_tags(path)
    assert [(a.title, a.text) for a in read_alerts(path)] == [
        ("gpulens: input_bound", "Step 2: data wait 41 % Try: more DataLoader workers")]

    client = mlflow_tracking.client()
    data = client.get_run(mlf_logger.run_id).data
    assert data.params["gpulens.backend"] == "simulated"
    assert data.tags["gpulens.alert.input_bound"].startswith("resolved at step 4 (fired at "
                                                             "step 2: data wait 41 %")


def test_a_fit_that_fails_before_training_ends_the_spare_it_made(tmp_path: Path) -> None:
    """``configure_optimizers`` raises: the spare engine process made at ``setup("fit")`` is
    ended at ``teardown``, not left idling until its retirement (9 minutes) or the exit."""
    import lightning.pytorch as pl

    from gpulens.integrations.lightning import GPUMonitorCallback
    from gpulens.transport import spawn

    module_cls, data_cls = classes(pl)

    class NoOptimizer(module_cls):  # type: ignore[misc, valid-type]
        def configure_optimizers(self) -> torch.optim.Optimizer:
            raise RuntimeError("no optimizer")

    made: list[Any] = []
    real_prepare = spawn.prepare

    def prepare() -> bool:
        done = real_prepare()
        made.append(spawn._spare)
        return done

    trainer = pl.Trainer(max_steps=4, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, callbacks=[GPUMonitorCallback(interval=0.05)],
                         accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spawn, "prepare", prepare)
        with pytest.raises(RuntimeError, match="no optimizer"):
            trainer.fit(NoOptimizer(), datamodule=data_cls())
    assert made and made[0] is not None  # setup("fit") made one
    assert spawn._spare is None
    made[0].proc.wait(timeout=30)  # and it ends
