"""What every entry point shares: a workload (the user's training, one trial at a time), the
context of its trials (device, work counting, the MFU peak), the sweep around it, and putting
the model and optimizer back as they were.

An adapter (plain PyTorch, Hugging Face, Lightning) is a :class:`Workload`: ``run(config, rec)``
trains with ``config`` until ``rec.done``, marking the recorder; ``cleanup()`` drops what a
trial left (gradients; after an out-of-memory error, whatever the framework held).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from gpulens.log import logger
from gpulens.tune import dist
from gpulens.tune.model import Config, TuneResult, TuneSettings, workers_grid
from gpulens.tune.progress import make_progress
from gpulens.tune.space import BatchSpace
from gpulens.tune.sweep import Sweep
from gpulens.tune.trial import Recorder, TrialContext, run_trial


class Workload(Protocol):
    """The user's training, run one trial at a time (module docstring)."""

    def run(self, config: Config, rec: Recorder) -> None: ...

    def cleanup(self) -> None: ...


def unwrap(model: Any) -> Any:
    """The module inside DDP / FSDP-style wrappers (``.module``)."""
    while model is not None and hasattr(model, "module") and hasattr(model, "parameters"):
        model = model.module
    return model


def model_device(model: Any) -> Any:
    """The device of the model's first parameter (``None`` without parameters)."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return None
    for p in params():
        return p.device
    return None


def make_context(*, model: Any = None, device: Any = None, dtype: object = None,
                 tokens_per_sample: float | None = None,
                 flops_per_sample: float | None = None) -> TrialContext:
    """The trials' context: the device (given, else the model's, else the CPU), a token
    counter on a Hugging Face model, the dense peak of the GPU in ``dtype`` for MFU."""
    import torch

    if device is None:
        device = model_device(model)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ctx = TrialContext(device=device, world_size=dist.world()[1],
                       tokens_per_sample=tokens_per_sample, flops_per_sample=flops_per_sample)
    inner = unwrap(model)
    if tokens_per_sample is None and getattr(getattr(inner, "config", None), "model_type",
                                             None):
        from gpulens.work.hf import TokenCounter, model_flops

        ctx.token_counter = TokenCounter(model_flops(inner)).attach(inner)
    if ctx.cuda and dtype is not None:
        from gpulens.work.peaks import peak_for

        name, memory_gb, power_w = _gpu_facts(device)
        peak = peak_for(name, dtype, memory_gb=memory_gb, power_limit_w=power_w)
        ctx.peak_tflops = peak.tflops if peak is not None else None
    return ctx


def _gpu_facts(device: Any) -> tuple[str, float, float | None]:
    """Name, memory (GB) and default power limit (W) of a CUDA device: what tells GPU variants
    apart for the MFU peak (an H100 SXM from a PCIe). Read once, before any trial, through
    gpulens's NVML door; torch's name and memory without NVML (no power limit: a variant the
    name does not settle then has no peak, and ``peak_for`` says so)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    name, memory_gb = str(torch.cuda.get_device_name(device)), props.total_memory / 1e9
    from gpulens.errors import GpulensError
    from gpulens.sources.nvml import NvmlSource

    source = NvmlSource()
    try:
        source.open()
        visible = source.visible_gpus()
        index = device.index or 0
        if index >= len(visible):
            return name, memory_gb, None
        info = source.device(visible[index].nvml_index).info(index)
        return info.name, info.mem_total_gb or memory_gb, (
            info.default_power_limit_w or info.power_limit_w)
    except GpulensError:
        return name, memory_gb, None
    finally:
        source.close()


def describe_device(ctx: TrialContext) -> str:
    if ctx.cuda:
        import torch

        return str(torch.cuda.get_device_name(ctx.device))
    return "CPU"


