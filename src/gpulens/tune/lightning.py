"""Lightning: ``tune_lightning(trainer, model, datamodule=...)``, beside or instead of
``Tuner(trainer).scale_batch_size(model, datamodule=...)``.

::

    from gpulens.tune.lightning import tune_lightning

    trainer = Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=3)
    result = tune_lightning(trainer, model, datamodule=dm)   # sets dm.batch_size, dm.num_workers
    trainer.fit(model, datamodule=dm)

Each trial is a real ``fit`` of warm-up + timed steps in a short-lived ``Trainer`` with the
accelerator, devices, nodes, strategy, precision and gradient clipping of yours (overridable
with ``trainer_kwargs``), the trial's ``accumulate_grad_batches``, and no logger, checkpoint,
progress bar or validation (nor the callbacks of your module's ``configure_callbacks()``).
Your trainer is not fitted (a fitted Trainer does not fit again from step 0); your module's
``configure_optimizers`` makes a fresh optimizer for each trial.

The batch size is changed as Lightning's own ``Tuner`` changes it: the ``batch_size``
attribute of the datamodule, the module or the module's ``hparams``, which your
``train_dataloader()`` reads; ``num_workers`` likewise when such an attribute exists. Without
one, the ``DataLoader`` that ``train_dataloader()`` returns (or ``train_dataloaders``) is
rebuilt with the trial's batch size and workers (:mod:`gpulens.tune.loader`).

Phases from the callback hooks: ``on_train_batch_end`` -> ``on_train_batch_start`` is the data
wait (fetching and moving the batch, Lightning's own work between batches),
``on_train_batch_start`` -> ``on_before_optimizer_step`` forward+backward, then the optimizer.
The model's weights are put back after the sweep; with ``apply_choice=True`` (default) the
chosen batch size and workers are written to the attributes they came from.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning.pytorch import Callback, Trainer

from gpulens.tune import loader as loaders
from gpulens.tune.model import Config, TuneResult, TuneSettings
from gpulens.tune.pace import TimedCollate
from gpulens.tune.plain import settings_from
from gpulens.tune.runner import make_context, restored, rng_kept, sweep
from gpulens.tune.trial import Recorder


class _TrialCallback(Callback):  # type: ignore[misc,unused-ignore]
    """Marks the recorder from Lightning's hooks; stops the fit when the window closes."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.rec.step_begin(batch)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.rec.before_optimizer()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.rec.step_end()
        if self.rec.done:
            trainer.should_stop = True


def _holder(objects: list[Any], name: str) -> Any:
    """The first object with attribute ``name`` (the datamodule, the module, its hparams)."""
    for obj in objects:
        if obj is None:
            continue
        if hasattr(obj, name):
            return obj
        hparams = getattr(obj, "hparams", None)
        if hparams is not None and name in hparams:
            return hparams
    return None


def _set(holder: Any, name: str, value: int) -> None:
    if isinstance(holder, dict):  # hparams
        holder[name] = value
    else:
        setattr(holder, name, value)


def _get(holder: Any, name: str) -> Any:
    if isinstance(holder, dict):
        return holder[name]
    return getattr(holder, name)


