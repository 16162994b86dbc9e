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

HUNG_POLL_S = 0.05
"""How often :func:`run_torchrun` asks its ``hung`` predicate."""

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
    """Killed at the timeout, or once ``run_torchrun``'s ``hung`` predicate said so."""
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


def torchrun_command(script_args: Sequence[str], nproc: int = 2,
                     rendezvous: tuple[int, str] | None = None) -> list[str]:
    """torchrun's command line: ``--standalone``, or with ``rendezvous`` = (nodes,
    "127.0.0.1:PORT") one node of a job whose launches meet at that c10d rendezvous."""
    if rendezvous is None:
        where = ["--standalone"]
    else:
        nodes, endpoint = rendezvous
        where = ["--nnodes", str(nodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                 "--rdzv_id", "gpulens-test"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node",
            str(nproc), *script_args]


def run_torchrun(
    script_args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    nproc: int = 2,
    timeout: float = 240.0,
    on_timeout: Callable[[list[JobProcess]], None] | None = None,
    nodes: Sequence[Mapping[str, str]] = (),
    hung: Callable[[], bool] | None = None,
    leftover_grace_s: float = LEFTOVER_GRACE_S,
) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc_per_node NPROC SCRIPT_ARGS`` in ``cwd``.

    ``env``: the whole environment (default: this process's). On timeout ``on_timeout`` is
    called with the job's live processes (to take their stacks) before they are killed.
    Whatever happens (timeout, an exception, Ctrl-C), no process of the job outlives the call.

    ``nodes``: one launch per entry instead, all on this host, meeting at a c10d rendezvous on
    127.0.0.1 (``--nnodes len(nodes)``), each with its entry added to the environment (say a
    ``GPULENS_NODE_NAME`` of its own): a job of several "nodes".  The result's return code is
    the first non-zero one (0 if all are), its output every launch's, each line prefixed with
    ``[node i]``.

    ``hung``: for a test that knows when its job is stuck for good (its ranks wrote that they
    are about to hang, say): polled every :data:`HUNG_POLL_S` while the job runs; once it
    returns true the job is handled as at the timeout (``on_timeout``, killed whole, the result
    says ``timed_out``), without waiting out the rest of ``timeout``.
    ``leftover_grace_s``: how long the job's processes may take to end by themselves once
    torchrun has exited before they count as leftovers (a test whose leftover never ends by
    itself need not wait).
    """
    tag = f"{os.getpid()}-{uuid.uuid4().hex}"
    full_env = dict(os.environ if env is None else env)
    full_env[TAG_VAR] = tag
    _LIVE_TAGS.add(tag)
    timed_out = False
    leftovers: list[JobProcess] = []
    launches = list(nodes) or [{}]
    rendezvous = (len(launches), f"127.0.0.1:{_free_port()}") if nodes else None
    # Output goes to files, not pipes: a leftover process that inherited a pipe would hold it
    # open, and waiting for its end of file would look like a hang.
    with contextlib.ExitStack() as stack:
        files = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                  stack.enter_context(tempfile.TemporaryFile("w+"))) for _ in launches]
        start = time.monotonic()
        procs = [subprocess.Popen(torchrun_command(script_args, nproc, rendezvous), cwd=cwd,
                                  env={**full_env, **extra}, stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=err, text=True, start_new_session=True)
                 for extra, (out, err) in zip(launches, files, strict=True)]
        try:
            timed_out = not _wait_all(procs, start + timeout, hung)
            if timed_out:
                if on_timeout is not None:
                    on_timeout(job_processes(tag))
                for proc in procs:
                    kill_job(tag, leader=proc.pid)
                for proc in procs:
                    proc.wait()
            seconds = time.monotonic() - start
            if not timed_out:
                grace = time.monotonic() + leftover_grace_s
                while job_processes(tag) and time.monotonic() < grace:
                    time.sleep(0.05)
                leftovers = job_processes(tag)
        finally:
            for proc in procs:
                # torchrun's own group only while it is unreaped (its pid is not reusable yet)
                kill_job(tag, leader=proc.pid if proc.poll() is None else None)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
            _LIVE_TAGS.discard(tag)
        outs, errs = [], []
        for i, (out, err) in enumerate(files):
            out.seek(0)
            err.seek(0)
            prefix = f"[node {i}] " if nodes else ""
            outs.append("".join(prefix + line for line in out.read().splitlines(True)))
            errs.append("".join(prefix + line for line in err.read().splitlines(True)))
    codes = [p.returncode for p in procs]
    return TorchrunResult(returncode=None if timed_out else next((c for c in codes if c), 0),
                          stdout="".join(outs), stderr="".join(errs), seconds=seconds,
                          timed_out=timed_out, leftovers=leftovers)


def _wait_all(procs: Sequence[subprocess.Popen[str]], deadline: float,
              hung: Callable[[], bool] | None) -> bool:
    """Wait for every launch to exit; ``False`` at ``deadline`` or once ``hung()`` is true."""
    for proc in procs:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                proc.wait(timeout=left if hung is None else min(left, HUNG_POLL_S))
                break
            except subprocess.TimeoutExpired:
                if hung is not None and hung():
                    return False
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
