"""The processes on the GPUs: NVML's lists through the door, named by psutil, read by the
engine (in its own process by default) and drawn by ``watch``'s process table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import psutil
import pytest
from rich.console import Console

import gpulens
from gpulens.cli.watch.layout import render_lines
from gpulens.cli.watch.processes import PROCESS_MIN_WIDTH, process_lines
from gpulens.sources.nvml import NvmlSource
from gpulens.sources.processes import GpuProcess, describe, used_bytes
from gpulens.testing import Constant, SimulatedNVML

GIB = 1024**3


def _text(lines: list[object]) -> list[str]:
    console = Console(width=400, color_system=None)
    out = []
    for line in lines:
        with console.capture() as cap:
            console.print(line)
        out.append(cap.get().rstrip("\n"))
    return out


def test_the_door_merges_compute_and_graphics_lists_and_keeps_unknown_memory_unknown() -> None:
    sim = SimulatedNVML(gpus=2, processes={0: [(101, 2 * GIB), (102, None)], 1: []})
    sim.nvmlDeviceGetGraphicsRunningProcesses = (  # type: ignore[method-assign]
        lambda h: [type("P", (), {"pid": 102, "usedGpuMemory": GIB})(),
                   type("P", (), {"pid": 103, "usedGpuMemory": None})()] if h.index == 0 else [])
    src = NvmlSource(sim)
    src.open()
    assert src.device(0).read_processes() == [(101, 2 * GIB), (102, GIB), (103, None)]
    assert src.device(1).read_processes() == []


def test_a_gpu_that_cannot_list_its_processes_gives_none_once_told() -> None:
    sim = SimulatedNVML(gpus=1, not_supported={0: {"nvmlDeviceGetComputeRunningProcesses",
                                                   "nvmlDeviceGetGraphicsRunningProcesses"}})
    src = NvmlSource(sim)
    src.open()
    dev = src.device(0)
    assert dev.read_processes() == [] and dev.read_processes() == []
    assert sim.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # not asked again


def test_used_bytes_reads_the_drivers_not_available_as_none() -> None:
    assert used_bytes(None) is None and used_bytes((1 << 64) - 1) is None
    assert used_bytes(5 * GIB) == 5 * GIB and used_bytes(0) == 0


_MY_COMMAND = " ".join(psutil.Process().cmdline())


def test_describe_names_a_process_this_one_can_see_and_only_the_pid_of_one_it_cannot() -> None:
    me = describe(3, os.getpid(), 2_000_000_000)
    assert me.gpu == 3 and me.gpu_mem_gb == 2.0 and me.name and me.user
    assert me.command == _MY_COMMAND  # pytest's, or an xdist worker's
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    gone = describe(0, proc.pid, None)  # a process id nothing holds now
    assert gone == GpuProcess(0, proc.pid, None, None, None, None)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_monitor_processes_come_from_the_engine_and_stop_with_it(isolation: str) -> None:
    sim = SimulatedNVML(gpus=2, load=Constant(0.5))
    mon = gpulens.Monitor(backend=sim, interval=0.05, isolation=isolation)
    assert mon.processes() == []  # not started
    with mon:
        procs = mon.processes()
        if isolation == "process":  # read in the engine process, about this one
            assert mon.isolation == "process"
        assert [(p.gpu, p.pid) for p in procs] == [(0, os.getpid()), (1, os.getpid())]
        expected_gb = ((4 + 60 * 0.5) * GIB - GIB // 2) / 1e9
        for p in procs:
            assert p.gpu_mem_gb == pytest.approx(expected_gb)
            assert p.command == _MY_COMMAND
    assert mon.processes() == []


def _proc(gpu: int, pid: int, gb: float | None, command: str | None = "python train.py",
          user: str | None = "alice") -> GpuProcess:
    return GpuProcess(gpu, pid, gb, "python" if command else None, user, command)


def test_the_table_orders_by_gpu_then_memory_and_cuts_only_the_command() -> None:
    procs = [_proc(1, 7, 3.0), _proc(0, 5, 1.0), _proc(0, 6, 40.0, "/usr/bin/python3 " + "x" * 300),
             _proc(1, 8, None, None, None)]
    lines = _text(process_lines(procs, 120, 10))
    assert lines[0].startswith("Processes ─") and lines[1].split() == ["GPU", "PID", "User",
                                                                       "GPU", "mem", "Command"]
    rows = lines[2:]
    assert [r.split()[:2] for r in rows] == [["0", "6"], ["0", "5"], ["1", "7"], ["1", "8"]]
    assert all(len(r) <= 120 for r in lines)
    assert rows[0].endswith("…") and "python3 xxx" in rows[0]  # the program without its dir
    assert "/usr/bin" not in rows[0]
    assert "40.0 GB" in rows[0] and "1.0 GB" in rows[1] and "python train.py" in rows[1]
    assert "n/a" in rows[3] and "another PID namespace" in rows[3]  # unknown: not 0 GB
    assert " ? " in rows[3]  # no user known


def test_the_table_fits_the_rows_it_is_given() -> None:
    procs = [_proc(g, 100 + g, 1.0) for g in range(8)]
    lines = _text(process_lines(procs, 120, 6))
    assert len(lines) == 6 and lines[-1].startswith("+5 more processes")
    assert process_lines(procs, 120, 2) == []
    assert _text(process_lines([], 120, 5))[1] == "none on these GPUs"


def test_the_frame_has_the_table_only_from_its_width_and_within_its_height() -> None:
    from collections import deque

    from gpulens.cli.watch.view import GpuView
    from gpulens.model import GpuInfo

    views = [GpuView(GpuInfo(index=g, name="NVIDIA H100", uuid="", pci_bus_id="",
                             mem_total_gb=85.9, power_limit_w=700.0), deque(maxlen=10))
             for g in range(8)]
    procs = [_proc(g, 100 + g, 1.0) for g in range(8)]

    def frame(width: int, height: int | None) -> list[str]:
        return _text(render_lines(views, width, 10, 1.0, "host", "nvml", processes=procs,
                                  height=height))

    assert not any("Processes" in line for line in frame(PROCESS_MIN_WIDTH - 1, 40))
    full = frame(PROCESS_MIN_WIDTH, 40)
    rows = [line.split()[:2] for line in full if re.match(r"^ +\d +10\d +alice ", line)]
    assert rows == [[str(g), str(100 + g)] for g in range(8)]
    short = frame(PROCESS_MIN_WIDTH, 20)
    assert len(short) == 20 and any(line.startswith("+") for line in short)  # fills it
    assert not any("Processes" in line for line in frame(PROCESS_MIN_WIDTH, 15))


def test_the_simulator_says_which_process_made_it() -> None:
    sim = SimulatedNVML(gpus=1)
    assert sim.owner_pid == os.getpid()
    src = NvmlSource(sim)
    src.open()
    [(pid, used)] = src.device(0).read_processes()
    assert pid == os.getpid() and used is not None and 0 < used < sim.MEM_TOTAL


def test_a_gpu_whose_process_list_fails_is_one_warning_in_the_training_process(
        caplog: pytest.LogCaptureFixture) -> None:
    """On the default path (the engine process): GPU 0's list fails with an unknown NVML
    error, so GPU 0 lists no process, GPU 1 still does, and the training process's ``gpulens``
    logger says so once."""
    from gpulens.log import reset_warnings

    reset_warnings()
    sim = SimulatedNVML(gpus=2, load=Constant(0.5),
                        fail_after={0: {"nvmlDeviceGetComputeRunningProcesses": 0.0}})
    with caplog.at_level("WARNING", logger="gpulens"), \
            gpulens.Monitor(backend=sim, interval=0.05) as mon:
        assert mon.isolation == "process"
        first, second = mon.processes(), mon.processes()
        deadline = time.monotonic() + 5
        while not any("compute_processes" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    assert [(p.gpu, p.pid) for p in first] == [(1, os.getpid())] == [(p.gpu, p.pid)
                                                                     for p in second]
    told = [r for r in caplog.records if "compute_processes" in r.getMessage()]
    assert len(told) == 1 and told[0].levelname == "WARNING"
    assert "GPU 0" in told[0].getMessage()
