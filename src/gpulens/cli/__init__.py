"""The ``gpulens`` command line.

Subcommands::

    gpulens watch  [--gpus 0,1] [--interval S] [--record RUN.jsonl]   live terminal view
    gpulens record [--sink SPEC]... [-- COMMAND [ARGS]] record GPU rows around a command, or
                                                    beside a training until Ctrl-C
    gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]] [--run last|N|ID|all]
    gpulens serve  [--port 9400] [--host 127.0.0.1]     live dashboard (/), Prometheus /metrics,
                                                    one port
    gpulens tune   MODULE:FUNCTION [--budget S] [-o tune.html]   batch size and loader workers
                                                    by measured throughput

Importing this module is light: each subcommand imports what it needs (rich, prometheus_client,
the monitor) when it runs.  Bad input prints one line ``gpulens: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpulens.cli._common import CliError, gpu_list, positive_float
from gpulens.log import fit_terminal

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


WATCH = """\
A live view of the GPUs of this machine, one line per GPU: activity (GPM SM active where the
GPU has GPM, else NVML utilization), tensor-core activity, memory used/total, power against
its limit, temperature, SM clock, and what holds the clocks down.  It fits 80 columns; a wider
terminal adds the activity history, memory and power bars, DRAM bandwidth and the GPU model,
and from 100 columns the processes on the GPUs (process id, user, GPU memory, command).
Memory is in GB of 10^9 bytes (an "80GB" card shows 85.9 GB = 80.0 GiB).  q quits.  Without a
terminal (or with --plain) it prints one line per interval.

With --record, it also follows a training's JSONL record (the jsonl sink's file) and shows its
latest step under the GPUs: loss, tokens/s, MFU, and the advice rules firing, with what to try.

  gpulens watch
  gpulens watch --gpus 0,1 --interval 0.5
  gpulens watch --record runs/gpu.jsonl
  gpulens watch --plain --count 10 > gpus.log
