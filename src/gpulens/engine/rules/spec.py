"""What a rule is made of: its thresholds (:class:`Threshold`) and its spec (:class:`RuleSpec`).

Each rule's spec sits beside the rule, in its own module; :data:`gpulens.engine.rules.RULES`
gathers them (:mod:`gpulens.engine.rules.catalog`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal[">=", "<="]


@dataclass(frozen=True)


class Threshold:
    """One figure a rule compares: at fire level when ``value <op> fire``; at clear level when
    the opposite side of ``clear`` holds (``value < clear`` for ``>=``, ``value > clear`` for
    ``<=``).  Between the two it is neither: that gap is the hysteresis."""

    name: str
    """Short name, unique within the rule (``"throttle_power"``)."""
    quantity: str
    """What is compared, in row keys (``gpu/{i}/throttle_power_pct``)."""
    op: Op
    fire: float
    clear: float
    unit: str
    doc: str

    def at_fire(self, value: float) -> bool:
        """``value`` is past the fire threshold."""
        return value >= self.fire if self.op == ">=" else value <= self.fire

    def at_clear(self, value: float) -> bool:
        """``value`` is past the clear threshold (on the healthy side)."""
        return value < self.clear if self.op == ">=" else value > self.clear


@dataclass(frozen=True)


class RuleSpec:
    """A rule: its name (``alerts/<name>``), subject, severity, thresholds and persistence."""

    name: str
    subject: Literal["job", "gpu", "rank"]
    severity: Literal["info", "warning", "critical"]
    title: str
    """What the rule says when it fires, in a few words."""
    thresholds: tuple[Threshold, ...]
    fire_share: float = 0.8
    """Share of the evidence at fire level that makes the rule fire."""
    training: bool = True
    """The rule judges training steps (its evidence or its advice is about them): it runs only
    on rows that ``log()`` wrote for training steps, never on the wall-clock rows of ``gpulens
    record`` and ``serve`` (:attr:`RulesConfig.training`).  ``False``: a fact of the hardware
    (the power cap, heat), true whatever runs."""
    clear_share: float = 0.8
    """Share of the evidence at clear level that clears it."""

    def threshold(self, name: str) -> Threshold:
        """The threshold called ``name``; ``KeyError`` if there is none."""
        for t in self.thresholds:
            if t.name == name:
                return t
        raise KeyError(f"rule {self.name} has no threshold {name!r}")
