"""A training whose speed the tests control: for ``gpulens tune`` on a CPU.

* :class:`SlowSamples` — a dataset whose every sample costs ``per_sample_s`` of sleep in the
  process that loads it (the main process with ``num_workers=0``, else a worker; one sleep per
  batch), so loader workers matter exactly as much as the test says.
* :class:`ControlledStep` — a real training step of a tiny linear model (forward, backward,
  optimizer step) plus a sleep of ``cost(batch)``: ``fixed_s + per_sample_s x batch`` up to
  ``knee`` samples, ``slow_per_sample_s`` per sample beyond (a larger batch that is slower per
  sample, built on purpose), and ``torch.OutOfMemoryError`` from ``oom_at`` samples on.

Sleeps, not computation, so the costs hold on a loaded two-core machine: a sleeping process
needs no CPU.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 4096, per_sample_s: float = 0.0, dim: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=gen)
        self.y = self.x.sum(-1, keepdim=True)
        self.per_sample_s = per_sample_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_sample_s:
            time.sleep(self.per_sample_s)
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch (what a DataLoader asks for): one sleep of the batch's cost, so the
        cost holds on a loaded machine (one wake-up per batch, not one per sample)."""
        if self.per_sample_s:
            time.sleep(self.per_sample_s * len(indices))
        return [(self.x[i], self.y[i]) for i in indices]


@dataclass
class ControlledStep:
    fixed_s: float = 0.002
    per_sample_s: float = 0.0005
    knee: int | None = None
    slow_per_sample_s: float = 0.002
    oom_at: int | None = None
    accumulate: bool = False
    """True: forward+backward only (the optimizer step is :meth:`optimizer_step`)."""
    model: nn.Module = field(default_factory=lambda: nn.Linear(8, 1))
    batches: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    """``f<batch>`` per forward+backward, ``o`` per optimizer step."""
    held: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    """The tensors that out-of-memory steps held when they raised."""

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def cost(self, b: int) -> float:
        if self.knee is not None and b > self.knee:
            return self.fixed_s + self.slow_per_sample_s * b
        return self.fixed_s + self.per_sample_s * b

    def __call__(self, batch: Any) -> None:
        x, y = (torch.as_tensor(t) for t in batch)
        b = int(x.shape[0])
        self.batches.append(b)
        if self.oom_at is not None and b >= self.oom_at:
            held = torch.empty(1 << 16)  # what the step's frame holds when it raises
            self.held.append(weakref.ref(held))
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} MiB")
        self.events.append(f"f{b}")
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        time.sleep(self.cost(b))
        if not self.accumulate:
            self.optimizer_step()

    def optimizer_step(self) -> None:
        self.events.append("o")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def collate_numpy(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Any]:
    """A batch as two numpy arrays: they cross from a loader worker by value, not as shared
    memory whose file descriptor the main process must fetch from the worker (a round trip
    that a loaded machine delays by milliseconds, which would read as data wait)."""
    return (torch.stack([s[0] for s in samples]).numpy(),
            torch.stack([s[1] for s in samples]).numpy())


#: Names a file :func:`record_start_method` appends to (unset: it writes nothing).
WORKER_STARTS_ENV = "TUNE_LOAD_WORKER_STARTS"


def record_start_method(worker_id: int) -> None:
    """A loader's ``worker_init_fn``: appends how this worker process was started (``fork``,
    ``spawn``, ...) to the file ``$TUNE_LOAD_WORKER_STARTS`` names, if it is set."""
    path = os.environ.get(WORKER_STARTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{multiprocessing.get_start_method()}\n")


def make_loader(dataset: Dataset[Any], batch_size: int, num_workers: int = 0,
                worker_init_fn: Any = None) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, shuffle=True,
                      drop_last=True, collate_fn=collate_numpy, worker_init_fn=worker_init_fn)


def make_loader_factory(dataset: Dataset[Any], worker_init_fn: Any = None) -> Any:
    def factory(batch_size: int, num_workers: int) -> DataLoader[Any]:
        return make_loader(dataset, batch_size, num_workers, worker_init_fn)
    return factory


def cli_job() -> Any:
    """``gpulens tune tests.support.tune_load:cli_job``: 20 ms + 1 ms/sample up to 16 samples,
    4 ms/sample beyond, out of memory from 64 samples; a loader function (its workers say how
    they were started: :func:`record_start_method`); current batch 4."""
    from gpulens.tune import Config, TuneJob

    step = ControlledStep(fixed_s=0.02, per_sample_s=0.001, knee=16, slow_per_sample_s=0.004,
                          oom_at=64)
    return TuneJob(loader=make_loader_factory(SlowSamples(n=1024), record_start_method),
                   step=step,
                   model=step.model, optimizer=step.optimizer, current=Config(4, 0))


def cli_job_one_worker() -> Any:
    """:func:`cli_job` whose current setting has one loader worker."""
    import dataclasses

    from gpulens.tune import Config

    return dataclasses.replace(cli_job(), current=Config(4, 1))


def not_a_job() -> int:
    return 3


def setup_raises_value_error() -> Any:
    """A setup whose own code raises ``ValueError`` (the user's bug, with its traceback)."""
    raise ValueError("learning rate must be positive")
