"""The framed pipe between the training process and the sampler process."""

from __future__ import annotations

import os

import pytest

from gpulens import link
from gpulens.link import LinkClosed, Receiver, Sender


def test_a_full_pipe_queues_whole_frames_and_order_holds() -> None:
    r, w = os.pipe()
    tx, rx = Sender(w, blocking=False), Receiver(r)
    big = "x" * 300_000  # several times a pipe's buffer: written in pieces
    sent = [("m", i, big if i % 3 == 0 else i) for i in range(12)]
    for msg in sent:
        assert tx.send(msg)  # never blocks: what the pipe cannot take waits in the queue
    assert tx.pending_bytes > 0
    got = []
    while len(got) < len(sent):
        got.extend(rx.poll())
        tx.flush()
    assert got == sent and tx.pending_bytes == 0
    tx.close()
    assert rx.poll() == [] and rx.eof


def test_blocking_receive_ends_at_end_of_file() -> None:
    r, w = os.pipe()
    tx, rx = Sender(w, blocking=True), Receiver(r)
    tx.send({"config": 1})
    tx.close()
    assert rx.recv() == {"config": 1}
    with pytest.raises(LinkClosed):
        rx.recv()


def test_queue_limit_drops_whole_messages_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "MAX_PENDING_BYTES", 200_000)
    r, w = os.pipe()
    tx, rx = Sender(w, blocking=False), Receiver(r)
    results = [tx.send(("m", i, "y" * 50_000)) for i in range(20)]
    assert not all(results) and tx.dropped == results.count(False)
    got = []
    for _ in range(100):
        got.extend(rx.poll())
        tx.flush()
        if tx.pending_bytes == 0:
            got.extend(rx.poll())
            break
    # every message that was taken arrives whole, in order; the dropped ones are gone
    assert [m[1] for m in got] == [i for i, ok in enumerate(results) if ok]


def test_other_end_gone_closes_the_sender() -> None:
    r, w = os.pipe()
    tx = Sender(w, blocking=False)
    os.close(r)
    assert tx.send(("m", 1)) is False and tx.closed
    assert tx.send(("m", 2)) is False
