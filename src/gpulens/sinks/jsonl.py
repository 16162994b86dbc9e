"""JSONL: one JSON object a line, appended and flushed line by line.

A file may hold several runs (a hyper-parameter search that re-uses one path, a resumed job):
the sink never overwrites, it appends.  Each run is told apart by its run id:

* ``{"event": "run_start", "run_id": ..., "time": ..., "hostname": ..., "backend": ...,
  "interval": ..., "gpus": [{"index", "name", "uuid", "pci_bus_id", "mem_total_gb",
  "power_limit_w", "default_power_limit_w", "max_sm_clock_mhz"}, ...], "meta": {...},
  "gpulens_version": ...}`` opens each run (``backend`` is ``"nvml"``, ``"simulated"`` or
  ``"none"``; ``time`` in unix seconds; ``interval`` in seconds between samples;
  ``mem_total_gb`` in GB of 1e9 bytes; ``power_limit_w`` (enforced) and
  ``default_power_limit_w`` in W; ``max_sm_clock_mhz``, the boost clock MFU's peak assumes, in
  MHz; a figure the GPU does not give is ``null``).  ``meta`` is the run's
  :attr:`~gpulens.model.RunContext.meta`: the compute ``dtype``, MFU's denominator
  (``peak_gpu``, ``peak_dtype``, ``peak_tflops`` in TFLOP/s of one GPU, ``peak_source``), how
  model FLOPs are counted (``flops_per_token`` / ``flops_per_sample``, ``flops_method`` ...);
  ``{}`` when the run has none (no dtype given, an unknown GPU: then rows have no MFU).
  In a distributed job, ``gpus`` lists every GPU of the job (rank 0's file) or of the node
  (another node's file, :meth:`JsonlSink.for_node`), each with its ``rank``, ``local_rank``,
  ``node`` (index) and ``node_name``, and a ``job`` object says ``world`` (ranks), ``nodes``,
  ``launcher``, ``view`` (``"job"`` or ``"node"``), ``missing_ranks`` (ranks that did not
  answer at start) and ``node_names`` (node index -> name);
* a row line per :class:`~gpulens.model.Row`: ``run_id``, ``step``, ``time`` (unix seconds
  at the end of the window) and the row's keys; a value that is not finite (a NaN loss) is
  written as ``null`` (``gpulens report`` says how many rows had a training scalar so, from
  which step);
* an event line per :class:`~gpulens.model.Event` of a row, after that row:
  ``{"event": "alert"|"notice", "run_id", "step", "time", "name", "state", "severity",
  "message", "advice", "data"}``;
* ``{"event": "run_end", "run_id": ..., "time": ..., "rows": N}`` when the run closes cleanly
  (a killed job leaves none, and every line written before is readable).

Every line that is not a row carries an ``event`` key, so ``[r for r in lines if "event" not in
r]`` gives the rows.  :func:`gpulens.report.load_jsonl` reads such a file run by run (and files
written before the header existed as one run).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import IO, Any

from gpulens.model import Event, GpuInfo, Row, RunContext


def new_run_id() -> str:
    """A run id that sorts by start time and is unique within a file: ``20261126-082042-3fa9c1``
    (UTC date and time, then 6 random hex digits)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


class JsonlSink:
    """Appends the rows of one run to ``path`` (parent folders are made; an existing file is
    kept and the run is added after what it holds).

    Args:
        path: the JSONL file.
        run_id: the id written on every line of this run (default: :func:`new_run_id` at
            ``open``, or the ``run_id`` of the :class:`RunContext` where it has one).
    """

    def __init__(self, path: str | os.PathLike[str], run_id: str | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self._file: IO[bytes] | None = None
        self._pending = ""
        """The header line, until it is written (a full disk at open puts it off)."""
        self._rows = 0
        _check_writable(self.path)

    @staticmethod
    def spec_options(arg: str | None) -> dict[str, Any]:
        """``"jsonl:PATH"`` -> ``{"path": PATH}``."""
        if not arg:
            raise ValueError("the jsonl sink needs a path: 'jsonl:runs/gpu.jsonl'")
        return {"path": arg}

    def for_node(self, node: int) -> JsonlSink:
        """The record a distributed job's node ``node`` writes, beside this one (above 8
        ranks, each node's leader): ``gpu.jsonl`` -> ``gpu.node1.jsonl``."""
        return JsonlSink(**self.node_options({"path": str(self.path), "run_id": self.run_id},
                                             node))

    @staticmethod
    def node_options(options: dict[str, Any], node: int) -> dict[str, Any]:
        """The options of :meth:`for_node`'s sink, for a sink chosen by name."""
        path = Path(options["path"])
        return {**options, "path": str(path.with_name(f"{path.stem}.node{node}{path.suffix}"))}

    @staticmethod
    def check_options(options: dict[str, Any]) -> dict[str, Any]:
        """``ValueError`` (one line) if the path cannot be written."""
        path = options.get("path")
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError("the jsonl sink needs a path: 'jsonl:runs/gpu.jsonl'")
        _check_writable(Path(path))
        run_id = options.get("run_id")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"the jsonl sink's run_id must be text, got {run_id!r}")
        return {**options, "path": str(path)}

    @staticmethod
    def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
        """At start: the path made absolute (the engine writes it wherever it runs from) and
        checked again."""
        path = Path(options["path"]).absolute()
        _check_writable(path)
        return {**options, "path": str(path)}

    @classmethod
    def from_spec(cls, arg: str | None) -> JsonlSink:
        """The sink of ``"jsonl:PATH"``, built here."""
        return cls(**cls.check_options(cls.spec_options(arg)))

    def open(self, context: RunContext) -> None:
        """Open ``path`` for appending and write the run's ``run_start`` line."""
        if self.run_id is None:
            given = getattr(context, "run_id", None)
            self.run_id = given if isinstance(given, str) and given else new_run_id()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = _ends_without_newline(self.path)
            # unbuffered: a line is written whole or not at all, so a retried write (after a
            # full disk, say) never leaves a line twice
            self._file = self.path.open("ab", buffering=0)
        except OSError as exc:
            raise ValueError(f"cannot write the JSONL record {str(self.path)!r}: {exc}") from exc
        self._rows = 0
        # a killed job's half line: the header must start a line of its own
        self._pending = ("\n" if torn else "") + _dumps(header(context, self.run_id)) + "\n"
        # a full disk: the header goes with the first row the step logger retries
        with contextlib.suppress(OSError):
            self._flush_pending()

    def write(self, row: Row) -> None:
        assert self._file is not None, "JsonlSink.write before open"
        record: dict[str, object] = {"run_id": self.run_id, "step": row.step,
                                     "time": round(row.time, 6)}
        for key, value in row.values.items():
            record[key] = value if math.isfinite(value) else None
        lines = [_dumps(record)]
        lines.extend(_dumps(event_line(e, self.run_id)) for e in row.events)
        self._flush_pending()
        self._file.write("".join(line + "\n" for line in lines).encode())
        self._rows += 1

    def close(self) -> None:
        if self._file is not None:
            try:
                self._line({"event": "run_end", "run_id": self.run_id,
                            "time": round(time.time(), 6), "rows": self._rows})
            finally:
                self._file.close()
                self._file = None

    def _line(self, obj: dict[str, object]) -> None:
        assert self._file is not None
        self._flush_pending()
        self._file.write((_dumps(obj) + "\n").encode())

    def _flush_pending(self) -> None:
        """Write the header line if it is still to be written (raises ``OSError``)."""
        if self._pending and self._file is not None:
            self._file.write(self._pending.encode())
            self._pending = ""


