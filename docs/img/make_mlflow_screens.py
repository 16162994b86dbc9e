"""Screenshots of the MLflow UI for docs/trackers.md: a real ``mlflow server`` on 127.0.0.1,
runs of a few steps on 2 and 8 simulated GPUs written by the ``mlflow`` sink, each run's
"Model metrics" page in headless Chromium.

    PYTHONPATH=src .venv/bin/python docs/img/make_mlflow_screens.py [OUT_DIR]

Writes ``mlflow-{2,8}gpu-default.png`` (the tracker view, ``keys="default"``) and
``mlflow-2gpu-all.png`` (every key, ``keys="all"``: what the sink wrote before the view), and
prints the section headings of each page in the order the UI shows them.  Runs from the
repository root (it uses ``tests/support``'s server and browser helpers); loopback only.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.chromium import Chromium
from tests.support.mlflow_server import start_mlflow_server

SECTION_TITLES = """[...document.querySelectorAll('div')].filter(
    e => /^[\\w\\/ .-]+\\s*\\(\\d+\\)$/.test((e.innerText || '').trim()))"""
SECTIONS_JS = SECTION_TITLES + ".map(e => e.innerText.trim().replace(/\\s+/g, ' '))"
"""The section headings of a run's "Model metrics" page, in the order shown ("train (11)")."""
COLLAPSE_JS = SECTION_TITLES + ".map(e => e.click()).length"
"""Click every section heading (each accordion closes)."""

CLOSE_ASSISTANT_JS = """
(() => { const b = document.querySelector('button[aria-label="Close"]'); if (b) b.click();
         return !!b; })()
"""
"""Close MLflow's assistant side panel (more room for the charts)."""


def log_run(uri: str, gpus: int, keys: str) -> tuple[str, str]:
    """A run of 12 steps through gpulens's mlflow sink; its (experiment id, run id)."""
    import mlflow

    import gpulens
    from gpulens.testing import SimulatedNVML

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("gpulens-tracker-view")
    with mlflow.start_run(run_name=f"{gpus} GPUs, keys={keys}") as run, gpulens.Monitor(
            interval=0.05, sinks=["mlflow:all" if keys == "all" else "mlflow"],
            backend=SimulatedNVML(gpus=gpus), dtype="bf16", flops_per_token=6e9) as mon:
        for step in range(1, 13):
            time.sleep(0.08)
            mon.log(step, loss=4.0 / step ** 0.5, learning_rate=1e-3 * (1 - step / 24),
                    grad_norm=1.0 / step,
                    tokens=16_384)
    return run.info.experiment_id, run.info.run_id


def _shrink(path: Path) -> None:
    """256 colours: a chart screenshot loses nothing you can see, the file most of its size
    (Pillow, if installed)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    root = Path(tempfile.mkdtemp(prefix="gpulens-screens-"))
    server = start_mlflow_server(root)
    try:
        shots = [(2, "default"), (8, "default"), (2, "all")]
        runs = [(g, k, *log_run(server.uri, g, k)) for g, k in shots]
        with Chromium(timeout=60) as browser:
            for gpus, keys, exp, run in runs:
                url = f"{server.uri}/#/experiments/{exp}/runs/{run}/model-metrics"
                page = browser.open(url, width=1280, height=860 if keys == "all" else 1220)
                page.wait_for("document.querySelectorAll('canvas, svg.main-svg').length > 3",
                              timeout=90)
                time.sleep(3.0)  # the charts draw their lines
                page.evaluate(CLOSE_ASSISTANT_JS)
                sections = page.evaluate(SECTIONS_JS)
                if keys == "all":  # collapsed: the sections the user scrolls through
                    page.evaluate(COLLAPSE_JS)
                time.sleep(1.0)
                path = out / f"mlflow-{gpus}gpu-{keys}.png"
                page.screenshot(path, full_page=False)
                _shrink(path)
                print(f"{path.name}: sections in order: {sections}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
