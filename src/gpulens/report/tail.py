"""Follow a JSONL record while a training writes it: the latest step of its newest run.

``gpulens watch --record PATH`` shows it beside the node's GPUs::

    tail = RecordTail("runs/gpu.jsonl")
    status = tail.poll()          # reads what was appended since the last call
    status.step, status.values["train/loss"], status.firing

Reading is bounded: the first poll reads at most the last ``initial_bytes`` of the file (a
long record's start holds nothing the view needs but the run's header, whose metadata is then
unknown until the next run starts), later polls what was appended, at most ``max_bytes`` each.
Only whole lines are read (a line still being written waits for the next poll); of a batch of
rows only the last is parsed.  A file that is replaced or truncated (a new run written to a
fresh file under the same name) is read again from its start.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class AlertEvent:
    """An alert event line of the run: a rule fired or cleared at ``step``."""

    name: str
    state: str
    step: int
    message: str = ""
    advice: str = ""


@dataclass
class TrainingStatus:
    """What the record says now (units: the row keys' own; ``time`` in unix seconds)."""

    path: Path
    exists: bool = False
    run_id: str | None = None
    meta: dict[str, str | float] = field(default_factory=dict)
    """The run header's ``meta`` (dtype, MFU's peak), empty where the header was not read."""
    step: int | None = None
    time: float | None = None
    """Unix time at the end of the latest row's window."""
    values: dict[str, float] = field(default_factory=dict)
    """The latest row's finite values."""
    ended: bool = False
    """The run's ``run_end`` line was written (the training stopped cleanly)."""
    events: deque[AlertEvent] = field(default_factory=lambda: deque(maxlen=50))
    """The run's latest alert events, oldest first."""
    error: str | None = None
    """Why the file cannot be read (permission denied, a directory), if so."""

    @property
    def firing(self) -> list[str]:
        """Rules firing in the latest row (``alerts/<rule>`` = 1), in name order."""
        return sorted(k.removeprefix("alerts/") for k, v in self.values.items()
                      if k.startswith("alerts/") and v >= 1)

    def fired_at(self, rule: str) -> int | None:
        """The step at which ``rule`` last started firing, where the record says."""
        for e in reversed(self.events):
            if e.name == rule and e.state == "firing":
                return e.step
        return None


class RecordTail:
    """Reads a JSONL record incrementally (see the module doc).

    Args:
        path: the record (the ``jsonl`` sink's file); it may not exist yet.
        initial_bytes: how much of the end of an existing file the first poll reads.
        max_bytes: the most one later poll reads (a burst beyond it is caught up next time).
    """

    def __init__(self, path: str | os.PathLike[str], initial_bytes: int = 1 << 20,
                 max_bytes: int = 8 << 20) -> None:
        self.path = Path(path)
        self.initial_bytes = initial_bytes
        self.max_bytes = max_bytes
        self._offset: int | None = None
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        self.status = TrainingStatus(path=self.path)

    def poll(self) -> TrainingStatus:
        """Read what was appended since the last call; returns :attr:`status`."""
        st = self.status
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            if st.exists:  # removed: the next file starts afresh
                self._reset()
            return self.status
        except OSError as e:
            st.error = e.strerror or str(e)
            return st
        if not self.path.is_file():
            st.error = "not a regular file"
            return st
        inode = (stat.st_dev, stat.st_ino)
        if self._inode is not None and (inode != self._inode or stat.st_size < (self._offset
                                                                                 or 0)):
            self._reset()  # replaced or truncated: read the new file from its start
        st = self.status
        st.exists = True
        self._inode = inode
        try:
            with self.path.open("rb") as f:
                if self._offset is None:  # first read: the end of the file only
                    start = max(0, stat.st_size - self.initial_bytes)
                    f.seek(start)
                    chunk = f.read(stat.st_size - start)
                    if start > 0:  # the first line is cut: skip to the next one
                        cut = chunk.find(b"\n")
                        chunk = chunk[cut + 1:] if cut >= 0 else b""
                        self._offset = stat.st_size - len(chunk)
                    else:
                        self._offset = 0
                else:
                    f.seek(self._offset)
                    chunk = f.read(self.max_bytes)
        except OSError as e:
            st.error = e.strerror or str(e)
            return st
        st.error = None
        data = self._partial + chunk
        self._offset += len(chunk)
        end = data.rfind(b"\n")
        self._partial = data[end + 1:] if end >= 0 else data
        if end >= 0:
            self._read(data[:end].split(b"\n"))
        return self.status  # a run_start line makes a new one

    def _reset(self) -> None:
        self._offset = None
        self._inode = None
        self._partial = b""
        self.status = TrainingStatus(path=self.path)

    def _read(self, lines: list[bytes]) -> None:
        last_row: bytes | None = None
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"{"):
                continue
            if b'"event"' not in line:
                last_row = line  # only the newest row is parsed
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict) or "event" not in obj:
                last_row = line
                continue
            if obj["event"] in ("run_start", "run_end") and last_row is not None:
                self._row(last_row)  # the run's last row, before its end or the next header
                last_row = None
            self._event(obj)
        if last_row is not None:
            self._row(last_row)

    def _event(self, obj: dict[str, object]) -> None:
        st = self.status
        kind = obj.get("event")
        given = obj.get("run_id")
        run_id = given if isinstance(given, str) else None
        if kind == "run_start":
            meta = obj.get("meta")
            self.status = TrainingStatus(
                path=self.path, exists=True, run_id=run_id,
                meta={str(k): v for k, v in meta.items() if isinstance(v, str)
                      or (isinstance(v, int | float) and not isinstance(v, bool)
                          and math.isfinite(v))} if isinstance(meta, dict) else {})
            return
        if run_id is not None and st.run_id is not None and run_id != st.run_id:
            return  # a line of another run
        if kind == "run_end":
            st.ended = True
        elif kind == "alert":
            step = obj.get("step")
            st.events.append(AlertEvent(
                name=str(obj.get("name") or ""), state=str(obj.get("state") or ""),
                step=step if isinstance(step, int) and not isinstance(step, bool) else -1,
                message=str(obj.get("message") or ""), advice=str(obj.get("advice") or "")))

    def _row(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
        except ValueError:
            return
        step, time = obj.get("step") if isinstance(obj, dict) else None, None
        if not isinstance(step, int) or isinstance(step, bool):
            return
        t = obj.get("time")
        if isinstance(t, int | float) and not isinstance(t, bool):
            time = float(t)
        st = self.status
        given = obj.get("run_id")
        run_id = given if isinstance(given, str) else None
        if run_id is not None and run_id != st.run_id:
            if st.run_id is not None:  # a run whose header we never saw: start it afresh
                self.status = st = TrainingStatus(path=self.path, exists=True)
            st.run_id = run_id
        st.step, st.time = step, time
        st.values = {k: float(v) for k, v in obj.items()
                     if k not in ("step", "time", "run_id") and isinstance(v, int | float)
                     and not isinstance(v, bool) and math.isfinite(v)}


__all__ = ["AlertEvent", "RecordTail", "TrainingStatus"]
