"""Helpers shared by the subcommands: the user-error exception and argument types."""

from __future__ import annotations

import argparse


class CliError(Exception):
    """A user error: printed as one line, exit code ``code`` (2 unless said otherwise)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def gpu_list(text: str) -> list[int]:
    """argparse type: ``"0,1,3"`` -> ``[0, 1, 3]``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(
                f"GPU indices are comma-separated numbers like 0,1; got {text!r}"
            )
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError("no GPU index given")
    return out


def monitor_interval(row_interval: float) -> float:
    """Seconds between cheap samples for rows every ``row_interval`` s: several per row,
    at most 0.5 s apart, at least 0.05 s."""
    return max(0.05, min(0.5, row_interval / 4))
