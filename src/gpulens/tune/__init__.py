"""``gpulens tune``: batch size and data-loader workers chosen by measured throughput.

A sweep runs real steps of your own training for each configuration it tries (warm-up steps,
then a timed window), records the phases (data wait, forward+backward, optimizer), samples and
tokens per second, MFU, peak memory and headroom, and allocator retries, treats running out of
memory as a result, and recommends the fastest configuration, stating how much faster it is
than your current one.

Entry points, one call each:

* plain PyTorch: :func:`tune` ``(loader, step)`` (:mod:`gpulens.tune.plain`);
* Hugging Face: :func:`gpulens.tune.hf.tune_trainer` ``(trainer)``;
* Lightning: :func:`gpulens.tune.lightning.tune_lightning` ``(trainer, model, datamodule=...)``;
* the command line: ``gpulens tune my_module:make_job``.

Reports: :func:`print_report`, :func:`render_markdown`, :func:`render_html`,
:func:`log_to_tracker`. How the search goes: :mod:`gpulens.tune.sweep`. How a trial is timed:
:mod:`gpulens.tune.trial`. DDP: :mod:`gpulens.tune.dist`.

torch is imported when a sweep runs, not with this package.
"""

from __future__ import annotations

from gpulens.tune.model import Config, Trial, TuneInterrupted, TuneResult, TuneSettings
from gpulens.tune.plain import TuneJob, tune, tune_job
from gpulens.tune.report import print_report, render_html, render_markdown, render_text
from gpulens.tune.track import log_to_tracker

__all__ = [
    "Config",
    "Trial",
    "TuneInterrupted",
    "TuneJob",
    "TuneResult",
    "TuneSettings",
    "log_to_tracker",
    "print_report",
    "render_html",
    "render_markdown",
    "render_text",
    "tune",
    "tune_job",
]
