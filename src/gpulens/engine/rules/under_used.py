"""under_used: a GPU in use by the job has little work per step."""

from __future__ import annotations

from collections.abc import Mapping

from gpulens.engine.rules.base import BETWEEN, FIRE, GpuRule, Obs, RowView, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold

SPEC = RuleSpec("under_used", "gpu", "warning", "GPU under-used: little work per step", (
    Threshold("sm_active", "gpu/{i}/sm_active_pct", "<=", 30.0, 40.0, "%",
              "GPM SM activity"),
    Threshold("util", "gpu/{i}/util_pct", "<=", 50.0, 60.0, "%",
              "NVML utilization, only where the GPU has no GPM"),
))


class UnderUsed(GpuRule):
    advice = ("Give the GPU more work per step: a larger (micro-)batch, sequence packing, "
              "torch.compile or CUDA graphs to cut kernel-launch overhead; if steps wait on "
              "the host, more DataLoader workers.")

    active_only = True

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        if "sm_active_pct" in g:
            fig = {"sm_active_pct": g["sm_active_pct"]}
            lvl = self.judge(sm_active=g["sm_active_pct"])
        elif "util_pct" in g:
            fig = {"util_pct": g["util_pct"]}
            lvl = self.judge(util=g["util_pct"])
        else:
            return None
        if lvl == FIRE and view.levels.get("input_bound", {}).get("job") == FIRE:
            lvl = BETWEEN  # quiet in rows where input_bound is at fire level
        return view.obs(lvl, fig)

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        if "sm_active_pct" in med:
            return (f"{self.label(subject)} had only {fmt(med['sm_active_pct'], '%')} of its "
                    f"SMs busy (GPM SM activity)")
        return (f"{self.label(subject)} ran kernels only {fmt(med['util_pct'], '%')} of the "
                f"time (NVML utilization)")

    def note(self, summaries: Mapping[str, Mapping[str, float]]) -> str:
        if any("util_pct" in m for m in summaries.values()):
            return ("Where a GPU reports no GPM SM activity, the rule reads NVML utilization, "
                    "which counts a GPU running any kernel as busy: the GPU may be emptier "
                    "than it says")
        return ""

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        if "sm_active_pct" in med:
            return f"{self.label(subject)} SM activity {fmt(med['sm_active_pct'], '%')}"
        return f"{self.label(subject)} NVML utilization {fmt(med.get('util_pct', 0.0), '%')}"
