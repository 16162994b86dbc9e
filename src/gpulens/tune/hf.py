"""Hugging Face: ``tune_trainer(trainer)`` before ``trainer.train()``.

::

    from gpulens.tune.hf import tune_trainer

    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = tune_trainer(trainer)       # sets per_device_train_batch_size, dataloader_num_workers
    trainer.train()

Each trial is a real ``trainer.train()`` of warm-up + timed steps with the trial's
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``dataloader_num_workers``
(and ``dataloader_pin_memory`` / ``dataloader_prefetch_factor``), your model, collator, loss
and optimizer settings. During the sweep the Trainer's own callbacks (progress bar, W&B,
MLflow, early stopping...) are set aside, so nothing is logged, evaluated or saved; a callback
of the tuner marks the phases: ``on_step_end`` -> ``on_step_begin`` is the data wait (the
Trainer fetches the step's micro-batches there), ``on_step_begin`` -> ``on_pre_optimizer_step``
forward+backward, then the optimizer until ``on_step_end``. On a GPU the phases are on the
GPU's timeline; on a CPU (host clock) the data wait also holds the Trainer's own work between
steps (its logging decision, the loss's NaN check), some milliseconds per step. With loader
workers, the collator is wrapped for the trial so each worker notes when it began and
finished each batch, and a window that waited less than the workers' pace allows (it ran on
batches queued during the warm-up) takes its data wait from that pace instead
(:mod:`gpulens.tune.pace`); the trial's workers are ended after it, persistent ones too.

Afterwards the model's weights (and an optimizer or scheduler you passed to the Trainer) are
put back, the Trainer's callbacks and arguments restored, and, with ``apply=True`` (default),
the chosen batch size, accumulation (with ``global_batch``; without, yours stays) and loader
settings written into ``trainer.args``. ``auto_find_batch_size`` is off during the trials (a
trial that runs out of memory is a result, not a cue to shrink the batch under its label).

Tokens and model FLOPs are counted from the model's inputs (MFU on a GPU with a known peak, in
the dtype ``TrainingArguments`` says). The Trainer keeps its effective batch size in the private
attribute ``_train_batch_size`` (what ``auto_find_batch_size`` changes): it is the only private
attribute this module writes, in :func:`_set_batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import TrainerCallback

from gpulens.log import logger
from gpulens.tune.model import Config, TuneResult, TuneSettings
from gpulens.tune.pace import LoaderPace
from gpulens.tune.plain import settings_from
from gpulens.tune.runner import make_context, restored, rng_kept, sweep
from gpulens.tune.trial import Recorder

_ARGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_num_workers",
         "dataloader_pin_memory", "dataloader_prefetch_factor", "max_steps",
         "auto_find_batch_size")


class _TrialCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Marks the recorder from the Trainer's hooks; stops training when the window closes."""

    def __init__(self, rec: Recorder, samples_per_step: int) -> None:
        self.rec = rec
        self.samples = samples_per_step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rec.step_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rec.before_optimizer()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.rec.step_end(optimizer_step=True, samples=self.samples)
        if self.rec.done:
            control.should_training_stop = True


def _set_batch(trainer: Any, batch_size: int) -> None:
    trainer.args.per_device_train_batch_size = batch_size
    trainer._train_batch_size = trainer.args.train_batch_size


class HfWorkload:
    """One trial = one short ``trainer.train()``."""

    def __init__(self, trainer: Any, settings: TuneSettings) -> None:
        self.trainer = trainer
        self.settings = settings
        self.optimizer = trainer.optimizer
        self.scheduler = trainer.lr_scheduler
        self.prefetch = trainer.args.dataloader_prefetch_factor

    def run(self, config: Config, rec: Recorder) -> None:
        t, args = self.trainer, self.trainer.args
        _set_batch(t, config.batch_size)
        args.gradient_accumulation_steps = config.accumulation
        args.dataloader_num_workers = config.num_workers
        if config.pin_memory is not None:
            args.dataloader_pin_memory = config.pin_memory
        prefetch = config.prefetch_factor or self.prefetch
        args.dataloader_prefetch_factor = prefetch if config.num_workers > 0 else None
        args.max_steps = self.settings.warmup_steps + self.settings.steps + 1
        # the trial's batch size, as set: accelerate's search would catch an out-of-memory
        # error and go on at 0.9x the batch, under this trial's label and sample count
        args.auto_find_batch_size = False
        t.callback_handler.callbacks = [_TrialCallback(rec, config.batch_size
                                                       * config.accumulation)]
        t.optimizer, t.lr_scheduler = self.optimizer, self.scheduler
        t.model_wrapped = t.model
        collator = t.data_collator
        if config.num_workers > 0:
            pace = LoaderPace(config.num_workers)
            rec.watch(pace)
            t.data_collator = pace.wrap(collator)
        try:
            t.train()
        finally:
            t.data_collator = collator
            _end_workers(t)

    def cleanup(self) -> None:
        t = self.trainer
        t.model.zero_grad(set_to_none=True)
        t.model_wrapped = t.model  # the next train() frees the accelerator's references
        t.optimizer, t.lr_scheduler = self.optimizer, self.scheduler


