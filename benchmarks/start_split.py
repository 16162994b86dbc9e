"""Where ``Monitor.start()`` spends its time on this host (issue 18: start on the training
thread at most 0.5 s).

Three arms, ``--repeat`` times each, in a rotated order, each with a JSONL sink:

* ``spawned`` (``isolation="process"``, the default's choice, no spare): ``start()`` and
  ``stop()`` on the calling thread, s;
* ``spare``: the same, with a spare engine process prepared ``--spare-lead-s`` before
  ``start()`` (what the Hugging Face and Lightning callbacks do while the framework sets
  training up: :mod:`gpulens.transport.spawn`);
* ``thread`` (``isolation="thread"``: the engine in the calling process): ``start()`` under
  ``cProfile``, and the time inside each of the engine's start phases (the NVML source's open,
  each GPU's device and info, the sinks' open, the sampler's start: with its whole first
  sample up to `c9dacee`, since then its first GPM sample only, the rest in the sampler
  thread), s.

With ``--hf N``: N tiny Hugging Face ``Trainer`` runs a way (on the GPU where there is one),
timing the gpulens callback's ``on_train_begin`` (where it starts its monitor), with the
spare the callback prepares at ``on_init_end`` and with that preparation turned off.

The spawned arm's ``start()`` less the thread arm's is about the engine process's spawn and
imports; a third table splits that: a fresh interpreter with the engine's environment
(``python -c pass``), the same importing what the engine process imports, and that import's
slowest modules (``-X importtime``, cumulative). Prints Markdown; ``--json`` writes every
figure and the thread arm's top functions.

    python benchmarks/start_split.py --repeat 5 --json $OUT/start_split.json   # a GPU host
    GPULENS_BACKEND=simulated python benchmarks/start_split.py --repeat 2      # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = {
    "nvml open": ("gpulens/engine/engine.py", "_open_source"),
    "GPUs chosen": ("gpulens/engine/engine.py", "_choose_gpus"),
    "sinks open": ("gpulens/sinks/writer.py", "open"),
    "sampler start": ("gpulens/engine/sampler.py", "start"),
    "engine start (all)": ("gpulens/engine/engine.py", "start"),
}
"""Phase -> (file suffix, function name) in the profile; cumulative seconds."""


def phases(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each of :data:`PHASES` in a profile (absent: not called)."""
    out: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for label, (suffix, name) in PHASES.items():
        spent = [v[3] for (file, _, func), v in raw.items()
                 if func == name and file.replace("\\", "/").endswith(suffix)]
        if spent:
            out[label] = max(spent)
    return out


def one(isolation: str, folder: Path, profile: bool, spare_lead_s: float = 0.0
        ) -> dict[str, Any]:
    import gpulens
    from gpulens.transport import spawn

    if isolation == "spare":
        assert spawn.prepare(), "no spare engine process could be spawned"
        time.sleep(spare_lead_s)

    mon = gpulens.Monitor(sinks=[f"jsonl:{folder / 'rows.jsonl'}"],
                          isolation="thread" if isolation == "thread" else "process")
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    mon.start()
    if prof is not None:
        prof.disable()
    start_s = time.perf_counter() - t0
    mon.log(1)
    t1 = time.perf_counter()
    mon.stop()
    out: dict[str, Any] = {"start_s": start_s, "stop_s": time.perf_counter() - t1}
    if prof is not None:
        stats = pstats.Stats(prof)
        out["phases_s"] = phases(stats)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        out["top"] = text.getvalue()
    return out


ENGINE_IMPORTS = "import gpulens.transport.child, gpulens.engine.engine"
"""What the engine process imports before it builds the engine (its bootstrap, then the
engine module it imports first)."""


