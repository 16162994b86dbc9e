"""gpulens: GPU telemetry per training step, beside the loss curve.

``import gpulens`` imports no torch, wandb, mlflow, transformers, lightning, omegaconf,
prometheus_client or rich: each integration imports its vendor when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpulens.errors import GpulensError, GpuLost, NvmlUnavailable
from gpulens.model import Event, GpuInfo, Row, RunContext
from gpulens.monitor import Monitor
from gpulens.sinks.base import Sink

if TYPE_CHECKING:
    from gpulens.integrations.hydra import from_config

__version__ = "0.1.0"

__all__ = [
    "Event",
    "GpuInfo",
    "GpuLost",
    "GpulensError",
    "Monitor",
    "NvmlUnavailable",
    "Row",
    "RunContext",
    "Sink",
    "__version__",
    "from_config",
]


def __getattr__(name: str) -> Any:
    if name == "from_config":
        from gpulens.integrations.hydra import from_config

        return from_config
    raise AttributeError(f"module 'gpulens' has no attribute {name!r}")
