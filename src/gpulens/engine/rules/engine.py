"""The rule engine: judges each finished row with every rule and turns their states into events
(see :mod:`gpulens.engine.rules`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gpulens.engine.rules.base import FIRE, RowView, Rule, Track
from gpulens.engine.rules.catalog import RULE_CLASSES, RULES
from gpulens.engine.rules.config import RulesConfig
from gpulens.engine.rules.slow_rank import SlowRank
from gpulens.log import warn_once
from gpulens.model import Event

ACTIVE_PCT = 5.0
"""SM activity or NVML utilization (%) that marks a GPU as in use by the job."""
STALE_ROWS = 20
STALE_S = 30.0
"""A subject without inputs for this many rows and seconds is resolved: no longer measured."""
GPU_KEYS = frozenset({
    "util_pct", "sm_active_pct", "tensor_active_pct", "throttle_power_pct",
    "throttle_thermal_pct", "power_w", "power_limit_w", "mem_used_gb", "mem_used_gb_max",
    "mem_pct", "temp_c", "temp_c_max", "sm_clock_mhz", "torch_allocated_gb",
    "torch_alloc_retries", "torch_ooms", "nvlink_rx_gb_per_s", "nvlink_tx_gb_per_s",
    "pcie_rx_gb_per_s", "pcie_tx_gb_per_s",
})
"""The ``gpu/{i}/<suffix>`` keys the rules read (the others are not even parsed)."""
RANK_KEYS = frozenset({"cpu_busy_s", "gpu_busy_s", "node"})
SCALAR_KEYS = frozenset({"gpu/all/sm_active_pct_mean", "gpu/all/nvlink_rx_gb_per_s_mean",
                         "gpu/all/nvlink_tx_gb_per_s_mean", "gpu/all/pcie_rx_gb_per_s_mean",
                         "gpu/all/pcie_tx_gb_per_s_mean"})
"""Job keys outside ``perf/`` that a rule reads (GPM in use across the job)."""
NODE_KEYS = frozenset({"gpu_busy_s_min", "gpu_busy_s_median", "cpu_busy_s_min",
                       "cpu_busy_s_median"})
"""``node/{n}/<suffix>`` keys the slow-rank rule reads (as scalars, under their full key)."""
"""The ``rank/{r}/<suffix>`` keys the rules read."""


def _finite(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


class RuleEngine:
    """Runs the rules of :data:`RULES` on finished rows (see :mod:`gpulens.engine.rules`).

    Not thread-safe: feed it from one thread, in step order.  Cost: a few tens of microseconds
    of Python per row and GPU (``benchmarks/rules_cost.py``).
    """

    def __init__(self, config: RulesConfig | None = None) -> None:
        self.config = config or RulesConfig()
        self._rules: list[Rule] = [
            cls(RULES[name], self.config) for name, cls in RULE_CLASSES.items()
            if name not in self.config.disabled
            and (self.config.training or not RULES[name].training)
        ]
        self._tracks: dict[str, dict[str, Track]] = {r.spec.name: {} for r in self._rules}
        self._judged: set[str] = set()
        self._firing: dict[str, set[str]] = {r.spec.name: set() for r in self._rules}
        self._start_step: int | None = None
        self._active: set[int] = set()
        self._mem_total = {g.index: g.mem_total_gb for g in self.config.gpus if g.mem_total_gb}
        self._power_limit = {g.index: g.power_limit_w for g in self.config.gpus
                             if g.power_limit_w}
        self._keys: dict[str, tuple[str, int, str] | None] = {}

    @property
    def rules(self) -> tuple[str, ...]:
        """Names of the rules this engine runs (those not disabled, nor switched off by a
        fault)."""
        return tuple(r.spec.name for r in self._rules)

    def firing(self) -> dict[str, tuple[str, ...]]:
        """The subjects each rule fires for now (rules firing for none are left out)."""
        return {k: tuple(sorted(v)) for k, v in self._firing.items() if v}

    def alert_keys(self) -> dict[str, float]:
        """``alerts/<rule>``: 1.0 while the rule fires for some subject, 0.0 while it does not;
        absent for a rule that has never had its inputs (or was switched off by a fault)."""
        return {f"alerts/{name}": 1.0 if self._firing.get(name) else 0.0
                for name in self.rules if name in self._judged}

    def feed(self, row_values: Mapping[str, float], step: int, time: float) -> list[Event]:
        """Judge one finished row (``step``: its training step; ``time``: Unix time at the end
        of its window) and return the events it causes, in rule order."""
        try:
            view = self._view(row_values, step, time)
        except Exception as e:  # a row the rules cannot read must not stop the engine
            warn_once("rules:row", "gpulens: advice rules skipped a row they could not read "
                      "(%s: %s); said once", type(e).__name__, e)
            return []
        if self._start_step is None:
            steps = int(view.steps) if view.steps >= 1 else 1
            self._start_step = step - steps
        warm = step - self._start_step >= self.config.min_steps
        events: list[Event] = []
        for rule in list(self._rules):
            try:
                events.extend(self._run(rule, view, warm))
            except Exception as e:  # a rule must never stop the engine
                name = rule.spec.name
                warn_once(f"rules:{name}",
                          "gpulens: advice rule %r failed and is switched off for this run "
                          "(%s: %s)", name, type(e).__name__, e)
                self._rules.remove(rule)
                self._firing.pop(name, None)
                self._judged.discard(name)
        return events

    # -- internals --------------------------------------------------------------------------

    def _view(self, values: Mapping[str, float], step: int, time: float) -> RowView:
        gpus: dict[int, dict[str, float]] = {}
        ranks: dict[int, dict[str, float]] = {}
        scalars: dict[str, float] = {}
        cache = self._keys
        for key, raw in values.items():
            parsed = cache.get(key, _UNSEEN)
            if parsed is _UNSEEN:
                parsed = _parse_key(key)
                if len(cache) < 65536:  # keys repeat row after row; bounded all the same
                    cache[key] = parsed
            if parsed is None:
                continue
            v = raw if type(raw) is float and math.isfinite(raw) else _finite(raw)
            if v is None:
                continue
            kind, index, suffix = parsed
            if kind == "gpu":
                gpus.setdefault(index, {})[suffix] = v
            elif kind == "rank":
                ranks.setdefault(index, {})[suffix] = v
            else:
                scalars[key] = v
        mem_total = dict(self._mem_total)
        for i, g in gpus.items():
            if (i not in mem_total and g.get("mem_pct", 0) > 0 and "mem_used_gb" in g):
                mem_total[i] = g["mem_used_gb"] * 100 / g["mem_pct"]
            if (max(g.get("sm_active_pct", 0.0), g.get("util_pct", 0.0)) >= ACTIVE_PCT
                    or "torch_allocated_gb" in g):
                self._active.add(i)
        return RowView(step=step, time=time, steps=scalars.get("perf/steps", 1.0), gpus=gpus,
                        ranks=ranks, scalars=scalars, active=self._active,
                        mem_total_gb=mem_total, power_limit_w=self._power_limit)

    def _run(self, rule: Rule, view: RowView, warm: bool) -> list[Event]:
        spec, cfg = rule.spec, self.config
        tracks = self._tracks[spec.name]
        observed = rule.observe(view)
        if observed:
            self._judged.add(spec.name)
        view.levels[spec.name] = {s: o.level for s, o in observed.items()}
        newly: list[str] = []
        cleared: dict[str, str] = {}
        for subject, o in observed.items():
            track = tracks.setdefault(subject, Track())
            span = cfg.min_span_s if o.sampled else 0.0
            track.add(o, cfg.min_rows, span)
            full = track.full(cfg.min_rows, span)
            if not track.firing:
                if warm and ((o.force and o.level == FIRE) or (
                        full and track.fire_n >= spec.fire_share * len(track.obs))):
                    track.firing = True
                    newly.append(subject)
            elif full and track.clear_n >= spec.clear_share * len(track.obs):
                track.firing = False
                cleared[subject] = rule.cleared(subject, rule.summary(track, None))
        for subject, track in tracks.items():
            if subject in observed:
                continue
            track.rows_since += 1
            if (track.rows_since >= STALE_ROWS and view.time - track.last_time >= STALE_S
                    and track.obs):
                if track.firing:
                    cleared[subject] = (f"{rule.label(subject)}: no longer measured since step "
                                        f"{track.obs[-1].step}")
                track.reset()
        events: list[Event] = []
        if isinstance(rule, SlowRank):
            events.extend(rule.one_offs(view, tracks, observed, warm))
        firing = self._firing[spec.name]
        if newly:
            firing.update(newly)
            events.append(self._fire_event(rule, view, newly, tracks))
        if cleared:
            firing.difference_update(cleared)
            if not firing:
                events.append(Event(
                    kind="alert", name=spec.name, state="resolved", step=view.step,
                    time=view.time, severity=spec.severity,
                    message=f"{spec.title}: resolved at step {view.step}. "
                            + "; ".join(cleared[s] for s in sorted(cleared, key=_order)) + ".",
                    data={},
                ))
        return events

    def _fire_event(self, rule: Rule, view: RowView, newly: list[str],
                    tracks: Mapping[str, Track]) -> Event:
        spec = rule.spec
        firing = sorted(self._firing[spec.name], key=_order)
        parts, data, summaries = [], {}, {}
        for subject in sorted(newly, key=_order):
            track = tracks[subject]
            med = summaries[subject] = rule.summary(track, FIRE)
            parts.append(rule.saw(subject, med))
            data.update(rule.data(subject, {k: round(v, 6) for k, v in med.items()}))
            if spec.subject == "rank" and subject.isdigit():
                data["rank"] = float(subject)
        first, last = newly_span(tracks, newly)
        n_fire = sum(tracks[s].fire_n for s in newly)
        n_all = sum(len(tracks[s].obs) for s in newly)
        also = [s for s in firing if s not in newly]
        message = (f"{spec.title}: " + "; ".join(parts)
                   + f" (windows of steps {first}-{last}: {n_fire} of {n_all} past the "
                     f"threshold; {rule.summarised})")
        if also:
            message += "; already firing for " + ", ".join(rule.label(s) for s in also)
        note = rule.note(summaries)
        message += "." + (f" {note}." if note else "")
        return Event(kind="alert", name=spec.name, state="firing", step=view.step,
                     time=view.time, severity=spec.severity, message=message,
                     advice=rule.advice, data=data)


_UNSEEN: tuple[str, int, str] = ("", -1, "")


def _parse_key(key: str) -> tuple[str, int, str] | None:
    """``("gpu", i, suffix)``, ``("rank", r, suffix)``, ``("perf", 0, key)`` for a key some
    rule reads; ``None`` for the others (``gpu/all/...``, ``train/...``, ...)."""
    head, _, rest = key.partition("/")
    if head == "perf" or key in SCALAR_KEYS:
        return ("perf", 0, key)
    if head == "node":
        return ("perf", 0, key) if rest.partition("/")[2] in NODE_KEYS else None
    if head not in ("gpu", "rank"):
        return None
    index, _, suffix = rest.partition("/")
    if suffix not in (GPU_KEYS if head == "gpu" else RANK_KEYS) or not index.isdigit():
        return None
    return (head, int(index), suffix)


def newly_span(tracks: Mapping[str, Track], subjects: Sequence[str]) -> tuple[int, int]:
    """First and last step of the evidence of ``subjects``."""
    firsts = [tracks[s].obs[0].step for s in subjects if tracks[s].obs]
    lasts = [tracks[s].obs[-1].step for s in subjects if tracks[s].obs]
    return (min(firsts), max(lasts)) if firsts else (0, 0)


def _order(subject: str) -> tuple[int, str]:
    return (int(subject), "") if subject.isdigit() else (-1, subject)
