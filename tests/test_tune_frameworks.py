"""``tune_trainer`` (Hugging Face) and ``tune_lightning`` end to end on a CPU, with tiny models
built in code whose step costs are set by the test: each finds the batch size past which a
step gets slower per sample and the loader worker count that brings the data wait under 5 %,
writes them back, and leaves the training as it found it."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gpulens.tune import Config

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings(  # Lightning 2.6.6 on torch 2.13, as in its own tests
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
    "ignore:The number of training batches .* is smaller than the logging interval:UserWarning",
)

from gpulens.tune.hf import tune_trainer  # noqa: E402
from gpulens.tune.lightning import tune_lightning  # noqa: E402


@pytest.fixture(autouse=True)
def _cheap_gc() -> Iterator[None]:
    """The Trainer collects Python's garbage at every ``train()`` (accelerate's
    ``free_memory``): 1-2 s in this test process, which holds every framework. Freezing what
    exists now leaves each collection only the objects made since."""
    gc.freeze()
    yield
    gc.unfreeze()


SIZES = (4, 8, 16, 32)
LOAD_S = 0.002  # per sample, one sleep per batch (32 ms at batch 16, in the main process
# without a worker)
FAST = {"warmup_steps": 1, "steps": 3, "loader_options": False, "confirm": False,
        "progress": False}


def step_cost(b: int) -> float:
    """30 ms + 1 ms/sample up to 16 samples, 5 ms/sample beyond: 32 is half as fast per
    sample (wide margins: a framework adds its own milliseconds per step, and the machine
    may be loaded)."""
    return 0.03 + (0.001 * b if b <= 16 else 0.005 * b)


class Samples(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 1024) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i].sum()}

    def __getitems__(self, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        time.sleep(LOAD_S * len(idx))
        return [self[i] for i in idx]


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(step_cost(int(x.shape[0])))
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


def hf_trainer(tmp_path: Path, model: nn.Module, dataset: Any, batch: int = 4,
               **args: Any) -> Any:
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=batch,
        learning_rate=1e-2, report_to="none", use_cpu=True, disable_tqdm=True,
        save_strategy="no", **args)
    return transformers.Trainer(model=model, args=targs, train_dataset=dataset)


def test_hf_trainer(tmp_path: Path) -> None:
    model = Regression()
    trainer = hf_trainer(tmp_path, model, Samples())
    callbacks = list(trainer.callback_handler.callbacks)
    collator = trainer.data_collator
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = tune_trainer(trainer, batch_sizes=SIZES, workers=(0, 1), **FAST)
    seen = [(t.config.batch_size, t.config.num_workers, t.data_wait_pct, t.samples_per_s)
            for t in result.trials]
    # on a CPU the data wait also holds the Trainer's own work between steps, so it does not
    # fall under 5 % here: the worker sweep ends because the grid does (one worker helped)
    assert result.chosen is not None and result.chosen.config == Config(16, 1), seen
    assert result.current is result.trials[0] and result.current.config == Config(4, 0)
    assert (result.speedup_pct or 0) > 0
    at32 = result.best_at(32)
    assert at32 is not None and at32.throughput < result.chosen.throughput
    # with a worker, the Trainer's loader was watched: its gaps between batches are at least
    # the worker's sleep for one batch
    for t in (t for t in result.trials if t.ok and t.config.num_workers == 1):
        assert t.loader_batch_s is not None and t.loader_batch_s >= LOAD_S * t.config.batch_size
    # the choice is in the Trainer's arguments; the rest is as it was (the collator too)
    assert trainer.data_collator is collator
    args = trainer.args
    assert (args.per_device_train_batch_size, args.dataloader_num_workers) == (16, 1)
    assert args.max_steps == 20 and trainer.callback_handler.callbacks == callbacks
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    assert trainer.get_train_dataloader().total_batch_size == 16
    trainer.args.max_steps = 2
    assert trainer.train().global_step == 2


def test_hf_accumulation_with_workers_that_keep_up_keeps_the_timed_wait(tmp_path: Path) -> None:
    """Three micro-batches of 8 a step (``global_batch=24``) from two workers at 16 ms a batch,
    against ~40 ms a micro-batch: the loader keeps up. The Trainer fetches a step's
    micro-batches back to back, so a worker's gaps between batches are 16 ms or a step or two;
    the workers' pace must read the 16 ms (a median read ~105 ms and a 25 % wait), and the
    window's own wait stands."""
    trainer = hf_trainer(tmp_path, Regression(), Samples(4096), batch=8,
                         dataloader_num_workers=2)
    result = tune_trainer(trainer, batch_sizes=(8,), workers=(2,), global_batch=24,
                          warmup_steps=2, steps=10, loader_options=False, confirm=False,
                          progress=False)
    ran = [t for t in result.trials if t.ok]
    assert ran and all(t.config.accumulation == 3 and t.config.num_workers == 2 for t in ran)
    for t in ran:
        seen = (t.data_wait_pct, t.data_wait_by, t.loader_batch_s)
        assert t.loader_batch_s is not None and t.loader_batch_s < 0.06, seen
        assert t.data_wait_by == "window", seen


