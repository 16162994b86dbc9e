"""Screenshots for the README: the HTML report of a JSONL record, and the live dashboard of a
short training on simulated GPUs, each in headless Chromium.

    PYTHONPATH=src .venv/bin/python docs/img/make_screens.py [--record FILE] [OUT_DIR]

Writes to OUT_DIR (default: this folder):

* ``report.png``: the top of ``gpulens report FILE`` (default ``demo-output/gpu.jsonl``, what
  ``make demo`` writes);
* ``dashboard.png``: the page of a ``dashboard:0`` sink while a tiny GPT-2 (built from a config
  in code, learning a fixed permutation of random tokens) trains on the CPU for 80 steps, 2
  simulated GPUs.

Runs from the repository root (it uses ``tests/support``'s browser helper); loopback only.  The
MLflow pictures come from ``make_mlflow_screens.py`` beside this script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.chromium import Chromium

STEPS = 80


def _shrink(path: Path) -> None:
    """256 colours: a chart screenshot loses nothing you can see, the file most of its size."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def report_shot(browser: Chromium, record: Path, out: Path) -> Path:
    """The top of the report of ``record``, 1280 px wide."""
    from gpulens.cli import main

    html = Path(tempfile.mkdtemp(prefix="gpulens-screens-")) / "report.html"
    if main(["report", str(record), "-o", str(html)]) != 0:
        raise SystemExit(f"gpulens report {record} failed")
    page = browser.open(html.as_uri(), width=1280, height=1500)
    page.wait_for("document.readyState === 'complete' && "
                  "document.querySelectorAll('svg polyline').length > 4")
    path = page.screenshot(out / "report.png", full_page=False)
    _shrink(path)
    return path


def dashboard_shot(browser: Chromium, out: Path) -> Path:
    """The live page of a training run's ``dashboard`` sink, 1400 px wide, after STEPS rows."""
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    import gpulens
    from gpulens.sinks.dashboard import DashboardSink
    from gpulens.testing import SimulatedNVML, Wave
    from gpulens.work.hf import model_flops

    torch.manual_seed(0)
    vocab, seq, batch = 256, 32, 8
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=seq, bos_token_id=vocab - 1,
                                       eos_token_id=vocab - 1))
    formula = model_flops(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    perm = torch.randperm(vocab)
    sink = DashboardSink(port=0, title="gpulens · GPT-2 (tiny) on 2 simulated GPUs")
    backend = SimulatedNVML(gpus=2, load=Wave(mean=0.8, amplitude=0.15))
    with gpulens.Monitor(interval=0.1, sinks=[sink], backend=backend, dtype="fp32",
                         flops_per_token=formula.flops_per_token(seq) if formula else None
                         ) as mon:
        deadline = time.monotonic() + 60
        while sink.server is None:  # the sink opens on a thread of its own
            if time.monotonic() > deadline:
                raise SystemExit("the dashboard sink did not open within 60 s")
            time.sleep(0.05)
        page = browser.open(sink.url, width=1400, height=1050)
        for step in range(1, STEPS + 1):
            x = torch.randint(0, vocab, (batch, seq))
            logits = model(input_ids=x).logits
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), perm[x].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            mon.log(step, tokens=batch * seq, loss=loss.detach(),
                    learning_rate=sched.get_last_lr()[0], grad_norm=grad_norm.detach())
        page.wait_for(f"document.body.dataset.lastStep === '{STEPS}'", timeout=60)
        time.sleep(0.5)  # the last drawing
        path = page.screenshot(out / "dashboard.png", full_page=False)
    _shrink(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=str(Path(__file__).parent))
    ap.add_argument("--record", default="demo-output/gpu.jsonl")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Chromium(timeout=60) as browser:
        for path in (report_shot(browser, Path(args.record), out), dashboard_shot(browser, out)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
