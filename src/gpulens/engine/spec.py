"""What the client tells the engine at start: a picklable spec (it crosses to the sampler
process), from which :class:`gpulens.engine.engine.Engine` builds everything."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from gpulens.sinks.base import Sink


@dataclass(frozen=True)
class SinkSpec:
    """How to rebuild a sink in the engine: ``target`` is ``"module:Class"``, called with
    ``kwargs`` (a sink's ``remote_spec()``)."""

    name: str
    """The sink's name in stats and messages, unique in the run."""
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Sink:
        module_name, _, cls_name = self.target.partition(":")
        cls: Any = getattr(importlib.import_module(module_name), cls_name)
        sink: Sink = cls(**self.kwargs)
        return sink


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine needs; every field pickles (a simulator backend does when its
    load does: see :mod:`gpulens.testing.loads`)."""

    interval: float
    """Seconds between cheap samples."""
    gpus: tuple[int, ...] | None = None
    """CUDA device numbers to watch (as the training process numbers them); ``None``: every
    visible GPU, or this rank's in a distributed job."""
    backend: Any = "auto"
    """``"auto"``, ``"nvml"`` or an NVML-like object (:class:`gpulens.testing.SimulatedNVML`)."""
    buffer_rows: int = 10_000
    gpm: bool = True
    energy: bool = True
    driver_samples: bool = True
    step: int = 0
    """The training step the first window starts after."""
    sinks: tuple[SinkSpec, ...] = ()
    """Sinks the engine writes itself."""
    rows_back: bool = False
    """Also hand every row back to the client (for its own sinks, or the rank gather)."""
    rank: tuple[int, int, int] | None = None
    """(global rank, local rank, world size) in a distributed job."""
    log_level: int = 30
    """The client's ``gpulens`` logger level: the engine says nothing below it."""
