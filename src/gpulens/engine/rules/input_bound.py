"""input_bound: the GPUs wait for data (step anatomy, else NVML utilization and idle time)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from gpulens.engine.rules.base import Obs, RowView, Rule, fmt, pick
from gpulens.engine.rules.spec import RuleSpec, Threshold

SPEC = RuleSpec("input_bound", "job", "warning", "input-bound: the GPUs wait for data", (
    Threshold("data_wait", "perf/data_wait_pct", ">=", 10.0, 5.0, "%",
              "share of the step spent waiting for the next batch (step anatomy)"),
    Threshold("gpu_util", "gpu/{i}/util_pct (mean of the GPUs in use)", "<=", 70.0, 80.0, "%",
              "NVML utilization, where the row has no perf/data_wait_pct"),
    Threshold("idle_s", "(1 - util_pct / 100) * perf/step_time_s", ">=", 0.02, 0.01, "s",
              "seconds per step with no kernel running, beside gpu_util"),
))


class InputBound(Rule):
    advice = ("Feed the GPUs faster: more DataLoader workers (num_workers), pin_memory=True, "
              "persistent_workers=True and a larger prefetch_factor; move decoding, "
              "tokenisation and augmentation out of __getitem__ (pre-process and cache); check "
              "the storage's read rate.")

    def observe(self, view: RowView) -> dict[str, Obs]:
        wait = view.scalars.get("perf/data_wait_pct")
        if wait is not None:
            fig = {"perf/data_wait_pct": wait,
                   **pick(view.scalars, ("perf/data_wait_s", "perf/step_time_s"))}
            return {"job": view.obs(self.judge(data_wait=wait), fig, sampled=False)}
        step_time = view.scalars.get("perf/step_time_s")
        utils = [g["util_pct"] for i, g in view.gpus.items()
                 if i in view.active and "util_pct" in g]
        if not utils:
            utils = [g["sm_active_pct"] for i, g in view.gpus.items()
                     if i in view.active and "sm_active_pct" in g]
        if step_time is None or not utils:
            return {}
        util = statistics.fmean(utils)
        idle_s = (1 - util / 100) * step_time
        fig = {"util_pct": util, "idle_s": idle_s, "perf/step_time_s": step_time}
        return {"job": view.obs(self.judge(gpu_util=util, idle_s=idle_s), fig)}

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        if "perf/data_wait_pct" in med:
            text = (f"the training step waited for its next batch "
                    f"{fmt(med['perf/data_wait_pct'], '%')} of its time (perf/data_wait_pct)")
            if "perf/data_wait_s" in med and "perf/step_time_s" in med:
                text += (f": {fmt(med['perf/data_wait_s'], 's')} of "
                         f"{fmt(med['perf/step_time_s'], 's')} per step")
            return text
        return (f"the GPUs ran no kernel {fmt(100 - med['util_pct'], '%')} of each step "
                f"(NVML utilization {fmt(med['util_pct'], '%')}): "
                f"{fmt(med['idle_s'], 's')} idle of {fmt(med['perf/step_time_s'], 's')} per "
                f"step. This loop reports no perf/data_wait_pct, so the wait may also be other "
                f"host work between steps (logging, Python overhead)")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        if "perf/data_wait_pct" in med:
            return f"data wait is down to {fmt(med['perf/data_wait_pct'], '%')} of the step"
        if "util_pct" in med:
            return f"the GPUs are busy again (NVML utilization {fmt(med['util_pct'], '%')})"
        return "no longer seen"
