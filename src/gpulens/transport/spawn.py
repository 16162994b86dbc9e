"""How the engine process is started, and the spare one a framework callback starts early.

:func:`spawn` starts ``python -c`` :data:`CHILD` with three pipes (marks and requests in;
log records, figures and answers out; rows out), in the environment of :func:`child_env`.

**The spare** (issue 18: the monitor's start off the training thread's path).  Most of a
spawned ``start()`` is the new interpreter and its imports of gpulens's engine, before the
engine does anything: on an H200 host 0.29-0.38 s in all, of which the interpreter and the
imports ~0.17 s and the engine's own start 0.03 s
(``benchmarks/results/2026-11-28-h200-hf-ls1-onegpu``, ``c1/start_split.md``).  A framework
knows long before training starts that a monitor will: Hugging Face's ``Trainer`` calls
``on_init_end`` when it is built, Lightning calls ``setup`` when ``fit`` begins.  There the
callback calls :func:`prepare`: an engine process is spawned and imports the engine (and NVML's
and psutil's modules) while the user's code and the framework go on; it then waits for its
``Start``.  The next ``start()`` in this process takes it (:func:`take`) and sends the spec with
this process's environment and folder of that moment, which the spare takes on before it builds
anything, as a fresh process would have inherited them.

At most one spare a process.  It is not taken (and is ended, off the training thread) if this
process was forked since (the spare is its parent's), if it ended, if what a process takes
from its parent only when it is made changed (the ``PYTHON*`` and ``LD_*`` variables, the
umask, the CPUs allowed, the spawning thread's priority and scheduling policy, the open-files
limit, the signals ignored: :func:`process_state`), or
if it is older than :data:`TAKE_WITHIN_S`.  A spare that is
never taken is ended (and reaped) by this process at :data:`TAKE_WITHIN_S` (a ``Trainer``
built, never trained), when this process exits (end of file on its pipe), or at
:func:`discard`; if this process cannot (it is stopped, or busy holding the GIL), the spare
ends itself after :data:`SPARE_IDLE_S`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import site
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpulens.log import logger
from gpulens.settings import ENGINE_NICE, engine_nice
from gpulens.transport.base import SpawnFailed

if TYPE_CHECKING:
    from gpulens.settings import Settings

CHILD = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); import os, sys; "
         "nice = int(os.environ.get('GPULENS_ENGINE_NICE') or 0); nice > 0 and os.nice(nice); "
         "from gpulens.transport.child import main; sys.exit(main(sys.argv[1:]))")
"""The engine process's bootstrap: it ignores SIGINT and SIGTERM before anything else (a
Ctrl-C at the terminal, a launcher's stop, reach the whole process group; the training process
decides when to stop, and the engine ends when it goes, after writing what it holds), then
lowers its priority by ``GPULENS_ENGINE_NICE``, if above 0 (:func:`child_env` sets it:
:func:`gpulens.settings.engine_nice`) before its imports."""
SPARE_ARG = "spare"
"""The engine process's fourth argument when it is a spare (it waits for its start)."""
SPARE_IDLE_S = 600.0
"""A spare that no ``start()`` took in this long ends itself."""
TAKE_WITHIN_S = SPARE_IDLE_S - 60.0
"""A spare older than this is not taken (it could end itself while its start is on the way)."""
F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20
"""Each pipe's capacity (Linux; a few marks' worth more than the default 64 KiB)."""

ENGINE_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
"""Set in the engine process's environment unless the user set them: MLflow's own defaults
(7 retries, 120 s each) keep a write to a server that went away busy for minutes, so nobody
hears of it; gpulens retries the row itself, with its own back-off, and says so.  The training
process's environment is never changed."""


