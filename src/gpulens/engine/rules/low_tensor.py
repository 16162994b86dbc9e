"""low_tensor_use: busy SMs but idle tensor pipes in a bf16/fp16 run."""

from __future__ import annotations

from collections.abc import Mapping

from gpulens.engine.rules.base import GpuRule, Obs, RowView, fmt
from gpulens.engine.rules.spec import RuleSpec, Threshold
from gpulens.work.precision import normalize_dtype

SPEC = RuleSpec("low_tensor_use", "gpu", "warning",
                "low tensor-core use in a bf16/fp16 run", (
    Threshold("sm_busy", "gpu/{i}/sm_active_pct", ">=", 50.0, 40.0, "%",
              "GPM SM activity: the rule judges busy GPUs only"),
    Threshold("tensor_share", "gpu/{i}/tensor_active_pct / gpu/{i}/sm_active_pct", "<=",
              0.10, 0.20, "", "tensor-pipe activity as a share of SM activity"),
))


class LowTensorUse(GpuRule):
    advice = ("Matrix products are not running on tensor cores: check that the forward pass "
              "runs under torch.autocast(dtype=torch.bfloat16) (or the model is cast), that "
              "matmul dimensions are multiples of 8 (16 for bf16/fp16 on Hopper), and that "
              "fp32 matmuls may use TF32 (torch.set_float32_matmul_precision('high')).")

    def observe(self, view: RowView) -> dict[str, Obs]:
        if normalize_dtype(self.config.dtype) not in ("bf16", "fp16"):
            return {}
        return super().observe(view)

    def observe_gpu(self, view: RowView, i: int, g: Mapping[str, float]) -> Obs | None:
        sm, tensor = g.get("sm_active_pct"), g.get("tensor_active_pct")
        if sm is None or tensor is None:
            return None
        share = tensor / sm if sm > 0 else 0.0
        return view.obs(self.judge(sm_busy=sm, tensor_share=share),
                        {"sm_active_pct": sm, "tensor_active_pct": tensor})

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} in a {normalize_dtype(self.config.dtype)} run: SMs "
                f"active {fmt(med['sm_active_pct'], '%')} but tensor pipes only "
                f"{fmt(med['tensor_active_pct'], '%')}")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} tensor pipes "
                f"{fmt(med.get('tensor_active_pct', 0.0), '%')} with SMs "
                f"{fmt(med.get('sm_active_pct', 0.0), '%')} active")
