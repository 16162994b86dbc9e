"""Run a script under ``torchrun`` for tests and benchmarks, and leave no process behind.

``run_torchrun(["examples/plain_loop.py", ...], cwd=tmp)`` runs::

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/plain_loop.py ...

and returns a :class:`TorchrunResult` (exit code, output, seconds, whether it timed out, and the
processes of the job that outlived ``torchrun``).

Killing the whole job is not one ``os.killpg``: torchrun is started in a session of its own, but
torch's elastic agent starts every rank with ``start_new_session=True`` too (torch 2.x,
``SubprocessHandler._popen``), so each rank leads a process group of its own (with the
processes it spawns, such as gpulens's engine process), and a rank whose agent died is
re-parented away from it. So every process of the job carries a tag in its environment
(``TORCHRUN_JOB_TAG``, inherited by ranks and their children), and :func:`kill_job` kills the
process group of torchrun and of every tagged process, then every tagged process left.
It is called on timeout, after every run (to catch leftovers) and by :func:`kill_all_jobs` at
test teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TAG_VAR = "TORCHRUN_JOB_TAG"
LEFTOVER_GRACE_S = 5.0
"""How long the processes of a job may take to end by themselves once torchrun has exited,
before they count as leftovers and are killed."""

_LIVE_TAGS: set[str] = set()


@dataclass
class JobProcess:
    pid: int
    cmdline: str


@dataclass
class TorchrunResult:
    returncode: int | None
    """torchrun's exit code; ``None`` when it was killed at the timeout."""
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    leftovers: list[JobProcess] = field(default_factory=list)
    """Processes of the job still alive ``LEFTOVER_GRACE_S`` after torchrun ended (killed)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def job_processes(tag: str) -> list[JobProcess]:
    """The live processes whose environment holds ``TORCHRUN_JOB_TAG=tag`` (zombies have an
    empty environment and are not listed)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found: list[JobProcess] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if needle not in env:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(JobProcess(int(entry), cmd))
    return found


def kill_job(tag: str, leader: int | None = None) -> list[JobProcess]:
    """SIGKILL every process of the job (see the module doc); returns those that were alive."""
    alive = job_processes(tag)
    own = os.getpgrp()
    groups = {leader} if leader is not None else set()
    for proc in alive:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(proc.pid))
    for pgid in groups:
        if pgid is not None and pgid != own:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
    for proc in alive:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
    # gone: no tagged process left, and each one killed is dead (a zombie at most; a process
    # still exiting has already lost its environment but not its pid)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and (
            job_processes(tag) or any(is_running(p.pid) for p in alive)):
        time.sleep(0.02)
    return alive


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not died yet (zombies have died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def kill_all_jobs() -> None:
    """Kill what is left of every job started by this process (test teardown)."""
    for tag in list(_LIVE_TAGS):
        kill_job(tag)
        _LIVE_TAGS.discard(tag)


def torchrun_command(script_args: Sequence[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), *script_args]


def run_torchrun(
    script_args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    nproc: int = 2,
    timeout: float = 240.0,
    on_timeout: Callable[[list[JobProcess]], None] | None = None,
) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc_per_node NPROC SCRIPT_ARGS`` in ``cwd``.

    ``env``: the whole environment (default: this process's). On timeout ``on_timeout`` is
    called with the job's live processes (to take their stacks) before they are killed.
    Whatever happens (timeout, an exception, Ctrl-C), no process of the job outlives the call.
    """
    tag = f"{os.getpid()}-{uuid.uuid4().hex}"
    full_env = dict(os.environ if env is None else env)
    full_env[TAG_VAR] = tag
    _LIVE_TAGS.add(tag)
    timed_out = False
    leftovers: list[JobProcess] = []
    # Output goes to files, not pipes: a leftover process that inherited a pipe would hold it
    # open, and waiting for its end of file would look like a hang.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen(torchrun_command(script_args, nproc), cwd=cwd, env=full_env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                if on_timeout is not None:
                    on_timeout(job_processes(tag))
                kill_job(tag, leader=proc.pid)
                proc.wait()
            seconds = time.monotonic() - start
            if not timed_out:
                deadline = time.monotonic() + LEFTOVER_GRACE_S
                while job_processes(tag) and time.monotonic() < deadline:
                    time.sleep(0.05)
                leftovers = job_processes(tag)
        finally:
            # torchrun's own group only while torchrun is unreaped (its pid is not reusable yet)
            kill_job(tag, leader=proc.pid if proc.poll() is None else None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            _LIVE_TAGS.discard(tag)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return TorchrunResult(returncode=None if timed_out else proc.returncode, stdout=stdout,
                          stderr=stderr, seconds=seconds, timed_out=timed_out,
                          leftovers=leftovers)
