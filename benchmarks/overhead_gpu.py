"""Training-step overhead of gpulens and of the monitors people use today, side by side (issue 5).

One process trains a GPT-2-small-sized transformer (12 layers, 768 wide, 12 heads, 1024 tokens,
built in code from ``GPT2Config``; bf16 weights, fused AdamW), batch chosen so that a step takes
about ``--target-ms`` (100 ms by default) on the GPU. Each step ends with ``loss.item()``, as a
loop that logs its loss every step does. In interleaved repetitions (the order rotates each
round) it runs the same loop under:

``none``           no monitoring (the baseline of the plain-loop variants);
``gpulens``        ``gpulens.Monitor(interval=0.1)``: 10 Hz cheap reads, GPM, energy counter,
                   the driver's buffered samples; ``mon.log(step, loss=...)`` every step, rows
                   to a JSONL file; sampler and JSONL writer in gpulens's own process (the
                   default ``isolation``);
``gpulens_thread`` the same with ``isolation="thread"``: sampler and writer in threads of the
                   training process;
``wandb``          an offline W&B run with its system monitor at ``x_stats_sampling_interval=0.1``
                   (the lowest its settings accept);
``mlflow``         an MLflow run (local file store) with system metrics every 0.1 s
                   (``set_system_metrics_sampling_interval``; it accepts any positive float, we
                   match gpulens's 10 Hz);
``nvitop``         nvitop's ``ResourceMetricCollector(interval=0.1)`` activated, its daemon
                   thread taking snapshots in the background;
``lightning``      the same model and batches in a Lightning ``Trainer`` with a CSV logger (the
                   baseline of the Lightning variant);
``lightning_dsm``  the same plus Lightning's ``DeviceStatsMonitor``.

On request (``--variants``): ``gpulens_mlflow`` / ``gpulens_mlflow_thread``: gpulens's rows
written to an MLflow run (local file store) instead of JSONL, sampler process / thread;
``gpulens_nogpm`` / ``gpulens_cheap`` (thread): without GPM, or with the cheap reads only.

The peers run only their system monitoring; the loss is not sent to them (gpulens's row, which
holds the loss beside the GPU window, is the only per-step write, so gpulens does more work here).

Per variant it reports the median step time (over all timed steps of all repetitions), its ratio
to the baseline; the per-round ratio (the variant's median step over the same round's baseline
median: pairing within a round takes out the drift of GPU clocks and temperature between rounds),
its median over the rounds with a 95 % bootstrap interval, and its range; the CPU time of
monitoring threads and processes; the training thread's CPU time per step; host memory.  A second
table sets gpulens against each other monitor round by round: the median difference of the
per-round ratios in percentage points, its 95 % bootstrap interval, and the rounds in which
gpulens cost less.  Many short rounds (40 by default, as many as the time budget allows, of 40
timed steps) give tighter intervals than a few long ones.

How monitoring CPU time is measured: ``psutil`` reads the CPU time of every OS thread of this
process (``/proc/self/task``) and of every child process, right after the warm-up steps of a
repetition and at the end of its timed steps. Threads that already existed after the model's
warm-up, before any monitor ran (the training thread, PyTorch's autograd and CUDA threads), are
the training's own and are left out; every other thread of the process (the monitor's sampler and
writer threads, W&B's asyncio thread, MLflow's and nvitop's daemon threads) and every child
process (W&B's ``wandb-core`` and ``wandb-symon``) counts. The difference over the timed steps,
divided by their wall time, is the monitor's share of one CPU core. Work a monitor does on the
training thread (``gpulens`` ``log()``, Lightning callbacks) is in the step time and in the
training thread's CPU time, not in this figure.

Host memory: RSS of this process plus its children at the end of each repetition's timed steps,
the largest over the repetitions (a per-variant figure, unlike ``ru_maxrss``).

    python benchmarks/overhead_gpu.py --budget-s 470  # on a GPU; as many rounds as fit
    python benchmarks/overhead_gpu.py --quick         # CPU, tiny model, simulated gpulens GPU

Prints a Markdown table; writes ``$OUT/overhead.json`` (or ``--json PATH``) with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata as md
import io
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

INTERVAL_S = 0.1
PLAIN = ("none", "gpulens", "gpulens_thread", "wandb", "mlflow", "nvitop")
LIGHTNING = ("lightning", "lightning_dsm")
# gpulens's own variants beyond the default: with --variants (or GPULENS_BENCH_ARGS)
DIAGNOSIS = ("gpulens_mlflow", "gpulens_mlflow_thread", "gpulens_nogpm", "gpulens_cheap")
ALL_VARIANTS = PLAIN + LIGHTNING
BASELINE = {v: "none" for v in PLAIN + DIAGNOSIS} | {v: "lightning" for v in LIGHTNING}


def log(msg: str) -> None:
    """Progress to stderr (the table goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the training loop -------------------------------------------------------------------------


@dataclass
class Setup:
    """The model, its optimizer, the batches and the device, shared by the plain-loop variants."""

    torch: Any
    device: Any
    model: Any
    optimizer: Any
    batches: list[Any]
    batch_size: int
    seq_len: int
    n_params: int
    config: Any
    quick: bool

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()


def build_model(quick: bool, device: Any) -> tuple[Any, Any, int]:
    """GPT-2 small (124M parameters) in bf16 from a config, or a tiny one for ``quick``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=512,
                         bos_token_id=0, eos_token_id=0)
    else:
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device=device, dtype=torch.bfloat16)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    return model, cfg, n_params


def make_optimizer(torch: Any, model: Any, device: Any) -> Any:
    """AdamW, fused on CUDA."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


def make_batches(torch: Any, cfg: Any, batch: int, seq: int, device: Any, n: int = 4) -> list[Any]:
    """``n`` batches of random token ids already on the device (no data loading in the step)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
            for _ in range(n)]


def train_step(s: Setup, i: int) -> float:
    """One optimizer step on batch ``i``; returns the loss as a Python float (a host sync)."""
    x = s.batches[i % len(s.batches)]
    loss = s.model(input_ids=x, labels=x).loss
    loss.backward()
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def time_steps(s: Setup, n: int) -> float:
    """Median seconds per step over ``n`` steps."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        train_step(s, i)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def setup(quick: bool, target_ms: float, batch: int | None, seq: int | None) -> Setup:
    """Build everything and choose the batch so that a step takes about ``target_ms``."""
    import torch

    device = torch.device("cuda" if (torch.cuda.is_available() and not quick) else "cpu")
    if quick:
        torch.set_num_threads(1)  # a tiny model: more threads only contend on a small machine
    model, cfg, n_params = build_model(quick, device)
    seq_len = seq or cfg.n_positions
    bs = batch or (2 if quick else 8)
    s = Setup(torch, device, model, make_optimizer(torch, model, device),
              make_batches(torch, cfg, bs, seq_len, device), bs, seq_len, n_params, cfg, quick)
    for i in range(3):
        train_step(s, i)  # warm-up: kernels chosen, allocator grown
    if batch is None and not quick:
        for _ in range(3):
            dt = time_steps(s, 3)
            want = max(1, min(64, round(s.batch_size * target_ms / 1e3 / dt)))
            log(f"batch {s.batch_size}: {dt * 1e3:.1f} ms/step; target {target_ms} ms -> {want}")
            if abs(want - s.batch_size) <= max(1, s.batch_size // 10):
                break
            s.batches = []
            gc.collect()
            torch.cuda.empty_cache()
            try:
                s.batches = make_batches(torch, cfg, want, seq_len, device)
                s.batch_size = want
                for i in range(2):
                    train_step(s, i)
            except torch.cuda.OutOfMemoryError:
                s.optimizer.zero_grad(set_to_none=True)
                want = max(1, want // 2)
                s.batches = []
                gc.collect()
                torch.cuda.empty_cache()
                s.batches = make_batches(torch, cfg, want, seq_len, device)
                s.batch_size = want
                log(f"out of memory; batch {want}")
    dt = time_steps(s, 5)
    log(f"batch {s.batch_size} x {seq_len} tokens on {device}: {dt * 1e3:.1f} ms/step")
    return s


# --- what is measured around each repetition ------------------------------------------------------


@dataclass
class Probe:
    """CPU times of threads and child processes, and memory, at one moment."""

    threads: dict[int, float]
    children: dict[int, float]
    rss: int

    @staticmethod
    def take() -> Probe:
        me = psutil.Process()
        threads = thread_cpu_s()
        children: dict[int, float] = {}
        rss = int(me.memory_info().rss)
        for c in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                ct = c.cpu_times()
                children[c.pid] = ct.user + ct.system
                rss += int(c.memory_info().rss)
        return Probe(threads, children, rss)


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id.

    From ``/proc/self/task/<tid>/schedstat`` (nanoseconds) where the kernel has it, else from
    ``psutil`` (clock ticks, 10 ms).
    """
    out: dict[int, float] = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        return out
    except (OSError, ValueError, IndexError):
        return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def monitor_cpu_s(before: Probe, after: Probe, training_threads: set[int]) -> float:
    """CPU seconds of non-training threads and of child processes between two probes."""
    total = 0.0
    for tid, t in after.threads.items():
        if tid not in training_threads:
            total += t - before.threads.get(tid, 0.0)
    for pid, t in after.children.items():
        total += t - before.children.get(pid, 0.0)
    return max(0.0, total)


@dataclass
class Rep:
    """One repetition of one variant."""

    step_s: list[float]
    wall_s: float
    monitor_cpu_s: float
    train_cpu_s: float
    rss_bytes: int
    note: str = ""


@dataclass
class Result:
    """All repetitions of one variant."""

    name: str
    reps: list[Rep] = field(default_factory=list)
    skipped: str | None = None


# --- the variants ------------------------------------------------------------------------------


def mlflow_missing() -> str | None:
    """Why the MLflow variants cannot run here, or None."""
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        return f"mlflow not importable ({exc})"
    return None


class Variant:
    """Start/stop a monitor around the timed steps; ``on_step`` runs after each step."""

    name = "none"

    def __init__(self, tmp: Path, s: Setup) -> None:
        self.tmp, self.s = tmp, s

    def skip_reason(self) -> str | None:
        return None

    def start(self, rep: int) -> None:
        pass

    def on_step(self, step: int, loss: float) -> None:
        pass

    def stop(self) -> str:
        return ""


class GpulensVariant(Variant):
    name = "gpulens"
    reads: dict[str, Any] = {}  # noqa: RUF012 - read-only per class

    def start(self, rep: int) -> None:
        import gpulens

        self.path = self.tmp / f"gpulens-{rep}.jsonl"
        backend = "simulated" if self.s.quick else None
        self.mon = gpulens.Monitor(interval=INTERVAL_S, sinks=[f"jsonl:{self.path}"],
                                   backend=backend, **self.reads)
        self.mon.start()

    def on_step(self, step: int, loss: float) -> None:
        self.mon.log(step, loss=loss)

    def stop(self) -> str:
        stats = self.mon.stop()
        rows = [r for r in map(json.loads, self.path.open()) if "event" not in r]
        keys = {k for r in rows for k in r}
        gpu_keys = sorted(k for k in keys if k.startswith("gpu/0/"))
        backend = self.mon.context.backend if self.mon.context else "?"
        dropped = sum(getattr(v, "dropped", 0) for v in stats.values())
        return (f"{len(rows)} rows, backend {backend}, {len(gpu_keys)} gpu/0 keys"
                + (f", {dropped} dropped" if dropped else ""))


class GpulensThreadVariant(GpulensVariant):
    """gpulens with its sampler (and JSONL writer) in a thread of the training process, as
    before ``isolation="process"`` became the default."""

    name = "gpulens_thread"
    reads = {"isolation": "thread"}  # noqa: RUF012


class GpulensMlflowVariant(Variant):
    """gpulens writing every row (~100 metrics) into an MLflow run (local file store) instead
    of JSONL: MLflow's client is pure Python, so where it runs matters."""

    name = "gpulens_mlflow"
    isolation = "process"

    def skip_reason(self) -> str | None:
        return mlflow_missing()

    def start(self, rep: int) -> None:
        import mlflow

        import gpulens

        mlflow.set_tracking_uri((self.tmp / "mlruns-gpulens").as_uri())
        mlflow.set_experiment("gpulens-bench-rows")
        self.run = mlflow.start_run(run_name=f"{self.name}-{rep}")
        backend = "simulated" if self.s.quick else None
        self.mon = gpulens.Monitor(interval=INTERVAL_S, sinks=["mlflow"], backend=backend,
                                   isolation=self.isolation)
        self.mon.start()

    def on_step(self, step: int, loss: float) -> None:
        self.mon.log(step, loss=loss)

    def stop(self) -> str:
        import mlflow

        stats = self.mon.stop()
        run_id = self.run.info.run_id
        mlflow.end_run()
        client = mlflow.MlflowClient()
        keys = list(client.get_run(run_id).data.metrics)
        rows = len(client.get_metric_history(run_id, "train/global_step"))
        dropped = sum(getattr(v, "dropped", 0) for v in stats.values())
        return (f"{rows} rows of {len(keys)} metrics in MLflow"
                + (f", {dropped} dropped" if dropped else ""))


class GpulensMlflowThreadVariant(GpulensMlflowVariant):
    name = "gpulens_mlflow_thread"
    isolation = "thread"


class GpulensNoGpmVariant(GpulensVariant):
    """Diagnosis: gpulens without GPM polling."""

    name = "gpulens_nogpm"
    reads = {"gpm": False, "isolation": "thread"}  # noqa: RUF012


class GpulensCheapVariant(GpulensVariant):
    """Diagnosis: gpulens with the cheap reads only (no GPM, energy counter, driver samples)."""

    name = "gpulens_cheap"
    reads = {"gpm": False, "energy": False, "driver_samples": False,  # noqa: RUF012
             "isolation": "thread"}


class WandbVariant(Variant):
    name = "wandb"

    def skip_reason(self) -> str | None:
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            return f"wandb not importable ({exc})"
        return None

    def start(self, rep: int) -> None:
        import wandb

        self.run = wandb.init(
            project="gpulens-bench", name=f"wandb-{rep}", mode="offline",
            dir=str(self.tmp),
            settings=wandb.Settings(x_stats_sampling_interval=INTERVAL_S, console="off",
                                    silent=True, disable_git=True, save_code=False),
        )

    def stop(self) -> str:
        run_dir = Path(self.run.dir).parent
        self.run.finish()
        size = sum(f.stat().st_size for f in run_dir.glob("*.wandb"))
        return f"offline run file {size / 1024:.0f} KiB"


class MlflowVariant(Variant):
    name = "mlflow"

    def skip_reason(self) -> str | None:
        return mlflow_missing()

    def start(self, rep: int) -> None:
        import mlflow

        mlflow.set_tracking_uri((self.tmp / "mlruns").as_uri())
        mlflow.enable_system_metrics_logging()
        mlflow.set_system_metrics_sampling_interval(INTERVAL_S)
        mlflow.set_system_metrics_samples_before_logging(1)
        mlflow.set_experiment("gpulens-bench")
        self.run = mlflow.start_run(run_name=f"mlflow-{rep}", log_system_metrics=True)

    def stop(self) -> str:
        import mlflow

        run_id = self.run.info.run_id
        mlflow.end_run()
        client = mlflow.MlflowClient()
        keys = list(client.get_run(run_id).data.metrics)
        gpu = [k for k in keys if k.startswith("system/gpu_0")]
        n = len(client.get_metric_history(run_id, "system/cpu_utilization_percentage"))
        return f"{n} samples, {len(gpu)} gpu_0 series"


class NvitopVariant(Variant):
    name = "nvitop"

    def skip_reason(self) -> str | None:
        try:
            from nvitop import Device
        except ImportError as exc:
            return f"nvitop not importable ({exc})"
        try:
            if not Device.cuda.all():
                return "nvitop sees no CUDA GPU"
        except Exception as exc:
            return f"nvitop cannot reach NVML ({exc})"
        return None

    def start(self, rep: int) -> None:
        from nvitop import Device, ResourceMetricCollector

        # its daemon thread cannot be restarted after stop(): a new collector per repetition
        self.collector = ResourceMetricCollector(Device.cuda.all(), interval=INTERVAL_S)
        self.collector.start(tag="bench")

    def stop(self) -> str:
        metrics = self.collector.collect()
        self.collector.stop()
        util = [k for k in metrics if "gpu_utilization" in k]
        return f"{len(metrics)} keys, {len(util)} gpu_utilization"


# --- Lightning -----------------------------------------------------------------------------------


class LightningRunner:
    """The same model and batches in a Lightning Trainer (its own copy of the model: Lightning
    moves the module to the CPU at teardown)."""

    def __init__(self, tmp: Path, s: Setup) -> None:
        import lightning.pytorch as pl
        import torch

        self.tmp, self.s, self.pl, self.torch = tmp, s, pl, torch
        model, _, _ = build_model(s.quick, s.device)
        batches = s.batches
        device = s.device

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                loss = self.net(input_ids=batch, labels=batch).loss
                self.log("loss", loss, on_step=True, on_epoch=False)
                return loss

            def configure_optimizers(self) -> Any:
                return make_optimizer(torch, self.net, device)

            def train_dataloader(self) -> Any:
                return torch.utils.data.DataLoader(Cycle(), batch_size=None)

        class Cycle(torch.utils.data.IterableDataset):  # type: ignore[misc]
            """The plain loop's batches, over and over: no epoch ends inside a repetition."""

            def __iter__(self) -> Any:
                i = 0
                while True:
                    yield batches[i % len(batches)]
                    i += 1

        self.module = Module()

    def run(self, rep: int, dsm: bool, warmup: int, steps: int,
            training_threads: set[int]) -> Rep:
        pl, s = self.pl, self.s
        marks: list[float] = []
        probes: dict[str, Probe] = {}

        class Timer(pl.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                s.sync()
                marks.append(time.perf_counter())
                if len(marks) == warmup:
                    probes["before"] = Probe.take()
                    probes["cpu_before"] = _main_thread_probe()
                elif len(marks) == warmup + steps:
                    probes["after"] = Probe.take()
                    probes["cpu_after"] = _main_thread_probe()

        from lightning.pytorch.callbacks import DeviceStatsMonitor
        from lightning.pytorch.loggers import CSVLogger

        callbacks: list[Any] = [Timer()]
        if dsm:  # on the CPU (--quick) it has only CPU figures to log
            callbacks.append(DeviceStatsMonitor(cpu_stats=True if s.device.type == "cpu" else None))
        trainer = pl.Trainer(
            accelerator="gpu" if s.device.type == "cuda" else "cpu", devices=1,
            max_steps=warmup + steps, max_epochs=-1,
            limit_val_batches=0, num_sanity_val_steps=0,
            logger=CSVLogger(str(self.tmp / "lightning"), name=f"{'dsm' if dsm else 'none'}-{rep}"),
            log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(self.module)
        step_s = [b - a for a, b in zip(marks[warmup - 1:], marks[warmup:], strict=False)]
        before, after = probes["before"], probes["after"]
        csv = Path(trainer.logger.log_dir) / "metrics.csv" if trainer.logger else None
        cols = len(csv.open().readline().split(",")) if csv and csv.exists() else 0
        del trainer
        return Rep(step_s=step_s, wall_s=marks[-1] - marks[warmup - 1],
                   monitor_cpu_s=monitor_cpu_s(before, after, training_threads),
                   train_cpu_s=probes["cpu_after"].threads[0] - probes["cpu_before"].threads[0],
                   rss_bytes=after.rss, note=f"{cols} columns in the CSV log")


def _main_thread_probe() -> Probe:
    """CPU time of the training (main) thread, stored under key 0."""
    tid = threading.main_thread().native_id
    return Probe({0: thread_cpu_s().get(tid or -1, 0.0)}, {}, 0)


# --- one repetition ------------------------------------------------------------------------------


def run_plain(v: Variant, s: Setup, rep: int, warmup: int, steps: int,
              training_threads: set[int]) -> Rep:
    """Start the variant, warm up, time ``steps`` steps, stop it (start/stop not timed)."""
    v.start(rep)
    step = 0
    for _ in range(warmup):
        step += 1
        v.on_step(step, train_step(s, step))
    before, cpu_before = Probe.take(), _main_thread_probe()
    times = []
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step += 1
        loss = train_step(s, step)
        v.on_step(step, loss)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    after, cpu_after = Probe.take(), _main_thread_probe()
    note = v.stop()
    return Rep(step_s=times, wall_s=wall, monitor_cpu_s=monitor_cpu_s(before, after,
                                                                       training_threads),
               train_cpu_s=cpu_after.threads[0] - cpu_before.threads[0], rss_bytes=after.rss,
               note=note)


# --- report ------------------------------------------------------------------------------------


def summarize(results: dict[str, Result]) -> dict[str, dict[str, Any]]:
    """Per-variant figures (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    medians = {n: statistics.median([t for rep in r.reps for t in rep.step_s])
               for n, r in results.items() if r.reps}
    for name, r in results.items():
        if not r.reps:
            out[name] = {"skipped": r.skipped or "no repetition ran"}
            continue
        base = BASELINE[name]
        all_steps = [t for rep in r.reps for t in rep.step_s]
        fig: dict[str, Any] = {
            "baseline": base,
            "reps": len(r.reps),
            "steps": len(all_steps),
            "median_step_ms": medians[name] * 1e3,
            "p90_step_ms": sorted(all_steps)[int(0.9 * (len(all_steps) - 1))] * 1e3,
            "monitor_cpu_pct_core": 100 * sum(x.monitor_cpu_s for x in r.reps)
            / sum(x.wall_s for x in r.reps),
            "monitor_cpu_ms_per_step": 1e3 * sum(x.monitor_cpu_s for x in r.reps)
            / len(all_steps),
            "train_thread_cpu_ms_per_step": 1e3 * sum(x.train_cpu_s for x in r.reps)
            / len(all_steps),
            "host_rss_mib_max": max(x.rss_bytes for x in r.reps) / 2**20,
            "rep_median_step_ms": [statistics.median(x.step_s) * 1e3 for x in r.reps],
            "notes": [x.note for x in r.reps],
        }
        if base in medians and results[base].reps:
            fig["ratio"] = medians[name] / medians[base]
            paired = [statistics.median(a.step_s) / statistics.median(b.step_s)
                      for a, b in zip(r.reps, results[base].reps, strict=False)]
            fig["rep_ratios"] = paired
            fig["overhead_pct"] = 100 * (fig["ratio"] - 1)
            fig["paired_median"] = statistics.median(paired)
            fig["paired_ci95"] = bootstrap_ci(paired)
        out[name] = fig
    return out


def bootstrap_ci(values: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``values`` (seeded: repeatable)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * (n - 1))], meds[int(0.975 * (n - 1))]


def comparison(summary: dict[str, dict[str, Any]], ours: str = "gpulens") -> str:
    """gpulens against each other monitor of the same loop, round by round.

    Per round: gpulens's step-time ratio to the baseline minus the other monitor's (both
    paired with the same round's baseline).  Negative: gpulens cost less.  Shown: the median
    difference in percentage points, its 95 % bootstrap interval, and in how many rounds
    gpulens cost less.
    """
    f = summary.get(ours) or {}
    mine = f.get("rep_ratios")
    if not mine:
        return ""
    lines = ["| gpulens vs | median difference (pp) | 95 % CI (pp) | rounds gpulens cost less |",
             "|---|---|---|---|"]
    for name in ALL_VARIANTS + DIAGNOSIS:
        other = summary.get(name) or {}
        theirs = other.get("rep_ratios")
        if name in (ours, "none", "lightning") or not theirs:
            continue
        diffs = [100 * (a - b) for a, b in zip(mine, theirs, strict=False)]
        lo, hi = bootstrap_ci(diffs)
        less = sum(d < 0 for d in diffs)
        lines.append(f"| {name} | {statistics.median(diffs):+.3f} | [{lo:+.3f}, {hi:+.3f}] "
                     f"| {less} of {len(diffs)} |")
    return "\n".join(lines)


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The Markdown table printed to stdout."""
    lines = [
        "| variant | median step (ms) | vs baseline | overhead | per-round ratio: median "
        "[95 % CI] | per-round ratios [min, max] "
        "| monitor CPU (% of a core) | monitor CPU (ms/step) | training-thread CPU (ms/step) "
        "| host RSS (MiB) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ALL_VARIANTS + DIAGNOSIS:
        f = summary.get(name)
        if f is None:
            continue
        if "skipped" in f:
            lines.append(f"| {name} | skipped | | | | | | | | | {f['skipped']} |")
            continue
        ratio = f.get("ratio")
        rr = f.get("rep_ratios") or []
        lines.append(
            f"| {name} | {f['median_step_ms']:.2f} | "
            + (f"{ratio:.4f} ({f['baseline']})" if ratio is not None else "-")
            + " | "
            + (f"{f['overhead_pct']:+.2f} %" if ratio is not None else "-")
            + " | "
            + (f"{f['paired_median']:.4f} [{f['paired_ci95'][0]:.4f}, "
               f"{f['paired_ci95'][1]:.4f}]" if ratio is not None else "-")
            + " | "
            + (f"[{min(rr):.4f}, {max(rr):.4f}]" if rr else "-")
            + f" | {f['monitor_cpu_pct_core']:.2f} | {f['monitor_cpu_ms_per_step']:.3f}"
            f" | {f['train_thread_cpu_ms_per_step']:.2f} | {f['host_rss_mib_max']:.0f}"
            f" | {f['notes'][-1] if f['notes'] else ''} |"
        )
    return "\n".join(lines)


def versions() -> dict[str, str]:
    """Versions of the packages that matter here."""
    out = {"python": platform.python_version()}
    for name in ("gpulens", "torch", "transformers", "lightning", "wandb", "mlflow-skinny",
                 "mlflow", "nvitop", "nvidia-ml-py", "psutil"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def hardware(s: Setup) -> dict[str, Any]:
    """GPU name, driver and CUDA versions, CPU count."""
    hw: dict[str, Any] = {"device": str(s.device), "cpus": os.cpu_count(),
                          "cpu": platform.processor() or platform.machine()}
    if s.device.type == "cuda":
        hw["gpu"] = s.torch.cuda.get_device_name(0)
        hw["cuda"] = s.torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            hw["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as exc:
            hw["driver"] = f"? ({exc})"
    return hw


_HARDWARE: dict[str, dict[str, Any]] = {}


def report(results: dict[str, Result], s: Setup, args: argparse.Namespace, reps: int,
           steps: int, warmup: int, rounds: int, t_begin: float, final: bool) -> None:
    """Write the JSON (after every round); with ``final`` also print the table."""
    summary = summarize(results)
    if "hw" not in _HARDWARE:  # read once (NVML init/shutdown)
        _HARDWARE["hw"] = hardware(s)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "complete": final,
        "quick": args.quick,
        "hardware": _HARDWARE["hw"],
        "versions": versions(),
        "model": {"n_params": s.n_params, "n_layer": s.config.n_layer,
                  "n_embd": s.config.n_embd, "seq_len": s.seq_len, "batch": s.batch_size,
                  "dtype": "bfloat16",
                  "attn": getattr(s.config, "_attn_implementation", None)},
        "interval_s": INTERVAL_S, "reps": reps, "rounds_done": rounds, "steps": steps,
        "warmup": warmup,
        "command": " ".join([sys.executable, *sys.argv]),
        "wall_s": time.perf_counter() - t_begin,
    }
    out = args.json or (Path(os.environ["OUT"]) / "overhead.json" if os.environ.get("OUT")
                        else None)
    if out is not None:
        out.write_text(json.dumps({"meta": meta, "variants": summary}, indent=2))
    if not final:
        return
    hw = meta["hardware"]
    print(f"## overhead: {hw.get('gpu', hw['device'])}, driver {hw.get('driver', '-')}, "
          f"CUDA {hw.get('cuda', '-')}, {hw['cpus']} CPUs; {meta['date']}")
    print(f"model {s.n_params / 1e6:.1f}M params bf16, batch {s.batch_size} x {s.seq_len} tokens; "
          f"{rounds} rounds x {steps} timed steps; monitors at {INTERVAL_S} s; "
          f"versions {json.dumps(meta['versions'])}")
    print()
    print(table(summary))
    cmp = comparison(summary)
    if cmp:
        print()
        print(cmp)
    if out is not None:
        log(f"wrote {out}")


# --- main ----------------------------------------------------------------------------------------


def quiet_libraries() -> None:
    """Keep the peers' log chatter off the table (warnings and info to stderr at most once)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "mlflow", "wandb",
                 "urllib3", "git"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    # mlflow-skinny has no SQL store; MLflow 3 asks for this to keep the file store
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def main(argv: list[str] | None = None) -> int:
    """Run every variant in interleaved repetitions and report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CPU, tiny model, simulated GPU for gpulens: a smoke test")
    p.add_argument("--reps", type=int, default=None, help="rounds over all variants")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after each start")
    p.add_argument("--target-ms", type=float, default=100.0, help="wanted step time (GPU)")
    p.add_argument("--batch", type=int, default=None, help="fix the batch instead")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--variants", default=",".join(ALL_VARIANTS))
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="start no new round once this many seconds have passed")
    p.add_argument("--json", type=Path, default=None,
                   help="where to write the figures (default $OUT/overhead.json if OUT is set)")
    args = p.parse_args(argv)
    quiet_libraries()
    t_begin = time.perf_counter()
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
    reps = args.reps or (2 if args.quick else 40)
    steps = args.steps or (6 if args.quick else 40)
    warmup = max(1, args.warmup or (2 if args.quick else 5))
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(wanted) - set(ALL_VARIANTS) - set(DIAGNOSIS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(ALL_VARIANTS)}")
    for v in wanted:  # every variant needs its baseline
        if BASELINE[v] not in wanted:
            wanted.append(BASELINE[v])

    s = setup(args.quick, args.target_ms, args.batch, args.seq)
    gc.collect()
    # Threads that exist now belong to training (main, autograd, CUDA, OpenMP pools)
    training_threads = set(Probe.take().threads)

    tmpdir = tempfile.TemporaryDirectory(prefix="gpulens-overhead-")
    tmp = Path(tmpdir.name)
    classes: dict[str, Callable[[Path, Setup], Variant]] = {
        "none": Variant, "gpulens": GpulensVariant, "gpulens_thread": GpulensThreadVariant,
        "wandb": WandbVariant,
        "gpulens_nogpm": GpulensNoGpmVariant, "gpulens_cheap": GpulensCheapVariant,
        "gpulens_mlflow": GpulensMlflowVariant,
        "gpulens_mlflow_thread": GpulensMlflowThreadVariant,
        "mlflow": MlflowVariant, "nvitop": NvitopVariant,
    }
    plain = {n: classes[n](tmp, s) for n in PLAIN + DIAGNOSIS if n in wanted}
    results = {n: Result(n) for n in ALL_VARIANTS + DIAGNOSIS if n in wanted}
    for n, v in plain.items():
        results[n].skipped = v.skip_reason()
    lightning: LightningRunner | None = None
    if any(n in wanted for n in LIGHTNING):
        try:
            lightning = LightningRunner(tmp, s)
        except ImportError as exc:
            for n in LIGHTNING:
                if n in results:
                    results[n].skipped = f"lightning not importable ({exc})"
    runnable = [n for n in results if results[n].skipped is None]
    log(f"variants {runnable}; {reps} rounds x {steps} timed steps (+{warmup} warm-up)")
    round_s: list[float] = []
    for rep in range(reps):
        elapsed = time.perf_counter() - t_begin
        if rep >= 2 and round_s and elapsed + max(round_s) > args.budget_s:
            log(f"stopping after {rep} rounds: {elapsed:.0f} s used of a {args.budget_s} s budget")
            break
        t_round = time.perf_counter()
        order = runnable[rep % len(runnable):] + runnable[:rep % len(runnable)]
        for name in order:
            gc.collect()
            sink = io.StringIO()
            try:
                with contextlib.redirect_stdout(sink):
                    if name in LIGHTNING:
                        assert lightning is not None
                        r = lightning.run(rep, name == "lightning_dsm", warmup, steps,
                                          training_threads)
                    else:
                        r = run_plain(plain[name], s, rep, warmup, steps, training_threads)
            except Exception as exc:  # a peer failing must not take the other figures down
                results[name].skipped = f"failed: {type(exc).__name__}: {exc}"
                log(f"{name} failed: {exc!r}")
                runnable = [n for n in runnable if n != name]
                continue
            results[name].reps.append(r)
            log(f"round {rep} {name}: {statistics.median(r.step_s) * 1e3:.2f} ms/step, "
                f"monitor CPU {r.monitor_cpu_s:.3f} s; {r.note}")
        round_s.append(time.perf_counter() - t_round)
        # figures so far, in case a later round is cut off by a time limit
        report(results, s, args, reps, steps, warmup, len(round_s), t_begin, final=False)
    for res in results.values():
        if not res.reps and res.skipped is None:
            res.skipped = "no repetition ran"

    report(results, s, args, reps, steps, warmup, len(round_s), t_begin, final=True)
    tmpdir.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
