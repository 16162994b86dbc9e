"""Exit finalizers of monitors and integrations: a ``weakref.finalize`` whose ``atexit`` hook
is registered when it is made (:func:`exit_finalizer`), so that it runs before the hooks of
trackers whose runs began earlier."""

from __future__ import annotations

import atexit
import weakref
from typing import Any


def exit_finalizer(owner: object, func: Any, *args: Any) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(owner, func, *args)`` whose exit hook is registered with ``atexit``
    now, not when the process made its first finalizer (importing torch does): ``atexit``
    runs the newest hook first, so one made after a tracker's run began (``wandb.init``
    registers W&B's own hook) runs while that tracker's service still lives. Undo with
    :func:`drop_exit_finalizer`."""
    finalizer = weakref.finalize(owner, func, *args)
    finalizer.atexit = False
    atexit.register(finalizer)
    return finalizer


def drop_exit_finalizer(finalizer: weakref.finalize[Any, Any]) -> bool:
    """Detach ``finalizer`` and take its exit hook back; True if it had not run."""
    atexit.unregister(finalizer)
    return finalizer.detach() is not None
