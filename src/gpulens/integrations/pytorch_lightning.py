"""GPU telemetry for the standalone ``pytorch_lightning`` package.

``from gpulens.integrations.pytorch_lightning import GPUMonitorCallback``; for the unified
``lightning`` package (``lightning.pytorch``) use :mod:`gpulens.integrations.lightning`. Both
classes share their hooks; each derives from its own package's ``Callback`` so that Lightning's
``isinstance`` checks and LightningCLI's ``class_path`` type checks accept it.
"""

from __future__ import annotations

from gpulens.integrations._lightning_common import DOC, GPUMonitorHooks, LoggersSink

try:
    from pytorch_lightning.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without pytorch_lightning
    raise ImportError(
        "gpulens.integrations.pytorch_lightning needs the pytorch_lightning package: "
        "pip install 'gpulens[pytorch-lightning]' (for the lightning package use "
        "gpulens.integrations.lightning)"
    ) from exc

__all__ = ["GPUMonitorCallback", "LoggersSink"]


class GPUMonitorCallback(GPUMonitorHooks, Callback):  # type: ignore[misc,unused-ignore]
    __doc__ = DOC
