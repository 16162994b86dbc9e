"""Read a JSONL record (one JSON object a line: ``step``, ``time`` and row keys) back into rows."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpulens.sinks.base import Row


class ReportError(Exception):
    """A user error while reading or writing a report (missing file, nothing to report)."""


@dataclass
class Record:
    """The rows of one JSONL record, in time order."""

    path: Path
    rows: list[Row] = field(default_factory=list)
    skipped: int = 0
    """Lines that were not a JSON object with a numeric ``step`` and ``time``."""
    gpu_names: dict[str, str] = field(default_factory=dict)
    """GPU key -> model name, where the record says (a ``gpus`` list of objects)."""
    mem_total_gb: dict[str, float] = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        """Whether the rows carry training scalars; if not (``gpulens record``), the steps are
        wall-clock interval numbers and per-step figures mean nothing."""
        return any(k.startswith("train/") and k != "train/global_step"
                   for r in self.rows for k in r.values)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def load_jsonl(path: str | Path) -> Record:
    """Read ``path``; malformed lines are skipped and counted in ``Record.skipped``.

    Raises:
        ReportError: the file is missing or unreadable.
    """
    p = Path(path)
    record = Record(path=p)
    try:
        with p.open(encoding="utf-8", errors="replace") as f:
            _read_lines(f, record)
    except FileNotFoundError:
        raise ReportError(f"no such file: {p}") from None
    except IsADirectoryError:
        raise ReportError(f"{p} is a directory, not a JSONL file") from None
    except OSError as e:
        raise ReportError(f"cannot read {p}: {e.strerror or e}") from None
    record.rows.sort(key=lambda r: r.time)
    return record


def _read_lines(lines: Iterable[str], record: Record) -> None:
    """Parse line by line (constant memory beyond the rows themselves)."""
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            record.skipped += 1
            continue
        if not isinstance(obj, dict):
            record.skipped += 1
            continue
        gpus = obj.get("gpus")
        if isinstance(gpus, list) and "step" not in obj:
            _read_gpu_info(gpus, record)
            continue
        step, time = obj.get("step"), _number(obj.get("time"))
        if isinstance(step, bool) or not isinstance(step, int) or time is None:
            record.skipped += 1
            continue
        values: dict[str, float] = {}
        for key, value in obj.items():
            if key in ("step", "time"):
                continue
            f = _number(value)
            if f is not None:
                values[key] = f
        record.rows.append(Row(step=step, time=time, values=values))


def _read_gpu_info(gpus: list[object], record: Record) -> None:
    for g in gpus:
        if not isinstance(g, dict) or "index" not in g:
            continue
        key = str(g["index"])
        if isinstance(g.get("name"), str):
            record.gpu_names[key] = g["name"]
        total = _number(g.get("mem_total_gb"))
        if total is not None:
            record.mem_total_gb[key] = total