ENGINE_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Set in the engine process's environment whatever the user set (theirs are for training): the
engine does no linear algebra, but ``import wandb`` imports NumPy, whose OpenBLAS starts a
thread per CPU that spins before it sleeps (NumPy issue 29193: ``import numpy`` took 1.28 s of
CPU at 1742 % on a many-core machine, 0.05 s with ``OMP_NUM_THREADS=1``).  On an H200 host the
engine's W&B start took about 3.3 CPU-seconds more than without W&B, on up to all 16 CPUs at
once, and the training thread waited 6-9 ms a step for a CPU meanwhile
(``benchmarks/results/2026-11-29-h200-start-aftereffect``, ``c4``)."""


def _is_site_dir(path: str) -> bool:
    """Whether ``path`` is a site-packages directory (an installed gpulens lives there)."""
    dirs: list[str] = []
    with contextlib.suppress(Exception):
        dirs.extend(site.getsitepackages())
    with contextlib.suppress(Exception):
        dirs.append(site.getusersitepackages())
    real = os.path.realpath(path)
    if any(os.path.realpath(d) == real for d in dirs if d):
        return True
    return Path(path).name in ("site-packages", "dist-packages")


def child_env() -> dict[str, str]:
    """The engine process's environment: this one's, with :data:`ENGINE_ENV` and
    :data:`ENGINE_ONE_THREAD`, and for a gpulens that is not installed (a source checkout, a
    ``sys.path`` entry) the folder it was imported from first on ``PYTHONPATH``.  An installed
    gpulens is found as the parent found it; its site-packages is never put ahead of the
    standard library."""
    env = {**ENGINE_ENV, **os.environ, **ENGINE_ONE_THREAD}
    try:
        env["GPULENS_ENGINE_NICE"] = str(engine_nice())
    except ValueError:  # said by the start that would take this process
        env["GPULENS_ENGINE_NICE"] = str(ENGINE_NICE)
    root = str(Path(__file__).resolve().parent.parent.parent)
    if not _is_site_dir(root):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def process_state() -> tuple[object, ...]:
    """What a new process takes from this one only when it is made, which a spare cannot take
    on later: the variables read then (the interpreter's ``PYTHON*``, the dynamic loader's
    ``LD_*``; ``GPULENS_ENGINE_NICE``, applied at its start), the umask (the mode of the files
    it writes), the CPUs it may run on, its priority and scheduling policy (this thread's: on
    Linux a thread has its own nice value, which the process it starts takes), its open-files
    limit, and the signals ignored (they stay ignored across ``exec``).  A spare spawned
    under another state is not taken."""
    made_with = frozenset((k, v) for k, v in child_env().items()
                          if k.startswith(("PYTHON", "LD_")) or k == "GPULENS_ENGINE_NICE")
    mask: object = None
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                mask = int(line.split()[1], 8)
    cpus: object = None
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            cpus = frozenset(os.sched_getaffinity(0))
    priority: object = None
    with contextlib.suppress(Exception):
        priority = (os.getpriority(os.PRIO_PROCESS, 0),
                    os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None)
    files: object = None
    with contextlib.suppress(Exception):
        import resource

        files = resource.getrlimit(resource.RLIMIT_NOFILE)
    ignored = set()
    for sig in signal.valid_signals():
        with contextlib.suppress(Exception):
            if signal.getsignal(sig) is signal.SIG_IGN:
                ignored.add(int(sig))
    return made_with, mask, cpus, priority, files, frozenset(ignored)


@dataclass(eq=False)
class Spawned:
    """An engine process and this process's ends of its pipes (file descriptors)."""

    proc: subprocess.Popen[bytes]
    to_child: int
    from_child: int
    rows: int
    born: float
    """``time.monotonic()`` at its spawn."""
    owner: int
    """The id of the process that spawned it (the only one that may talk to it)."""
    state: tuple[object, ...]
    """:func:`process_state` at its spawn."""
    closed: bool = False
    """This process's ends are closed (never twice: the numbers may be another file's by
    then)."""
    retire: threading.Timer | None = None
    """A spare's: ends it at :data:`TAKE_WITHIN_S` unless it was taken (cancelled then)."""

    def close(self, wait_s: float = 1.0) -> None:
        """Close this process's ends (the engine process sees end of file and exits) and
        reap it, killing it after ``wait_s``."""
        self.abandon()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)

    def keep(self) -> None:
        """Cancel the spare's retirement (it was taken, or is being ended otherwise)."""
        timer, self.retire = self.retire, None
        if timer is not None:
            timer.cancel()

    def end_later(self) -> None:
        """:meth:`close`, off this thread: its ends closed now, the process reaped (killed
        if it does not end) by a thread of its own, so a start that refuses a spare does not
        wait for it."""
        self.abandon()
        threading.Thread(target=self.close, name="gpulens-spare-end", daemon=True).start()

    def abandon(self) -> None:
        """Close this process's ends only (a forked child's copies)."""
        self.keep()
        if self.closed:
            return
        self.closed = True
        for fd in (self.to_child, self.from_child, self.rows):
            with contextlib.suppress(OSError):
                os.close(fd)


def spawn(spare: bool = False) -> Spawned:
    """Start an engine process (:data:`CHILD`); :class:`SpawnFailed` when it cannot be.

    ``spare``: it imports what its start will need, then waits for its ``Start`` (at most
    :data:`SPARE_IDLE_S`)."""
    if not sys.executable:
        raise SpawnFailed("no Python executable to start (sys.executable is empty)")
    state = process_state()  # what the process is made under (read just before)
    ends: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(3):
            ends.extend(os.pipe())
        to_child_r, to_child_w, from_child_r, from_child_w, rows_r, rows_w = ends
        theirs = (to_child_r, from_child_w, rows_w)
        for fd in (to_child_w, from_child_w, rows_w):
            with contextlib.suppress(OSError):
                import fcntl

                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
        argv = [sys.executable, "-c", CHILD, *map(str, theirs)]
        if spare:
            argv += [SPARE_ARG, repr(SPARE_IDLE_S)]
        try:
            proc = subprocess.Popen(argv, pass_fds=theirs, stdin=subprocess.DEVNULL,
                                    env=child_env(), close_fds=True)
        except OSError as exc:
            raise SpawnFailed(f"could not start the engine process: {exc}") from exc
        for fd in theirs:  # the engine process's ends: its own copies are all it needs
            ends.remove(fd)
            os.close(fd)
        return Spawned(proc, to_child_w, from_child_r, rows_r, time.monotonic(), os.getpid(),
                       state)
    except BaseException:  # a Ctrl-C too: no process or descriptor is left without an owner
        for fd in ends:  # first: a second Ctrl-C in the wait below leaks no descriptor
            with contextlib.suppress(OSError):
                os.close(fd)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait()
        raise


