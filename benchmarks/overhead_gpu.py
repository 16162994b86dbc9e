"""Training-step overhead of gpulens and of the monitors people use, with an A/A arm (issue 11).

One process trains a GPT-2-small-sized transformer (12 layers, 768 wide, 12 heads, 1024 tokens,
built in code from ``GPT2Config``: no download; bf16 weights, fused AdamW), the batch chosen so
that a step takes about ``--target-ms`` (100 ms by default) on the GPU. It runs **rounds**; each
round runs every **arm** once, in a balanced, seeded order (``paired.round_order``; seed
recorded). An arm is a baseline loop, the same baseline a second time (its **A/A arm**,
``<baseline>_b``), or the baseline with one monitor. ``benchmarks/paired.py`` holds the
statistics: per-round paired differences in percentage points (pp) of the baseline's step, their
mean with a 95 % bootstrap interval, the A/A envelope, the verdict rule and how many rounds the
A/A noise asks for.

Suites (``--suite``, several with commas; each brings its baseline and A/A arm):

``peers``      the plain loop (``loss.item()`` every step): ``none`` / ``none_b``;
               ``gpulens`` (``Monitor(interval)``, rows to JSONL, the engine process),
               ``gpulens_thread`` (the same, ``isolation="thread"``), ``wandb`` (an offline run
               with its system monitor at ``interval``, W&B's own processes), ``mlflow`` (a run
               on a local file store with system metrics every ``interval``), ``nvitop``
               (``ResourceMetricCollector(interval)``, its daemon thread). The peers get no
               loss; gpulens's row (loss beside the GPU window) is the only per-step write.
``wandb``      a W&B user's plain loop: ``wandb_log`` / ``wandb_log_b`` (an offline run, system
               metrics off, ``run.log({"train/loss", "train/global_step"})`` every step);
               ``wandb_stats`` (the same with W&B's system metrics every ``interval``);
               ``gpulens_wandb`` (system metrics off; ``Monitor(sinks=["wandb"])`` logs the
               loss and the GPU row: rows come back from the engine process into this
               process, ``wandb.log`` on the training thread).
The framework paths (Hugging Face ``Trainer``, Lightning, HF under DDP) are timed by
``paths_aa.py``: per-step timings on the GPU timeline in blocks alternated within one process,
which resolve +-0.3 pp where this script's block timing of whole ``train()`` calls could not.

More arms with ``--arms`` (a baseline and its A/A arm come along): ``gpulens_mlflow`` /
``gpulens_mlflow_thread`` (rows into an MLflow file store from the engine process / a thread),
``gpulens_nogpm``, ``gpulens_cheap`` (thread; no GPM / cheap reads only),
``gpulens_wandb_thread`` (``GPULENS_ISOLATION=thread``): the process-vs-thread question.

Rounds: ``--pilot`` rounds first (4); the largest per-round SD of the A/A arms sets the rounds
needed to resolve 0.2 pp (``paired.rounds_needed``), capped by ``--max-rounds`` and by the time
budget (``--budget-s``: no round starts that would end past it). ``--rounds N`` fixes the number
instead. The JSON (``$OUT/overhead.json`` or ``--json``) is rewritten after every round, so a
time limit still leaves figures.

Per arm, also: the median step; the CPU time of monitoring threads and processes (threads that
did not exist after the model's warm-up, and child processes, as a share of one core); the
training thread's CPU time per step; the RSS of this process and of its child processes (a
gpulens engine process, ``wandb-core``) at the end of the arm's timed steps, the largest over the
rounds, with the children's names.

    python benchmarks/overhead_gpu.py --suite peers --budget-s 480   # on a GPU
    python benchmarks/overhead_gpu.py --quick --suite peers          # CPU smoke run

Prints Markdown; writes JSON with every round's value per arm and the order of every round.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired  # benchmarks/paired.py, beside this script

SUITES: dict[str, tuple[str, ...]] = {
    "peers": ("none", "gpulens", "gpulens_thread", "wandb", "mlflow", "nvitop"),
    "wandb": ("wandb_log", "wandb_stats", "gpulens_wandb"),
}
EXTRA_ARMS = ("gpulens_mlflow", "gpulens_mlflow_thread", "gpulens_nogpm", "gpulens_cheap",
              "gpulens_wandb_thread")
BASELINE_OF: dict[str, str] = {
    **{a: "none" for a in ("none", "gpulens", "gpulens_thread", "wandb", "mlflow", "nvitop",
                           "gpulens_mlflow", "gpulens_mlflow_thread", "gpulens_nogpm",
                           "gpulens_cheap")},
    **{a: "wandb_log" for a in ("wandb_log", "wandb_stats", "gpulens_wandb",
                                "gpulens_wandb_thread")},
}
BASELINES = ("none", "wandb_log")
for _b in BASELINES:
    BASELINE_OF[paired.aa_name(_b)] = _b
RIVALS = (
    ("gpulens", "gpulens_thread"), ("gpulens", "wandb"), ("gpulens", "mlflow"),
    ("gpulens", "nvitop"), ("gpulens", "gpulens_mlflow"), ("gpulens_mlflow",
                                                           "gpulens_mlflow_thread"),
    ("gpulens_wandb", "wandb_stats"), ("gpulens_wandb", "gpulens_wandb_thread"),
)


def log(msg: str) -> None:
    """Progress to stderr (the tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def expand_arms(suites: list[str], arms: list[str]) -> list[str]:
    """The arms to run: those of the suites and the named ones, each with its baseline and the
    baseline's A/A arm, in a stable order. ``ValueError`` names an unknown suite or arm."""
    wanted: list[str] = []
    for s in suites:
        if s not in SUITES:
            raise ValueError(f"unknown suite {s!r}; known: {', '.join(SUITES)}")
        wanted += SUITES[s]
    for a in arms:
        if a not in BASELINE_OF:
            raise ValueError(f"unknown arm {a!r}; known: {', '.join(BASELINE_OF)}")
        wanted.append(a)
    out: list[str] = []
    for a in wanted:
        base = BASELINE_OF[a]
        for x in (base, paired.aa_name(base), a):
            if x not in out:
                out.append(x)
    return out


# --- the training loop ---------------------------------------------------------------------------


@dataclass
class Setup:
    """The model, its optimizer, the batches and the device, shared by the plain-loop arms."""

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


def build_model(quick: bool, device: Any, plain: bool = False) -> tuple[Any, Any, int]:
    """GPT-2 small (124M parameters) in bf16 from a config, or a tiny one for ``quick``;
    ``plain`` (a smoke run of the plain-loop arms): a tiny model of torch alone
    (:func:`tiny_lm`), so that the run does not import transformers (~2 s of CPU)."""
    import torch

    if plain:
        return tiny_lm(torch, device)
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


def tiny_lm(torch: Any, device: Any) -> tuple[Any, Any, int]:
    """A two-layer next-token model of torch alone with GPT-2's calling convention
    (``model(input_ids=x, labels=x).loss``), in bf16, and a config with the fields the
    report reads (``n_layer``, ``n_embd``, ``n_positions``, ``vocab_size``)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(n_layer=2, n_embd=64, n_positions=64, vocab_size=512)
    nn = torch.nn

    class TinyLM(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(cfg.n_embd, cfg.n_embd),
                                                        nn.GELU())
                                          for _ in range(cfg.n_layer)])
            self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)

        def forward(self, input_ids: Any, labels: Any) -> Any:
            logits = self.head(self.blocks(self.embed(input_ids)))[:, :-1]
            loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(),
                                               labels[:, 1:].reshape(-1))
            return SimpleNamespace(loss=loss)

    torch.manual_seed(0)
    model = TinyLM().to(device=device, dtype=torch.bfloat16)
    model.train()
    return model, cfg, sum(p.numel() for p in model.parameters())


def make_optimizer(torch: Any, model: Any, device: Any) -> Any:
    """AdamW, fused on CUDA."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


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


def setup(quick: bool, target_ms: float, batch: int | None, seq: int | None,
          device_name: str | None = None, plain: bool = False) -> Setup:
    """Build everything and choose the batch so that a step takes about ``target_ms``
    (``plain``: see :func:`build_model`)."""
    import torch

    if device_name is None:
        device_name = "cuda" if (torch.cuda.is_available() and not quick) else "cpu"
    device = torch.device(device_name)
    if quick:
        torch.set_num_threads(1)  # a tiny model: more threads only contend on a small machine
    model, cfg, n_params = build_model(quick, device, plain)
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


def collect(quick: bool) -> None:
    """``gc.collect()`` before an arm or a block, so that each starts from a collected state.
    ``quick`` (a smoke run) also moves every object alive now (the libraries, the model, the
    frameworks a block imported) out of the collector's sight, so that the next collection
    scans only what was made since: with torch, transformers, W&B and MLflow loaded a full
    collection takes about 0.5 s of CPU, a dozen of them a smoke run's main cost."""
    gc.collect()
    if quick:
        gc.freeze()


# --- what is measured around each arm ------------------------------------------------------------


@dataclass
class Probe:
    """CPU times of threads and child processes, and memory, at one moment."""

    threads: dict[int, float]
    children: dict[int, float]
    rss_self: int
    rss_children: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def take() -> Probe:
        me = psutil.Process()
        threads = thread_cpu_s()
        children: dict[int, float] = {}
        rss: dict[str, int] = {}
        for c in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                ct = c.cpu_times()
                children[c.pid] = ct.user + ct.system
                name = _child_name(c)
                rss[name] = rss.get(name, 0) + int(c.memory_info().rss)
        return Probe(threads, children, int(me.memory_info().rss), rss)


def _child_name(proc: psutil.Process) -> str:
    """A short name for a child process: ``gpulens-sampler`` for a Python process whose command
    line names gpulens (the engine process), else its executable's name (``wandb-core``...)."""
    with contextlib.suppress(psutil.Error):
        name = proc.name()
        if name.startswith("python") and "gpulens" in " ".join(proc.cmdline()):
            return "gpulens-sampler"
        return name
    return "?"


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


def main_thread_cpu_s() -> float:
    """CPU seconds of the training (main) thread."""
    tid = threading.main_thread().native_id
    return thread_cpu_s().get(tid or -1, 0.0)


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
    """One arm in one round."""

    round: int
    value_s: float
    """The arm's seconds per step in this round (median of ``step_s``, or a block's mean)."""
    timing: str
    step_s: list[float]
    wall_s: float
    monitor_cpu_s: float
    train_cpu_s: float
    rss_self: int
    rss_children: dict[str, int]
    note: str = ""


class Window:
    """Probes at the start and end of an arm's timed steps; makes the arm's :class:`Rep`."""

    def __init__(self, training_threads: set[int]) -> None:
        self.training_threads = training_threads
        self.before: Probe | None = None
        self.after: Probe | None = None
        self.cpu0 = self.cpu1 = 0.0
        self.t0 = self.t1 = 0.0

    def open(self) -> None:
        self.before, self.cpu0 = Probe.take(), main_thread_cpu_s()
        self.t0 = time.perf_counter()

    def close(self) -> None:
        self.t1 = time.perf_counter()
        self.after, self.cpu1 = Probe.take(), main_thread_cpu_s()

    def rep(self, rnd: int, step_s: list[float], steps: int, timing: str, note: str) -> Rep:
        if self.before is None or self.after is None:
            raise RuntimeError("the arm ended before its timed steps did")
        wall = self.t1 - self.t0
        value = statistics.median(step_s) if timing == "median" else wall / steps
        return Rep(rnd, value, timing, step_s, wall,
                   monitor_cpu_s(self.before, self.after, self.training_threads),
                   self.cpu1 - self.cpu0, self.after.rss_self, self.after.rss_children, note)


# --- plain-loop arms -----------------------------------------------------------------------------


def missing(module: str, extra: str = "") -> str | None:
    """Why ``module`` cannot be imported here, or None."""
    try:
        __import__(module)
    except ImportError as exc:
        return f"{module} not importable ({exc}){extra}"
    return None


class Variant:
    """A plain-loop arm: start/stop a monitor around the timed steps; ``on_step`` after each."""

    def __init__(self, tmp: Path, s: Setup, args: argparse.Namespace) -> None:
        self.tmp, self.s, self.args = tmp, s, args

    def skip_reason(self) -> str | None:
        return None

    def start(self, rnd: int) -> None:
        pass

    def on_step(self, step: int, loss: float) -> None:
        pass

    def stop(self) -> str:
        return ""

    def run(self, rnd: int, warmup: int, steps: int, training_threads: set[int]) -> Rep:
        """Start, warm up, time ``steps`` steps, stop (start and stop are not timed)."""
        s = self.s
        self.start(rnd)
        step = 0
        for _ in range(warmup):
            step += 1
            self.on_step(step, train_step(s, step))
        win = Window(training_threads)
        win.open()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step += 1
            loss = train_step(s, step)
            self.on_step(step, loss)
            times.append(time.perf_counter() - t0)
        win.close()
        return win.rep(rnd, times, steps, "median", self.stop())


def rows_note(stats: dict[str, Any]) -> str:
    dropped = sum(getattr(v, "dropped", 0) for v in stats.values())
    return f", {dropped} dropped" if dropped else ""


class GpulensVariant(Variant):
    """``gpulens.Monitor(interval, sinks=["jsonl:..."])``; ``log(step, loss=...)`` every step."""

    reads: dict[str, Any] = {}  # noqa: RUF012 - read-only per class

    def start(self, rnd: int) -> None:
        import gpulens

        self.path = self.tmp / f"{type(self).__name__}-{rnd}.jsonl"
        self.mon = gpulens.Monitor(interval=self.args.interval, sinks=[f"jsonl:{self.path}"],
                                   **self.reads)
        self.mon.start()

    def on_step(self, step: int, loss: float) -> None:
        self.mon.log(step, loss=loss)

    def stop(self) -> str:
        stats = self.mon.stop()
        rows = [r for r in map(json.loads, self.path.open()) if "event" not in r]
        keys = {k for r in rows for k in r}
        gpu_keys = sorted(k for k in keys if k.startswith("gpu/0/"))
        backend = self.mon.context.backend if self.mon.context else "?"
        return (f"{len(rows)} rows, backend {backend}, {len(gpu_keys)} gpu/0 keys, "
                f"sampler in a {self.mon.isolation}" + rows_note(stats))


class GpulensThreadVariant(GpulensVariant):
    reads = {"isolation": "thread"}  # noqa: RUF012


class GpulensNoGpmVariant(GpulensVariant):
    reads = {"gpm": False, "isolation": "thread"}  # noqa: RUF012


class GpulensCheapVariant(GpulensVariant):
    reads = {"gpm": False, "energy": False, "driver_samples": False,  # noqa: RUF012
             "isolation": "thread"}


class GpulensMlflowVariant(Variant):
    """gpulens's rows (~100 metrics each) into an MLflow run on a local file store."""

    isolation = "process"

    def skip_reason(self) -> str | None:
        return missing("mlflow")

    def start(self, rnd: int) -> None:
        import mlflow

        import gpulens

        mlflow.set_tracking_uri((self.tmp / "mlruns-gpulens").as_uri())
        mlflow.set_experiment("gpulens-bench-rows")
        self.run_ = mlflow.start_run(run_name=f"{type(self).__name__}-{rnd}",
                                     log_system_metrics=False)
        self.mon = gpulens.Monitor(interval=self.args.interval, sinks=["mlflow"],
                                   isolation=self.isolation)
        self.mon.start()

    def on_step(self, step: int, loss: float) -> None:
        self.mon.log(step, loss=loss)

    def stop(self) -> str:
        import mlflow

        stats = self.mon.stop()
        run_id = self.run_.info.run_id
        mlflow.end_run()
        client = mlflow.MlflowClient()
        keys = list(client.get_run(run_id).data.metrics)
        rows = len(client.get_metric_history(run_id, "train/global_step"))
        return f"{rows} rows of {len(keys)} metrics in MLflow" + rows_note(stats)


class GpulensMlflowThreadVariant(GpulensMlflowVariant):
    isolation = "thread"


def wandb_init(tmp: Path, name: str, stats_interval: float | None, quick: bool = False) -> Any:
    """An offline W&B run; system metrics every ``stats_interval`` s, or off (None).
    ``quick`` (a smoke run): W&B does not list the installed packages into the run (it reads
    every package's metadata at each ``init``, ~0.3 s of CPU)."""
    import wandb

    settings: dict[str, Any] = {"console": "off", "silent": True, "disable_git": True,
                                "save_code": False}
    if quick:
        settings["x_save_requirements"] = False
    if stats_interval is None:
        settings["x_disable_stats"] = True
    else:
        settings["x_stats_sampling_interval"] = stats_interval
    return wandb.init(project="gpulens-bench", name=name, mode="offline", dir=str(tmp),
                      settings=wandb.Settings(**settings))


def wandb_finish(run: Any) -> str:
    """Finish the run and end W&B's service process (``wandb-core`` would otherwise outlive
    the arm and show in the next arms' child processes); its run file's size."""
    import wandb

    run_dir = Path(run.dir).parent
    run.finish()
    wandb.teardown()
    size = sum(f.stat().st_size for f in run_dir.glob("*.wandb"))
    return f"offline run file {size / 1024:.0f} KiB"


class WandbVariant(Variant):
    """W&B's system monitor alone (no loss logged): the peers suite."""

    def skip_reason(self) -> str | None:
        return missing("wandb")

    def start(self, rnd: int) -> None:
        self.run_ = wandb_init(self.tmp, f"wandb-{rnd}", self.args.interval, self.args.quick)

    def stop(self) -> str:
        return wandb_finish(self.run_)


class WandbLogVariant(Variant):
    """A W&B user's loop: the loss logged every step; system metrics off (or on: ``stats``)."""

    stats = False

    def skip_reason(self) -> str | None:
        return missing("wandb")

    def start(self, rnd: int) -> None:
        self.run_ = wandb_init(self.tmp, f"{type(self).__name__}-{rnd}",
                               self.args.interval if self.stats else None, self.args.quick)

    def on_step(self, step: int, loss: float) -> None:
        self.run_.log({"train/loss": loss, "train/global_step": step})

    def stop(self) -> str:
        return wandb_finish(self.run_)


class WandbStatsVariant(WandbLogVariant):
    stats = True


class GpulensWandbVariant(Variant):
    """W&B run with its system metrics off; gpulens writes loss and GPU row through its
    ``"wandb"`` sink (rows come back from the engine process; ``wandb.log`` on this thread)."""

    isolation: str | None = None

    def skip_reason(self) -> str | None:
        return missing("wandb")

    def start(self, rnd: int) -> None:
        import gpulens

        self.run_ = wandb_init(self.tmp, f"{type(self).__name__}-{rnd}", None, self.args.quick)
        kw = {"isolation": self.isolation} if self.isolation else {}
        self.mon = gpulens.Monitor(interval=self.args.interval, sinks=["wandb"], **kw)
        self.mon.start()

    def on_step(self, step: int, loss: float) -> None:
        self.mon.log(step, loss=loss)

    def stop(self) -> str:
        stats = self.mon.stop()
        written = sum(getattr(v, "written", 0) for v in stats.values())
        return (f"{written} rows to W&B, sampler in a {self.mon.isolation}, "
                + wandb_finish(self.run_) + rows_note(stats))


class GpulensWandbThreadVariant(GpulensWandbVariant):
    isolation = "thread"


class MlflowVariant(Variant):
    def skip_reason(self) -> str | None:
        return missing("mlflow")

    def start(self, rnd: int) -> None:
        import mlflow

        mlflow.set_tracking_uri((self.tmp / "mlruns").as_uri())
        mlflow.enable_system_metrics_logging()
        mlflow.set_system_metrics_sampling_interval(self.args.interval)
        mlflow.set_system_metrics_samples_before_logging(1)
        mlflow.set_experiment("gpulens-bench")
        self.run_ = mlflow.start_run(run_name=f"mlflow-{rnd}", log_system_metrics=True)

    def stop(self) -> str:
        import mlflow

        run_id = self.run_.info.run_id
        mlflow.end_run()
        mlflow.disable_system_metrics_logging()  # a process-wide switch: off for later arms
        client = mlflow.MlflowClient()
        keys = list(client.get_run(run_id).data.metrics)
        gpu = [k for k in keys if k.startswith("system/gpu_0")]
        n = len(client.get_metric_history(run_id, "system/cpu_utilization_percentage"))
        return f"{n} samples, {len(gpu)} gpu_0 series"


class NvitopVariant(Variant):
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

    def start(self, rnd: int) -> None:
        from nvitop import Device, ResourceMetricCollector

        # its daemon thread cannot be restarted after stop(): a new collector per round
        self.collector = ResourceMetricCollector(Device.cuda.all(), interval=self.args.interval)
        self.collector.start(tag="bench")

    def stop(self) -> str:
        metrics = self.collector.collect()
        self.collector.stop()
        util = [k for k in metrics if "gpu_utilization" in k]
        return f"{len(metrics)} keys, {len(util)} gpu_utilization"


# --- the arms, by name ---------------------------------------------------------------------------


class Arm:
    """A runnable arm: ``run(round, ...)`` gives its :class:`Rep`."""

    def __init__(self, name: str, why: str | None) -> None:
        self.name, self.why = name, why

    def skip_reason(self) -> str | None:
        return self.why

    def run(self, rnd: int, warmup: int, steps: int, training_threads: set[int]) -> Rep:
        raise NotImplementedError


class PlainArm(Arm):
    def __init__(self, name: str, variant: Variant) -> None:
        super().__init__(name, variant.skip_reason())
        self.variant = variant

    def run(self, rnd: int, warmup: int, steps: int, training_threads: set[int]) -> Rep:
        return self.variant.run(rnd, warmup, steps, training_threads)


PLAIN: dict[str, type[Variant]] = {
    "none": Variant, "gpulens": GpulensVariant, "gpulens_thread": GpulensThreadVariant,
    "gpulens_nogpm": GpulensNoGpmVariant, "gpulens_cheap": GpulensCheapVariant,
    "gpulens_mlflow": GpulensMlflowVariant, "gpulens_mlflow_thread": GpulensMlflowThreadVariant,
    "wandb": WandbVariant, "mlflow": MlflowVariant, "nvitop": NvitopVariant,
    "wandb_log": WandbLogVariant, "wandb_stats": WandbStatsVariant,
    "gpulens_wandb": GpulensWandbVariant, "gpulens_wandb_thread": GpulensWandbThreadVariant,
}
PLAIN |= {paired.aa_name(b): PLAIN[b] for b in ("none", "wandb_log")}


def make_arms(names: list[str], tmp: Path, s: Setup, args: argparse.Namespace) -> dict[str, Arm]:
    """The runnable arms (an arm whose tracker cannot be imported skips, saying why)."""
    arms: dict[str, Arm] = {}
    for name in names:
        if name not in PLAIN:
            raise ValueError(f"no runner for arm {name!r}")
        arms[name] = PlainArm(name, PLAIN[name](tmp, s, args))
    return arms


# --- report --------------------------------------------------------------------------------------


@dataclass
class Result:
    """Every round of one arm."""

    name: str
    reps: list[Rep] = field(default_factory=list)
    skipped: str | None = None

    def values(self) -> dict[int, float]:
        return {r.round: r.value_s for r in self.reps}


def arm_figures(r: Result, baseline: str) -> dict[str, Any]:
    """Per-arm figures (besides the paired comparisons)."""
    if not r.reps:
        return {"skipped": r.skipped or "no round ran"}
    steps = [t for rep in r.reps for t in rep.step_s]
    wall = sum(x.wall_s for x in r.reps)
    children: dict[str, int] = {}
    for x in r.reps:
        for k, v in x.rss_children.items():
            children[k] = max(children.get(k, 0), v)
    return {
        "baseline": baseline,
        "timing": r.reps[0].timing,
        "rounds": len(r.reps),
        "median_of_round_values_ms": statistics.median(x.value_s for x in r.reps) * 1e3,
        "median_step_ms": statistics.median(steps) * 1e3 if steps else math.nan,
        "monitor_cpu_pct_core": 100 * sum(x.monitor_cpu_s for x in r.reps) / wall if wall else 0,
        "train_thread_cpu_ms_per_step": 1e3 * sum(x.train_cpu_s for x in r.reps)
        / max(1, sum(len(x.step_s) for x in r.reps)),
        "rss_self_mib_max": max(x.rss_self for x in r.reps) / 2**20,
        "rss_children_mib_max": {k: v / 2**20 for k, v in sorted(children.items())},
        "per_round": [{"round": x.round, "value_ms": x.value_s * 1e3, "wall_s": x.wall_s,
                       "monitor_cpu_s": x.monitor_cpu_s, "train_cpu_s": x.train_cpu_s,
                       "rss_self_mib": x.rss_self / 2**20,
                       "rss_children_mib": {k: v / 2**20 for k, v in x.rss_children.items()},
                       "note": x.note} for x in r.reps],
        "note": r.reps[-1].note,
    }


def arm_table(figs: dict[str, dict[str, Any]]) -> str:
    lines = ["| arm | baseline | timing | rounds | step (ms), median of rounds "
             "| monitor CPU (% of a core) | training-thread CPU (ms/step) | this process RSS (MiB) "
             "| child processes RSS (MiB) | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in figs.items():
        if "skipped" in f:
            lines.append(f"| {name} | skipped | | | | | | | | {f['skipped']} |")
            continue
        kids = ", ".join(f"{k} {v:.0f}" for k, v in f["rss_children_mib_max"].items()) or "-"
        lines.append(
            f"| {name} | {f['baseline']} | {f['timing']} | {f['rounds']} "
            f"| {f['median_of_round_values_ms']:.2f} | {f['monitor_cpu_pct_core']:.2f} "
            f"| {f['train_thread_cpu_ms_per_step']:.2f} | {f['rss_self_mib_max']:.0f} | {kids} "
            f"| {f['note']} |")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    """Versions of the packages that matter here."""
    out = {"python": platform.python_version()}
    for name in ("gpulens", "torch", "transformers", "accelerate", "lightning", "wandb",
                 "mlflow-skinny", "mlflow", "nvitop", "nvidia-ml-py", "psutil"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    with contextlib.suppress(ImportError):  # which tree ran (an A/B runs two: say which)
        import gpulens

        out["gpulens_from"] = str(Path(gpulens.__file__).resolve().parent.parent)
    return out


def hardware(s: Setup) -> dict[str, Any]:
    """GPU name, driver and CUDA versions, CPU count."""
    hw: dict[str, Any] = {"device": str(s.device), "cpus": os.cpu_count(),
                          "cpu": platform.processor() or platform.machine()}
    if s.device.type == "cuda":
        hw["gpu"] = s.torch.cuda.get_device_name(s.device)
        hw["cuda"] = s.torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            hw["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as exc:
            hw["driver"] = f"? ({exc})"
    return hw


def git_commit() -> str:
    """The commit of the checkout the script runs from, if git can tell."""
    import subprocess

    with contextlib.suppress(Exception):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    return "?"


@dataclass
class Run:
    """Everything one invocation measured, and how it was run."""

    args: argparse.Namespace
    arms: list[str]
    results: dict[str, Result]
    baseline_of: dict[str, str]
    rivals: tuple[tuple[str, str], ...] = RIVALS
    orders: list[list[str]] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    plan: paired.Plan | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def values(self) -> dict[str, dict[int, float]]:
        return {n: r.values() for n, r in self.results.items() if r.reps}

    def comparisons(self) -> list[paired.Comparison]:
        base_of = {a: self.baseline_of[a] for a in self.arms}
        return paired.compare(self.values(), base_of, self.rivals, seed=self.args.seed)

    def aa_sd(self) -> float:
        """The noisiest group's A/A per-round SD (pp) so far."""
        return paired.worst_aa_sd(self.values(), set(self.baseline_of.values()))

    def current_plan(self, pilot: int, needed: int | None, cap: int | None,
                     pilot_sd: float, cap_by: str) -> paired.Plan:
        final = self.aa_sd()
        return paired.Plan(pilot, pilot_sd, needed, cap, len(self.round_s), final,
                           self.args.resolve_pp, cap_by)


def write_report(run: Run, out: Path | None, final: bool) -> None:
    """The JSON (after every round); with ``final`` also the Markdown on stdout."""
    figs = {n: arm_figures(r, run.baseline_of[n]) for n, r in run.results.items()}
    comps = run.comparisons()
    doc = {"meta": {**run.meta, "complete": final, "rounds_done": len(run.round_s),
                    "round_s": run.round_s, "orders": run.orders,
                    "plan": run.plan.as_dict() if run.plan else None},
           "arms": figs, "comparisons": [c.as_dict() for c in comps]}
    if out is not None:
        out.write_text(json.dumps(doc, indent=2, default=str))
    if not final:
        return
    m = run.meta
    hw = m["hardware"]
    print(f"## overhead ({', '.join(m['suites']) or 'arms'}): {hw.get('gpu', hw['device'])}, "
          f"driver {hw.get('driver', '-')}, CUDA {hw.get('cuda', '-')}, {hw['cpus']} CPUs; "
          f"{m['date']}; commit {m['commit']}")
    print(f"model {m['model']['n_params'] / 1e6:.1f}M params bf16, batch {m['model']['batch']} x "
          f"{m['model']['seq_len']} tokens; {len(run.round_s)} rounds x {m['steps']} timed steps "
          f"(+{m['warmup']} warm-up) per arm; monitors at {m['interval_s']} s; trainers log every "
          f"{m['log_every']} step(s); arm orders balanced (Williams), seed {m['seed']}")
    print(f"versions {json.dumps(m['versions'])}")
    print()
    if run.plan is not None:
        print(run.plan.line())
        print()
    print("orders: " + "; ".join(f"{i}: {' '.join(o)}" for i, o in enumerate(run.orders)))
    print()
    print(paired.table(comps))
    for note in paired.bias_notes(comps):
        print()
        print(note)
    print()
    print(arm_table(figs))
    if out is not None:
        log(f"wrote {out}")


# --- main ----------------------------------------------------------------------------------------


def quiet_libraries() -> None:
    """Keep the peers' log chatter off the tables (warnings and info to stderr at most once)."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "mlflow", "wandb",
                 "urllib3", "git", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # mlflow-skinny has no SQL store; MLflow 3 asks for this to keep the file store
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CPU, a tiny model of torch alone, simulated GPUs for gpulens: a smoke "
                   "test")
    p.add_argument("--suite", default="peers",
                   help=f"comma-separated suites: {', '.join(SUITES)} (default peers)")
    p.add_argument("--arms", default="", help="more arms by name (see the module doc)")
    p.add_argument("--rounds", type=int, default=None,
                   help="run exactly this many rounds (no pilot rule)")
    p.add_argument("--pilot", type=int, default=4, help="rounds before the A/A noise is read")
    p.add_argument("--max-rounds", type=int, default=60)
    p.add_argument("--resolve-pp", type=float, default=paired.RESOLVE_PP,
                   help="the difference the rounds are chosen to resolve (pp)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after each start")
    p.add_argument("--interval", type=float, default=0.1, help="every monitor's sampling period")
    p.add_argument("--log-every", type=int, default=1,
                   help="HF logging_steps / Lightning log_every_n_steps")
    p.add_argument("--target-ms", type=float, default=100.0, help="wanted step time (GPU)")
    p.add_argument("--batch", type=int, default=None, help="fix the batch instead")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="seeds the order of the arms")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no round that would end after this many seconds")
    p.add_argument("--json", type=Path, default=None,
                   help="where to write the figures (default $OUT/overhead.json if OUT is set)")
    return p.parse_args(argv)


def run_rounds(run: Run, arms: dict[str, Arm], warmup: int, steps: int,
               training_threads: set[int], t_begin: float, out: Path | None,
               agree: Callable[[Any], Any] = lambda x: x,
               combine: Callable[[Rep], Rep] = lambda r: r, writer: bool = True,
               raise_on_failure: bool = False) -> None:
    """Run shuffled rounds until the pilot's rule, ``--rounds``, ``--max-rounds`` or the time
    budget says stop; report after every round (``writer`` only).

    ``agree(x)`` returns the value every process must act on (in a distributed run: rank 0's,
    broadcast); ``combine(rep)`` merges a rep with the other ranks' (a collective: every rank
    calls it after every arm). ``raise_on_failure``: an arm that fails ends the run (in a
    distributed run the other ranks cannot go on alone).
    """
    args = run.args
    runnable = [n for n in run.arms if run.results[n].skipped is None]
    log(f"arms {runnable}; {steps} timed steps (+{warmup} warm-up) per arm")
    fixed = args.rounds
    target = fixed if fixed is not None else max(2, args.pilot)
    needed: int | None = None
    cap: int | None = None
    cap_by = "the time budget"
    pilot_sd = math.nan
    rnd = 0
    while rnd < target and runnable:
        elapsed = time.perf_counter() - t_begin
        stop = bool(run.round_s) and elapsed + max(run.round_s) > args.budget_s
        if agree(stop):
            log(f"stopping after {rnd} rounds: {elapsed:.0f} s used of a {args.budget_s} s budget")
            break
        t_round = time.perf_counter()
        order = paired.round_order(runnable, args.seed, rnd)
        run.orders.append(order)
        for name in order:
            collect(args.quick)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    r = combine(arms[name].run(rnd, warmup, steps, training_threads))
            except Exception as exc:  # one arm failing must not take the other figures down
                run.results[name].skipped = f"failed: {type(exc).__name__}: {exc}"
                log(f"{name} failed: {exc!r}")
                runnable = [n for n in runnable if n != name]
                if raise_on_failure:
                    if writer:
                        write_report(run, out, final=False)
                    raise
                continue
            run.results[name].reps.append(r)
            log(f"round {rnd} {name}: {r.value_s * 1e3:.2f} ms/step ({r.timing}), "
                f"monitor CPU {r.monitor_cpu_s:.3f} s; {r.note}")
        run.round_s.append(time.perf_counter() - t_round)
        rnd += 1
        if fixed is None and rnd == target:  # the pilot is over: how many rounds are needed?
            pilot_sd = run.aa_sd()
            needed = paired.rounds_needed(pilot_sd, args.resolve_pp)
            left = args.budget_s - (time.perf_counter() - t_begin)
            cap = rnd + max(0, int(left // max(run.round_s)))
            if args.max_rounds < cap:
                cap, cap_by = args.max_rounds, "--max-rounds"
            target = agree(max(rnd, min(needed if needed is not None else rnd, cap)))
            log(f"pilot: A/A SD {pilot_sd:.3f} pp -> {needed} rounds needed; {cap_by} allows "
                f"{cap}; running {target}")
        if fixed is None and rnd >= args.pilot:
            run.plan = run.current_plan(args.pilot, needed, cap, pilot_sd, cap_by)
        if writer:  # figures so far, in case a time limit cuts the run off
            write_report(run, out, final=False)
    if fixed is not None:
        sd_now = run.aa_sd()
        run.plan = paired.Plan(0, sd_now, paired.rounds_needed(sd_now, args.resolve_pp), None,
                               len(run.round_s), sd_now, args.resolve_pp)
    for res in run.results.values():
        if not res.reps and res.skipped is None:
            res.skipped = "no round ran"
    if writer:
        write_report(run, out, final=True)


def main(argv: list[str] | None = None) -> int:
    """Run the arms in shuffled rounds and report."""
    args = parse_args(argv)
    quiet_libraries()
    t_begin = time.perf_counter()
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
    steps = args.steps or (6 if args.quick else 40)
    warmup = max(1, args.warmup or (2 if args.quick else 5))
    suites = [x.strip() for x in args.suite.split(",") if x.strip()]
    extra = [x.strip() for x in args.arms.split(",") if x.strip()]
    try:
        names = expand_arms(suites, extra)
    except ValueError as exc:
        print(f"overhead_gpu.py: {exc}", file=sys.stderr)
        return 2
    out = args.json or (Path(os.environ["OUT"]) / "overhead.json" if os.environ.get("OUT")
                        else None)

    s = setup(args.quick, args.target_ms, args.batch, args.seq, plain=args.quick)
    gc.collect()
    training_threads = set(Probe.take().threads)  # training's own: main, autograd, CUDA, OpenMP
    tmpdir = tempfile.TemporaryDirectory(prefix="gpulens-overhead-")
    tmp = Path(tmpdir.name)
    arms = make_arms(names, tmp, s, args)
    run = Run(args, names, {n: Result(n) for n in names}, {n: BASELINE_OF[n] for n in names})
    for n, a in arms.items():
        run.results[n].skipped = a.skip_reason()
    if args.quick:
        collect(True)
    run.meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
        "quick": args.quick, "suites": suites, "arms": names, "hardware": hardware(s),
        "versions": versions(),
        "model": {"n_params": s.n_params, "n_layer": s.config.n_layer, "n_embd": s.config.n_embd,
                  "seq_len": s.seq_len, "batch": s.batch_size, "dtype": "bfloat16"},
        "interval_s": args.interval, "log_every": args.log_every, "steps": steps,
        "warmup": warmup, "seed": args.seed, "budget_s": args.budget_s,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    run_rounds(run, arms, warmup, steps, training_threads, t_begin, out)
    tmpdir.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
