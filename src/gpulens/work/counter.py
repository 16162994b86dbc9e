"""The measured fallback: model FLOPs counted by ``FlopCounterMode`` on the meta device.

For an architecture :mod:`.flops` has no formula for, the model is built on the **meta device**
(shapes only: no memory, no real compute) and one forward + backward pass runs under
``torch.utils.flop_counter.FlopCounterMode``, which adds up the FLOPs of every matrix product
from the shapes. This runs once per model, at three short sequence lengths, and fits
``flops(s) = a·s + b·s²`` per sequence: ``a`` gives the per-token term (weight products) and
``b`` the attention-score term, so the result is a :class:`~gpulens.work.flops.FlopsFormula`
like the analytic one (attention counted the "full" way, as ``FlopCounterMode`` counts it).
The third length checks the fit: a model whose count is not of that form (data-dependent work)
gives no figure rather than a wrong one.

What ``FlopCounterMode`` (torch 2.13) does not count, and how this module copes:

* ``aten._grouped_mm`` (the grouped expert products of MoE layers): counted here from the
  shapes (rows x inner x output, the rows being the tokens routed to the experts).
* ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward): counted here like
  the other SDPA kernels.
* Any other operator whose name says it multiplies matrices or attends but that has no flop
  formula: the measurement is refused (:class:`CounterError`) instead of undercounting.

Like the formula these are model FLOPs: activation recompute is not run here and not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpulens.work.flops import FlopsFormula

if TYPE_CHECKING:
    import torch

DEFAULT_SEQ_LENS: tuple[int, int, int] = (16, 32, 64)
"""Sequence lengths of the three measured passes (batch of one)."""

_FIT_TOLERANCE = 1e-3
"""Relative error the third length may show against the fit from the first two."""

# Operator-name fragments of work FlopCounterMode should have counted.
_MATMUL_LIKE = ("mm", "matmul", "linear", "convolution", "attention", "einsum")
# Fragments that look like products but move no FLOPs worth counting.
_NOT_WORK = ("_local_scalar_dense", "comm", "sym_", "mm_out_dtype_check")


class CounterError(RuntimeError):
    """The model could not be measured: why, in one line."""


def _grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int], *args: Any,
                      out_shape: Sequence[int] | None = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)`` from the shapes alone.

    2-D x 3-D (tokens x experts' weights): every row of ``a`` meets one group's matrix;
    2-D x 2-D (the weight gradient): groups split the shared inner dimension; 3-D x 3-D:
    a batched product; 3-D x 2-D: groups split ``b``'s columns.
    """
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    raise CounterError(f"_grouped_mm with shapes {a_shape} x {b_shape} is not understood")


def _attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    # (batch, heads, q_len, d) · (batch, heads, k_len, d)ᵀ, then · (batch, heads, k_len, dv)
    b, h, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def _cpu_flash_fwd(query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return _attention_flops(query, key, value)


def _cpu_flash_bwd(grad_out: Sequence[int], query: Sequence[int], key: Sequence[int],
                   value: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return 2 * _attention_flops(query, key, value)  # dQ, dK, dV, dP: twice the forward


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    import torch

    aten = torch.ops.aten
    extra: dict[Any, Callable[..., int]] = {}
    for name, fn in (
        ("_grouped_mm", _grouped_mm_flops),
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            extra[op] = fn
    return extra


def count_flops(run: Callable[[], object]) -> int:
    """FLOPs of ``run()`` as ``FlopCounterMode`` counts them (plus the operators above).

    Raises :class:`CounterError` when ``run`` fails, or when an operator that multiplies
    matrices ran without a flop formula (the count would be short).
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_extra_formulas())
    counted = set(counter.flop_registry)

    class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.uncounted: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            packet = getattr(func, "overloadpacket", func)
            name = str(packet)
            if packet not in counted and any(f in name for f in _MATMUL_LIKE) and not any(
                f in name for f in _NOT_WORK
            ):
                self.uncounted.add(name)
            return func(*args, **(kwargs or {}))

    watch = _Watch()
    try:
        with counter, watch:
            run()
    except CounterError:
        raise
    except Exception as exc:  # the model's own code failed on meta tensors
        raise CounterError(f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from exc
    if watch.uncounted:
        raise CounterError(
            "operators without a flop formula ran: " + ", ".join(sorted(watch.uncounted))
        )
    return int(counter.get_total_flops())


def measure_formula(
    build: Callable[[], torch.nn.Module],
    step: Callable[[torch.nn.Module, int], object],
    *,
    family: str,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
) -> FlopsFormula:
    """Build the model on the meta device once and measure its training FLOPs.

    ``build()`` makes the model (it runs under ``torch.device("meta")``); ``step(model, s)``
    runs one forward and backward pass on one sequence of ``s`` tokens (meta tensors). Three
    lengths are measured; the result is per token and per query-key pair (forward FLOPs,
    training = 3 x forward, :class:`FlopsFormula` with ``method="flop_counter"``).
    """
    import torch

    if len(seq_lens) != 3 or len(set(seq_lens)) != 3 or min(seq_lens) <= 0:
        raise ValueError(f"seq_lens must be three different positive lengths, got {seq_lens}")
    try:
        with torch.device("meta"):
            model = build()
    except Exception as exc:
        raise CounterError(
            f"building the model on the meta device failed: {type(exc).__name__}: {exc}"
            .splitlines()[0][:300]
        ) from exc
    s1, s2, s3 = seq_lens
    f1, f2, f3 = (count_flops(functools.partial(step, model, s)) for s in (s1, s2, s3))
    # f(s) = a·s + b·s²  ->  f/s = a + b·s
    b = (f2 / s2 - f1 / s1) / (s2 - s1)
    a = f1 / s1 - b * s1
    predicted = a * s3 + b * s3 * s3
    if f3 <= 0 or abs(predicted - f3) > _FIT_TOLERANCE * f3 or a < 0 or b < -1e-9 * abs(a):
        raise CounterError(
            f"the counted FLOPs ({f1}, {f2}, {f3} at {s1}, {s2}, {s3} tokens) are not "
            "linear + quadratic in the sequence length"
        )
    b = max(b, 0.0)
    return FlopsFormula(
        dense_forward_per_token=a / 3.0,
        attention_forward_per_pair=((None, b / 3.0),) if b > 0 else (),
        family=family,
        method="flop_counter",
    )
