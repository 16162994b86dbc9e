"""The engine in a process of its own (``Monitor(isolation="process")``, the default).

What must hold: the training process runs no sampler or writer thread; rows reach sinks on
both sides of the pipe, in order; user errors found there are ``ValueError`` here; what the
engine says reaches this process's ``gpulens`` logger; the engine process dying, or failing to
start, never stops training and is told once, with true figures; a training process that dies
without ``stop()`` still leaves its JSONL rows written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpulens
from gpulens.engine.spec import EngineSpec
from gpulens.testing import MemorySink, SimulatedNVML
from gpulens.transport.process import STOP_GRACE_S, ProcessTransport
from tests.support.jsonl import read_rows
from tests.support.mlflow_server import MlflowTracking
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parent.parent


def _train(mon: gpulens.Monitor, steps: int, dt: float = 0.03, **scalars: Any) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, **scalars)


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _sampler_children() -> list[psutil.Process]:
    out = []
    for child in _children():
        try:
            if "gpulens.transport.child" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.Error:
            pass
    return out


def _wait_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, alive


def test_rows_written_by_the_engine_process(tmp_path: Path) -> None:
    path = tmp_path / "gpu.jsonl"
    mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], backend="simulated")
    with mon:
        assert mon.isolation == "process"
        _train(mon, 8, learning_rate=1e-3)
        children = _sampler_children()
        assert len(children) == 1
        # nothing samples or writes in this process: no sampler, no sink thread, and the
        # link thread is asleep in os.read (no rows come back: the only sink is remote)
        names = {t.name for t in threading.enumerate()}
        assert not any(n.startswith(("gpulens-sampler", "gpulens-sink")) for n in names)
    _wait_gone(children)
    rows = read_rows(path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["train/loss"] == pytest.approx(1 / 8)
    assert rows[-1]["train/learning_rate"] == 1e-3
    for gpu in (0, 1):  # GPULENS_SIMULATED_GPUS defaults to 2
        assert rows[-1][f"gpu/{gpu}/power_w"] > 0 and f"gpu/{gpu}/sm_active_pct" in rows[-1]
    assert mon.sink_stats[f"jsonl:{path}"].written == 8  # named as written (issue 21)
    assert mon.context is not None and mon.context.backend == "simulated"


def test_local_sinks_get_the_rows_back_in_order(tmp_path: Path) -> None:
    background, training = MemorySink(), MemorySink(on_training_thread=True)
    path = tmp_path / "gpu.jsonl"
    with gpulens.Monitor(interval=0.05, sinks=[background, training, f"jsonl:{path}"],
                         backend="simulated") as mon:
        _train(mon, 10)
    assert [r.step for r in background.rows] == list(range(1, 11))
    assert [r.step for r in training.rows] == list(range(1, 11))
    assert training.write_threads == {threading.current_thread().name}
    assert background.context is not None and len(background.context.gpus) == 2
    assert background.closed and training.closed
    jsonl = read_rows(path)
    # the same figures on both sides of the pipe
    assert jsonl[4]["gpu/1/power_w"] == pytest.approx(background.rows[4].values["gpu/1/power_w"])
    assert {k: (v.written, v.dropped) for k, v in mon.sink_stats.items()} == {
        f"jsonl:{path}": (10, 0), "MemorySink": (10, 0), "MemorySink#2": (10, 0)}


class _LazyScalar:
    """Stands for a CUDA tensor: ``item()`` must not run on the training thread."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.threads: list[str] = []

    def item(self) -> float:
        self.threads.append(threading.current_thread().name)
        return self.value


