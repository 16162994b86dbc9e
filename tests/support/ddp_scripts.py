"""``torchrun --nproc_per_node 2 tests/support/ddp_scripts.py SCRIPTS_JSON``: several DDP scripts
in one launch, one after another in the same ranks, each run as ``python SCRIPT ARGS`` runs it
(:func:`runpy.run_path` as ``__main__``, with its own ``sys.argv``).

Why: a launch of 2 ranks costs seconds of CPU before any script runs (torchrun's agent and
each rank import torch; a rank that runs Lightning imports it for ~4 s).  Here the ranks pay
that once for every script; each script still makes its process group from torchrun's
environment (``init_process_group`` reads ``env://``), trains, and destroys it, as it does when
torchrun launches it alone.

A process group made again on the store of the one before reads the keys that one left (c10d
names the default group ``"0"`` again once it is destroyed) and connects to sockets that are
gone; so each script after the first meets at a store of its own.  Rank 0 hosts it (a
``TCPStore`` on a free port, as torchrun's agent hosts the first), tells the other ranks its
port through the agent's store, and every rank points ``MASTER_PORT`` at it: every rank is a
client of a store hosted outside the script, as under torchrun's agent.

``SCRIPTS_JSON``: a JSON list of ``[script, arg, ...]``.  Each rank writes
``gpulens-test ddp-scripts: <i> done`` on stderr after script ``i`` (from 0); an exception in a
script ends the rank (and torchrun ends the job).
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
from datetime import timedelta
from typing import Any

STORE_TIMEOUT = timedelta(seconds=120)


def fresh_store(index: int, kept: list[Any]) -> None:
    """Point this rank's ``MASTER_PORT`` at a new store for script ``index`` (module doc)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported

    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["AGENT_PORT"]),
                     is_master=False, timeout=STORE_TIMEOUT)
    key = f"gpulens-test/ddp-scripts/{index}/port"
    if int(os.environ["RANK"]) == 0:
        own = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=STORE_TIMEOUT)
        kept.append(own)  # serves until the job ends
        agent.set(key, str(own.port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()


def main(scripts: list[list[str]]) -> None:
    # SIGUSR1 writes every thread's stack to stderr (the tests send it to a job that hangs,
    # before they kill it); a DataLoader worker forked from this process inherits it
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("AGENT_PORT", os.environ["MASTER_PORT"])
    kept: list[Any] = []
    for index, argv in enumerate(scripts):
        if index:
            fresh_store(index, kept)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        print(f"gpulens-test ddp-scripts: {index} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
