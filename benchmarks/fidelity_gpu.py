"""Fidelity of per-step GPU figures on a known load: gpulens beside W&B, MLflow, nvitop (issue 5).

The load alternates two kinds of step, a known pattern:

* busy: bf16 8192 x 8192 x 8192 matrix products back to back for ``--busy-ms`` (300 ms), then a
  device sync (the GPU is fully occupied: SM activity and tensor-pipe activity near 100 %);
* idle: ``time.sleep(--idle-ms)`` (300 ms) with nothing queued (the GPU idles: near 0 %).

gpulens (``Monitor(interval=0.1)``, rows collected in memory) logs one row per step. Each step's
edges are also stamped in wall-clock time, and NVML's own total-energy counter is read on the
main thread at each edge (the reference for ``energy_j``; the counter updates about every
100 ms, so an edge reading can be up to that stale). At the same time the peers run their own
system monitors at 0.1 s: a W&B offline run (samples kept in memory with
``x_stats_buffer_size``), an MLflow run (local file store, read back with the client), nvitop's
``ResourceMetricCollector`` (its snapshots recorded as they are taken). Their figures are
wall-clock samples, not step windows: for each step the table shows how many of their samples
fall inside it and the mean of their utilization figure. MLflow stamps a sample when it writes
it, about one interval after it read it.

Checks printed at the end (not asserted): busy steps' SM activity near full (>= 80 %), idle
steps' near zero (<= 10 %); per-step ``energy_j`` against NVML's counter difference at the step
edges (a poor per-step reference: the counter ticks every ~100 ms), and issue 11's targets
against the integral of the driver's 20 ms power samples (median error <= 2 %, worst step
<= 10 %) and for the run's total against the counter (<= 0.5 %).

    python benchmarks/fidelity_gpu.py                # on a GPU; ~30 s
    python benchmarks/fidelity_gpu.py --quick        # CPU: small products, simulated GPU

Prints a Markdown table; writes ``$OUT/fidelity.json`` (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    """Progress to stderr (the table goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Rows:
    """A gpulens sink that keeps every row in memory."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def open(self, context: Any) -> None:
        pass

    def write(self, row: Any) -> None:
        self.rows.append(row)

    def close(self) -> None:
        pass


# --- the load ------------------------------------------------------------------------------------


class Load:
    """Busy steps of matrix products and idle steps of sleep."""

    def __init__(self, quick: bool, busy_ms: float) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available() and not quick
        if quick:
            torch.set_num_threads(1)
        n = 8192 if self.cuda else 256
        dev = "cuda" if self.cuda else "cpu"
        dtype = torch.bfloat16 if self.cuda else torch.float32
        g = torch.Generator(device=dev).manual_seed(0)
        self.a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
        self.b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
        self.c = torch.empty(n, n, device=dev, dtype=dtype)
        self.n = n
        for _ in range(3):
            self._products(3)
        t0 = time.perf_counter()
        self._products(20)
        per = (time.perf_counter() - t0) / 20
        self.busy_s = busy_ms / 1e3
        self.chunk = max(1, round(0.02 / per))  # products between syncs: ~20 ms of work
        self.tflops = 2 * n**3 / per / 1e12
        log(f"{n}^3 {str(dtype).replace('torch.', '')} product: {per * 1e3:.2f} ms "
            f"({self.tflops:.0f} TFLOP/s); {self.chunk} between syncs")

    def _products(self, k: int) -> None:
        for _ in range(k):
            self.torch.matmul(self.a, self.b, out=self.c)
        if self.cuda:
            self.torch.cuda.synchronize()

    def busy(self) -> None:
        """Products back to back until ``busy_s`` has passed (checked at each sync)."""
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            self._products(self.chunk)

    @staticmethod
    def idle(seconds: float) -> None:
        time.sleep(seconds)


# --- the peers -----------------------------------------------------------------------------------


class Peer:
    """A peer's monitor, started before the steps and read back after them."""

    name = "peer"
    util_key = ""

    def __init__(self, quick: bool = False) -> None:
        self.quick = quick
        """A smoke run (``--quick``): the peer may skip work that is no part of its
        figures."""

    def pick_util_key(self, series: dict[str, list[tuple[float, float]]]) -> str | None:
        """The series holding GPU 0's utilization, if the peer recorded one."""
        if self.util_key in series:
            return self.util_key
        for key in sorted(series):
            low = key.lower()
            if ("gpu.0." in low or "gpu_0" in low or "gpu:0" in low) and "util" in low:
                return key
        return None

    def start(self, tmp: Path) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, list[tuple[float, float]]]:
        """Series name -> [(unix time s, value)]."""
        raise NotImplementedError


