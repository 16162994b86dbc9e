"""A take's token and FLOPs counts on their way off the training thread: the lengths' copy to
the host started at the take, summed by whoever reads them (:class:`DeferredCount`), or reduced
on the device by that reader. Used by :class:`gpulens.work.hf.TokenCounter`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from gpulens.log import warn_once

if TYPE_CHECKING:
    from gpulens.work.hf import TokenCounter

__all__ = ["PYTHON_SUM_MAX", "DeferredCount", "home_device", "on_one_device"]


PYTHON_SUM_MAX = 100
"""Up to this many sequence lengths a take's host copy is summed in Python (4 us for 16, 11 us
for 64), beyond with torch on the host tensor (16-20 us whatever the number; Python took 600
us for 4,096): ``benchmarks/results/2026-11-27-cpu-relay-layout/lengths_out.txt``."""


class _Pending:
    """The kept counts of one take, reduced once, by the first reader (any thread).

    The usual take holds only sequence lengths (attention masks' row sums, ``cu_seq_lens_q``
    differences).  Their one copy to the host starts **on the training thread, at the take**
    (a ``cat`` of the micro-batches' lengths, the copy to pinned memory and an event behind it:
    three launches, no wait), and the reader only asks the event and sums the host's integers:
    in Python, or with torch on the host tensor beyond :data:`PYTHON_SUM_MAX`.  So
    :meth:`landed` can tell, without waiting, when the sums can be had, and the training thread
    reads them itself at its next ``log()`` (:mod:`gpulens.transport.relay`): no other thread of
    the training process wakes for them.  Packed ``position_ids`` (a figure per token) and folded
    totals are reduced on the device by the reader (a dozen operations: the relay thread, a
    second later), and their two sums copied.

    Device work runs on the stream the training thread used when it took the counts (the kept
    tensors were made there, so it comes after them).  Copies reach the host without a
    blocking wait: each is polled (:func:`gpulens.transport.relay.stage`): a thread blocked in a
    device copy holds the training thread up too (``transport/relay.py``).
    """

    def __init__(self, counter: TokenCounter, lengths: list[Any], positions: list[Any],
                 folded: tuple[Any, Any] | None) -> None:
        self._counter = counter
        self._parts: tuple[list[Any], list[Any], tuple[Any, Any] | None] | None = (
            lengths, positions, folded)
        self._plain = (counter._tokens, counter._flops)
        self._stream = _stream_of([*lengths, *positions, *(folded or ())])
        self._result: tuple[float, float | None] | None = None
        self._lock = threading.Lock()
        self._copy: Any = None
        """The lengths' copy to the host, started at the take (see the class doc)."""
        if lengths and not positions and folded is None:
            self._copy = _stage_lengths(lengths)
            if self._copy is not None:
                self._parts = None

    def result(self) -> tuple[float, float | None]:
        with self._lock:
            if self._result is None:
                if self._copy is not None:
                    from gpulens.transport.relay import Staged

                    staged, self._copy = self._copy, None
                    self._result = self._sum_host(staged.value() if isinstance(staged, Staged)
                                                  else staged)
                else:
                    assert self._parts is not None
                    parts, self._parts = self._parts, None
                    self._result = self._reduce(*parts)
            return self._result

    def landed(self) -> bool:
        """Whether :meth:`result` can be had now without waiting for the device: the take's
        lengths have reached the host (never waits).  A take reduced on the device by its
        reader (packed positions, folded totals) is not."""
        if self._result is not None:
            return True
        staged = self._copy
        if staged is None:
            return False
        from gpulens.transport.relay import Staged

        return staged.landed() if isinstance(staged, Staged) else True

    def _sum_host(self, host: Any) -> tuple[float, float | None]:
        """(tokens, FLOPs) of the lengths' host copy, the plain counts added."""
        plain_tokens, plain_flops = self._plain
        formula = self._counter.formula
        host_tokens: float | None
        host_flops: float | None
        if host.numel() <= PYTHON_SUM_MAX:
            values: list[int] = host.tolist()
            host_tokens = float(sum(values))
            host_flops = (None if formula is None
                          else formula.training_flops(values, self._counter.attention))
        else:  # many lengths: torch on the host copy, a flat ~20 us
            host_tokens = float(host.sum())
            flops_t = self._counter._flops_of_lengths(host)
            host_flops = None if flops_t is None else float(flops_t)
        return (host_tokens + plain_tokens,
                host_flops + plain_flops if host_flops is not None else None)

    def _reduce(self, lengths: list[Any], positions: list[Any],
                folded: tuple[Any, Any] | None) -> tuple[float, float | None]:
        import contextlib

        import torch

        from gpulens.transport.relay import stage

        context: Any = contextlib.nullcontext()
        if self._stream is not None:
            context = torch.cuda.stream(self._stream)
        plain_tokens, plain_flops = self._plain
        with context:
            tokens, flops = self._counter._reduce_tensors(lengths, positions, folded)
            staged = [stage(x.to(torch.float64)) if isinstance(x, torch.Tensor) else x
                      for x in (tokens, flops)]
        host_tokens, host_flops = (_host_float(x) for x in staged)
        assert host_tokens is not None
        return (host_tokens + plain_tokens,
                host_flops + plain_flops if host_flops is not None else None)


