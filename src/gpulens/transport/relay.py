"""Step marks on their way from ``log()`` to the transport, with every scalar a number.

``log()`` takes whatever the training loop passes: Python numbers (the usual case: the mark goes
straight on), but also tensors, whose ``.item()`` would synchronise the device if called on
the training thread, and the token counter's deferred counts.  A CUDA tensor is never read with
``.item()`` on any thread: that is a blocking copy, and a thread waiting in it holds up the
training thread too (measured on 4 H200s under DDP: a loop of 2.6 ms steps passing
``loss=loss.detach()`` to ``log()`` every step ran about ten times slower;
``benchmarks/results/2026-11-27-h200x4-call3``).  On the training thread ``log()`` starts its
copy to pinned host memory and records a CUDA event behind it (two launches, no wait).

**Who converts a mark.** The training thread itself, at a later ``log()``: each call first
sends the waiting marks whose values have landed (``Event.query()``, which never blocks: a few
microseconds on the thread that launches the kernels anyway), in order, then its own if it is
plain.  Host values (numbers, CPU tensors) count as landed; a value that might synchronise a
device (a tensor of another kind of device, an object of unknown kind) never does, and waits
for the relay thread.  In training a log period is far longer than the device's lag, so a
mark usually goes at the next ``log()``, and its row is finished a period later than it would
otherwise be (rows wait at least 0.2 s for the sampler's data in any case).

A relay thread (started on first need) wakes every :data:`RELAY_WAKE_S` and sends a mark that
has waited :data:`LATE_S` (the loop stopped logging: evaluation, a checkpoint, the end),
polling its events; it also converts what ``stop()`` leaves.  The earlier design converted
every such mark on the relay thread; in the loops benchmarked on H100 and H200 hosts that
thread took 0.23-0.9 ms of CPU a step, wakes and GIL turns beside a training thread that is
busy on the CPU (``benchmarks/results/2026-11-27-h200x2-relay-sync-old-new``).  Marks keep
their order: a plain mark behind a waiting one waits too.  At most :data:`RELAY_MAX` marks
wait; beyond, marks are dropped and counted.

:func:`to_float` is the one place a logged value becomes a number.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpulens.log import warn_once
from gpulens.model import MarkFields

RELAY_MAX = 10_000
"""Marks with tensors that may wait for conversion before new ones are dropped (counted)."""
LATE_S = 1.0
"""A mark that has waited this long (seconds) is sent by the relay thread."""
RELAY_WAKE_S = 1.0
"""How often the relay thread looks for late marks (a mark it sends has waited 1-2 s).  Each
look takes the GIL: at 0.25 s the thread took 43 us of CPU a 110 ms step with Lightning on an
H100 (``benchmarks/results/2026-11-27-h100-relay-at-log``)."""


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

    def landed(self) -> bool:
        """Whether the copy has reached host memory (``Event.query()``: never waits)."""
        return bool(self.done.query())

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


def _landed(value: Any) -> bool:
    """Whether the training thread may read ``value`` now, knowing it will not wait: a staged
    copy whose event says it landed, a deferred count that says so (``landed()``), a number,
    a host tensor or array.  Anything else (a tensor of another device, whose ``.item()`` may
    synchronise it, an object of unknown kind) is the relay thread's to read."""
    landed = value.landed if type(value) is Staged else getattr(value, "landed", None)
    if landed is not None:  # a staged copy, the token counter's DeferredCount
        try:
            return bool(landed())
        except Exception:  # (a CUDA error) never into training: the relay thread reads it
            return False  # and says what is wrong, once
    if isinstance(value, numbers.Number):
        return True
    device = getattr(value, "device", None)
    return getattr(device, "type", device) == "cpu"


def _numbers(mark: MarkFields) -> MarkFields:
    """The mark with every scalar a float (those that are not numbers left out, said once)."""
    scalars: dict[str, float] = {}
    for name, value in mark[3].items():
        if type(value) is Staged:
            value = value.value()
        number = value if type(value) is float else to_float(name, value)
        if number is not None:
            scalars[name] = number
    return (mark[0], mark[1], mark[2], scalars, mark[4])


class MarkRelay:
    """Sends marks through ``send`` (see the module doc).  ``send`` returns False when it
    could not take the mark (counted by its owner)."""

    def __init__(self, send: Callable[[MarkFields], bool]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._waiting: deque[tuple[MarkFields, float]] = deque()
        """Marks not sent yet, oldest first, each with its ``time.monotonic()`` at ``put``."""
        self._busy = False
        """The relay thread is converting the oldest mark: nobody else sends meanwhile."""
        self._closing = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_failed = False
        self.dropped = 0
        """Marks dropped because too many waited."""

    def put(self, mark: MarkFields) -> None:
        """From ``log()``: send the waiting marks whose values have landed, then this one if
        it is plain; else stage its tensors and keep it.  Never waits for the device."""
        scalars = mark[3]
        plain = True
        for name, value in scalars.items():
            kind = type(value)
            if kind is not float and kind is not int:
                plain = False
                scalars[name] = stage(value)
        with self._lock:
            if plain and not self._waiting and not self._busy:
                self._send(mark)
                return
            if len(self._waiting) >= RELAY_MAX:
                self.dropped += 1
                warn_once("relay-full", "gpulens: logged tensors are not converted fast enough; "
                          "step marks are dropped (counted)")
            else:
                self._waiting.append((mark, time.monotonic()))
            self._send_landed()
            if self._waiting and self._thread is None and not self._start_failed:
                self._start()  # once a monitor: the first mark that had to wait

    def _send_landed(self) -> None:
        """With the lock held: send the oldest marks while their values have landed."""
        waiting = self._waiting
        while waiting and not self._busy:
            mark = waiting[0][0]
            for value in mark[3].values():
                kind = type(value)
                if kind is not float and kind is not int and not _landed(value):
                    return
            waiting.popleft()
            try:
                self._send(_numbers(mark))
            except Exception as exc:  # a mark that cannot be read must not stop training
                warn_once("relay-mark", "gpulens: could not send a step mark: %r", exc)

    def _start(self) -> None:
        thread = threading.Thread(target=self._loop, name="gpulens-relay", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            self._start_failed = True
            warn_once("relay-start", "gpulens: could not start the relay thread (%s); marks "
                      "with tensors are sent at later log() calls only", exc)
            return
        self._thread = thread

    def _loop(self) -> None:
        while True:
            self._wake.wait(RELAY_WAKE_S)
            while True:
                with self._lock:
                    closing = self._closing
                    if not self._waiting or self._busy:
                        break
                    mark, since = self._waiting[0]
                    if not closing and time.monotonic() - since < LATE_S:
                        break
                    self._waiting.popleft()
                    self._busy = True
                try:
                    self._send(_numbers(mark))  # may poll its events: off the training thread
                except Exception as exc:  # this thread must outlive any one mark
                    warn_once("relay-mark", "gpulens: could not send a step mark: %r", exc)
                finally:
                    with self._lock:
                        self._busy = False
            if closing:
                return

    def close(self, timeout: float) -> None:
        """Send what waits (within ``timeout`` seconds) and end the relay thread."""
        with self._lock:
            self._closing = True
            self._send_landed()
            waiting = bool(self._waiting)
        thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join(timeout)
        elif waiting:
            self._start()
            if self._thread is not None:
                self._wake.set()
                self._thread.join(timeout)
        self._thread = None

    def forget(self) -> None:
        """In a forked child: the relay thread and the waiting marks are the parent's (and its
        lock may have been held at the fork)."""
        self._lock = threading.Lock()
        self._waiting = deque()
        self._busy = False
        self._thread = None
