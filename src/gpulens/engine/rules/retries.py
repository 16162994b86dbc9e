"""memory_alloc_retries: the torch caching allocator retried or ran out of memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpulens.engine.rules.base import CLEAR, FIRE, GpuRule, Obs, RowView, Track, pick
from gpulens.engine.rules.spec import RuleSpec, Threshold

if TYPE_CHECKING:
    from gpulens.engine.rules.config import RulesConfig

SPEC = RuleSpec("memory_alloc_retries", "gpu", "warning",
                "the torch allocator retried or ran out of memory", (
    Threshold("new_events", "new gpu/{i}/torch_alloc_retries + gpu/{i}/torch_ooms", ">=",
              1.0, 1.0, "count", "allocator retries and OOMs counted in the window"),
), fire_share=0.2, clear_share=1.0)


class AllocRetries(GpuRule):
    advice = ("The caching allocator could not find memory: each retry frees its cache and "
              "synchronises the device. Reduce the (micro-)batch or sequence length, set "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and avoid shapes that change "
              "every step.")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self._last: dict[tuple[int, str], float] = {}

    def _new(self, i: int, key: str, value: float | None) -> float | None:
        if value is None:
            return None
        prev = self._last.get((i, key))
        self._last[(i, key)] = value
        if prev is None:
            return 0.0
        return value - prev if value >= prev else value  # a reset counter restarts from 0

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        retries = self._new(i, "torch_alloc_retries", g.get("torch_alloc_retries"))
        ooms = self._new(i, "torch_ooms", g.get("torch_ooms"))
        if retries is None and ooms is None:
            return None
        new = (retries or 0.0) + (ooms or 0.0)
        fired = self.spec.threshold("new_events").at_fire(new)
        return view.obs(FIRE if fired else CLEAR, {
            "new_retries": retries or 0.0, "new_ooms": ooms or 0.0,
            **pick(g, ("torch_alloc_retries", "torch_ooms"))}, force=bool(ooms), sampled=False)

    summarised = "counts are totals"

    def summary(self, track: Track, level: int | None) -> dict[str, float]:
        fired = [o for o in track.obs if o.level == FIRE]
        return {
            "windows_with_events": float(len(fired)),
            "windows": float(len(track.obs)),
            "new_retries": sum(o.figures.get("new_retries", 0.0) for o in track.obs),
            "new_ooms": sum(o.figures.get("new_ooms", 0.0) for o in track.obs),
        }

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        parts = []
        if med.get("new_ooms"):
            parts.append(f"{med['new_ooms']:.0f} out-of-memory error(s)")
        if med.get("new_retries"):
            parts.append(f"{med['new_retries']:.0f} allocation retries")
        return (f"{self.label(subject)}: the torch allocator counted "
                f"{' and '.join(parts) or 'retries'} (torch.cuda.memory_stats)")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)}: no allocator retries or OOMs in the last "
                f"{med.get('windows', 0):.0f} windows")
