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
    "setup",
]


def setup(*, isolation: str = "auto", backend: Any = None) -> bool:
    """Make the engine process of this process's next :meth:`Monitor.start` ready now, while
    the rest of the program starts (as ``wandb.setup()`` does for W&B): call it early (before
    building the model, or before ``init_process_group``), and ``start()`` takes the process
    made here instead of waiting for a new interpreter and its imports (on an H200 host
    0.05 s instead of 0.3-0.4 s: ``benchmarks/results/2026-11-28-h200-start-spare``). The
    Hugging Face and Lightning callbacks do this by themselves before training starts.

    ``isolation`` and ``backend``: as the monitor's (``"auto"``, and ``None`` for
    ``GPULENS_BACKEND`` or NVML); nothing is made where that monitor would run its engine in a
    thread (and one made earlier is ended). The process waits, idle, for a start of this
    process; this process ends one that no start took after 9 minutes, or at its exit (which
    then waits for its end). Returns True when one waits. ``ValueError`` for an
    unknown ``isolation`` or backend name.
    """
    from gpulens.settings import Settings
    from gpulens.transport.spawn import prepare_engine

    return prepare_engine(Settings(isolation=isolation, backend=backend))


def __getattr__(name: str) -> Any:
    if name == "from_config":
        from gpulens.integrations.hydra import from_config

        return from_config
    raise AttributeError(f"module 'gpulens' has no attribute {name!r}")
