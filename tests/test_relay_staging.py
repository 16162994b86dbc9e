"""A CUDA tensor passed to ``log()`` is never read with a blocking ``.item()``: the training
thread starts its copy to host memory and records an event; the relay thread polls the event
and reads the copy once it has landed (``gpulens.transport.relay``)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpulens.model import MarkFields
from gpulens.transport import relay as relay_mod
from gpulens.transport.relay import MarkRelay, Staged, stage


class FakeEvent:
    """A CUDA event that reports its work done only after ``pending`` queries."""

    def __init__(self, pending: int) -> None:
        self.pending = pending
        self.recorded = 0
        self.queries = 0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.pending


class FakeCudaTensor:
    """Looks like a CUDA tensor to ``stage``; fails the test if anything reads it blocking."""

    is_cuda = True
    device = torch.device("cpu", 0)  # stands for cuda:0 (an index, as the event pool needs)

    def __init__(self, value: float) -> None:
        self.host = torch.tensor(value)
        self.copies: list[tuple[str, bool]] = []

    def detach(self) -> FakeCudaTensor:
        return self

    def to(self, device: str, non_blocking: bool = False) -> torch.Tensor:
        self.copies.append((device, non_blocking))
        return self.host

    def item(self) -> float:
        raise AssertionError("a blocking .item() on a CUDA tensor")


def pool_of(monkeypatch: Any, make: Any) -> None:
    """Events from ``make(device)`` through a fresh pool, recorded without a stream."""
    monkeypatch.setattr(relay_mod, "_cuda_event", make)
    monkeypatch.setattr(relay_mod, "_record", lambda done, value: done.record())
    monkeypatch.setattr(relay_mod, "EVENTS", relay_mod.EventPool())


def test_stage_starts_a_non_blocking_copy_and_records_an_event(monkeypatch: Any) -> None:
    tensor, event = FakeCudaTensor(2.5), FakeEvent(pending=3)
    pool_of(monkeypatch, lambda device: event)
    staged = stage(tensor)
    assert isinstance(staged, Staged)
    assert tensor.copies == [("cpu", True)]
    assert event.recorded == 1 and event.queries == 0  # nothing waited on the training thread
    assert float(staged.value()) == 2.5
    assert event.queries == 4  # polled until the copy landed


def test_stage_leaves_numbers_and_cpu_tensors_alone() -> None:
    cpu = torch.tensor(1.0)
    assert stage(3.0) == 3.0
    assert stage(cpu) is cpu


def test_the_relay_thread_reads_a_cuda_value_only_after_its_event(monkeypatch: Any) -> None:
    event = FakeEvent(pending=5)
    pool_of(monkeypatch, lambda device: event)
    sent: list[MarkFields] = []
    got = threading.Event()

    def send(mark: MarkFields) -> bool:
        sent.append(mark)
        got.set()
        return True

    relay = MarkRelay(send)
    tensor = FakeCudaTensor(0.75)
    relay.put((7, 1.0, 2.0, {"loss": tensor, "lr": 0.1}, None))
    assert got.wait(30.0), "the relay never sent the mark"
    relay.close(5.0)
    assert tensor.copies == [("cpu", True)]
    assert event.queries > 5
    assert sent[0][0] == 7 and sent[0][3] == {"loss": 0.75, "lr": 0.1}


def test_events_come_back_to_their_pool_and_are_reused(monkeypatch: Any) -> None:
    made: list[FakeEvent] = []

    def make(device: Any) -> FakeEvent:
        made.append(FakeEvent(pending=1))
        return made[-1]

    pool_of(monkeypatch, make)
    first, second = stage(FakeCudaTensor(1.0)), stage(FakeCudaTensor(2.0))
    assert len(made) == 2  # both in flight: two events
    assert float(first.value()) == 1.0 and float(second.value()) == 2.0
    third = stage(FakeCudaTensor(3.0))
    assert len(made) == 2 and third.done in made  # a returned event, recorded again
    assert float(third.value()) == 3.0


def test_polls_back_off_to_a_few_a_step(monkeypatch: Any) -> None:
    """A copy that lands late is polled at doubling intervals up to POLL_MAX_S, not 2,000
    times a second (each poll is a driver call and a turn of the GIL beside training)."""
    slept: list[float] = []
    monkeypatch.setattr(relay_mod, "_sleep", slept.append)
    pool_of(monkeypatch, lambda device: FakeEvent(pending=8))
    staged = stage(FakeCudaTensor(4.0))
    assert float(staged.value()) == 4.0
    assert slept == [0.001, 0.002, 0.004, 0.008, 0.016, 0.016, 0.016, 0.016]
    assert relay_mod.POLL_MAX_S == 0.016
