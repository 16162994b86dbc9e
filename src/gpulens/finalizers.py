"""Exit finalizers of monitors and integrations: a ``weakref.finalize`` whose ``atexit`` hook
is registered when it is made (:func:`exit_finalizer`), so that it runs before the hooks of
trackers whose runs began earlier."""

from __future__ import annotations

import atexit
import builtins
import sys
import weakref
from typing import Any

from gpulens.model import Outcome, outcome_of


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


def unfinished_outcome() -> Outcome:
    """The outcome of training found still running when its owner was dropped or the process
    exits (a framework's end hook would have stopped it): ``"killed"`` where the script ends
    on a ``KeyboardInterrupt``, else ``"failed"``."""
    return "killed" if exit_outcome() == "killed" else "failed"


def exit_outcome() -> Outcome:
    """How training ended, seen from an exit hook or a finalizer: ``"failed"`` (``"killed"``
    for a ``KeyboardInterrupt``) where the script is ending on an exception nobody caught
    (Python sets ``sys.last_value`` before it runs the exit hooks), else ``"finished"``.  In
    an interactive session (``python -i``, IPython, Jupyter) ``sys.last_value`` is any earlier
    error shown, so there it is always ``"finished"``."""
    if sys.flags.interactive or hasattr(sys, "ps1") or hasattr(builtins, "__IPYTHON__"):
        return "finished"
    exc = getattr(sys, "last_value", None)
    return outcome_of(exc) if isinstance(exc, BaseException) else "finished"
