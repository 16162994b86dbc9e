"""Every rule, in the order the engine runs them: :data:`RULES` (the specs, by name: the one
source of truth for thresholds) and :data:`RULE_CLASSES` (the code that judges each)."""

from __future__ import annotations

from gpulens.engine.rules import (
    comm_bound,
    creep,
    headroom,
    input_bound,
    low_tensor,
    power_capped,
    retries,
    slow_rank,
    thermal,
    under_used,
)
from gpulens.engine.rules.base import Rule
from gpulens.engine.rules.spec import RuleSpec

_ALL: tuple[tuple[RuleSpec, type[Rule]], ...] = (
    (input_bound.SPEC, input_bound.InputBound),
    (power_capped.SPEC, power_capped.PowerCapped),
    (thermal.SPEC, thermal.Thermal),
    (low_tensor.SPEC, low_tensor.LowTensorUse),
    (under_used.SPEC, under_used.UnderUsed),
    (headroom.SPEC, headroom.MemoryHeadroom),
    (retries.SPEC, retries.AllocRetries),
    (creep.SPEC, creep.MemoryCreep),
    (slow_rank.SPEC, slow_rank.SlowRank),
    (comm_bound.SPEC, comm_bound.CommBound),
)

RULES: dict[str, RuleSpec] = {spec.name: spec for spec, _ in _ALL}
"""Every rule, by name, with its thresholds: the one source of truth."""
RULE_CLASSES: dict[str, type[Rule]] = {spec.name: cls for spec, cls in _ALL}
"""The class that judges each rule, by name."""


def rules_table() -> str:
    """A Markdown table of every rule and threshold (for docs), built from :data:`RULES`."""
    lines = ["| rule | subject | severity | threshold | compares | fires | clears | evidence |",
             "|---|---|---|---|---|---|---|---|"]
    for spec in RULES.values():
        for t in spec.thresholds:
            clear_op = "<" if t.op == ">=" else ">"
            unit = f" {t.unit}" if t.unit and t.unit not in ("count",) else ""
            lines.append(
                f"| {spec.name} | {spec.subject} | {spec.severity} | {t.name} | "
                f"{t.quantity} | {t.op} {t.fire:g}{unit} | {clear_op} {t.clear:g}{unit} | "
                f"fire {spec.fire_share:.0%}, clear {spec.clear_share:.0%} |")
    return "\n".join(lines)
