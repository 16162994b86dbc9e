"""What one GPU's line shows (:class:`GpuView`), and the plain one-line form for logs and pipes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gpulens.model import GpuInfo


@dataclass
class GpuView:
    """What one line of the view shows, in the row keys' units."""

    info: GpuInfo
    history: deque[float]
    values: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.info.index)

    def get(self, suffix: str) -> float | None:
        return self.values.get(suffix)

    def activity(self) -> tuple[str, float | None]:
        """(label, percent): GPM SM active where present, else NVML utilization."""
        sm = self.get("sm_active_pct")
        if sm is not None:
            return "SM", sm
        return "util", self.get("util_pct")

    def held_by(self) -> str:
        """``"power cap"``, ``"thermal"``, ``"power cap+thermal"``, ``"other"``, ``"-"``."""
        reasons = [name for suffix, name in (("throttle_power_pct", "power cap"),
                                             ("throttle_thermal_pct", "thermal"))
                   if (self.get(suffix) or 0) > 0]
        if reasons:
            return "+".join(reasons)
        if (self.get("throttle_pct") or 0) > 0:
            return "other"
        return "-" if self.get("throttle_pct") is not None else "n/a"

    def mem_total_gb(self) -> float | None:
        if self.info.mem_total_gb:
            return self.info.mem_total_gb
        used, pct = self.get("mem_used_gb"), self.get("mem_pct")
        return used / pct * 100 if used is not None and pct else None

    def power_limit_w(self) -> float | None:
        return self.get("power_limit_w") or self.info.power_limit_w


def num(v: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{unit}"


def plain_line(views: list[GpuView]) -> str:
    """One line for all GPUs, for logs and pipes."""
    parts = [time.strftime("%H:%M:%S")]
    for v in views:
        label, act = v.activity()
        tensor = v.get("tensor_active_pct")
        parts.append(
            f"gpu{v.key} {label} {num(act, '.0f', '%')}"
            + (f" tensor {tensor:.0f}%" if tensor is not None else "")
            + f" mem {num(v.get('mem_used_gb'), '.1f')}/{num(v.mem_total_gb(), '.1f')} GB"
            + f" power {num(v.get('power_w'), '.0f')}/{num(v.power_limit_w(), '.0f')} W"
            + f" temp {num(v.get('temp_c'), '.0f')} C"
            + f" sm {num(v.get('sm_clock_mhz'), '.0f')} MHz"
            + f" held {v.held_by()}"
        )
    return " | ".join(parts)


def short_name(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"H100 80GB HBM3"`` (the vendor says nothing here)."""
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name
