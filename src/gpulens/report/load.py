"""Read a JSONL record back into rows, run by run.

A record (see :mod:`gpulens.sinks.jsonl`) may hold several runs, each opened by a
``{"event": "run_start", "run_id": ...}`` line whose id every row of the run carries.  Files
written before the header existed (rows only) load as one run without an id; rows that come
before the first header of a file form such a run too.

``load_jsonl(path)`` returns the *last* run; ``run="all"``, a 1-based number (negative counts
from the end) or a run id (or a unique prefix of one) choose others.  ``Record.runs`` lists
every run of the file either way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpulens.model import Event, Row

_WORK_KEYS = frozenset(("perf/tokens_per_s", "perf/samples_per_s", "perf/tflops"))
"""Keys that only the work of training steps (``log(step, tokens=...)``) gives."""


class ReportError(Exception):
    """A user error while reading or writing a report (missing file, nothing to report)."""


@dataclass
class GpuMeta:
    """What a run's header says about one GPU (``mem_total_gb`` in GB of 1e9 bytes)."""

    index: str
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    mem_total_gb: float | None = None
    power_limit_w: float | None = None
    default_power_limit_w: float | None = None
    max_sm_clock_mhz: float | None = None
    """The boost clock (MHz) the peak behind MFU assumes."""


@dataclass
class RunInfo:
    """One run of a record: its header (where the file has one) and what it holds."""

    number: int
    """1-based position of the run in the file."""
    run_id: str | None = None
    """``None`` for rows written without a header (files from before gpulens 0.1's header)."""
    start_time: float | None = None
    """Unix time of the run's header (the monitor's start)."""
    hostname: str | None = None
    backend: str | None = None
    """``"nvml"``, ``"simulated"``, ``"none"``, or ``None`` where the file does not say."""
    interval: float | None = None
    gpulens_version: str | None = None
    gpus: list[GpuMeta] = field(default_factory=list)
    meta: dict[str, str | float] = field(default_factory=dict)
    """The header's ``meta``: the compute dtype, MFU's denominator (``peak_gpu``,
    ``peak_dtype``, ``peak_tflops``, ``peak_source``), how model FLOPs were counted; empty
    where the header has none."""
    rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    last_time: float | None = None
    ended: bool = False
    """Whether the run's ``run_end`` line was written (no: killed, or still running)."""

    @property
    def label(self) -> str:
        return f"run {self.number}" + (f" ({self.run_id})" if self.run_id else "")


@dataclass
class Record:
    """The chosen run(s) of one JSONL record: rows in time order, events, and metadata."""

    path: Path
    rows: list[Row] = field(default_factory=list)
    skipped: int = 0
    """Lines that were neither a row (a JSON object with a numeric ``step`` and ``time``) nor
    a header or event line."""
    gpu_names: dict[str, str] = field(default_factory=dict)
    """GPU key -> model name, where the record says (the runs' headers)."""
    mem_total_gb: dict[str, float] = field(default_factory=dict)
    runs: list[RunInfo] = field(default_factory=list)
    """Every run of the file, in file order."""
    selected: list[RunInfo] = field(default_factory=list)
    """The runs whose rows are in :attr:`rows`."""
    events: list[Event] = field(default_factory=list)
    """Alerts and notices of the chosen runs, in time order."""
    run_of_row: list[int] = field(default_factory=list)
    """For each row of :attr:`rows`, the :attr:`RunInfo.number` of its run."""

    @property
    def trained(self) -> bool:
        """Whether the rows carry training scalars or the work of training steps (tokens or
        samples per second); if not (``gpulens record``), the steps are wall-clock interval
        numbers and per-step figures mean nothing."""
        return any((k.startswith("train/") and k != "train/global_step") or k in _WORK_KEYS
                   for r in self.rows for k in r.values)

    @property
    def backend(self) -> str | None:
        """The chosen runs' backend (``"nvml"``, ``"simulated"``, ``"none"``), ``"mixed"``
        when they differ, ``None`` where no header says."""
        found = {r.backend for r in self.selected if r.backend}
        if not found:
            return None
        return found.pop() if len(found) == 1 else "mixed"

    @property
    def simulated(self) -> bool:
        """Whether any chosen run sampled simulated GPUs."""
        return any(r.backend == "simulated" for r in self.selected)

    @property
    def meta(self) -> dict[str, str | float]:
        """The run metadata of the chosen runs (the header's ``meta``): keys on which every
        chosen run that has them agrees; a key whose value differs between runs is left out
        (:attr:`RunInfo.meta` has each run's own)."""
        out: dict[str, str | float] = {}
        differs: set[str] = set()
        for info in self.selected:
            for key, value in info.meta.items():
                if key in out and out[key] != value:
                    differs.add(key)
                out.setdefault(key, value)
        return {k: v for k, v in out.items() if k not in differs}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def load_jsonl(path: str | Path, run: str | None = None) -> Record:
    """Read ``path``; malformed lines are skipped and counted in ``Record.skipped``.

    Args:
        run: which run(s) of the file: ``None`` or ``"last"`` (the last run with rows),
            ``"all"``, ``"N"`` (1-based; ``"-1"`` is the last) or a run id (or a unique
            prefix of one).

    Raises:
        ReportError: the file is missing or unreadable, or ``run`` names no run of it.
    """
    p = Path(path)
    reader = _Reader(p)
    try:
        with p.open(encoding="utf-8", errors="replace") as f:
            reader.read(f)
    except FileNotFoundError:
        raise ReportError(f"no such file: {p}") from None
    except IsADirectoryError:
        raise ReportError(f"{p} is a directory, not a JSONL file") from None
    except OSError as e:
        raise ReportError(f"cannot read {p}: {e.strerror or e}") from None
    return reader.record(run)


