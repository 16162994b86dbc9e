"""``gpulens watch [--gpus 0,1] [--interval S]``: a live terminal view.

One line per GPU, readable in an 80x24 terminal: activity (GPM SM active where the GPU has
GPM, else NVML utilization), tensor-core activity, memory used/total, power against its limit,
temperature, SM clock, and what holds the clocks down (power cap, thermal).  As the terminal
widens, more columns join: the activity history (a sparkline of the last ``--history``
intervals), the GPU model, memory and power bars, DRAM bandwidth; from 100 columns on, a table
of the processes on the GPUs (GPU, process id, user, GPU memory held, command line), as many
rows as the terminal's height leaves.  The view follows the terminal's size while it runs.
``q`` quits.  Without a terminal (or with ``--plain``) it prints one plain line per interval
(and, once, on stderr, what the GPUs are).

Memory is in GB of 1e9 bytes, as NVML counts it: an "80GB" card shows 85.9 GB (80.0 GiB);
the view says so.  The figures are the newest samples (``Monitor.latest()``), read every
``--interval`` seconds.

``--record PATH`` also follows a training's JSONL record (the ``jsonl`` sink's file, which
the training's own gpulens writes; the file may not exist yet) and shows, under the GPU
lines, its latest step: loss, throughput (tokens/s, else samples/s), MFU (else achieved
TFLOP/s per GPU) and how long ago the row was written, then the advice rules firing in that
row (``alerts/<rule>``) with the step each started, and what to try for the newest one.  At 80
columns the lower-priority figures (clock-adjusted MFU, TFLOP/s, tokens per joule) are left
out before anything is cut.  The watch itself has no training loop: its own rows would have no
work, so throughput and MFU come only from the record.
"""

from gpulens.cli.watch.command import run_watch

__all__ = ["run_watch"]
