"""GPU telemetry for ``lightning.pytorch`` (the ``lightning`` package).

``from gpulens.integrations.lightning import GPUMonitorCallback``; for the standalone
``pytorch_lightning`` package use :mod:`gpulens.integrations.pytorch_lightning`, whose class
derives from that package's own ``Callback`` (the two ``Callback`` classes are distinct, and
Lightning and LightningCLI check callbacks with ``isinstance``).
"""

from __future__ import annotations

from gpulens.integrations._lightning_common import DOC, GPUMonitorHooks, LoggersSink

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "gpulens.integrations.lightning needs the lightning package: "
        "pip install 'gpulens[lightning]' (for the standalone pytorch_lightning package use "
        "gpulens.integrations.pytorch_lightning)"
    ) from exc

__all__ = ["GPUMonitorCallback", "LoggersSink"]


class GPUMonitorCallback(GPUMonitorHooks, Callback):  # type: ignore[misc,unused-ignore]
    __doc__ = DOC