def _stage_lengths(lengths: list[Any]) -> Any:
    """On the training thread, at a take: the micro-batches' lengths as one tensor on its way
    to the host (:func:`gpulens.transport.relay.stage`: a ``Staged`` copy for CUDA tensors,
    the tensor itself on a CPU), or ``None`` if that failed (the reader then reduces the
    lengths itself)."""
    import torch

    from gpulens.transport.relay import stage

    try:
        lengths = on_one_device(lengths)
        return stage(torch.cat(lengths) if len(lengths) > 1 else lengths[0])
    except Exception as exc:  # never into training: the reader's path still counts them
        warn_once("tokens:stage", "gpulens: could not start the copy of the token counts "
                  "(%s: %s); they are reduced off the training thread instead",
                  type(exc).__name__, exc)
        return None


def _host_float(value: Any) -> float | None:
    """A staged device copy's value once its event says it landed (polled); a number or a
    host tensor as it is."""
    from gpulens.transport.relay import Staged

    if isinstance(value, Staged):
        value = value.value()
    return None if value is None else float(value)


def home_device(tensors: list[Any]) -> Any:
    """The device where counts kept on several devices meet (``nn.DataParallel`` runs a
    replica's forward, the counter's pre-hook included, on every GPU: its masks stay there):
    the lowest-numbered CUDA device of theirs (a device, never the host: a copy to the host
    would be read before it landed), so that every take and fold of one counter picks the
    same; ``None`` when they all share one (the usual case: nothing moves)."""
    devices = {t.device for t in tensors if hasattr(t, "device")}
    if len(devices) <= 1:
        return None
    return min(devices, key=lambda d: (d.type != "cuda", d.type,
                                       -1 if d.index is None else d.index))


def on_one_device(tensors: list[Any], home: Any = None) -> list[Any]:
    """``tensors`` with those off ``home`` (default: :func:`home_device`) copied there (no wait:
    a device-to-device copy, ordered behind the tensor's work by torch)."""
    if home is None:
        home = home_device(tensors)
    if home is None:
        return tensors
    return [t.to(home, non_blocking=True)
            if hasattr(t, "device") and t.device != home else t for t in tensors]


def _stream_of(tensors: list[Any]) -> Any:
    """The training thread's current stream on the device the tensors' counts meet on (the
    first CUDA tensor's, or :func:`home_device`'s), or None."""
    home = home_device(tensors)
    for t in tensors:
        if getattr(t, "is_cuda", False):
            import torch

            return torch.cuda.current_stream(home if home is not None else t.device)
    return None


class DeferredCount:
    """One figure (tokens or FLOPs) of a :meth:`TokenCounter.take_deferred`: ``item()`` (or
    ``float()``) reduces the kept counts and returns once their sums have reached the host
    (polling an event, never a blocking device read); call it off the training thread. Reading
    either figure reduces both, once."""

    def __init__(self, pending: _Pending, index: int) -> None:
        self._pending = pending
        self._index = index

    def item(self) -> float:
        value = self._pending.result()[self._index]
        if value is None:
            raise ValueError("no FLOPs formula: the FLOPs of these tokens are unknown")
        return float(value)

    def __float__(self) -> float:
        return self.item()

    def landed(self) -> bool:
        """Whether ``item()`` would return without waiting for the device (never waits):
        ``Monitor.log`` converts a mark on the training thread once this holds."""
        return self._pending.landed()
