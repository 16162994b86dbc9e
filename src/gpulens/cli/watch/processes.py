"""The process table of the live view: who runs on the GPUs (from :data:`PROCESS_MIN_WIDTH`
columns on)."""

from __future__ import annotations

import os
from typing import Any

from gpulens.cli.watch.view import num
from gpulens.sources.processes import GpuProcess

PROCESS_MIN_WIDTH = 100
"""From this many columns the view has a process table (and only then asks for processes)."""


def _command(p: GpuProcess) -> str:
    """The command line with its program's directory left out (``python train.py``)."""
    if p.command:
        head, _, rest = p.command.partition(" ")
        return f"{os.path.basename(head)} {rest}".rstrip()
    if p.name:
        return p.name
    return "(not visible from here: another PID namespace)"


def process_lines(processes: list[GpuProcess], width: int, rows: int,
                  rule_width: int | None = None) -> list[Any]:
    """The process table in at most ``rows`` lines of ``width`` cells (``[]`` if fewer than
    three fit): a rule, a header, one line per process by GPU and then GPU memory (largest
    first), and ``+N more`` when they do not all fit.  Only the command line is ever cut."""
    from rich.text import Text

    if rows < 3:
        return []
    rule = Text(no_wrap=True, overflow="crop")
    rule.append("Processes ", style="bold")
    rule.append("─" * max(0, min(width, rule_width or width) - len("Processes ")), style="dim")
    if not processes:
        return [rule, Text("none on these GPUs", style="dim", no_wrap=True, overflow="crop")]
    ordered = sorted(processes, key=lambda p: (p.gpu, -(p.gpu_mem_gb or 0.0), p.pid))
    user_w = max(4, min(10, max(len(p.user or "?") for p in ordered)))
    pid_w = max(3, max(len(str(p.pid)) for p in ordered))
    head = f"{'GPU':>3}  {'PID':>{pid_w}}  {'User':<{user_w}}  {'GPU mem':>9}  Command"
    out = [rule, Text(head[:width], style="bold", no_wrap=True, overflow="crop")]
    room = rows - 2
    shown = ordered if len(ordered) <= room else ordered[:room - 1]
    for p in shown:
        user = (p.user or "?")[:user_w]
        mem = num(p.gpu_mem_gb, ".1f", " GB")
        left = f"{p.gpu:>3}  {p.pid:>{pid_w}}  {user:<{user_w}}  {mem:>9}  "
        command = _command(p)
        if len(left) + len(command) > width:
            command = command[:max(0, width - len(left) - 1)] + "…"
        line = Text(no_wrap=True, overflow="crop")
        line.append(left)
        line.append(command, style="cyan" if p.command else "dim")
        out.append(line)
    if len(shown) < len(ordered):
        out.append(Text(f"+{len(ordered) - len(shown)} more processes (a taller terminal shows "
                        "them)", style="dim", no_wrap=True, overflow="crop"))
    return out
