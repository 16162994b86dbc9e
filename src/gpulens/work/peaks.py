"""Peak FLOP/s per GPU and dtype that gpulens can defend: dense figures, each with its source.

Rules of the table:

* **Dense only, never the sparsity figure.** Vendors print tensor-core peaks "with sparsity"
  (2:4 structured sparsity, twice the dense rate; NVIDIA's data-centre datasheets since the
  A100 mark them with an asterisk). Where a document prints only that figure, the entry holds
  half of it and says so in ``note``.
* **One column per dtype**: ``bf16``/``fp16`` (tensor cores, FP32 accumulate: what mixed
  precision training runs), ``tf32`` (tensor cores), ``fp32`` (FP32 products without TF32:
  CUDA cores on NVIDIA, FP32 matrix cores on AMD), ``fp8``, ``int8`` (TOPS). A column the
  card does not have is absent (Volta and Turing have no BF16 or TF32): no figure, no MFU.
  GeForce cards run FP16/BF16 products with FP32 accumulate at half their FP16-accumulate
  rate; the table holds the FP32-accumulate figure.
* **Every entry cites** the vendor document it was read from (``source``). Some entries are
  derived from a vendor's per-SM rate and the card's SM count and boost clock; ``note`` says
  so and shows the product.
* **Variants the name does not tell apart** (H100 SXM/PCIe/NVL, H200 SXM/NVL, H800 SXM/PCIe,
  A100 40/80 GB and SXM/PCIe, RTX 3080 10/12 GB) are told apart by the board's memory size and
  its *default* (maximum) power limit; when those do not settle it, there is no peak.
* **An unknown GPU, dtype or variant gets no peak** (``None``) and one WARNING naming the GPU
  through the ``gpulens`` logger — never a borrowed figure (torchtitan falls back to the A100's
  312 TFLOP/s, Composer to 0, verl to infinity).

:func:`peak_for` is the entry point.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gpulens.log import warn_once
from gpulens.work.precision import normalize_dtype


@dataclass(frozen=True)
class PeakEntry:
    """Dense peak rates of one GPU (variant), per dtype, with the document they come from."""

    gpu: str
    """Canonical name, e.g. ``"H100 SXM5 80GB"``."""
    tflops: Mapping[str, float]
    """Dense TFLOP/s per dtype (``int8``: TOPS)."""
    source: str
    """The vendor document: title and URL."""
    note: str = ""
    """How the figures were read (halved from a sparsity figure, derived from SMs x clock)."""


@dataclass(frozen=True)
class GpuPeak:
    """The peak one run divides by: one GPU, one dtype."""

    gpu: str
    dtype: str
    tflops: float
    """Dense TFLOP/s of one GPU in this dtype."""
    source: str
    note: str = ""
    nvml_name: str = ""
    """The name the peak was looked up by."""

    @property
    def flops(self) -> float:
        """FLOP/s of one GPU."""
        return self.tflops * 1e12

    def describe(self) -> dict[str, str | float]:
        """The denominator of MFU, for the run's metadata."""
        return {
            "peak_gpu": self.gpu,
            "peak_dtype": self.dtype,
            "peak_tflops": self.tflops,
            "peak_source": self.source,
        }


def _t(**rates: float) -> Mapping[str, float]:
    return MappingProxyType(dict(rates))


# --- sources -------------------------------------------------------------------------------

_HOPPER_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'NVIDIA H100 SXM5 / "
              "H100 PCIe' (dense and sparse columns), "
              "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet, columns 'H100 SXM | H100 NVL', "
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet, columns 'H200 SXM | H200 NVL', "
            "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446")
_GH200_DS = ("NVIDIA GH200 Grace Hopper Superchip datasheet, "
             "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip")
_H800_DS = ("NVIDIA H800 Tensor Core GPU datasheet (NVIDIA China), columns 'H800 SXM | H800 "
            "PCIe', https://www.nvidia.cn/data-center/h800/")
