"""The pipe between a training process and its sampler process: framed, pickled messages.

A frame is a 4-byte little-endian length and a pickle.  :class:`Sender` never blocks when
asked not to: bytes the pipe cannot take now wait in a bounded queue and go out with the next
send (the training thread's ``log()`` sends this way, so a sampler process that stalls or dies
costs training nothing).  :class:`Receiver` reads frames in a thread of its own, blocking in
``os.read`` with the GIL released, or polls (:meth:`Receiver.poll`).

Why the sampler process polls its end rather than blocking on it: a write to a pipe that a
reader sleeps on wakes that reader, and the waking is paid by the writer.  Measured on a 2-core
VM, ``pickle`` + ``os.write`` of a mark took 25 us (median) with a reader blocked in ``read``
and 5 us with a reader that polls every 20 ms.  The training thread is the writer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import struct
import threading
from collections import deque
from typing import Any

_LEN = struct.Struct("<I")
MAX_PENDING_BYTES = 16 * 1024 * 1024
"""Bytes a non-blocking sender may hold back before it drops new messages (counted)."""


class LinkClosed(Exception):
    """The other end is gone."""


class Sender:
    """Writes frames to ``fd`` (see module doc).  Thread-safe."""

    def __init__(self, fd: int, *, blocking: bool) -> None:
        self.fd = fd
        self.blocking = blocking
        os.set_blocking(fd, blocking)
        self._pending: deque[memoryview] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.dropped = 0
        """Messages dropped because the queue was full."""
        self.closed = False

    def send(self, obj: Any) -> bool:
        """Queue ``obj`` and write what the pipe takes.  False if it was dropped or the other
        end is gone (then ``closed`` is true)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _LEN.pack(len(payload)) + payload
        with self._lock:
            if self.closed:
                return False
            if not self._pending:  # the usual case: one write, nothing queued
                try:
                    n = os.write(self.fd, frame)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    if exc.errno in (errno.EPIPE, errno.EBADF):
                        self._close_locked()
                        return False
                    raise
                if n == len(frame):
                    return True
                if n:  # the rest of a frame begun must follow it, whatever the queue holds
                    self._pending.append(memoryview(frame)[n:])
                    self._pending_bytes += len(frame) - n
                    return True
            if self._pending_bytes + len(frame) > MAX_PENDING_BYTES:
                self.dropped += 1
                return False
            self._pending.append(memoryview(frame))
            self._pending_bytes += len(frame)
            self._flush_locked()
            return not self.closed

    def flush(self) -> None:
        """Write what is queued (blocking senders: all of it)."""
        with self._lock:
            self._flush_locked()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _flush_locked(self) -> None:
        while self._pending:
            head = self._pending[0]
            try:
                n = os.write(self.fd, head)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    self._close_locked()
                    return
                raise
            self._pending_bytes -= n
            if n == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head[n:]

    def _close_locked(self) -> None:
        self.closed = True
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self._close_locked()
                os.close(self.fd)


class Receiver:
    """Reads frames from ``fd`` (blocking)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, True)
        self._buf = bytearray()
        self.eof = False

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
        with contextlib.suppress(OSError):
            os.close(self.fd)
