"""The run's compute dtype, which picks the column of the peak table.

Canonical names: ``"fp64"``, ``"fp32"`` (FP32 products without TF32), ``"tf32"``, ``"bf16"``,
``"fp16"``, ``"fp8"``, ``"int8"``. Every function returns ``None`` when it cannot tell, and the
caller then reports no MFU (with a warning) rather than pick a column: taking the TF32 or FP32
column for a BF16 run, or the other way round, is one of the documented ways MFU goes wrong.
"""

from __future__ import annotations

DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_ALIASES: dict[str, str] = {
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "64": "fp64",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "32": "fp32",
    "tf32": "tf32", "tfloat32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "amp_bf16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "16": "fp16", "amp_fp16": "fp16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8", "amp_fp8": "fp8",
    "int8": "int8",
}


def normalize_dtype(value: object) -> str | None:
    """``"bf16"``, ``"bfloat16"``, ``torch.bfloat16`` ... -> ``"bf16"``; unknown -> ``None``."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text.startswith("torch."):
        text = text[len("torch."):]
    return _ALIASES.get(text)


def float32_matmul_dtype() -> str:
    """``"tf32"`` when torch lets FP32 matrix products use TF32 (or BF16) tensor cores, else
    ``"fp32"``: ``torch.get_float32_matmul_precision()`` other than ``"highest"``, or
    ``torch.backends.cuda.matmul.allow_tf32``."""
    import torch

    if torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    try:
        allow = bool(torch.backends.cuda.matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        allow = False
    return "tf32" if allow else "fp32"


def dtype_from_torch(dtype: object) -> str | None:
    """The canonical name of a ``torch.dtype`` (``torch.float32`` follows the TF32 setting)."""
    name = normalize_dtype(dtype)
    if name == "fp32":
        return float32_matmul_dtype()
    return name


_LIGHTNING: dict[str, str | None] = {
    "64": "fp64", "64-true": "fp64",
    "32": "fp32", "32-true": "fp32",
    "16": "fp16", "16-mixed": "fp16", "16-true": "fp16",
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16",
    # Transformer Engine runs the linear layers' products in FP8 (weights in BF16 or FP16).
    "transformer-engine": "fp8", "transformer-engine-float16": "fp8",
    # bitsandbytes: 4-bit or 8-bit weights, products in a dtype the string does not say.
    "nf4": None, "nf4-dq": None, "fp4": None, "fp4-dq": None,
    "int8": None, "int8-training": None,
}


def dtype_from_lightning_precision(precision: object) -> str | None:
    """A Lightning ``Trainer(precision=...)`` value -> the compute dtype.

    ``"bf16-mixed"``/``"bf16-true"`` -> bf16, ``"16-mixed"``/``"16-true"`` -> fp16,
    ``"32-true"`` -> fp32, or tf32 when torch allows TF32 for FP32 products
    (:func:`float32_matmul_dtype`), ``"64-true"`` -> fp64, ``"transformer-engine"`` -> fp8;
    bitsandbytes modes and anything else -> ``None`` (unknown: no MFU, say so).
    """
    text = str(precision).strip().lower()
    if text not in _LIGHTNING:
        return None
    name = _LIGHTNING[text]
    if name == "fp32":
        return float32_matmul_dtype()
    return name
