"""Throughput, achieved FLOP/s, MFU and work per joule of one window: pure arithmetic.

:func:`window_perf` takes what one window (the steps between two ``log()`` calls) did and
returns the ``perf/*`` keys below. An input that is absent (``None``, NaN) leaves the keys that
need it absent — never 0. Nothing here reads a device or synchronises one: the engine calls it
off the training thread with figures it already has.

=================================== ========= ===================================================
key                                 unit      what
=================================== ========= ===================================================
``perf/tokens_per_s``               tokens/s  tokens the window's GPUs processed together / window
``perf/samples_per_s``              samples/s the same for samples (where tokens mean nothing)
``perf/tflops``                     TFLOP/s   achieved model FLOP/s per GPU (job FLOPs / s / GPUs)
``perf/tflops_job``                 TFLOP/s   achieved model FLOP/s of all the window's GPUs
``perf/mfu_pct``                    %         ``perf/tflops`` / the GPU's dense peak in the run's
                                              dtype (model FLOPs utilization, PaLM's definition)
``perf/mfu_clock_adjusted_pct``     %         the same against the peak scaled by mean SM clock /
                                              the clock the peak assumes (capped at 1): the share
                                              of what the GPU could do *at the clock it ran*
``perf/tokens_per_j``               tokens/J  tokens / the GPUs' energy in the window
``perf/samples_per_j``              samples/J samples / the GPUs' energy in the window
``perf/mfu_when_tensor_active_pct`` %         ``perf/mfu_pct`` / (GPM tensor-pipe active % / 100):
                                              the share of peak the tensor cores delivered *while
                                              they were busy*; only for a dtype whose products
                                              run on tensor cores, and only within 0-100
=================================== ========= ===================================================

Reading ``perf/mfu_when_tensor_active_pct`` beside ``gpu/*/tensor_active_pct``:

* tensor pipes active most of the time and this figure low — the tensor cores were **busy but
  slow**: small or badly shaped matrix products, low SM clock (power or thermal cap), products
  running at a slower rate than the dtype's peak (FP32 accumulate on GeForce, TF32 where BF16
  was expected).
* tensor pipes active a small share of the time and this figure high — the tensor cores were
  **idle**: the step spends its time elsewhere (data loading, communication, elementwise and
  memory-bound kernels, the host).

When it is left out:

* **The dtype does not run on tensor cores** (``fp32`` without TF32, ``fp64``, or no dtype):
  the peak is then the CUDA cores' (or unknown) and the products never touch the tensor pipes,
  so MFU divided by tensor-pipe activity measures nothing: the 302-407 % a tiny FP32 model
  read on two H200s (issue 18) is such a quotient, an FP32 MFU over whatever little the tensor
  pipes happened to run.
* **It would exceed 100 %**: the tensor cores cannot deliver more than their peak while busy,
  so the inputs disagree (FLOPs counted that ran elsewhere, say attention in FP32 or on CUDA
  cores; a peak or GPU variant that is wrong; a GPM reading that does not cover the window).
  The window gets no figure (absent, not clamped: a clamped 100 would look like a perfect
  kernel); :func:`window_perf` reports it in ``out_of_range`` so that the engine says so once.
* **Its GPM readings hold the start** (the engine's call, not :func:`window_perf`'s): the
  first row, and the rows after it whose GPM spans began before the first row's end. A monitor
  started mid-training stalls the training thread, so the GPU idles through the spans' start
  while the rows inside them are busy steps (and the first row counts steps whose kernels ran
  partly after it). Such rows read 100-215 % on an H200; the rest of a run 81-84 %.
"""

from __future__ import annotations

import math

TOKENS_PER_S = "perf/tokens_per_s"
SAMPLES_PER_S = "perf/samples_per_s"
TFLOPS = "perf/tflops"
TFLOPS_JOB = "perf/tflops_job"
MFU_PCT = "perf/mfu_pct"
MFU_CLOCK_ADJUSTED_PCT = "perf/mfu_clock_adjusted_pct"
TOKENS_PER_J = "perf/tokens_per_j"
SAMPLES_PER_J = "perf/samples_per_j"
MFU_WHEN_TENSOR_ACTIVE_PCT = "perf/mfu_when_tensor_active_pct"

TENSOR_CORE_DTYPES = frozenset({"tf32", "bf16", "fp16", "fp8", "int8"})
"""Dtypes whose products run on tensor cores (the peak of their column is a tensor-core peak)."""

PERF_KEYS: tuple[str, ...] = (
    TOKENS_PER_S, SAMPLES_PER_S, TFLOPS, TFLOPS_JOB, MFU_PCT, MFU_CLOCK_ADJUSTED_PCT,
    TOKENS_PER_J, SAMPLES_PER_J, MFU_WHEN_TENSOR_ACTIVE_PCT,
)
"""Every key :func:`window_perf` can return."""


def _value(x: float | None, what: str) -> float | None:
    """A finite number, ``None`` for absent or NaN; negative values are a user error."""
    if x is None:
        return None
    v = float(x)
    if math.isnan(v):
        return None
    if math.isinf(v) or v < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {x!r}")
    return v