def test_scalars_of_unknown_kind_are_converted_off_the_training_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A value whose ``.item()`` might synchronise a device (not a number, not a host tensor,
    not a staged copy) is read by the relay thread, in order with the plain rows after it."""
    from gpulens.transport import relay

    monkeypatch.setattr(relay, "LATE_S", 0.02)
    monkeypatch.setattr(relay, "RELAY_WAKE_S", 0.01)
    sink = MemorySink()
    scalars = [_LazyScalar(0.5 * i) for i in range(1, 7)]
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated") as mon:
        for step in range(1, 7):
            time.sleep(0.02)
            # a plain row first, then tensors: later plain rows must not overtake them
            mon.log(step, loss=scalars[step - 1] if step > 1 else 1.0)
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5, 6]
    assert [r.values["train/loss"] for r in sink.rows] == [1.0, 1.0, 1.5, 2.0, 2.5, 3.0]
    me = threading.current_thread().name
    assert all(s.threads and me not in s.threads for s in scalars[1:])


def test_user_error_in_the_engine_process_is_a_value_error_here() -> None:
    mon = gpulens.Monitor(gpus=[7], sinks=[MemorySink()], backend="simulated")
    with pytest.raises(ValueError, match="GPU 7 does not exist: this process sees 2 GPU"):
        mon.start()
    assert not mon.running
    assert not _sampler_children()


def test_bad_isolation_is_refused() -> None:
    with pytest.raises(ValueError, match="isolation 'fork'"):
        gpulens.Monitor(isolation="fork")
    mon = gpulens.Monitor(isolation="process", backend=SimulatedNVML(gpus=1, load=_unpicklable))
    with pytest.raises(ValueError, match="needs a backend that pickles"):
        mon.start()


_unpicklable = lambda gpu, t: 0.5  # noqa: E731 - a lambda on purpose: it does not pickle


def test_backend_objects_cross_when_they_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    with gpulens.Monitor(backend=SimulatedNVML(gpus=1)) as mon:
        assert mon.isolation == "process"
    with gpulens.Monitor(backend=SimulatedNVML(gpus=1, load=_unpicklable)) as mon:
        assert mon.isolation == "thread"
    monkeypatch.setenv("GPULENS_ISOLATION", "thread")
    with gpulens.Monitor(backend="simulated") as mon:
        assert mon.isolation == "thread"
    monkeypatch.setenv("GPULENS_ISOLATION", "sideways")
    with pytest.raises(ValueError, match="GPULENS_ISOLATION='sideways'"):
        gpulens.Monitor(backend="simulated").start()
    # integrations copy a monitor's settings: isolation goes with them
    assert gpulens.Monitor(isolation="thread").with_sinks([]).settings.isolation == "thread"


def test_spawn_failure_falls_back_to_a_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", "")
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=[sink], backend="simulated") as mon:
        _train(mon, 3)
        assert mon.isolation == "thread"
    assert [r.step for r in sink.rows] == [1, 2, 3]
    assert "sampling in a thread of this process instead" in caplog.text


def test_engine_process_killed_mid_run_training_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated").start()
        _train(mon, 3)
        wait_until(lambda: len(sink.rows) == 3, what="rows 1-3 back from the engine process")
        (child,) = _sampler_children()
        child.kill()
        child.wait(5)
        for step in range(4, 30):
            mon.log(step, loss=1.0)
        mon.stop()
    # log()'s cost with the engine process gone: benchmarks/unit_timings.py
    assert [r.step for r in sink.rows] == [1, 2, 3]
    assert "did not stop in" not in caplog.text  # stop() saw the death, waited out nothing
    told = [r for r in caplog.records if "engine process" in r.message]
    assert len(told) == 1, [r.message for r in told]  # one warning, not one per cause
    assert "ended unexpectedly" in told[0].message


def test_latest_asks_the_engine_process() -> None:
    with gpulens.Monitor(interval=0.05, backend="simulated") as mon:
        latest = wait_until(mon.latest, what="a first sample")
    assert latest["gpu/0/power_w"] > 0 and latest["gpu/1/temp_c"] > 0
    assert "host/ram_used_gb" in latest


class _FakeAllocator:
    def __init__(self) -> None:
        self.reads = 0

    def read(self, index: int) -> tuple[float, float, float, float]:
        self.reads += 1
        return 1.5 + index, 2.5 + index, 3.0, 0.0


def test_torch_allocator_read_here_once_a_slow_period() -> None:
    """The engine process cannot see this process's allocator: ``log()`` reads it, once a
    slow period (1 s), and the rows carry the newest reading."""
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated")
    fake = _FakeAllocator()
    mon._alloc = fake  # type: ignore[assignment]
    with mon:
        t0 = time.monotonic()
        _train(mon, 60, dt=0.025)  # ~1.6 s, longer on a loaded machine
        spent = time.monotonic() - t0
    # two GPUs, once for each slow period begun (not once a log: that would be 120 reads)
    assert 2 <= fake.reads <= 2 * (math.floor(spent / mon._slow) + 1), (fake.reads, spent)
    values = [r.values for r in sink.rows]
    assert all(v["gpu/0/torch_allocated_gb"] == 1.5 for v in values)
    assert all(v["gpu/1/torch_peak_gb"] == 3.5 for v in values)
    assert all(v["gpu/1/torch_alloc_retries"] == 3.0 and v["gpu/0/torch_ooms"] == 0.0
               for v in values)


class _FakeCuda:
    def __init__(self) -> None:
        self.calls = 0

    def is_initialized(self) -> bool:
        return True

    def memory_stats_as_nested_dict(self, index: int) -> dict[str, Any]:
        self.calls += 1
        return {"allocated_bytes": {"all": {"current": 2e9 * (index + 1), "peak": 3e9}},
                "num_alloc_retries": 2, "num_ooms": 1}


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_allocator_is_read_here_once_a_slow_period(
    monkeypatch: pytest.MonkeyPatch, isolation: str,
) -> None:
    class FakeTorch:
        cuda = _FakeCuda()

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    sink = MemorySink()
    with gpulens.Monitor(interval=0.02, sinks=[sink], backend=SimulatedNVML(gpus=2),
                         isolation=isolation) as mon:
        t0 = time.monotonic()
        _train(mon, 12, dt=0.1)  # 1.2 s (longer when loaded): ~60 cheap reads, 2-3 slow ones
        spent = time.monotonic() - t0
    # two GPUs, once for each slow period begun (not once a log: 24)
    assert FakeTorch.cuda.calls <= 2 * (math.floor(spent / mon._slow) + 1), spent
    last = sink.rows[-1].values
    assert last["gpu/0/torch_allocated_gb"] == 2.0 and last["gpu/1/torch_allocated_gb"] == 4.0
    assert last["gpu/1/torch_peak_gb"] == 3.0
    assert last["gpu/1/torch_alloc_retries"] == 2.0 and last["gpu/1/torch_ooms"] == 1.0


def test_mlflow_written_by_the_engine_process_into_the_active_run(
    mlflow_tracking: MlflowTracking,
) -> None:
    import mlflow

    with mlflow.start_run() as run, gpulens.Monitor(
            interval=0.05, sinks=["mlflow"], backend="simulated") as mon:
        assert mon.isolation == "process"
        _train(mon, 4)
    client = mlflow_tracking.client()
    power = client.get_metric_history(run.info.run_id, "train/gpu_power_w_mean")
    assert sorted(m.step for m in power) == [1, 2, 3, 4]
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in loss) == [1, 2, 3, 4]
    assert len(mlflow_tracking.runs()) == 1  # no run of the engine process's own


def _five_steps_then(path: Path, end: str) -> str:
    """A training script: a monitor into JSONL logs steps 1-5, prints its engine's pid, then
    runs ``end`` (how the training process goes away)."""
    return textwrap.dedent(f"""
        import os, time, gpulens
        mon = gpulens.Monitor(interval=0.05, sinks=["jsonl:{path}"], backend="simulated")
        mon.start()
        for step in range(1, 6):
            time.sleep(0.03)
            mon.log(step)
        print(mon._transport.pid, flush=True)
        {end}
    """)


def _engine_ends(pid: int) -> None:
    """The engine process (no child of this one) ends by itself once its training process
    went."""
    with contextlib.suppress(psutil.NoSuchProcess):
        _wait_gone([psutil.Process(pid)], timeout=15.0)


def test_training_process_killed_leaves_its_rows_written(tmp_path: Path) -> None:
    """A training process that ends without ``stop()`` (``os._exit``: no finalizers): the
    engine process sees the pipe close, finishes the windows it holds and writes them."""
    path = tmp_path / "gpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", _five_steps_then(path, "os._exit(3)")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 3, done.stderr
    _engine_ends(int(done.stdout.split()[0]))
    rows = read_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all("gpu/0/power_w" in r for r in rows)


def test_sigterm_to_the_process_group_leaves_the_rows_written(tmp_path: Path) -> None:
    """A launcher that stops a job (torchrun: ``os.killpg(rank, SIGTERM)``; the engine
    process is in the rank's process group) ends the training process; the engine process
    outlives the signal, sees the pipe close and writes the rows it holds and ``run_end``
    (it died with the training process: the last rows and the run's end were lost)."""
    path = tmp_path / "gpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", _five_steps_then(path, "time.sleep(60)")],
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        _engine_ends(child)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert [r["step"] for r in read_rows(path)] == [1, 2, 3, 4, 5]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-1].get("event") == "run_end", lines[-1]


