"""Host metrics through psutil: CPU busy share and RAM in use."""

from __future__ import annotations

from typing import Any


class HostReader:
    """Reads ``cpu_pct`` (all cores, percent, since the previous read) and ``ram_used_gb``.

    ``psutil_module`` may be handed in (tests); by default psutil is imported on first use.
    """

    def __init__(self, psutil_module: Any | None = None) -> None:
        self._psutil = psutil_module
        self._primed = False

    def read(self) -> dict[str, float]:
        """One reading; empty if psutil is unavailable."""
        if self._psutil is None:
            try:
                import psutil
            except ImportError:  # pragma: no cover - psutil is a core dependency
                return {}
            self._psutil = psutil
        ps = self._psutil
        out: dict[str, float] = {}
        cpu = ps.cpu_percent(interval=None)
        if self._primed:  # psutil's first call has no reference point and returns 0.0
            out["cpu_pct"] = float(cpu)
        self._primed = True
        out["ram_used_gb"] = ps.virtual_memory().used / 1e9
        return out
