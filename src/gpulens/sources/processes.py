"""The processes on each GPU: NVML's running compute and graphics processes, named by psutil.

Read on demand (``Monitor.processes()``, the ``watch`` view's process table), in the engine
process like every NVML read; never on a training thread.  NVML gives each process's id and,
where the driver can tell, the GPU memory it holds (not under MIG without the right rights,
nor on some virtualised GPUs: then ``gpu_mem_gb`` is ``None``, never 0).  psutil adds the
name, user and command line of processes in this process's PID namespace; a process NVML
reports from another namespace (a container beside this one) keeps only its id.
"""

from __future__ import annotations

from typing import Any, NamedTuple

_GB = 1e9


class GpuProcess(NamedTuple):
    """One process on one GPU."""

    gpu: int
    """The GPU's number in row keys (``gpu/{gpu}/...``)."""
    pid: int
    gpu_mem_gb: float | None
    """GPU memory the process holds, GB of 1e9 bytes; ``None`` when the driver does not say."""
    name: str | None
    """The executable's name (``python3``); ``None`` for a process psutil cannot see."""
    user: str | None
    command: str | None
    """The command line, joined by spaces; ``None`` when not readable."""


def used_bytes(value: Any) -> int | None:
    """NVML's ``usedGpuMemory``: ``None`` (or the driver's "not available" all-ones value)
    when it cannot tell."""
    if value is None:
        return None
    n = int(value)
    return None if n < 0 or n >= (1 << 63) else n


def describe(gpu: int, pid: int, used: int | None, psutil_module: Any | None = None
             ) -> GpuProcess:
    """A :class:`GpuProcess` for ``pid`` on GPU ``gpu`` holding ``used`` bytes, with what
    psutil can tell of it."""
    name = user = command = None
    try:
        ps: Any = psutil_module
        if ps is None:
            import psutil

            ps = psutil
        proc = ps.Process(pid)
        with proc.oneshot():
            name = proc.name()
            try:
                user = proc.username()
            except (ps.AccessDenied, KeyError):  # KeyError: a uid with no name
                user = None
            try:
                command = " ".join(proc.cmdline()) or None
            except ps.AccessDenied:
                command = None
    except Exception:  # gone, in another PID namespace, or not ours to read
        pass
    gb = used / _GB if used is not None else None
    return GpuProcess(gpu=gpu, pid=pid, gpu_mem_gb=gb, name=name, user=user, command=command)
