"""A verl-style trainer: one ``logger.log(data=metrics, step=global_step)`` per step. gpulens
passes each call on at once and sends the GPU row of that step after it, at the same step, to
the trackers only (W&B, whose step *is* ``global_step`` here, gets one record per step and its
step is never pushed; the console line stays short).

    python examples/verl_style.py +trainer.enable_gpu_monitoring=true
    WANDB_MODE=offline python examples/verl_style.py +trainer.enable_gpu_monitoring=true \\
        'trainer.logger=[console,wandb]'

``Tracking`` below behaves like ``verl.utils.tracking.Tracking`` for these backends: a
``logger`` dict of backends, ``log(data, step, backend=None)``, W&B finished when the object
goes away. The only gpulens line is the ``MergingLogger`` around it; like verl's ``fit()``, the
trainer never closes it: the rows still waiting go out when ``fit()`` returns and drops it.
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
    """What verl's tracking object does for its console and W&B backends."""

    def __init__(self, project_name: str, experiment_name: str, default_backend: list[str],
                 config: dict[str, Any]) -> None:
        self.logger: dict[str, Any] = {}
        if "wandb" in default_backend:
            import wandb

            wandb.init(project=project_name, name=experiment_name, config=config)
            self.logger["wandb"] = wandb
        if "console" in default_backend:
            self.logger["console"] = Console()

    def log(self, data: dict[str, Any], step: int, backend: Any = None) -> None:
        for name, backend_logger in self.logger.items():
            if backend is None or name in backend:
                backend_logger.log(data=data, step=step)

    def __del__(self) -> None:
        if "wandb" in self.logger:
            self.logger["wandb"].finish()


class Console:
    def log(self, data: dict[str, Any], step: int) -> None:
        print(f"step:{step} - " + " - ".join(f"{k}:{v:.4g}" for k, v in data.items()))


def fit(cfg: DictConfig) -> None:
    tracking = Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name,
                        list(cfg.trainer.logger),
                        config=OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    # a fresh run: the first GPU window starts now (a resumed run passes its step, or leaves
    # start_step out and the first log() starts it)
    logger = MergingLogger.from_config(tracking, cfg, start_step=0)
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
    # no logger.close(): as in verl, fit() just returns


@hydra.main(version_base=None, config_path="verl_conf", config_name="ppo_trainer")
def main(cfg: DictConfig) -> None:
    fit(cfg)


if __name__ == "__main__":
    main()