# -- faults: pipes, fork, interrupts, relay, stop -------------------------------------------------
def _nfd() -> int:
    return len(os.listdir("/proc/self/fd"))


def _pipes() -> set[str]:
    """This process's open pipes (``pipe:[inode]``): what a transport opens and must close.
    Other threads of the test process (a tracker's, from an earlier test in this worker) may
    open sockets and files meanwhile; counting every fd read those as a leak."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("pipe:"):
                out.add(f"{fd}:{target}")
    return out


def _spec() -> EngineSpec:
    return EngineSpec(interval=0.05, backend=SimulatedNVML(gpus=2), buffer_rows=100)


def test_killed_engine_process_closes_both_pipes_and_tells_true_figures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    base = _nfd()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for _ in range(2):
            memory = MemorySink()
            mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{tmp_path / 'g.jsonl'}",
                                                        memory],
                                  backend="simulated").start()
            _train(mon, 2)
            transport = mon._transport
            assert isinstance(transport, ProcessTransport)

            def told_two_rows(transport: ProcessTransport = transport) -> bool:
                # the engine's figures come every second: JSONL 2 rows written (told from
                # the engine process); the memory sink here has its 2 rows
                last = transport._last_stats
                jsonl = (last.stats.get(f"jsonl:{tmp_path / 'g.jsonl'}") if last is not None
                         else None)
                return jsonl is not None and jsonl.written == 2
            wait_until(told_two_rows, what="the engine's figures: JSONL 2 rows written")
            wait_until(lambda m=memory: len(m.rows) == 2, what="2 rows back from the engine")
            (child,) = _sampler_children()
            child.kill()
            child.wait(5)
            for step in range(3, 6):  # a write meets the closed pipe (EPIPE)
                time.sleep(0.05)
                mon.log(step)
            stats = mon.stop()
            jsonl = stats[f"jsonl:{tmp_path / 'g.jsonl'}"]
            assert (jsonl.written, jsonl.dropped) == (2, 0)
            assert (stats["MemorySink"].written, stats["MemorySink"].dropped) == (2, 0)
    assert _nfd() == base
    assert caplog.text.count("ended unexpectedly") == 2  # once for each monitor
    assert f"rows it had not yet written to jsonl:{tmp_path / 'g.jsonl'} are lost" in caplog.text


def test_child_failing_before_ready_leaks_no_fd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process started fails before "ready", but a process it left behind holds the
    pipe's write end a moment longer: the link thread is still reading when start() gives
    up, and closes the read end itself when the end of file comes."""
    from gpulens.transport.process import ProcessTransport, SpawnFailed

    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, pickle, struct, subprocess, sys
        from gpulens.transport.messages import Failed
        payload = pickle.dumps(Failed(False, "RuntimeError", "no luck"))
        os.write(int(sys.argv[4]), struct.pack("<I", len(payload)) + payload)
        subprocess.Popen(["sleep", "0.5"], close_fds=False)  # inherits the write end
        sys.exit(1)
    """))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    base = _pipes()
    for _ in range(2):
        with pytest.raises(SpawnFailed, match="RuntimeError: no luck"):
            ProcessTransport().start(_spec(), on_row=lambda row: None)
    deadline = time.monotonic() + 5
    while _pipes() != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pipes() == base


def test_keyboard_interrupt_while_starting_ends_the_engine_process() -> None:
    import queue

    from gpulens.transport.process import ProcessTransport

    class Interrupted(queue.Queue):  # type: ignore[type-arg]
        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            raise KeyboardInterrupt  # Ctrl-C while start() waits for "ready"

    base = _nfd()
    proc = ProcessTransport()
    proc._startup = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        proc.start(_spec(), on_row=lambda row: None)
    assert proc._proc is not None and proc._proc.poll() is not None
    assert not _sampler_children()
    assert _nfd() == base


def test_a_forked_child_leaves_the_parents_sampler_alone(tmp_path: Path) -> None:
    """A child forked from the training process (its atexit finalizer runs) sends nothing to
    the parent's engine process, closes its copies of the pipe ends and exits at once."""
    path = tmp_path / "gpu.jsonl"
    script = textwrap.dedent(f"""
        import json, os, sys, time, gpulens
        from tests.support.fds import open_among
        mon = gpulens.Monitor(interval=0.05, sinks=["jsonl:{path}"], backend="simulated")
        mon.start()
        for step in range(1, 4):
            time.sleep(0.03)
            mon.log(step, loss=1.0)
        fds = (mon._transport._tx.fd, mon._transport._rx.fd)
        t = time.monotonic()
        pid = os.fork()
        if pid == 0:
            closed = [fd not in open_among(fds) for fd in fds]
            mon.log(99, loss=1.0)  # does nothing here
            print("child", json.dumps(closed), flush=True)
            sys.exit(0)  # atexit: the monitor's finalizer
        os.waitpid(pid, 0)
        print("fork_exit_s", time.monotonic() - t, flush=True)
        print("alive", mon._transport._proc.poll() is None, flush=True)
        for step in range(4, 8):
            time.sleep(0.03)
            mon.log(step, loss=1.0)
        mon.stop()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert json.loads(out["child"]) == [True, True]
    # the child does not wait on the parent's engine (stop() would wait >= STOP_GRACE_S): a
    # bound on a hang only; the figure itself: benchmarks/unit_timings.py
    assert float(out["fork_exit_s"]) < STOP_GRACE_S, out["fork_exit_s"]
    assert out["alive"] == "True"
    rows = read_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]


class _TwoElements:
    def item(self) -> float:
        raise RuntimeError("a Tensor with 2 elements cannot be converted to Scalar")


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_value_that_cannot_be_read_is_left_out_and_the_relay_goes_on(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    """Only the value is lost, never the row (the relay converts it, whatever the engine's
    isolation)."""
    from gpulens.log import reset_warnings

    reset_warnings()
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=[sink], backend="simulated", isolation=isolation) as mon:
        mon.log(1, loss=_LazyScalar(1.0))
        time.sleep(0.03)
        mon.log(2, loss=_TwoElements(), lr=_LazyScalar(0.1))
        for step in range(3, 6):
            time.sleep(0.03)
            mon.log(step, loss=2.0)
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5]
    assert "train/loss" not in sink.rows[1].values
    assert sink.rows[1].values["train/lr"] == 0.1
    assert sink.rows[4].values["train/loss"] == 2.0
    assert ("logged value 'loss' (_TwoElements) could not be read as a number "
            "(a Tensor with 2 elements") in caplog.text


def test_relay_queue_is_bounded_and_its_drops_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpulens.transport import relay as relay_module

    monkeypatch.setattr(relay_module, "RELAY_MAX", 5)
    gate = threading.Event()

    class Slow:
        def item(self) -> float:
            gate.wait(10)
            return 1.0

    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated") as mon:
        assert mon.dropped_marks == 0
        mon.log(1, loss=Slow())  # of unknown kind: the relay thread reads it, and waits
        for step in range(2, 12):  # behind it: 4 more fit, 6 are dropped
            mon.log(step, loss=1.0)
        assert mon.dropped_marks == 6
        gate.set()
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5]
    assert mon.dropped_marks == 6


def test_dropped_marks_are_counted_and_stop_still_gets_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A stalled engine process: marks beyond the queue's bound are dropped and counted;
    stop()'s own frame is never dropped, so the engine process still stops cleanly."""
    from gpulens.transport import pipe as link
    from gpulens.transport import spawn

    monkeypatch.setattr(link, "MAX_PENDING_BYTES", 64 * 1024)
    monkeypatch.setattr(spawn, "PIPE_BYTES", 64 * 1024)
    path = tmp_path / "gpu.jsonl"
    wide = {f"s{i:03d}": float(i) for i in range(60)}
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"],
                              backend="simulated").start()
        pid = mon._transport.pid  # type: ignore[union-attr]
        assert pid is not None
        child = psutil.Process(pid)
        child.suspend()
        try:
            step = 0
            while mon.dropped_marks < 3 and step < 10_000:
                step += 1
                mon.log(step, **wide)
        finally:
            child.resume()
        stats = mon.stop(timeout=2.0)
    assert mon.dropped_marks == 3
    assert "3 step mark(s) were dropped on their way" in caplog.text
    assert stats[f"jsonl:{path}"].written == step - 3
    assert "did not stop in" not in caplog.text  # the engine stopped by itself, in time
    with gpulens.Monitor(backend=SimulatedNVML(gpus=1), isolation="thread") as thread_mon:
        assert thread_mon.dropped_marks == 0


