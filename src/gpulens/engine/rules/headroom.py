"""memory_headroom: little device memory left at the window's peak."""

from __future__ import annotations

from collections.abc import Mapping

from gpulens.engine.rules.base import GpuRule, Obs, RowView, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold

SPEC = RuleSpec("memory_headroom", "gpu", "warning", "little device memory left", (
    Threshold("headroom", "100 * (1 - gpu/{i}/mem_used_gb_max / total)", "<=", 10.0, 15.0,
              "%", "free share of device memory at the window's peak"),
))


class MemoryHeadroom(GpuRule):
    advice = ("The next longer batch may run out of memory: activation checkpointing, a "
              "smaller micro-batch with gradient accumulation, or "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut fragmentation.")

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        used = g.get("mem_used_gb_max", g.get("mem_used_gb"))
        total = view.mem_total_gb.get(i)
        if used is None or not total:
            return None
        headroom = 100 * (1 - used / total)
        return view.obs(self.judge(headroom=headroom), {
            "mem_used_gb_max": used, "mem_total_gb": total, "headroom_pct": headroom})

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} peaked at {fmt(med['mem_used_gb_max'], 'GB')} of "
                f"{fmt(med['mem_total_gb'], 'GB')}: {fmt(med['headroom_pct'], '%')} left")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return f"{self.label(subject)} has {fmt(med.get('headroom_pct', 0.0), '%')} free"
