"""memory_creep: allocated memory creeps up step over step (a robust Theil-Sen slope)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpulens.engine.rules.base import GpuRule, Obs, RowView, Track, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold

if TYPE_CHECKING:
    from gpulens.engine.rules.config import RulesConfig

SPEC = RuleSpec("memory_creep", "gpu", "warning", "allocated memory creeps up step over step", (
    Threshold("growth", "Theil-Sen growth of gpu/{i}/torch_allocated_gb over the last 20 "
              "readings, % of total", ">=", 0.5, 0.1, "%",
              "robust growth over the span, as a share of device memory"),
    Threshold("rising", "share of reading pairs that rise", ">=", 70.0, 55.0, "%",
              "how consistently it grows (50 %: no trend)"),
))

CREEP_READINGS = 20
"""``torch_allocated_gb`` readings the creep slope is fitted on."""
READING_GAP_S = 1.0
"""A row whose ``torch_allocated_gb`` equals the previous reading is a new reading only this
long after it (the sampler carries a reading into the windows until the next, ~1 s later)."""


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Robust slope (median of pairwise slopes) and the share of pairs (with distinct x) whose
    y rises along x (ties count half)."""
    n = len(xs)
    slopes = sorted([(ys[b] - ys[a]) / (xs[b] - xs[a])
                     for a in range(n) for b in range(a + 1, n) if xs[b] != xs[a]])
    if not slopes:
        return 0.0, 0.5
    m = len(slopes)
    median = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
    below, above = bisect.bisect_left(slopes, 0.0), bisect.bisect_right(slopes, 0.0)
    return median, ((m - above) + 0.5 * (above - below)) / m


class MemoryCreep(GpuRule):
    advice = ("Something keeps tensors alive across steps: a loss summed without .item() or "
              ".detach(), outputs appended to a list, a cache that only grows. Check what "
              "the loop keeps between steps.")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self._readings: dict[int, deque[tuple[float, float]]] = {}
        self._read_at: dict[int, float] = {}

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        alloc = g.get("torch_allocated_gb")
        total = view.mem_total_gb.get(i)
        if alloc is None or not total:
            return None
        r = self._readings.setdefault(i, deque(maxlen=CREEP_READINGS))
        if r and r[-1][0] >= view.step:
            r.clear()  # the step went back: a new phase, a new baseline
        last_t = self._read_at.get(i, -math.inf)
        if r and alloc == r[-1][1] and view.time - last_t < READING_GAP_S:
            return None  # the same reading carried into another window: not a new one
        self._read_at[i] = view.time
        r.append((float(view.step), alloc))
        if len(r) < CREEP_READINGS // 2:
            return None
        xs, ys = [p[0] for p in r], [p[1] for p in r]
        slope, rising = theil_sen(xs, ys)
        growth_gb = slope * (xs[-1] - xs[0])
        growth = 100 * growth_gb / total
        used = max(max(ys), g.get("mem_used_gb_max", g.get("mem_used_gb", 0.0)))
        free = total - used  # what the device has left (NVML), not only the allocator
        return view.obs(self.judge(growth=growth, rising=100 * rising), sampled=False, figures={
            "torch_allocated_gb": alloc, "first_gb": ys[0], "first_step": xs[0],
            "slope_gb_per_step": slope, "growth_gb": growth_gb, "growth_pct": growth,
            "rising_pct": 100 * rising, "free_gb": free})

    summarised = "figures are the latest fit"

    def summary(self, track: Track, level: int | None) -> dict[str, float]:
        return dict(track.obs[-1].figures) if track.obs else {}

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        slope = med["slope_gb_per_step"]
        text = (f"{self.label(subject)}: torch_allocated_gb grew from "
                f"{fmt(med['first_gb'], 'GB')} at step {med['first_step']:.0f} to "
                f"{fmt(med['torch_allocated_gb'], 'GB')}, {slope * 1000:.1f} MB per step "
                f"(robust slope over the last {CREEP_READINGS} readings; "
                f"{med['rising_pct']:.0f} % of reading pairs rising)")
        if slope > 0 and med.get("free_gb", 0) > 0:
            text += (f"; at this rate the {fmt(med['free_gb'], 'GB')} of device memory "
                     f"still free last "
                     f"~{med['free_gb'] / slope:.0f} more steps")
        return text

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)}: torch_allocated_gb is flat again "
                f"({med.get('slope_gb_per_step', 0.0) * 1000:.1f} MB per step)")
