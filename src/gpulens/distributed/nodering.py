"""The node level of the gather: a shared-memory file that the ranks of one node write and its
leader reads.  No socket, no collective: a rank that dies or stalls leaves its slot as it was,
and no other rank ever waits on it.

Layout (float64 cells, native byte order; all ranks of a node run on one host)::

    header       [MAGIC, VERSION, slots, ring, width, creator pid, 0, 0]
    slot i       [state, rank, pid, written, beat, final, 0, 0]          (SLOT_HEAD cells)
                 ring x [seq, value_0 .. value_{width-1}, seq]            (width + 2 cells each)

A slot's ``pid`` is its writer's: the rank's engine process where the engines gather (it says
so as it opens the file, before it answers its start: the engine still writes the rows of the
steps its training process logged after that process has exited), else the training process.

Each slot has one writer (its rank, under a lock of that process) and one reader (the
node's leader).  Entry ``seq`` goes to ring position ``seq % ring``: the writer marks the entry's
head invalid (NaN), writes the values, the tail, then the head, and last raises ``written`` to
``seq + 1``.  The reader takes an entry only if its head and tail both read ``seq`` before and
after it copied the values; an entry overwritten by a writer ``ring`` entries ahead (a leader
that fell that far behind) is counted as lost.  Aligned 8-byte stores are single copy-atomic on
x86-64 and AArch64; the head/tail check covers the order in which another core may see them.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import time
from pathlib import Path

MAGIC = 7.0e9 + 1.0  # "gpulens ring": any value that a zero-filled file cannot hold
VERSION = 1.0
HEADER = 8
SLOT_HEAD = 8
_STATE, _RANK, _PID, _WRITTEN, _BEAT, _FINAL = range(6)

EMPTY = 0.0
"""Slot state: nobody attached yet."""
RUNNING = 1.0
DONE = 2.0
"""The rank has stopped: ``final`` entries were written in all."""

LOST = "lost"
""":meth:`NodeRing.read` of an entry that was overwritten before it was read."""


def ring_dir() -> Path:
    """``/dev/shm`` where it exists and is writable (memory, not disk), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def sweep_stale(folder: Path) -> int:
    """Remove this user's node files whose leader process is gone (a job killed before its
    leader could remove its file); returns how many."""
    removed = 0
    uid = os.getuid()
    for path in folder.glob("gpulens-*-n*"):
        try:
            if path.stat().st_uid != uid or path.stat().st_size < 8 * HEADER:
                continue
            with path.open("rb") as f:
                head = memoryview(f.read(8 * HEADER)).cast("d")
            if head[0] != MAGIC or pid_alive(int(head[5])):
                continue
            path.unlink()
            removed += 1
        except OSError:
            continue
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and, where ``/proc`` tells, is not a zombie (an
    engine that died under a training process that exited is reparented; in a container whose
    first process reaps nothing it stays a zombie for good)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc (macOS), or it ended just now: the next look tells
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] != b"Z"


