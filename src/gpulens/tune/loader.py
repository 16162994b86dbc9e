"""A data loader for a trial's configuration: the user's ``DataLoader`` rebuilt with another
batch size and worker count, or the user's own factory called with them.

* A ``torch.utils.data.DataLoader`` is rebuilt from its own parts: the same dataset, sampler
  (a ``DistributedSampler`` stays one), collate function, ``drop_last``, worker init function,
  generator and timeout; only ``batch_size``, ``num_workers``, and, when a trial sets them,
  ``pin_memory`` and ``prefetch_factor`` change. With workers, the collate function is wrapped
  to note when each worker began and finished each batch (:mod:`gpulens.tune.pace`). A loader
  built on a custom ``batch_sampler`` has no batch size to change: pass a factory instead.
* A factory ``make_loader(batch_size, num_workers=..., pin_memory=..., prefetch_factor=...)`` is
  called with the keywords its signature accepts (``batch_size`` is required); a factory
  without ``num_workers`` is not given a worker sweep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from gpulens.tune.model import Config
from gpulens.tune.pace import LoaderPace

LOADER_KEYWORDS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor")


def _is_dataloader(source: object) -> bool:
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is there whenever a loader is
        return False
    return isinstance(source, DataLoader)


def accepted_keywords(factory: Callable[..., Any]) -> frozenset[str]:
    """The loader keywords ``factory`` takes (all of them when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return frozenset(LOADER_KEYWORDS)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(LOADER_KEYWORDS)
    return frozenset(k for k in LOADER_KEYWORDS if k in params)


def check_source(source: object) -> None:
    """``ValueError`` (one line) when ``source`` cannot give loaders for other batch sizes."""
    if _is_dataloader(source):
        if getattr(source, "batch_size", None) is None:
            raise ValueError(
                "gpulens tune: this DataLoader uses a batch_sampler, so its batch size cannot "
                "be changed; pass a function make_loader(batch_size, num_workers) instead")
        return
    if not callable(source):
        raise ValueError("gpulens tune: loader must be a torch DataLoader or a function "
                         f"make_loader(batch_size, num_workers), not {type(source).__name__}")
    if "batch_size" not in accepted_keywords(source):
        raise ValueError("gpulens tune: the loader function must take a batch_size argument "
                         "(make_loader(batch_size, num_workers))")


def sweeps_workers(source: object) -> bool:
    """Whether trials can change the loader's worker count."""
    return _is_dataloader(source) or "num_workers" in accepted_keywords(source)  # type: ignore[arg-type]


def defaults(source: object) -> Config | None:
    """The loader's own setting (batch size, workers, pin_memory, prefetch_factor), when the
    source is a DataLoader."""
    if not _is_dataloader(source):
        return None
    loader: Any = source
    return Config(batch_size=int(loader.batch_size), num_workers=int(loader.num_workers),
                  pin_memory=bool(loader.pin_memory), prefetch_factor=loader.prefetch_factor)


def generators(source: object) -> list[Any]:
    """The ``torch.Generator`` objects a loader rebuilt from ``source`` shares with it (its own,
    its sampler's, its batch sampler's sampler's): the trials advance them."""
    if not _is_dataloader(source):
        return []
    loader: Any = source
    samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    found = [loader.generator, *(getattr(s, "generator", None) for s in samplers)]
    return [g for g in found if g is not None]


def pace_for(source: object, config: Config) -> LoaderPace | None:
    """What times the workers of the loader a trial with ``config`` rebuilds from ``source``
    (:mod:`gpulens.tune.pace`); ``None`` without workers, or for a factory (the loader is of
    your making)."""
    if not _is_dataloader(source) or config.num_workers < 1:
        return None
    return LoaderPace(config.num_workers)


def loader_for(source: object, config: Config, pace: LoaderPace | None = None) -> Iterable[Any]:
    """The loader a trial with ``config`` iterates (its workers timed by ``pace``, when the
    loader is rebuilt)."""
    if _is_dataloader(source):
        rebuilt: Iterable[Any] = rebuild(source, config, pace)
        return rebuilt
    factory: Callable[..., Iterable[Any]] = source  # type: ignore[assignment]
    accepted = accepted_keywords(factory)
    values = {"batch_size": config.batch_size, "num_workers": config.num_workers,
              "pin_memory": config.pin_memory, "prefetch_factor": config.prefetch_factor}
    kwargs = {k: v for k, v in values.items() if k in accepted and v is not None}
    made: Iterable[Any] = factory(**kwargs)
    return made


def rebuild(loader: Any, config: Config, pace: LoaderPace | None = None) -> Any:
    """``loader`` rebuilt for ``config`` (module docstring); with ``pace``, its collate
    function notes in each worker when each batch began and was done."""
    from torch.utils.data import DataLoader, IterableDataset

    workers = config.num_workers
    collate = loader.collate_fn
    kwargs: dict[str, Any] = {
        "batch_size": config.batch_size,
        "num_workers": workers,
        "collate_fn": pace.wrap(collate) if pace is not None and workers > 0 else collate,
        "pin_memory": loader.pin_memory if config.pin_memory is None else config.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout if workers > 0 else 0,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    if workers > 0:
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
        kwargs["persistent_workers"] = loader.persistent_workers
        kwargs["prefetch_factor"] = config.prefetch_factor or loader.prefetch_factor or 2
    if not isinstance(loader.dataset, IterableDataset):
        kwargs["sampler"] = loader.sampler
    return DataLoader(loader.dataset, **kwargs)
