"""The torchrun harness (``tests/support/torchrun.py``) leaves no process behind: a hung job is
killed whole (every rank leads a session of its own, with its children), and processes that
outlive torchrun are reported and killed.

The ranks here import nothing heavy (no torch): only torchrun itself does.  The hung job is
taken as hung once both ranks wrote their pids (they then sleep for ten minutes), through the
harness's ``hung`` predicate, which ends the wait as the timeout would; its timeout only
bounds a hang of the harness itself."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from tests.support.torchrun import is_running, run_torchrun

# Each rank writes its pid and the pid of a child it started, then hangs (the child too).
HANG = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"pids-{os.environ['RANK']}.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(f"pids-{os.environ['RANK']}.tmp", f"pids-{os.environ['RANK']}")
    time.sleep(600)
""")

# Rank 0 starts a process in a session of its own and exits at once: a leftover.
LEAVE = textwrap.dedent("""
    import os, subprocess, sys
    if os.environ["RANK"] == "0":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        with open("leftover", "w") as f:
            f.write(str(child.pid))
""")

TIMEOUT_S = 240.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}


def test_a_hung_job_is_killed_whole(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(HANG)
    seen: list[int] = []
    pid_files = [tmp_path / f"pids-{rank}" for rank in (0, 1)]
    done = run_torchrun([str(tmp_path / "hang.py")], cwd=tmp_path, env=_env(),
                        timeout=TIMEOUT_S, hung=lambda: all(f.exists() for f in pid_files),
                        on_timeout=lambda procs: seen.extend(p.pid for p in procs))
    assert done.timed_out and done.returncode is None and not done.ok
    assert done.seconds < TIMEOUT_S  # ended as hung, not at the timeout that bounds a hang
    pids = [int(p) for f in pid_files for p in f.read_text().split()]
    assert set(pids) <= set(seen)  # the ranks and their children carried the job's tag
    assert not [pid for pid in pids if is_running(pid)]


def test_processes_left_after_torchrun_are_reported_and_killed(tmp_path: Path) -> None:
    (tmp_path / "leave.py").write_text(LEAVE)
    # the leftover sleeps for ten minutes: no grace would see it end by itself
    done = run_torchrun([str(tmp_path / "leave.py")], cwd=tmp_path, env=_env(), nproc=1,
                        timeout=TIMEOUT_S, leftover_grace_s=0.0)
    assert done.returncode == 0 and not done.timed_out
    pid = int((tmp_path / "leftover").read_text())
    assert [p.pid for p in done.leftovers] == [pid]
    assert sys.executable in done.leftovers[0].cmdline
    assert not is_running(pid)
