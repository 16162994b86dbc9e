"""The rule engine on rows that the real pipeline writes: a Hugging Face Trainer whose dataset
turns slow, simulated GPUs that hit their power cap, slow down for heat, stop using their tensor
cores and fill their memory.  Each run has a healthy first half (no rule may fire) and a faulty
second half (the rule must fire within 20 steps of the onset).  A 2-rank DDP job (torchrun,
gloo) whose rank 1 turns slow in backward compute is in ``tests/test_integration_distributed.py``
(``test_ddp_rank_slow_in_backward_is_named_chronic``), where it shares the launch of the other
DDP scripts.

The engine runs the rules on its rows; each test reads its verdicts back (Row.events, the
JSONL record's event lines, alerts/<rule> keys).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from gpulens.model import Event, RunContext
from gpulens.testing import MemorySink, SimulatedNVML
from tests.support.jsonl import read_lines, read_rows

FAULT_AFTER_S = 3.0
"""Simulated seconds (since the simulator was made) after which the simulated faults begin."""


def firing(events: list[Event]) -> dict[str, int]:
    """First firing step of each rule."""
    out: dict[str, int] = {}
    for e in events:
        if e.kind == "alert" and e.state == "firing":
            out.setdefault(e.name, e.step)
    return out


# -- simulated GPUs with faults ---------------------------------------------------------------

def two_phase_load(gpu: int, t: float) -> float:
    """A steady training (activity 0.8 with a little ripple), then from FAULT_AFTER_S a load
    that keeps the board at its power limit (the simulator sets the power-cap reason above
    0.9)."""
    return 0.97 if t >= FAULT_AFTER_S else 0.8 + 0.03 * math.sin(7.0 * t + gpu)


class FaultyGpus(SimulatedNVML):
    """From FAULT_AFTER_S: GPU 1 slows down for heat (thermal clock-event reason, 88 C), the
    tensor pipes of every GPU go nearly idle (an fp32 matmul loop in a bf16 run), and GPU 0's
    memory is 97 % full."""

    def _faulty(self) -> bool:
        return self._now() >= FAULT_AFTER_S

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        reasons = super().nvmlDeviceGetCurrentClocksEventReasons(h)
        return reasons | 0x20 if self._faulty() and h.index == 1 else reasons

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        t = super().nvmlDeviceGetTemperature(h, sensor)
        return 88 if self._faulty() and h.index == 1 else t

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        mem = super().nvmlDeviceGetMemoryInfo(h)
        if self._faulty() and h.index == 0:
            mem.used = int(0.97 * mem.total)
            mem.free = mem.total - mem.used
        return mem

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        request = super().nvmlGpmMetricsGet(request)
        if self._faulty():
            for m in request.metrics[: request.numMetrics]:
                if m.metricId == 5:  # tensor pipes active
                    m.value *= 0.02
        return request


def test_simulated_faults_fire_their_rules_and_the_healthy_half_fires_nothing() -> None:
    import gpulens

    sink = MemorySink()
    sim = FaultyGpus(gpus=2, load=two_phase_load)
    mon = gpulens.Monitor(backend=sim, interval=0.05, sinks=[sink], dtype="bf16")
    mon.start(step=0)
    assert mon.isolation == "process"  # the engine's own rules, on the default path
    onset = None
    for step in range(1, 61):
        time.sleep(0.1)
        mon.log(step, loss=1.0 / step)
        # the faults begin on the simulator's clock (its epoch is when it was made: a start
        # slowed by a loaded machine eats into the healthy phase, never into the check)
        if onset is None and sim.elapsed() >= FAULT_AFTER_S:
            onset = step
    mon.stop()
    context = mon.context
    assert isinstance(context, RunContext) and onset is not None
    events = [e for r in sink.rows for e in r.events if e.kind == "alert"]
    fired = firing(events)
    for name in fired:  # the alert keys follow on the step axis
        assert sink.rows[-1].values[f"alerts/{name}"] == 1.0
    assert set(fired) == {"power_capped", "thermal", "low_tensor_use", "memory_headroom"}, events
    for name, step in fired.items():
        assert onset - 1 <= step <= onset + 20, (name, step, onset)
    thermal = next(e for e in events if e.name == "thermal")
    assert "GPU 1" in thermal.message and "GPU 0" not in thermal.message
    memory = next(e for e in events if e.name == "memory_headroom")
    assert "GPU 0" in memory.message and "GPU 1" not in memory.message


# -- a Hugging Face Trainer whose dataset turns slow ------------------------------------------

SLOW_AFTER_STEPS = 40
SLOW_STEPS = 20
"""The rule must fire within this many steps of the onset: the run ends there (a later firing
would fail the check as no firing does)."""


def test_hf_trainer_with_a_dataset_that_turns_slow_is_input_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    import torch
    from torch import nn

    from gpulens.integrations.transformers import GPUMonitorCallback

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    batch = 16

    class Model(nn.Module):
        """A few milliseconds of CPU work per step, so that a fast dataset is a small share."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512),
                                     nn.ReLU(), nn.Linear(512, 1))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            pred = self.net(x.repeat(16, 1)).squeeze(-1)
            return {"loss": nn.functional.mse_loss(pred, labels.repeat(16))}

    class TurnsSlow(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        """Fast, then from step SLOW_AFTER_STEPS 4 ms a sample (a slow ``__getitem__``)."""

        def __init__(self) -> None:
            self.x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
            self.fetched = 0

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            self.fetched += 1
            if self.fetched > SLOW_AFTER_STEPS * batch:
                time.sleep(0.004)
            return {"x": self.x[i], "labels": self.x[i].sum()}

    sink = tmp_path / "rows.jsonl"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=SLOW_AFTER_STEPS + SLOW_STEPS, logging_steps=1,
        per_device_train_batch_size=batch, learning_rate=1e-3, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(
        model=Model(), args=args, train_dataset=TurnsSlow(),
        callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)])
    # one intra-op thread: two spin while they wait for each other on this 2-core machine
    # with the suite in several workers (~2.3 s of CPU of this test)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    rows = read_rows(sink)
    assert [r["step"] for r in rows] == list(range(1, SLOW_AFTER_STEPS + SLOW_STEPS + 1))
    healthy = [r["perf/data_wait_pct"] for r in rows[5:SLOW_AFTER_STEPS]]
    slow = [r["perf/data_wait_pct"] for r in rows[SLOW_AFTER_STEPS + 1:]]
    # the engine's verdicts, as the record keeps them; judged on input_bound only: the
    # simulated GPU follows the simulator's default load wave (0.15-0.95 over 7 s), not the
    # CPU training, so its activity says nothing here
    events = [e for e in read_lines(sink) if e.get("event") == "alert"]
    fired = {e["step"] for e in events if e["name"] == "input_bound" and e["state"] == "firing"}
    assert len(fired) == 1, (events, healthy, slow)
    (step,) = fired
    assert SLOW_AFTER_STEPS < step <= SLOW_AFTER_STEPS + SLOW_STEPS, (step, healthy, slow)
