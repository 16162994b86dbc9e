"""The progress display of a sweep, on stderr: trials done out of about how many, the time
left by the estimate, one line per finished trial.

In a terminal (and with rich installed) a live bar stays at the bottom with the trial lines
printed above it; otherwise (a log file, a notebook cell's captured stderr, no rich) one plain
line per trial::

    gpulens tune: trial 3/~11  batch 16, 2 workers: 1.84k samples/s, data wait 2.1 %,
    peak 9.3 GB; about 52 s left      (one line)
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from gpulens.report.svg import fmt
from gpulens.tune.model import Trial


def trial_line(trial: Trial) -> str:
    """``batch 16, 2 workers: 1.84k samples/s, data wait 2.1 %, peak 9.3 GB`` (or the status
    of a trial that did not run); ``(loader pace)`` after a data wait taken from the loader
    workers' own pace (:mod:`gpulens.tune.pace`)."""
    head = trial.config.label()
    if trial.status == "oom":
        return f"{head}: out of memory"
    if not trial.ok:
        return f"{head}: could not be timed ({trial.error})"
    parts = [f"{fmt(trial.throughput)} samples/s"]
    if trial.tokens_per_s is not None:
        parts.append(f"{fmt(trial.tokens_per_s)} tokens/s")
    if trial.data_wait_pct is not None:
        paced = " (loader pace)" if trial.data_wait_by == "loader pace" else ""
        parts.append(f"data wait {trial.data_wait_pct:.1f} %{paced}")
    if trial.mfu_pct is not None:
        parts.append(f"MFU {trial.mfu_pct:.1f} %")
    if trial.peak_reserved_gb is not None:
        parts.append(f"peak {trial.peak_reserved_gb:.1f} GB")
    return f"{head}: " + ", ".join(parts)


def seconds_text(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 90:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min"


class LineProgress:
    """One plain line per trial."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def update(self, trial: Trial, done: int, expected: int, spent_s: float,
               left_s: float | None) -> None:
        out = self.stream or sys.stderr
        print(f"gpulens tune: trial {done}/~{expected}  {trial_line(trial)}; about "
              f"{seconds_text(left_s)} left", file=out, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live bar (rich) with the trial lines above it."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]gpulens tune[/bold]"), BarColumn(),
            TextColumn("{task.completed}/~{task.total} trials"),
            TextColumn("about {task.fields[left]} left"),
            console=Console(stderr=True), transient=True)
        self._progress.start()
        self._task = self._progress.add_task("tune", total=None, left="?")

    def update(self, trial: Trial, done: int, expected: int, spent_s: float,
               left_s: float | None) -> None:
        self._progress.console.print(f"  {trial_line(trial)}", highlight=False)
        self._progress.update(self._task, completed=done, total=expected,
                              left=seconds_text(left_s))

    def close(self) -> None:
        self._progress.stop()


def make_progress(enabled: bool, stream: TextIO | None = None) -> Any:
    """The display for this process: ``None`` when disabled, a live bar in a terminal when
    rich is installed, plain lines otherwise."""
    if not enabled:
        return None
    out = stream or sys.stderr
    if stream is None and getattr(out, "isatty", lambda: False)():
        try:
            return RichProgress()
        except ImportError:
            pass
    return LineProgress(stream)