class SlowFirstStep(Regression):
    """The first forward takes ``first_s`` (a compile, a slow rank: the sweep's one trial
    begins with it); the others ``step_s``."""

    def __init__(self, first_s: float, step_s: float) -> None:
        super().__init__()
        self.first_s, self.step_s, self.calls = first_s, step_s, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        time.sleep(self.first_s if self.calls == 1 else self.step_s)
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


@pytest.mark.parametrize("persistent", [False, True])
def test_hf_a_short_window_after_a_slow_warm_up_reads_the_loaders_pace(
        tmp_path: Path, persistent: bool) -> None:
    """Two workers at 8 x 20 ms = 160 ms a batch (80 ms a step from the two), 40 ms steps, a
    first step of 1 s: the workers fill their queue, and a 3-step window eats it without
    waiting. The workers' service times read ~160 ms a batch and the trial takes the wait
    the pace imposes (~50 %). With persistent workers the accelerator keeps the loader after
    ``train()``: the trial ends its workers (each finishes the batch it began, which then
    counts), and none outlives the sweep."""
    model = SlowFirstStep(first_s=1.0, step_s=0.04)
    trainer = hf_trainer(tmp_path, model, SlowSamples(), batch=8, dataloader_num_workers=2,
                         dataloader_persistent_workers=persistent)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    result = tune_trainer(trainer, batch_sizes=(8,), workers=(2,), warmup_steps=1, steps=3,
                          loader_options=False, confirm=False, progress=False)
    (trial,) = [t for t in result.trials if t.ok]
    seen = (trial.data_wait_pct, trial.data_wait_by, trial.loader_batch_s)
    assert trial.data_wait_by == "loader pace", seen
    assert trial.loader_batch_s is not None and 0.16 <= trial.loader_batch_s < 0.4, seen
    assert trial.data_wait_pct is not None and trial.data_wait_pct > 30, seen
    left = [c for c in psutil.Process().children(recursive=True)
            if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, [c.cmdline() for c in left]


class SlowSamples(Samples):
    """20 ms a sample."""

    def __getitems__(self, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        time.sleep(0.02 * len(idx))
        return [self[i] for i in idx]


def test_hf_model_counts_tokens_and_flops(tmp_path: Path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64,
                                     vocab_size=128, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (256, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    trainer = hf_trainer(tmp_path, model, dataset)
    result = tune_trainer(trainer, batch_sizes=(4,), workers=(0,), **FAST)
    assert len(result.trials) == 1  # the current setting is the one configuration
    for t in result.trials:
        assert t.ok and t.samples_per_s is not None and t.tokens_per_s is not None
        assert t.tokens_per_s == pytest.approx(16 * t.samples_per_s)
        assert t.tflops is not None and t.tflops > 0
        assert t.mfu_pct is None  # no peak on a CPU


class Module(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(step_cost(int(batch["x"].shape[0])))
        return nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Data(pl.LightningDataModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4
        self.num_workers = 0

    def setup(self, stage: str) -> None:
        self.train = Samples()

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train, batch_size=self.batch_size, num_workers=self.num_workers,
                          shuffle=True, drop_last=True)


def pl_trainer() -> Any:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False)


def test_lightning_with_datamodule_attributes() -> None:
    model, dm, trainer = Module(), Data(), pl_trainer()
    result = tune_lightning(trainer, model, datamodule=dm, batch_sizes=SIZES, workers=(0, 1),
                            **FAST)
    seen = [(t.config.batch_size, t.config.num_workers, t.data_wait_pct, t.samples_per_s)
            for t in result.trials]
    assert result.chosen is not None and result.chosen.config == Config(16, 1), seen
    assert result.current is not None and result.current.config == Config(4, 0)
    assert (dm.batch_size, dm.num_workers) == (16, 1)  # written back, as Tuner does
    assert trainer.global_step == 0  # your Trainer was not fitted
    for t in (t for t in result.trials if t.ok):
        assert t.forward_backward_pct is not None and t.optimizer_pct is not None
        # your train_dataloader()'s loader was watched where it had a worker
        watched = t.loader_batch_s is not None and t.loader_batch_s >= LOAD_S * t.config.batch_size
        assert watched == (t.config.num_workers == 1), seen
    assert "train_dataloader" not in vars(dm)  # the watch is gone


def test_lightning_watch_puts_a_kept_loaders_collate_back() -> None:
    """A ``train_dataloader()`` that returns the same loader every time: each trial's watch
    wraps its own collate function, not the last trial's wrapper, and puts it back after."""
    from gpulens.tune.lightning import _watched
    from gpulens.tune.model import TuneSettings
    from gpulens.tune.pace import TimedCollate
    from gpulens.tune.trial import Recorder, TrialContext

    class Keeper:
        def __init__(self) -> None:
            self.loader = DataLoader(Samples(64), batch_size=8, num_workers=1)
            self.original = self.loader.collate_fn

        def train_dataloader(self) -> DataLoader[Any]:
            return self.loader

    keeper = Keeper()
    for _ in range(2):
        rec = Recorder(Config(8, 1), TuneSettings(), TrialContext())
        with _watched(keeper, Config(8, 1), rec):
            collate = keeper.train_dataloader().collate_fn
            assert isinstance(collate, TimedCollate) and collate.collate is keeper.original
            # as Lightning records an assignment made inside its hook, to replay it on a
            # loader it re-creates
            record = [(("collate_fn", collate), "__setattr__")]
            keeper.loader.__dict__["__pl_attrs_record"] = record
        assert keeper.loader.collate_fn is keeper.original
        assert "train_dataloader" not in vars(keeper)
        assert keeper.loader.__dict__["__pl_attrs_record"] == []  # no wrapper left to replay

    class Several(Keeper):  # a dict of loaders (Lightning combines them): not watched
        def train_dataloader(self) -> Any:  # type: ignore[override]
            return {"a": self.loader, "b": self.loader}

    several = Several()
    rec = Recorder(Config(8, 1), TuneSettings(), TrialContext())
    with _watched(several, Config(8, 1), rec):
        assert several.train_dataloader() == {"a": several.loader, "b": several.loader}
    assert several.loader.collate_fn is several.original


def test_lightning_with_a_dataloader_is_rebuilt() -> None:
    model, trainer = Module(), pl_trainer()
    loader = DataLoader(Samples(), batch_size=8, shuffle=True, drop_last=True)
    result = tune_lightning(trainer, model, train_dataloaders=loader, batch_sizes=(8, 16, 32),
                            workers=(0,), **FAST)
    assert result.chosen is not None and result.chosen.config.batch_size == 16
    assert any("no batch_size / num_workers attribute" in n for n in result.notes)


class RunsOutAbove8(Regression):
    """Out of memory above 8 samples, with CUDA's message (what accelerate's batch search
    catches)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return super().forward(x, labels)


def test_hf_auto_find_batch_size_does_not_shrink_a_trial(tmp_path: Path) -> None:
    """``auto_find_batch_size=True`` (the user's): a trial that runs out of memory is an
    ``oom`` trial, not a train() that goes on at 0.9x the batch under the trial's label and
    sample count; the user's setting stays."""
    trainer = hf_trainer(tmp_path, RunsOutAbove8(), Samples(), batch=4,
                         auto_find_batch_size=True)
    result = tune_trainer(trainer, batch_sizes=(4, 8, 16, 32), workers=(0,), **FAST)
    seen = [(t.config.batch_size, t.status, t.samples_per_s) for t in result.trials]
    assert [t.status for t in result.trials if t.config.batch_size == 16] == ["oom"], seen
    assert result.oom_batch == 16 and result.chosen is not None, seen
    assert result.chosen.config.batch_size == 8, seen
    assert trainer.args.auto_find_batch_size and trainer.args.per_device_train_batch_size == 8


def test_hf_keeps_the_users_accumulation_and_state(tmp_path: Path) -> None:
    """Without ``global_batch`` the sweep chooses the micro-batch: the user's
    ``gradient_accumulation_steps`` stays in ``trainer.args``; the Trainer's state (its
    ``global_step``, ``log_history``) is not the last trial's."""
    trainer = hf_trainer(tmp_path, Regression(), Samples(), batch=4,
                         gradient_accumulation_steps=2)
    state = trainer.state
    result = tune_trainer(trainer, batch_sizes=(4, 8), workers=(0,), **FAST)
    assert result.chosen is not None and result.chosen.config.accumulation == 1
    assert trainer.args.gradient_accumulation_steps == 2
    assert any("yours (2) is kept" in n for n in result.notes)
    assert trainer.state is state and trainer.state.global_step == 0


class WithCallbacks(Module):
    """A module that brings its own callbacks: a checkpoint every step, a learning-rate
    monitor (which raises in a Trainer without a logger)."""

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__()
        self.ckpt_dir = ckpt_dir

    def configure_callbacks(self) -> list[Any]:
        from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

        return [ModelCheckpoint(dirpath=self.ckpt_dir, every_n_train_steps=1, save_top_k=-1),
                LearningRateMonitor()]


def test_lightning_trials_leave_the_modules_callbacks_out(tmp_path: Path) -> None:
    model, dm, trainer = WithCallbacks(tmp_path / "ckpt"), Data(), pl_trainer()
    result = tune_lightning(trainer, model, datamodule=dm, batch_sizes=(4, 8), workers=(0,),
                            **FAST)
    assert result.chosen is not None
    assert not list(tmp_path.rglob("*.ckpt"))  # no checkpoint from a trial
    assert "configure_callbacks" not in vars(model) and len(model.configure_callbacks()) == 2


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_lightning_trials_print_no_banner_and_levels_come_back() -> None:
    """Each trial's fit would print Lightning's banner (``GPU available: ...``, the LitLogger
    tip) between the tuner's progress lines; its warnings still show, and the levels you set
    come back: INFO as Lightning sets it, and a level you raised is not lowered."""
    lightning_log, fabric_log = logging.getLogger("lightning.pytorch"), \
        logging.getLogger("lightning.fabric")
    # where pytorch_lightning was imported too (an earlier test in this process), the banner
    # of lightning.pytorch's Trainer comes through the standalone package's logger
    standalone = logging.getLogger("pytorch_lightning")
    levels = (lightning_log.level, fabric_log.level, standalone.level)
    records = Records()
    lightning_log.addHandler(records)
    standalone.addHandler(records)
    try:
        standalone.setLevel(logging.INFO)
        lightning_log.setLevel(logging.INFO)
        fabric_log.setLevel(logging.ERROR)
        model, trainer = Module(), pl_trainer()
        assert any(m.startswith("GPU available") for m in records.messages)  # yours speaks
        records.messages.clear()
        seen: list[tuple[int, int]] = []

        class Probe(Data):
            def train_dataloader(self) -> DataLoader[Any]:
                seen.append((lightning_log.getEffectiveLevel(), fabric_log.level))
                return super().train_dataloader()

        result = tune_lightning(trainer, model, datamodule=Probe(), batch_sizes=(4, 8),
                                workers=(0,), **FAST)
        assert len(result.trials) == 2 and result.chosen is not None
        assert records.messages == [], records.messages
        assert seen and set(seen) == {(logging.WARNING, logging.ERROR)}
        assert (lightning_log.level, fabric_log.level) == (logging.INFO, logging.ERROR)
        pl_trainer()  # after the sweep: your Trainer's banner as before
        assert any(m.startswith("GPU available") for m in records.messages)
    finally:
        lightning_log.removeHandler(records)
        standalone.removeHandler(records)
        lightning_log.setLevel(levels[0])
        fabric_log.setLevel(levels[1])
        standalone.setLevel(levels[2])
