"""Lightning with GPU telemetry beside the module's own metrics: one callback.

    python examples/lightning_fit.py                             # CSV logger in a temp folder
    python examples/lightning_fit.py --package pytorch_lightning # the standalone package
    python examples/lightning_fit.py --logger wandb              # W&B (set WANDB_MODE=offline)
    torchrun --nproc_per_node 2 examples/lightning_fit.py        # DDP on CPU (gloo)

The GPU keys (``gpu/0/util_pct``, ``perf/data_wait_pct``, ...) reach every logger of the trainer
at the steps where Lightning writes ``train_loss`` (every ``--log-every`` optimizer steps).
A small MLP is built in code; without a GPU the monitor samples simulated GPUs.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def build(package: str) -> tuple[Any, type[Any]]:
    """(the Lightning package, the GPUMonitorCallback class for it)."""
    if package == "lightning":
        import lightning.pytorch as pl

        from gpulens.integrations.lightning import GPUMonitorCallback
    else:
        pl = importlib.import_module("pytorch_lightning")
        from gpulens.integrations.pytorch_lightning import GPUMonitorCallback
    return pl, GPUMonitorCallback


def make_module(pl: Any) -> Any:
    class Regressor(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, width: int = 64) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("train_loss", loss, on_step=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def make_data(n: int = 2048, batch: int = 32) -> torch.utils.data.DataLoader[Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    y = x[:, :4].sum(-1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", choices=("lightning", "pytorch_lightning"), default="lightning")
    p.add_argument("--logger", choices=("csv", "wandb", "mlflow"), default="csv")
    p.add_argument("--save-dir", default=None, help="default: a new temporary folder")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--sink", action="append", default=[], help="extra gpulens sink (repeatable)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        # one simulated GPU per process of the node (torchrun sets LOCAL_WORLD_SIZE)
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))

    pl, GPUMonitorCallback = build(args.package)
    save_dir = args.save_dir or tempfile.mkdtemp(prefix="gpulens-lightning-")
    if args.logger == "csv":
        logger: Any = pl.loggers.CSVLogger(save_dir, name="example")
    elif args.logger == "wandb":
        logger = pl.loggers.WandbLogger(save_dir=save_dir, project="gpulens-example")
    else:
        logger = pl.loggers.MLFlowLogger(experiment_name="gpulens-example")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        log_every_n_steps=args.log_every,
        logger=logger,
        callbacks=[GPUMonitorCallback(sinks=args.sink, interval=0.1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="auto",
        # under torchrun: one process per device, as many as torchrun started on this node
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(
            os.environ.get("LOCAL_WORLD_SIZE", "1")),
        default_root_dir=save_dir,
    )
    trainer.fit(make_module(pl), make_data())
    if trainer.is_global_zero and args.logger == "csv":
        print(f"gpulens: metrics in {logger.log_dir}/metrics.csv")
    # Under torchrun Lightning set up torch.distributed (gloo on CPU) and leaves it up. Take it
    # down in this order: first free the trainer and what it holds (a DDP model holds the
    # process group from C++), then destroy the group, so that gloo's worker threads are joined
    # with the GIL let go; the other way round the process can hang or abort at exit
    # (docs/design-notes.md, "DDP exit").
    del trainer, logger
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
