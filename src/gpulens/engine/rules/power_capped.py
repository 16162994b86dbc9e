"""power_capped: a GPU holds its clocks down at its power limit."""

from __future__ import annotations

from collections.abc import Mapping

from gpulens.engine.rules.base import GpuRule, Obs, RowView, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold

SPEC = RuleSpec("power_capped", "gpu", "info", "power-capped: clocks held down at the limit", (
    Threshold("throttle_power", "gpu/{i}/throttle_power_pct", ">=", 50.0, 20.0, "%",
              "share of the window with clocks held down by the power cap"),
    Threshold("power_share", "gpu/{i}/power_w / gpu/{i}/power_limit_w", ">=", 0.95, 0.90, "",
              "mean board power as a share of the enforced limit"),
), training=False)


class PowerCapped(GpuRule):
    advice = ("The GPU works at its power limit and lowers its clocks to stay under it. If the "
              "limit was lowered (nvidia-smi -q -d POWER: Current vs Default Power Limit), "
              "raise it (nvidia-smi -pl); otherwise this is the card's ceiling: more work per "
              "step will not run faster, and energy per step is the figure to improve.")

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        thr, power = g.get("throttle_power_pct"), g.get("power_w")
        limit = g.get("power_limit_w", view.power_limit_w.get(i))
        if thr is None or power is None or not limit:
            return None
        return view.obs(self.judge(throttle_power=thr, power_share=power / limit), {
            "throttle_power_pct": thr, "power_w": power, "power_limit_w": limit})

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} held its clocks down for the power cap "
                f"{fmt(med['throttle_power_pct'], '%')} of the time, drawing "
                f"{fmt(med['power_w'], 'W')} of its {fmt(med['power_limit_w'], 'W')} limit")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} power-cap throttling "
                f"{fmt(med.get('throttle_power_pct', 0.0), '%')} of the time, drawing "
                f"{fmt(med.get('power_w', 0.0), 'W')}")
