"""What the W&B sink's rows cost the training process's threads, on a CPU (third session).

Runs ``benchmarks/callback_cost.py --groups hf_wandb`` (HF Trainer into an offline W&B run,
simulated GPUs) with the sink as it is (``base``), without the hidden per-GPU detail keys
(``nodetail``: the layout's split keeps only the shown keys), or without the sink's question to
W&B's core after each row (``noround``: ``_held_by`` returns its guess). The variants patch the
sink in this benchmark process only; gpulens is unchanged.

    PYTHONPATH=src OMP_NUM_THREADS=1 \
        python benchmarks/results/2026-11-27-cpu-wandb-row-cost/run.py VARIANT GPUS
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
os.environ.setdefault("GPULENS_BACKEND", "simulated")
variant, gpus = sys.argv[1], sys.argv[2]
os.environ["GPULENS_SIMULATED_GPUS"] = gpus
if variant == "nodetail":
    from gpulens.sinks import layout

    split = layout.TrackerLayout.split
    layout.TrackerLayout.split = lambda self, values: (split(self, values)[0], {})
elif variant == "noround":
    from gpulens.sinks import wandb

    wandb.WandbSink._held_by = lambda self, guess: guess
import callback_cost  # noqa: E402

sys.argv = ["callback_cost.py", "--groups", "hf_wandb", "--rounds", "3", "--steps", "40"]
callback_cost.main()
