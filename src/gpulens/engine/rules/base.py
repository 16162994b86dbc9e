"""The machinery every rule shares: observation levels, a subject's evidence (:class:`Track`),
one row split by subject (:class:`RowView`), the base class :class:`Rule` and, for the rules
judged one GPU at a time, :class:`GpuRule` (the walk over the row's GPUs is there, once).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpulens.engine.rules.spec import RuleSpec, Threshold

if TYPE_CHECKING:
    from gpulens.engine.rules.config import RulesConfig

FIRE = 1
CLEAR = -1
BETWEEN = 0


@dataclass


class Obs:
    time: float
    step: int
    level: int
    figures: dict[str, float]
    force: bool = False
    """Fire at once (past the warm-up), whatever the share: a new OOM."""
    sampled: bool = True
    """From figures the sampler averages over the window (GPU activity, power, clocks): the
    evidence must also cover :attr:`RulesConfig.min_span_s`.  Figures measured exactly per
    step (step anatomy, CPU time, allocator counters and readings) need no span."""


@dataclass


class Track:
    """Evidence and state of one (rule, subject)."""

    obs: deque[Obs] = field(default_factory=deque)
    fire_n: int = 0
    clear_n: int = 0
    firing: bool = False
    last_time: float = -math.inf
    rows_since: int = 0

    def add(self, o: Obs, min_rows: int, min_span_s: float, cap: int = 1024) -> None:
        self.obs.append(o)
        self.fire_n += o.level == FIRE
        self.clear_n += o.level == CLEAR
        self.last_time = o.time
        self.rows_since = 0
        while len(self.obs) > min_rows and (
            o.time - self.obs[1].time >= min_span_s or len(self.obs) > cap
        ):
            old = self.obs.popleft()
            self.fire_n -= old.level == FIRE
            self.clear_n -= old.level == CLEAR

    def full(self, min_rows: int, min_span_s: float) -> bool:
        return (len(self.obs) >= min_rows
                and self.obs[-1].time - self.obs[0].time >= min_span_s * 0.999)

    def medians(self, level: int | None = None) -> dict[str, float]:
        """Median of each figure over the evidence (only observations at ``level`` if given)."""
        seen: dict[str, list[float]] = {}
        for o in self.obs:
            if level is None or o.level == level:
                for k, v in o.figures.items():
                    seen.setdefault(k, []).append(v)
        return {k: statistics.median(v) for k, v in seen.items()}

    def reset(self) -> None:
        self.obs.clear()
        self.fire_n = self.clear_n = 0
        self.firing = False


@dataclass


class RowView:
    """One row, split by subject."""

    step: int
    time: float
    steps: float
    gpus: dict[int, dict[str, float]]
    ranks: dict[int, dict[str, float]]
    scalars: dict[str, float]
    active: set[int]
    """GPUs seen in use by the job so far."""
    mem_total_gb: dict[int, float]
    power_limit_w: dict[int, float]
    levels: dict[str, dict[str, int]] = field(default_factory=dict)
    """Levels already observed in this row, by rule and subject (for suppression)."""

    def obs(self, level: int, figures: dict[str, float], *, force: bool = False,
            sampled: bool = True) -> Obs:
        """An observation at this row's time and step (see :class:`Obs`)."""
        return Obs(self.time, self.step, level, figures, force=force, sampled=sampled)


def pick(figures: Mapping[str, float], keys: Iterable[str]) -> dict[str, float]:
    """The figures among ``keys`` that ``figures`` has (in the order of ``keys``)."""
    return {k: figures[k] for k in keys if k in figures}


def fmt(v: float, unit: str = "") -> str:
    if unit == "%":
        return f"{v:.0f} %" if abs(v) >= 10 else f"{v:.1f} %"
    if unit == "s":
        return f"{v:.3f} s" if v < 1 else f"{v:.2f} s"
    if unit == "GB":
        return f"{v:.2f} GB"
    if unit == "W":
        return f"{v:.0f} W"
    return f"{v:.2f}"


class Rule:
    """A rule's observation of one row, and its words."""

    advice = ""

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        self.spec = spec
        self.config = config

    def observe(self, view: RowView) -> dict[str, Obs]:
        raise NotImplementedError

    def label(self, subject: str) -> str:
        return {"job": "the job", "gpu": f"GPU {subject}", "rank": f"rank {subject}"}[
            self.spec.subject]

    def data(self, subject: str, figures: Mapping[str, float]) -> dict[str, float]:
        prefix = {"job": "", "gpu": f"gpu/{subject}/", "rank": f"rank/{subject}/"}[
            self.spec.subject]
        return {(k if "/" in k else prefix + k): v for k, v in figures.items()}

    summarised = "figures are medians"
    """How :meth:`summary` sums up the evidence (said at the end of a firing message)."""

    def summary(self, track: Track, level: int | None) -> dict[str, float]:
        """The figures a message quotes: medians over the evidence (at ``level`` if given and
        any observation has it)."""
        return track.medians(level) or track.medians()

    def note(self, summaries: Mapping[str, Mapping[str, float]]) -> str:
        """A sentence said once per firing message, after every subject's part."""
        return ""

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        """What was seen, from :meth:`summary` of the evidence at fire level."""
        raise NotImplementedError

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        """What is seen now that the rule cleared, from the medians of the evidence."""
        raise NotImplementedError

    def level(self, checks: Iterable[tuple[Threshold, float]]) -> int:
        """FIRE when every check is at fire level, CLEAR when any is at clear level."""
        checks = list(checks)
        if any(t.at_clear(v) for t, v in checks):
            return CLEAR
        if all(t.at_fire(v) for t, v in checks):
            return FIRE
        return BETWEEN

    def judge(self, **values: float) -> int:
        """:meth:`level` of the spec's thresholds named by the keywords, each against its
        value: ``self.judge(sm_busy=sm, tensor_share=share)``."""
        return self.level((self.spec.threshold(name), v) for name, v in values.items())


class GpuRule(Rule):
    """A rule judged on each GPU of a row apart (subject ``"gpu"``): :meth:`observe` walks the
    row's GPUs, :meth:`observe_gpu` says what one GPU's figures show."""

    active_only = False
    """Judge only the GPUs the job has been seen using (:attr:`RowView.active`)."""

    def observe(self, view: RowView) -> dict[str, Obs]:
        out: dict[str, Obs] = {}
        for i, g in view.gpus.items():
            if self.active_only and i not in view.active:
                continue
            o = self.observe_gpu(view, i, g)
            if o is not None:
                out[str(i)] = o
        return out

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        """GPU ``i``'s observation from its figures ``g`` in this row; ``None`` where the row
        lacks what the rule reads."""
        raise NotImplementedError
