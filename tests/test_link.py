"""The framed pipe between the training process and the engine process."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpulens.transport import pipe as link
from gpulens.transport.pipe import LinkClosed, Receiver, Sender


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


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_after_the_other_end_went_closes_the_fd_once() -> None:
    r, w = os.pipe()
    tx = Sender(w, blocking=False)
    os.close(r)
    assert tx.send(("m", 1)) is False and tx.broken
    assert str(w) in _open_fds()  # broken, but the fd is still ours to close
    tx.close()
    assert str(w) not in _open_fds()
    reused_r, reused_w = os.pipe()  # may take w's number: a second close must spare it
    try:
        tx.close()
        assert {str(reused_r), str(reused_w)} <= _open_fds()
    finally:
        os.close(reused_r)
        os.close(reused_w)


def test_receiver_closes_once() -> None:
    r, w = os.pipe()
    rx = Receiver(r)
    rx.close()
    r2, w2 = os.pipe()  # may reuse r's number
    try:
        rx.close()
        assert {str(r2), str(w2)} <= _open_fds()
    finally:
        for fd in (w, r2, w2):
            os.close(fd)


def _flushers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpulens-flush"]


def test_a_backlog_moves_without_another_send() -> None:
    """A frame larger than the pipe: the rest goes out as the reader makes room, with no
    further send() (rows must not stall while training pauses)."""
    r, w = os.pipe()
    tx, rx = Sender(w, blocking=False), Receiver(r)
    big = ("m", 1, "z" * 1_000_000)
    assert tx.send(big) and tx.pending_bytes > 0
    got: list[object] = []
    deadline = time.monotonic() + 5.0
    while not got and time.monotonic() < deadline:
        got.extend(rx.poll())
        time.sleep(0.005)
    assert got == [big] and tx.pending_bytes == 0
    deadline = time.monotonic() + 2.0
    while _flushers() and time.monotonic() < deadline:  # the flusher ends with the backlog
        time.sleep(0.01)
    assert not _flushers()
    tx.close()
    rx.close()


def test_forced_frames_ignore_the_queue_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "MAX_PENDING_BYTES", 100_000)
    r, w = os.pipe()
    tx, rx = Sender(w, blocking=False), Receiver(r)
    sent = 0
    while tx.send(("m", sent, "y" * 20_000)):
        sent += 1
    assert tx.dropped == 1
    assert tx.send(("stop", 1.0), force=True)  # a control frame is never dropped
    assert tx.dropped == 1
    got: list[object] = []
    deadline = time.monotonic() + 5.0
    while (not got or got[-1] != ("stop", 1.0)) and time.monotonic() < deadline:
        got.extend(rx.poll())
        time.sleep(0.005)
    assert got[-1] == ("stop", 1.0) and len(got) == sent + 1
    tx.close()
    rx.close()
