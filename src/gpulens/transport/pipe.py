"""The pipe between a training process and its engine process: framed, pickled messages.

A frame is a 4-byte little-endian length and a pickle.  :class:`Sender` never blocks when
asked not to: bytes the pipe cannot take now wait in a bounded queue, which a short-lived
flusher thread writes out as the reader makes room (the training thread's ``log()`` sends this
way, so a engine process that stalls or dies costs training nothing).  Control messages
(``force=True``) are never dropped for the bound.  :class:`Receiver` reads frames in a thread
of its own, blocking in ``os.read`` with the GIL released, or polls (:meth:`Receiver.poll`).

Why the engine process polls its end rather than blocking on it: a write to a pipe that a
reader sleeps on wakes that reader, and the waking is paid by the writer.  On the 2-core
development VM, ``pickle`` + ``os.write`` of a mark took 21 us (median) with a reader asleep in
``read`` and 4.7 us with a reader that polls every 20 ms (``benchmarks/pipe_wake.py``).  The
training thread is the writer.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import threading
import time
from collections import deque
from typing import Any

_LEN = struct.Struct("<I")
MAX_PENDING_BYTES = 16 * 1024 * 1024
"""Bytes a non-blocking sender may hold back before it drops new messages (counted)."""
FLUSH_S = 0.01
"""How often a non-blocking sender's flusher thread retries a backlog the pipe did not take."""
_FLUSH_CHUNK = 256 * 1024
"""Most bytes the flusher writes per hold of the lock (a sender waiting to queue waits less)."""


class LinkClosed(Exception):
    """The other end is gone."""


class Sender:
    """Writes frames to ``fd`` (see module doc).  Thread-safe.

    A non-blocking sender whose pipe is full queues what it cannot write and starts a flusher
    thread (one at a time, ``gpulens-flush``) that writes the backlog every :data:`FLUSH_S`
    until it is gone, then ends; while a backlog exists, ``send`` only queues.
    """

    def __init__(self, fd: int, *, blocking: bool) -> None:
        self.fd = fd
        self.blocking = blocking
        os.set_blocking(fd, blocking)
        self._pending: deque[memoryview] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self.dropped = 0
        """Messages dropped because the queue was full."""
        self.broken = False
        """The other end is gone (a write failed); nothing more is sent."""
        self._fd_closed = False

    @property
    def closed(self) -> bool:
        """Nothing more can be sent: the other end is gone or :meth:`close` was called."""
        return self.broken or self._fd_closed

    def send(self, obj: Any, *, force: bool = False) -> bool:
        """Queue ``obj`` and write what the pipe takes.  False if it was dropped or the other
        end is gone (then ``closed`` is true).  ``force``: queue it even beyond
        :data:`MAX_PENDING_BYTES` (control messages, which must not be lost)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _LEN.pack(len(payload)) + payload
        start_flusher = False
        with self._lock:
            if self.closed:
                return False
            if not self._pending:  # the usual case: one write, nothing queued
                try:
                    n = os.write(self.fd, frame)
                except BlockingIOError:
                    n = 0
                except OSError:
                    self._break_locked()
                    return False
                if n == len(frame):
                    return True
                if n:  # the rest of a frame begun must follow it, whatever the queue holds
                    self._pending.append(memoryview(frame)[n:])
                    self._pending_bytes += len(frame) - n
                else:
                    if not force and len(frame) > MAX_PENDING_BYTES:
                        self.dropped += 1
                        return False
                    self._pending.append(memoryview(frame))
                    self._pending_bytes += len(frame)
            else:
                if not force and self._pending_bytes + len(frame) > MAX_PENDING_BYTES:
                    self.dropped += 1
                    return False
                self._pending.append(memoryview(frame))
                self._pending_bytes += len(frame)
            if self.blocking:
                self._flush_locked()
            elif self._flusher is None:
                # the backlog moves in a thread of its own, not with the next send
                self._flusher = threading.Thread(target=self._flush_loop,
                                                 name="gpulens-flush", daemon=True)
                start_flusher = True
            ok = not self.closed
        if start_flusher:
            self._start_flusher()
        return ok

    def _start_flusher(self) -> None:
        thread = self._flusher
        if thread is None:
            return
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the next send() tries again
            with self._lock:
                self._flush_locked()
                if self._flusher is thread:
                    self._flusher = None

    def _flush_loop(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    wrote = self._flush_locked(limit=_FLUSH_CHUNK)
                    if self.closed or not self._pending:
                        return
                if not wrote:  # the pipe is full: the reader takes its time
                    time.sleep(FLUSH_S)
        except Exception:
            with self._lock:
                self._break_locked()
        finally:
            with self._lock:
                if self._flusher is me:
                    self._flusher = None

    def flush(self) -> None:
        """Write what is queued (blocking senders: all of it)."""
        with self._lock:
            self._flush_locked()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _flush_locked(self, limit: int | None = None) -> int:
        """Write queued bytes until the pipe is full (or ``limit`` bytes); the bytes written."""
        wrote = 0
        while self._pending and not self.closed:
            if limit is not None and wrote >= limit:
                break
            head = self._pending[0]
            chunk = head if limit is None else head[:limit - wrote]
            try:
                n = os.write(self.fd, chunk)
            except BlockingIOError:
                break
            except OSError:
                self._break_locked()
                break
            wrote += n
            self._pending_bytes -= n
            if n == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head[n:]
        return wrote

    def _break_locked(self) -> None:
        """The other end is gone: forget the queue (the fd stays open until close())."""
        self.broken = True
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        """Close the fd (once, whether or not the other end is gone)."""
        with self._lock:
            self._pending.clear()
            self._pending_bytes = 0
            if not self._fd_closed:
                self._fd_closed = True
                with contextlib.suppress(OSError):
                    os.close(self.fd)

    def abandon(self) -> None:
        """In a forked child: close this process's copy of the fd without the lock (another
        thread of the parent may have held it at the fork) and send nothing more."""
        self._lock = threading.Lock()
        self._pending = deque()
        self._pending_bytes = 0
        self._flusher = None
        if not self._fd_closed:
            self._fd_closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


class Receiver:
    """Reads frames from ``fd`` (blocking)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, True)
        self._buf = bytearray()
        self.eof = False
        self._close_lock = threading.Lock()
        self.closed = False

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = os.read(self.fd, max(65536, n - len(self._buf)))
            if not chunk:
                raise LinkClosed
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def recv(self) -> Any:
        """The next message; :class:`LinkClosed` at end of file."""
        (size,) = _LEN.unpack(self._read_exact(_LEN.size))
        return pickle.loads(self._read_exact(size))

    def poll(self) -> list[Any]:
        """Every complete message that can be read now, without waiting (the fd is made
        non-blocking).  ``eof`` is set once the other end has closed and all is read."""
        os.set_blocking(self.fd, False)
        while not self.eof:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self._buf += chunk
        out: list[Any] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= _LEN.size:
            (size,) = _LEN.unpack_from(buf, pos)
            if len(buf) - pos - _LEN.size < size:
                break
            start = pos + _LEN.size
            out.append(pickle.loads(buf[start:start + size]))
            pos = start + size
        del buf[:pos]
        return out

    def close(self) -> None:
        """Close the fd, once: a second call must not close a number the fd's has been
        reused for.  Never while another thread reads it (the read would go on, on the
        reused number)."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def abandon(self) -> None:
        """In a forked child: close this process's copy of the fd (without the lock)."""
        self._close_lock = threading.Lock()
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)
