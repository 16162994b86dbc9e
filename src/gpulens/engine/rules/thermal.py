"""thermal: a GPU holds its clocks down for temperature."""

from __future__ import annotations

from collections.abc import Mapping

from gpulens.engine.rules.base import GpuRule, Obs, RowView, fmt, pick
from gpulens.engine.rules.spec import RuleSpec, Threshold

SPEC = RuleSpec("thermal", "gpu", "warning", "thermal slowdown: clocks held down by heat", (
    Threshold("throttle_thermal", "gpu/{i}/throttle_thermal_pct", ">=", 10.0, 2.0, "%",
              "share of the window with clocks held down by temperature"),
), training=False)


class Thermal(GpuRule):
    advice = ("Check cooling: airflow, blocked intakes, fans or chassis faults, the room's "
              "temperature. A GPU hotter than its neighbours under the same load may need "
              "service; nvidia-smi -q -d TEMPERATURE,PERFORMANCE shows its slowdown "
              "temperature.")

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        thr = g.get("throttle_thermal_pct")
        if thr is None:
            return None
        return view.obs(self.judge(throttle_thermal=thr), {
            "throttle_thermal_pct": thr, **pick(g, ("temp_c", "temp_c_max", "sm_clock_mhz"))})

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        text = (f"{self.label(subject)} held its clocks down for temperature "
                f"{fmt(med['throttle_thermal_pct'], '%')} of the time")
        extra = []
        if "temp_c" in med:
            extra.append(f"{med['temp_c']:.0f} °C")
        if "temp_c_max" in med:
            extra.append(f"peak {med['temp_c_max']:.0f} °C")
        if "sm_clock_mhz" in med:
            extra.append(f"SM clock {med['sm_clock_mhz']:.0f} MHz")
        return text + (f" ({', '.join(extra)})" if extra else "")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} thermal throttling "
                f"{fmt(med.get('throttle_thermal_pct', 0.0), '%')} of the time")
