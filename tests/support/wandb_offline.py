"""Offline, quiet W&B for tests.

wandb reads its environment (``WANDB_DIR``, ``WANDB_MODE``, ...) once, when its process-wide
setup singleton is made, and then keeps those settings for every later ``wandb.init`` in the
process. A test that points ``WANDB_DIR`` somewhere new must therefore ``reset_wandb()`` first
(finish any open run, tear the singleton and its wandb-core service down); the next
``wandb.init`` then reads the environment again.
"""

from __future__ import annotations

import sys
from typing import Any

#: Environment for offline runs that make no network call and print nothing.
OFFLINE_ENV: dict[str, str] = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",  # no stdout/stderr capture
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB__DISABLE_STATS": "true",  # setting x_disable_stats: wandb's own system monitor
    "WANDB__DISABLE_MACHINE_INFO": "true",  # setting x_disable_machine_info
}


def reset_wandb() -> None:
    """Finish any active run and drop wandb's settings singleton, if wandb was imported."""
    wandb: Any = sys.modules.get("wandb")
    if wandb is None:
        return
    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()
