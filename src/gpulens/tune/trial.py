"""One trial: warm-up steps, then a timed window of real training steps, turned into figures.

A framework adapter runs the user's training and calls a :class:`Recorder` at the edges of
every (micro-)batch, exactly as :class:`gpulens.integrations.phases.StepPhases` is marked::

    rec.step_begin(batch)        # batch in hand
    rec.before_optimizer()       # gradients ready (the plain loop: a global optimizer hook)
    rec.step_end()               # step done; rec.done says when to stop

**Timing.** The window starts at the end of the last warm-up optimizer step and ends at the end
of the last timed one. The device is synchronised at those two edges only (this is a tuning
run: two syncs per trial cost nothing that matters), never per step. Inside the window the
phases (data wait, forward+backward, optimizer) are timed by ``StepPhases``: with CUDA events on
the GPU's timeline on a CUDA device (the data wait is then the time the GPU sat idle waiting for
the next batch), with the host clock on a CPU; they are read after the closing sync.

**The loader's pace.** Where the adapter built the loader with workers, it passes the
recorder a :class:`gpulens.tune.pace.LoaderPace`: a window that ran on batches queued during
the warm-up then reads the data wait from the workers' own time per batch instead.

**Work.** Samples come from the batches (their leading dimension) or from the adapter; tokens
and model FLOPs from :class:`gpulens.work.hf.TokenCounter` when the model has a Hugging Face
config (a forward pre-hook; counts stay on the device until the closing sync), else from
``tokens_per_sample``. Rates, TFLOP/s and MFU come from :func:`gpulens.work.mfu.window_perf`.

**Memory.** On CUDA the allocator's peak statistics are reset before the trial; after it, the
peak allocated and reserved bytes, the device's total memory and the allocator's retries
(``num_alloc_retries``) during the trial.

**Out of memory** (``torch.OutOfMemoryError``, or a RuntimeError whose message says the device
or cuBLAS could not allocate) is data: the trial comes back with ``status="oom"``, the
exception's frames are released, gradients are dropped (the adapter's clean-up), then Python's
garbage is collected and the allocator's cache emptied, so the next trial starts from the same
memory state. Any other exception propagates.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpulens.integrations.phases import StepPhases
from gpulens.tune.model import Config, Trial, TuneSettings
from gpulens.tune.pace import LoaderPace
from gpulens.work import mfu as mfu_keys
from gpulens.work.mfu import window_perf

GB = 1e9

_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed", "can't allocate memory",
             "failed to allocate")


class TrialFailed(Exception):
    """A trial that could not be timed (e.g. the loader gave no batch): recorded as
    ``status="failed"`` with this message."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says a device (or the host allocator) ran out of memory."""
    import sys

    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, (RuntimeError, MemoryError)):
        text = str(exc).lower()
        return isinstance(exc, MemoryError) or any(t in text for t in _OOM_TEXT)
    return False


@dataclass
class TrialContext:
    """What every trial of one sweep shares: where it runs and how work is counted."""

    device: Any = None
    """The ``torch.device`` the training runs on (``None`` or CPU: host clock, no memory)."""
    world_size: int = 1
    token_counter: Any = None
    """A :class:`gpulens.work.hf.TokenCounter` attached to the model, or ``None``."""
    tokens_per_sample: float | None = None
    flops_per_sample: float | None = None
    peak_tflops: float | None = None
    """Dense peak of one GPU in the run's dtype (:func:`gpulens.work.peaks.peak_for`)."""

    @property
    def cuda(self) -> bool:
        return getattr(self.device, "type", None) == "cuda"


