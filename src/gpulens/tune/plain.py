"""Plain PyTorch: ``tune(loader, step)``.

::

    from gpulens.tune import tune

    result = tune(train_loader, train_step, model=model, optimizer=optimizer, dtype="bf16")
    print(result.chosen.config)            # Config(batch_size=48, num_workers=4, ...)

``loader`` is the ``DataLoader`` you train with (rebuilt for each trial's batch size and worker
count) or a function ``make_loader(batch_size, num_workers)`` returning one. ``step(batch)``
is one training step on one batch: forward, backward, optimizer step, ``zero_grad``. The time
until the optimizer's ``step`` is forward+backward, the rest the optimizer phase (found with a
global optimizer pre-hook, no change to your code).

With ``global_batch=`` the sweep keeps ``batch x accumulation x world size`` fixed: pass
``step`` that does forward and backward only and ``optimizer_step()`` that steps and zeroes
the gradients; the tuner calls ``step`` ``accumulation`` times per ``optimizer_step``.

``model`` and ``optimizer`` are optional but recommended: their ``state_dict`` is put back
after the sweep (tuning runs real steps; the random number generators, torch's, Python's,
NumPy's and the loader's, are put back too), their gradients are dropped after an out-of-memory
trial, and a Hugging Face model gives tokens/s and model FLOPs (MFU with ``dtype``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpulens.tune import loader as loaders
from gpulens.tune.model import Config, TuneResult, TuneSettings
from gpulens.tune.runner import make_context, restored, rng_kept, sweep
from gpulens.tune.trial import Recorder, TrialFailed


@dataclass
class TuneJob:
    """The plain-PyTorch pieces of a training (the module docstring says what each is). A
    function ``module:function`` returning one is what ``gpulens tune`` runs."""

    loader: Any
    """A ``DataLoader``, or ``make_loader(batch_size, num_workers, ...) -> iterable``."""
    step: Callable[[Any], Any]
    optimizer_step: Callable[[], Any] | None = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    """Put back after the sweep, like the model and optimizer."""
    dtype: object = None
    """The compute dtype (``"bf16"``, ``torch.bfloat16``...), for MFU."""
    tokens_per_sample: float | None = None
    flops_per_sample: float | None = None
    """Training model FLOPs per sample, for MFU when the model is not a Hugging Face one."""
    current: Config | None = None
    """Your current setting (the ``DataLoader``'s own when ``loader`` is one)."""
    device: Any = None


class PlainWorkload:
    """Runs ``job.step`` over ``job.loader`` for one trial."""

    def __init__(self, job: TuneJob) -> None:
        self.job = job

    def run(self, config: Config, rec: Recorder) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        job = self.job
        pace = loaders.pace_for(job.loader, config)
        rec.watch(pace)
        data = loaders.loader_for(job.loader, config, pace)
        hook = register_optimizer_step_pre_hook(lambda *_: rec.before_optimizer())
        it = iter(data)
        try:
            while not rec.done:
                for micro in range(config.accumulation):
                    batch = _next(it)
                    if batch is _END:
                        it = iter(data)
                        batch = _next(it)
                        if batch is _END:
                            raise TrialFailed(f"the loader gave no batch at batch size "
                                              f"{config.batch_size}")
                    last = micro == config.accumulation - 1
                    rec.step_begin(batch)
                    job.step(batch)
                    if last and job.optimizer_step is not None:
                        job.optimizer_step()
                    rec.step_end(optimizer_step=last)
                    del batch
        finally:
            hook.remove()
            del it  # shuts the loader's workers down

    def cleanup(self) -> None:
        opt = self.job.optimizer
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        model = self.job.model
        if model is not None:
            for p in model.parameters():
                p.grad = None


_END = object()


def _next(it: Any) -> Any:
    try:
        return next(it)
    except StopIteration:
        return _END


def settings_from(settings: TuneSettings | None, overrides: dict[str, Any]) -> TuneSettings:
    """``settings`` (default ones when ``None``) with keyword overrides, checked."""
    base = settings or TuneSettings()
    for name in ("batch_sizes", "workers"):
        if overrides.get(name) is not None:
            overrides[name] = tuple(overrides[name])
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TuneSettings)}
    if unknown:
        raise TypeError(f"gpulens tune: unknown setting(s) {', '.join(sorted(unknown))}")
    return dataclasses.replace(base, **overrides).check()


def tune_job(job: TuneJob, settings: TuneSettings | None = None, *, progress: bool = True,
             restore: bool = True, **overrides: Any) -> TuneResult:
    """Sweep ``job`` (see :func:`tune`)."""
    settings = settings_from(settings, overrides)
    loaders.check_source(job.loader)
    if settings.global_batch is not None and job.optimizer_step is None:
        raise ValueError("gpulens tune: a fixed global_batch accumulates gradients: pass "
                         "step (forward+backward) and optimizer_step (step and zero_grad)")
    defaults = loaders.defaults(job.loader)
    current = job.current or (dataclasses.replace(defaults, pin_memory=None,
                                                  prefetch_factor=None) if defaults else None)
    ctx = make_context(model=job.model, device=job.device, dtype=job.dtype,
                       tokens_per_sample=job.tokens_per_sample,
                       flops_per_sample=job.flops_per_sample)
    try:
        with restored(*(job.model, job.optimizer, job.scheduler) if restore else ()), \
                rng_kept(*loaders.generators(job.loader)):
            return sweep(PlainWorkload(job), ctx, settings, current=current,
                         loader_defaults=defaults, progress=progress,
                         sweeps_workers=loaders.sweeps_workers(job.loader))
    finally:
        if ctx.token_counter is not None:
            ctx.token_counter.detach()


def tune(loader: Any, step: Callable[[Any], Any], *,
         optimizer_step: Callable[[], Any] | None = None, model: Any = None,
         optimizer: Any = None, scheduler: Any = None, dtype: object = None,
         tokens_per_sample: float | None = None, flops_per_sample: float | None = None,
         current: Config | tuple[int, int] | None = None, device: Any = None,
         settings: TuneSettings | None = None, progress: bool = True, restore: bool = True,
         **overrides: Any) -> TuneResult:
    """Choose the batch size and loader workers of a plain PyTorch training by measured
    throughput (module docstring). Every rank calls it under DDP.

    Args:
        loader: the ``DataLoader``, or ``make_loader(batch_size, num_workers)``.
        step: ``step(batch)``: one training step (or forward+backward with
            ``optimizer_step``).
        current: your setting, ``(batch_size, num_workers)`` or a :class:`Config`, measured
            first so the result says how much faster the choice is (default: the DataLoader's).
        settings / overrides: :class:`TuneSettings`, or its fields as keywords
            (``budget_s=300, workers=(0, 2, 4), global_batch=256``...).
        progress: show the progress on stderr (rank 0).
        restore: put the model's, optimizer's and scheduler's state back afterwards.

    Returns:
        The :class:`TuneResult`: ``result.chosen.config`` is the recommendation;
        ``gpulens.tune.print_report(result)`` shows why.
    """
    if isinstance(current, tuple):
        current = Config(int(current[0]), int(current[1]))
    job = TuneJob(loader=loader, step=step, optimizer_step=optimizer_step, model=model,
                  optimizer=optimizer, scheduler=scheduler, dtype=dtype,
                  tokens_per_sample=tokens_per_sample, flops_per_sample=flops_per_sample,
                  current=current, device=device)
    return tune_job(job, settings, progress=progress, restore=restore, **overrides)
