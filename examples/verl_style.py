"""A verl-style trainer: one ``logger.log(data=metrics, step=global_step)`` per step, with the GPU
keys merged into that same call (so W&B, whose step *is* ``global_step`` here, gets one record per
step and its step is never pushed twice).

    python examples/verl_style.py +trainer.enable_gpu_monitoring=true
    WANDB_MODE=offline python examples/verl_style.py +trainer.enable_gpu_monitoring=true \\
        'trainer.logger=[console,wandb]'

``Tracking`` below mirrors ``verl.utils.tracking.Tracking`` (console and W&B backends:
``wandb.log(data=data, step=step)``). The only gpulens line is the ``MergingLogger`` around it.
Without a GPU the monitor samples simulated GPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from gpulens.integrations.verl import MergingLogger

if not torch.cuda.is_available():
    os.environ.setdefault("GPULENS_BACKEND", "simulated")
    # one simulated GPU per process of the node (torchrun sets LOCAL_WORLD_SIZE)
    os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))


class Tracking:
    """What verl's tracking object does with ``log(data, step)`` for these backends."""

    def __init__(self, project_name: str, experiment_name: str, default_backend: list[str],
                 config: dict[str, Any]) -> None:
        self.backends = list(default_backend)
        self.wandb: Any = None
        if "wandb" in self.backends:
            import wandb

            wandb.init(project=project_name, name=experiment_name, config=config)
            self.wandb = wandb

    def log(self, data: dict[str, Any], step: int) -> None:
        if self.wandb is not None:
            self.wandb.log(data=data, step=step)
        if "console" in self.backends:
            shown = {k: round(v, 4) for k, v in data.items()
                     if k.startswith(("actor/", "perf/")) or k == "gpu/0/util_pct"}
            print(f"step:{step} - {shown}")

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


@hydra.main(version_base=None, config_path="verl_conf", config_name="ppo_trainer")
def main(cfg: DictConfig) -> None:
    tracking = Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name,
                        list(cfg.trainer.logger),
                        config=OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    logger = MergingLogger.from_config(tracking, cfg)
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(actor.parameters(), lr=cfg.actor.lr)
    for global_step in range(1, cfg.trainer.total_training_steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(cfg.data.batch_size, 16)
        loss = nn.functional.mse_loss(actor(x).squeeze(-1), x[:, :4].sum(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics = {"actor/loss": loss.item(), "actor/lr": cfg.actor.lr,
                   "timing_s/step": time.perf_counter() - t0}
        logger.log(data=metrics, step=global_step)
    logger.close()  # stops the monitor and forwards the calls still waiting for their rows
    tracking.finish()


if __name__ == "__main__":
    main()
