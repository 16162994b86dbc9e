"""Sinks: where rows go, and the one registry of sink names.

A sink is chosen in one of two ways:

* **by name**, a spec string parsed once, here, into a :class:`SinkSpec`:
  ``"jsonl:runs/gpu.jsonl"``, ``"mlflow"``, ``"mlflow:RUN_ID"``, ``"mlflow:all"``,
  ``"wandb"``, ``"wandb:all"``, ``"prometheus:9401"``, ``"dashboard:0.0.0.0:8765"``
  (:func:`parse_sink`), or with options
  given in code (:func:`sink_spec`: ``sink_spec("mlflow", include_train=False)``).  Parsing
  imports no tracker library and changes nothing (no file, no run, no environment variable); a
  bad name or option is a one-line ``ValueError`` there.  A spec pickles: the sink object is
  built from it where it runs (:attr:`SinkKind.where`): every one of them in the engine (its
  own process, by default); W&B's there too, attached to the training process's run through
  W&B's service (:mod:`gpulens.sinks.wandb_run`).  Its name in every message and in
  ``Monitor.sink_stats`` is the text the user wrote (``"jsonl:/dev/full"``).
* **by object**: anything with ``open``/``write``/``close`` (:class:`~gpulens.sinks.base.Sink`),
  written in the training process as it is, named by its class.

When a monitor starts, each spec is *prepared* in the caller (:meth:`SinkSpec.prepared`): what
only the training process knows is resolved (the active MLflow run, the tracking URI set with
``mlflow.set_tracking_uri``, a relative path) and what can be checked cheaply is checked (a
path that cannot be written, a tracking server that refuses connections, a port in use, a
store that MLflow refuses), so such a mistake is a ``ValueError`` from ``start()``; the
active W&B run is handed over the same way.

The sink classes take part through three static methods (``spec_options(text)``: the options
of ``"kind:text"``; ``check_options(options)``: their values, checked; and optionally
``prepare_options(options)``: the start-time step above).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpulens.model import CLIENT, ENGINE, SinkSpec, _load
from gpulens.sinks.base import Sink


@dataclass(frozen=True)
class SinkKind:
    """One entry of :data:`SINKS`."""

    target: str
    """``"module:Class"`` of the sink, imported only to parse, prepare and build (the module
    imports no tracker library itself)."""
    where: str
    """Where the sink object is built and written: :data:`ENGINE` (the engine: its own process,
    or its thread with ``isolation="thread"``) or :data:`CLIENT` (the training process)."""
    options: tuple[str, ...]
    """The keyword options a spec may give (the class's constructor arguments that pickle)."""
    syntax: str
    """How it is written, for messages."""


SINKS: dict[str, SinkKind] = {
    "jsonl": SinkKind("gpulens.sinks.jsonl:JsonlSink", ENGINE, ("path", "run_id"),
                      "'jsonl:runs/gpu.jsonl'"),
    "mlflow": SinkKind("gpulens.sinks.mlflow:MlflowSink", ENGINE,
                       ("run_id", "tracking_uri", "include_train", "keys", "section"),
                       "'mlflow', 'mlflow:RUN_ID', 'mlflow:all' or 'mlflow:RUN_ID,all'"),
    "wandb": SinkKind("gpulens.sinks.wandb:WandbSink", ENGINE,
                      ("run", "include_train", "keys", "section", "step_metric",
                       "detail_interval"),
                      "'wandb', 'wandb:all' or 'wandb:default'"),
    "prometheus": SinkKind("gpulens.sinks.prometheus:PrometheusSink", ENGINE,
                           ("port", "host", "training"),
                           "'prometheus', 'prometheus:PORT' or 'prometheus:HOST:PORT'"),
    "dashboard": SinkKind("gpulens.sinks.dashboard:DashboardSink", ENGINE,
                          ("port", "host", "history_rows", "title"),
                          "'dashboard', 'dashboard:PORT' or 'dashboard:HOST:PORT'"),
}
"""Every sink that can be chosen by name."""

__all__ = ["CLIENT", "ENGINE", "SINKS", "Sink", "SinkKind", "SinkSpec", "as_sink",
           "check_port", "check_sinks", "host_port_options", "parse_sink", "port_taken",
           "prepare_sinks", "resolve_sink",
           "sink_label", "sink_spec", "unique_names", "with_options"]


def parse_sink(text: str) -> SinkSpec:
    """``"kind"`` or ``"kind:argument"`` -> a :class:`SinkSpec` (see the module docstring);
    ``ValueError`` (one line) for an unknown kind or a bad argument."""
    if not isinstance(text, str):
        raise ValueError(f"sink {text!r} is not a sink name")
    name = text.strip()
    kind_name, _, arg = name.partition(":")
    kind_name = kind_name.strip().lower()
    kind = SINKS.get(kind_name)
    if kind is None:
        known = ", ".join(f"'{n}'" for n in sorted(SINKS))
        raise ValueError(f"unknown sink {text!r}; known sinks: {known} "
                         "(e.g. 'jsonl:runs/gpu.jsonl')")
    cls = _load(kind.target)
    options: dict[str, Any] = cls.spec_options(arg.strip() or None)
    return SinkSpec(name=name, kind=kind_name, options=cls.check_options(options),
                    target=kind.target, where=kind.where)


def sink_spec(kind: str, *, name: str | None = None, **options: Any) -> SinkSpec:
    """A sink of :data:`SINKS` with options given in code, e.g. ``sink_spec("mlflow",
    include_train=False, keys="all")``; ``name`` (default: ``kind``) is its name in messages
    and stats.  ``ValueError`` (one line) for an unknown kind or option or a bad value."""
    entry = SINKS.get(kind)
    if entry is None:
        known = ", ".join(f"'{n}'" for n in sorted(SINKS))
        raise ValueError(f"unknown sink {kind!r}; known sinks: {known}")
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        raise ValueError(f"the {kind} sink has no option {', '.join(map(repr, unknown))} "
                         f"(its options: {', '.join(entry.options)})")
    checked = _load(entry.target).check_options(dict(options))
    return SinkSpec(name=name or kind, kind=kind, options=checked, target=entry.target,
                    where=entry.where)


def with_options(spec: SinkSpec, **options: Any) -> SinkSpec:
    """A copy of a registry sink's ``spec`` with these options changed (checked like those
    parsed: :func:`sink_spec`)."""
    return sink_spec(spec.kind, name=spec.name, **{**spec.options, **options})


def as_sink(item: str | SinkSpec | Sink) -> SinkSpec | Sink:
    """A sink as a monitor keeps it: a string parsed (:func:`parse_sink`), a spec or an object
    with ``open``/``write``/``close`` as it is; ``ValueError`` for anything else."""
    if isinstance(item, str):
        return parse_sink(item)
    if isinstance(item, (SinkSpec, Sink)):
        return item
    raise ValueError(f"sink {item!r} is neither a sink name nor an object with "
                     "open/write/close")


def resolve_sink(item: str | SinkSpec | Sink) -> Sink:
    """A sink object in this process: a name or spec built here (for code that writes rows
    itself; a monitor builds each spec where it runs)."""
    sink = as_sink(item)
    return sink.build() if isinstance(sink, SinkSpec) else sink


def check_sinks(sinks: Iterable[Any]) -> None:
    """The start-time checks, before anything is made: each spec prepared (see
    :meth:`SinkSpec.prepared`), each object's optional ``check()`` called.  A sink that cannot
    work (W&B without a login, an MLflow server that refuses connections, a port in use)
    raises a one-line ``ValueError``.  :meth:`gpulens.Monitor.start` does this itself."""
    for sink in sinks:
        if isinstance(sink, SinkSpec):
            sink.prepared()
            continue
        check = getattr(sink, "check", None)
        if check is not None:
            check()


def prepare_sinks(sinks: Iterable[SinkSpec | Sink]) -> list[SinkSpec | Sink]:
    """What ``Monitor.start()`` does first, on its caller's thread: each spec prepared
    (:meth:`SinkSpec.prepared`), each object's ``prepare()`` (or else ``check()``) called.  A
    one-line ``ValueError`` for what cannot work, before anything is made."""
    out: list[SinkSpec | Sink] = []
    for sink in sinks:
        if isinstance(sink, SinkSpec):
            out.append(sink.prepared())
            continue
        hook = getattr(sink, "prepare", None) or getattr(sink, "check", None)
        if hook is not None:
            hook()
        out.append(sink)
    return out


def sink_label(sink: SinkSpec | Sink) -> str:
    """A spec's name as written, an object's ``label`` where it has one (a string), else its
    class name."""
    if isinstance(sink, SinkSpec):
        return sink.name
    label = getattr(sink, "label", None)
    return label if isinstance(label, str) and label else type(sink).__name__


def unique_names(sinks: Iterable[SinkSpec | Sink]) -> list[str]:
    """:func:`sink_label` of each, numbered from the second of a name: ``MemorySink``,
    ``MemorySink#2``."""
    seen: dict[str, int] = {}
    names: list[str] = []
    for sink in sinks:
        base = sink_label(sink)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def port_taken(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound now (``None``: it can; port 0 always can).  A cheap
    start-time check for the sinks that serve HTTP; the server binds it for real later."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        return exc
    return None


def host_port_options(kind: str, arg: str | None, syntax: str) -> dict[str, Any]:
    """The options of ``"kind:PORT"`` or ``"kind:HOST:PORT"`` (``[::1]:PORT`` for IPv6;
    127.0.0.1 when no host is given): ``{"port", "host"}``, ``{}`` for ``"kind"``;
    ``ValueError`` naming ``syntax`` otherwise."""
    if arg is None or not arg.strip():
        return {}
    host, sep, port_text = arg.strip().rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{kind} sink: expected {syntax}, got '{kind}:{arg}'") from None
    return {"port": port, "host": host.strip("[]") if sep and host else "127.0.0.1"}


def check_port(kind: str, port: object) -> None:
    """``ValueError`` (one line) unless ``port`` is a TCP port number (0: any free one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{kind} sink: port must be 0-65535, not {port!r}")

