"""Turn GPU monitoring on from a Hydra / OmegaConf config: ``gpulens.from_config(cfg)``.

Two ways to switch it on, both from the command line of an existing Hydra app:

* verl's convention, keys added to the ``trainer`` node of a struct config that lacks them::

      python train.py +trainer.enable_gpu_monitoring=true +trainer.gpu_monitor_interval=0.2 \\
          '+trainer.gpu_monitor_sinks=[jsonl:runs/gpu.jsonl]'

  (verl's ``Tracking`` gives the rows to its own W&B and MLflow backends through
  :class:`gpulens.integrations.verl.MergingLogger`; a ``wandb`` sink beside its ``wandb``
  backend is refused. A plain Hydra app names its trackers here: ``[wandb,jsonl:...]``.)

* a config group, registered in Hydra's ConfigStore by the ``hydra_plugins.gpulens`` module
  (Hydra imports it when it looks for plugins)::

      python train.py +gpu_monitor=default gpu_monitor.interval=0.2

Keys read (all optional):

==================================  =========================================================
``trainer.enable_gpu_monitoring``   bool, default false (true when ``gpu_monitor`` is chosen)
``trainer.gpu_monitor_interval``    seconds between cheap GPU samples, > 0 (default 0.5)
``trainer.gpu_monitor_sinks``       list of sink names, or one comma-separated string
``trainer.gpu_monitor_gpm``         bool, default true: read GPM (SM, tensor-core, DRAM activity)
``gpu_monitor.enabled|interval|sinks|gpm|gpus|backend``  the same, from the config group
==================================  =========================================================

``trainer.*`` keys win over the ``gpu_monitor`` group. A bad value raises ``ValueError`` naming
the key, and so does a misspelt key, which would otherwise be ignored
(``trainer.gpu_monitor_intervl``, ``trainer.enable_gpu_monitor``, a ``gpu_monitor.*`` key the
group lacks); sink names are parsed by the same parser as everywhere
(:func:`gpulens.sinks.parse_sink`) into the monitor's :class:`~gpulens.settings.Settings`
(:func:`settings_from_config`). The app starts the returned monitor itself (``with monitor:
...``) and calls ``monitor.log(step, loss=...)`` where it logs.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from gpulens.settings import Settings
from gpulens.sinks import SinkSpec, as_sink, parse_sink
from gpulens.sinks.base import Sink

if TYPE_CHECKING:
    from gpulens.monitor import Monitor

__all__ = ["GpuMonitorConfig", "from_config", "register_configs", "settings_from_config"]

ENABLE_KEY = "trainer.enable_gpu_monitoring"
INTERVAL_KEY = "trainer.gpu_monitor_interval"
SINKS_KEY = "trainer.gpu_monitor_sinks"
GPM_KEY = "trainer.gpu_monitor_gpm"
GROUP = "gpu_monitor"
DEFAULT_INTERVAL = 0.5

_MISSING = object()


@dataclass
class GpuMonitorConfig:
    """The ``gpu_monitor`` config group (``+gpu_monitor=default``)."""

    enabled: bool = True
    interval: float = DEFAULT_INTERVAL
    """Seconds between cheap GPU samples."""
    sinks: list[str] = field(default_factory=list)
    """Sink names: ``wandb``, ``mlflow``, ``jsonl:PATH``, ``prometheus:PORT``."""
    gpm: bool = True
    """Read GPM (SM, tensor-core and DRAM activity); false leaves those keys out."""
    gpus: list[int] | None = None
    """CUDA device numbers to watch; null: those this process uses."""
    backend: str | None = None
    """``nvml``, ``simulated`` or null (automatic, honours ``GPULENS_BACKEND``)."""


def register_configs() -> None:
    """Store :class:`GpuMonitorConfig` as ``gpu_monitor/default`` in Hydra's ConfigStore."""
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError as exc:
        raise ImportError("gpulens' Hydra config group needs hydra-core: "
                          "pip install 'gpulens[hydra]'") from exc
    ConfigStore.instance().store(group=GROUP, name="default", node=GpuMonitorConfig)


def from_config(cfg: Any, *, sinks: Sequence[str | SinkSpec | Sink] = (),
                default_sinks: Sequence[str | SinkSpec | Sink] = ()) -> Monitor | None:
    """A :class:`gpulens.Monitor` (not started) when the config turns GPU monitoring on, else
    ``None``. ``cfg`` is an OmegaConf ``DictConfig`` (struct or not) or a plain mapping. Its
    engine process is made ready now (``gpulens.setup()``), for a start after the app's set-up
    (an app that never starts it ends that process at exit, and waits for its end).

    Args:
        sinks: sinks the app adds to those of the config (e.g. a
            :class:`gpulens.integrations.verl.RowHandoff` that hands rows to its own logger).
        default_sinks: sinks used when the config names none (e.g. a JSONL file in the run's
            output folder).

    Raises:
        ValueError: a key holds a value of the wrong kind (the message names the key).
    """
    settings = settings_from_config(cfg, sinks=sinks, default_sinks=default_sinks)
    if settings is None:
        return None
    from gpulens.monitor import Monitor
    from gpulens.transport.spawn import prepare_engine

    monitor = Monitor.from_settings(settings)
    # the app starts it later, once its model is built: its engine process gets ready meanwhile
    prepare_engine(settings)
    return monitor