def test_latest_gives_up_at_once_when_the_engine_process_dies_and_drops_late_replies(
) -> None:
    mon = gpulens.Monitor(interval=0.05, backend="simulated").start()
    proc = mon._transport
    assert isinstance(proc, ProcessTransport) and proc.pid is not None
    child = psutil.Process(proc.pid)
    wait_until(mon.latest, what="a first sample")
    child.suspend()
    try:
        assert proc.latest(timeout=0.1) == {}  # no answer in time
        child.resume()
        # the late answer arrives (before the next one: one pipe): nobody waits for it
        assert wait_until(mon.latest, what="an answer after the late one")["gpu/0/power_w"] > 0
        assert proc._replies == {}
        child.suspend()
        killer = threading.Timer(0.3, child.kill)
        killer.start()
        t = time.perf_counter()
        # an hour to answer: only the death can end this wait
        assert proc.latest(timeout=3600.0) == {}
        waited = time.perf_counter() - t
        killer.join()
    finally:
        with contextlib.suppress(psutil.Error):
            child.resume()
    assert waited < 60, waited  # bounds a hang: gave up at the death, not at the timeout
    mon.stop()


def test_an_installed_gpulens_is_not_put_ahead_of_the_standard_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import site

    from gpulens.transport import spawn

    root = str(Path(spawn.__file__).resolve().parent.parent.parent)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    # a source checkout: the child must import this very gpulens
    assert spawn.child_env()["PYTHONPATH"] == f"{root}{os.pathsep}/elsewhere"
    monkeypatch.setattr(site, "getsitepackages", lambda: [root])
    assert spawn.child_env()["PYTHONPATH"] == "/elsewhere"