def window_flops(
    *,
    flops: float | None = None,
    tokens: float | None = None,
    flops_per_token: float | None = None,
    samples: float | None = None,
    flops_per_sample: float | None = None,
    steps: float | None = None,
    flops_per_step: float | None = None,
) -> float | None:
    """Model FLOPs of the window from the first input that gives them, in this order:
    ``flops`` (counted by the caller), ``tokens x flops_per_token``,
    ``samples x flops_per_sample``, ``steps x flops_per_step``; ``None`` when none does."""
    total = _value(flops, "flops")
    if total is not None:
        return total
    for count, per, what in (
        (tokens, flops_per_token, "tokens"),
        (samples, flops_per_sample, "samples"),
        (steps, flops_per_step, "steps"),
    ):
        n, f = _value(count, what), _value(per, f"flops per {what[:-1]}")
        if n is not None and f is not None:
            return n * f
    return None


def window_perf(
    *,
    seconds: float,
    gpus: int = 1,
    tokens: float | None = None,
    samples: float | None = None,
    steps: float | None = None,
    flops: float | None = None,
    flops_per_token: float | None = None,
    flops_per_sample: float | None = None,
    flops_per_step: float | None = None,
    peak_tflops: float | None = None,
    mean_sm_clock_mhz: float | None = None,
    max_sm_clock_mhz: float | None = None,
    energy_j: float | None = None,
    tensor_active_pct: float | None = None,
    dtype: str | None = None,
    out_of_range: list[float] | None = None,
) -> dict[str, float]:
    """The ``perf/*`` keys (module docstring) of one window.

    Args:
        seconds: the window's length (wall clock, s). Not positive: no rate at all.
        gpus: how many GPUs did the window's work together (the job's GPUs in one row).
        tokens, samples, steps: work done in the window by those GPUs together (tokens that
            are real: padding excluded by the caller).
        flops: model FLOPs of the window, when the caller counted them; else
            ``flops_per_token`` / ``flops_per_sample`` / ``flops_per_step`` multiply the
            counts (:func:`window_flops`). Training FLOPs (forward + backward), model not
            hardware FLOPs (:mod:`gpulens.work.flops`).
        peak_tflops: dense peak of ONE GPU in the run's dtype (:func:`gpulens.work.peaks.peak_for`).
        mean_sm_clock_mhz: the window's time-weighted mean SM clock (mean over its GPUs).
        max_sm_clock_mhz: the clock the peak assumes: the GPU's maximum boost SM clock
            (``nvmlDeviceGetMaxClockInfo(SM)``).
        energy_j: energy of all the window's GPUs together (J).
        tensor_active_pct: GPM tensor-pipe active %, mean over the window's GPUs.
        dtype: the run's compute dtype (``"bf16"`` ...): ``perf/mfu_when_tensor_active_pct``
            needs one of :data:`TENSOR_CORE_DTYPES`.
        out_of_range: where the ratio of MFU to tensor activity came out above 100 %, it is
            left out of the result and appended here (for the caller to tell).
    """
    out: dict[str, float] = {}
    secs = _value(seconds, "seconds")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    n_tokens = _value(tokens, "tokens")
    n_samples = _value(samples, "samples")
    energy = _value(energy_j, "energy_j")
    if energy is not None and energy > 0:
        if n_tokens is not None:
            out[TOKENS_PER_J] = n_tokens / energy
        if n_samples is not None:
            out[SAMPLES_PER_J] = n_samples / energy
    if secs is None or secs <= 0:
        return out
    if n_tokens is not None:
        out[TOKENS_PER_S] = n_tokens / secs
    if n_samples is not None:
        out[SAMPLES_PER_S] = n_samples / secs
    total = window_flops(flops=flops, tokens=n_tokens, flops_per_token=flops_per_token,
                         samples=n_samples, flops_per_sample=flops_per_sample, steps=steps,
                         flops_per_step=flops_per_step)
    if total is None:
        return out
    per_gpu = total / secs / gpus / 1e12
    out[TFLOPS] = per_gpu
    out[TFLOPS_JOB] = total / secs / 1e12
    peak = _value(peak_tflops, "peak_tflops")
    if peak is None or peak <= 0:
        return out
    mfu = 100.0 * per_gpu / peak
    out[MFU_PCT] = mfu
    clock, clock_max = (_value(mean_sm_clock_mhz, "mean_sm_clock_mhz"),
                        _value(max_sm_clock_mhz, "max_sm_clock_mhz"))
    if clock is not None and clock_max is not None and clock > 0 and clock_max > 0:
        out[MFU_CLOCK_ADJUSTED_PCT] = mfu / min(1.0, clock / clock_max)
    tensor = _value(tensor_active_pct, "tensor_active_pct")
    if tensor is not None and tensor > 0 and dtype in TENSOR_CORE_DTYPES:
        busy = 100.0 * mfu / tensor
        if busy <= 100.0:
            out[MFU_WHEN_TENSOR_ACTIVE_PCT] = busy
        elif out_of_range is not None:
            out_of_range.append(busy)
    return out
