"""The user paths the overhead benchmarks time, one *block* at a time (issue 18).

A block is one short run of one arm: a Hugging Face ``Trainer.train()``, a Lightning
``Trainer.fit()`` or a plain loop with a W&B run, of ``warmup + steps`` optimizer steps, with
gpulens (arm ``gpulens``) or without (``base``; the A/A arm runs the same code), over a fresh
copy of one warmed model (the process has chosen its kernels and grown its allocator before the
first block; a copy keeps no hook of an earlier block, DDP's included). gpulens's monitor starts
and stops with its block, outside the timed steps: start and stop are not what is measured.

A stamp at the end of every optimizer step (HF's ``on_step_end``, Lightning's
``on_train_batch_end``, the loop's own) reads three clocks:

* on a GPU, the GPU's timeline: a CUDA event recorded on the current stream, so a step's time
  is the time between two such events as the GPU ran them, with no device sync added: host
  work that the GPU's queue hides costs nothing there, host work that starves the GPU shows;
* the host's wall clock (``perf_counter``): the step time on a CPU;
* the training thread's CPU time (``time.thread_time``).

A block's value is the median of its timed steps (the steps after the warm-up). Both
``callback_cost.py`` (the training thread's CPU, on a CPU) and ``paths_aa.py`` (step time
against an A/A arm, on a GPU) run their blocks from here; ``overhead_gpu.py`` builds the model.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # benchmarks/overhead_gpu.py: the model, its warm-up, W&B helpers

Instrument = Callable[[Any, "Clock"], None]
"""Called with gpulens's callback (or monitor) of a ``gpulens`` block and the block's clock
before it trains."""


class Clock:
    """Stamps at the end of each step; the steps' times read back after the block."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.events: list[Any] = []
        self.listeners: list[Callable[[int], None]] = []
        """Called with the stamp's index after each stamp."""

    def stamp(self) -> None:
        for listener in self.listeners:
            listener(len(self.cpu))
        self.cpu.append(time.thread_time())
        self.wall.append(time.perf_counter())
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def steps(self, warmup: int) -> tuple[list[float], list[float]]:
        """(seconds, training-thread CPU seconds) of each step after the first ``warmup``:
        stamp ``k`` ends step ``k + 1``, so step ``k + 1``'s time is stamp ``k`` - stamp
        ``k - 1``."""
        first = max(1, warmup)
        cpu = [b - a for a, b in zip(self.cpu[first - 1:], self.cpu[first:], strict=False)]
        if self.cuda and self.events:
            self.events[-1].synchronize()  # after the block: every stamp has run
            pairs = zip(self.events[first - 1:], self.events[first:], strict=False)
            wall = [a.elapsed_time(b) / 1e3 for a, b in pairs]
        else:
            wall = [b - a for a, b in zip(self.wall[first - 1:], self.wall[first:], strict=False)]
        return wall, cpu


@dataclass
class Block:
    """One arm's run in one round."""

    arm: str
    round: int
    step_s: list[float]
    cpu_s: list[float]
    note: str = ""
    rank_values_s: list[float] = field(default_factory=list)
    """In a distributed run: every rank's block value (``value_s`` is the slowest's)."""

    @property
    def value_s(self) -> float:
        """The median step (seconds)."""
        return statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def cpu_per_step_s(self) -> float:
        """The median training-thread CPU seconds of a step."""
        return statistics.median(self.cpu_s) if self.cpu_s else float("nan")


def kind_of(arm: str) -> str:
    """``"gpulens"`` for an arm that runs gpulens, ``"dsm"`` for Lightning's
    ``DeviceStatsMonitor``, else ``"base"`` (the baseline and its A/A arm run the same code)."""
    if arm.endswith("gpulens"):
        return "gpulens"
    return "dsm" if arm.endswith("_dsm") else "base"