def trainer_kwargs_of(trainer: Any) -> dict[str, Any]:
    """What a trial's Trainer copies from yours."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    accel = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower() or "auto"
    kwargs: dict[str, Any] = {
        "accelerator": accel, "precision": trainer.precision, "num_nodes": trainer.num_nodes,
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
    }
    strategy = trainer.strategy
    if isinstance(strategy, SingleDeviceStrategy):
        kwargs["devices"] = [strategy.root_device.index] if accel == "cuda" else 1
    elif isinstance(strategy, DDPStrategy):
        kwargs["strategy"] = "ddp"
        kwargs["devices"] = trainer.num_devices
    else:
        kwargs["strategy"] = getattr(strategy, "strategy_name", "auto")
        kwargs["devices"] = trainer.num_devices
    return kwargs


class LightningWorkload:
    """One trial = one short ``fit`` in a fresh Trainer."""

    def __init__(self, model: Any, datamodule: Any, loader: Any, base: dict[str, Any],
                 settings: TuneSettings, batch_holder: Any, workers_holder: Any) -> None:
        self.model, self.datamodule, self.loader = model, datamodule, loader
        self.base, self.settings = base, settings
        self.batch_holder, self.workers_holder = batch_holder, workers_holder
        self._set_up = False

    def run(self, config: Config, rec: Recorder) -> None:
        trainer = Trainer(**self.base, max_steps=self.settings.warmup_steps
                          + self.settings.steps + 1,
                          accumulate_grad_batches=config.accumulation,
                          callbacks=[_TrialCallback(rec)], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0,
                          limit_val_batches=0)
        with _without_module_callbacks(self.model):
            self._fit(trainer, config, rec)

    def _fit(self, trainer: Any, config: Config, rec: Recorder) -> None:
        if self.loader is None and self.batch_holder is not None:
            _set(self.batch_holder, "batch_size", config.batch_size)
        if self.workers_holder is not None:
            _set(self.workers_holder, "num_workers", config.num_workers)
        own = config.pin_memory is None and config.prefetch_factor is None
        if own and self.loader is None and None not in (self.batch_holder,
                                                        self.workers_holder):
            with _watched(self.datamodule if self.datamodule is not None else self.model,
                          config, rec):
                trainer.fit(self.model, datamodule=self.datamodule)  # your train_dataloader()
            return
        source = self.loader if self.loader is not None else self._train_loader()
        pace = loaders.pace_for(source, config)
        rec.watch(pace)
        trainer.fit(self.model, train_dataloaders=loaders.rebuild(source, config, pace))

    def _train_loader(self) -> Any:
        dm = self.datamodule
        if dm is None:
            return self.model.train_dataloader()
        if not self._set_up:
            dm.prepare_data()
            dm.setup("fit")
            self._set_up = True
        return dm.train_dataloader()

    def cleanup(self) -> None:
        self.model.zero_grad(set_to_none=True)


_MISSING = object()


@contextmanager
def _instance_attr(owner: Any, name: str, value: Any) -> Iterator[None]:
    """During the block, ``owner.name`` is ``value``: an attribute of the instance (it shadows
    the class's method), removed after, or the instance's own put back."""
    own = owner.__dict__.get(name, _MISSING)
    owner.__dict__[name] = value
    try:
        yield
    finally:
        if own is _MISSING:
            owner.__dict__.pop(name, None)
        else:
            owner.__dict__[name] = own


LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
"""Lightning's loggers: its banner at every ``fit`` (``GPU available: ...``, the LitLogger
tip, ``LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: ...``) is their INFO.  The standalone packages'
names too: where ``pytorch_lightning`` was imported as well, ``lightning.pytorch``'s Trainer
says its banner through ``pytorch_lightning.utilities.rank_zero`` (seen with 2.6.6)."""


@contextmanager
def _quiet() -> Iterator[None]:
    """During the sweep, Lightning says its warnings, not its banner: every trial's ``fit``
    would print it again between the tuner's own progress lines. Lightning's loggers go to
    WARNING (not down from a higher level you set) and get their own levels back after; the
    warning that advises more loader workers is left out (the sweep measures exactly that).
    Warnings are filtered once for the whole sweep: a filter set and reset in every trial
    would let Python show each warning of Lightning's once per trial, not once."""
    loggers = [logging.getLogger(name) for name in LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers",
                                category=UserWarning)
        for lg in loggers:
            if lg.getEffectiveLevel() < logging.WARNING:
                lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def _without_module_callbacks(model: Any) -> AbstractContextManager[None]:
    """During the block, the module's ``configure_callbacks()`` gives none: Lightning adds what
    it returns to every Trainer that fits the module, the trials' too, where a
    ``ModelCheckpoint`` would write checkpoints and a ``LearningRateMonitor`` raise (the
    trials have no logger)."""
    return _instance_attr(model, "configure_callbacks", lambda: [])


