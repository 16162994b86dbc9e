"""Do gpulens's rows reach a W&B run written from the engine process? Read the run file back.

Runs ``examples/hf_trainer.py --report-to wandb`` (a two-layer GPT-2 on random tokens; on a
GPU when there is one) into an offline W&B run, logging every step, then reads the run's own
file (``tests/support/wandb_reader.py``) and prints, as JSON: the steps HF logged its loss
at, the ``gpulens/step`` of every gpulens row, how many rows shared a record with HF's loss
(placed while training, not left for the end), whether W&B's ``_step`` only counted commits,
the run config's ``gpulens`` entry (GPUs, backend) and the process that wrote the rows (the
engine, not the training process: a spy on ``Run.log`` in the training process counts
gpulens rows logged there).

    python benchmarks/wandb_engine_check.py --max-steps 40   # $OUT/wandb_engine_check.json

Exit status 1 when a check fails (each is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.wandb_reader
sys.path.insert(0, str(ROOT / "examples"))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", "."))
                   / "wandb_engine_check.json")
    args = p.parse_args()
    wandb_dir = Path(tempfile.mkdtemp(prefix="gpulens-wandb-check-"))
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true",
                      WANDB_PROJECT="gpulens-check")

    from wandb.sdk.wandb_run import Run

    here: list[int] = []
    real_log = Run.log

    def spy(self: Any, data: dict[str, Any], *a: Any, **kw: Any) -> Any:
        if "gpulens/step" in data:
            here.append(int(data["gpulens/step"]))
        return real_log(self, data, *a, **kw)

    Run.log = spy  # type: ignore[method-assign]
    import hf_trainer

    hf_trainer.main(["--report-to", "wandb", "--max-steps", str(args.max_steps),
                     "--logging-steps", "1"])
    import wandb

    wandb.finish()
    from tests.support.wandb_reader import read_config, read_history, wait_for_finished_run

    path = wait_for_finished_run(wandb_dir)
    history = read_history(path)
    loss_steps = [int(h["train/global_step"]) for h in history if "train/loss" in h]
    rows = [h for h in history if "gpulens/step" in h]
    config = read_config(path).get("gpulens", {})
    out = {
        "cuda": __import__("torch").cuda.is_available(),
        "hf_loss_steps": loss_steps,
        "gpulens_steps": [int(h["gpulens/step"]) for h in rows],
        "rows_in_a_loss_record": sum(1 for h in rows if "train/loss" in h),
        "w_and_b_steps_contiguous": [h["_step"] for h in history] == list(range(len(history))),
        "rows_logged_by_the_training_process": len(here),
        "config": {k: config.get(k) for k in ("backend", "gpus", "gpu_count", "hostname")},
        "run_file": str(path),
    }
    checks = {
        "every HF step has its row": out["gpulens_steps"] == loss_steps,
        "rows written from the engine": not here,
        "W&B's step only counts commits": out["w_and_b_steps_contiguous"],
        "the run config names the backend": bool(config.get("backend")),
    }
    out["checks"] = checks
    text = json.dumps(out, indent=1)
    print(text)
    args.json.write_text(text + "\n")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