class WandbPeer(Peer):
    name = "wandb"
    util_key = "gpu.0.gpu"

    def start(self, tmp: Path) -> None:
        import wandb

        self.run = wandb.init(
            project="gpulens-fidelity", mode="offline", dir=str(tmp),
            settings=wandb.Settings(x_stats_sampling_interval=0.1, x_stats_buffer_size=100_000,
                                    console="off", silent=True, disable_git=True,
                                    save_code=False,
                                    # a smoke run's W&B does not list the installed packages
                                    **({"x_save_requirements": False} if self.quick else {})),
        )

    def stop(self) -> dict[str, list[tuple[float, float]]]:
        metrics = self.run._system_metrics
        self.run.finish()
        return {k: [(dt.timestamp(), float(v)) for dt, v in vals] for k, vals in metrics.items()}


class MlflowPeer(Peer):
    name = "mlflow"
    util_key = "system/gpu_0_utilization_percentage"

    def start(self, tmp: Path) -> None:
        import mlflow

        mlflow.set_tracking_uri((tmp / "mlruns").as_uri())
        mlflow.set_system_metrics_sampling_interval(0.1)
        mlflow.set_system_metrics_samples_before_logging(1)
        mlflow.set_experiment("gpulens-fidelity")
        self.run = mlflow.start_run(log_system_metrics=True)

    def stop(self) -> dict[str, list[tuple[float, float]]]:
        import mlflow

        run_id = self.run.info.run_id
        mlflow.end_run()
        client = mlflow.MlflowClient()
        out = {}
        for key in client.get_run(run_id).data.metrics:
            hist = client.get_metric_history(run_id, key)
            out[key] = [(m.timestamp / 1e3, float(m.value)) for m in hist]
        return out


class NvitopPeer(Peer):
    name = "nvitop"
    util_key = "gpu:0/gpu_utilization (%)"

    def start(self, tmp: Path) -> None:
        from nvitop import Device, ResourceMetricCollector

        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.collector = ResourceMetricCollector(Device.cuda.all(), interval=0.1)
        original = self.collector.take_snapshots

        def recording() -> Any:  # keep each snapshot with its time, as nvitop's thread takes it
            result = original()
            now = time.time()
            for snap in result.devices:
                idx = snap.index
                for attr, name in (("gpu_utilization", "gpu_utilization (%)"),
                                   ("power_usage", "power_usage (W)")):
                    value = getattr(snap, attr)
                    if isinstance(value, (int, float)):
                        scale = 1e3 if attr == "power_usage" else 1.0
                        self.samples.setdefault(f"gpu:{idx}/{name}", []).append(
                            (now, float(value) / scale))
            return result

        self.collector.take_snapshots = recording  # type: ignore[method-assign]
        self.collector.start(tag="fidelity")

    def stop(self) -> dict[str, list[tuple[float, float]]]:
        self.collector.stop()
        return self.samples


def start_peers(tmp: Path, wanted: list[str],
                quick: bool = False) -> tuple[list[Peer], dict[str, str]]:
    """Start each wanted peer that can run here; the others get a reason."""
    peers: list[Peer] = []
    skipped: dict[str, str] = {}
    for cls in (WandbPeer, MlflowPeer, NvitopPeer):
        if cls.name not in wanted:
            continue
        peer = cls(quick)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                peer.start(tmp)
            peers.append(peer)
        except Exception as exc:
            skipped[cls.name] = f"{type(exc).__name__}: {exc}"
            log(f"{cls.name} skipped: {exc!r}")
    return peers, skipped


