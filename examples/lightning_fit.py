"""Lightning with GPU telemetry beside the module's own metrics: one callback.

    python examples/lightning_fit.py                             # CSV logger in a temp folder
    python examples/lightning_fit.py --package pytorch_lightning # the standalone package
    python examples/lightning_fit.py --logger wandb              # W&B (set WANDB_MODE=offline)
    python examples/lightning_fit.py --model gpt2 --precision bf16-mixed   # tokens, MFU
    torchrun --nproc_per_node 2 examples/lightning_fit.py        # DDP on CPU (gloo)

The GPU keys (``gpu/0/util_pct``, ``perf/data_wait_pct``, ...) reach every logger of the trainer
at the steps where Lightning writes ``train_loss`` (every ``--log-every`` optimizer steps).
A small MLP is built in code (``--model gpt2``: a small GPT-2 built from a config, trained on
random tokens in Hugging Face style batches, so rows also carry ``perf/tokens_per_s``,
``perf/tflops`` and ``perf/mfu_pct``); without a GPU the monitor samples simulated GPUs.
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


def make_module(pl: Any, model: str = "mlp") -> Any:
    if model == "gpt2":
        return make_gpt2(pl)

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


def make_gpt2(pl: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    class Gpt2(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            # gpulens finds the FLOPs formula through self.model.config
            self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4,
                                                    n_positions=128, vocab_size=1024))

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            self.log("train_loss", loss, on_step=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    return Gpt2()


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token ids, the labels the inputs; every sequence a little shorter than the last
    few so that the attention mask has padding (which is not work)."""

    def __init__(self, n: int = 512, length: int = 128, vocab: int = 1024) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)
        self.mask = torch.ones(n, length, dtype=torch.long)
        for i in range(n):
            self.mask[i, length - (i % 16):] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def make_data(n: int = 2048, batch: int = 32, model: str = "mlp"
              ) -> torch.utils.data.DataLoader[Any]:
    if model == "gpt2":
        return torch.utils.data.DataLoader(RandomTokens(), batch_size=16)
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
    p.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    p.add_argument("--precision", default=None,
                   help="Lightning's precision (e.g. bf16-mixed); default: Lightning's")
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
        **({"precision": args.precision} if args.precision else {}),
    )
    trainer.fit(make_module(pl, args.model), make_data(model=args.model))
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
