"""Step marks on their way from ``log()`` to the transport, with every scalar a number.

``log()`` takes whatever the training loop passes: Python numbers (the usual case: the mark goes
straight on), but also tensors, whose ``.item()`` would synchronise the device if called on
the training thread.  A mark holding anything but plain ``int``/``float`` goes to a relay
thread (started on first need) that converts the scalars and sends it on; every later mark then
goes through the relay too, so marks keep their order.  The queue is bounded
(:data:`RELAY_MAX`): beyond it marks are dropped and counted.

A CUDA tensor is never read with ``.item()`` on any thread: that is a blocking copy, and a
thread waiting in it holds up the training thread too (measured on 4 H200s under DDP: a loop of
2.6 ms steps passing ``loss=loss.detach()`` to ``log()`` every step ran about ten times slower;
``benchmarks/results/2026-11-27-h200x4-call3``).  On the training thread ``log()`` only starts
its copy to pinned host memory and records a CUDA event behind it (two launches, no wait); the
relay thread polls the event (``query()``, which never blocks) and reads the host copy once it
has landed.

:func:`to_float` is the one place a logged value becomes a number.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpulens.log import warn_once
from gpulens.model import MarkFields

RELAY_MAX = 10_000
"""Marks with tensors that may wait for conversion before new ones are dropped (counted)."""


def to_float(name: str, value: Any) -> float | None:
    """A logged value as a float (tensors via ``.item()``, off the training thread), or
    ``None`` with one warning per name and type: not a number, a tensor of several elements,
    a CUDA error.  Never raises.  NaN and infinities stay (a NaN loss is news)."""
    try:
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (str, bytes)):
            raise TypeError("text is not a number")
        number = float(value)
    except Exception as exc:
        warn_once(f"scalar:{name}:{type(value).__name__}",
                  "gpulens: logged value %r (%s) could not be read as a number (%s); left out",
                  name, type(value).__name__, exc)
        return None
    return number


POLL_FIRST_S = 0.001
POLL_MAX_S = 0.016
"""The relay thread asks whether a staged device copy has landed first after
:data:`POLL_FIRST_S`, then at doubling intervals up to :data:`POLL_MAX_S`.  A row is finished
at least 0.2 s after its mark (the driver's buffers lag that much), so a copy read up to 16 ms
late costs nothing, while each poll is a driver call and a turn of the GIL beside the training
thread: a fixed 0.5 ms poll (the earlier design) woke the thread 2,000 times a second whenever
the device ran behind the host, which is most of the time in training
(``benchmarks/step_cost_gpu.py`` compares the two)."""


_sleep = time.sleep


class Staged:
    """A device tensor's copy to host memory, started on the training thread, and the event
    recorded behind it on the tensor's stream."""

    __slots__ = ("done", "host", "pool")

    def __init__(self, host: Any, done: Any, pool: deque[Any] | None = None) -> None:
        self.host = host
        self.done = done
        self.pool = pool

    def value(self) -> Any:
        """The host copy, once the event says it has landed (polled at backing-off intervals:
        never a blocking wait).  The event goes back to its pool."""
        wait = POLL_FIRST_S
        while not self.done.query():
            _sleep(wait)
            wait = min(wait * 2, POLL_MAX_S)
        pool, self.pool = self.pool, None
        if pool is not None and len(pool) < EventPool.KEEP:
            pool.append(self.done)
        return self.host


class EventPool:
    """CUDA events to record behind staged copies, kept for reuse (one pool per device: an
    event records only on a stream of its own device).  :meth:`take` runs on the training
    thread, :meth:`Staged.value` gives the event back on the relay thread; a deque's appends
    and pops are atomic."""

    KEEP = 64
    """Events kept per device beyond which returned ones are let go."""

    def __init__(self) -> None:
        self._free: dict[int, deque[Any]] = {}

    def take(self, device: Any) -> tuple[Any, deque[Any]]:
        """An event on ``device`` (reused, or new) and the free events of that device, to give
        it back to (no function made for it on the training thread)."""
        index = device.index if device.index is not None else -1
        free = self._free.get(index)
        if free is None:
            free = self._free.setdefault(index, deque())
        try:
            event = free.pop()
        except IndexError:
            event = _cuda_event(device)
        return event, free


def _cuda_event(device: Any) -> Any:
    import torch

    with torch.cuda.device(device):
        make: Any = torch.cuda.Event
        return make()


def _record(event: Any, value: Any) -> None:
    """Record ``event`` on the training thread's current stream of ``value``'s device."""
    import torch

    event.record(torch.cuda.current_stream(value.device))


EVENTS = EventPool()


def stage(value: Any) -> Any:
    """On the training thread: a CUDA tensor becomes a :class:`Staged` copy (an asynchronous
    copy to pinned host memory and an event recorded after it, on the current stream of the
    tensor's device, from :data:`EVENTS`); anything else is returned as it is.  Never waits for
    the device; on any error the value is returned as it is (the relay then reads it, as
    before)."""
    if getattr(value, "is_cuda", False) is not True:
        return value
    try:
        host = value.detach().to("cpu", non_blocking=True)
        done, pool = EVENTS.take(value.device)
        _record(done, value)
    except Exception:
        return value
    return Staged(host, done, pool)


def _plain(scalars: dict[str, Any]) -> bool:
    for value in scalars.values():
        kind = type(value)
        if kind is not float and kind is not int:
            return False
    return True


class MarkRelay:
    """Sends marks through ``send`` (see the module doc).  ``send`` returns False when it
    could not take the mark (counted by its owner)."""

    def __init__(self, send: Callable[[MarkFields], bool]) -> None:
        self._send = send
        self._queue: queue.SimpleQueue[MarkFields | None] | None = None
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Marks dropped because the relay's queue was full."""

    def put(self, mark: MarkFields) -> None:
        """From ``log()``: send a mark's fields now, or queue them for the relay thread.
        Never blocks."""
        relay = self._queue
        if relay is None:
            if _plain(mark[3]):
                self._send(mark)
                return
            relay = self._start()
            if relay is None:
                return
        if relay.qsize() >= RELAY_MAX:
            self.dropped += 1
            warn_once("relay-full", "gpulens: logged tensors are not converted fast enough; "
                      "step marks are dropped (counted)")
            return
        scalars = mark[3]
        for name, value in scalars.items():
            kind = type(value)
            if kind is not float and kind is not int:
                scalars[name] = stage(value)
        relay.put(mark)

    def _start(self) -> queue.SimpleQueue[MarkFields | None] | None:
        relay: queue.SimpleQueue[MarkFields | None] = queue.SimpleQueue()
        thread = threading.Thread(target=self._loop, args=(relay,), name="gpulens-relay",
                                  daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            warn_once("relay-start", "gpulens: could not start the relay thread (%s); marks "
                      "with tensors are left out", exc)
            return None
        self._queue, self._thread = relay, thread
        return relay

    def _loop(self, relay: queue.SimpleQueue[MarkFields | None]) -> None:
        while True:
            mark = relay.get()
            if mark is None:
                return
            try:
                scalars: dict[str, float] = {}
                for name, value in mark[3].items():
                    if type(value) is Staged:
                        value = value.value()
                    number = value if type(value) is float else to_float(name, value)
                    if number is not None:
                        scalars[name] = number
                self._send((mark[0], mark[1], mark[2], scalars, mark[4]))
            except Exception as exc:  # this thread must outlive any one mark
                warn_once("relay-mark", "gpulens: could not send a step mark: %r", exc)

    def close(self, timeout: float) -> None:
        """Send what the relay holds (within ``timeout`` seconds) and end its thread."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
        self._queue = None
        self._thread = None

    def forget(self) -> None:
        """In a forked child: the relay thread is the parent's."""
        self._queue = None
        self._thread = None
