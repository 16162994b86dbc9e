"""comm_bound: the job waits on its interconnect: NVLink (or PCIe) busy while SM activity drops.

Per window, over the job's GPUs (rank 0's row: every GPU up to 8, the job aggregates above):
SM activity (GPM) is the mean ``sm_active_pct``; link traffic is the mean per GPU of NVLink
receive + transmit (PCIe where no NVLink moves), GB/s.  Traffic is judged against the busiest
window of the run so far (its *share* of the run's peak), since a link's real ceiling depends
on the topology (NVSwitch, the links a GPU has) that NVML does not sum up: a window that moves
half the bytes of the run's busiest one while the SMs sit mostly idle is waiting on
communication.  Windows moving under :data:`MIN_LINK_GB_PER_S` are never judged (an idle job,
a job of one GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpulens.engine.rules.base import Obs, RowView, Rule, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold

if TYPE_CHECKING:
    from gpulens.engine.rules.config import RulesConfig

SPEC = RuleSpec("comm_bound", "job", "warning",
                "communication-bound: the interconnect is busy while the SMs wait", (
    Threshold("sm_active", "SM activity (GPM sm_active_pct), mean over the job's GPUs", "<=",
              50.0, 60.0, "%", "the SMs sit idle much of the window"),
    Threshold("link_share", "NVLink (else PCIe) rx + tx GB/s per GPU, as a share of the run's "
              "busiest window", ">=", 50.0, 30.0, "%", "the links move a good part of their "
              "peak traffic meanwhile"),
))

MIN_LINK_GB_PER_S = 1.0
"""Per GPU, rx + tx: below it a window is not judged (no traffic worth the name)."""


def _links(g: Mapping[str, float], prefix: str = "", suffix: str = "") -> tuple[float, str]:
    """(rx + tx GB/s, which link) from one GPU's figures or the job aggregates."""
    nv = [g.get(f"{prefix}nvlink_{d}_gb_per_s{suffix}") for d in ("rx", "tx")]
    if any(v is not None for v in nv) and sum(v or 0.0 for v in nv) > 0:
        return sum(v or 0.0 for v in nv), "NVLink"
    pcie = [g.get(f"{prefix}pcie_{d}_gb_per_s{suffix}") for d in ("rx", "tx")]
    return sum(v or 0.0 for v in pcie), "PCIe"


class CommBound(Rule):
    advice = ("The step waits on communication. Overlap it with compute (DDP buckets: a "
              "smaller bucket_cap_mb starts the all-reduce earlier; FSDP prefetch), send fewer "
              "bytes (gradient accumulation, bf16 gradients / reduce_dtype, a larger batch per "
              "GPU), or check the topology: GPUs talking over PCIe or across nodes where "
              "NVLink was expected (nvidia-smi topo -m).")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self.peak = 0.0
        self.link = "NVLink"

    def observe(self, view: RowView) -> dict[str, Obs]:
        if view.gpus:
            sm_v = [g["sm_active_pct"] for g in view.gpus.values() if "sm_active_pct" in g]
            links = [_links(g) for g in view.gpus.values()]
            if not sm_v or len(sm_v) < len(view.gpus) or not links:
                return {}
            sm = sum(sm_v) / len(sm_v)
            rate = sum(x for x, _ in links) / len(links)
            self.link = "NVLink" if any(k == "NVLink" for _, k in links) else "PCIe"
        else:  # a large job's row: the job's aggregates
            sm_mean = view.scalars.get("gpu/all/sm_active_pct_mean")
            if sm_mean is None:
                return {}
            sm = sm_mean
            rate, self.link = _links(view.scalars, "gpu/all/", "_mean")
        if rate < MIN_LINK_GB_PER_S:
            return {}
        self.peak = max(self.peak, rate)
        share = 100 * rate / self.peak
        return {"job": view.obs(self.judge(sm_active=sm, link_share=share), {
            "sm_active_pct": sm, "link_gb_per_s": rate, "link_share_pct": share,
            "link_peak_gb_per_s": self.peak})}

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"the GPUs' SMs were active {fmt(med['sm_active_pct'], '%')} of the time while "
                f"{self.link} moved {med['link_gb_per_s']:.1f} GB/s per GPU (rx + tx), "
                f"{fmt(med['link_share_pct'], '%')} of the run's busiest window "
                f"({med['link_peak_gb_per_s']:.1f} GB/s)")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"SM activity {fmt(med.get('sm_active_pct', 0.0), '%')}, {self.link} "
                f"{med.get('link_gb_per_s', 0.0):.1f} GB/s per GPU")