def _end_workers(trainer: Any) -> None:
    """End the loader workers of the trial's ``train()`` now, letting each finish the batch it
    is making. Persistent workers (``dataloader_persistent_workers``) outlive ``train()``: the
    accelerator keeps its loaders until the next ``train()``, so the trial's figures would be
    read with batches begun in the window still unfinished (and not counted in its pace), and
    the last trial's workers would outlive the sweep. Non-persistent workers ended already."""
    for loader in list(getattr(getattr(trainer, "accelerator", None), "_dataloaders", None)
                       or ()):
        base = getattr(loader, "base_dataloader", loader)
        shutdown = getattr(getattr(base, "_iterator", None), "_shutdown_workers", None)
        if callable(shutdown):
            try:
                shutdown()
                base._iterator = None
            except Exception as exc:  # the figures stand; the workers end with the loader
                logger.debug("gpulens tune: could not end a trial's loader workers: %r", exc)


@contextmanager
def _set_aside(trainer: Any) -> Iterator[None]:
    """Restore the Trainer's arguments, batch size, callbacks and state (its ``global_step``
    and ``log_history``: each trial's ``train()`` makes its own) after the block."""
    args = trainer.args
    saved = {name: getattr(args, name) for name in _ARGS}
    batch = trainer._train_batch_size
    callbacks = list(trainer.callback_handler.callbacks)
    state = trainer.state
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
        trainer._train_batch_size = batch
        trainer.callback_handler.callbacks = callbacks
        trainer.state = state


def apply(trainer: Any, config: Config) -> None:
    """Write ``config`` into ``trainer.args`` (and the Trainer's effective batch size)."""
    args = trainer.args
    _set_batch(trainer, config.batch_size)
    args.gradient_accumulation_steps = config.accumulation
    args.dataloader_num_workers = config.num_workers
    if config.pin_memory is not None:
        args.dataloader_pin_memory = config.pin_memory
    if config.prefetch_factor is not None:
        args.dataloader_prefetch_factor = config.prefetch_factor
    if config.num_workers == 0:
        args.dataloader_prefetch_factor = None


def tune_trainer(trainer: Any, settings: TuneSettings | None = None, *, apply_choice: bool = True,
                 progress: bool = True, **overrides: Any) -> TuneResult:
    """Choose ``per_device_train_batch_size`` and ``dataloader_num_workers`` of ``trainer`` by
    measured throughput (module docstring). Under DDP every rank calls it.

    Args:
        settings / overrides: :class:`~gpulens.tune.TuneSettings` or its fields as keywords
            (``budget_s=600``, ``global_batch=256`` keeps batch x accumulation x ranks).
        apply_choice: write the choice into ``trainer.args`` (your
            ``gradient_accumulation_steps`` stays unless ``global_batch`` is given).
        progress: show the progress on stderr (rank 0).
    """
    from gpulens.work.hf import dtype_from_training_args

    settings = settings_from(settings, overrides)
    if trainer.train_dataset is None:
        raise ValueError("gpulens tune: the Trainer has no train_dataset to tune on")
    args = trainer.args
    current = Config(int(args.per_device_train_batch_size), int(args.dataloader_num_workers),
                     accumulation=int(args.gradient_accumulation_steps))
    defaults = Config(current.batch_size, current.num_workers,
                      pin_memory=bool(args.dataloader_pin_memory),
                      prefetch_factor=args.dataloader_prefetch_factor)
    ctx = make_context(model=trainer.model, device=args.device,
                       dtype=dtype_from_training_args(args, trainer.model))
    workload = HfWorkload(trainer, settings)
    try:
        with restored(trainer.model, trainer.optimizer, trainer.lr_scheduler), \
                _set_aside(trainer), rng_kept():
            result = sweep(workload, ctx, settings, current=current, loader_defaults=defaults,
                           progress=progress)
    finally:
        if ctx.token_counter is not None:
            ctx.token_counter.detach()
    keep = current.accumulation > 1 and settings.global_batch is None
    if keep:
        result.notes.append(f"the sweep ran without gradient accumulation; yours "
                            f"({current.accumulation}) is kept; pass global_batch= to keep the "
                            "global batch")
    if apply_choice and result.chosen is not None:
        # without a global batch the sweep chose the micro-batch, not the accumulation
        apply(trainer, dataclasses.replace(result.chosen.config, accumulation=(
            current.accumulation if keep else result.chosen.config.accumulation)))
    return result
