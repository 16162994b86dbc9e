"""The peak table: dense figures, variants told apart, no borrowed peak, every card of the
other tools' tables handled.

Expected figures below are copied from the vendor documents each entry cites (dense column,
or half the "with sparsity" figure where that is all the document prints).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulens.log import reset_warnings
from gpulens.work.peaks import PEAKS, UNCITED, identify_gpu, peak_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    reset_warnings()
    yield
    reset_warnings()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "gpulens" and r.levelno == logging.WARNING]


# --- dense figures of the cards people quote --------------------------------------------------

DENSE_BF16 = [
    # (NVML name, memory GB, default power limit W, dense BF16 TFLOP/s, sparse figure to avoid)
    ("NVIDIA H100 80GB HBM3", 85.0, 700, 989.4, 1978.9),  # Hopper whitepaper
    ("NVIDIA H100 PCIe", 85.5, 350, 756.0, 1513.0),
    ("NVIDIA H100 NVL", 100.5, 400, 835.5, 1671.0),  # H100 datasheet 1,671*
    ("NVIDIA H200", 150.1, 700, 989.5, 1979.0),  # H200 datasheet 1,979*
    ("NVIDIA H200 NVL", 150.1, 600, 835.5, 1671.0),  # H200 datasheet 1,671*
    ("NVIDIA B200", 191.5, 1000, 2250.0, 4500.0),  # HGX B200 36 PF* / 8
    ("NVIDIA GB200", 199.0, 1200, 2500.0, 5000.0),  # GB200 NVL72 360 PF* / 72
    ("NVIDIA A100-SXM4-80GB", 85.9, 400, 312.0, 624.0),
    ("NVIDIA L40S", 48.3, 350, 362.05, 733.0),
    ("NVIDIA RTX A6000", 51.0, 300, 154.8, 309.7),  # GA102 whitepaper
    ("NVIDIA GeForce RTX 4090", 25.4, 450, 165.2, 330.4),  # Ada whitepaper, FP32 accumulate
    ("AMD Instinct MI300X", 205.8, 750, 1307.4, 2614.9),
]


@pytest.mark.parametrize(("name", "mem", "watts", "dense", "sparse"), DENSE_BF16,
                         ids=[c[0] for c in DENSE_BF16])
def test_dense_bf16_not_sparse(name: str, mem: float, watts: float, dense: float,
                               sparse: float) -> None:
    peak = peak_for(name, "bf16", memory_gb=mem, power_limit_w=watts)
    assert peak is not None
    assert peak.tflops == dense
    assert peak.tflops != sparse
    assert peak.flops == dense * 1e12
    assert peak.source and ("http" in peak.source)


def test_no_sparsity_figure_anywhere() -> None:
    """Every entry's dtypes keep the dense ratios (TF32 = BF16 / 2, FP8 = 2 x BF16, within the
    documents' rounding): a sparse figure in one column breaks them; and no BF16 figure is one
    of the sparse BF16 figures other tables carry."""
    sparse_bf16 = {1979.0, 1978.9, 1978.8, 2000.0, 1671.0, 1700.0, 1513.0, 624.0, 733.0,
                   330.4, 309.7, 4500.0, 5000.0, 3500.0, 2614.9}
    for e in PEAKS:
        for dtype, rate in e.tflops.items():
            assert math.isfinite(rate) and rate > 0, (e.gpu, dtype)
        bf16, tf32, fp8 = e.tflops.get("bf16"), e.tflops.get("tf32"), e.tflops.get("fp8")
        if bf16 is not None:
            assert bf16 not in sparse_bf16, e.gpu
            assert e.tflops["fp16"] == bf16, e.gpu
        if bf16 is not None and tf32 is not None and tf32 != e.tflops.get("fp32"):
            assert bf16 / tf32 == pytest.approx(2.0, rel=0.03), e.gpu
        if bf16 is not None and fp8 is not None:
            assert fp8 / bf16 == pytest.approx(2.0, rel=0.03), e.gpu
        assert e.source.count("http") >= 1, e.gpu


def test_fp32_tf32_bf16_columns_distinct() -> None:
    """The TF32 or FP32 column taken for BF16 (torchtitan #668; Lightning's A6000 and RTX 4090
    BF16 entries hold the FP32 / TF32 rates) must not happen here."""
    a6000 = identify_gpu("NVIDIA RTX A6000").entry
    assert a6000 is not None
    assert (a6000.tflops["fp32"], a6000.tflops["tf32"], a6000.tflops["bf16"]) == (
        38.7, 77.4, 154.8)
    h100 = identify_gpu("NVIDIA H100 80GB HBM3").entry
    assert h100 is not None
    assert (h100.tflops["fp32"], h100.tflops["tf32"], h100.tflops["bf16"]) == (
        66.9, 494.7, 989.4)
    rtx4090 = identify_gpu("NVIDIA GeForce RTX 4090").entry
    assert rtx4090 is not None and rtx4090.tflops["bf16"] == 2 * rtx4090.tflops["tf32"]
    for e in PEAKS:
        if "bf16" in e.tflops and "fp32" in e.tflops:
            assert e.tflops["bf16"] > e.tflops["fp32"], e.gpu
    assert peak_for("NVIDIA A100-SXM4-80GB", "tf32", memory_gb=85.9).tflops == 156.0  # type: ignore[union-attr]
    assert peak_for("NVIDIA A100-SXM4-80GB", "fp32", memory_gb=85.9).tflops == 19.5  # type: ignore[union-attr]


# --- variants the name does not tell apart ----------------------------------------------------


def test_h200_sxm_and_nvl_told_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    assert identify_gpu("NVIDIA H200", power_limit_w=700).gpu == "H200 SXM 141GB"
    assert identify_gpu("NVIDIA H200", power_limit_w=600).gpu == "H200 NVL 141GB"
    assert identify_gpu("NVIDIA H200 NVL").gpu == "H200 NVL 141GB"
    assert identify_gpu("NVIDIA H200 SXM 141GB").gpu == "H200 SXM 141GB"
    # Without its power limit an "NVIDIA H200" could be either: no peak, one warning.
    assert peak_for("NVIDIA H200", "bf16", memory_gb=150.1) is None
    assert peak_for("NVIDIA H200", "bf16", memory_gb=150.1) is None
    msgs = _warnings(caplog)
    assert len(msgs) == 1 and "NVIDIA H200" in msgs[0] and "power limit" in msgs[0]


@pytest.mark.parametrize(("name", "mem", "watts", "gpu"), [
    ("NVIDIA H100 80GB HBM3", 85.0, 700, "H100 SXM5 80GB"),
    ("NVIDIA H100 PCIe", 85.5, 350, "H100 PCIe 80GB"),
    ("NVIDIA H100 NVL", 100.5, 400, "H100 NVL 94GB"),
    ("NVIDIA H100", 85.0, 700, "H100 SXM5 80GB"),  # name alone says nothing: power does
    ("NVIDIA H100", 100.5, 400, "H100 NVL 94GB"),
    ("NVIDIA H100", 85.5, 350, "H100 PCIe 80GB"),
    ("NVIDIA H800", 85.0, 700, "H800 SXM5 80GB"),
    ("NVIDIA H800 PCIe", 85.5, 350, "H800 PCIe 80GB"),
    ("NVIDIA A100-SXM4-40GB", 42.9, 400, "A100 SXM4 40GB"),
    ("NVIDIA A100-PCIE-40GB", 42.9, 250, "A100 PCIe 40GB"),
    ("NVIDIA A100 80GB PCIe", 85.9, 300, "A100 PCIe 80GB"),
    ("NVIDIA A100-SXM4-80GB", 85.9, 400, "A100 SXM4 80GB"),
    ("NVIDIA GH200 480GB", 102.0, 900, "GH200 (Hopper GPU)"),  # not an H200
    ("NVIDIA GB200", 199.0, 1200, "GB200 (Blackwell GPU)"),  # not a B200
    ("NVIDIA L4", 24.0, 72, "L4"),
    ("NVIDIA L40", 48.3, 300, "L40"),
    ("NVIDIA GeForce RTX 3080", 10.7, 320, "GeForce RTX 3080 10GB"),
])
def test_variants(name: str, mem: float, watts: float, gpu: str) -> None:
    found = identify_gpu(name, memory_gb=mem, power_limit_w=watts)
    assert found.entry is not None, found.reason
    assert found.gpu == gpu


def test_h100_without_power_or_memory_is_ambiguous(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    assert peak_for("NVIDIA H100", "bf16") is None
    assert "H100" in _warnings(caplog)[0]
    assert identify_gpu("NVIDIA GeForce RTX 3080", memory_gb=12.9).entry is None  # 12 GB: more SMs


# --- no borrowed peak -------------------------------------------------------------------------


def test_unknown_gpu_gets_no_peak_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """torchtitan falls back to the A100's 312 TFLOP/s (152 % and 563 % MFU on AMD cards),
    Composer to 0, verl to infinity: gpulens returns None and says so, once."""
    caplog.set_level(logging.WARNING, logger="gpulens")
    for _ in range(3):
        assert peak_for("AMD Radeon PRO W7900", "bf16") is None
    msgs = _warnings(caplog)
    assert len(msgs) == 1
    assert "AMD Radeon PRO W7900" in msgs[0] and "MFU is not reported" in msgs[0]
    assert peak_for("NVIDIA A10G", "bf16") is None  # another cause: a second warning
    assert len(_warnings(caplog)) == 2 and "A10G" in _warnings(caplog)[1]


@pytest.mark.parametrize("dtype", [None, "fp4", "nf4", "complex64"])
def test_unknown_dtype_gets_no_peak(dtype: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    assert peak_for("NVIDIA H100 80GB HBM3", dtype) is None
    msgs = _warnings(caplog)
    assert len(msgs) == 1 and "dtype is unknown" in msgs[0] and "H100" in msgs[0]


def test_dtype_the_card_lacks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpulens")
    assert peak_for("Tesla T4", "bf16") is None  # Turing has no BF16 tensor cores
    assert peak_for("Tesla V100-SXM2-16GB", "tf32") is None
    assert peak_for("NVIDIA H100 80GB HBM3", "fp64") is None
    assert len(_warnings(caplog)) == 3
    t4 = peak_for("Tesla T4", "fp16")
    assert t4 is not None and t4.tflops == 65.0


def test_dtype_spellings() -> None:
    torch = pytest.importorskip("torch")
    for spelling in ("bf16", "bfloat16", "BF16", torch.bfloat16, "torch.bfloat16", "amp_bf16"):
        peak = peak_for("NVIDIA H100 80GB HBM3", spelling)
        assert peak is not None and peak.dtype == "bf16" and peak.tflops == 989.4
    fp8 = peak_for("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn)
    assert fp8 is not None and fp8.tflops == 1978.9
    assert peak_for("NVIDIA H100 80GB HBM3", "fp8").describe() == {  # type: ignore[union-attr]
        "peak_gpu": "H100 SXM5 80GB", "peak_dtype": "fp8", "peak_tflops": 1978.9,
        "peak_source": fp8.source,
    }


# --- coverage of the other tools' tables -----------------------------------------------------

# The GPUs of Lightning's _CUDA_FLOPS (2.6), Composer's GPU_AVAILABLE_FLOPS, torchtitan's
# get_peak_flops and verl's _DEVICE_FLOPS, as NVML (or ROCm) names them: (name, GB, W).
OTHER_TABLES = [
    ("NVIDIA H200", 150.1, 700), ("NVIDIA H200 NVL", 150.1, 600), ("NVIDIA H100 NVL", 100.5, 400),
    ("NVIDIA H100 80GB HBM3", 85.0, 700), ("NVIDIA H100 PCIe", 85.5, 350),
    ("NVIDIA GeForce RTX 4090", 25.4, 450), ("NVIDIA GeForce RTX 4080", 17.2, 320),
    ("NVIDIA GeForce RTX 4080 SUPER", 17.2, 320), ("NVIDIA L4", 24.0, 72),
    ("NVIDIA L40", 48.3, 300), ("NVIDIA L40S", 48.3, 350), ("NVIDIA A100-SXM4-80GB", 85.9, 400),
    ("NVIDIA A100-PCIE-40GB", 42.9, 250), ("NVIDIA RTX A6000", 51.0, 300),
    ("NVIDIA A40", 48.3, 300), ("NVIDIA A10", 24.2, 150),
    ("NVIDIA GeForce RTX 3090 Ti", 25.8, 450), ("NVIDIA GeForce RTX 3090", 25.8, 350),
    ("NVIDIA GeForce RTX 3080 Ti", 12.9, 350), ("NVIDIA GeForce RTX 3080", 10.7, 320),
    ("NVIDIA GeForce RTX 3070 Ti", 8.6, 290), ("NVIDIA GeForce RTX 3070", 8.6, 220),
    ("Tesla T4", 15.8, 70), ("Quadro RTX 5000", 17.2, 230),
    ("NVIDIA GeForce RTX 2080 SUPER", 8.6, 250), ("NVIDIA GeForce RTX 2080 Ti", 11.8, 260),
    ("NVIDIA GeForce RTX 2080", 8.6, 225), ("NVIDIA GeForce RTX 2070 SUPER", 8.6, 215),
    ("NVIDIA TITAN RTX", 25.8, 280), ("Tesla V100-SXM2-16GB", 17.2, 300),
    ("Tesla V100-PCIE-16GB", 17.2, 250), ("Tesla V100S-PCIE-32GB", 34.4, 250),
    ("NVIDIA B200", 191.5, 1000), ("NVIDIA GB200", 199.0, 1200), ("NVIDIA H800", 85.0, 700),
    ("NVIDIA A800-SXM4-80GB", 85.9, 400), ("AMD Instinct MI300X", 205.8, 750),
    ("AMD Instinct MI325X", 274.9, 1000), ("AMD Instinct MI250X", 68.7, 500),
]
# Cards those tables list that no vendor document gpulens can cite gives figures for.
OTHER_TABLES_UNCITED = ["NVIDIA A10G", "NVIDIA H20", "NVIDIA L20"]


@pytest.mark.parametrize(("name", "mem", "watts"), OTHER_TABLES, ids=[c[0] for c in OTHER_TABLES])
def test_every_card_of_the_other_tables_has_an_entry(name: str, mem: float, watts: float) -> None:
    found = identify_gpu(name, memory_gb=mem, power_limit_w=watts)
    assert found.entry is not None, found.reason
    assert found.entry in PEAKS


@pytest.mark.parametrize("name", OTHER_TABLES_UNCITED)
def test_uncited_cards_say_why(name: str) -> None:
    found = identify_gpu(name)
    assert found.entry is None
    assert found.reason in UNCITED.values()


def test_lookalike_names_do_not_borrow() -> None:
    for name in ("NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 4090 Laptop GPU",
                 "Tesla V100-SXM3-32GB", "AMD Instinct MI250X/MI250", "NVIDIA L4O",
                 "Intel(R) Data Center GPU Max 1550", "Ascend910B", "NVIDIA RTX 5000 Ada"):
        assert identify_gpu(name).entry is None, name


def test_docs_list_every_entry() -> None:
    text = (ROOT / "docs" / "mfu.md").read_text()
    for e in PEAKS:
        assert re.search(rf"\|\s*{re.escape(e.gpu)}\s*\|", text), e.gpu
