"""A CUDA tensor passed to ``log()`` is never read with a blocking ``.item()``: the training
thread starts its copy to host memory and records an event, and sends the mark at a later
``log()`` once the event says the copy has landed; a mark that waits too long is sent by the
relay thread, which polls (``gpulens.transport.relay``)."""

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


class Sent:
    """A transport's ``send_mark``: the marks sent, and the thread each was sent on."""

    def __init__(self) -> None:
        self.marks: list[MarkFields] = []
        self.threads: list[str] = []
        self.got = threading.Event()

    def __call__(self, mark: MarkFields) -> bool:
        self.marks.append(mark)
        self.threads.append(threading.current_thread().name)
        self.got.set()
        return True

    @property
    def steps(self) -> list[int]:
        return [m[0] for m in self.marks]


def test_a_cuda_value_goes_at_a_later_log_once_landed_and_marks_keep_their_order(
        monkeypatch: Any) -> None:
    """The training thread asks the event at each later ``log()`` (never waits) and sends the
    mark once it has landed; plain marks behind it wait, so rows keep their order; no other
    thread is woken for it."""
    monkeypatch.setattr(relay_mod, "LATE_S", 60.0)
    event = FakeEvent(pending=2)
    pool_of(monkeypatch, lambda device: event)
    sent = Sent()
    relay = MarkRelay(sent)
    relay.put((1, 0.5, 1.5, {"lr": 0.1}, None))  # plain, nothing waiting: sent at once
    tensor = FakeCudaTensor(0.75)
    relay.put((7, 1.0, 2.0, {"loss": tensor, "lr": 0.1}, None))
    assert sent.steps == [1] and event.queries == 1 and tensor.copies == [("cpu", True)]
    relay.put((8, 2.0, 3.0, {"lr": 0.2}, None))  # plain, but behind a waiting mark
    assert sent.steps == [1] and event.queries == 2
    relay.put((9, 3.0, 4.0, {"lr": 0.3}, None))  # the copy has landed by now
    assert sent.steps == [1, 7, 8, 9]
    assert set(sent.threads) == {threading.current_thread().name}
    assert sent.marks[1][3] == {"loss": 0.75, "lr": 0.1}
    relay.close(5.0)


def test_a_mark_left_waiting_is_sent_by_the_relay_thread(monkeypatch: Any) -> None:
    """A loop that stops logging (evaluation, a checkpoint) does not hold its last row back
    for long: the relay thread sends a mark that has waited ``LATE_S``, polling its event."""
    monkeypatch.setattr(relay_mod, "LATE_S", 0.05)
    monkeypatch.setattr(relay_mod, "RELAY_WAKE_S", 0.01)
    event = FakeEvent(pending=5)
    pool_of(monkeypatch, lambda device: event)
    sent = Sent()
    relay = MarkRelay(sent)
    relay.put((7, 1.0, 2.0, {"loss": FakeCudaTensor(0.5)}, None))
    assert sent.got.wait(30.0), "the relay never sent the mark"
    assert sent.steps == [7] and sent.threads == ["gpulens-relay"]
    assert sent.marks[0][3] == {"loss": 0.5} and event.queries > 5
    relay.close(5.0)


def test_close_sends_what_waits_in_order(monkeypatch: Any) -> None:
    monkeypatch.setattr(relay_mod, "LATE_S", 60.0)
    pool_of(monkeypatch, lambda device: FakeEvent(pending=3))
    sent = Sent()
    relay = MarkRelay(sent)
    relay.put((1, 1.0, 1.0, {"loss": FakeCudaTensor(1.0)}, None))
    relay.put((2, 2.0, 2.0, {"lr": 0.5}, None))
    assert sent.steps == []
    relay.close(10.0)
    assert sent.steps == [1, 2] and sent.marks[0][3] == {"loss": 1.0}
    assert relay.dropped == 0


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


def test_a_device_error_never_reaches_the_training_thread(monkeypatch: Any,
                                                          caplog: Any) -> None:
    """An event whose query raises (a CUDA error) leaves ``log()`` alone: the relay thread
    tries the mark, says what went wrong once, and the marks after it still go."""
    import logging

    class BrokenEvent(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(relay_mod, "LATE_S", 0.02)
    monkeypatch.setattr(relay_mod, "RELAY_WAKE_S", 0.01)
    pool_of(monkeypatch, lambda device: BrokenEvent(pending=0))
    caplog.set_level(logging.WARNING, logger="gpulens")
    sent = Sent()
    relay = MarkRelay(sent)
    relay.put((1, 1.0, 1.0, {"loss": FakeCudaTensor(1.0)}, None))  # must not raise
    relay.put((2, 2.0, 2.0, {"lr": 0.5}, None))
    relay.close(10.0)
    assert sent.steps == [2]
    assert any("illegal memory access" in r.getMessage() for r in caplog.records)