class NodeRing:
    """One node's shared file (module doc).  Make it with :meth:`create` (the leader) or
    :meth:`attach` (the other ranks of the node)."""

    def __init__(self, path: Path, fd: int, slots: int, ring: int, width: int,
                 owner: bool) -> None:
        self.path = path
        self.slots, self.ring, self.width = slots, ring, width
        self.owner = owner
        size = self.size(slots, ring, width)
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        self._cells = memoryview(self._map).cast("d")
        self._entry = width + 2
        self._slot_size = SLOT_HEAD + ring * self._entry

    @staticmethod
    def size(slots: int, ring: int, width: int) -> int:
        """Bytes of the file."""
        return 8 * (HEADER + slots * (SLOT_HEAD + ring * (width + 2)))

    @classmethod
    def create(cls, path: Path, slots: int, ring: int, width: int) -> NodeRing:
        """Make the file (it must not exist: its name is unique to the job) and its header;
        first remove stale node files of this user (:func:`sweep_stale`)."""
        sweep_stale(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, cls.size(slots, ring, width))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        made = cls(path, fd, slots, ring, width, owner=True)
        cells = made._cells
        cells[1], cells[2], cells[3], cells[4] = VERSION, float(slots), float(ring), float(width)
        cells[5] = float(os.getpid())
        cells[0] = MAGIC  # last: an attaching rank checks it
        return made

    @classmethod
    def attach(cls, path: Path, slots: int, ring: int, width: int) -> NodeRing:
        """Open the leader's file; ``ValueError`` if it is not one of ours of this shape."""
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != cls.size(slots, ring, width):
            os.close(fd)
            raise ValueError(f"{path}: not a gpulens node ring of {slots} slot(s)")
        opened = cls(path, fd, slots, ring, width, owner=False)
        head = tuple(opened._cells[0:5])
        if head != (MAGIC, VERSION, float(slots), float(ring), float(width)):
            opened.close()
            raise ValueError(f"{path}: not a gpulens node ring of this job ({head})")
        return opened

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} of {self.slots}")
        return HEADER + slot * self._slot_size

    # -- a rank, on its own slot --------------------------------------------------------------
    def claim(self, slot: int, rank: int, pid: int) -> None:
        """Take ``slot`` for ``rank``, written by process ``pid`` (until :meth:`writer` says
        another): nothing written yet."""
        base = self._slot(slot)
        c = self._cells
        c[base + _WRITTEN] = 0.0
        c[base + _FINAL] = math.nan
        c[base + _RANK] = float(rank)
        c[base + _PID] = float(pid)
        c[base + _BEAT] = time.time()
        c[base + _STATE] = RUNNING

    def writer(self, slot: int, pid: int) -> None:
        """The process that writes ``slot`` from now on is ``pid`` (an engine that started)."""
        self._cells[self._slot(slot) + _PID] = float(pid)

    def write(self, slot: int, seq: int, values: list[float]) -> None:
        """Entry ``seq`` of ``slot`` (``len(values) == width``); seqs come in order from 0."""
        if len(values) != self.width:
            raise ValueError(f"{len(values)} values for a ring of width {self.width}")
        base = self._slot(slot)
        at = base + SLOT_HEAD + (seq % self.ring) * self._entry
        c = self._cells
        c[at] = math.nan
        c[at + 1:at + 1 + self.width] = memoryview(_pack(values)).cast("d")
        c[at + 1 + self.width] = float(seq)
        c[at] = float(seq)
        c[base + _BEAT] = time.time()
        c[base + _WRITTEN] = float(seq + 1)

    def finish(self, slot: int, written: int) -> None:
        """This rank has stopped after ``written`` entries."""
        base = self._slot(slot)
        self._cells[base + _FINAL] = float(written)
        self._cells[base + _STATE] = DONE

    # -- the leader ---------------------------------------------------------------------------
    def state(self, slot: int) -> tuple[float, int, int, int, int | None]:
        """``(state, rank, pid, written, final)`` of ``slot`` (``final`` ``None`` until done)."""
        base = self._slot(slot)
        c = self._cells
        state = c[base + _STATE]
        final = c[base + _FINAL]
        return (state, int(c[base + _RANK]) if state != EMPTY else -1,
                int(c[base + _PID]) if state != EMPTY else 0, int(c[base + _WRITTEN]),
                int(final) if state == DONE and math.isfinite(final) else None)

    def read(self, slot: int, seq: int) -> list[float] | str | None:
        """Entry ``seq`` of ``slot``: its values, :data:`LOST` if it was overwritten, ``None``
        if it is not written yet (or is being written now)."""
        base = self._slot(slot)
        c = self._cells
        if seq >= int(c[base + _WRITTEN]):
            return None
        at = base + SLOT_HEAD + (seq % self.ring) * self._entry
        head = c[at]
        if head != seq:
            return LOST if head > seq or (math.isnan(head) and seq + self.ring
                                          < int(c[base + _WRITTEN])) else None
        values: list[float] = c[at + 1:at + 1 + self.width].tolist()  # type: ignore[assignment]
        if c[at + 1 + self.width] != seq or c[at] != seq:
            return LOST if c[at] > seq else None
        return values

    def close(self) -> None:
        """Unmap; the owner (the leader) also removes the file.  Idempotent."""
        cells = getattr(self, "_cells", None)
        if cells is None:
            return
        self._cells = None  # type: ignore[assignment]
        cells.release()
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if self.owner:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _pack(values: list[float]) -> bytes:
    import array

    return array.array("d", values).tobytes()
