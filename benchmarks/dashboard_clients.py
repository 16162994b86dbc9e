"""CPU cost of the live dashboard's server with pages connected, and the bounds of its history.

The server (``gpulens.dashboard.DashboardServer``, what the ``dashboard:PORT`` sink runs) lives
in a process of its own here, as it does in the engine process, and gets rows at ``--rate``
rows per second: rows shaped like a real monitor's (taken from a ``gpulens.Monitor`` run on
``--gpus`` simulated GPUs, with loss, learning rate and gradient norm), one step after another.
Then:

(a) its CPU time (user + system, all threads, from ``/proc``) over ``--seconds`` with no page
    connected (receiving, encoding and keeping the rows), and again with ``--clients`` pages
    connected to ``/events`` (each a thread of this process reading and decoding the stream as
    the page's JavaScript does; the browser's own drawing is the browser's CPU, not the
    server's), as % of one core.  Target: under 5 % of a core with 10 pages at 10 rows/s.
(b) how long a row takes from ``publish`` to a page: the row's ``time`` (stamped when it is
    published) against the page's clock when it decoded it, median / p99 / max; whether every
    page got every row, and how many were disconnected as slow.
(c) the history's memory: the encoded size of a row (``sys.getsizeof`` of the kept text) with
    1 and with ``--gpus`` GPUs, and so a full history (8192 rows); what ``publish`` costs the
    delivery thread per row.

Prints Markdown tables, asserts nothing about timings (the test suite runs ``--quick``).

    python benchmarks/dashboard_clients.py               # 10 pages, 10 rows/s, 8 GPUs, ~70 s
    python benchmarks/dashboard_clients.py --quick       # a few seconds
    python benchmarks/dashboard_clients.py --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FULL_HISTORY = 8192


def _gpulens_on_path() -> None:
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def pct(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


# -- a realistic row ---------------------------------------------------------------------------
def make_template(gpus: int) -> dict[str, Any]:
    """A finished row of a real monitor on ``gpus`` simulated GPUs, and its context."""
    _gpulens_on_path()
    import gpulens
    from gpulens.testing import MemorySink, SimulatedNVML

    rows = MemorySink()
    mon = gpulens.Monitor(backend=SimulatedNVML(gpus=gpus), interval=0.05, sinks=[rows],
                          isolation="thread")
    mon.start()
    try:
        for step in range(1, 4):
            time.sleep(0.1)
            mon.log(step, loss=2.5, learning_rate=3e-4, grad_norm=0.8)
        deadline = time.monotonic() + 20
        while len(rows.rows) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        mon.stop()
    ctx = mon.context
    assert ctx is not None and rows.rows, "the simulated monitor gave no row"
    return {
        "values": dict(rows.rows[-1].values),
        "context": {"hostname": ctx.hostname, "backend": ctx.backend, "interval": ctx.interval,
                    "gpus": [vars(g) for g in ctx.gpus]},
    }


def context_of(template: dict[str, Any]) -> Any:
    from gpulens.model import GpuInfo, RunContext

    c = template["context"]
    return RunContext(gpus=tuple(GpuInfo(**g) for g in c["gpus"]), hostname=c["hostname"],
                      backend=c["backend"], interval=c["interval"])


def row_at(template: dict[str, Any], step: int) -> Any:
    """The template's row at ``step``, stamped now, with the training figures moving."""
    from gpulens.model import Row

    values = dict(template["values"])
    values["train/global_step"] = float(step)
    values["train/loss"] = 2.5 / (1 + step / 500)
    values["train/grad_norm"] = 0.8 + 0.1 * ((step * 7919) % 13) / 13
    return Row(step=step, time=time.time(), values=values)


