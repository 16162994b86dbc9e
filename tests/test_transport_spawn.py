"""The spare engine process (``gpulens.transport.spawn``): a framework callback spawns it
while training is set up, and the monitor's start takes it with the environment and folder of
that moment; one it may not take is never used, and none outlives its use."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpulens
from gpulens.log import reset_warnings
from gpulens.transport import spawn
from tests.support.fds import open_among
from tests.support.jsonl import read_rows
from tests.support.wait import wait_until


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # a fallback here says its once-a-process warning; another test in this worker may
    # need to hear it too (and this one, one said before)
    reset_warnings()
    yield
    reset_warnings()


def _spare_pid() -> int:
    spare = spawn._spare
    assert spare is not None, "no spare engine process"
    return spare.proc.pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_start_takes_the_spare_with_this_moments_environment_and_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert spawn.prepare()
    pid = _spare_pid()
    assert spawn.prepare()  # one a process: a good spare is kept, not doubled
    assert _spare_pid() == pid
    # set after the spare was spawned: the engine must see them as a new process would
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.chdir(tmp_path)
    mon = gpulens.Monitor(sinks=["jsonl:rows.jsonl"], interval=0.05).start()
    try:
        assert mon._transport.pid == pid  # type: ignore[union-attr]
        assert psutil.Process(pid).cwd() == str(tmp_path)
        (gpu,) = mon.context.gpus  # GPU 2 of the 4, seen as CUDA sees it
        assert gpu.uuid.endswith("000000000002"), gpu
        mon.log(1)
        mon.log(2)
    finally:
        mon.stop()
    assert spawn._spare is None
    assert [r["step"] for r in read_rows(tmp_path / "rows.jsonl") if "step" in r] == [1, 2]
    assert wait_until(lambda: _gone(pid), what="the engine process's end")


def test_gpulens_setup_makes_the_next_starts_engine_process_ready(tmp_path: Path) -> None:
    """``gpulens.setup()`` (a plain loop's early call, as ``wandb.setup()``) leaves a spare
    that the next ``Monitor.start()`` takes; none where that monitor's engine would run in a
    thread; an unknown isolation is the monitor's one-line error."""
    assert not gpulens.setup(isolation="thread")
    assert spawn._spare is None
    with pytest.raises(ValueError, match="isolation 'threads': expected one of"):
        gpulens.setup(isolation="threads")
    assert gpulens.setup()
    pid = _spare_pid()
    mon = gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"], interval=0.05).start()
    try:
        assert mon._transport.pid == pid  # type: ignore[union-attr]
        mon.log(1)
    finally:
        mon.stop()
    assert spawn._spare is None
    assert [r["step"] for r in read_rows(tmp_path / "rows.jsonl") if "step" in r] == [1]


def test_a_spare_whose_interpreter_would_differ_is_ended_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    assert spawn.prepare()
    pid = _spare_pid()
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with caplog.at_level(logging.DEBUG, logger="gpulens"), \
            gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
        assert mon.isolation == "process"
        assert mon._transport.pid != pid  # type: ignore[union-attr]
    assert wait_until(lambda: _gone(pid), what="the untaken spare's end")
    # said, at DEBUG: why the start spawned a new process
    assert ("gpulens: the engine process made ready earlier is not used (this process changed "
            "since it was made: PYTHON*/LD_* variables); starting a new one"
            in [r.getMessage() for r in caplog.records])


def test_a_spare_no_monitor_will_take_is_ended(tmp_path: Path) -> None:
    """A monitor whose engine runs in a thread ends the waiting spare (it would idle until its
    retirement), and so does ``gpulens.setup(isolation="thread")``."""
    assert gpulens.setup()
    pid = _spare_pid()
    with gpulens.Monitor(isolation="thread", sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]):
        assert spawn._spare is None
    assert wait_until(lambda: _gone(pid), what="the spare's end")
    assert gpulens.setup()
    pid = _spare_pid()
    assert not gpulens.setup(isolation="thread")
    assert spawn._spare is None
    assert wait_until(lambda: _gone(pid), what="the spare's end")