# --- NVML reference ------------------------------------------------------------------------------


class EnergyCounter:
    """NVML's total-energy counter of one GPU, read on this thread (reference only)."""

    def __init__(self, uuid: str | None) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.h = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else None
        except pynvml.NVMLError:
            self.h = None
        if self.h is None:
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read_j(self) -> float:
        self.read_power()
        return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.h)) / 1e3

    power: list[tuple[float, float]]
    _since = 0

    def read_power(self) -> None:
        """Collect the driver's 20 ms power samples (unix s, W): a second reference, exact in
        time where the energy counter at the step edges can be up to ~100 ms stale."""
        if not hasattr(self, "power"):
            self.power = []
        try:
            _, got = self.nvml.nvmlDeviceGetSamples(self.h, 0, self._since)
        except self.nvml.NVMLError:
            return
        for s in got:
            if s.timeStamp > self._since:
                self.power.append((s.timeStamp / 1e6, s.sampleValue.uiVal / 1e3))
        if got:
            self._since = max(s.timeStamp for s in got)

    def power_integral_j(self, t0: float, t1: float) -> float | None:
        """Trapezoid integral of the power samples over [t0, t1] (unix s), None if uncovered.

        Each sample averages the 20 ms before its timestamp, so it is placed 10 ms earlier."""
        pts = sorted((t - 0.01, w) for t, w in getattr(self, "power", []))
        if len(pts) < 2 or pts[0][0] > t0 or pts[-1][0] < t1:
            return None

        def at(t: float) -> float:
            for (ta, wa), (tb, wb) in itertools.pairwise(pts):
                if ta <= t <= tb:
                    return wa + (wb - wa) * (t - ta) / (tb - ta) if tb > ta else wa
            return pts[-1][1]

        inner = [(t, w) for t, w in pts if t0 < t < t1]
        xs = [(t0, at(t0)), *inner, (t1, at(t1))]
        return sum((wa + wb) / 2 * (tb - ta) for (ta, wa), (tb, wb) in itertools.pairwise(xs))

    def close(self) -> None:
        self.nvml.nvmlShutdown()


# --- report --------------------------------------------------------------------------------------


