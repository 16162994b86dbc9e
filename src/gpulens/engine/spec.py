"""What the client tells the engine at start: a picklable spec (it crosses to the engine
process), from which :class:`gpulens.engine.engine.Engine` builds everything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpulens.model import JobShape, SinkSpec

if TYPE_CHECKING:
    from gpulens.distributed.rows import GatherPlan

WORK_TOKENS = "work/tokens"
WORK_SAMPLES = "work/samples"
WORK_FLOPS = "work/flops"
WORK_CPU = "work/cpu_s"
"""A step mark's work figures ride among its scalars under these names (so a tensor among them
is converted off the training thread like any scalar); the engine turns them into ``perf/*``
keys and leaves them out of the rows it finishes."""
WORK_KEYS = (WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS, WORK_CPU)
GPM_FROM_START = "work/gpm_from_start"
"""In a row whose GPM figures draw more than :data:`GPM_START_SHARE` of their weight on GPM
spans that began before the first row's end (the share, 0-1): those spans hold the start,
when the GPU's queue was empty (a monitor started mid-training stalls the training thread),
while the row's MFU counts steps whose kernels ran partly after its end. The finisher takes
it out and writes no ``perf/mfu_when_tensor_active_pct`` for the row: on an H200 such rows
read 100-215 % (HF every step and every 10, the paths harness's blocks) where the rest read
81-84 % (``benchmarks/results/2026-11-29-h200-lightning-mfu-rows``)."""
GPM_START_SHARE = 0.1


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine needs; every field pickles (a simulator backend does when its
    load does: see :mod:`gpulens.sources.loads`)."""

    interval: float
    """Seconds between cheap samples."""
    gpus: tuple[int, ...] | None = None
    """CUDA device numbers to watch (as the training process numbers them); ``None``: every
    visible GPU, or this rank's in a distributed job.  A number that names no GPU is an
    error, also where no driver answers."""
    require_gpu: bool = False
    """No GPU to monitor is an error (``ValueError`` at start), not a warning."""
    wall_clock: bool = False
    """Each mark is a tick of a wall clock, not a training step (``gpulens record``,
    ``serve``): rows carry no per-step figures and only the rules about the hardware judge
    them."""
    backend: Any = "auto"
    """``"auto"``, ``"nvml"`` or an NVML-like object (:class:`gpulens.testing.SimulatedNVML`)."""
    buffer_rows: int = 10_000
    gpm: bool = True
    energy: bool = True
    driver_samples: bool = True
    step: int = 0
    """The training step the first window starts after."""
    sinks: tuple[SinkSpec, ...] = ()
    """Sinks the engine builds and writes itself (prepared: see
    :meth:`gpulens.sinks.SinkSpec.prepared`; each ``name`` unique in the run)."""
    rows_back: bool = False
    """Hand every finished row back to the client, for its own sinks."""
    gather: bool = False
    """A distributed job whose store no engine can open (not a ``TCPStore``): each window's
    raw row goes back to the client for the rank gather; rank 0's client sends the merged row
    back to be finished (:meth:`Engine.finish`)."""
    gather_plan: GatherPlan | None = None
    """A distributed job gathered by the engines: this one does this rank's part of the
    gather itself (:mod:`gpulens.distributed.rows`): its raw rows go into the node's file, and
    rank 0's engine merges and finishes the job's rows."""
    rank: tuple[int, int, int] | None = None
    """(global rank, local rank, world size) in a distributed job."""
    job: JobShape | None = None
    """The job's shape as this rank's gather found it (rank 0: every rank; a node's leader:
    its node), for the run's context; the engine fills in its own GPUs."""
    log_level: int = 30
    """The client's ``gpulens`` logger level: the engine says nothing below it."""
    dtype: str | None = None
    """The run's compute dtype (``"bf16"``, ...): the peak's column, the tensor-core rule."""
    flops_per_token: float | None = None
    flops_per_sample: float | None = None
    """Model FLOPs (forward + backward) per token / per sample, for ``perf/tflops``."""

    @property
    def distributed(self) -> bool:
        """The rows are a distributed job's, gathered by the client (``gather``) or by the
        engines (``gather_plan``): rank 0's finished rows hold every rank's GPUs."""
        return self.gather or self.gather_plan is not None

