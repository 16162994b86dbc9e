"""The one place the Lightning callback reads a Lightning ``Trainer``'s internals.

Lightning publishes no hook that says "the loggers are about to get this step's metrics, at this
step". The callback writes its row in ``on_train_batch_end``, before Lightning's logger
connector decides, so it repeats that decision here from the private attributes it is made of.
Nothing else in gpulens touches a private Lightning attribute; :func:`check` verifies at
``setup`` that they exist, so a Lightning that renamed them fails with one line before training,
never in the middle of it.

Checked against ``lightning`` 2.6.6 and ``pytorch_lightning`` 2.6.6 (the same code under two
package names); the decision mirrors ``_LoggerConnector.update_train_step_metrics`` and
``_TrainingEpochLoop`` of Lightning 2.x. This module imports neither package: it only reads the
trainer it is handed.

Private attributes read:

* ``trainer.fit_loop.epoch_loop._batches_that_stepped``: optimizer steps taken, the step
  Lightning logs training-step metrics at (``trainer/global_step``), one less than
  ``trainer.global_step`` once a batch's optimizer step has run;
* ``trainer.fit_loop.epoch_loop.restarting``: a resumed fit restarting inside an epoch,
  whose ``_batches_that_stepped`` Lightning may still correct after ``on_train_start``;
* ``trainer.fit_loop._should_accumulate()``: this batch is a gradient-accumulation micro-batch;
* ``trainer._logger_connector.should_update_logs``: this batch's step is a logging step
  (every ``log_every_n_steps``, or the trainer is stopping);
* ``trainer._logger_connector.metrics["log"]``: the metrics Lightning hands the loggers for
  this training step (``update_train_step_metrics``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gpulens.log import warn_once

CHECKED_WITH = ("lightning 2.6.6", "pytorch_lightning 2.6.6")


def check(trainer: Any) -> None:
    """``RuntimeError`` (one line) when this Lightning lacks what this module reads."""
    fit_loop = getattr(trainer, "fit_loop", None)
    missing = [
        name
        for name, ok in (
            ("fit_loop.epoch_loop._batches_that_stepped",
             hasattr(getattr(fit_loop, "epoch_loop", None), "_batches_that_stepped")),
            ("fit_loop.epoch_loop.restarting",
             hasattr(type(getattr(fit_loop, "epoch_loop", None)), "restarting")),
            ("fit_loop._should_accumulate", hasattr(fit_loop, "_should_accumulate")),
            *((f"_logger_connector.{name}",
               hasattr(type(getattr(trainer, "_logger_connector", None)), name))
              for name in ("should_update_logs", "metrics")),
        )
        if not ok
    ]
    if missing:
        raise RuntimeError(
            "gpulens' Lightning callback follows Lightning 2.x's logging step and needs "
            f"{', '.join(missing)}, which this Lightning version lacks"
        )


def steps_done(trainer: Any) -> int:
    """Optimizer steps taken so far; exact from a batch's start on, and at ``on_train_start``
    unless :func:`resuming_mid_epoch`."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def resuming_mid_epoch(trainer: Any) -> bool:
    """A resumed fit whose epoch loop restarts inside an epoch. Its checkpoint may have been
    saved (``ModelCheckpoint`` every N training steps, or after a validation inside the epoch)
    before its batch's ``_batches_that_stepped`` increment, which Lightning adds back after
    ``on_train_start``, when its epoch loop resets or skips the validation it restarted on:
    until the first batch starts, :func:`steps_done` may be one short."""
    return bool(trainer.fit_loop.epoch_loop.restarting)


def log_step(trainer: Any) -> tuple[int, bool | None]:
    """The step Lightning logs training-step metrics at right after ``on_train_batch_end``,
    and whether it logs them for this batch: ``None`` (never) on a gradient-accumulation
    micro-batch under automatic optimisation; otherwise when ``should_update_logs`` or
    ``fast_dev_run`` (``False`` may still turn true: a hook after the caller's can set
    ``should_stop``, which ``should_update_logs`` holds)."""
    fit_loop = trainer.fit_loop
    step = int(fit_loop.epoch_loop._batches_that_stepped)
    accumulating = bool(fit_loop._should_accumulate())
    module = trainer.lightning_module
    if accumulating and getattr(module, "automatic_optimization", True):
        return step, None
    will_log = bool(trainer._logger_connector.should_update_logs) or bool(trainer.fast_dev_run)
    return step, will_log


def logged_metrics(trainer: Any, names: Collection[str] | None = None,
                   late: bool = False) -> dict[str, Any]:
    """What Lightning's logger connector hands the loggers for this training step (the module's
    step-level ``self.log`` values, tensors left as they are: the monitor converts them off the
    training thread) and the epoch, as Lightning adds it: ``_logger_connector.metrics["log"]``,
    what ``update_train_step_metrics`` passes to ``log_metrics``. Not the public
    ``trainer.logged_metrics``: that keeps every value logged since the fit began (a
    validation's ``val_loss``, an epoch's means) and would repeat them in every later row, at
    steps where Lightning never logged them. Either recomputes Lightning's results each call:
    read it only when a sink wants ``train/*``.

    ``late``: read at a hook after Lightning logged the step (a late stop), where the step's
    results are gone (the epoch's were reset): ``trainer.logged_metrics`` then, kept to
    ``names`` (the previous row's training-step names; every name without one)."""
    out: dict[str, Any] = {}
    try:
        if late:
            metrics = {k: v for k, v in trainer.logged_metrics.items()
                       if names is None or k in names}
        else:
            metrics = trainer._logger_connector.metrics["log"]
    except Exception as exc:
        warn_once("lightning-logged-metrics", "gpulens: Lightning's logged metrics cannot be "
                  "read (%r); rows carry no train/* keys", exc)
        metrics = {}
    for name, value in dict(metrics).items():
        if name in ("epoch", "step"):
            continue
        out[name] = value
    out["epoch"] = int(trainer.current_epoch)
    return out