def test_the_engine_process_ignores_sigint_before_it_imports_gpulens(tmp_path: Path) -> None:
    from gpulens.transport.spawn import CHILD

    fake = tmp_path / "gpulens"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "transport").mkdir()
    (fake / "transport" / "__init__.py").write_text("")
    (fake / "transport" / "child.py").write_text(textwrap.dedent("""
        import signal
        IGNORED = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        def main(argv):
            print("ignored", IGNORED)
            return 0
    """))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ignored True"


def _record_handoffs(mon: gpulens.Monitor) -> list[tuple[int, str]]:
    """(step, thread) of each row the transport hands on to this process, from now on."""
    transport: Any = mon._transport
    assert isinstance(transport, ProcessTransport)
    handed: list[tuple[int, str]] = []
    on_row = transport._on_row
    assert on_row is not None

    def record(row: Any, final: bool) -> None:
        handed.append((row.step, threading.current_thread().name))
        on_row(row, final)

    transport._on_row = record
    return handed


def test_rows_back_are_taken_by_log_and_wake_no_thread(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Rows for this process's sinks come back on a pipe of their own that ``log()`` reads
    without waiting: a row reaches its sink at the ``log()`` after its window closed, on the
    training thread; the link thread takes only what is left at the end."""
    from gpulens.transport import process

    # the link thread's fallback (rows log() has not taken for this long) kept out of the way
    # of a loaded machine's slow loop: this test is about the rows log() takes
    monkeypatch.setattr(process, "STATS_EVERY_S", 30.0)
    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated") as mon:
        handed = _record_handoffs(mon)
        for step in range(1, 7):
            time.sleep(0.5)  # a row is finished ~0.25 s after its log()
            mon.log(step, loss=1.0 / step)
    me = threading.current_thread().name
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5, 6]
    assert [s for s, t in handed] == [1, 2, 3, 4, 5, 6]
    assert {t for s, t in handed if s <= 5} == {me}, handed
    assert "gpulens-link" not in {t for s, t in handed if s <= 4}


def test_rows_of_a_loop_that_stopped_logging_still_come(tmp_path: Path) -> None:
    """A loop that stops calling ``log()`` (evaluation, a checkpoint) does not hold its last
    rows back: the link thread hands them on at its next wake (the engine's figures, every
    second)."""
    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated") as mon:
        handed = _record_handoffs(mon)
        mon.log(1, loss=1.0)
        deadline = time.monotonic() + 10.0
        while not sink.rows and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.step for r in sink.rows] == [1], "the row never came without another log()"
        assert handed == [(1, "gpulens-link")]


def test_an_engine_that_cannot_join_its_nodes_gather_says_so_and_runs_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default path of a one-node job: the engine process joins the gather itself. One
    that cannot open the node's file says so in a WARNING that reaches the training process,
    starts all the same and stops cleanly; its rows are not gathered (and not written as if
    they were the job's)."""
    from dataclasses import replace

    from gpulens.distributed.rows import GatherPlan
    from gpulens.distributed.start import Membership

    m = Membership(prefix="p/", token="t", rank=1, world=2, node=0, node_name="h",
                   members=(0, 1), node_keys=("h",), local_rank=1, launcher="test", arrived=2)
    spec = replace(_spec(), gather_plan=GatherPlan(m, str(tmp_path / "no-such-ring"), 8),
                   rank=(1, 1, 2), rows_back=True)
    rows: list[Any] = []
    proc = ProcessTransport()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        proc.start(spec, on_row=lambda row, final: rows.append(row))
        for step in (1, 2):
            proc.send_mark((step, time.monotonic(), time.time(), {}, None))
        proc.stop(5.0, 5.0)  # the marks' windows close at the engine's stop: their rows come
        proc.take_rows()
    said = [r.getMessage() for r in caplog.records if "could not join" in r.getMessage()]
    assert len(said) == 1 and "rank 1's engine" in said[0], caplog.text
    assert rows == []
