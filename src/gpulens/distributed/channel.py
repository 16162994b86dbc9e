"""The job level of the gather: node leaders -> rank 0 through the launcher's store.

Each leader pushes one node summary a row (:class:`~gpulens.distributed.aggregate.NodeSummary`,
a few kB) to one queue; a thread of rank 0's waits on it (a blocking pop on a store connection
of its own: no polling) and hands what comes to the gather thread.  Torch's store queues
(``queue_push`` / ``queue_pop``: TCPStore with libuv and HashStore in recent torch) are used where
the store has them; elsewhere each leader writes numbered keys and rank 0 reads them
(``up/<node>/<n>``: one ``check`` per node a poll).  Either way no rank opens a connection of
its own to another rank, and no rank waits for another: a node that stops sending is simply
absent from the rows that follow.

A leader does not push while the queue holds more than :data:`MAX_QUEUED_PER_NODE` messages a
node (rank 0 gone or far behind): the summary is dropped and counted, so the store, which the
training uses too, never grows without bound.
"""

from __future__ import annotations

import time
from typing import Any

MAX_QUEUED_PER_NODE = 64
POLL_KEYS_S = 0.1
"""How often rank 0 looks for new keys on a store without queues."""


class UpChannel:
    """One gather's queue (keys under ``prefix``) on ``store``."""

    def __init__(self, store: Any, prefix: str, nodes: int) -> None:
        self._store = store
        self._key = prefix + "up"
        self._prefix = prefix
        self._nodes = nodes
        self._queue = hasattr(store, "queue_push")
        self._next: dict[int, int] = {}
        self.dropped = 0
        """Summaries a leader did not push (the queue was full)."""
        self.bytes_out = 0
        self.bytes_in = 0
        self.ops = 0
        """Store operations made (for the benchmarks)."""

    def push(self, node: int, payload: bytes) -> bool:
        """A leader's summary; False if dropped (the queue is full)."""
        store = self._store
        if self._queue:
            try:
                self.ops += 1
                if store.queue_len(self._key) >= MAX_QUEUED_PER_NODE * self._nodes:
                    self.dropped += 1
                    return False
                self.ops += 1
                store.queue_push(self._key, payload)
                self.bytes_out += len(payload)
                return True
            except (NotImplementedError, RuntimeError) as exc:
                if "not implemented" not in str(exc).lower() and not isinstance(
                        exc, NotImplementedError):
                    raise
                self._queue = False  # a store without queues (FileStore, an older TCPStore)
        n = int(store.add(self._prefix + f"up/{node}/n", 1))
        taken = int(store.add(self._prefix + f"up/{node}/taken", 0))
        self.ops += 2
        if n - taken > MAX_QUEUED_PER_NODE:
            store.add(self._prefix + f"up/{node}/n", -1)
            self.dropped += 1
            return False
        store.set(self._prefix + f"up/{node}/{n}", payload)
        self.ops += 1
        self.bytes_out += len(payload)
        return True

    def pop_wait(self) -> list[bytes]:
        """Rank 0's receiving thread: wait for the next summary, then take every one waiting
        (a store without queues: look every :data:`POLL_KEYS_S`).  An empty message is the
        wake-up :meth:`wake` sends at stop."""
        if self._queue:
            try:
                first = self._store.queue_pop(self._key, True)
            except (NotImplementedError, RuntimeError) as exc:
                if "not implemented" not in str(exc).lower() and not isinstance(
                        exc, NotImplementedError):
                    raise
                self._queue = False
            else:
                self.ops += 1
                self.bytes_in += len(first)
                return [first, *self.pop_all()]
        got = self.pop_all()
        if not got:
            time.sleep(POLL_KEYS_S)
        return got

    def wake(self) -> None:
        """Wake a thread waiting in :meth:`pop_wait` (an empty message)."""
        if self._queue:
            self._store.queue_push(self._key, b"")

    def pop_all(self, limit: int = 100_000) -> list[bytes]:
        """Rank 0: every summary waiting now, oldest first (never waits)."""
        store = self._store
        out: list[bytes] = []
        if self._queue:
            try:
                self.ops += 1
                waiting = int(store.queue_len(self._key))
                for _ in range(min(waiting, limit)):
                    self.ops += 1
                    out.append(store.queue_pop(self._key, False))
                self.bytes_in += sum(map(len, out))
                return out
            except (NotImplementedError, RuntimeError) as exc:
                if "not implemented" not in str(exc).lower() and not isinstance(
                        exc, NotImplementedError):
                    raise
                self._queue = False
        for node in range(self._nodes):
            while len(out) < limit:
                n = self._next.get(node, 1)
                key = self._prefix + f"up/{node}/{n}"
                self.ops += 1
                if not store.check([key]):
                    break
                out.append(store.get(key))
                store.delete_key(key)
                store.add(self._prefix + f"up/{node}/taken", 1)
                self.ops += 3
                self._next[node] = n + 1
        self.bytes_in += sum(map(len, out))
        return out
