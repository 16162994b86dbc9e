"""Set-up checks the integrations run before anything is created."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_sinks(sinks: Iterable[Any]) -> None:
    """Call each sink's optional ``check()``: a sink that cannot work (W&B without a login, an
    MLflow server that does not answer) raises a one-line ``ValueError`` before any sink opens
    or any run is made."""
    for sink in sinks:
        check = getattr(sink, "check", None)
        if check is not None:
            check()
