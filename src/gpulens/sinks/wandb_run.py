"""The W&B run the sink writes to: wandb imported, the login checked, and the run handed from
the training process to the engine process.

W&B's own way to log into one run from several processes of a machine: a ``wandb.Run``
pickles to its attach id, and the copy unpickled in another process connects to the same
``wandb-core`` service (the ``WANDB_SERVICE`` address) and attaches to the run at its first
call.  Its ``log`` calls then join that run's records like those of the process that made it
(wandb 0.31; offline runs too, since the service is local).  The W&B sink uses this to write
from gpulens's engine process, so that none of W&B's per-row work (the encoding, the socket,
the round trips) runs in the training process beside the training thread.

:class:`RunHandle` is what crosses: made in the training process when the monitor starts (the
run pickled there, a few microseconds, and the service address, which an engine process
spawned before ``wandb.init`` would not have), resolved in the engine when the sink opens.
Where the engine is a thread of the training process (``isolation="thread"``), the handle
never pickles and gives the run object itself.

:func:`ask_step` bounds the one wait the sink makes: W&B's ``run.step`` waits 30 s for an
answer, and an attached process gets none once the user's process has finished the run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import pickle
import sys
import weakref
from typing import Any

from gpulens.log import logger, one_line, warn_once
from gpulens.model import Event, RunContext, outcome_of
from gpulens.sinks.layout import run_metadata

SERVICE_ENV = "WANDB_SERVICE"
"""The environment variable through which a wandb process finds the running service."""

ANSWER_TIMEOUT_S = 5.0
"""How long the sink waits for ``wandb-core``'s answer (W&B's step) before it takes the run
as finished (or its service as gone): rows are then no longer written to W&B (counted)."""


DETAIL_INTERVAL_S = 1.0
"""Default for :class:`WandbSink`'s ``detail_interval``: seconds (of the rows' own times)
between two rows that carry the hidden detail (see the module doc)."""
DETAIL_ENV = "GPULENS_WANDB_DETAIL_S"
"""Environment variable giving ``detail_interval`` to W&B sinks made without it."""


def resolve_detail_interval(seconds: float | None) -> float:
    """``seconds`` checked (a number >= 0, else a one-line ``ValueError``), or
    :data:`DETAIL_ENV`'s value, or :data:`DETAIL_INTERVAL_S`."""
    where = "detail_interval"
    value: Any = seconds
    if value is None:
        value = os.environ.get(DETAIL_ENV, "").strip() or DETAIL_INTERVAL_S
        where = DETAIL_ENV
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not number >= 0 or math.isinf(number):
        raise ValueError(f"{where}={value!r}: expected seconds >= 0 between the W&B rows that "
                         "carry the per-GPU detail (0: every row)")
    return number


_DEFINED: weakref.WeakKeyDictionary[Any, dict[str, tuple[bool, str]]] = (
    weakref.WeakKeyDictionary())
"""Per W&B run object: the keys defined on it so far, each with (hidden, step metric)."""


def definitions(run: Any) -> dict[str, tuple[bool, str]]:
    """The keys defined on ``run`` so far (shared by every sink writing to it), or a fresh
    dict for a run object that cannot be weakly referenced."""
    try:
        return _DEFINED.setdefault(run, {})
    except TypeError:
        return {}


class RunGone(RuntimeError):
    """``wandb-core`` no longer answers for the run (finished in the training process, or its
    service stopped)."""


