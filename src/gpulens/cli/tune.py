"""``gpulens tune MODULE:FUNCTION [options]``: the sweep of :mod:`gpulens.tune` from the
command line. ``FUNCTION()`` returns a :class:`gpulens.tune.TuneJob` (the loader or a
``make_loader(batch_size, num_workers)``, the step, optionally the model, optimizer, dtype);
the directory the command runs in is importable, as with ``python -m``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gpulens.cli._common import CliError, positive_float

HELP = """\
Choose the batch size and data-loader workers of a training by measured throughput: a
coarse pass over batch sizes (powers of two), then a search around the fastest one, loader
workers raised until the data wait is under the target, out-of-memory trials recorded and
survived.  FUNCTION() returns a gpulens.tune.TuneJob: the DataLoader (or make_loader(batch_size,
num_workers)), step(batch), and optionally the model, optimizer and dtype (for MFU).  Prints
the choice, how much faster it is than the loader's own setting, and a table of every trial;
-o/--markdown/--json write the report.  Under torchrun every rank runs the same command.

  gpulens tune train:make_job
  gpulens tune train:make_job --budget 600 --workers 0,2,4,8 -o tune.html
  gpulens tune train:make_job --global-batch 256 --markdown tune.md
  gpulens tune train:make_job --isolate            # each trial in a fresh process
"""


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: ``"8,16,32"`` -> ``(8, 16, 32)``."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tune`` subcommand's arguments."""
    p.add_argument("job", metavar="MODULE:FUNCTION",
                   help="a function returning a gpulens.tune.TuneJob")
    p.add_argument("--batch-sizes", type=int_list, default=None, metavar="8,16,32",
                   help="only these batch sizes (default: powers of two, and multiples of "
                        "--multiple between them)")
    p.add_argument("--min-batch", type=int, default=1, metavar="N",
                   help="no batch size below N (1)")
    p.add_argument("--max-batch", type=int, default=65536, metavar="N",
                   help="no batch size above N (the out-of-memory edge ends the pass first)")
    p.add_argument("--multiple", type=int, default=8, metavar="N",
                   help="batch sizes between powers of two are multiples of N (8)")
    p.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="keep batch x accumulation x ranks = N (needs the job's "
                        "optimizer_step)")
    p.add_argument("--workers", type=int_list, default=(0, 1, 2, 4, 8), metavar="0,1,2,4,8",
                   help="loader worker counts to try (0,1,2,4,8; none above the CPUs)")
    p.add_argument("--data-wait-pct", type=float, default=5.0, metavar="PCT",
                   help="raise workers until the data wait is below PCT %% of the step (5)")
    p.add_argument("--warmup", type=int, default=3, metavar="STEPS",
                   help="untimed steps per trial (3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial (10)")
    p.add_argument("--max-trial-s", type=positive_float, default=30.0, metavar="S",
                   help="end a trial's timed window after S seconds (30)")
    p.add_argument("--budget", type=positive_float, default=None, metavar="S",
                   help="start no trial that would end after S seconds in all")
    p.add_argument("--no-loader-options", action="store_true",
                   help="do not try pin_memory / prefetch_factor")
    p.add_argument("--no-confirm", action="store_true",
                   help="do not measure the choice again at the end")
    p.add_argument("--isolate", action="store_true",
                   help="run each trial in a fresh process (not under torchrun)")
    p.add_argument("-o", "--output", default=None, metavar="FILE.html",
                   help="write the HTML report")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write Markdown ('-': "
                                                                    "stdout)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every trial as JSON")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines, no report on stdout")


def run_tune(args: argparse.Namespace) -> int:
    """Run the sweep; print and write the report (rank 0). On Ctrl-C: one line, the report of
    the trials that finished (marked partial) and exit code 130; a second Ctrl-C ends at once."""
    from gpulens.tune import (
        TuneInterrupted,
        TuneSettings,
        print_report,
        render_html,
        render_markdown,
    )
    from gpulens.tune.dist import world
    from gpulens.tune.isolate import JobError, load_job, tune_isolated
    from gpulens.tune.plain import tune_job

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    interrupted = False
    try:
        settings = TuneSettings(
            warmup_steps=args.warmup, steps=args.steps, max_trial_s=args.max_trial_s,
            budget_s=args.budget, batch_sizes=args.batch_sizes, min_batch=args.min_batch,
            max_batch=args.max_batch, batch_multiple=args.multiple,
            global_batch=args.global_batch, workers=args.workers,
            data_wait_pct=args.data_wait_pct, loader_options=not args.no_loader_options,
            confirm=not args.no_confirm).check()
        if args.isolate:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise JobError("--isolate runs trials in processes of its own: not under "
                               "torchrun")
            result = tune_isolated(args.job, settings, progress=not args.quiet)
        else:
            result = tune_job(load_job(args.job), settings, progress=not args.quiet)
    except ValueError as e:
        # gpulens's own one-line errors (the spec, the settings, the loader); a ValueError of
        # the user's setup or step (a shape mismatch...) keeps its traceback
        if not isinstance(e, JobError) and not str(e).startswith("gpulens tune: "):
            raise
        raise CliError(str(e).removeprefix("gpulens tune: ")) from None
    except TuneInterrupted as e:
        result, interrupted = e.result, True
    code = 130 if interrupted else 0 if result.chosen is not None else 1
    if world()[0] != 0:
        return code
    title = f"gpulens tune: {args.job}"
    if interrupted:
        print(f"gpulens tune: interrupted (Ctrl-C) after {len(result.trials)} finished "
              "trial(s); their results follow, marked partial", file=sys.stderr, flush=True)
        title += " (partial: interrupted)"
    if not args.quiet:
        print_report(result, title=title)
    renders: list[tuple[str | None, Callable[[], str], str]] = [
        (args.output, lambda: render_html(result, title), "HTML report"),
        (args.markdown, lambda: render_markdown(result, title), "Markdown report"),
        (args.json, lambda: json.dumps(result.to_dict(), indent=1), "trials (JSON)"),
    ]
    for path, render, what in renders:
        if path is None:
            continue
        if path == "-":
            sys.stdout.write(render())
            continue
        try:
            Path(path).write_text(render(), encoding="utf-8")
        except OSError as e:
            raise CliError(f"cannot write {what} to {path}: {e.strerror or e}") from None
        print(f"wrote {what}: {path}", file=sys.stderr)
    return code
