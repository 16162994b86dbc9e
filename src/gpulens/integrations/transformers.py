"""GPU telemetry beside the Hugging Face ``Trainer``'s loss curve.

Usage::

    from gpulens.integrations.transformers import GPUMonitorCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GPUMonitorCallback()])

What it does, hook by hook:

* ``on_train_begin``: starts a :class:`gpulens.Monitor`. Hugging Face calls its own integration
  callbacks (``report_to``) before user callbacks, so the W&B run and the MLflow run that
  ``WandbCallback`` / ``MLflowCallback`` start in their ``on_train_begin`` already exist: with
  ``report_to`` containing ``"wandb"`` and/or ``"mlflow"`` the rows go into those very runs (the
  ``"wandb"`` sink writes to the active ``wandb.run``, from gpulens's engine process, with
  ``gpulens/step`` as x-axis, and never moves W&B's step ahead of Hugging Face's; the
  ``"mlflow"`` sink takes the run active on this thread at start and logs with
  ``step=state.global_step``). Those runs already get ``loss``, ``learning_rate``,
  ``grad_norm`` from Hugging Face, so the rows sent to them leave out ``train/*`` (except
  ``train/global_step``). Sinks given as ``sinks=`` get full rows. With neither, rows go to
  ``{output_dir}/gpulens.jsonl``.
* ``on_log`` with a training log (one holding ``loss``): a row at ``state.global_step`` with
  exactly the numbers Hugging Face logged. Hugging Face averages the loss over the
  ``logging_steps`` optimizer steps since its previous log, and the GPU window spans the same
  steps. Hugging Face calls ``on_log`` just after ``loss.item()`` synchronised the device, so
  anything launched there leaves the GPU idle: the window ends at ``on_log``, but the row is
  written at the end of the next training forward (a forward hook on the model, where the
  forward's kernels are queued and the device is busy; at an evaluation's first batch; after a
  save; at ``on_train_end``) (``TrainingSession.row(..., later=True)``). Hugging Face also
  synchronises after every backward (``logging_nan_inf_filter`` reads ``isnan(loss)``), so from
  there to the next forward the device waits for the host: the step hooks
  (``on_pre_optimizer_step``, ``on_step_end``, ``on_step_begin``) record a CUDA event each and
  nothing else; the attention masks are summed after the forward too. ``global_step`` counts
  optimizer steps, so under gradient accumulation a step is ``gradient_accumulation_steps``
  micro-batches. Evaluation logs (``eval_*``) make no row: their
  time falls into the next training window.
* ``on_train_end``, Hugging Face's own end-of-training signal (not a key of the logs: other
  options add ``train_runtime`` to every log): writes a last row if optimizer steps ran since
  the previous training log (with the numbers of the end-of-training summary, ``train_loss``
  ..., its window ending at that summary's ``on_log``: what Hugging Face does after it,
  loading the best model, ``MLflowCallback`` ending its run and flushing MLflow's queue, is
  no training step), then stops the monitor, which writes every row still waiting.
  ``MLflowCallback`` has ended its run by then (it runs first); MLflow still takes metrics
  into an ended run, so the rows land there. Hugging Face has no exception hook: if
  ``train()`` raises, the monitor is stopped (rows flushed, threads ended) when the callback
  is garbage-collected or, at the latest, at interpreter exit (``weakref.finalize``); a new
  ``train()`` call stops a monitor left running by a failed one before starting afresh. A
  training forward that raises hands the row held since the previous log to the monitor at
  once (the forward hook is ``always_call``), so it reaches a W&B run the user finishes
  before the callback is collected.

Every ``train()`` call gets its own monitor, and its rows go into the runs Hugging Face writes
that call's loss to: a second ``train()`` on the same Trainer, a resume from a checkpoint
(``resume_from_checkpoint``: the first window starts at the restored ``global_step``, so its
per-step figures count only the steps run), and hyper-parameter search trials (W&B: the
trial's own run). ``MLflowCallback`` starts an MLflow run only in its first ``on_train_begin``;
in a later ``train()`` MLflow would make one at Hugging Face's first log. When ``report_to``
holds ``"mlflow"`` and no MLflow run is active at ``on_train_begin``, this callback starts it
then (``mlflow.start_run(run_name=args.run_name)``, in the same experiment), so that Hugging
Face's loss and the GPU rows share it, and ends it at ``on_train_end`` if it is still active.

Distributed jobs: every rank samples its own GPU and every rank calls ``monitor.log`` (a
collective); Hugging Face calls ``on_log`` on every rank. Only ``state.is_world_process_zero``
gets sinks. The row holds every rank's GPU (``gpu/{rank}/...``, ``gpu/all/...``); the
``train/*`` and ``perf/*`` phase keys are rank 0's. Several GPUs without a launcher (Hugging
Face then wraps the model in ``nn.DataParallel``): the one process samples every GPU it sees,
the tokens of every replica's chunk are counted (their counts meet on the lowest-numbered
GPU), and since the replicas' forwards run on threads of their own, the held row is written at
``on_pre_optimizer_step`` instead of after the forward.

Keys each row can carry, beside the GPU and host keys of :mod:`gpulens.schema` and the core's
``perf/step_time_s`` / ``perf/energy_per_step_j``:

* ``train/<k>`` for each number in Hugging Face's ``logs`` (``train/loss``,
  ``train/learning_rate``, ``train/grad_norm``, ``train/epoch``, ...), not sent to HF's trackers;
* ``perf/data_wait_pct``, ``perf/data_wait_s``: the wall time (CPU) or GPU idle time (CUDA, from
  CUDA events) from the end of ``on_step_end`` (or of the latest ``on_log`` / ``on_evaluate`` /
  ``on_save`` / ``on_epoch_begin`` after it) to ``on_step_begin`` of the next optimizer step.
  In Hugging Face's loop that span holds the fetch of all ``gradient_accumulation_steps``
  micro-batches of the next step (``get_batch_samples``, which also counts the label tokens),
  the epoch's ``iter(dataloader)`` at epoch starts, and the ``on_step_begin`` of callbacks before
  this one. ``_pct`` is a share of the measured step time (data wait + forward/backward +
  optimizer), ``_s`` seconds per optimizer step;
* ``perf/forward_backward_pct|_s``: ``on_step_begin`` -> ``on_pre_optimizer_step``: moving the
  inputs to the device, forward and backward of every micro-batch, gradient clipping;
* ``perf/optimizer_pct|_s``: ``on_pre_optimizer_step`` -> ``on_step_end``: ``optimizer.step()``,
  the LR scheduler step and ``zero_grad``.

See :mod:`gpulens.integrations.phases` for how the phases are timed (CUDA events read with
``query()``, never a device synchronisation).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpulens.finalizers import drop_exit_finalizer, exit_finalizer, unfinished_outcome
from gpulens.integrations.session import (
    SessionCallback,
    TrainingSession,
    WorkSource,
    monitor_for_run,
)
from gpulens.model import Outcome
from gpulens.sinks import SinkSpec, check_sinks, sink_spec, with_options
from gpulens.sinks.base import Sink
from gpulens.transport.spawn import prepare_engine

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gpulens.integrations.transformers needs Hugging Face transformers: "
        "pip install 'gpulens[transformers]'"
    ) from exc


__all__ = ["GPUMonitorCallback"]

log = logging.getLogger(__name__)


class GPUMonitorCallback(SessionCallback, TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Writes a GPU telemetry row at each Hugging Face training log (see the module docstring
    for every key and hook).

    Reads only public fields of Hugging Face's ``TrainingArguments`` (``report_to``,
    ``output_dir``, ``run_name``, ``device``, the precision flags) and ``TrainerState``
    (``global_step``, ``is_world_process_zero``), and the ``model`` handed to
    ``on_train_begin`` (checked against transformers 5.24). The run's lifecycle is
    :class:`gpulens.integrations.session.TrainingSession`'s.

    Args:
        sinks: extra sinks (names such as ``"jsonl:runs/gpu.jsonl"``, ``"prometheus:9401"`` or
            sink objects) that get full rows, training scalars included.
        interval: seconds between the sampler's cheap reads.
        gpus: device indices to sample; ``None``: the devices this process uses.
        backend: ``"nvml"``, ``"simulated"`` or ``None`` (automatic, honours
            ``GPULENS_BACKEND``).
        follow_report_to: send rows to the W&B / MLflow runs of ``args.report_to``.
        phases: time the phases of each step (``perf/data_wait_pct`` ...).
        work: count the tokens of every training forward (the attention mask says which are
            padding) and the model's FLOPs (analytic formula from the model's config, else
            measured once with ``FlopCounterMode`` on the meta device), so that rows carry
            ``perf/tokens_per_s``, ``perf/tflops``, ``perf/mfu_pct`` and
            ``perf/tokens_per_j``; the dtype comes from ``TrainingArguments`` (``bf16``,
            ``fp16``, ``tf32``) and the model.  See :mod:`gpulens.work`.  The forward hook
            only keeps the mask; its row sums (one device operation per micro-batch) are
            launched after the forward, the sums and the FLOPs computed off the thread.
        tracker_keys: what the W&B and MLflow runs of ``report_to`` get: ``"default"`` (a
            handful of job-level GPU figures beside HF's loss: :mod:`gpulens.sinks.layout`) or
            ``"all"``; ``None``: ``GPULENS_TRACKER_KEYS``, else ``"default"``.
        gpm: read GPM (Hopper and newer: ``sm_active_pct``, ``sm_occupancy_pct``,
            ``tensor_active_pct``, ``dram_bw_pct``); ``False`` leaves those keys out. It
            did not make a step cheaper: under DDP on two H200s (37 paired rounds) neither GPM
            off nor no NVML read at all made the step cheaper (``docs/benchmarks.md``,
            "eighth session").
    """

    def __init__(
        self,
        sinks: Sequence[str | Sink] | None = None,
        *,
        interval: float = 0.5,
        gpus: Sequence[int] | None = None,
        backend: str | None = None,
        follow_report_to: bool = True,
        phases: bool = True,
        work: bool = True,
        gpm: bool = True,
        tracker_keys: str | None = None,
    ) -> None:
        super().__init__(sinks, interval, gpus, backend, tracker_keys, phases, work, gpm)
        self.follow_report_to = follow_report_to
        self._tail: tuple[int, dict[str, float], tuple[float, float]] | None = None
        self._mlflow_run: Any = None
        self._mlflow_run_end: Any = None
        """Ends ``_mlflow_run`` FAILED (KILLED) at exit or collection: its train() raised."""

    # -- lifecycle -------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer is built: its train() (datasets, optimizer, the first batch) comes later
        prepare_engine(self.settings)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:  # a previous train() that raised left it running
            self._stop(collective=False, outcome="failed")
            run = self._take_mlflow_run()
            if run is not None:
                _end_mlflow_run(run, "FAILED")
        rank0 = bool(state.is_world_process_zero)
        model = kwargs.get("model")
        dtype, counter = _work_of(args, model) if self.count_work else (None, None)
        monitor = monitor_for_run(self.settings, self._sinks_for(args) if rank0 else [], dtype)
        check_sinks(monitor.sinks)  # a one-line error before any run or file is made
        if rank0 and self._follows(args, "mlflow"):
            self._mlflow_run = run = _ensure_mlflow_run(args)
            if run is not None:  # a train() that raises never reaches on_train_end
                self._mlflow_run_end = exit_finalizer(self, _end_dropped_mlflow_run, run)
        self._tail = None
        step = int(state.global_step)
        # a resumed run starts its windows at the restored step
        work: WorkSource | None = counter.attach(model) if counter is not None else None
        self.session = TrainingSession(monitor, start_step=step, steps_done=step,
                                       phases=self._phases(getattr(args, "device", None)),
                                       work=work, model=model).start()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        step = int(state.global_step)
        if session is not None and session.steps_since_row(step) > 0:
            # the steps since the last training log (or every step, with logging_strategy
            # "no"): a last row, with the end-of-training summary's numbers if it came now;
            # its window ends at that log, not here: what Hugging Face does between the two
            # (loading the best model, MLflowCallback's end_run flushing its queue) is no step
            if self._tail is not None and self._tail[0] == step:
                session.row(step, step, self._tail[1], at=self._tail[2])
            else:
                session.row(step, step, {})
        self._stop()
        run = self._take_mlflow_run()
        if run is not None:
            _end_mlflow_run(run)
        if getattr(state, "is_hyper_param_search", False):
            # a search's next trial calls train() again, with no on_init_end before it
            prepare_engine(self.settings)

    def _take_mlflow_run(self) -> Any:
        """The MLflow run this callback started for this train() (``None``: none), its exit
        hook taken back: the caller ends it."""
        run, self._mlflow_run = self._mlflow_run, None
        end, self._mlflow_run_end = self._mlflow_run_end, None
        if end is not None:
            drop_exit_finalizer(end)
        return run

    def _stop(self, collective: bool = True, outcome: Outcome = "finished") -> None:
        self._tail = None
        super()._stop(collective, outcome)

    # -- step anatomy ----------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.step_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.before_optimizer()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:  # a micro-batch under gradient accumulation
            self.session.micro_step_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.step_end()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resume()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # an evaluation's first batch: a row held since the log is written now, not after
        # the whole evaluation (its window still ends at the log)
        if self.session is not None:
            self.session.flush()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resume(flush=True)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resume(flush=True)

    def _resume(self, flush: bool = False) -> None:
        if self.session is not None:
            if flush:  # a row held for the next step is written before a pause, not after
                self.session.flush()
            self.session.resume()

    # -- rows ------------------------------------------------------------------------------------
    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        session = self.session
        if session is None or not logs:
            return
        step = int(state.global_step)
        scalars = {k: float(v) for k, v in logs.items() if _is_number(v)}
        if "loss" in logs:
            # HF has just read the loss (a device sync): the row is written at the next
            # step's forward, while the device is busy (TrainingSession.row)
            session.row(step, step, scalars, later=True)
            self._tail = None
        elif session.steps_since_row(step) > 0 and not any(k.startswith("eval_") for k in logs):
            # another log between training logs, e.g. the end-of-training summary: its numbers
            # go into the row that on_train_end writes for the steps since the last one, whose
            # window ends here if no step comes before on_train_end
            self._tail = (step, scalars, (time.monotonic(), time.time()))
        session.resume()

    # -- helpers ---------------------------------------------------------------------------------
    def _follows(self, args: Any, tracker: str) -> bool:
        return self.follow_report_to and tracker in list(getattr(args, "report_to", None) or ())

    def _sinks_for(self, args: Any) -> list[str | SinkSpec | Sink]:
        sinks: list[str | SinkSpec | Sink] = []
        user: list[SinkSpec | Sink] = list(self.settings.sinks)
        # the runs HF's WandbCallback / MLflowCallback started in on_train_begin (called
        # before ours); they log HF's loss etc. themselves, so rows skip train/*. Specs: built
        # and written in the engine process (W&B's attached to that run), off training
        for tracker in ("wandb", "mlflow"):
            if not self._follows(args, tracker):
                continue
            spec = sink_spec(tracker, include_train=False, keys=self.tracker_keys)
            same = [s for s in user
                    if isinstance(s, SinkSpec) and _writes_active_run(s, tracker)]
            if same:
                # sinks=["wandb"] (or "mlflow") names the very run report_to writes to: one
                # sink for it, with the user's options. Two W&B sinks of one run failed to
                # open ("attaching settings"), two MLflow sinks wrote every figure twice
                spec = with_options(same[0], include_train=False,
                                    keys=same[0].options.get("keys", self.tracker_keys))
                user = [s for s in user if s not in same]
                log.info("gpulens: sink %r writes into Hugging Face's %s run (report_to), "
                         "once, without train/* (Hugging Face logs those itself)",
                         same[0].name, tracker)
            sinks.append(spec)
        sinks.extend(user)
        if not sinks:
            path = os.path.join(str(args.output_dir), "gpulens.jsonl")
            log.info("gpulens: no W&B/MLflow in report_to and no sinks given; rows go to %s", path)
            sinks.append(f"jsonl:{path}")
        return sinks


