"""The spare engine process (``gpulens.transport.spawn``): a framework callback spawns it
while training is set up, and the monitor's start takes it with the environment and folder of
that moment; one it may not take is never used, and none outlives its use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpulens
from gpulens.transport import spawn
from tests.support.jsonl import read_rows
from tests.support.wait import wait_until


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


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


def test_a_spare_whose_interpreter_would_differ_is_ended_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert spawn.prepare()
    pid = _spare_pid()
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with gpulens.Monitor(sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"]) as mon:
        assert mon.isolation == "process"
        assert mon._transport.pid != pid  # type: ignore[union-attr]
    assert wait_until(lambda: _gone(pid), what="the untaken spare's end")


def test_a_forked_child_never_takes_its_parents_spare() -> None:
    assert spawn.prepare()
    pid = _spare_pid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the fork
        os.close(r)
        got = spawn.take()
        os.write(w, b"none" if got is None and spawn._spare is None else b"took")
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as said:
        assert said.read() == b"none"
    os.waitpid(child, 0)
    assert not _gone(pid)  # the fork closed its copies only
    assert _spare_pid() == pid


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
    assert caplog.records == []
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