_lock = threading.Lock()
_spare: Spawned | None = None


forked_away: list[object] = []
"""In a forked child: the parent's spare and engine processes' ``Popen`` objects, kept (never
collected here: a ``Popen`` collected while its process runs warns, and the process is the
parent's to end)."""


_STATE_PARTS = ("PYTHON*/LD_* variables", "umask", "CPUs allowed", "priority or scheduling",
                "open-files limit", "ignored signals")
"""What each part of :func:`process_state` is, to say which one changed."""


def _unfit(spawned: Spawned) -> str | None:
    """Why this process may not take the spare (``None``: it may)."""
    if spawned.owner != os.getpid():
        return "it belongs to the parent of this forked process"
    if spawned.proc.poll() is not None:
        return "it ended"
    if time.monotonic() - spawned.born >= TAKE_WITHIN_S:
        return f"it is older than {TAKE_WITHIN_S:.0f} s"
    now = process_state()
    if spawned.state != now:
        changed = [part for part, was, is_ in zip(_STATE_PARTS, spawned.state, now, strict=True)
                   if was != is_]
        return f"this process changed since it was made: {', '.join(changed)}"
    return None


def _good(spawned: Spawned) -> bool:
    return _unfit(spawned) is None


def prepare() -> bool:
    """Spawn a spare engine process for this process's next ``start()``, unless a good one
    is waiting.  Never raises: False when none could be spawned (``start()`` spawns its own)."""
    global _spare
    if os.name != "posix":
        return False
    with _lock:
        if _spare is not None and _good(_spare):
            return True
        old, _spare = _spare, None
    if old is not None and old.owner == os.getpid():
        old.end_later()
    try:
        made = spawn(spare=True)
    except Exception as exc:
        logger.debug("gpulens: no spare engine process: %s", exc)
        return False
    with _lock:
        if _spare is None:
            timer = threading.Timer(TAKE_WITHIN_S, _retire, (made,))
            timer.name, timer.daemon = "gpulens-spare-retire", True
            made.retire = timer
            timer.start()
            _spare = made
            return True
    made.end_later()  # another thread's came first
    return True


def _retire(spawned: Spawned) -> None:
    """A spare that no start took within :data:`TAKE_WITHIN_S`: ended and reaped here (on its
    timer's thread), so it leaves no zombie behind."""
    global _spare
    with _lock:
        if _spare is not spawned:
            return
        _spare = None
    spawned.retire = None  # this timer's own thread: nothing to cancel
    spawned.close()


def take() -> Spawned | None:
    """The spare, if one is waiting that this process may use (see the module's text); one
    that may not is ended."""
    global _spare
    with _lock:
        got, _spare = _spare, None
    if got is None:
        return None
    got.keep()
    why = _unfit(got)
    if why is None:
        return got
    logger.debug("gpulens: the engine process made ready earlier is not used (%s); starting a "
                 "new one", why)
    if got.owner == os.getpid():
        got.end_later()
    return None


def drop() -> None:
    """End the spare, if any, without waiting for it (a monitor that will not take it: its
    engine runs in a thread)."""
    global _spare
    with _lock:
        got, _spare = _spare, None
    if got is not None and got.owner == os.getpid():
        got.end_later()


def cwd() -> str | None:
    """This process's working folder (``None`` if it was removed)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def discard() -> None:
    """End the spare, if any, and wait for its end (at exit; tests between themselves)."""
    global _spare
    with _lock:
        got, _spare = _spare, None
    if got is not None and got.owner == os.getpid():
        got.close()


def _forget_after_fork() -> None:
    global _spare, _lock
    _lock = threading.Lock()  # the parent's may have been held at the fork
    got, _spare = _spare, None
    if got is not None:
        # its timer's thread is not in this process, and its lock may have been held at the
        # fork: the copy is dropped, never cancelled
        got.retire = None
        got.abandon()  # the parent's spare: close the copies of its pipe ends
        forked_away.append(got)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(discard)


def prepare_engine(settings: Settings | None) -> bool:
    """Spawn a spare engine process now (:func:`prepare`), for a monitor of ``settings`` that
    starts later, so that its start takes it instead of waiting for a new interpreter and its
    imports; nothing for a monitor whose engine will run in a thread (the monitor's own
    choice: :func:`gpulens.settings.isolation_for`). Never raises (a wrong
    ``GPULENS_ISOLATION`` or backend is said at the start, as without this); ``None`` (a
    monitor that is not gpulens's): nothing. True when a spare waits. For a monitor whose
    engine runs in a thread, a spare made earlier is ended (nothing would take it)."""
    from gpulens.settings import Settings, backend_for, isolation_for

    if not isinstance(settings, Settings):
        return False
    try:
        if isolation_for(settings, backend_for(settings))[0] != "process":
            drop()  # one made earlier would idle until its retirement
            return False
    except ValueError:
        return False
    return prepare()