def in_step(series: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """Values of the samples stamped inside [t0, t1)."""
    return [v for t, v in series if t0 <= t < t1]


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    """Run the alternating load with gpulens and the peers; print the per-step table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU, small products, simulated GPU")
    p.add_argument("--steps", type=int, default=None, help="steps (busy and idle alternate)")
    p.add_argument("--busy-ms", type=float, default=None)
    p.add_argument("--idle-ms", type=float, default=None)
    p.add_argument("--peers", default="wandb,mlflow,nvitop", help="comma list, or 'none'")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("mlflow", "wandb", "urllib3", "git"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
    steps = args.steps or (6 if args.quick else 24)
    busy_s = (args.busy_ms or (50 if args.quick else 300)) / 1e3
    idle_s = (args.idle_ms or (50 if args.quick else 300)) / 1e3

    import gpulens

    load = Load(args.quick, busy_s * 1e3)
    tmpdir = tempfile.TemporaryDirectory(prefix="gpulens-fidelity-")
    tmp = Path(tmpdir.name)
    wanted = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",")]
    peers, skipped = start_peers(tmp, wanted, args.quick)
    sink = Rows()
    mon = gpulens.Monitor(interval=0.1, sinks=[sink],
                          backend="simulated" if args.quick else None)
    mon.start()
    assert mon.context is not None
    backend = mon.context.backend
    gpu0 = mon.context.gpus[0] if mon.context.gpus else None
    energy: EnergyCounter | None = None
    energy_note = ""
    if backend == "nvml":
        try:
            energy = EnergyCounter(gpu0.uuid if gpu0 else None)
        except Exception as exc:
            energy_note = f"NVML energy counter unavailable: {exc!r}"
    else:
        energy_note = f"no NVML reference (backend {backend})"
    # peers' first samples, gpulens's first GPM read (a smoke run's simulated GPU has no GPM)
    time.sleep(0.3 if args.quick else 1.0)

    edges: list[float] = [time.time()]
    e_edges: list[float | None] = [energy.read_j() if energy else None]
    kinds: list[str] = []
    t_begin = time.time()
    mon.log(0)  # close the window before the first step: step 1 starts here
    for step in range(1, steps + 1):
        kind = "busy" if step % 2 == 1 else "idle"
        if kind == "busy":
            load.busy()
        else:
            load.idle(idle_s)
        edges.append(time.time())
        mon.log(step, busy=1.0 if kind == "busy" else 0.0)
        e_edges.append(energy.read_j() if energy else None)
        kinds.append(kind)
    time.sleep(0.2 if args.quick else 0.5)  # the peers' last samples
    if energy:
        energy.read_power()
    mon.stop()
    with contextlib.redirect_stdout(io.StringIO()):
        peer_series = {}
        for peer in peers:
            try:
                peer_series[peer.name] = peer.stop()
            except Exception as exc:
                skipped[peer.name] = f"read-back failed: {exc!r}"
    if energy:
        energy.close()
    log(f"{steps} steps in {time.time() - t_begin:.1f} s; {len(sink.rows)} gpulens rows")

    rows = {r.step: r.values for r in sink.rows}
    table_rows: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        step = i + 1
        t0, t1 = edges[i], edges[i + 1]
        v = rows.get(step, {})
        e0, e1 = e_edges[i], e_edges[i + 1]
        rec: dict[str, Any] = {
            "step": step, "kind": kind, "ms": (t1 - t0) * 1e3,
            "sm_active_pct": v.get("gpu/0/sm_active_pct"),
            "tensor_active_pct": v.get("gpu/0/tensor_active_pct"),
            "util_pct": v.get("gpu/0/util_pct"),
            "power_w": v.get("gpu/0/power_w"),
            "energy_j": v.get("gpu/0/energy_j"),
            "samples": v.get("gpu/0/samples"),
            "nvml_energy_j": (e1 - e0) if (e0 is not None and e1 is not None) else None,
            "power_int_j": energy.power_integral_j(t0, t1) if energy else None,
        }
        for peer in peers:
            series = peer_series.get(peer.name, {})
            key = peer.pick_util_key(series)
            any_key = key or next(iter(series), None)
            vals = in_step(series.get(any_key, []), t0, t1) if any_key else []
            rec[f"{peer.name}_n"] = len(vals)
            rec[f"{peer.name}_util"] = statistics.fmean(vals) if (vals and key) else None
        table_rows.append(rec)

    head = ("| step | kind | ms | gpulens sm_active % | tensor_active % | util % | power W "
            "| energy J | NVML energy J | power-integral J |"
            + "".join(f" {p.name} samples | {p.name} util % |" for p in peers))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table_rows:
        lines.append(
            f"| {r['step']} | {r['kind']} | {r['ms']:.0f} | {fmt(r['sm_active_pct'])} "
            f"| {fmt(r['tensor_active_pct'])} | {fmt(r['util_pct'])} | {fmt(r['power_w'])} "
            f"| {fmt(r['energy_j'], '.2f')} | {fmt(r['nvml_energy_j'], '.2f')} "
            f"| {fmt(r['power_int_j'], '.2f')} |"
            + "".join(f" {r[p.name + '_n']} | {fmt(r[p.name + '_util'])} |" for p in peers)
        )

    def mean_of(kind: str, key: str) -> float | None:
        vals = [r[key] for r in table_rows if r["kind"] == kind and r[key] is not None]
        return statistics.fmean(vals) if vals else None

    checks: list[tuple[str, bool | None, str]] = []
    sm_busy, sm_idle = mean_of("busy", "sm_active_pct"), mean_of("idle", "sm_active_pct")
    checks.append(("busy steps: gpulens sm_active_pct >= 80", None if sm_busy is None
                   else sm_busy >= 80, fmt(sm_busy)))
    checks.append(("idle steps: gpulens sm_active_pct <= 10", None if sm_idle is None
                   else sm_idle <= 10, fmt(sm_idle)))
    errs = [abs(r["energy_j"] - r["nvml_energy_j"]) / r["nvml_energy_j"] for r in table_rows
            if r["energy_j"] is not None and r["nvml_energy_j"] not in (None, 0)]
    tot_g = sum(r["energy_j"] for r in table_rows if r["energy_j"] is not None)
    tot_n = sum(r["nvml_energy_j"] for r in table_rows if r["nvml_energy_j"] is not None)
    checks.append(("per-step energy_j within 10 % of NVML counter (median error)",
                   None if not errs else statistics.median(errs) <= 0.10,
                   f"{100 * statistics.median(errs):.1f} %" if errs else energy_note or "-"))
    perrs = [abs(r["energy_j"] - r["power_int_j"]) / r["power_int_j"] for r in table_rows
             if r["energy_j"] is not None and r["power_int_j"] not in (None, 0)]
    # issue 11's targets: median per-step error against the power samples' integral <= 2 %,
    # the worst <= 10 %; the run's total against the counter <= 0.5 %
    checks.append(("per-step energy_j within 2 % of the 20 ms power samples' integral "
                   "(median error)", None if not perrs else statistics.median(perrs) <= 0.02,
                   f"{100 * statistics.median(perrs):.1f} %" if perrs else energy_note or "-"))
    checks.append(("per-step energy_j within 10 % of the 20 ms power samples' integral "
                   "(worst step)", None if not perrs else max(perrs) <= 0.10,
                   f"{100 * max(perrs):.1f} %" if perrs else energy_note or "-"))
    checks.append(("total energy gpulens / NVML counter within 0.5 %", None if not tot_n
                   else abs(tot_g / tot_n - 1) <= 0.005,
                   f"{tot_g:.1f} J / {tot_n:.1f} J ({100 * (tot_g / tot_n - 1):+.2f} %)"
                   if tot_n else "-"))
    for peer in peers:
        b = mean_of("busy", f"{peer.name}_util")
        i = mean_of("idle", f"{peer.name}_util")
        n = [r[f"{peer.name}_n"] for r in table_rows]
        checks.append((f"{peer.name}: mean util busy / idle steps; samples per step "
                       "[min, max]", None, f"{fmt(b)} / {fmt(i)}; [{min(n)}, {max(n)}]"))
    for name, why in skipped.items():
        checks.append((f"{name}: skipped", None, why))

    hw = gpu0.name if gpu0 else backend
    print(f"## fidelity: {hw} via {backend}; {steps} steps alternating {busy_s * 1e3:.0f} ms of "
          f"{load.n}^3 products ({load.tflops:.0f} TFLOP/s) and {idle_s * 1e3:.0f} ms idle; "
          f"monitors at 0.1 s")
    print()
    print("\n".join(lines))
    print()
    print("| check | result | value |")
    print("|---|---|---|")
    for what, ok, value in checks:
        verdict = "n/a" if ok is None else ("ok" if ok else "MISS")
        print(f"| {what} | {verdict} | {value} |")
    out = args.json or (Path(os.environ["OUT"]) / "fidelity.json" if os.environ.get("OUT")
                        else None)
    if out is not None:
        out.write_text(json.dumps({
            "backend": backend, "gpu": hw, "steps": table_rows,
            "checks": [{"check": c, "ok": ok, "value": v} for c, ok, v in checks],
            "peer_keys": {k: sorted(v) for k, v in peer_series.items()},
            "skipped": skipped,
        }, indent=2, default=str))
        log(f"wrote {out}")
    tmpdir.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