def settings_from_config(cfg: Any, *, sinks: Sequence[str | SinkSpec | Sink] = (),
                         default_sinks: Sequence[str | SinkSpec | Sink] = ()
                         ) -> Settings | None:
    """The :class:`~gpulens.settings.Settings` of :func:`from_config` (``None``: monitoring is
    off): sink names parsed by :func:`gpulens.sinks.parse_sink`, as everywhere else."""
    group = _get(cfg, GROUP)
    if group is not _MISSING and group is not None and not isinstance(group, Mapping):
        raise ValueError(f"{GROUP}: expected a config node, got {group!r}")
    has_group = isinstance(group, Mapping)
    _check_names(_get(cfg, "trainer"), "trainer", _TRAINER_NAMES, loose=True)
    if has_group:
        _check_names(group, GROUP, _GROUP_NAMES, loose=False)

    enabled = _first(cfg, (ENABLE_KEY, f"{GROUP}.enabled"))
    if enabled is not None:
        if not _as_bool(*enabled):
            return None
    elif not has_group:  # off unless asked for; choosing the group asks for it
        return None

    interval = _first(cfg, (INTERVAL_KEY, f"{GROUP}.interval") if has_group else (INTERVAL_KEY,))
    interval_value = DEFAULT_INTERVAL if interval is None else _as_interval(*interval)
    names = _first(cfg, (SINKS_KEY, f"{GROUP}.sinks") if has_group else (SINKS_KEY,))
    named: list[SinkSpec | Sink] = [] if names is None else list(_as_sinks(*names))
    chosen = named or [as_sink(s) for s in default_sinks]
    gpm = _first(cfg, (GPM_KEY, f"{GROUP}.gpm") if has_group else (GPM_KEY,))
    gpus = _first(cfg, (f"{GROUP}.gpus",)) if has_group else None
    backend = _first(cfg, (f"{GROUP}.backend",)) if has_group else None
    return Settings(
        gpus=None if gpus is None else tuple(_as_gpus(*gpus)),
        interval=interval_value,
        sinks=(*chosen, *(as_sink(s) for s in sinks)),
        backend=None if backend is None else _as_backend(*backend),
        gpm=True if gpm is None else _as_bool(*gpm),
    )


# -- reading ---------------------------------------------------------------------------------
_TRAINER_NAMES = tuple(k.split(".", 1)[1] for k in (ENABLE_KEY, INTERVAL_KEY, SINKS_KEY, GPM_KEY))
_GROUP_NAMES = tuple(f.name for f in fields(GpuMonitorConfig))


def _check_names(node: Any, where: str, known: tuple[str, ...], *, loose: bool) -> None:
    """A ``ValueError`` for a key of ``node`` that looks like one of gpulens's ``known`` keys but
    is not one (a typo a struct config lets through with ``+``). ``loose``: ``node`` is the
    app's own (``trainer``), so only keys in gpulens's namespace (``gpu_mon...``:
    ``gpu_monitor_intervl``, ``enable_gpu_monitor``) are checked, not an app's own key that
    merely resembles one (``cpu_monitor_interval``, ``enable_gpu_offload``)."""
    if not isinstance(node, Mapping):
        return
    for name in node:
        if not isinstance(name, str) or name in known:
            continue
        if loose and "gpu_mon" not in name:
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f"did you mean {where}.{near[0]}? " if near else ""
        raise ValueError(f"{where}.{name}: not a gpulens key ({hint}gpulens reads "
                         f"{', '.join(f'{where}.{k}' for k in known)})")


def _get(cfg: Any, dotted: str) -> Any:
    """The value at ``dotted`` or ``_MISSING``; never raises for an absent key, even on a struct
    config. A mandatory value left unset (``???``) is a ``ValueError`` naming the key."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        try:
            node = node[part]
        except Exception as exc:  # omegaconf's MissingMandatoryValue, InterpolationResolutionError
            raise ValueError(f"{dotted}: cannot be read: {exc}") from exc
    return node


def _first(cfg: Any, keys: tuple[str, ...]) -> tuple[Any, str] | None:
    """(value, key) of the first key present with a non-null value."""
    for key in keys:
        value = _get(cfg, key)
        if value is not _MISSING and value is not None:
            return value, key
    return None


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain Python lists/dicts (imports omegaconf only if it is one)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def _as_interval(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key}: expected a number of seconds > 0, got {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{key}: expected a number of seconds > 0, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{key}: expected a number of seconds > 0, got {value!r}")
    return seconds


def _as_sinks(value: Any, key: str) -> list[SinkSpec]:
    value = _plain(value)
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        items = [s.strip() for s in value if s.strip()]
    else:
        raise ValueError(f"{key}: expected a list of sink names (e.g. [wandb, "
                         f"'jsonl:runs/gpu.jsonl']), got {value!r}")
    try:
        return [parse_sink(item) for item in items]
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _as_gpus(value: Any, key: str) -> list[int]:
    value = _plain(value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value
    ):
        raise ValueError(f"{key}: expected a list of CUDA device numbers >= 0, got {value!r}")
    return list(value)


def _as_backend(value: Any, key: str) -> str:
    if not isinstance(value, str) or value.lower() not in ("auto", "nvml", "simulated"):
        raise ValueError(f"{key}: expected auto, nvml or simulated, got {value!r}")
    return value.lower()
