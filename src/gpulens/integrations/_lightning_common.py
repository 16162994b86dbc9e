"""The Lightning callback's hooks, shared by the ``lightning.pytorch`` and ``pytorch_lightning``
classes (:mod:`gpulens.integrations.lightning`, :mod:`gpulens.integrations.pytorch_lightning`).

This module imports neither package: the hooks only use the ``trainer`` and ``pl_module`` they are
handed. The run's lifecycle is :class:`gpulens.integrations.session.TrainingSession`'s; every
private Lightning attribute (the step and the decision of Lightning's logger connector) is read
in :mod:`gpulens.integrations._lightning_internals`, and nowhere else.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpulens.integrations import _lightning_internals as internals
from gpulens.integrations.session import (
    SessionCallback,
    TrainingSession,
    monitor_for_run,
)
from gpulens.log import warn_once
from gpulens.model import Outcome, Row, RunContext, outcome_of
from gpulens.sinks import SinkSpec
from gpulens.sinks.base import Sink
from gpulens.transport.spawn import prepare_engine

DOC = """Writes GPU telemetry to every logger of the Lightning ``Trainer``, on the steps where
    Lightning writes the module's own ``self.log(...)`` metrics.

    Usage::

        trainer = Trainer(callbacks=[GPUMonitorCallback()], log_every_n_steps=10)

    or with LightningCLI::

        --trainer.callbacks+=gpulens.integrations.lightning.GPUMonitorCallback

    A row is written in ``on_train_batch_end`` exactly when Lightning's logger connector is about
    to log training-step metrics (every ``log_every_n_steps`` optimizer steps, never on a
    gradient-accumulation micro-batch, and on the last step when training stops; where a hook
    after this one stops it, such as Lightning's own ``max_time`` timer, that row comes at
    this callback's next hook), at the same step Lightning passes to ``logger.log_metrics``
    (``trainer/global_step`` in W&B). A logger that raises gets the row again later; the
    loggers that took it do not. The GPU
    window covers every batch since the previous row. Each row reaches each logger through
    ``logger.log_metrics(metrics, step=...)`` on the training thread, inside one of this
    callback's later rows once it is summarised (the engine waits about 0.2 s for the GPU's
    samples of its window: with fast steps that is several rows later) and at the latest
    when training ends. The first window starts when training starts (at a resumed fit, at
    the restored step; for a checkpoint saved inside an epoch, when the first batch starts:
    Lightning corrects its restored step count after ``on_train_start`` there), so the first
    row's ``perf/steps`` counts exactly the optimizer steps it covers.
    Only global rank 0 writes; every rank samples its own GPU and takes part in the row
    (``Monitor.log`` is then a collective, called on every rank by this callback); the row holds
    every rank's GPU, the ``perf/*`` phase keys are rank 0's.

    Keys, besides the per-GPU and host keys of :mod:`gpulens.schema` and the core's
    ``perf/step_time_s`` / ``perf/energy_per_step_j``:

    * ``train/<name>`` for each metric Lightning logs to its loggers at that step
      (the training-step metrics Lightning hands ``log_metrics`` there, not
      ``trainer.logged_metrics``, which keeps a validation's or an epoch's values for every
      later step: what the module's ``self.log(..., on_step=True)`` gave, e.g.
      ``train/loss`` for ``self.log("loss", ...)``; names that hold a ``/`` are kept as they
      are) and ``train/epoch``, for the extra ``sinks`` (a JSONL record then has the loss, the
      step count and the step time). The loggers get them from Lightning itself, so rows sent
      to the loggers leave ``train/*`` out, and without extra sinks they are not read at all
      (reading them makes Lightning compute its logged results a second time).
    * ``perf/data_wait_pct``, ``perf/data_wait_s``: from the end of this callback's
      ``on_train_batch_end`` (or of ``on_validation_end`` / ``on_train_epoch_start`` after it,
      or of a checkpoint save through ``trainer.save_checkpoint``, as ``ModelCheckpoint``
      saves) to its ``on_train_batch_start`` of the next batch: fetching the next batch,
      moving it to the device, plus Lightning's own work after the batch (logger writes, the
      ``on_train_batch_end`` of callbacks after this one). Validation and saves are no wait
      for data.
    * ``perf/forward_backward_pct|_s``: ``on_train_batch_start`` -> ``on_before_optimizer_step``
      (training_step, backward; a gradient-accumulation micro-batch counts wholly here).
    * ``perf/optimizer_pct|_s``: ``on_before_optimizer_step`` -> ``on_train_batch_end``.

    ``_pct`` is a share of the measured step time (the three phases), ``_s`` seconds per optimizer
    step. On a CUDA module the phases are timed with CUDA events on the GPU's timeline, read once
    they have completed (``query()``), never by synchronising; on CPU with ``perf_counter``.

    Args:
        sinks: extra sinks (``"jsonl:PATH"``, ``"prometheus:PORT"``, sink objects) that get the
            same rows.
        interval: seconds between the sampler's cheap reads.
        gpus: device indices to sample; ``None``: the devices this process uses.
        backend: ``"nvml"``, ``"simulated"``, ``"auto"`` or ``None`` (automatic, honours
            ``GPULENS_BACKEND``).
        to_loggers: write rows to ``trainer.loggers``.
        tracker_keys: ``"default"`` (W&B's and MLflow's loggers get a handful of job-level GPU
            figures, the view of :mod:`gpulens.sinks.layout`; other loggers every key) or
            ``"all"`` (every key to every logger); ``None``: ``GPULENS_TRACKER_KEYS``, else
            ``"default"``.
        phases: time the phases of each step.
        work: count each window's work for ``perf/tokens_per_s``, ``perf/tflops``,
            ``perf/mfu_pct`` and ``perf/tokens_per_j``: from the module's
            ``tokens_per_batch(batch)`` / ``flops_per_batch(batch)`` /
            ``samples_per_batch(batch)`` where it defines them, else from a Hugging Face style
            batch (``input_ids``, ``attention_mask``: padding is not work) with the FLOPs of
            the module's (or its ``model``'s) Hugging Face config; the dtype from the
            Trainer's ``precision``.
        gpm: ``False``: no GPM reads, and no ``sm_active_pct``, ``sm_occupancy_pct``,
            ``tensor_active_pct`` or ``dram_bw_pct`` (Hopper and newer); GPM did not make a
            step dearer in the runs of ``docs/benchmarks.md`` ("eighth session").
"""


TRACKER_LOGGERS = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}
"""Lightning loggers whose UI makes a chart per key, and the tracker each writes to: they (and
their subclasses) get the tracker view (:mod:`gpulens.sinks.layout`), the run's metadata and
the alerts; the others (CSV, TensorBoard, ...) every key."""


class LoggersSink:
    """Writes rows to Lightning loggers with ``log_metrics(metrics, step=row.step)``.

    Fed from the training thread (Lightning loggers are not thread-safe). ``train/*`` keys are
    left out: the step goes in ``step=`` and the module logs its own metrics.  W&B's and
    MLflow's loggers get the tracker view (a handful of job-level GPU figures as bare keys,
    beside the module's own, e.g. ``gpu_sm_active_pct_mean``), unless ``keys="all"``
    (or ``GPULENS_TRACKER_KEYS=all``); the other loggers get every key.

    W&B's and MLflow's loggers (and their subclasses) also get what the W&B and MLflow sinks
    give their runs (``docs/trackers.md``): the run's metadata (GPUs, backend, host, ...) in
    the W&B config under ``"gpulens"`` and as MLflow params ``gpulens.*``; the W&B tag
    ``simulated-gpus`` for simulated GPUs; and for each advice rule that fires, ``run.alert``
    in W&B and the MLflow tag ``gpulens.alert.<rule>``; written by a thread of their own
    (:class:`_Extras`), never the training thread.
    """

    on_training_thread = True

    def __init__(self, loggers: Sequence[Any], keys: str | None = None) -> None:
        from gpulens.sinks.layout import TrackerLayout

        self.loggers = list(loggers)
        self._layout = TrackerLayout(keys, section="", include_train=False)
        self._kinds = [_tracker_kind(lg) for lg in self.loggers]
        self._trackers = [k is not None and self._layout.keys != "all" for k in self._kinds]
        self.label = "Lightning loggers (" + ", ".join(type(lg).__name__
                                                      for lg in self.loggers) + ")"
        """The name warnings give this sink."""
        self._pending: tuple[Row, set[int]] | None = None
        """A row some loggers have and others have not (one raised): its retry skips those."""
        self._extras: _Extras | None = None
        """Metadata and alerts for W&B's and MLflow's loggers, written off the training
        thread (while open)."""
        self._keys: set[str] = set()
        self._train: list[str] = []
        """The ``train/*`` keys of rows with the key set ``_keys`` (rows repeat their keys)."""

    def open(self, context: RunContext) -> None:
        self._layout.reset()
        if any(self._kinds):
            self._extras = _Extras(self.loggers, self._kinds, context)

    def write(self, row: Row) -> None:
        values = row.values
        if values.keys() != self._keys:  # a set comparison, in C: rows repeat their keys
            self._keys = set(values)
            self._train = [k for k in values if k.startswith("train/")]
        metrics = dict(values)
        for key in self._train:
            del metrics[key]
        view: dict[str, float] | None = None
        pending = self._pending
        done = pending[1] if pending is not None and pending[0] is row else set()
        self._pending = (row, done)
        for i, (logger, tracker) in enumerate(zip(self.loggers, self._trackers, strict=True)):
            if i in done:  # a retry of this row: that logger has it (never twice)
                continue
            if tracker:
                if view is None:
                    view = self._layout.split(values)[0]
                logger.log_metrics(view, step=row.step)
            else:
                logger.log_metrics(metrics, step=row.step)
            done.add(i)
            if row.events and self._extras is not None:
                self._extras.alerts(i, row)
        self._pending = None

    def close(self) -> None:
        extras, self._extras = self._extras, None
        if extras is not None:
            extras.close()
        for logger in self.loggers:
            logger.save()


class _Extras:
    """What the W&B and MLflow sinks give their runs, for Lightning's W&B and MLflow loggers:
    the run's metadata (W&B config ``"gpulens"`` and the ``simulated-gpus`` tag; MLflow params
    ``gpulens.*``) and each alert (W&B ``run.alert``; MLflow tag ``gpulens.alert.<rule>``).
    They are network calls: a thread of their own makes them, in order, never the training
    thread. The runs (``logger.experiment``, ``logger.run_id``) are read once, at open, on the
    training thread, as Lightning's loggers expect; a failure is a warning, once."""

    def __init__(self, loggers: list[Any], kinds: list[str | None],
                 context: RunContext) -> None:
        self._targets: list[tuple[str, Any, Any] | None] = []
        for logger, kind in zip(loggers, kinds, strict=True):
            target = None
            if kind is not None:
                try:
                    target = (kind, logger.experiment,
                              getattr(logger, "run_id", None) if kind == "mlflow" else None)
                except Exception as exc:  # extras: rows go on
                    warn_once(f"lightning-run:{kind}", "gpulens: cannot reach the run of %s "
                              "for its metadata and alerts: %r", type(logger).__name__, exc)
            self._targets.append(target)
        self._fired: dict[str, str] = {}
        """The text of each alert firing now (MLflow's tag when it ends)."""
        self._tags: tuple[Row, dict[str, str]] | None = None
        """A row's MLflow alert tags, made once for it (two MLflow loggers share them)."""
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gpulens-lightning-extras",
                                        daemon=True)
        self._thread.start()
        self._jobs.put(lambda: self._metadata(context))

    def alerts(self, index: int, row: Row) -> None:
        """The alerts of ``row`` for the logger at ``index`` (it took the row)."""
        target = self._targets[index]
        if target is not None and any(e.kind == "alert" for e in row.events):
            self._jobs.put(lambda: self._alert(target, row))

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _metadata(self, context: RunContext) -> None:
        for target in self._targets:
            if target is None:
                continue
            kind, run, run_id = target
            try:
                if kind == "wandb":
                    from gpulens.sinks.wandb_run import write_run_metadata

                    write_run_metadata(run, context)
                else:
                    from gpulens.sinks.mlflow import write_run_params

                    write_run_params(run, run_id, context)
            except Exception as exc:  # metadata is an extra: rows go on
                warn_once(f"lightning-meta:{kind}", "gpulens: could not write the run's "
                          "metadata to the %s run: %r", kind, exc)

    def _alert(self, target: tuple[str, Any, Any], row: Row) -> None:
        kind, run, run_id = target
        try:
            if kind == "wandb":
                from gpulens.sinks.wandb_run import send_alert

                for event in row.events:
                    if event.kind == "alert" and event.state == "firing":
                        send_alert(run, event)
            else:
                from gpulens.sinks.mlflow import alert_tags

                if self._tags is None or self._tags[0] is not row:
                    self._tags = (row, alert_tags(row.events, self._fired))
                for key, text in self._tags[1].items():
                    run.set_tag(run_id, key, text)
        except Exception as exc:  # alerts are extras: rows go on
            warn_once(f"lightning-alert:{kind}", "gpulens: could not send an alert to the %s "
                      "run: %r", kind, exc)


class GPUMonitorHooks(SessionCallback):
    """Hook implementations; mixed into each package's ``Callback``."""

    def __init__(
        self,
        sinks: Sequence[str | Sink] | None = None,
        interval: float = 0.5,
        gpus: Sequence[int] | None = None,
        backend: str | None = None,
        to_loggers: bool = True,
        phases: bool = True,
        work: bool = True,
        tracker_keys: str | None = None,
        gpm: bool = True,
    ) -> None:
        super().__init__(sinks, interval, gpus, backend, tracker_keys, phases, work, gpm)
        self.to_loggers = to_loggers
        self._train_keys = False
        """Rows carry the module's logged metrics as ``train/*`` (an extra sink wants them)."""
        self._step_names: frozenset[str] | None = None
        """The names of the training-step metrics of the previous row (for a late row)."""
        self._late: int | None = None
        """The logging step of the last batch, which had no row: see :meth:`_late_stop`."""
        self._saves: _SavesResume | None = None
        """While a session runs: the trainer's checkpoint saves resume the data-wait clock."""
        self._begin: tuple[list[SinkSpec | Sink], Any] | None = None
        """A session to start (its sinks and module) at the first batch (:meth:`_start`)."""

    # -- lifecycle -------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            internals.check(trainer)
            # fit begins: the model's move, the sanity check and the loaders come before
            # on_train_start
            prepare_engine(self.settings)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._stop()
        self._late = None
        self._step_names = None
        sinks: list[SinkSpec | Sink] = []
        if trainer.is_global_zero:
            if self.to_loggers and trainer.loggers:
                sinks.append(LoggersSink(trainer.loggers, self.tracker_keys))
            sinks.extend(self.settings.sinks)
            if not sinks:
                warn_once("lightning-no-sinks", "gpulens: no logger takes the GPU rows (the "
                          "Trainer has none, or to_loggers=False) and no sinks were given: they "
                          "are written nowhere; give the Trainer a logger or the callback "
                          "sinks=[\"jsonl:PATH\"]")
        self._train_keys = bool(trainer.is_global_zero and self.settings.sinks)
        self._begin = (sinks, pl_module)
        # a fit resumed inside an epoch: Lightning corrects its step count after this hook
        # (internals.resuming_mid_epoch); its first window starts at the first batch instead
        if not internals.resuming_mid_epoch(trainer):
            self._start(trainer)

    def _start(self, trainer: Any) -> None:
        begin, self._begin = self._begin, None
        if begin is None:
            return
        sinks, pl_module = begin
        dtype = work = None
        if self.count_work:
            from gpulens.work.precision import dtype_from_lightning_precision

            dtype = dtype_from_lightning_precision(getattr(trainer, "precision", None))
            work = _BatchWork(pl_module)
        done = internals.steps_done(trainer)
        # Rows are stamped with Lightning's logging step, which counts the optimizer steps
        # *before* the batch (4 after the fifth): a window that starts with training (or at a
        # resumed fit's restored step) starts one below, so the first row counts every step.
        self.session = TrainingSession(
            monitor_for_run(self.settings, sinks, dtype), start_step=done - 1,
            steps_done=done, phases=self._phases(pl_module.device), work=work).start()
        self._saves = _SavesResume(trainer, self)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._late_stop(trainer)
        self._stop()

    def _stop(self, collective: bool = True, outcome: Outcome = "finished") -> None:
        self._begin = None
        saves, self._saves = self._saves, None
        if saves is not None:
            saves.undo()
        super()._stop(collective, outcome)

    def _late_stop(self, trainer: Any) -> None:
        """At the first of this callback's hooks after Lightning logged a batch's training
        metrics (the next batch's start, validation's start, the epoch's end, training's
        end): if ``should_stop`` is set now and was not at this callback's
        ``on_train_batch_end`` (no row was due then), a hook after it set it (Lightning's
        Timer for ``max_time``, a later callback, the module's ``on_train_batch_end``), and
        Lightning logged that step (``should_update_logs`` holds ``should_stop``): its row.
        Not after a gradient-accumulation micro-batch (Lightning logs none there). It reads
        wrong where a callback listed before this one sets ``should_stop`` in that next hook
        (``on_train_batch_start``, ``on_validation_start``, ``on_train_epoch_end``): a row at
        the last batch's step, where Lightning logged no training metrics."""
        step, self._late = self._late, None
        session = self.session
        if (step is None or session is None or not trainer.should_stop
                or not trainer.log_every_n_steps or session.steps_since_row(step + 1) <= 0):
            return
        scalars = (internals.logged_metrics(trainer, self._step_names, late=True)
                   if self._train_keys else {})
        session.row(step, step + 1, scalars)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # this rank failed; the others may be stuck in training's collectives: no gather
        self._stop(collective=False, outcome=outcome_of(exception))
        _drop_spare()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()
        if stage == "fit":
            _drop_spare()

    # -- step anatomy ----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._begin is not None:  # a fit resumed inside an epoch: its first batch
            self._start(trainer)
        if self._late is not None:  # a stop that did not end training yet (min_steps)
            self._late_stop(trainer)
        session = self.session
        if session is not None:
            session.step_begin()
            if isinstance(session.work, _BatchWork):
                session.work.observe(batch)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session is not None:
            self.session.before_optimizer()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.session is not None:
            self.session.resume()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._late_stop(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._late_stop(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # a session lives from on_train_start to on_train_end: this is validation inside fit
        # (where trainer.training is False), and its time is no wait for data
        if self.session is not None:
            self.session.resume()

    # -- rows ------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.session
        if session is None:
            return
        session.step_end()
        step, will_log = internals.log_step(trainer)
        # a step with no row now may get one if a later hook stops training (_late_stop)
        self._late = step if will_log is False else None
        if not will_log:
            return
        scalars = internals.logged_metrics(trainer) if self._train_keys else {}
        if scalars:
            self._step_names = frozenset(scalars)
        # optimizer steps done: the logging step counts those before this batch's
        session.row(step, step + 1, scalars)


class _SavesResume:
    """Makes ``trainer.save_checkpoint`` resume the data-wait clock when it returns, for one
    fit (:meth:`undo` puts the trainer's own method back). Lightning's ``ModelCheckpoint``
    saves through it in ``on_validation_end`` and ``on_train_batch_end``, after this
    callback's hooks there (Lightning puts checkpoint callbacks last): a slow save then read
    as the next step's wait for data, and could raise ``input_bound``. Lightning has no hook
    after a save ends (``on_save_checkpoint`` comes before the file is written)."""

    def __init__(self, trainer: Any, hooks: GPUMonitorHooks) -> None:
        self.trainer = trainer
        self.had_own = "save_checkpoint" in vars(trainer)  # the user's own, kept as it is
        save = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            try:
                return save(*args, **kwargs)
            finally:
                session = hooks.session
                if session is not None:
                    session.resume()

        self.wrapped = save_checkpoint
        if not self.had_own:
            trainer.save_checkpoint = save_checkpoint

    def undo(self) -> None:
        if not self.had_own and vars(self.trainer).get("save_checkpoint") is self.wrapped:
            del self.trainer.save_checkpoint


def _drop_spare() -> None:
    """A fit that ended before ``on_train_start`` took the spare engine process ``setup``
    made (``configure_optimizers`` or the sanity check raised): it is ended now, not left
    idle until its retirement (9 minutes) or the exit."""
    from gpulens.transport import spawn

    spawn.drop()


def _tracker_kind(logger: Any) -> str | None:
    """``"wandb"`` or ``"mlflow"`` for their Lightning loggers and subclasses, else ``None``."""
    for cls in type(logger).__mro__:
        kind = TRACKER_LOGGERS.get(cls.__name__)
        if kind is not None:
            return kind
    return None


class _BatchWork:
    """The work of the batches of a window: the module's own ``tokens_per_batch(batch)`` /
    ``flops_per_batch(batch)`` / ``samples_per_batch(batch)`` where it defines them (numbers or
    tensors; never synchronised here), else, for a Hugging Face style batch (a mapping with
    ``input_ids`` and maybe ``attention_mask``), the real tokens and model FLOPs that
    :class:`gpulens.work.hf.TokenCounter` counts (the formula from the module's or its
    ``model``'s Hugging Face config)."""

    def __init__(self, pl_module: Any) -> None:
        self._hooks = {name: getattr(pl_module, f"{name}_per_batch", None)
                       for name in ("tokens", "flops", "samples")}
        self._sums: dict[str, Any] = {}
        self._counter: Any = None
        if not any(callable(h) for h in self._hooks.values()):
            from gpulens.work.hf import TokenCounter, model_flops

            model = getattr(pl_module, "model", pl_module)
            has_config = getattr(model, "config", None) is not None
            self._counter = TokenCounter(model_flops(model) if has_config else None)

    def observe(self, batch: Any) -> None:
        try:
            for name, hook in self._hooks.items():
                if callable(hook):
                    value = hook(batch)
                    if value is not None:
                        self._sums[name] = self._sums.get(name, 0) + value
            if self._counter is not None and isinstance(batch, Mapping):
                self._counter.observe(batch)
        except Exception as exc:  # work figures are extras: training goes on
            warn_once("lightning-work", "gpulens: cannot count the work of a batch (%r); no "
                      "throughput or MFU for it", exc)

    def settle(self) -> None:
        if self._counter is not None:
            self._counter.settle()

    def cut(self) -> _BatchWork:
        """The work so far as a source of its own (no device operation); this one starts
        again."""
        part = copy.copy(self)
        self._sums = {}
        part._counter = self._counter.cut() if self._counter is not None else None
        return part

    def take_deferred(self) -> dict[str, Any]:
        out, self._sums = self._sums, {}
        if self._counter is not None:
            out.update(self._counter.take_deferred())
        return out

    def close(self) -> None:
        if self._counter is not None:
            self._counter.close()


__all__ = ["DOC", "GPUMonitorHooks", "LoggersSink"]
