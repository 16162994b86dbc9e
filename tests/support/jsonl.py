"""Reading a gpulens JSONL record in tests, without gpulens's own loader.

A record holds ``run_start`` / ``run_end`` lines and event lines (each with an ``event`` key)
beside the row lines; :func:`read_rows` keeps the rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the file, parsed."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The row lines of the file (all runs), in file order."""
    return [obj for obj in read_lines(path) if "event" not in obj]