def test_a_forked_child_never_takes_its_parents_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spawn.prepare()
    spare = spawn._spare
    assert spare is not None
    pid, ends = spare.proc.pid, (spare.to_child, spare.from_child, spare.rows)
    del spare  # the module's reference alone: in the fork, nothing here keeps its Popen
    said: list[str] = []  # what is collected with an error (a running Popen warns)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: said.append(repr(u.exc_value)))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the fork
        try:
            os.close(r)
            took = spawn.take() is not None or spawn._spare is not None
            open_ends = open_among(ends)
            gc.collect()
            os.write(w, repr((took, open_ends, said)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as got:
        # not taken, the copies of its pipe ends closed, its Popen not collected (it warns)
        assert got.read().decode() == repr((False, [], []))
    os.waitpid(child, 0)
    assert not _gone(pid)  # the fork closed its copies only
    assert _spare_pid() == pid


@pytest.mark.parametrize("change", ["umask", "cpus", "nice"])
def test_a_spare_made_under_another_process_state_is_ended_not_taken(
    tmp_path: Path, change: str,
) -> None:
    """What a new process inherits only when it is made (the umask, the CPUs it may use, its
    priority): a spare made before a change would write files or run where, or ahead of
    whom, a new process would not."""
    if change == "cpus" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no other set to pin to")
    if change == "nice" and os.getpriority(os.PRIO_PROCESS, 0) + 3 + spawn.ENGINE_NICE > 19:
        pytest.skip("run too nice: no room for a nicer thread and its nicer engine (cap 19)")
    assert spawn.prepare()
    pid = _spare_pid()
    if change == "nice":
        # on Linux a thread has its own nice value, and a process it starts takes it: a
        # training thread made nicer after its Trainer was built; this test's own thread
        # (and so the rest of this worker) keeps its own
        engine_nice: list[int] = []

        def nicer_start() -> None:
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
            with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
                engine = mon._transport.pid  # type: ignore[union-attr]
                assert engine is not None and engine != pid
                engine_nice.append(psutil.Process(engine).nice())

        mine = os.getpriority(os.PRIO_PROCESS, 0)
        thread = threading.Thread(target=nicer_start)
        thread.start()
        thread.join()
        assert engine_nice == [min(19, mine + 3 + spawn.ENGINE_NICE)]
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        assert wait_until(lambda: _gone(pid), what="the untaken spare's end")
        return
    before_mask, before_cpus = os.umask(0o077), os.sched_getaffinity(0)
    os.umask(before_mask if change == "cpus" else 0o077)
    try:
        if change == "cpus":
            os.sched_setaffinity(0, {min(before_cpus)})
        with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
            engine = mon._transport.pid  # type: ignore[union-attr]
            assert engine is not None and engine != pid
            if change == "cpus":
                assert psutil.Process(engine).cpu_affinity() == [min(before_cpus)]
    finally:
        os.umask(before_mask)
        os.sched_setaffinity(0, before_cpus)
    if change == "umask":
        assert (tmp_path / "rows.jsonl").stat().st_mode & 0o077 == 0
    assert wait_until(lambda: _gone(pid), what="the untaken spare's end")


def test_a_spare_works_where_the_training_process_has_over_a_thousand_files_open(
    tmp_path: Path,
) -> None:
    """The spare keeps the training process's pipe numbers; past 1023 a ``select`` there
    failed (a traceback on the console, the spare gone)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"at most {hard} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    r, w = os.pipe()
    held = [os.dup(r) for _ in range(1100)]
    try:
        assert spawn.prepare()
        pid = _spare_pid()
        assert min(spawn._spare.to_child, spawn._spare.rows) > 1023  # type: ignore[union-attr]
        with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"], interval=0.05) as mon:
            assert mon._transport.pid == pid  # type: ignore[union-attr]
            mon.log(1)
    finally:
        for fd in [*held, r, w]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert [r["step"] for r in read_rows(tmp_path / "rows.jsonl") if "step" in r] == [1]


def test_a_spare_that_does_not_answer_is_not_followed_by_more_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A spare that fails its start in any way but ending first (here: no answer in time) is
    not retried with another process: the start falls back once, as a new process's would."""
    from gpulens.transport import process

    monkeypatch.setattr(process, "READY_TIMEOUT_S", 1.0)
    assert spawn.prepare()
    spare = psutil.Process(_spare_pid())
    spawned: list[bool] = []
    real_spawn = spawn.spawn

    def counted(spare: bool = False) -> Any:
        spawned.append(spare)
        return real_spawn(spare)

    monkeypatch.setattr(spawn, "spawn", counted)
    wait_until(lambda: spare.status() == psutil.STATUS_SLEEPING, what="the spare waiting")
    spare.suspend()
    try:
        with caplog.at_level("WARNING", logger="gpulens"), \
                gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
            assert mon.isolation == "thread"
    finally:
        with contextlib.suppress(psutil.Error):
            spare.resume()
    assert spawned == []
    assert "did not start within 1 s" in caplog.text
    assert wait_until(lambda: _gone(spare.pid), what="the silent spare's end")


def test_a_spare_that_died_before_its_start_is_replaced_by_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    assert spawn.prepare()
    real_take = spawn.take

    def take_then_kill() -> Any:
        got = real_take()
        assert got is not None
        got.proc.send_signal(signal.SIGKILL)  # after it was judged good: the start finds out
        got.proc.wait(10.0)
        return got

    monkeypatch.setattr(spawn, "take", take_then_kill)
    with caplog.at_level("WARNING", logger="gpulens"), \
            gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
        assert mon.isolation == "process"  # not the thread fallback
        pid = mon._transport.pid  # type: ignore[union-attr]
        assert pid is not None and psutil.Process(pid).is_running()
        mon.log(1)
        mon.log(2)
    # survived, and said: something killed a process of gpulens's
    assert [r.getMessage() for r in caplog.records] == [
        "gpulens: the engine process made ready while training was set up ended before it "
        "answered the monitor's start (killed by SIGKILL); starting a new one"]
    assert [r["step"] for r in read_rows(tmp_path / "rows.jsonl") if "step" in r] == [1, 2]


def test_an_unused_spare_ends_by_itself_and_with_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spawn, "SPARE_IDLE_S", 0.5)
    assert spawn.prepare()
    spare = spawn._spare
    assert spare is not None
    assert spare.proc.wait(30.0) == 0  # no start came: it ended by itself
    assert spawn.take() is None
    # a script that prepares and exits without training leaves no engine process behind
    script = tmp_path / "prepare_and_exit.py"
    script.write_text(textwrap.dedent("""
        from gpulens.transport import spawn
        assert spawn.prepare()
        print(spawn._spare.proc.pid, flush=True)
    """))
    root = Path(spawn.__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    assert wait_until(lambda: _gone(pid), what="the exiting script's spare's end")


def test_a_spare_no_start_took_is_ended_and_reaped_by_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``Trainer`` built and never trained: at :data:`~spawn.TAKE_WITHIN_S` this process
    ends its spare and reaps it (it ended itself, and stayed a zombie until the next
    ``take()`` or exit); a spare taken before then is not ended by its timer."""
    monkeypatch.setattr(spawn, "TAKE_WITHIN_S", 1.0)
    assert spawn.prepare()
    pid = _spare_pid()

    def reaped() -> bool:
        try:
            psutil.Process(pid)
        except psutil.NoSuchProcess:
            return True
        return False

    assert wait_until(reaped, what="the idle spare's end, reaped")
    assert spawn._spare is None
    assert wait_until(lambda: not [t for t in threading.enumerate()
                                   if t.name == "gpulens-spare-retire"], what="its timer's end")
    monkeypatch.setattr(spawn, "TAKE_WITHIN_S", 3.0)
    assert spawn.prepare()
    got = spawn.take()
    assert got is not None and got.retire is None  # taken: its timer cancelled
    try:
        spawn._retire(got)  # a timer that fired all the same: the start that took it owns it
        assert got.proc.poll() is None and not got.closed
    finally:
        got.close()


def test_the_jobs_shape_is_awaited_while_the_engine_starts_and_lands_in_its_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 and a node's leader wait for the other ranks' GPUs at start: meanwhile their
    engine process opens NVML (it leaves a mark there), and the shape it is handed after
    its spec is in the context it answers with, its own GPUs filled in."""
    from gpulens.engine.spec import EngineSpec
    from gpulens.model import JobShape, RankInfo
    from gpulens.testing import SimulatedNVML
    from gpulens.transport import process
    from tests.support.marked_nvml import MarkedNVML

    root = str(Path(__file__).resolve().parents[1])  # the engine imports tests.support too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    mark = tmp_path / "nvml-opened"
    shape = JobShape(world=2, nodes=1, launcher="torchrun",
                     ranks=(RankInfo(0, 0, 0, "here"), RankInfo(1, 1, 0, "here")))
    transport = process.ProcessTransport()
    waited: list[bool] = []

    def job() -> JobShape:
        # the engine opens NVML while the other ranks are awaited (it did so only after)
        waited.append(bool(wait_until(mark.exists, what="the engine's NVML open")))
        return shape

    context, _ = transport.start(
        EngineSpec(interval=0.05, backend=MarkedNVML(str(mark), gpus=1), rank=(0, 0, 2)),
        lambda row, final: None, job)
    try:
        assert waited == [True]
        assert context.job is not None and context.job.world == 2
        ranks = {r.rank: r for r in context.job.ranks}
        assert ranks[0].gpus == context.gpus and ranks[1].gpus == ()
    finally:
        transport.stop(5.0, 5.0, collective=False)

    def broken() -> JobShape:
        raise KeyboardInterrupt

    failing = process.ProcessTransport()
    with pytest.raises(KeyboardInterrupt):
        failing.start(EngineSpec(interval=0.05, backend=SimulatedNVML(gpus=1)),
                      lambda row, final: None, broken)
    assert failing._proc is not None and failing._proc.poll() is not None  # ended, reaped
    assert failing not in process._LIVE


def test_no_spare_for_a_monitor_whose_engine_will_run_in_a_thread() -> None:
    """``prepare_engine`` asks the monitor's own question (``isolation_for``): a backend object
    that does not pickle runs its engine in a thread, so no spare is spawned to idle beside
    it; a backend that pickles gets one."""
    from gpulens.settings import Settings
    from gpulens.sources.simulated import SimulatedNVML
    from gpulens.transport.spawn import prepare_engine

    unpicklable = SimulatedNVML(gpus=1)
    unpicklable.hook = lambda: None  # type: ignore[attr-defined]
    prepare_engine(Settings(backend=unpicklable))
    assert spawn._spare is None
    prepare_engine(Settings(isolation="thread"))
    assert spawn._spare is None
    prepare_engine(Settings(backend=SimulatedNVML(gpus=1)))
    assert spawn._spare is not None


@pytest.mark.parametrize("setting", [None, "0", "3"])
def test_the_engine_process_runs_as_nice_as_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None,
) -> None:
    """``GPULENS_ENGINE_NICE=N``: the engine process runs N nicer than training, a spawned
    engine and a spare alike; by default as nice as training (a nicer engine fell behind on a
    loaded host: ``gpulens.settings.ENGINE_NICE``)."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    if setting is None:
        monkeypatch.delenv("GPULENS_ENGINE_NICE", raising=False)
    else:
        monkeypatch.setenv("GPULENS_ENGINE_NICE", setting)
    assert spawn.ENGINE_NICE == 0
    expected = min(19, mine + (0 if setting is None else int(setting)))
    with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'a.jsonl'}"], interval=0.05) as mon:
        engine = mon._transport.pid  # type: ignore[union-attr]
        assert engine is not None and psutil.Process(engine).nice() == expected
        mon.log(1)
    assert spawn.prepare()
    pid = _spare_pid()
    # (lowered first thing, before its imports: just after its interpreter starts)
    assert wait_until(lambda: psutil.Process(pid).nice() == expected, what="the spare's nice")
    with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'b.jsonl'}"], interval=0.05) as mon:
        assert mon._transport.pid == pid  # type: ignore[union-attr]
        mon.log(1)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the training process is untouched
    assert [r["step"] for r in read_rows(tmp_path / "b.jsonl") if "step" in r] == [1]


@pytest.mark.parametrize("value", ["ten", "-1", "20", "1.5"])
def test_a_bad_engine_nice_is_a_one_line_error_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
) -> None:
    monkeypatch.setenv("GPULENS_ENGINE_NICE", value)
    with pytest.raises(ValueError, match=r"GPULENS_ENGINE_NICE=.*whole number from 0 to 19"):
        gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'a.jsonl'}"]).start()
    # a thread runs no engine process: nothing to lower
    gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'b.jsonl'}"], isolation="thread").start().stop()


def test_the_engine_runs_blas_on_one_thread_whatever_training_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``import wandb`` in the engine imports NumPy, whose OpenBLAS would start a spinning
    thread per CPU (on an H200 host: 16 CPUs at once, the training thread kept waiting): the
    engine's environment says one thread, a spawned engine's and a spare's alike, and the
    training process keeps its own values."""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    one = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'a.jsonl'}"], interval=0.05) as mon:
        engine = psutil.Process(mon._transport.pid)  # type: ignore[union-attr]
        assert {k: engine.environ().get(k) for k in one} == one
        mon.log(1)
    assert spawn.prepare()
    spare = psutil.Process(_spare_pid())
    assert {k: spare.environ().get(k) for k in one} == one
    with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'b.jsonl'}"], interval=0.05) as mon:
        assert mon._transport.pid == spare.pid  # type: ignore[union-attr]
        mon.log(1)
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OPENBLAS_NUM_THREADS"]) == ("8", "4")
    assert "MKL_NUM_THREADS" not in os.environ