@contextmanager
def _watched(owner: Any, config: Config, rec: Recorder) -> Iterator[None]:
    """During the block, the loader that ``owner.train_dataloader()`` returns has its collate
    function timed in its workers (:mod:`gpulens.tune.pace`): an attribute of the instance,
    removed after, and the loader's own collate function put back (a ``train_dataloader()``
    that keeps its loader gets it back as it was). Lightning records the assignment and
    replays it on the loader it re-creates with a distributed sampler."""
    if config.num_workers < 1:
        yield
        return
    made = owner.train_dataloader
    handed: list[tuple[Any, Any]] = []

    def train_dataloader() -> Any:
        loader = made()
        pace = loaders.pace_for(loader, config)  # None for a dict, list or CombinedLoader
        if pace is not None and pace.workers == loader.num_workers:
            collate = loader.collate_fn
            while isinstance(collate, TimedCollate):  # a loader kept from an earlier trial
                collate = collate.collate
            handed.append((loader, collate))
            loader.collate_fn = pace.wrap(collate)
            rec.watch(pace)
        return loader

    try:
        with _instance_attr(owner, "train_dataloader", train_dataloader):
            yield
    finally:
        for loader, collate in handed:
            loader.collate_fn = collate
            # what Lightning recorded to replay on a re-created loader, less the trial's wrapper
            record = loader.__dict__.get("__pl_attrs_record")
            if isinstance(record, list):
                record[:] = [(args, tag) for args, tag in record
                             if not any(isinstance(a, TimedCollate) for a in args)]


def tune_lightning(trainer: Any, model: Any, datamodule: Any = None, *,
                   train_dataloaders: Any = None, settings: TuneSettings | None = None,
                   trainer_kwargs: dict[str, Any] | None = None, apply_choice: bool = True,
                   tokens_per_sample: float | None = None,
                   flops_per_sample: float | None = None, progress: bool = True,
                   **overrides: Any) -> TuneResult:
    """Choose the batch size and loader workers of a Lightning fit by measured throughput
    (module docstring). Under DDP every rank calls it.

    Args:
        trainer: your Trainer (its settings are copied; it is not fitted).
        model, datamodule, train_dataloaders: as for ``trainer.fit``.
        trainer_kwargs: override what the trials' Trainers copy (e.g. ``strategy=``).
        tokens_per_sample, flops_per_sample: for tokens/s and MFU.
        settings / overrides: :class:`~gpulens.tune.TuneSettings` or its fields as keywords.
    """
    from gpulens.work.precision import dtype_from_lightning_precision

    settings = settings_from(settings, overrides)
    holders = [datamodule, model]
    batch_holder = _holder(holders, "batch_size")
    workers_holder = _holder(holders, "num_workers")
    source = train_dataloaders
    if source is None and (batch_holder is None or workers_holder is None):
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup("fit")
            source = datamodule.train_dataloader()
        else:
            source = model.train_dataloader()
        loaders.check_source(source)
    defaults = loaders.defaults(source) if source is not None else None
    batch = _get(batch_holder, "batch_size") if batch_holder is not None else None
    workers = _get(workers_holder, "num_workers") if workers_holder is not None else None
    current = Config(int(batch if batch is not None else defaults.batch_size if defaults else 1),
                     int(workers if workers is not None else
                         defaults.num_workers if defaults else 0),
                     accumulation=int(trainer.accumulate_grad_batches))
    base = {**trainer_kwargs_of(trainer), **(trainer_kwargs or {})}
    ctx = make_context(model=model, device=trainer.strategy.root_device,
                       dtype=dtype_from_lightning_precision(trainer.precision),
                       tokens_per_sample=tokens_per_sample, flops_per_sample=flops_per_sample)
    workload = LightningWorkload(model, datamodule, train_dataloaders, base, settings,
                                 batch_holder, workers_holder)
    saved = {(id(h), name): (h, name, _get(h, name)) for h, name in
             ((batch_holder, "batch_size"), (workers_holder, "num_workers")) if h is not None}
    try:
        with restored(model), rng_kept(*loaders.generators(source)), _quiet():
            result = sweep(workload, ctx, settings, current=current, progress=progress,
                           loader_defaults=dataclasses.replace(current, pin_memory=(
                               defaults.pin_memory if defaults else None)))
    finally:
        for holder, name, value in saved.values():
            _set(holder, name, value)
        if ctx.token_counter is not None:
            ctx.token_counter.detach()
    if apply_choice and result.chosen is not None:
        c = result.chosen.config
        for holder, name, value in ((batch_holder, "batch_size", c.batch_size),
                                    (workers_holder, "num_workers", c.num_workers)):
            if holder is not None:
                _set(holder, name, value)
        if batch_holder is None or workers_holder is None:
            result.notes.append("no batch_size / num_workers attribute to write the choice to: "
                                "set it in your DataLoader")
    return result