class RunHandle:
    """A W&B run that pickles to what another process needs to attach to it.

    Args:
        run: the ``wandb.Run`` (or W&B's no-op run of ``mode="disabled"``), in the process that
            made or attached it.
    """

    __slots__ = ("_blob", "_run", "config_entry", "disabled", "service")

    def __init__(self, run: Any) -> None:
        try:
            blob = pickle.dumps(run)
        except Exception as exc:
            raise ValueError(f"the wandb sink cannot hand the W&B run {run!r} to gpulens's "
                             f"engine process ({type(exc).__name__}: {exc}); pass "
                             "WandbSink(run=...) to write it from this process") from None
        self._run: Any = run
        self._blob: bytes = blob
        self.service: str | None = os.environ.get(SERVICE_ENV)
        """The service address of the process that made the handle (if W&B set one)."""
        self.disabled: bool = getattr(run, "disabled", False) is True
        """W&B is off (``mode="disabled"``: a no-op run): the sink writes nothing."""
        self.config_entry: Any = None
        """The run config's ``"gpulens"`` entry as the training process has it (an attached
        run's config starts empty: the sink must not take a user's entry for none)."""
        with contextlib.suppress(Exception):  # a run without a config: nothing seen
            self.config_entry = run.config.get("gpulens")

    def __getstate__(self) -> dict[str, Any]:
        return {"blob": self._blob, "service": self.service, "config": self.config_entry,
                "disabled": self.disabled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._run = None
        self._blob = state["blob"]
        self.service = state["service"]
        self.config_entry = state["config"]
        self.disabled = state["disabled"]

    @property
    def here(self) -> Any:
        """The run, in the process that made the handle; ``None`` where it crossed."""
        return self._run if not self.disabled else None

    def __repr__(self) -> str:
        return "RunHandle(here)" if self._run is not None else "RunHandle(to attach)"

    def resolve(self) -> tuple[Any, bool]:
        """The run in this process, and whether it is attached from another process (then it
        is not this process's to finish, and its ``_local_step`` is not the run's).  Imports
        wandb where the handle crossed; the attach itself happens at the run's first call."""
        if self._run is not None:
            return self._run, False
        if self.service and SERVICE_ENV not in os.environ:
            os.environ[SERVICE_ENV] = self.service  # read when wandb connects, below
        import wandb  # noqa: F401  (the class the run unpickles to)

        self._run = pickle.loads(self._blob)  # gpulens's own bytes, from the training process
        return self._run, True


def ask_step(run: Any, timeout: float = ANSWER_TIMEOUT_S) -> int:
    """W&B's step ``S`` as ``wandb-core`` has it (after every ``log`` this process made: the
    request travels behind them), waiting at most ``timeout`` seconds; :class:`RunGone` when
    no answer comes.  Uses the request behind ``run.step`` (which waits 30 s), or ``run.step``
    itself where this wandb has no such request."""
    interface = getattr(run, "_interface", None)
    deliver = getattr(interface, "deliver_history_step", None)
    if deliver is None:
        return int(run.step)
    try:
        answer = deliver().wait_or(timeout=timeout)
    except TimeoutError:
        raise RunGone(f"W&B did not answer within {timeout:.0f} s: the run was finished "
                      "(wandb.finish) or W&B's service stopped before gpulens stopped") from None
    return int(answer.step)


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("the 'wandb' sink needs wandb: pip install 'gpulens[wandb]'") from exc
    return wandb


def check_wandb_login() -> None:
    """``ValueError`` (one line) when ``wandb.init`` would fail for want of a login: W&B is
    online and no API key is configured (environment, ``~/.netrc``, W&B's settings).

    Nothing is created.  When W&B's way of finding credentials cannot be asked (another wandb
    version), nothing is said and ``wandb.init`` decides.
    """
    wandb = import_wandb()
    if wandb.run is not None:
        return
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate

        settings = wandb_setup.singleton().settings
        if settings.mode in ("offline", "dryrun", "disabled"):
            return  # no login needed
        auth = authenticate.authenticate_session(host=settings.base_url, source="gpulens",
                                                 prompt=False, update_session=False)
    except ImportError:
        return
    except Exception as exc:  # a malformed key file, ...: W&B's own message, on one line
        raise ValueError(f"the wandb sink cannot log in to W&B: {one_line(exc)}") from None
    if auth is None:
        raise ValueError(
            "the wandb sink needs a W&B login, and none is configured: run `wandb login` (or "
            "set WANDB_API_KEY), or log offline with WANDB_MODE=offline")


def check_wandb_ready() -> None:
    """The start-time check, cheap: ``ValueError`` (one line) when wandb is not installed, or,
    where wandb is imported already (a user's ``wandb.init`` ...), when it needs a login it has
    not got (:func:`check_wandb_login`).  Importing wandb takes about a second, so where it is
    not imported the login is checked when the sink opens (off the training thread; a failure
    is then a WARNING, and the sink's rows are counted as dropped)."""
    if importlib.util.find_spec("wandb") is None:
        raise ValueError("the 'wandb' sink needs wandb: pip install 'gpulens[wandb]'")
    if "wandb" in sys.modules:
        check_wandb_login()


SIMULATED_TAG = "simulated-gpus"
"""The W&B run tag of a run whose GPUs were simulated."""

CONFIG_FROM_RUN: Any = object()
"""For :func:`write_run_metadata`: read the config's ``"gpulens"`` entry from the run."""


def write_run_metadata(run: Any, context: RunContext, *, seen: Any = CONFIG_FROM_RUN) -> None:
    """The run's metadata (:func:`~gpulens.sinks.layout.run_metadata`) into its config under
    ``"gpulens"`` (``"gpulens_run"`` when the user's config has a ``"gpulens"`` entry of its
    own: ``seen``, the entry as the training process saw it, for an attached run whose config
    starts empty; else read from the run) and, for simulated GPUs, the run tag
    :data:`SIMULATED_TAG`.  Never a reason not to log rows: a failure is a warning, once."""
    meta = run_metadata(context)
    try:
        config = run.config
        key = "gpulens"
        existing = seen
        if seen is CONFIG_FROM_RUN:
            existing = config.get(key) if hasattr(config, "get") else None
        if existing is not None and not (isinstance(existing, dict) and
                                         existing.get("version") is not None and
                                         "backend" in existing):
            key = "gpulens_run"  # the user's own "gpulens" entry stays as it is
            logger.info("gpulens: the W&B config has a 'gpulens' entry of its own; the run's "
                        "metadata goes under 'gpulens_run'")
        # our own entry may change when a run is resumed (another host, other GPUs)
        config.update({key: meta}, allow_val_change=True)
    except Exception as exc:
        warn_once("wandb-config", "gpulens: could not write the run's metadata (GPUs, "
                  "backend, ...) into the W&B config: %s", one_line(exc))
    if context.backend == "simulated":
        try:
            tags = tuple(run.tags or ())
            if SIMULATED_TAG not in tags:
                run.tags = (*tags, SIMULATED_TAG)
        except Exception as exc:
            warn_once("wandb-tags", "gpulens: could not tag the W&B run %r: %s",
                      SIMULATED_TAG, one_line(exc))


ALERT_LEVELS = {"info": "INFO", "warning": "WARN", "critical": "ERROR"}
"""W&B alert level of each :class:`~gpulens.model.Event` severity."""


def send_alert(run: Any, event: Event) -> bool:
    """``run.alert`` for an alert that fires (W&B sends it where the user set alerts up); a
    failure is a warning, once, never an exception into training. True when it was sent.
    Also used for Lightning's ``WandbLogger`` (its run)."""
    text = f"Step {event.step}: {event.message}".strip()
    if event.advice:
        text += f" Try: {event.advice}"
    try:
        run.alert(title=f"gpulens: {event.name}"[:63], text=text,
                  level=ALERT_LEVELS.get(event.severity, "WARN"))
        return True
    except Exception as exc:
        warn_once("wandb-alert", "gpulens: could not send the W&B alert for %s: %s (the "
                  "alerts/%s key and the other sinks still have it)", event.name,
                  one_line(exc), event.name)
        return False


def wandb_starts_own_run(sinks: Any) -> bool:
    """At start, in the training process: whether a prepared ``"wandb"`` spec among ``sinks``
    (``(name, sink)`` pairs) has no run to attach to, so that the engine starts a run of its
    own (said at INFO: a ``wandb.init()`` after ``Monitor.start()`` makes a second run)."""
    alone = any(getattr(sink, "kind", None) == "wandb" and sink.options.get("run") is None
                for _, sink in sinks)
    if alone:
        logger.info("gpulens: no W&B run is active at start(): the wandb sink starts a run of "
                    "its own for the GPU rows (call wandb.init() before Monitor.start() to "
                    "get them into your run)")
    return alone


def tell_wandb_run_missed() -> None:
    """At stop, where the engine wrote a run of its own: a WARNING if this process has a W&B
    run now (a ``wandb.init()`` after ``Monitor.start()``), whose charts have no GPU rows."""
    run = getattr(sys.modules.get("wandb"), "run", None)
    if run is not None and getattr(run, "disabled", False) is not True:
        logger.warning("gpulens: the GPU rows went to a W&B run of gpulens's own, not to your "
                       "run %s: it began after Monitor.start() (start the monitor after "
                       "wandb.init(), or pass the run: sink_spec('wandb', run=run))",
                       getattr(run, "id", "?"))


def _no_hook() -> None:
    """Nothing to undo (:func:`stop_before_finish` hooked no run)."""


def _runs_written(sinks: Any) -> list[Any]:
    """The W&B runs of this process that ``sinks`` (``(name, sink)`` pairs, prepared) write
    to: a ``"wandb"`` spec's handle made here, a :class:`WandbSink`'s own run, else the active
    ``wandb.run`` for a sink that takes it at open.  Imports nothing (a start without W&B
    pays no import): a :class:`WandbSink` exists only where its module was imported."""
    module = sys.modules.get("gpulens.sinks.wandb")
    runs: list[Any] = []
    for _, sink in sinks:
        if getattr(sink, "kind", None) == "wandb":
            handle = sink.options.get("run")
            run = handle.here if isinstance(handle, RunHandle) else None
        elif module is not None and isinstance(sink, module.WandbSink):
            run = sink._run
            if run is None:
                run = getattr(sys.modules.get("wandb"), "run", None)
        else:
            continue
        if run is not None and all(run is not seen for seen in runs):
            runs.append(run)
    return runs


def stop_before_finish(sinks: Any, monitor: Any) -> Any:
    """At start, in the training process: an early teardown hook on each W&B run that
    ``sinks`` write to, so that a ``wandb.finish()`` made while an exception propagates (a
    crash, then the user's ``try/finally: wandb.finish()`` or ``with wandb.init():``) first
    stops ``monitor`` (held weakly), while W&B's service still takes rows: the rows it holds
    reach the run, those of a sink that had not attached yet too.  Without an exception in
    flight the hook does nothing (training may go on; rows after the finish are dropped, with
    a WARNING).  W&B runs the hook before it marks the run finished (``Run._finish``, wandb
    0.31; a wandb without ``_teardown_hooks`` gets none).  Returns the undo, for ``stop()``."""
    runs = _runs_written(sinks)
    if not runs:  # (a run here means wandb is imported: nothing is imported for this)
        return _no_hook
    try:
        from wandb.sdk.wandb_run import TeardownHook, TeardownStage
    except ImportError:
        return _no_hook
    ref = weakref.ref(monitor)
    inside = [False]

    def before_finish() -> None:
        mon, raised = ref(), sys.exc_info()[1]
        if mon is None or raised is None or not getattr(mon, "_started", False):
            return
        inside[0] = True
        try:  # never an exception into W&B's finish
            logger.info("gpulens: the W&B run is finished while %s propagates: the monitor "
                        "stops first, so that its GPU rows reach the run",
                        type(raised).__name__)
            mon.stop(collective=False, outcome=outcome_of(raised))
        except Exception as exc:
            logger.warning("gpulens: stopping the monitor before W&B's finish failed: %s",
                           one_line(exc))
        finally:
            inside[0] = False

    hooked: list[tuple[list[Any], Any]] = []
    for run in runs:
        hooks = getattr(run, "_teardown_hooks", None)
        if isinstance(hooks, list):
            hook = TeardownHook(before_finish, TeardownStage.EARLY)
            hooks.append(hook)
            hooked.append((hooks, hook))
    if not hooked:
        return _no_hook

    def undo() -> None:
        if inside[0]:
            return  # W&B iterates its hooks now (and drops them all after)
        for hooks, hook in hooked:
            with contextlib.suppress(ValueError):
                hooks.remove(hook)

    return undo