def header(context: RunContext, run_id: str | None) -> dict[str, object]:
    """The ``run_start`` line of a run, from its :class:`RunContext`."""
    from gpulens import __version__

    job = getattr(context, "job", None)
    placed: list[tuple[GpuInfo, dict[str, object]]] = []
    if job is not None:  # every GPU of the job (rank 0) or of the node (another leader)
        for r in job.ranks:
            placed += [(g, {"rank": r.rank, "local_rank": r.local_rank, "node": r.node,
                            "node_name": r.node_name}) for g in r.gpus]
    else:
        placed = [(g, {}) for g in context.gpus]
    out: dict[str, object] = {
        "event": "run_start",
        "run_id": run_id,
        "time": round(time.time(), 6),
        "hostname": context.hostname,
        "backend": context.backend,
        "interval": _finite(context.interval),
        "gpus": [
            {"index": g.index, "name": g.name, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
             "mem_total_gb": _finite(g.mem_total_gb), "power_limit_w": _finite(g.power_limit_w),
             "default_power_limit_w": _finite(g.default_power_limit_w),
             "max_sm_clock_mhz": _finite(g.max_sm_clock_mhz), **where}
            for g, where in placed
        ],
        "meta": _meta(getattr(context, "meta", None)),
        "gpulens_version": __version__,
    }
    if job is not None:
        out["job"] = {"world": job.world, "nodes": job.nodes, "launcher": job.launcher,
                      "view": job.view, "missing_ranks": list(job.missing),
                      "node_names": {str(n): name for n, name in
                                     sorted(job.node_names().items())}}
    return out


def _meta(meta: object) -> dict[str, object]:
    """The run's metadata as JSON: text as it is, numbers finite or ``null``; a value of any
    other type (a sink handed an odd context) as its text, never a reason not to write the
    header."""
    if not isinstance(meta, dict):
        return {}
    out: dict[str, object] = {}
    for key, value in meta.items():
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[str(key)] = value
        elif isinstance(value, int | float):
            out[str(key)] = _finite(float(value)) if isinstance(value, float) else value
        else:
            out[str(key)] = str(value)
    return out


def event_line(event: Event, run_id: str | None) -> dict[str, object]:
    """The JSONL line of one :class:`Event` (``"event"`` is its kind: alert or notice)."""
    return {
        "event": event.kind, "run_id": run_id, "step": event.step,
        "time": round(event.time, 6), "name": event.name, "state": event.state,
        "severity": event.severity, "message": event.message, "advice": event.advice,
        "data": {k: _finite(v) for k, v in event.data.items()},
    }


def _finite(value: float | None) -> float | None:
    """``value``, or ``None`` (JSON ``null``) where it is missing or not finite."""
    return value if value is not None and math.isfinite(value) else None


def _dumps(obj: dict[str, object]) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def _ends_without_newline(path: Path) -> bool:
    """Whether ``path`` exists, is not empty and its last byte is not a newline."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _check_writable(path: Path) -> None:
    """``ValueError`` now, before training, if ``path`` cannot be written."""
    if path.is_dir():
        raise ValueError(f"the JSONL path {str(path)!r} is a directory")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the JSONL record {str(path)!r}: "
                         f"{str(parent)!r} is not a writable directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write the JSONL record {str(path)!r}: permission denied")