def _writes_active_run(sink: SinkSpec, tracker: str) -> bool:
    """``sink`` is a ``tracker`` sink by name that writes into the active run (no run of its
    own, no other MLflow server): the run that Hugging Face's ``report_to`` writes to."""
    if sink.kind != tracker:
        return False
    own = ("run",) if tracker == "wandb" else ("run_id", "tracking_uri")
    return not any(sink.options.get(k) for k in own)


def _ensure_mlflow_run(args: Any) -> Any:
    """The MLflow run Hugging Face will log this ``train()`` call's loss to, started here when
    none is active (see the module docstring); ``None`` when one is active already."""
    import mlflow

    if mlflow.active_run() is not None:
        return None
    run = mlflow.start_run(run_name=getattr(args, "run_name", None))
    log.info("gpulens: started MLflow run %s for this train() call (Hugging Face's "
             "MLflowCallback starts one only for the first)", run.info.run_id)
    return run


def _end_mlflow_run(run: Any, status: str = "FINISHED") -> bool:
    """End ``run`` with ``status`` where it is still this process's active run; whether it
    was."""
    import mlflow

    active = mlflow.active_run()
    if active is None or active.info.run_id != run.info.run_id:
        return False
    mlflow.end_run(status)
    return True


def _end_dropped_mlflow_run(run: Any) -> None:
    """At exit or the callback's collection: the run started for a train() that raised (it
    never reached ``on_train_end``) ends ``FAILED``, ``KILLED`` where the script ends on a
    Ctrl-C; at exit before MLflow's own hook would end it ``FINISHED``.  Collected, Hugging
    Face's ``MLflowCallback.__del__`` may have ended it ``FINISHED`` first: set again."""
    status = unfinished_outcome().upper()
    try:
        if _end_mlflow_run(run, status):
            return
        import mlflow

        client = mlflow.MlflowClient()
        if client.get_run(run.info.run_id).info.status == "FINISHED":
            client.set_terminated(run.info.run_id, status)
    except Exception as exc:  # at exit or in a finalizer: never raise
        log.warning("gpulens: ending MLflow run %s %s failed: %r", run.info.run_id, status, exc)


def _work_of(args: Any, model: Any) -> tuple[str | None, Any]:
    """The run's compute dtype and an unattached token and FLOPs counter for ``model``;
    ``(None, None)``, said once, when they cannot be had (no work is counted then)."""
    if model is None:
        return None, None
    try:
        from gpulens.work.hf import TokenCounter, dtype_from_training_args, model_flops

        return dtype_from_training_args(args, model), TokenCounter(model_flops(model))
    except Exception as exc:  # work figures are extras: never a reason to stop training
        log.warning("gpulens: cannot count this model's tokens and FLOPs (%r); no "
                    "throughput or MFU", exc)
        return None, None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
