"""Trials in fresh processes: ``gpulens tune --isolate MODULE:FUNCTION``.

In one process an out-of-memory trial can leave the allocator's cache fragmented, or objects
held, so that later trials read slower; ``benchmarks/tune_gpu.py`` measures whether it does
(the same configuration before and after an out-of-memory trial). Where it does, each trial
runs in a process of its own: the process imports ``MODULE``, calls ``FUNCTION()`` for the
:class:`~gpulens.tune.plain.TuneJob`, runs one trial and sends its figures back. A first
process only describes the job (the loader's own setting, the device) so that the sweep can
start (it also measures the current setting). Each trial then pays for building the job again
(model, loader): slower, and exact.

Processes are started with ``spawn`` (CUDA cannot be used in a forked child), one at a time;
a trial's loader workers start by the platform's default method, as the user's training starts
them. A trial process that dies without an answer (killed, a crash of the driver) is recorded
as a ``failed`` trial and the sweep goes on; on Ctrl-C the running trial's process is ended
with the sweep. Not for DDP (each rank would need its own group).
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing as mp
from typing import Any

from gpulens.tune import loader as loaders
from gpulens.tune.model import Config, Trial, TuneResult, TuneSettings
from gpulens.tune.plain import PlainWorkload, TuneJob
from gpulens.tune.progress import make_progress
from gpulens.tune.runner import cpus_per_rank, describe_device, make_context, worker_settings
from gpulens.tune.space import BatchSpace
from gpulens.tune.sweep import Sweep
from gpulens.tune.trial import run_trial


class JobError(ValueError):
    """A ``MODULE:FUNCTION`` that gives no job (one line, for the command line); what the
    function itself raises is the user's, and propagates as it is."""


def load_job(spec: str) -> TuneJob:
    """Call ``module:function`` and return its :class:`TuneJob` (a dict of its fields is
    accepted too). :class:`JobError` with one line for a spec that does not give one."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise JobError(f"expected MODULE:FUNCTION, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise JobError(f"cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise JobError(f"{module_name!r} has no function {attr!r}")
    job = fn()
    if isinstance(job, dict):
        job = TuneJob(**job)
    if not isinstance(job, TuneJob):
        raise JobError(f"{spec}() returned a {type(job).__name__}, not a "
                       "gpulens.tune.TuneJob")
    return job


def _child(spec: str, config: Config | None, settings: TuneSettings, conn: Any) -> None:
    """In the fresh process: run the trial of ``config``; with ``config`` None, describe the
    job and run the trial of its current setting.

    The process was spawned, which made "spawn" its default start method; the job's loader
    workers start as the user's training starts them instead, by the platform's default
    (fork on Linux), not as fresh interpreters that import torch again (seconds a trial)."""
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    try:
        job = load_job(spec)
        ctx = make_context(model=job.model, device=job.device, dtype=job.dtype,
                           tokens_per_sample=job.tokens_per_sample,
                           flops_per_sample=job.flops_per_sample)
        answer: dict[str, Any] = {}
        if config is None:  # describe the job, and measure its current setting
            defaults = loaders.defaults(job.loader)
            current = job.current or (dataclasses.replace(
                defaults, pin_memory=None, prefetch_factor=None) if defaults else None)
            answer = {"current": current, "defaults": defaults, "cuda": ctx.cuda,
                      "device": describe_device(ctx),
                      "sweeps_workers": loaders.sweeps_workers(job.loader)}
            config = current
        if config is not None:
            workload = PlainWorkload(job)
            answer["trial"] = run_trial(lambda rec: workload.run(config, rec), config,
                                        settings, ctx, workload.cleanup).to_dict()
        conn.send(answer)
    except BaseException as e:  # the parent reports it; the child only ends
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _ask(spec: str, config: Config | None, settings: TuneSettings) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    # not a daemon: a daemon may not start the loader's worker processes
    proc = ctx.Process(target=_child, args=(spec, config, settings, send))
    proc.start()
    send.close()
    try:
        answer: dict[str, Any] = receive.recv()
    except EOFError:
        answer = {}
    except KeyboardInterrupt:  # Ctrl-C: the trial ends with the sweep (its workers see it go)
        proc.terminate()
        proc.join()
        raise
    proc.join()
    if not answer:
        answer = {"died": f"the trial process ended with exit code {proc.exitcode} and no "
                          "answer"}
    return answer


def tune_isolated(spec: str, settings: TuneSettings, *, progress: bool = True) -> TuneResult:
    """The sweep of :func:`gpulens.tune.tune_job`, each trial in a fresh process."""
    info = _ask(spec, None, settings)
    if "error" in info or "died" in info:
        raise JobError(f"{spec}: {info.get('error') or info.get('died')}")
    settings, notes = worker_settings(settings, sweeps_workers=info["sweeps_workers"],
                                      current=info["current"], cpus=cpus_per_rank())

    first = info.get("trial")

    def measure(config: Config, role: str) -> Trial:
        nonlocal first
        if first is not None and role == "current":
            trial, first = Trial.from_dict(first), None
            return trial
        answer = _ask(spec, config, settings)
        if "trial" in answer:
            return Trial.from_dict(answer["trial"])
        if "error" in answer:
            raise RuntimeError(f"gpulens tune: a trial of {config.label()} raised "
                               f"{answer['error']}")
        return Trial(config, "failed", error=answer["died"])

    defaults: Config | None = info["defaults"]
    current: Config | None = info["current"]
    sweep = Sweep(measure, settings, BatchSpace.from_settings(settings), current=current,
                  cuda=info["cuda"], pin_memory=defaults.pin_memory if defaults else None,
                  prefetch_factor=defaults.prefetch_factor if defaults else None,
                  progress=make_progress(progress), device=info["device"],
                  notes=["each trial ran in a fresh process", *notes])
    return sweep.run()
