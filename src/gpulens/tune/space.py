"""Which batch sizes a sweep may try: the coarse pass (about doubling) and the points between.

* Default: powers of two and multiples of ``batch_multiple`` (8: what GPU kernels like), from
  ``min_batch`` to ``max_batch``. The coarse pass is the powers of two.
* An explicit list (``batch_sizes``): only those; the coarse pass keeps each size at least
  twice the previous one kept.
* A fixed global batch ``G`` over ``world`` ranks: the per-device batch sizes ``b`` that divide
  ``G / world`` (accumulation ``G / (world x b)``), coarse pass as for a list.

:meth:`BatchSpace.between` picks the allowed size closest to the geometric middle of two sizes,
so the search around the best size halves its interval (in ratio) each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpulens.tune.model import TuneSettings


@dataclass(frozen=True)
class BatchSpace:
    """The allowed per-device batch sizes (``sizes``: ``None`` for the unbounded default form,
    where ``multiple`` and the bounds describe the set)."""

    sizes: tuple[int, ...] | None
    min_batch: int = 1
    max_batch: int = 65536
    multiple: int = 8
    global_batch: int | None = None
    world_size: int = 1

    @classmethod
    def from_settings(cls, settings: TuneSettings, world_size: int = 1) -> BatchSpace:
        """The space a sweep with these settings searches (``ValueError`` for a global batch
        that the ranks cannot share)."""
        lo, hi = settings.min_batch, settings.max_batch
        if settings.global_batch is not None:
            g = settings.global_batch
            if g % world_size:
                raise ValueError(f"gpulens tune: global_batch {g} is not a multiple of the "
                                 f"world size {world_size}")
            per_rank = g // world_size
            sizes = tuple(b for b in range(1, per_rank + 1) if per_rank % b == 0
                          and lo <= b <= hi and (settings.batch_sizes is None
                                                 or b in settings.batch_sizes))
            if not sizes:
                raise ValueError(f"gpulens tune: no batch size between {lo} and {hi} divides "
                                 f"the global batch {g} over {world_size} rank(s)")
            return cls(sizes, lo, hi, settings.batch_multiple, g, world_size)
        if settings.batch_sizes is not None:
            sizes = tuple(b for b in settings.batch_sizes if lo <= b <= hi)
            if not sizes:
                raise ValueError(f"gpulens tune: no batch size of {list(settings.batch_sizes)}"
                                 f" lies between {lo} and {hi}")
            return cls(sizes, lo, hi, settings.batch_multiple, None, world_size)
        return cls(None, lo, hi, settings.batch_multiple, None, world_size)

    def accumulation(self, batch_size: int) -> int:
        """Gradient-accumulation steps that keep the global batch (1 without one)."""
        if self.global_batch is None:
            return 1
        return self.global_batch // (self.world_size * batch_size)

    def allowed(self, b: int) -> bool:
        if self.sizes is not None:
            return b in self.sizes
        return self.min_batch <= b <= self.max_batch and (
            b % self.multiple == 0 or b & (b - 1) == 0)

    def coarse(self) -> list[int]:
        """The coarse pass, ascending: each size about twice the previous one."""
        if self.sizes is None:
            out, b = [], 1
            while b <= self.max_batch:
                if b >= self.min_batch:
                    out.append(b)
                b *= 2
            if not out or out[0] != self.min_batch:
                out.insert(0, self.min_batch)
            return out
        kept: list[int] = []
        for b in self.sizes:
            if not kept or b >= 2 * kept[-1]:
                kept.append(b)
        if kept[-1] != self.sizes[-1]:
            kept.append(self.sizes[-1])
        return kept

    def between(self, lo: int, hi: int) -> int | None:
        """The allowed size strictly between ``lo`` and ``hi`` closest to ``sqrt(lo x hi)``
        (``None`` when there is none)."""
        if hi - lo < 2:
            return None
        middle = math.sqrt(lo * hi)
        if self.sizes is not None:
            inside: Sequence[int] = [b for b in self.sizes if lo < b < hi]
        else:
            m = self.multiple
            near = {int(middle)}
            near.update({(int(middle) // m) * m, (int(middle) // m + 1) * m})
            p = 1 << max(0, int(math.log2(middle)))
            near.update({p, 2 * p})
            inside = [b for b in near if lo < b < hi and self.allowed(b)]
        if not inside:
            return None
        return min(inside, key=lambda b: (abs(math.log(b / middle)), b))
