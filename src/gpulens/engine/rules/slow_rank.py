"""slow_rank: a rank busy longer per step than the others sets the pace of the job (and one-off
spikes, told once as a notice)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpulens.engine.rules.base import BETWEEN, FIRE, Obs, RowView, Rule, Track, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold
from gpulens.model import Event

if TYPE_CHECKING:
    from gpulens.engine.rules.config import RulesConfig

SPEC = RuleSpec("slow_rank", "rank", "warning", "a slow rank sets the pace of the job", (
    Threshold("lag", "busy_s of rank r / the typical rank's busy_s - 1, in % (typical: the "
              "median of the other ranks; over several nodes, the median of the nodes' "
              "medians); a node: its fastest rank against the other nodes' fastest", ">=",
              20.0, 10.0, "%", "how much longer this rank is busy per step"),
    Threshold("lag_cpu", "the same lag where busy_s is the training thread's CPU time (ranks "
              "without GPM)", ">=", 50.0, 25.0, "%",
              "CPU time is a noisier signal: two healthy ranks doing the same work were seen "
              "~30 % apart for ten steps on a loaded host"),
    Threshold("one_off", "lag in a single window (told once as a notice)", ">=", 50.0, 20.0,
              "%", "a spike that the following windows do not repeat"),
))

ONE_OFF_CONFIRM_ROWS = 3
"""Windows after a spike that must be back under the lag clear threshold to call it one-off."""
ONE_OFF_GAP_STEPS = 50
"""At most one one-off notice per rank in this many steps."""


class SlowRank(Rule):
    """Says *what* is slow (module doc of :mod:`gpulens.engine.rules`): a node (even its fastest
    rank lags the other nodes' fastest: the host, its network, its cooling), a GPU (its busy
    time per step lags, measured on the GPU: GPM) or a rank (its training thread's CPU time
    lags, where the GPUs have no GPM).  Subjects are ranks (``"3"``) and nodes (``"node1"``); a
    rank on a node that lags as a whole is not named apart (the node explains it)."""

    advice = ("The slowest rank sets the pace: every other rank waits for it at each gradient "
              "all-reduce. Check that rank's GPU (thermal or power throttling, clocks), its host "
              "(CPU contention, NUMA binding, other processes) and uneven work (shards with "
              "longer sequences: packing or length-balanced sampling); a whole node that lags "
              "points at that host or its network.")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self.basis = ""
        self.kind = "gpu"
        self.sampled = True
        self._spikes: dict[int, tuple[int, float, dict[str, float], int]] = {}
        """rank -> (step, time, figures, windows seen since) of a spike awaiting confirmation"""
        self._last_notice: dict[int, int] = {}
        self._names = config.job.node_names() if config.job is not None else {}

    def busy(self, view: RowView) -> tuple[dict[int, float], str] | None:
        step_time = view.scalars.get("perf/step_time_s")
        gathered = {r: v["gpu_busy_s"] for r, v in view.ranks.items() if "gpu_busy_s" in v}
        gpm = (view.gpus and all("sm_active_pct" in g for g in view.gpus.values())) or (
            not view.gpus and "gpu/all/sm_active_pct_mean" in view.scalars)
        self.kind, self.sampled = "gpu", True
        if self.config.distributed and len(gathered) >= 2 and gpm:
            return gathered, ("GPU busy time per step (GPM sm_active_pct x perf/step_time_s, "
                              "rank/{r}/gpu_busy_s)")
        if (self.config.distributed and step_time is not None and len(view.gpus) >= 2
                and all("sm_active_pct" in g for g in view.gpus.values())):
            return ({i: g["sm_active_pct"] / 100 * step_time for i, g in view.gpus.items()},
                    "GPU busy time per step (GPM sm_active_pct x perf/step_time_s)")
        cpu = {r: v["cpu_busy_s"] for r, v in view.ranks.items() if "cpu_busy_s" in v}
        if len(cpu) >= 2:
            self.kind, self.sampled = "cpu", False
            return cpu, "CPU time of the training thread per step (rank/{r}/cpu_busy_s)"
        return None

    def _nodes(self, view: RowView) -> dict[int, tuple[float, float]]:
        """Each node's (fastest, median) busy time per step of this basis, from rank 0's row."""
        out: dict[int, tuple[float, float]] = {}
        for key, v in view.scalars.items():
            if key.startswith("node/") and key.endswith(f"/{self.kind}_busy_s_min"):
                n = int(key.split("/")[1])
                median = view.scalars.get(f"node/{n}/{self.kind}_busy_s_median")
                if median is not None:
                    out[n] = (v, median)
        return out

    def observe(self, view: RowView) -> dict[str, Obs]:
        got = self.busy(view)
        if got is None:
            return {}
        busy, self.basis = got
        lag_t = self.spec.threshold("lag" if self.sampled else "lag_cpu")
        out: dict[str, Obs] = {}
        nodes = self._nodes(view)
        slow_nodes: set[int] = set()
        if len(nodes) >= 2:
            for n, (fastest, _) in nodes.items():
                ref = statistics.median(f for m, (f, _) in nodes.items() if m != n)
                if ref <= 0:
                    continue
                lag = 100 * (fastest / ref - 1)
                level = self.level([(lag_t, lag)])
                if level == FIRE:
                    slow_nodes.add(n)
                out[f"node{n}"] = view.obs(level, {"busy_s": fastest, "others_busy_s": ref,
                                                   "lag_pct": lag}, sampled=self.sampled)
        typical = statistics.median(m for _, m in nodes.values()) if len(nodes) >= 2 else None
        for r, b in busy.items():
            ref = typical if typical is not None else statistics.median(
                [v for k, v in busy.items() if k != r])
            if ref <= 0:
                continue
            lag = 100 * (b / ref - 1)
            node = view.ranks.get(r, {}).get("node")
            level = self.level([(lag_t, lag)])
            if node is not None and int(node) in slow_nodes and level == FIRE:
                level = BETWEEN  # its node lags as a whole: the node is named, not each rank
            figures = {"busy_s": b, "others_busy_s": ref, "lag_pct": lag}
            if node is not None:
                figures["node"] = node
            out[str(r)] = view.obs(level, figures, sampled=self.sampled)
        return out

    def _node(self, n: int) -> str:
        name = self._names.get(n)
        return f"node {n}" + (f" {name}" if name else "")

    def label(self, subject: str) -> str:
        if subject.startswith("node"):
            return self._node(int(subject[4:]))
        return f"rank {subject}"

    def data(self, subject: str, figures: Mapping[str, float]) -> dict[str, float]:
        if subject.startswith("node"):
            n = subject[4:]
            return {"node": float(n), **{f"node/{n}/{k}": v for k, v in figures.items()}}
        return super().data(subject, figures)

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        how = (f"busy {fmt(med['busy_s'], 's')} per step, {fmt(med['lag_pct'], '%')} more than "
               f"the typical rank ({fmt(med['others_busy_s'], 's')}), measured as "
               f"{self.basis}")
        if subject.startswith("node"):
            return (f"{self.label(subject)} is slow as a whole (most recent windows): even its "
                    f"fastest rank is " + how.replace("the typical rank", "the other nodes' "
                                                      "fastest"))
        where = self._node(int(med["node"])) if "node" in med else ""
        what = (f"GPU {subject} (rank {subject}{', ' + where if where else ''})"
                if self.kind == "gpu" else f"rank {subject}" + (f" ({where})" if where else ""))
        return f"{what} is chronically slow (most recent windows, not a one-off): {how}"

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} keeps pace again ({fmt(med.get('lag_pct', 0.0), '%')} "
                f"above the others)")

    def one_offs(self, view: RowView, tracks: Mapping[str, Track],
                 observed: Mapping[str, Obs], warm: bool) -> list[Event]:
        """Spikes (one window far above the others) that the next windows did not repeat."""
        spike_t = self.spec.threshold("one_off")
        events: list[Event] = []
        for subject, o in observed.items():
            if not subject.isdigit():
                continue  # nodes: told by the alert only
            r = int(subject)
            pending = self._spikes.get(r)
            if pending is not None:
                step, t, fig, n = pending
                if not spike_t.at_clear(o.figures["lag_pct"]) or tracks[subject].firing:
                    del self._spikes[r]  # not a one-off: it goes on (the alert tells it)
                    continue
                n += 1
                if n < ONE_OFF_CONFIRM_ROWS:
                    self._spikes[r] = (step, t, fig, n)
                    continue
                del self._spikes[r]
                if step - self._last_notice.get(r, -(10**12)) < ONE_OFF_GAP_STEPS:
                    continue
                self._last_notice[r] = step
                events.append(Event(
                    kind="notice", name=self.spec.name, state="info", step=view.step,
                    time=view.time,
                    severity="info",
                    message=(f"rank {r} lagged once at step {step}: busy "
                             f"{fmt(fig['busy_s'], 's')}, {fmt(fig['lag_pct'], '%')} more "
                             f"than the median of the other ranks "
                             f"({fmt(fig['others_busy_s'], 's')}); the "
                             f"{ONE_OFF_CONFIRM_ROWS} windows since kept pace: a one-off "
                             f"({self.basis})"),
                    advice=("A one-off lag is usually a hiccup of that rank's host (garbage "
                            "collection, a checkpoint write, another process); repeated ones "
                            "are worth a look at that host."),
                    data={"rank": float(r), "spike_step": float(step),
                          **{f"rank/{r}/{k}": v for k, v in fig.items()}},
                ))
            elif warm and spike_t.at_fire(o.figures["lag_pct"]) and not tracks[subject].firing:
                self._spikes[r] = (o.step, o.time, dict(o.figures), 0)
        return events