def fresh(code: str, env: dict[str, str]) -> float:
    """Seconds for a fresh interpreter (this one's executable) to run ``code`` and exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t0


def slowest_imports(env: dict[str, str], top: int = 8) -> list[tuple[str, float]]:
    """The ``top`` modules by cumulative import time (s) of :data:`ENGINE_IMPORTS` in a fresh
    interpreter (``-X importtime``)."""
    got = subprocess.run([sys.executable, "-X", "importtime", "-c", ENGINE_IMPORTS], env=env,
                         check=True, capture_output=True, text=True).stderr
    rows: list[tuple[str, float]] = []
    for line in got.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((parts[2].rstrip(), int(parts[1]) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def hf_begin(spare: bool, folder: Path, entries: list[float] | None = None) -> float:
    """Seconds of the gpulens callback's ``on_train_begin`` in a tiny ``Trainer`` run (a
    linear model, 4 steps); ``spare=False``: the callback prepares no spare; ``entries``
    gets the wall-clock time (``time.time()``, s) the hook was entered."""
    import torch
    import transformers

    from gpulens.integrations.transformers import GPUMonitorCallback

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}

    class Points(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x = torch.full((8,), float(i % 7))
            return {"x": x, "labels": x.sum()}

    callback = GPUMonitorCallback(sinks=[f"jsonl:{folder / 'rows.jsonl'}"])
    if not spare:  # its on_init_end spawns the spare, and does nothing else
        callback.on_init_end = lambda *a, **kw: None  # type: ignore[method-assign]
    spent: list[float] = []
    begin = callback.on_train_begin

    def timed(*a: Any, **kw: Any) -> None:
        if entries is not None:
            entries.append(time.time())
        t0 = time.perf_counter()
        begin(*a, **kw)
        spent.append(time.perf_counter() - t0)

    callback.on_train_begin = timed  # type: ignore[method-assign]
    args = transformers.TrainingArguments(
        output_dir=str(folder / "out"), max_steps=4, logging_steps=2,
        per_device_train_batch_size=8, report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its logs
        transformers.Trainer(model=Linear(), args=args, train_dataset=Points(),
                             callbacks=[callback]).train()
    (got,) = spent
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--spare-lead-s", type=float, default=1.0,
                    help="how long before start() the spare arm prepares its spare (s)")
    ap.add_argument("--hf", type=int, default=0, metavar="N",
                    help="N tiny HF Trainer runs a way: on_train_begin with and without the "
                         "spare")
    args = ap.parse_args(argv)
    arms = ["spawned", "spare", "thread"]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for arm in arms[i % 3:] + arms[:i % 3]:
                folder = Path(tmp) / f"{arm}{i}"
                folder.mkdir()
                runs[arm].append(one(arm, folder, profile=arm == "thread",
                                     spare_lead_s=args.spare_lead_s))
        hf: dict[str, list[float]] = {"with the spare": [], "without": []}
        for i in range(args.hf):
            for way in ("with the spare", "without") if i % 2 == 0 else ("without",
                                                                          "with the spare"):
                folder = Path(tmp) / f"hf{i}{'s' if way == 'with the spare' else 'n'}"
                folder.mkdir()
                hf[way].append(hf_begin(way == "with the spare", folder))
    lines = [f"spare arm: prepared {args.spare_lead_s:g} s before start()", "",
             "| arm | start() s, each | median | stop() s, median |", "|---|---|---|---|"]
    for arm, got in runs.items():
        starts = [r["start_s"] for r in got]
        lines.append(f"| {arm} | {', '.join(f'{s:.3f}' for s in starts)} | "
                     f"{statistics.median(starts):.3f} | "
                     f"{statistics.median(r['stop_s'] for r in got):.3f} |")
    labels = [p for p in PHASES if any(p in r.get("phases_s", {}) for r in runs["thread"])]
    medians = [statistics.median(r["phases_s"].get(p, 0.0) for r in runs["thread"])
               for p in labels]
    lines += ["", "Inside the thread arm's `start()` (median over its runs, s):", "",
              "| " + " | ".join(labels) + " |", "|" + "---|" * len(labels),
              "| " + " | ".join(f"{m:.3f}" for m in medians) + " |"]
    from gpulens.transport.spawn import child_env

    env = child_env()
    procs = {"python -c pass": [fresh("pass", env) for _ in range(args.repeat)],
             "the engine's imports": [fresh(ENGINE_IMPORTS, env) for _ in range(args.repeat)]}
    imports = slowest_imports(env)
    lines += ["", "A fresh interpreter, as the engine process starts (s, each and median):", "",
              "| what | each | median |", "|---|---|---|"]
    lines += [f"| {what} | {', '.join(f'{s:.3f}' for s in got)} | "
              f"{statistics.median(got):.3f} |" for what, got in procs.items()]
    lines += ["", "Its slowest imports (cumulative s, one run): "
              + ", ".join(f"`{name.strip()}` {s:.3f}" for name, s in imports)]
    if args.hf:
        lines += ["", "The HF callback's `on_train_begin` in a tiny Trainer run (s):", "",
                  "| way | each | median |", "|---|---|---|"]
        lines += [f"| {way} | {', '.join(f'{s:.3f}' for s in got)} | "
                  f"{statistics.median(got):.3f} |" for way, got in hf.items()]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({**runs, "fresh_s": procs, "imports_s": imports,
                                         "hf_on_train_begin_s": hf}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