def cpus_per_rank() -> int | None:
    """The CPUs this process may use, shared by the ranks of its node (``LOCAL_WORLD_SIZE``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cpus // max(1, local)) if cpus else None


def worker_settings(settings: TuneSettings, *, sweeps_workers: bool, current: Config | None,
                    cpus: int | None) -> tuple[TuneSettings, list[str]]:
    """The worker counts a sweep tries: none above the CPUs per rank, only the current count
    when the loader cannot change it; with the notes that say so."""
    notes: list[str] = []
    grid = workers_grid(settings.workers, cpus if settings.workers_per_cpu else None)
    if grid != settings.workers:
        notes.append(f"worker counts above the {cpus} CPU(s) per rank were left out")
    if not sweeps_workers:
        grid = (current.num_workers if current is not None else 0,)
        notes.append("the loader function takes no num_workers: workers were not swept")
    return dataclasses.replace(settings, workers=grid), notes


def sweep(workload: Workload, ctx: TrialContext, settings: TuneSettings, *,
          current: Config | None = None, loader_defaults: Config | None = None,
          sweeps_workers: bool = True, progress: bool = True) -> TuneResult:
    """Run the sweep over ``workload`` (every rank under DDP) and return its result."""
    rank, size = dist.world()
    settings, notes = worker_settings(settings, sweeps_workers=sweeps_workers, current=current,
                                      cpus=dist.agree_min(cpus_per_rank()))
    space = BatchSpace.from_settings(settings, size)
    if current is not None and space.global_batch is not None:
        acc = space.accumulation(current.batch_size) if space.allowed(current.batch_size) \
            else current.accumulation
        current = dataclasses.replace(current, accumulation=acc)
    if ctx.token_counter is None and ctx.tokens_per_sample is None:
        notes.append("tokens are not counted (no Hugging Face model, no tokens_per_sample): "
                     "samples/s only")
    if ctx.cuda and ctx.peak_tflops is None:
        notes.append("no MFU: the compute dtype or the GPU's peak is unknown")

    def measure(config: Config, role: str) -> Any:
        trial = run_trial(lambda rec: workload.run(config, rec), config, settings, ctx,
                          workload.cleanup)
        trial = dist.agree(trial)
        if trial.status == "oom":
            logger.info("gpulens tune: %s ran out of memory (recorded; the sweep goes on)",
                        config.label())
        return trial

    defaults = loader_defaults or Config(1)
    runner = Sweep(measure, settings, space, current=current, cuda=ctx.cuda,
                   pin_memory=defaults.pin_memory if loader_defaults else None,
                   prefetch_factor=defaults.prefetch_factor,
                   progress=make_progress(progress and rank == 0),
                   device=describe_device(ctx), notes=notes)
    return runner.run()


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


@contextmanager
def restored(*objects: Any) -> Iterator[None]:
    """Put each object's ``state_dict`` (a model, an optimizer, a scheduler) back after the
    block: tuning runs real steps, which move the weights and fill the optimizer's state.
    Snapshots are kept in host memory."""
    saved = [(o, _to_cpu(o.state_dict())) for o in objects if o is not None]
    try:
        yield
    finally:
        for obj, state in saved:
            obj.load_state_dict(state)


@contextmanager
def rng_kept(*generators: Any) -> Iterator[None]:
    """Put the random number generators back after the block: torch's global ones (CPU, and
    CUDA), Python's and NumPy's, and each ``torch.Generator`` given (a loader's or its
    sampler's, which the trials' loaders share). Trials draw from them (shuffling, dropout,
    worker seeds): without this, a seeded training tuned first would see other data orders and
    masks than the same training untuned.

    Where the trials were what started CUDA (a Lightning module still on the CPU, a step that
    moves the batch), there was no CUDA state to save: each device's generator is seeded back
    with the seed it started with (``torch.manual_seed`` before CUDA starts is applied then),
    at offset 0, the state the training would have found had it started CUDA itself."""
    import random
    import sys

    import torch

    gens = [g for g in dict.fromkeys(generators) if isinstance(g, torch.Generator)]
    states = [(g, g.get_state()) for g in gens]
    cpu = torch.get_rng_state()
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call,unused-ignore]
    cuda = torch.cuda.get_rng_state_all() if started else None
    py = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif torch.cuda.is_initialized():  # type: ignore[no-untyped-call,unused-ignore]
            for gen in torch.cuda.default_generators:  # started in the block: as it started
                gen.manual_seed(gen.initial_seed())
        random.setstate(py)
        if numpy is not None and np_state is not None:
            numpy.random.set_state(np_state)
