"""CPU benchmark of gpulens's training-thread path, with simulated GPUs (issue 2's targets).

Three measurements, each printed as a row of one Markdown table:

(a) ``Monitor.log()`` latency on the training thread, 8 simulated GPUs sampled at 10 Hz, a JSONL
    sink: ``perf_counter_ns`` around each call, median / p99 / max in microseconds. Between calls
    the thread busy-waits ``--gap-us`` (a short step), so the sampler and writer threads run
    concurrently, as in training, and compete for the GIL. Target: median <= 50 us.
(b) A 5 ms training step logging every step, 8 simulated GPUs at 10 Hz: the loop's wall time
    with and without gpulens, in interleaved repetitions in one process. The step stands for a
    GPU training step as the host sees it: ~1 ms of Python holding the GIL (building the graph,
    launching kernels: a busy-wait here) then ~4 ms blocked in C with the GIL released (waiting
    for the GPU in ``loss.item()``: ``time.sleep`` here). Target: ratio within 1 %.
(c) Memory over 100k rows (8 simulated GPUs, a sink that keeps only a count: an object sink,
    so rows are finished in the engine process and come back over the pipe to this process,
    as they do for W&B): rows logged in bursts of ``--mem-burst``, each burst waited for until
    the monitor has finished it; the RSS of this (training) process and of the engine process
    (a child process whose command line names gpulens, read with ``psutil``), and the number of
    objects this process's garbage collector tracks, after 20 % of the rows and at the end, and
    the growth between the two (``--tracemalloc`` adds traced bytes; slow). Target: no growth.
(d) The engine process's own memory by sink (``--no-sinks-rss`` skips it): for each of no
    sink, a JSONL file, an object sink (rows back here), MLflow into a SQLite store and MLflow
    into a tracking server on 127.0.0.1 (``mlflow server``, skipped if it cannot start), a fresh
    Python process imports gpulens (and mlflow where its sink is used), starts a monitor with 8
    simulated GPUs at 10 Hz, logs a row every 20 ms for ``--rss-seconds`` (3 s), then reads the
    engine process's RSS and USS (unique set size: what ending it would free; RSS also counts
    shared library pages) and its own RSS before start and after those rows.

Prints figures, asserts nothing about timings (the test suite runs ``--quick`` as a smoke test).

    python benchmarks/bench_log.py            # full run, ~3 minutes on 2 shared cores
    python benchmarks/bench_log.py --quick    # a few seconds, tiny sizes
    python benchmarks/bench_log.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

N_GPUS = 8
INTERVAL_S = 0.1


def _use_simulated(n_gpus: int) -> None:
    os.environ["GPULENS_BACKEND"] = "simulated"
    os.environ["GPULENS_SIMULATED_GPUS"] = str(n_gpus)


@contextmanager
def monitor(path: Path, interval: float = INTERVAL_S) -> Iterator[Any]:
    """A started ``gpulens.Monitor`` over the simulated GPUs, writing JSONL to ``path``."""
    import gpulens

    mon = gpulens.Monitor(interval=interval, sinks=[f"jsonl:{path}"], backend="simulated")
    mon.start()
    try:
        yield mon
    finally:
        mon.stop()


def busy_wait(seconds: float) -> None:
    """Spin in Python (holding the GIL) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pct(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def bench_latency(tmp: Path, calls: int, gap_us: float) -> dict[str, float]:
    """(a) ``log()`` latency in microseconds, ``calls`` calls ``gap_us`` apart."""
    lat_ns: list[int] = []
    with monitor(tmp / "latency.jsonl") as mon:
        busy_wait(3 * INTERVAL_S)  # let the sampler fill its first window
        for step in range(1, calls + 1):
            busy_wait(gap_us * 1e-6)
            t0 = time.perf_counter_ns()
            mon.log(step, loss=1.0 / step, learning_rate=3e-4, grad_norm=0.5)
            lat_ns.append(time.perf_counter_ns() - t0)
    us = [x / 1e3 for x in lat_ns]
    return {
        "log_calls": calls,
        "log_median_us": statistics.median(us),
        "log_p99_us": pct(us, 0.99),
        "log_max_us": max(us),
        "log_mean_us": statistics.fmean(us),
    }


def training_step(busy_s: float, wait_s: float) -> None:
    """One simulated step: ``busy_s`` holding the GIL, then ``wait_s`` blocked without it."""
    busy_wait(busy_s)
    time.sleep(wait_s)


def bench_loop(tmp: Path, steps: int, reps: int, busy_s: float, wait_s: float) -> dict[str, Any]:
    """(b) Loop seconds per step with and without gpulens, interleaved repetitions."""
    times: dict[str, list[float]] = {"without": [], "with": []}
    for rep in range(reps):
        order = ("without", "with") if rep % 2 == 0 else ("with", "without")
        for variant in order:
            gc.collect()
            if variant == "without":
                t0 = time.perf_counter()
                for step in range(1, steps + 1):
                    training_step(busy_s, wait_s)
                    _ = 1.0 / step  # the loss the loop would hand to a logger
                times[variant].append((time.perf_counter() - t0) / steps)
            else:
                with monitor(tmp / f"loop-{rep}.jsonl") as mon:
                    t0 = time.perf_counter()
                    for step in range(1, steps + 1):
                        training_step(busy_s, wait_s)
                        mon.log(step, loss=1.0 / step, learning_rate=3e-4, grad_norm=0.5)
                    times[variant].append((time.perf_counter() - t0) / steps)
    paired = [w / wo for w, wo in zip(times["with"], times["without"], strict=True)]
    without = statistics.median(times["without"])
    with_ = statistics.median(times["with"])
    return {
        "loop_steps": steps,
        "loop_reps": reps,
        "loop_step_without_ms": without * 1e3,
        "loop_step_with_ms": with_ * 1e3,
        "loop_ratio": with_ / without,
        "loop_ratio_paired_median": statistics.median(paired),
        "loop_ratio_paired_min": min(paired),
        "loop_ratio_paired_max": max(paired),
    }


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def engine_processes() -> list[Any]:
    """This process's Python children whose command line names gpulens (the engine process),
    as ``psutil`` objects."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("python") and "gpulens" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.Error:
            pass
    return out


def sampler_memory() -> tuple[int, int] | None:
    """(RSS, USS) in bytes of the engine process(es); None when there is none (thread)."""
    import psutil

    rss = uss = 0
    procs = engine_processes()
    for proc in procs:
        try:
            full = proc.memory_full_info()
            rss += int(full.rss)
            uss += int(full.uss)
        except psutil.Error:
            pass
    return (rss, uss) if procs else None


class CountingSink:
    """A sink that keeps only a count and the newest row (the memory figure is gpulens's own)."""

    def __init__(self) -> None:
        self.written = 0
        self.last: Any = None

    def open(self, context: Any) -> None:
        pass

    def write(self, row: Any) -> None:
        self.written += 1
        self.last = row

    def close(self) -> None:
        pass


def _drained(sink: CountingSink, rows: int, timeout: float = 60.0) -> bool:
    """Wait until every logged row reached the sink (rows are finished in the background)."""
    end = time.monotonic() + timeout
    while sink.written < rows and time.monotonic() < end:
        time.sleep(0.02)
    return sink.written >= rows


def bench_memory(rows: int, burst: int, trace: bool) -> dict[str, Any]:
    """(c) Memory growth between 20 % of ``rows`` and the end.

    Rows are logged in bursts of ``burst`` back to back; after each burst the loop waits until
    the monitor has finished them all. The backlog of unfinished rows is thus bounded by the
    burst, and both readings (taken after a burst) see the same state: what grows between them
    grows with the number of rows. Readings: process RSS, the number of objects the garbage
    collector tracks, and with ``trace`` the bytes ``tracemalloc`` traces (it slows the
    sampler several times over, so it is off for 100k rows).
    """
    import gpulens

    burst = max(1, min(burst, rows // 3))
    mark = max(burst, (rows // 5) // burst * burst)
    sink = CountingSink()
    drained = True
    traced0 = rss0 = objs0 = 0
    child0: tuple[int, int] | None = None
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        mon = gpulens.Monitor(interval=INTERVAL_S, sinks=[sink], backend="simulated")
        mon.start()
        try:
            for step in range(1, rows + 1):
                mon.log(step, loss=1.0 / step, learning_rate=3e-4, grad_norm=0.5)
                if step % burst == 0 or step == rows:
                    drained = _drained(sink, step) and drained
                if step == mark:
                    gc.collect()
                    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
                    rss0, objs0 = _rss_bytes(), len(gc.get_objects())
                    child0 = sampler_memory()
            gc.collect()
            traced1 = tracemalloc.get_traced_memory()[0] if trace else 0
            rss1, objs1 = _rss_bytes(), len(gc.get_objects())
            child1 = sampler_memory()
            isolation = mon.isolation
        finally:
            mon.stop()
    finally:
        if trace:
            tracemalloc.stop()
    out: dict[str, Any] = {
        "mem_rows": rows,
        "mem_burst": burst,
        "mem_mark_row": mark,
        "mem_drained": drained,
        "mem_s": time.perf_counter() - t0,
        "mem_isolation": isolation,
        "mem_rss_at_mark_mib": rss0 / 2**20,
        "mem_rss_end_mib": rss1 / 2**20,
        "mem_rss_growth_mib": (rss1 - rss0) / 2**20,
        "mem_gc_objects_at_mark": objs0,
        "mem_gc_objects_growth": objs1 - objs0,
        "mem_rows_written": sink.written,
    }
    if child0 is not None and child1 is not None:
        out["mem_sampler_rss_at_mark_mib"] = child0[0] / 2**20
        out["mem_sampler_rss_end_mib"] = child1[0] / 2**20
        out["mem_sampler_rss_growth_mib"] = (child1[0] - child0[0]) / 2**20
        out["mem_sampler_uss_end_mib"] = child1[1] / 2**20
    if trace:
        out["mem_traced_at_mark_kib"] = traced0 / 1024
        out["mem_traced_growth_kib"] = (traced1 - traced0) / 1024
    return out


def table(fig: dict[str, Any]) -> str:
    """The figures as a Markdown table (figure, value, target)."""
    rows = [
        (f"log() median, {N_GPUS} simulated GPUs, 10 Hz", f"{fig['log_median_us']:.1f} us",
         "<= 50 us"),
        ("log() p99 / max", f"{fig['log_p99_us']:.1f} / {fig['log_max_us']:.1f} us", ""),
        ("5 ms step loop, without gpulens", f"{fig['loop_step_without_ms']:.3f} ms/step", ""),
        ("5 ms step loop, with gpulens (log every step)", f"{fig['loop_step_with_ms']:.3f} ms/step",
         ""),
        ("loop time ratio with / without (medians)", f"{fig['loop_ratio']:.4f}", "<= 1.01"),
        ("paired ratio per repetition: median [min, max]",
         f"{fig['loop_ratio_paired_median']:.4f} [{fig['loop_ratio_paired_min']:.4f}, "
         f"{fig['loop_ratio_paired_max']:.4f}]", ""),
        (f"training process RSS at row {fig['mem_mark_row']} / at row {fig['mem_rows']}",
         f"{fig['mem_rss_at_mark_mib']:.1f} / {fig['mem_rss_end_mib']:.1f} MiB", ""),
        (f"training process RSS growth, rows {fig['mem_mark_row']} -> {fig['mem_rows']}",
         f"{fig['mem_rss_growth_mib']:.2f} MiB", "~0 (no growth)"),
    ]
    if "mem_sampler_rss_growth_mib" in fig:
        rows += [
            (f"engine process RSS at row {fig['mem_mark_row']} / at row {fig['mem_rows']}",
             f"{fig['mem_sampler_rss_at_mark_mib']:.1f} / {fig['mem_sampler_rss_end_mib']:.1f} "
             f"MiB (USS {fig['mem_sampler_uss_end_mib']:.1f} MiB)", ""),
            (f"engine process RSS growth, rows {fig['mem_mark_row']} -> {fig['mem_rows']}",
             f"{fig['mem_sampler_rss_growth_mib']:.2f} MiB", "~0 (no growth)"),
        ]
    else:
        rows.append(("engine process RSS", f"no engine process (engine in a "
                     f"{fig['mem_isolation']})", ""))
    rows += [
        ("objects tracked by the GC: growth over the same rows",
         f"{fig['mem_gc_objects_growth']:+d} (of {fig['mem_gc_objects_at_mark']})", "~0"),
        ("rows that reached the sink", f"{fig['mem_rows_written']}", f"= {fig['mem_rows']}"),
    ]
    if "mem_traced_growth_kib" in fig:
        rows.append(("tracemalloc: traced bytes growth over the same rows",
                     f"{fig['mem_traced_growth_kib']:.1f} KiB", "~0"))
    out = ["| figure | value | target |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out)


# --- (d) the engine process's memory by sink --------------------------------------------------

RSS_SINKS = ("none", "jsonl", "object", "mlflow-sqlite", "mlflow-server")
"""(d)'s configurations: no sink; a JSONL file; an object sink (rows come back to the training
process, as for W&B); MLflow into a SQLite store; MLflow into a tracking server."""


def rss_child(config: str, seconds: float, tmp: Path, settle_s: float = 1.5) -> dict[str, Any]:
    """In a fresh process: one configuration of (d); returns its figures. After the rows,
    the training thread stays busy ``settle_s`` seconds before the readings (the last rows
    are finished about 1 s after their ``log()``; ``--quick``: 0.3 s)."""
    import gpulens

    sinks: list[Any] = []
    mlflow: Any = None
    if config == "jsonl":
        sinks = [f"jsonl:{tmp / 'rss.jsonl'}"]
    elif config == "object":
        sinks = [CountingSink()]
    elif config.startswith("mlflow"):
        import mlflow

        mlflow.set_experiment("gpulens-bench-log-rss")
        mlflow.start_run()
        sinks = ["mlflow"]
    elif config != "none":
        raise ValueError(f"unknown configuration {config!r}")
    gc.collect()
    before = _rss_bytes()
    mon = gpulens.Monitor(interval=INTERVAL_S, sinks=sinks, backend="simulated")
    mon.start()
    rows = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rows += 1
            mon.log(rows, loss=1.0 / rows, learning_rate=3e-4, grad_norm=0.5)
            time.sleep(0.02)
        busy_wait(settle_s)
        mem = sampler_memory()
        running = _rss_bytes()
        isolation = mon.isolation
    finally:
        stats = mon.stop()
        if mlflow is not None:
            mlflow.end_run()
    return {
        "config": config, "isolation": isolation, "rows_logged": rows,
        "rows_written": {k: getattr(v, "written", None) for k, v in stats.items()},
        "rows_dropped": {k: getattr(v, "dropped", None) for k, v in stats.items()},
        "train_rss_before_mib": before / 2**20, "train_rss_running_mib": running / 2**20,
        "sampler_rss_mib": mem[0] / 2**20 if mem else None,
        "sampler_uss_mib": mem[1] / 2**20 if mem else None,
    }


def start_mlflow_server(tmp: Path) -> tuple[Any, str | None]:
    """A tracking server on 127.0.0.1 (the test suite's helper), or (None, why not)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    try:
        from tests.support.mlflow_server import start_mlflow_server as start
    except ImportError as exc:
        return None, f"no server helper ({exc})"
    try:
        return start(tmp / "mlflow-server"), None
    except Exception as exc:
        return None, f"server did not start: {type(exc).__name__}: {str(exc)[:200]}"


def bench_sampler_rss(tmp: Path, configs: list[str], seconds: float,
                      settle_s: float = 1.5) -> list[dict[str, Any]]:
    """(d): each configuration in a fresh Python process (``--rss-child``)."""
    import subprocess

    out: list[dict[str, Any]] = []
    server: Any = None
    try:
        for config in configs:
            env = dict(os.environ)
            if config == "mlflow-sqlite":
                env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'rss-mlflow.db'}"
            elif config == "mlflow-server":
                if server is None:
                    server, why = start_mlflow_server(tmp)
                    if server is None:
                        out.append({"config": config, "skipped": why})
                        continue
                env["MLFLOW_TRACKING_URI"] = server.uri
            proc = subprocess.run(
                [sys.executable, __file__, "--rss-child", config, "--rss-seconds", str(seconds),
                 "--rss-settle-s", str(settle_s), "--rss-dir", str(tmp)],
                capture_output=True, text=True, env=env, timeout=300)
            if proc.returncode != 0:
                out.append({"config": config,
                            "skipped": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"})
                continue
            fig = json.loads(proc.stdout.strip().splitlines()[-1])
            fig["stderr_tail"] = proc.stderr.strip()[-600:]  # the monitor's warnings, if any
            out.append(fig)
    finally:
        if server is not None:
            server.stop()
    return out


def rss_table(results: list[dict[str, Any]]) -> str:
    """(d) as a Markdown table."""
    lines = ["| sink | engine process RSS (MiB) | engine process USS (MiB) "
             "| training process RSS before start / running (MiB) "
             "| rows logged / written, dropped |",
             "|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} | | | |")
            continue
        rss = "-" if r["sampler_rss_mib"] is None else f"{r['sampler_rss_mib']:.1f}"
        uss = "-" if r["sampler_uss_mib"] is None else f"{r['sampler_uss_mib']:.1f}"
        dropped = r.get("rows_dropped", {})
        written = ", ".join(f"{k} {v}, {dropped.get(k)} dropped"
                            for k, v in r["rows_written"].items()) or "no sink"
        lines.append(f"| {r['config']} (sampler in a {r['isolation']}) | {rss} | {uss} "
                     f"| {r['train_rss_before_mib']:.1f} / {r['train_rss_running_mib']:.1f} "
                     f"| {r['rows_logged']} / {written} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run (a), (b), (c), (d); print the tables and optionally write JSON."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--gap-us", type=float, default=1000.0, help="busy time between log() calls")
    p.add_argument("--mem-burst", type=int, default=5000,
                   help="rows logged back to back before waiting for them in the memory run")
    p.add_argument("--mem-rows", type=int, default=None, help="rows in the memory run")
    p.add_argument("--tracemalloc", action="store_true",
                   help="also trace allocations in the memory run (slow: use fewer rows)")
    p.add_argument("--rss-sinks", default=None,
                   help=f"(d)'s configurations, comma-separated, of {', '.join(RSS_SINKS)} "
                   "(default: all; --quick: none,object)")
    p.add_argument("--no-sinks-rss", action="store_true", help="skip (d)")
    p.add_argument("--rss-seconds", type=float, default=3.0)
    p.add_argument("--rss-settle-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rss-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _use_simulated(N_GPUS)
    settle = args.rss_settle_s if args.rss_settle_s is not None else (
        0.3 if args.quick else 1.5)
    if args.rss_child:
        assert args.rss_dir is not None
        print(json.dumps(rss_child(args.rss_child, args.rss_seconds, args.rss_dir, settle)))
        return 0
    calls, steps, reps, rows = (300, 40, 2, 600) if args.quick else (10_000, 400, 7, 100_000)
    rows = args.mem_rows or rows
    configs = [c.strip() for c in (args.rss_sinks or (
        "none,object" if args.quick else ",".join(RSS_SINKS))).split(",") if c.strip()]
    unknown = set(configs) - set(RSS_SINKS)
    if unknown:
        p.error(f"unknown --rss-sinks {sorted(unknown)}; known: {', '.join(RSS_SINKS)}")
    import gpulens

    fig: dict[str, Any] = {
        "quick": args.quick,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "gpulens": getattr(gpulens, "__version__", "?"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    with tempfile.TemporaryDirectory(prefix="gpulens-bench-") as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        fig.update(bench_latency(tmp, calls, args.gap_us))
        fig.update(bench_loop(tmp, steps, reps, busy_s=0.001, wait_s=0.004))
        fig.update(bench_memory(rows, args.mem_burst, args.tracemalloc))
        if not args.no_sinks_rss:
            fig["sampler_rss"] = bench_sampler_rss(tmp, configs, args.rss_seconds, settle)
        fig["wall_s"] = time.perf_counter() - t0
    print(f"gpulens {fig['gpulens']} | Python {fig['python']} | {fig['cpus']} CPUs | "
          f"{fig['date']} | {'quick' if args.quick else 'full'} run in {fig['wall_s']:.1f} s")
    print(table(fig))
    if "sampler_rss" in fig:
        print()
        print(rss_table(fig["sampler_rss"]))
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