"""

RECORD = """\
Write one row of GPU telemetry every --interval seconds to each --sink: for the whole life of
COMMAND (then exit with COMMAND's exit code), or, without a command, beside a training that
runs elsewhere until Ctrl-C or SIGTERM (exit code 0).  Then print a per-GPU summary (activity,
peak memory, power, temperature, energy, throttling) on stderr, and write it as JSON and
Markdown when asked.  Rows are wall-clock intervals on record/elapsed_s, not training steps.

  gpulens record --sink jsonl:run.jsonl -- python bench.py
  gpulens record --gpus 0,1 --interval 1 --no-console --summary-interval 10 --sink wandb
  gpulens record --work 1e6 --unit tokens --summary-md summary.md -- python serve_bench.py
"""

REPORT = """\
Write one self-contained HTML page (no network needed to view it) from a JSONL record: loss,
learning rate and step time beside GPU activity, memory, power, temperature and throttling on
the same step axis (elapsed seconds for a `gpulens record` file), a per-GPU table, energy and
efficiency.  --markdown also writes a summary for a pull-request comment.

A JSONL file may hold several runs (the jsonl sink appends; each run starts with a header
line): the report shows the last run unless --run chooses.

  gpulens report runs/gpu.jsonl                  # writes runs/gpu.html
  gpulens report runs/gpu.jsonl --run all -o all.html
  gpulens report runs/gpu.jsonl --markdown       # Markdown to stdout too
"""

SERVE = """\
Serve this machine's GPUs on one port: a live dashboard to open in a browser (/: activity,
memory, power, temperature, clocks, every GPU on one chart per metric) and an endpoint for
Prometheus to scrape (/metrics: utilization, SM and tensor activity, memory in bytes, power,
energy as a counter, temperature, clocks and throttling, labelled by GPU, uuid, model and
host).  Both addresses are printed once the first sample is in.
Binds 127.0.0.1 unless --host says otherwise.

  gpulens serve --port 9400
  gpulens serve --host 0.0.0.0 --port 9400 --gpus 0,1
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gpulens`` and its subcommands."""
    parser = _Parser(
        prog="gpulens",
        description="GPU telemetry per training step, beside the loss curve. These commands "
                    "watch, record, report and serve it without changing a training script.",
        epilog="Each command has its own help: gpulens COMMAND --help",
    )
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the gpulens version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser,
                                title="commands")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("watch", help="live terminal view of GPU activity, memory, power, "
                       "temperature", description=WATCH, formatter_class=raw)
    p.add_argument("--gpus", type=gpu_list, default=None, metavar="0,1",
                   help="GPU indices to show, comma-separated (default: all)")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1.0)")
    p.add_argument("--history", type=int, default=30, metavar="N",
                   help="length of the activity history, in intervals (default 30; shown "
                        "when the terminal is wide enough)")
    p.add_argument("--plain", action="store_true",
                   help="one plain text line per interval, also in a terminal (for logs)")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="stop after N intervals (default: run until q, Ctrl-C or SIGTERM)")
    p.add_argument("--record", default=None, metavar="RUN.jsonl",
                   help="also follow a training's JSONL record (the jsonl sink's file; it may "
                        "not exist yet): its latest step, loss, tokens/s, MFU and the alerts "
                        "firing")

    p = sub.add_parser(
        "record",
        help="record GPU telemetry around a command, or beside a training until Ctrl-C",
        usage="gpulens record [options] [-- COMMAND [ARGS...]]",
        description=RECORD, formatter_class=raw,
    )
    p.add_argument("--sink", action="append", default=[], metavar="SPEC",
                   help="where rows go, repeatable: jsonl:PATH, prometheus:PORT, dashboard:PORT, "
                        "mlflow, wandb")
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
    p.add_argument("--summary-json", metavar="FILE", default=None,
                   help="also write the summary as JSON to FILE (per GPU: activity, peak "
                        "memory, power, temperature, energy, throttling; the command and its "
                        "exit code)")
    p.add_argument("--summary-md", metavar="FILE", default=None,
                   help="also write the summary as Markdown to FILE (a table per GPU, for a "
                        "pull-request comment)")
    p.add_argument("--quiet", action="store_true", help="do not print the summary")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command to run, after --")

    p = sub.add_parser("report", help="HTML/Markdown report of a JSONL record",
                       description=REPORT, formatter_class=raw)
    p.add_argument("input", metavar="RUN.jsonl",
                   help="a JSONL record (the jsonl sink's file, or `gpulens record --sink "
                        "jsonl:PATH`)")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="HTML file (default: RUN.html beside the input; '-' for stdout)")
    p.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                   help="also write Markdown (to stdout without FILE)")
    p.add_argument("--title", default=None, help="page title (default: 'gpulens report: "
                                                 "RUN.jsonl')")
    p.add_argument("--work", type=positive_float, default=None,
                   help="work the run did in total (tokens, samples, ...), for the efficiency "
                        "figure (work per joule of GPU energy) and the throughput")
    p.add_argument("--unit", default="tokens", choices=("tokens", "samples", "requests"),
                   help="unit of --work (tokens)")
    p.add_argument("--run", default=None, metavar="last|N|ID|all",
                   help="which run of the file: the last (default), the N-th (1-based; -1 is "
                        "the last), the run with id ID (or a unique prefix), or all")

    p = sub.add_parser("serve", help="live dashboard and Prometheus metrics of this "
                       "machine's GPUs", description=SERVE, formatter_class=raw)
    p.add_argument("--port", type=_port, default=9400, help="TCP port (9400; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: this machine only; 0.0.0.0 for all)")
    p.add_argument("--interval", type=positive_float, default=1.0, metavar="S",
                   help="seconds between samples (default 1.0)")
    p.add_argument("--gpus", type=gpu_list, default=None, metavar="0,1",
                   help="GPU indices to serve, comma-separated (default: all)")

    from gpulens.cli.tune import HELP as TUNE
    from gpulens.cli.tune import add_arguments as tune_arguments

    tune_arguments(sub.add_parser("tune", help="batch size and loader workers by measured "
                                  "throughput", description=TUNE, formatter_class=raw))
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
        if args.command == "tune":
            from gpulens.cli.tune import run_tune

            return run_tune(args)
        from gpulens.cli.watch import run_watch

        return run_watch(args)
    except CliError as e:
        print(fit_terminal(f"gpulens {args.command}: error: {e}", sys.stderr), file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
