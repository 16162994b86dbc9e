"""A pytest plugin (``-p freezer``, this folder on ``PYTHONPATH``) that freezes the test process
and its children (the engine process) once, for ``FREEZE_S`` seconds (SIGSTOP from a helper
process, SIGCONT after), at one chosen point of a test: what a machine that starves the test of
CPU for seconds does to it, at a point chosen instead of by chance.

``FREEZE_AT``:

* ``fetch:N``, ``forward:N``, ``step_end:N``, ``pre_opt:N`` (tests of
  ``tests/test_integration_transformers.py``): at the N-th fetch of a sample (``Points``), the
  N-th forward pass (``Regression``), the N-th ``on_step_end`` (the data wait, outside a fetch)
  or ``on_pre_optimizer_step`` (the optimizer phase) of the run whose dataset
  ``FREEZE_DATASET`` names: ``slow`` (a delay per sample) or ``fast`` (none);
* ``sleep:N`` (tests of ``tests/test_integration_verl.py``): right after the test's N-th
  ``time.sleep`` (in ``test_two_calls_at_one_step_do_not_stall``: just before step N's calls).
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
import types
from typing import Any

import psutil

_counts: dict[str, int] = {}
_fast = {"now": False}


def freeze() -> None:
    seconds = float(os.environ.get("FREEZE_S", "3"))
    pids = " ".join(str(p) for p in [os.getpid(), *(c.pid for c in
                                                    psutil.Process().children(recursive=True))])
    helper = subprocess.Popen(["sh", "-c", f"kill -STOP {pids}; sleep {seconds}; "
                               f"kill -CONT {pids}"])
    time.sleep(0.5)  # the signal lands meanwhile
    helper.wait()


def _hit(where: str, fast: bool = False) -> None:
    kind, _, n = os.environ.get("FREEZE_AT", "").partition(":")
    if kind != where or (where != "sleep" and os.environ.get("FREEZE_DATASET", "slow") !=
                         ("fast" if fast else "slow")):
        return
    _counts[where] = _counts.get(where, 0) + 1
    if _counts[where] == int(n):
        freeze()


def _patch_hf(mod: Any) -> None:
    import transformers

    get, fwd, make = mod.Points.__getitem__, mod.Regression.forward, mod.make_trainer

    def getitem(self: Any, i: int) -> Any:
        _fast["now"] = not self.delay_s
        _hit("fetch", not self.delay_s)
        return get(self, i)

    @functools.wraps(fwd)  # the Trainer reads forward's signature
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _hit("forward", _fast["now"])
        return fwd(self, *args, **kwargs)

    class Freeze(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            _hit("step_end", _fast["now"])

        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            _hit("pre_opt", _fast["now"])

    def make_trainer(*args: Any, **kwargs: Any) -> Any:
        trainer = make(*args, **kwargs)
        trainer.add_callback(Freeze())  # after gpulens's callback
        return trainer

    mod.Points.__getitem__, mod.Regression.forward = getitem, forward
    mod.make_trainer = make_trainer


def _patch_verl(mod: Any) -> None:
    def sleep(seconds: float) -> None:
        time.sleep(seconds)
        _hit("sleep")

    mod.time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time)
                                        if not k.startswith("_")})
    mod.time.sleep = sleep


def pytest_runtest_setup(item: Any) -> None:
    mod = item.module
    if hasattr(mod, "Points") and hasattr(mod, "Regression"):
        _patch_hf(mod)
    elif hasattr(mod, "MergingLogger"):
        _patch_verl(mod)