def gpulens_callbacks(arm: str, module: str, interval: float, clock: Clock,
                      instrument: Instrument | None) -> list[Any]:
    """``[GPUMonitorCallback(interval)]`` of ``module`` for a gpulens arm, else ``[]``."""
    if kind_of(arm) != "gpulens":
        return []
    import importlib

    callback = importlib.import_module(module).GPUMonitorCallback(interval=interval)
    if instrument is not None:
        instrument(callback, clock)
    return [callback]


class HfPath:
    """Hugging Face ``Trainer`` on the warmed model, ``logging_steps=log_every``, with the
    trackers of ``report_to`` (W&B: the run the caller opened, which HF's ``WandbCallback``
    uses), a dataset of token rows with an attention mask (a quarter of each row padded in
    every other row), collated and moved to the device by the Trainer as a user's data is;
    ``gpulens``: plus ``GPUMonitorCallback(interval)``."""

    def __init__(self, s: og.Setup, tmp: Path, log_every: int, report_to: list[str],
                 interval: float) -> None:
        import torch

        self.s, self.tmp, self.log_every = s, tmp, log_every
        self.report_to, self.interval = report_to, interval
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        g = torch.Generator().manual_seed(2)
        n = max(64, 4 * s.batch_size)
        self.ids = torch.randint(0, s.config.vocab_size, (n, s.seq_len), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[::2, -(s.seq_len // 4):] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self.name = f"hf_ls{log_every}"

    def dataset(self, steps: int) -> Any:
        import torch

        ids, mask, labels = self.ids, self.mask, self.labels
        length = (steps + 1) * self.s.batch_size * self.world

        class Rows(torch.utils.data.Dataset):  # type: ignore[misc]
            def __len__(self) -> int:
                return length

            def __getitem__(self, i: int) -> dict[str, Any]:
                j = i % len(ids)
                return {"input_ids": ids[j], "attention_mask": mask[j], "labels": labels[j]}

        return Rows()

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        from transformers import Trainer, TrainerCallback, TrainingArguments

        s = self.s
        clock = Clock(s.device.type == "cuda")

        class Stamp(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.stamp()

        cuda = s.device.type == "cuda"
        targs = TrainingArguments(
            output_dir=str(self.tmp / "hf" / f"{arm}-{rnd}"), max_steps=warmup + steps,
            per_device_train_batch_size=s.batch_size, logging_steps=self.log_every,
            report_to=self.report_to, save_strategy="no", eval_strategy="no",
            optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=1e-4,
            lr_scheduler_type="constant", warmup_steps=0, dataloader_num_workers=0,
            dataloader_pin_memory=cuda, disable_tqdm=True, use_cpu=not cuda, seed=0,
            bf16=False, ddp_find_unused_parameters=False,
        )
        callbacks = [*gpulens_callbacks(arm, "gpulens.integrations.transformers",
                                        self.interval, clock, instrument), Stamp()]
        model = copy.deepcopy(s.model)
        trainer = Trainer(model=model, args=targs, train_dataset=self.dataset(warmup + steps),
                          callbacks=callbacks)
        trainer.train()
        step_s, cpu_s = clock.steps(warmup)
        del trainer, model, callbacks
        gc.collect()
        return Block(arm, rnd, step_s, cpu_s)


class LightningPath:
    """A ``lightning.pytorch.Trainer`` over a module wrapping a copy of the warmed model
    (``self.model``: its Hugging Face config gives gpulens the FLOPs), fed the setup's batches
    as dicts with an attention mask (no data loading), a CSV logger, ``log_every_n_steps``;
    ``gpulens``: plus ``GPUMonitorCallback(interval)`` (rows to the CSV logger); ``*_dsm``:
    plus Lightning's ``DeviceStatsMonitor``."""

    def __init__(self, s: og.Setup, tmp: Path, log_every: int, interval: float) -> None:
        import torch

        self.s, self.tmp, self.log_every, self.interval = s, tmp, log_every, interval
        self.name = f"lightning_ls{log_every}"
        self.batches = []
        for ids in s.batches:
            mask = torch.ones_like(ids)
            mask[::2, -(s.seq_len // 4):] = 0
            self.batches.append({"input_ids": ids, "attention_mask": mask,
                                 "labels": ids.masked_fill(mask == 0, -100)})

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        import lightning.pytorch as pl
        import torch
        from lightning.pytorch.loggers import CSVLogger

        s = self.s
        clock = Clock(s.device.type == "cuda")
        batches = self.batches
        device = s.device

        class Module(pl.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.model = copy.deepcopy(s.model)

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                loss = self.model(**batch).loss
                self.log("loss", loss, on_step=True, on_epoch=False)
                return loss

            def configure_optimizers(self) -> Any:
                return og.make_optimizer(torch, self.model, device)

            def train_dataloader(self) -> Any:
                return torch.utils.data.DataLoader(Cycle(), batch_size=None)

        class Cycle(torch.utils.data.IterableDataset):  # type: ignore[misc]
            def __iter__(self) -> Any:
                i = 0
                while True:
                    yield batches[i % len(batches)]
                    i += 1

        class Stamp(pl.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, *args: Any) -> None:
                clock.stamp()

        callbacks = [*gpulens_callbacks(arm, "gpulens.integrations.lightning", self.interval,
                                        clock, instrument), Stamp()]
        if kind_of(arm) == "dsm":  # Lightning's own peer; on a CPU it has only CPU figures
            from lightning.pytorch.callbacks import DeviceStatsMonitor

            callbacks.insert(0, DeviceStatsMonitor(cpu_stats=True if device.type == "cpu"
                                                   else None))
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
            max_steps=warmup + steps, max_epochs=-1, limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=CSVLogger(str(self.tmp / "lightning"), name=f"{arm}-{rnd}"),
            log_every_n_steps=self.log_every, callbacks=callbacks, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Module())
        step_s, cpu_s = clock.steps(warmup)
        del trainer, callbacks
        gc.collect()
        return Block(arm, rnd, step_s, cpu_s)


class WandbLoopPath:
    """A W&B user's plain loop on the warmed model: ``run.log({"train/loss": loss})`` every
    step (the loss read with ``.item()``) into the run the caller opened; ``gpulens``: plus
    ``Monitor(interval, sinks=["wandb"])`` started for the block and ``mon.log(step)`` after
    each step (rows into the same run, written from the W&B sink's own thread)."""

    name = "wandb_loop"

    def __init__(self, s: og.Setup, interval: float) -> None:
        self.s, self.interval = s, interval

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        import torch
        import wandb

        import gpulens

        s = self.s
        clock = Clock(s.device.type == "cuda")
        model = copy.deepcopy(s.model)
        work = og.Setup(torch, s.device, model, og.make_optimizer(torch, model, s.device),
                        s.batches, s.batch_size, s.seq_len, s.n_params, s.config, s.quick)
        mon = None
        if kind_of(arm) == "gpulens":
            mon = gpulens.Monitor(interval=self.interval, sinks=["wandb"])
            if instrument is not None:
                instrument(mon, clock)
            mon.start()
        run = wandb.run
        try:
            for step in range(1, warmup + steps + 1):
                loss = og.train_step(work, step)
                run.log({"train/loss": loss})
                if mon is not None:
                    mon.log(step)
                clock.stamp()
        finally:
            if mon is not None:
                mon.stop()
        step_s, cpu_s = clock.steps(warmup)
        del work, model
        gc.collect()
        return Block(arm, rnd, step_s, cpu_s)


def open_wandb_run(tmp: Path, name: str) -> Any:
    """One offline W&B run for every block of the benchmark (W&B's system metrics every
    15 s, its default, as a user's run has them)."""
    return og.wandb_init(tmp, name, stats_interval=15.0)


__all__ = ["Block", "Clock", "HfPath", "LightningPath", "WandbLoopPath", "kind_of",
           "open_wandb_run"]