_BLACKWELL_DS = ("NVIDIA Blackwell datasheet, columns 'GB200 NVL72 | HGX B200 | HGX B100' "
                 "(whole-system figures; per GPU = / 72 or / 8), "
                 "https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
            "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A800_DS = ("NVIDIA A800 datasheet (A800 40GB Active and A800 SXM4/PCIe 80GB: the A100's "
            "GA100 rates), https://www.nvidia.com/en-us/design-visualization/a800/")
_A30_DS = ("NVIDIA A30 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
           "Solutions/data-center/products/a30-gpu/pdf/a30-datasheet.pdf")
_A10_DS = ("NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
           "Solutions/Data-Center/a10/pdf/a10-datasheet.pdf")
_A40_DS = ("NVIDIA A40 datasheet, "
           "https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper v2, appendix tables "
             "(RTX 3090, RTX 3080, RTX 3070, RTX A6000), https://www.nvidia.com/content/PDF/"
             "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper v2.1, appendix A (RTX 4090, RTX 4080, "
           "RTX 6000 Ada), https://images.nvidia.com/aem-dam/Solutions/Data-Center/l4/"
           "nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf")
_L4_DS = ("NVIDIA L4 Tensor Core GPU datasheet, "
          "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet")
_L40_DS = ("NVIDIA L40 GPU datasheet, "
           "https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf")
_L40S_DS = ("NVIDIA L40S GPU datasheet, "
            "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413")
_TURING_WP = ("NVIDIA Turing GPU Architecture whitepaper, appendix A (RTX 2080 Ti and RTX 2080 "
              "Founders Edition), https://images.nvidia.com/aem-dam/en-zz/Solutions/"
              "design-visualization/technologies/turing-architecture/"
              "NVIDIA-Turing-Architecture-Whitepaper.pdf")
_QRTX5000_DS = ("NVIDIA Quadro RTX 5000 datasheet, https://www.nvidia.com/content/dam/en-zz/"
                "Solutions/design-visualization/quadro-product-literature/"
                "quadro-rtx-5000-data-sheet-us-nvidia-704120-r4-web.pdf")
_T4_DS = ("NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
          "Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf")
_V100_DS = ("NVIDIA V100 Tensor Core GPU datasheet, https://images.nvidia.com/content/"
            "technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf")
_MI300X_DS = ("AMD Instinct MI300X accelerator data sheet, https://www.amd.com/content/dam/amd/"
              "en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf")
_MI325X_DS = ("AMD Instinct MI325X accelerator data sheet, https://www.amd.com/content/dam/amd/"
              "en/documents/instinct-tech-docs/product-briefs/instinct-mi325x-datasheet.pdf")
_MI250X_DS = ("AMD Instinct MI250X accelerator data sheet (per OAM module of two GCDs), "
              "https://www.amd.com/content/dam/amd/en/documents/instinct-business-docs/"
              "product-briefs/amd-instinct-mi250x-brochure.pdf")

_HALVED = "the document prints tensor-core figures with sparsity; the table holds half of each"
_GEFORCE = ("GeForce: FP16/BF16 with FP32 accumulate (half the FP16-accumulate rate); "
            "FP8 with FP32 accumulate")


def _derived(sms: int, mhz: int, per_sm: str, whitepaper: str) -> str:
    return (f"derived: {sms} SMs x {mhz} MHz boost clock (NVIDIA product specifications) x "
            f"per-SM rates of the {whitepaper} ({per_sm})")


_GA10X = "dense FLOP/clock/SM: FP16/BF16 512 (FP32 accumulate), TF32 256, FP32 256, INT8 2048"
_AD10X = ("dense FLOP/clock/SM: FP16/BF16 512 (FP32 accumulate), FP8 1024, TF32 256, FP32 256, "
          "INT8 2048")
_TU10X = "dense FLOP/clock/SM: FP16 512 (FP32 accumulate; TITAN RTX 1024), FP32 128, INT8 2048"


def _ga10x(sms: int, mhz: int) -> Mapping[str, float]:
    r = sms * mhz * 1e6 / 1e12
    return _t(fp32=round(256 * r, 1), tf32=round(256 * r, 1), bf16=round(512 * r, 1),
              fp16=round(512 * r, 1), int8=round(2048 * r, 1))


# --- the table -----------------------------------------------------------------------------

H100_SXM = PeakEntry("H100 SXM5 80GB", _t(fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4,
                                          fp8=1978.9, int8=1978.9), _HOPPER_WP)
H100_PCIE = PeakEntry("H100 PCIe 80GB", _t(fp32=51.2, tf32=378.0, bf16=756.0, fp16=756.0,
                                           fp8=1513.0, int8=1513.0), _HOPPER_WP)
H100_NVL = PeakEntry("H100 NVL 94GB", _t(fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5,
                                         fp8=1670.5, int8=1670.5), _H100_DS, _HALVED)
H200_SXM = PeakEntry("H200 SXM 141GB", _t(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5,
                                          fp8=1979.0, int8=1979.0), _H200_DS, _HALVED)
H200_NVL = PeakEntry("H200 NVL 141GB", _t(fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5,
                                          fp8=1670.5, int8=1670.5), _H200_DS, _HALVED)
GH200 = PeakEntry("GH200 (Hopper GPU)", _t(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5,
                                           fp8=1979.0, int8=1979.0), _GH200_DS, _HALVED)
H800_SXM = PeakEntry("H800 SXM5 80GB", _t(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5,
                                          fp8=1979.0, int8=1979.0), _H800_DS, _HALVED)
H800_PCIE = PeakEntry("H800 PCIe 80GB", _t(fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5,
                                           fp8=1513.0, int8=1513.0), _H800_DS, _HALVED)
B200 = PeakEntry("B200", _t(tf32=1125.0, bf16=2250.0, fp16=2250.0, fp8=4500.0, int8=4500.0),
                 _BLACKWELL_DS, _HALVED + "; HGX B200 figure / 8")
GB200 = PeakEntry("GB200 (Blackwell GPU)", _t(tf32=1250.0, bf16=2500.0, fp16=2500.0,
                                              fp8=5000.0, int8=5000.0),
                  _BLACKWELL_DS, _HALVED + "; GB200 NVL72 figure / 72")
B100 = PeakEntry("B100", _t(tf32=875.0, bf16=1750.0, fp16=1750.0, fp8=3500.0, int8=3500.0),
                 _BLACKWELL_DS, _HALVED + "; HGX B100 figure / 8")

_A100_RATES = _t(fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0, int8=624.0)
A100 = PeakEntry("A100", _A100_RATES, _A100_DS,
                 "dense column of the datasheet; SXM4 and PCIe, 40 and 80 GB share these rates")
A800 = PeakEntry("A800", _A100_RATES, _A800_DS, "dense column")
A30 = PeakEntry("A30", _t(fp32=10.3, tf32=82.0, bf16=165.0, fp16=165.0, int8=330.0), _A30_DS,
                "dense column")
A10 = PeakEntry("A10", _t(fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0, int8=250.0), _A10_DS,
                "dense column")
A40 = PeakEntry("A40", _t(fp32=37.4, tf32=74.8, bf16=149.7, fp16=149.7, int8=299.3), _A40_DS,
                "dense column")
RTX_A6000 = PeakEntry("RTX A6000", _t(fp32=38.7, tf32=77.4, bf16=154.8, fp16=154.8,
                                      int8=309.7), _GA102_WP, "dense column")
L4 = PeakEntry("L4", _t(fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0, fp8=242.5, int8=242.5),
               _L4_DS, _HALVED)
L40 = PeakEntry("L40", _t(fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362.0,
                          int8=362.0), _L40_DS, "dense column")
L40S = PeakEntry("L40S", _t(fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05, fp8=733.0,
                            int8=733.0), _L40S_DS, "dense column")
RTX_6000_ADA = PeakEntry("RTX 6000 Ada", _t(fp32=91.1, tf32=182.1, bf16=364.2, fp16=364.2,
                                            fp8=728.5, int8=728.5), _ADA_WP, "dense column")
RTX_4090 = PeakEntry("GeForce RTX 4090", _t(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2,
                                            fp8=330.3, int8=660.6), _ADA_WP,
                     "dense column; " + _GEFORCE)
RTX_4080 = PeakEntry("GeForce RTX 4080", _t(fp32=48.7, tf32=48.7, bf16=97.5, fp16=97.5,
                                            fp8=194.9, int8=389.9), _ADA_WP,
                     "dense column; " + _GEFORCE)
RTX_4080_SUPER = PeakEntry(
    "GeForce RTX 4080 SUPER",
    _t(fp32=52.2, tf32=52.2, bf16=104.4, fp16=104.4, fp8=208.9, int8=417.8), _ADA_WP,
    _derived(80, 2550, _AD10X, "Ada whitepaper") + "; " + _GEFORCE)
RTX_3090_TI = PeakEntry("GeForce RTX 3090 Ti", _ga10x(84, 1860), _GA102_WP,
                        _derived(84, 1860, _GA10X, "GA102 whitepaper") + "; " + _GEFORCE)
RTX_3090 = PeakEntry("GeForce RTX 3090", _t(fp32=35.6, tf32=35.6, bf16=71.0, fp16=71.0,
                                            int8=284.0), _GA102_WP, "dense column; " + _GEFORCE)
RTX_3080_TI = PeakEntry("GeForce RTX 3080 Ti", _ga10x(80, 1665), _GA102_WP,
                        _derived(80, 1665, _GA10X, "GA102 whitepaper") + "; " + _GEFORCE)
RTX_3080 = PeakEntry("GeForce RTX 3080 10GB", _t(fp32=29.8, tf32=29.8, bf16=59.5, fp16=59.5,
                                                 int8=238.0), _GA102_WP,
                     "dense column; " + _GEFORCE)
RTX_3070_TI = PeakEntry("GeForce RTX 3070 Ti", _ga10x(48, 1770), _GA102_WP,
                        _derived(48, 1770, _GA10X, "GA102 whitepaper") + "; " + _GEFORCE)
RTX_3070 = PeakEntry("GeForce RTX 3070", _t(fp32=20.3, tf32=20.3, bf16=40.6, fp16=40.6,
                                            int8=162.6), _GA102_WP, "dense column; " + _GEFORCE)
TITAN_RTX = PeakEntry("TITAN RTX", _t(fp32=16.3, fp16=130.5, int8=261.0), _TURING_WP,
                      _derived(72, 1770, _TU10X, "Turing whitepaper"))
RTX_2080_TI = PeakEntry("GeForce RTX 2080 Ti", _t(fp32=14.2, fp16=56.9, int8=227.7),
                        _TURING_WP, "Founders Edition clocks (1635 MHz); " + _GEFORCE)
RTX_2080_SUPER = PeakEntry("GeForce RTX 2080 SUPER", _t(fp32=11.2, fp16=44.6, int8=178.4),
                           _TURING_WP, _derived(48, 1815, _TU10X, "Turing whitepaper"))
RTX_2080 = PeakEntry("GeForce RTX 2080", _t(fp32=10.6, fp16=42.4, int8=169.6), _TURING_WP,
                     "Founders Edition clocks (1800 MHz); " + _GEFORCE)
RTX_2070_SUPER = PeakEntry("GeForce RTX 2070 SUPER", _t(fp32=9.1, fp16=36.2, int8=145.0),
                           _TURING_WP, _derived(40, 1770, _TU10X, "Turing whitepaper"))
QUADRO_RTX_5000 = PeakEntry("Quadro RTX 5000", _t(fp32=11.2, fp16=89.2), _QRTX5000_DS,
                            "'Tensor performance' is the FP16 tensor-core rate")
T4 = PeakEntry("T4", _t(fp32=8.1, fp16=65.0, int8=130.0), _T4_DS,
               "'mixed precision (FP16/FP32)' row")
V100_SXM2 = PeakEntry("V100 SXM2", _t(fp32=15.7, fp16=125.0), _V100_DS,
                      "'Tensor Performance' row")
V100_PCIE = PeakEntry("V100 PCIe", _t(fp32=14.0, fp16=112.0), _V100_DS,
                      "'Tensor Performance' row")
V100S_PCIE = PeakEntry("V100S PCIe", _t(fp32=16.4, fp16=130.0), _V100_DS,
                       "'Tensor Performance' row")
MI300X = PeakEntry("AMD Instinct MI300X", _t(fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4,
                                             fp8=2614.9, int8=2614.9), _MI300X_DS,
                   "dense figures (the data sheet lists sparsity separately); fp32: matrix")
MI325X = PeakEntry("AMD Instinct MI325X", _t(fp32=163.4, tf32=653.7, bf16=1307.4,
                                             fp16=1307.4, fp8=2614.9, int8=2614.9), _MI325X_DS,
                   "dense figures; fp32: matrix")
MI250X = PeakEntry("AMD Instinct MI250X (one GCD)", _t(fp32=47.85, bf16=191.5, fp16=191.5,
                                                       int8=191.5), _MI250X_DS,
                   "per GCD (each GCD is one device): half the per-module figures")

PEAKS: tuple[PeakEntry, ...] = (
    H100_SXM, H100_PCIE, H100_NVL, H200_SXM, H200_NVL, GH200, H800_SXM, H800_PCIE,
    B200, GB200, B100, A100, A800, A30, A10, A40, RTX_A6000, L4, L40, L40S, RTX_6000_ADA,
    RTX_4090, RTX_4080, RTX_4080_SUPER, RTX_3090_TI, RTX_3090, RTX_3080_TI, RTX_3080,
    RTX_3070_TI, RTX_3070, TITAN_RTX, RTX_2080_TI, RTX_2080_SUPER, RTX_2080, RTX_2070_SUPER,
    QUADRO_RTX_5000, T4, V100_SXM2, V100_PCIE, V100S_PCIE, MI300X, MI325X, MI250X,
)
"""Every entry of the table."""

UNCITED: Mapping[str, str] = MappingProxyType({
    "A10G": "AWS's A10G: NVIDIA publishes no datasheet for it (not the A10's figures)",
    "H20": "NVIDIA publishes no datasheet for the H20",
    "L20": "NVIDIA publishes no datasheet for the L20",
    "RTX 4090 D": "the RTX 4090 D has fewer SMs than the RTX 4090 and no whitepaper figures",
    "RTX 3080 12GB": "the 12 GB RTX 3080 has more SMs than the 10 GB one in the whitepaper",
})
"""Cards that other tables list but no vendor document gpulens can cite gives figures for:
they get no peak, with a WARNING that says why."""


# --- identification ------------------------------------------------------------------------


@dataclass(frozen=True)
class Identification:
    """Which table entry a GPU is, or why none."""

    entry: PeakEntry | None
    gpu: str = ""
    """Variant label (``"A100 SXM4 80GB"``), also when the figures are shared."""
    reason: str = ""
    """Why there is no entry (empty when there is one)."""


def _norm(name: str) -> str:
    return " ".join(re.sub(r"[-_/,()]", " ", name.upper()).split())


def _match_rule(pattern: str) -> Callable[[str], bool]:
    rx = re.compile(pattern)
    return lambda n: rx.search(n) is not None


def _has(n: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", n) is not None


def _hopper(n: str, family: str, memory_gb: float | None, power_w: float | None) -> Identification:
    if family == "H200":
        if _has(n, "NVL"):
            return Identification(H200_NVL, H200_NVL.gpu)
        if _has(n, "SXM") or (power_w is not None and power_w >= 650):
            return Identification(H200_SXM, H200_SXM.gpu)
        if power_w is not None and power_w <= 620:
            return Identification(H200_NVL, H200_NVL.gpu)
        return Identification(None, reason=(
            "cannot tell H200 SXM (700 W) from H200 NVL (600 W) without the board's default "
            f"power limit (got {power_w!r} W)"))
    if family == "H100":
        if _has(n, "NVL"):
            return Identification(H100_NVL, H100_NVL.gpu)
        if _has(n, "PCIE") or _has(n, "HBM2E"):
            return Identification(H100_PCIE, H100_PCIE.gpu)
        if _has(n, "HBM3") or re.search(r"\bSXM\d?\b", n):
            return Identification(H100_SXM, H100_SXM.gpu)
        if power_w is not None and power_w > 500:
            return Identification(H100_SXM, H100_SXM.gpu)
        if memory_gb is not None and power_w is not None:
            if memory_gb > 90 and power_w <= 450:
                return Identification(H100_NVL, H100_NVL.gpu)
            if memory_gb <= 90 and power_w <= 375:
                return Identification(H100_PCIE, H100_PCIE.gpu)
        return Identification(None, reason=(
            "cannot tell H100 SXM (700 W, 80 GB), PCIe (350 W, 80 GB) and NVL (400 W, 94 GB) "
            f"apart from the name alone (memory {memory_gb!r} GB, default power limit "
            f"{power_w!r} W)"))
    # H800
    if _has(n, "PCIE"):
        return Identification(H800_PCIE, H800_PCIE.gpu)
    if _has(n, "HBM3") or re.search(r"\bSXM\d?\b", n) or (power_w is not None and power_w > 500):
        return Identification(H800_SXM, H800_SXM.gpu)
    if power_w is not None and power_w <= 400:
        return Identification(H800_PCIE, H800_PCIE.gpu)
    return Identification(None, reason=(
        f"cannot tell H800 SXM from H800 PCIe (default power limit {power_w!r} W)"))


def _ampere_dc(n: str, family: str, memory_gb: float | None,
               power_w: float | None) -> Identification:
    entry = A100 if family == "A100" else A800
    if re.search(r"\bSXM\d?\b", n):
        form = "SXM4"
    elif _has(n, "PCIE") or _has(n, "ACTIVE"):
        form = "PCIe"
    elif power_w is not None:
        form = "SXM4" if power_w >= 375 else "PCIe" if power_w <= 310 else ""
    else:
        form = ""
    if _has(n, "80GB") or (memory_gb is not None and memory_gb > 60):
        mem = "80GB"
    elif _has(n, "40GB") or (memory_gb is not None and memory_gb <= 60):
        mem = "40GB"
    else:
        mem = ""
    label = " ".join(x for x in (family, form, mem) if x)
    return Identification(entry, label)


_GEFORCE_RX = re.compile(r"^(?:NVIDIA )?(?:GEFORCE )?RTX (\d{4})((?: (?:TI|SUPER|D))*)$")
_GEFORCE_TABLE: dict[str, PeakEntry] = {
    "4090": RTX_4090, "4080": RTX_4080, "4080 SUPER": RTX_4080_SUPER,
    "3090 TI": RTX_3090_TI, "3090": RTX_3090, "3080 TI": RTX_3080_TI,
    "3070 TI": RTX_3070_TI, "3070": RTX_3070,
    "2080 TI": RTX_2080_TI, "2080 SUPER": RTX_2080_SUPER, "2080": RTX_2080,
    "2070 SUPER": RTX_2070_SUPER,
}


def _geforce(n: str, memory_gb: float | None) -> Identification | None:
    m = _GEFORCE_RX.match(n)
    if m is None:
        return None
    model = (m.group(1) + m.group(2)).strip()
    if model == "4090 D":
        return Identification(None, reason=UNCITED["RTX 4090 D"])
    if model == "3080":
        if memory_gb is None:
            return Identification(None, reason=(
                "cannot tell the RTX 3080 10GB from the 12GB (memory size unknown)"))
        if memory_gb > 11.5:
            return Identification(None, reason=UNCITED["RTX 3080 12GB"])
        return Identification(RTX_3080, RTX_3080.gpu)
    entry = _GEFORCE_TABLE.get(model)
    if entry is None:
        return Identification(None, reason=f"GeForce RTX {model.title()} is not in the table")
    return Identification(entry, entry.gpu)


_SIMPLE: tuple[tuple[Callable[[str], bool], PeakEntry], ...] = (
    (_match_rule(r"\bGB200\b"), GB200),
    (_match_rule(r"\bB200\b"), B200),
    (_match_rule(r"\bB100\b"), B100),
    (_match_rule(r"\bGH200\b"), GH200),
    (_match_rule(r"\bA30\b"), A30),
    (_match_rule(r"\bA10\b"), A10),
    (_match_rule(r"\bA40\b"), A40),
    (_match_rule(r"\bRTX A6000\b"), RTX_A6000),
    (_match_rule(r"\bRTX 6000 ADA\b"), RTX_6000_ADA),
    (_match_rule(r"\bL40S\b"), L40S),
    (_match_rule(r"\bL40\b"), L40),
    (_match_rule(r"\bL4\b"), L4),
    (_match_rule(r"\bT4\b"), T4),
    (_match_rule(r"\bTITAN RTX\b"), TITAN_RTX),
    (_match_rule(r"\bQUADRO RTX 5000\b"), QUADRO_RTX_5000),
    (_match_rule(r"\bMI300X\b"), MI300X),
    (_match_rule(r"\bMI325X\b"), MI325X),
)


def identify_gpu(
    name: str, *, memory_gb: float | None = None, power_limit_w: float | None = None
) -> Identification:
    """Which table entry the GPU called ``name`` is.

    ``name`` is NVML's (``nvmlDeviceGetName``) or torch's device name. ``memory_gb``: total
    memory (1e9 or 2**30 bytes, either works); ``power_limit_w``: the board's *default* or
    maximum power limit (``nvmlDeviceGetPowerManagementDefaultLimit``), not a limit an admin
    lowered — a capped H200 SXM would otherwise read as an NVL.
    """
    n = _norm(name)
    for word, reason in UNCITED.items():
        if " " not in word and _has(n, word):
            return Identification(None, reason=reason)
    for family in ("H200", "H100", "H800"):
        if _has(n, family):
            return _hopper(n, family, memory_gb, power_limit_w)
    for family in ("A100", "A800"):
        if _has(n, family):
            return _ampere_dc(n, family, memory_gb, power_limit_w)
    if _has(n, "V100S"):
        return Identification(V100S_PCIE, V100S_PCIE.gpu)
    if _has(n, "V100"):
        if _has(n, "SXM2"):
            return Identification(V100_SXM2, V100_SXM2.gpu)
        if _has(n, "PCIE"):
            return Identification(V100_PCIE, V100_PCIE.gpu)
        return Identification(None, reason=(
            "only V100 SXM2, V100 PCIe and V100S PCIe have datasheet figures"))
    if _has(n, "MI250X"):
        if _has(n, "MI250"):
            return Identification(None, reason=(
                "the name does not tell MI250X from MI250 (different rates)"))
        return Identification(MI250X, MI250X.gpu)
    geforce = _geforce(n, memory_gb)
    if geforce is not None:
        return geforce
    for rule, entry in _SIMPLE:
        if rule(n):
            return Identification(entry, entry.gpu)
    return Identification(None, reason="not in gpulens's peak table")


def peak_for(
    name: str,
    dtype: object,
    *,
    memory_gb: float | None = None,
    power_limit_w: float | None = None,
) -> GpuPeak | None:
    """The dense peak of GPU ``name`` in the run's compute ``dtype``, or ``None``.

    ``dtype``: ``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``, ``"fp8"``, ``"int8"`` (or a
    ``torch.dtype``, or ``None`` when the run's dtype is unknown). ``None`` is returned — and
    one WARNING naming the GPU is logged through the ``gpulens`` logger, once per cause — for
    an unknown GPU, a variant the inputs do not settle, an unknown dtype, or a dtype the card
    has no figure for. Never another card's figure.
    """
    found = identify_gpu(name, memory_gb=memory_gb, power_limit_w=power_limit_w)
    if found.entry is None:
        warn_once(f"peak:gpu:{name}:{found.reason}",
                  "gpulens: no peak FLOP/s for GPU %r (%s): MFU is not reported for it; "
                  "gpulens never borrows another card's peak", name, found.reason)
        return None
    canonical = normalize_dtype(dtype)
    if canonical is None:
        warn_once(f"peak:dtype:{dtype!r}",
                  "gpulens: the run's compute dtype is unknown (%r): MFU is not reported for "
                  "GPU %r; pass the dtype (bf16, fp16, tf32, fp32, fp8, int8)", dtype, name)
        return None
    rate = found.entry.tflops.get(canonical)
    if rate is None:
        warn_once(f"peak:nodtype:{found.entry.gpu}:{canonical}",
                  "gpulens: GPU %r (%s) has no %s peak in gpulens's table: MFU is not reported",
                  name, found.gpu, canonical)
        return None
    return GpuPeak(gpu=found.gpu, dtype=canonical, tflops=rate, source=found.entry.source,
                   note=found.entry.note, nvml_name=name)
