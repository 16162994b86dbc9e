"""A Hydra app with GPU monitoring switched on from the command line (see conf/config.yaml).

``gpulens.from_config(cfg)`` returns ``None`` unless ``trainer.enable_gpu_monitoring`` is true
(or the ``gpu_monitor`` config group is chosen); then a ``Monitor`` whose rows go to the sinks of
``trainer.gpu_monitor_sinks``, by default ``gpulens.jsonl`` in the run's output folder. A small
MLP is trained on random data; without a GPU the monitor samples simulated GPUs.

Everything goes under the Hydra run dir (``outputs/hydra_app/<time>/``; ``GPULENS_EXAMPLE_OUT``
replaces ``outputs``): the job runs inside it (``hydra.job.chdir``), so relative sink paths land
there too.  ``outputs/`` and ``multirun/`` are ignored by git and removed by ``make clean``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn

import gpulens

if not torch.cuda.is_available():
    os.environ.setdefault("GPULENS_BACKEND", "simulated")
    # one simulated GPU per process of the node (torchrun sets LOCAL_WORLD_SIZE)
    os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    monitor = gpulens.from_config(cfg, default_sinks=[f"jsonl:{out / 'gpulens.jsonl'}"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.trainer.lr)
    with monitor if monitor is not None else contextlib.nullcontext():
        for step in range(1, cfg.trainer.max_steps + 1):
            x = torch.randn(cfg.trainer.batch_size, 16)
            loss = nn.functional.mse_loss(model(x).squeeze(-1), x[:, :4].sum(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % cfg.trainer.log_every == 0:
                print(f"step {step} loss {loss.item():.4f}")
                if monitor is not None:
                    monitor.log(step, loss=loss.item(), learning_rate=cfg.trainer.lr)
    if monitor is not None:
        print(f"gpulens: monitored {len(monitor.context.gpus) if monitor.context else 0} GPU(s);"
              f" sinks: {', '.join(monitor.sink_stats)}; output: {out}")
    else:
        print("gpulens: off (add +trainer.enable_gpu_monitoring=true)")


if __name__ == "__main__":
    main()