def batch_samples(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor (dicts, lists, tuples and
    objects with tensor attributes are searched in order); ``None`` when none is found."""
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    items: Sequence[Any]
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        data = getattr(batch, "__dict__", None)
        items = list(data.values()) if isinstance(data, dict) else []
    for item in items:
        n = batch_samples(item) if not isinstance(item, (str, bytes)) else None
        if n is not None:
            return n
    return None


class Recorder:
    """Marks of one trial -> its timed window, phases and work (module docstring)."""

    def __init__(self, config: Config, settings: TuneSettings, ctx: TrialContext,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.settings = settings
        self.ctx = ctx
        self._now = now
        self.done = False
        self.optimizer_steps = 0
        self.timed_steps = 0
        self._opt_marked = False
        self._phases: StepPhases | None = None
        self._t0: float | None = None
        self._t1: float | None = None
        self._samples = 0.0
        self._samples_known = True
        self._tokens: float | None = None
        self._flops: float | None = None
        self._pace: LoaderPace | None = None
        if settings.warmup_steps == 0:
            self._open()

    @property
    def timing(self) -> bool:
        """Whether the timed window is open."""
        return self._t0 is not None and not self.done

    def watch(self, pace: LoaderPace | None) -> None:
        """Take the data wait from ``pace`` (the loader workers' own batch times) where it is
        more than the window measured (:mod:`gpulens.tune.pace`)."""
        self._pace = pace

    # -- marks --------------------------------------------------------------------------------
    def step_begin(self, batch: Any = None, *, samples: float | None = None) -> None:
        """A (micro-)batch is in hand: forward+backward starts. ``batch`` (or ``samples``)
        counts its samples when the window is open; with neither, the adapter gives them to
        :meth:`step_end`."""
        if not self.timing:
            return
        assert self._phases is not None
        self._phases.step_begin()
        if batch is None and samples is None:
            return
        n = samples if samples is not None else batch_samples(batch)
        if n is None:
            self._samples_known = False
        else:
            self._samples += n

    def before_optimizer(self) -> None:
        """Gradients are ready; the optimizer step starts."""
        self._opt_marked = True
        if self.timing:
            assert self._phases is not None
            self._phases.before_optimizer()

    def step_end(self, optimizer_step: bool | None = None, *,
                 samples: float | None = None) -> None:
        """A (micro-)batch is done. ``optimizer_step``: whether it ended an optimizer step
        (``None``: if :meth:`before_optimizer` was marked since the last end). ``samples``: the
        samples of the whole step, for adapters that never see the batch (HF's callbacks)."""
        stepped = self._opt_marked if optimizer_step is None else optimizer_step
        self._opt_marked = False
        if self.timing:
            assert self._phases is not None
            self._phases.step_end()
            if samples is not None:
                self._samples += samples
        if not stepped or self.done:
            return
        self.optimizer_steps += 1
        if self._t0 is None:
            if self.optimizer_steps >= self.settings.warmup_steps:
                self._open()
            return
        self.timed_steps += 1
        limit = self.settings.max_trial_s
        if self.timed_steps >= self.settings.steps or (
                limit is not None and self.ctx.world_size == 1
                and self._now() - self._t0 >= limit):
            self._close()

    # -- the window ---------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.ctx.cuda:
            import torch

            torch.cuda.synchronize(self.ctx.device)

    def _open(self) -> None:
        self._sync()
        if self.ctx.token_counter is not None:
            self.ctx.token_counter.take()
        self._phases = StepPhases(cuda=self.ctx.cuda)
        self._phases.resume()
        self._t0 = self._now()

    def _close(self) -> None:
        self._sync()
        self._t1 = self._now()
        self.done = True
        if self.ctx.token_counter is not None:
            work = self.ctx.token_counter.take()
            if work.micro_batches:
                self._tokens = float(work.tokens)
                self._flops = None if work.flops is None else float(work.flops)

    def figures(self) -> dict[str, Any]:
        """The trial's figures (``Trial`` field names); empty when the window never closed."""
        if self._t0 is None or self._t1 is None or self.timed_steps == 0:
            return {}
        assert self._phases is not None
        seconds = self._t1 - self._t0
        ctx = self.ctx
        tokens = self._tokens
        if tokens is None and ctx.tokens_per_sample is not None and self._samples_known:
            tokens = self._samples * ctx.tokens_per_sample
        flops = self._flops
        if flops is None and ctx.flops_per_sample is not None and self._samples_known:
            flops = self._samples * ctx.flops_per_sample
        perf = window_perf(seconds=seconds, gpus=1, tokens=tokens,
                           samples=self._samples if self._samples_known else None,
                           flops=flops, peak_tflops=ctx.peak_tflops)
        out: dict[str, Any] = {
            "steps": self.timed_steps, "seconds": seconds,
            "step_s": seconds / self.timed_steps,
            "samples_per_s": perf.get(mfu_keys.SAMPLES_PER_S),
            "tokens_per_s": perf.get(mfu_keys.TOKENS_PER_S),
            "tflops": perf.get(mfu_keys.TFLOPS), "mfu_pct": perf.get(mfu_keys.MFU_PCT),
        }
        for key, value in self._phases.collect(self.timed_steps).items():
            out[key.removeprefix("perf/")] = value
        if self._pace is not None:
            out = self._pace.correct(out, self._t0, self._t1, self.config.accumulation,
                                     self.settings.data_wait_pct)
        return out


class DeviceMemory:
    """The CUDA allocator's figures for one trial (nothing on a CPU device)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._retries = 0

    @property
    def cuda(self) -> bool:
        return getattr(self.device, "type", None) == "cuda"

    def reset(self) -> None:
        if not self.cuda:
            return
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        self._retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def read(self) -> dict[str, Any]:
        if not self.cuda:
            return {}
        import torch

        stats = torch.cuda.memory_stats(self.device)
        _free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device) / GB
        return {
            "peak_allocated_gb": torch.cuda.max_memory_allocated(self.device) / GB,
            "peak_reserved_gb": reserved, "total_gb": total / GB,
            "headroom_gb": total / GB - reserved,
            "alloc_retries": int(stats.get("num_alloc_retries", 0)) - self._retries,
        }


def free_memory(device: Any, collect: bool = False) -> None:
    """Return the allocator's cached blocks to the device; with ``collect``, first collect
    Python's garbage (what an out-of-memory traceback held in reference cycles). Only after an
    out-of-memory error: a collection costs 0.3-0.8 s in a process that imported torch and
    transformers, more than a short trial."""
    if collect:
        gc.collect()
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()


def run_trial(run: Callable[[Recorder], None], config: Config, settings: TuneSettings,
              ctx: TrialContext, cleanup: Callable[[], None] | None = None) -> Trial:
    """Run one trial: ``run(recorder)`` trains until ``recorder.done``. Returns its figures;
    an out-of-memory error becomes ``status="oom"`` (module docstring)."""
    memory = DeviceMemory(ctx.device)
    free_memory(ctx.device)
    memory.reset()
    rec = Recorder(config, settings, ctx)
    start = time.perf_counter()
    status = "ok"
    error: str | None = None
    try:
        run(rec)
    except TrialFailed as exc:
        status, error = "failed", str(exc)
    except BaseException as exc:
        if not is_oom(exc):
            if cleanup is not None:
                cleanup()
            raise
        status, error = "oom", _first_line(exc)
        exc.__traceback__ = None  # the frames hold the step's activations
    figures: dict[str, Any] = rec.figures() if status == "ok" else {}
    if status == "ok" and not figures:
        status, error = "failed", (
            f"no timed step: the training stopped after {rec.optimizer_steps} optimizer "
            f"step(s), warm-up is {settings.warmup_steps}")
    mem = memory.read()
    if cleanup is not None:
        cleanup()
    free_memory(ctx.device, collect=status != "ok")
    trial = Trial(config=config, status=status,  # type: ignore[arg-type]
                  error=error, world_size=ctx.world_size, **mem,
                  **{k: v for k, v in figures.items() if k in _TRIAL_FIELDS})
    trial.wall_s = time.perf_counter() - start
    return trial


_TRIAL_FIELDS = frozenset(Trial.__dataclass_fields__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    head = text[0] if text else ""
    return f"{type(exc).__name__}: {head}"[:300]