# -- the server's process ----------------------------------------------------------------------
def child(template_path: str, rate: float) -> int:
    """Serve on a free port, publish ``rate`` rows a second until 'stop' comes on stdin."""
    _gpulens_on_path()
    from gpulens.dashboard import DashboardServer

    template = json.loads(Path(template_path).read_text())
    server = DashboardServer(port=0, title="dashboard_clients benchmark")
    server.start(context_of(template))
    print(f"PORT {server.port} KEYS {len(template['values'])}", flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    step, next_t = 0, time.monotonic()
    while not stop.is_set():
        step += 1
        server.publish(row_at(template, step))
        next_t += 1.0 / rate
        stop.wait(max(0.0, next_t - time.monotonic()))
    stats = server.stats
    server.close()
    print(json.dumps({"published": step, **vars(stats)}), flush=True)
    return 0


# -- a page ------------------------------------------------------------------------------------
class Page(threading.Thread):
    """Reads ``/events`` as the page does: decodes every message, times every live row."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.ready = threading.Event()
        self.measuring = False
        self.latencies: list[float] = []
        self.steps: list[int] = []
        self.error: str | None = None
        self._conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        try:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self._conn.request("GET", "/events")
            resp = self._conn.getresponse()
            kind, data = "", []
            history_done = False
            while True:
                line = resp.readline()
                if not line:
                    return
                text = line.decode().rstrip("\n")
                if text.startswith("event: "):
                    kind = text[7:]
                elif text.startswith("data: "):
                    data.append(text[6:])
                elif not text and data:
                    payload = json.loads("".join(data))
                    now = time.time()
                    data = []
                    if kind == "rows" and history_done:
                        for r in payload:
                            if self.measuring:
                                self.latencies.append(now - r[1])
                                self.steps.append(r[0])
                    elif kind == "hello":
                        history_done = True  # history rows follow at once; live ones after
                        self.ready.set()
        except OSError as exc:
            self.error = repr(exc)
        finally:
            self.ready.set()

    def close(self) -> None:
        if self._conn is not None and self._conn.sock is not None:
            self._conn.sock.shutdown(2)


def measure(port: int, pid: int, seconds: float) -> float:
    """% of one core that ``pid`` used over ``seconds``."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def bench_clients(template_path: Path, clients: int, rate: float, seconds: float,
                  warmup: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(template_path),
                             "--rate", str(rate)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        first = proc.stdout.readline().split()
        port, keys = int(first[1]), int(first[3])
        time.sleep(warmup)
        idle = measure(port, proc.pid, seconds)
        pages = [Page(port) for _ in range(clients)]
        for p in pages:
            p.start()
        for p in pages:
            p.ready.wait(30)
        time.sleep(warmup)
        for p in pages:
            p.measuring = True
        busy = measure(port, proc.pid, seconds)
        for p in pages:
            p.measuring = False
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
        proc.wait(30)
        for p in pages:
            p.close()
            p.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lat = [x for p in pages for x in p.latencies]
    complete = all(p.steps == list(range(p.steps[0], p.steps[0] + len(p.steps)))
                   for p in pages if p.steps)
    return {
        "clients": clients, "rate": rate, "seconds": seconds, "keys_per_row": keys,
        "cpu_idle_pct": idle, "cpu_clients_pct": busy, "cpu_added_pct": busy - idle,
        "latency_median_ms": 1e3 * statistics.median(lat) if lat else None,
        "latency_p99_ms": 1e3 * pct(lat, 0.99) if lat else None,
        "latency_max_ms": 1e3 * max(lat) if lat else None,
        "rows_per_page": [len(p.steps) for p in pages],
        "every_page_every_row": complete and all(p.steps for p in pages),
        "page_errors": [p.error for p in pages if p.error],
        "server": stats,
    }


# -- the history -------------------------------------------------------------------------------
def one_gpu(values: dict[str, float]) -> dict[str, float]:
    """The row of GPU 0 alone (no other GPU, no job aggregates)."""
    return {k: v for k, v in values.items()
            if not (k.startswith("gpu/") and not k.startswith("gpu/0/"))}


def bench_history(template: dict[str, Any], rows: int) -> dict[str, Any]:
    _gpulens_on_path()
    from gpulens.dashboard import DashboardServer

    out: dict[str, Any] = {}
    for name, values in (("1 GPU", one_gpu(template["values"])),
                         (f"{len(template['context']['gpus'])} GPUs", template["values"])):
        t = {"values": values}
        server = DashboardServer(port=0, history_rows=FULL_HISTORY)  # never bound: no socket
        costs = []
        for step in range(1, rows + 1):
            row = row_at(t, step)
            t0 = time.perf_counter()
            server.publish(row)
            costs.append(time.perf_counter() - t0)
        per_row = server.history_bytes() / rows
        out[name] = {"keys": len(values), "bytes_per_row": per_row,
                     "full_history_mb": per_row * FULL_HISTORY / 1e6,
                     "publish_median_us": 1e6 * statistics.median(costs),
                     "publish_p99_us": 1e6 * pct(costs, 0.99)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", metavar="TEMPLATE", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, default=10, help="pages connected (10)")
    ap.add_argument("--rate", type=float, default=10.0, help="rows per second (10)")
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs in a row (8)")
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="length of each CPU measurement (30)")
    ap.add_argument("--quick", action="store_true", help="1 s measurements: a smoke test")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.rate)
    seconds = 1.0 if args.quick else args.seconds
    warmup = 0.3 if args.quick else 3.0
    template = make_template(args.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "template.json"
        path.write_text(json.dumps(template))
        c = bench_clients(path, args.clients, args.rate, seconds, warmup)
    h = bench_history(template, 500 if args.quick else FULL_HISTORY)

    print(f"# dashboard server: {args.clients} pages, {args.rate:g} rows/s, rows of "
          f"{args.gpus} simulated GPUs ({c['keys_per_row']} keys), {seconds:g} s each\n")
    print("| figure | value |")
    print("|---|---|")
    print(f"| server CPU, no page connected | {c['cpu_idle_pct']:.2f} % of a core |")
    print(f"| server CPU, {args.clients} pages connected | {c['cpu_clients_pct']:.2f} % of a "
          f"core |")
    print(f"| added by {args.clients} pages | {c['cpu_added_pct']:.2f} % of a core |")
    if c["latency_median_ms"] is not None:
        print(f"| publish to page, median / p99 / max | {c['latency_median_ms']:.1f} / "
              f"{c['latency_p99_ms']:.1f} / {c['latency_max_ms']:.1f} ms |")
    rows = c["rows_per_page"]
    print(f"| live rows each page got in the window | {min(rows)}-{max(rows)}, "
          f"{'none missing' if c['every_page_every_row'] else 'SOME MISSING'} |")
    s = c["server"]
    print(f"| pages disconnected as slow / refused | {s['clients_dropped_slow']} / "
          f"{s['clients_refused']} |")
    print()
    print("| history | keys a row | bytes a row | full history (8192 rows) | publish, "
          "median / p99 |")
    print("|---|---|---|---|---|")
    for name, f in h.items():
        print(f"| {name} | {f['keys']} | {f['bytes_per_row']:.0f} | "
              f"{f['full_history_mb']:.1f} MB | {f['publish_median_us']:.0f} / "
              f"{f['publish_p99_us']:.0f} us |")
    if args.json:
        meta = {"python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "quick": args.quick,
                "load_avg_1min": os.getloadavg()[0]}
        Path(args.json).write_text(json.dumps({"meta": meta, "clients": c, "history": h},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
