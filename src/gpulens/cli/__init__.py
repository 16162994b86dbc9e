"""The ``gpulens`` command line.

Subcommands::

    gpulens watch  [--gpus 0,1] [--interval S]          live terminal view
    gpulens record [--sink SPEC]... [-- COMMAND [ARGS]] record GPU rows around a command, or
                                                    beside a training until Ctrl-C
    gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]]
    gpulens serve  [--port 9400] [--host 127.0.0.1]     Prometheus exporter of live GPU metrics

Importing this module is light: each subcommand imports what it needs (rich, prometheus_client,
the monitor) when it runs.  Bad input prints one line ``gpulens: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpulens.cli._common import CliError, gpu_list, positive_float

__all__ = ["CliError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line on stderr, exit code 2 (argparse prints the whole usage otherwise)."""
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but an unknown argument after a subcommand is that subcommand's
        error (pointing to ``gpulens <subcommand> --help``)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            owner: argparse.ArgumentParser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    owner = action.choices.get(getattr(ns, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gpulens`` and its subcommands."""
    parser = _Parser(prog="gpulens", description="GPU telemetry per training step.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("watch", help="live view of GPU activity, memory, power, temperature")
    p.add_argument("--gpus", type=gpu_list, default=None, help="GPU indices, e.g. 0,1 (all)")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds (1.0)")
    p.add_argument("--history", type=int, default=30, help="sparkline length in intervals (30)")
    p.add_argument("--plain", action="store_true", help="one plain line per interval")
    p.add_argument("--count", type=int, default=None, help="stop after N intervals")

    p = sub.add_parser(
        "record",
        help="record GPU telemetry around a command, or beside a training until Ctrl-C",
        usage="gpulens record [options] [-- COMMAND [ARGS...]]",
        description="Write a row every --interval seconds to every --sink: for the whole life "
                    "of COMMAND, or, without a command, beside a training until Ctrl-C or "
                    "SIGTERM (exit code 0). Rows sit on a wall-clock axis (record/elapsed_s).",
    )
    p.add_argument("--sink", action="append", default=[], metavar="SPEC",
                   help="where rows go, repeatable: jsonl:PATH, prometheus:PORT, mlflow, wandb")
    p.add_argument("--interval", type=positive_float, default=1.0,
                   help="seconds per row (1.0); GPUs are sampled more often")
    p.add_argument("--gpus", type=gpu_list, default=None, help="GPU indices (all)")
    p.add_argument("--no-console", action="store_true",
                   help="no live line on stderr (without a command)")
    p.add_argument("--summary-interval", type=positive_float, default=None, metavar="S",
                   help="also print a summary of the last S seconds every S seconds")
    p.add_argument("--work", type=positive_float, default=None,
                   help="work the command does in total, for efficiency figures")
    p.add_argument("--unit", default="tokens", choices=("tokens", "samples", "requests"),
                   help="unit of --work (tokens)")
    p.add_argument("--summary-json", metavar="FILE", default=None)
    p.add_argument("--summary-md", metavar="FILE", default=None)
    p.add_argument("--quiet", action="store_true", help="do not print the summary")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND")

    p = sub.add_parser("report", help="HTML/Markdown report of a JSONL record")
    p.add_argument("input", metavar="RUN.jsonl")
    p.add_argument("-o", "--output", default=None,
                   help="HTML file (default: RUN.html beside the input; '-' for stdout)")
    p.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                   help="also write Markdown (to stdout without FILE)")
    p.add_argument("--title", default=None)
    p.add_argument("--work", type=positive_float, default=None,
                   help="work the run did in total (tokens, samples, ...), for efficiency")
    p.add_argument("--unit", default="tokens", choices=("tokens", "samples", "requests"),
                   help="unit of --work (tokens)")

    p = sub.add_parser("serve", help="Prometheus exporter of live GPU metrics")
    p.add_argument("--port", type=_port, default=9400, help="TCP port (9400; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds (1.0)")
    p.add_argument("--gpus", type=gpu_list, default=None, help="GPU indices (all)")
    return parser


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, not {port}")
    return port


def _version() -> str:
    from gpulens import __version__

    return f"gpulens {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``sys.exit(main())``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "report":
            from gpulens.cli.report import run_report

            return run_report(args)
        if args.command == "serve":
            from gpulens.cli.serve import run_serve

            return run_serve(args)
        if args.command == "record":
            from gpulens.cli.record import run_record

            return run_record(args)
        from gpulens.cli.watch import run_watch

        return run_watch(args)
    except CliError as e:
        print(f"gpulens {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
