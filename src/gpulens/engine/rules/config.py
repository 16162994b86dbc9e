"""What the rules need to know about the run (:class:`RulesConfig`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpulens.engine.rules.catalog import RULES
from gpulens.model import GpuInfo, JobShape


@dataclass(frozen=True)


class RulesConfig:
    """What the rules need to know about the run.

    Args:
        dtype: the compute dtype as gpulens names it (``"bf16"``, ``"fp16"`` ...:
            :func:`gpulens.work.precision.normalize_dtype`); ``low_tensor_use`` judges only
            bf16/fp16 runs and stays quiet (no key) when it is unknown.
        gpus: the monitored GPUs (``RunContext.gpus``): total memory and power limit.
        job: a distributed job's shape (``RunContext.job``), for node names in messages.
        distributed: rows hold one GPU per rank (rank 0's gathered rows); turns on
            ``slow_rank`` from GPM figures.  Rows with ``rank/{r}/cpu_busy_s`` keys turn it on
            too.
        min_steps: training steps before any rule may fire.
        min_rows: the least number of windows a rule's evidence holds.
        min_span_s: the least wall-clock time (s) the evidence of a rule on sampled GPU
            figures covers.
        disabled: names of rules to leave out.
        training: the rows are training steps (``log()`` in a training loop).  ``False``:
            ticks of a wall clock (``gpulens record``, ``serve``): only the rules that judge
            the hardware run (:attr:`RuleSpec.training`); no rule about training steps judges
            rows that hold none.
    """

    dtype: str | None = None
    gpus: Sequence[GpuInfo] = ()
    job: JobShape | None = None
    """A distributed job's shape (node names for the slow-rank rule's words)."""
    distributed: bool = False
    min_steps: int = 20
    min_rows: int = 10
    min_span_s: float = 2.0
    disabled: frozenset[str] = frozenset()
    training: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.disabled) - set(RULES)
        if unknown:
            raise ValueError(f"unknown rule(s) {sorted(unknown)}; known: {sorted(RULES)}")
        if self.min_steps < 0 or self.min_rows < 1 or self.min_span_s < 0:
            raise ValueError("min_steps >= 0, min_rows >= 1 and min_span_s >= 0 are required")
