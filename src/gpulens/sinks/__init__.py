"""Sinks: where rows go.  ``resolve_sink("jsonl:runs/gpu.jsonl")`` imports only what it needs.

Names map to ``"module:Class"`` strings; each class has a ``from_spec(arg)`` classmethod taking
the text after the first ``:`` (or ``None``).  Sink objects of the :class:`Sink` protocol are
accepted as they are.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from gpulens.sinks.base import Sink

SINKS: dict[str, str] = {
    "jsonl": "gpulens.sinks.jsonl:JsonlSink",
    "wandb": "gpulens.sinks.wandb:WandbSink",
    "mlflow": "gpulens.sinks.mlflow:MlflowSink",
    "prometheus": "gpulens.sinks.prometheus:PrometheusSink",
    "dashboard": "gpulens.sinks.dashboard:DashboardSink",
}

__all__ = ["SINKS", "Sink", "check_sinks", "resolve_sink"]


def resolve_sink(spec: str | Sink) -> Sink:
    """Turn ``"name"`` / ``"name:arg"`` or a sink object into a sink; ``ValueError`` if unknown."""
    if not isinstance(spec, str):
        if not isinstance(spec, Sink):
            raise ValueError(
                f"sink {spec!r} is neither a sink name nor an object with open/write/close"
            )
        return spec
    name, _, arg = spec.partition(":")
    target = SINKS.get(name.strip().lower())
    if target is None:
        known = ", ".join(f"'{n}'" for n in sorted(SINKS))
        raise ValueError(
            f"unknown sink {spec!r}; known sinks: {known} (e.g. 'jsonl:runs/gpu.jsonl')"
        )
    module_name, _, cls_name = target.partition(":")
    cls: Any = getattr(importlib.import_module(module_name), cls_name)
    sink: Sink = cls.from_spec(arg or None)
    return sink


def check_sinks(sinks: Iterable[Any]) -> None:
    """Call each sink's optional ``check()``: a sink that cannot work (W&B without a login, an
    MLflow server that does not answer) raises a one-line ``ValueError`` before any sink opens
    or any run is made (:meth:`gpulens.Monitor.start` calls this first)."""
    for sink in sinks:
        check = getattr(sink, "check", None)
        if check is not None:
            check()
