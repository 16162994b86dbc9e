"""``gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]]``."""

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
        record = load_jsonl(args.input)
    except ReportError as e:
        raise CliError(str(e)) from None
    if record.skipped:
        print(f"gpulens report: skipped {record.skipped} malformed line(s) in {args.input}",
              file=sys.stderr)
    if not record.rows:
        raise CliError(f"no rows in {args.input} (expected JSON objects with 'step' and 'time')")
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
