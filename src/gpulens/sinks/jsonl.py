"""JSONL: one JSON object a line, written and flushed line by line.

Each line holds ``step``, ``time`` (unix seconds at the end of the window) and the row's keys.
A value that is not finite (a NaN loss) is written as ``null``.  A killed job leaves every line
written so far readable.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from gpulens.sinks.base import Row, RunContext


class JsonlSink:
    """Writes rows to ``path`` (parent folders are made; an existing file is replaced)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        _check_writable(self.path)

    @classmethod
    def from_spec(cls, arg: str | None) -> JsonlSink:
        if not arg:
            raise ValueError("the jsonl sink needs a path: 'jsonl:runs/gpu.jsonl'")
        return cls(arg)

    def remote_spec(self) -> tuple[str, dict[str, Any]]:
        """How the sampler process rebuilds this sink (it then writes the file)."""
        return "gpulens.sinks.jsonl:JsonlSink", {"path": str(self.path.absolute())}

    def open(self, context: RunContext) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot write the JSONL record {str(self.path)!r}: {exc}") from exc

    def write(self, row: Row) -> None:
        assert self._file is not None, "JsonlSink.write before open"
        record: dict[str, object] = {"step": row.step, "time": round(row.time, 6)}
        for key, value in row.values.items():
            record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
