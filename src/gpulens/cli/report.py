"""``gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]] [--run last|N|ID|all]``.

A JSONL record may hold several runs (the sink appends); the report shows the last one unless
``--run`` chooses, and says on stderr which run it shows when the file holds more than one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpulens.cli._common import CliError


def _write(path: str, text: str, what: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot write {what} to {path}: {e.strerror or e}") from None
    print(f"wrote {what}: {path}", file=sys.stderr)


def run_report(args: argparse.Namespace) -> int:
    """Read the JSONL record, write the HTML page (and Markdown when asked)."""
    from gpulens.report import ReportError, load_jsonl, render_html, render_markdown, summarize

    try:
        record = load_jsonl(args.input, run=getattr(args, "run", None))
    except ReportError as e:
        raise CliError(str(e)) from None
    if record.skipped:
        print(f"gpulens report: skipped {record.skipped} malformed line(s) in {args.input}",
              file=sys.stderr)
    if not record.rows:
        which = (f" for {', '.join(r.label for r in record.selected)}"
                 if len(record.runs) > 1 else "")
        raise CliError(f"no rows in {args.input}{which} (expected JSON objects with 'step' and "
                       "'time')")
    if len(record.runs) > 1:
        shown = ("all " + str(len(record.runs)) + " runs" if len(record.selected) == len(
            record.runs) else ", ".join(r.label for r in record.selected))
        print(f"gpulens report: {args.input} holds {len(record.runs)} runs; showing {shown} "
              "(--run N|ID|all for others)", file=sys.stderr)
    summary = summarize(record, work=args.work, unit=args.unit)
    output = args.output
    if output is None:
        output = str(Path(args.input).with_suffix(".html"))
    if args.markdown == "-" and output == "-":
        raise CliError("HTML and Markdown cannot both go to stdout; give -o FILE")
    _write(output, render_html(record, summary, args.title), "HTML report")
    if args.markdown is not None:
        _write(args.markdown, render_markdown(record, summary, args.title), "Markdown report")
    return 0
