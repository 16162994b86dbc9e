"""Run a command as a child subreaper and write its wall time and the CPU time of its whole
process tree: ``python reap.py OUT_FILE COMMAND...``.

Every descendant, orphans included (a torchrun job killed at its timeout, an MLflow server
killed with its process group), is re-parented to this process and waited for here, so
``RUSAGE_CHILDREN`` counts them all; ``/usr/bin/time`` alone misses the CPU of processes whose
parent was killed before it waited for them.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    child = subprocess.Popen(sys.argv[2:])
    code = None
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(sys.argv[1], "w") as f:
        f.write(f"{wall:.2f} s wall {usage.ru_utime:.2f} s user {usage.ru_stime:.2f} s sys "
                f"(whole tree) rc {code}\n")
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