class _Reader:
    """Parses line by line (constant memory beyond the rows themselves)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.runs: list[RunInfo] = []
        self.by_id: dict[str, RunInfo] = {}
        self.current: RunInfo | None = None
        self.rows: list[tuple[int, Row]] = []
        self.events: list[tuple[int, Event]] = []
        self.skipped = 0

    def _new_run(self, run_id: str | None) -> RunInfo:
        info = RunInfo(number=len(self.runs) + 1, run_id=run_id)
        self.runs.append(info)
        if run_id is not None:
            self.by_id[run_id] = info
        return info

    def _run_for(self, run_id: str | None) -> RunInfo:
        """The run a line with ``run_id`` belongs to (lines without one: the current run)."""
        if run_id is not None:
            found = self.by_id.get(run_id)
            if found is None:  # its header was lost (a truncated file): a run of its own
                found = self._new_run(run_id)
            self.current = found
            return found
        if self.current is None:
            self.current = self._new_run(None)
        return self.current

    def read(self, lines: Iterable[str]) -> None:
        for line in lines:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                self.skipped += 1
                continue
            if not isinstance(obj, dict):
                self.skipped += 1
                continue
            kind = obj.get("event")
            if kind is not None:
                self._event_line(str(kind), obj)
                continue
            gpus = obj.get("gpus")
            if isinstance(gpus, list) and "step" not in obj:  # an early header without "event"
                _read_gpus(gpus, self._run_for(_text(obj.get("run_id"))))
                continue
            self._row_line(obj)

    def _event_line(self, kind: str, obj: dict[str, object]) -> None:
        run_id = _text(obj.get("run_id"))
        if kind == "run_start":
            info = self._new_run(run_id)  # an id used twice: its later rows go to this run
            self.current = info
            info.start_time = _number(obj.get("time"))
            info.hostname = _text(obj.get("hostname"))
            info.backend = _text(obj.get("backend"))
            info.interval = _number(obj.get("interval"))
            info.gpulens_version = _text(obj.get("gpulens_version"))
            gpus = obj.get("gpus")
            if isinstance(gpus, list):
                _read_gpus(gpus, info)
            meta = obj.get("meta")
            if isinstance(meta, dict):
                info.meta = _read_meta(meta)
            return
        if kind == "run_end":
            self._run_for(run_id).ended = True
            return
        step, time = obj.get("step"), _number(obj.get("time"))
        if isinstance(step, bool) or not isinstance(step, int) or time is None:
            self.skipped += 1
            return
        data = obj.get("data")
        values = ({str(k): f for k, v in data.items() if (f := _number(v)) is not None}
                  if isinstance(data, dict) else {})
        event = Event(kind=kind, name=str(obj.get("name") or ""),
                      state=str(obj.get("state") or ""), step=step, time=time,
                      severity=str(obj.get("severity") or "warning"),
                      message=str(obj.get("message") or ""), advice=str(obj.get("advice") or ""),
                      data=values)
        self.events.append((self._run_for(run_id).number, event))

    def _row_line(self, obj: dict[str, object]) -> None:
        step, time = obj.get("step"), _number(obj.get("time"))
        if isinstance(step, bool) or not isinstance(step, int) or time is None:
            self.skipped += 1
            return
        values: dict[str, float] = {}
        for key, value in obj.items():
            if key in ("step", "time", "run_id"):
                continue
            f = _number(value)
            if f is not None:
                values[key] = f
            elif value is None and key.startswith("train/"):
                values[key] = math.nan  # the JSONL's null for a scalar that was not finite
        info = self._run_for(_text(obj.get("run_id")))
        info.rows += 1
        info.first_step = step if info.first_step is None else min(info.first_step, step)
        info.last_step = step if info.last_step is None else max(info.last_step, step)
        info.last_time = time if info.last_time is None else max(info.last_time, time)
        self.rows.append((info.number, Row(step=step, time=time, values=values)))

    def record(self, run: str | None) -> Record:
        chosen = self._choose(run)
        numbers = {r.number for r in chosen}
        pairs = sorted(((n, row) for n, row in self.rows if n in numbers),
                       key=lambda p: (p[1].time, p[0]))
        rec = Record(path=self.path, rows=[row for _, row in pairs],
                     run_of_row=[n for n, _ in pairs], skipped=self.skipped,
                     runs=self.runs, selected=chosen,
                     events=sorted((e for n, e in self.events if n in numbers),
                                   key=lambda e: e.time))
        for info in chosen:
            for g in info.gpus:
                if g.name:
                    rec.gpu_names.setdefault(g.index, g.name)
                if g.mem_total_gb:
                    rec.mem_total_gb.setdefault(g.index, g.mem_total_gb)
        return rec

    def _choose(self, run: str | None) -> list[RunInfo]:
        runs = self.runs
        if not runs:
            return []
        spec = (run or "last").strip()
        if spec == "all":
            return list(runs)
        if spec == "last":
            with_rows = [r for r in runs if r.rows]
            return [with_rows[-1] if with_rows else runs[-1]]
        listing = ", ".join(r.label for r in runs)
        number = int(spec) if spec.lstrip("-").isdigit() else None
        if number is not None and 1 <= number <= len(runs):
            return [runs[number - 1]]
        if number is not None and -len(runs) <= number <= -1:
            return [runs[number]]
        if spec in self.by_id:
            return [self.by_id[spec]]
        matches = [r for r in runs if r.run_id and r.run_id.startswith(spec)]
        if len(matches) == 1:
            return matches
        if matches:
            what = f"several runs with id {spec!r}"
        elif number is not None:
            what = f"no run {number}"
        else:
            what = f"no run with id {spec!r}"
        raise ReportError(f"{what} in {self.path}; runs: {listing}")


def _read_meta(meta: dict[object, object]) -> dict[str, str | float]:
    """Text and finite numbers of a header's ``meta``; ``null`` and anything else left out."""
    out: dict[str, str | float] = {}
    for key, value in meta.items():
        if isinstance(value, str):
            out[str(key)] = value
        elif (f := _number(value)) is not None:
            out[str(key)] = f
    return out


def _read_gpus(gpus: list[object], info: RunInfo) -> None:
    for g in gpus:
        if not isinstance(g, dict) or "index" not in g:
            continue
        info.gpus.append(GpuMeta(
            index=str(g["index"]), name=_text(g.get("name")), uuid=_text(g.get("uuid")),
            pci_bus_id=_text(g.get("pci_bus_id")), mem_total_gb=_number(g.get("mem_total_gb")),
            power_limit_w=_number(g.get("power_limit_w")),
            default_power_limit_w=_number(g.get("default_power_limit_w")),
            max_sm_clock_mhz=_number(g.get("max_sm_clock_mhz")),
        ))
