"""W&B: rows into a wandb run, on ``train/global_step``.

``train/global_step`` is declared with ``define_metric`` as the x-axis of every gpulens key
(``gpu/*``, ``host/*``, ``perf/*``, ``train/*``) and is in every row, so GPU charts sit on the
same axis as the loss.  ``step=`` is never passed, so W&B's own step is never pushed ahead of
the training's.  ``wandb.log`` is not thread-safe: this sink is written from the training
thread (``on_training_thread``), inside ``Monitor.log()``/``stop()``.
"""

from __future__ import annotations

from typing import Any

from gpulens.schema import STEP_KEY
from gpulens.sinks.base import Row, RunContext

_PREFIXES = ("gpu/*", "host/*", "perf/*", "train/*")


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("the 'wandb' sink needs wandb: pip install 'gpulens[wandb]'") from exc
    return wandb


class WandbSink:
    """Logs rows to ``run`` (default: the active ``wandb.run``, else ``wandb.init()`` from W&B's
    own environment settings, finished again at close).

    Args:
        run: a wandb run to log to.
        include_train: also write the ``train/*`` scalars.  Integrations whose framework logs
            loss to W&B itself turn this off, so each point is logged once.
    """

    on_training_thread = True

    def __init__(self, run: Any | None = None, *, include_train: bool = True) -> None:
        self._run = run
        self._owned = False
        self.include_train = include_train

    @classmethod
    def from_spec(cls, arg: str | None) -> WandbSink:
        if arg:
            raise ValueError(f"the wandb sink takes no argument, got 'wandb:{arg}'")
        return cls()

    def open(self, context: RunContext) -> None:
        wandb = import_wandb()
        if self._run is None:
            self._run = wandb.run
        if self._run is None:
            self._run = wandb.init()
            self._owned = True
        self._run.define_metric(STEP_KEY, hidden=False)
        for prefix in _PREFIXES:
            self._run.define_metric(prefix, step_metric=STEP_KEY)

    def write(self, row: Row) -> None:
        data: dict[str, float] = {}
        for key, value in row.values.items():
            if not self.include_train and key.startswith("train/") and key != STEP_KEY:
                continue
            data[key] = value
        data[STEP_KEY] = float(row.step)
        assert self._run is not None, "WandbSink.write before open"
        self._run.log(data)

    def close(self) -> None:
        if self._owned and self._run is not None:
            self._run.finish()
        self._run = None
