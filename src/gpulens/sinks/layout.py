"""The tracker view: which keys of a row go to W&B and MLflow, and under which names.

JSONL and Prometheus keep every key of the schema under its own name; this module decides only
what the trackers' UIs show.  Both UIs make one chart per key and group charts into sections by
the key's prefix (checked against MLflow 3.17's UI bundle and wandb-workspaces 0.4):

* **MLflow** (run page and experiment chart view): a key's section is everything before its
  *last* ``/`` (``gpu/0/power_w`` -> section ``gpu/0``, chart ``power_w``); keys without a
  ``/`` go to "Model metrics".  Sections are sorted by name, with "Model metrics" and "System
  metrics" after all the others; charts inside a section are sorted by key.  Nothing can be
  pinned from the client: the order is the user's own once they drag sections (kept in the
  browser).  Schema keys gave ``gpu/0 (19)``, ``gpu/1 (19)``, ``gpu/all (33)`` sections
  before ``train``: about 70 charts before the loss with 2 GPUs, about 200 with 8.
* **W&B**: one panel per key; sections by the prefix up to the last ``/`` by default (a
  workspace setting can group by the first segment instead).  ``define_metric(key,
  hidden=True)`` keeps a key out of the automatic panels (W&B: "Hide this metric from automatic
  plots") while it stays logged for custom panels, such as the saved view of
  :mod:`gpulens.integrations.wandb_workspace` that draws every GPU of a metric on one chart.

So the default key set (``keys="default"``) puts a handful of job-level figures *in the loss's
own section*, each key with a single ``/`` (the same section under either W&B grouping):

===============================  ==========================================================
tracker key (section ``train``)  from the row
===============================  ==========================================================
``train/gpu_sm_active_pct_mean`` ``gpu/all/sm_active_pct_mean`` (GPM), or the one GPU's
``train/gpu_util_pct_mean``      ``gpu/all/util_pct_mean``, or the one GPU's
``train/gpu_mem_used_gb_max``    ``gpu/all/mem_used_gb_max`` (the fullest GPU), or the one's
``train/gpu_power_w_mean``       ``gpu/all/power_w_mean``, or the one GPU's
``train/energy_per_step_j``      ``perf/energy_per_step_j`` (all GPUs, J per step)
``train/step_time_s``            ``perf/step_time_s``
``train/data_wait_pct``          ``perf/data_wait_pct`` (HF / Lightning callbacks)
``train/tokens_per_s``           ``perf/tokens_per_s`` (or ``train/samples_per_s``)
``train/mfu_pct``                ``perf/mfu_pct``
===============================  ==========================================================

``_mean``/``_max`` are over the job's GPUs, as in ``gpu/all/*``; a run on one GPU writes the
same keys from that GPU, so runs of any size compare.  Beside them: the loop's own scalars
(``train/loss`` ...) and any key outside gpulens's own prefixes, as given; ``alerts/<rule>``
from the first row where that rule fired on (a healthy run shows no alert chart, a run with an
alert shows it in the ``alerts`` section, first in MLflow's order).  Everything else
(``gpu/{i}/*``, the other ``gpu/all/*`` and ``perf/*``, ``host/*``, ``rank/*``, ``job/*``,
``node/*``) is *detail*: W&B logs it under the schema's names hidden from the automatic panels,
MLflow leaves it out (an alert key before its rule first fires is neither: a W&B key defined
hidden stays hidden).  A figure shown under a view name is not detail too (W&B stores
``train/step_time_s``, not also ``perf/step_time_s``).  MLflow sorts the charts of a section by
key, so the loss is among them, not first (the 8th of 11 in the demo's run).
``train/global_step`` is left out (both trackers have the step).

The section is ``train`` for training rows (where gpulens itself writes ``train/loss``, and
where Hugging Face's ``WandbCallback`` writes its loss), ``gpu`` for the wall-clock rows of
``gpulens record`` (no loss there: ``gpu/sm_active_pct_mean`` ...), or what the sink is given:
``section=""`` writes bare keys, the section ("Model metrics") where Hugging Face's
``MLflowCallback`` and Lightning's ``MLFlowLogger`` put ``loss`` (the MLflow sink picks it
when it does not write the ``train/*`` keys itself).

**The key budget of a distributed job.**  Both trackers keep every distinct key of a run (W&B
asks for fewer than 10,000 in a whole project; MLflow makes a chart for each), so the number of
keys must not grow with the job.  Per-unit keys (``gpu/{i}/*``, ``node/{n}/*``, ``rank/{r}/*``)
reach the trackers only while the job has at most :data:`~gpulens.schema.FULL_GPUS` ranks
(``job/world`` in the row; ``GPULENS_FULL_GPUS`` can lower it), and then only ``gpu/{i}/*``
without the bookkeeping suffixes (:data:`~gpulens.schema.BOOKKEEPING_SUFFIXES`) and
``rank/{r}/cpu_busy_s``.  Above it, the
trackers get the job's aggregates (``gpu/all/*``), how many ranks and nodes each row holds
(``job/*``), the least active GPUs and nodes and the slowest ranks in fixed slots
(``gpu/worst{j}/*``, ``node/worst{j}/*``, ``rank/slowest{j}/*``: which GPU, node or rank as a
value, never as a new key), so the count is the same at 16 GPUs as at 4,096.  Every GPU's
figures stay in each node's JSONL record and Prometheus endpoint, labelled by node, rank and
GPU (:mod:`gpulens.distributed`).

``keys="all"`` writes every key within that budget under the schema's names, nothing hidden
(as before this layout).  Spellings: ``WandbSink(keys="all")``, ``MlflowSink(keys="all")``,
the sink names ``"wandb:all"`` and ``"mlflow:all"`` (``"mlflow:RUN_ID,all"``), and for
integrations that make their own tracker sinks the environment variable
``GPULENS_TRACKER_KEYS=all``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpulens.log import warn_once
from gpulens.model import RunContext
from gpulens.schema import BOOKKEEPING_SUFFIXES, FULL_GPUS, STEP_KEY, full_gpus

KEY_SETS = ("default", "all")
"""The tracker key sets: ``"default"`` (the view above) and ``"all"`` (every schema key)."""

KEYS_ENV = "GPULENS_TRACKER_KEYS"
"""Environment variable giving the key set of tracker sinks made without ``keys=``."""

OWN_PREFIXES = ("gpu/", "host/", "perf/", "rank/", "alerts/", "job/", "node/")
"""Prefixes of the keys gpulens computes; any other key is the user's and passes as given."""

ALERT_PREFIX = "alerts/"

_GPU_INDEX = re.compile(r"^gpu/(\d+)/")
_UNIT_KEY = re.compile(r"^(gpu|node|rank)/\d+/(.+)$")


def within_budget(key: str, scaled: bool) -> bool:
    """Whether a tracker gets ``key`` at all (module doc, "the key budget"): ``scaled`` for a
    job of more than :data:`~gpulens.schema.FULL_GPUS` ranks."""
    m = _UNIT_KEY.match(key)
    if m is None:
        return True
    if scaled:
        return False
    kind, suffix = m.group(1), m.group(2)
    if kind == "gpu":
        return suffix not in BOOKKEEPING_SUFFIXES
    return kind == "rank" and suffix == "cpu_busy_s"


def is_scaled(values: Mapping[str, float], full: int = FULL_GPUS) -> bool:
    """Whether a row is of a job above the budget's threshold (``job/world``, ranks, against
    :func:`~gpulens.schema.full_gpus`)."""
    return values.get("job/world", 0.0) > full


@dataclass(frozen=True)
class Headline:
    """One key of the default view: ``name`` in the section, read from ``source`` (a row key)
    or, for GPU figures, from ``gpu/all/{suffix}_{agg}`` or the one GPU's ``gpu/{i}/{suffix}``."""

    name: str
    source: str = ""
    suffix: str = ""
    agg: str = ""


HEADLINES: tuple[Headline, ...] = (
    Headline("gpu_sm_active_pct_mean", suffix="sm_active_pct", agg="mean"),
    Headline("gpu_util_pct_mean", suffix="util_pct", agg="mean"),
    Headline("gpu_mem_used_gb_max", suffix="mem_used_gb", agg="max"),
    Headline("gpu_power_w_mean", suffix="power_w", agg="mean"),
    Headline("energy_per_step_j", source="perf/energy_per_step_j"),
    Headline("step_time_s", source="perf/step_time_s"),
    Headline("data_wait_pct", source="perf/data_wait_pct"),
    Headline("tokens_per_s", source="perf/tokens_per_s"),
    Headline("samples_per_s", source="perf/samples_per_s"),
    Headline("mfu_pct", source="perf/mfu_pct"),
)
"""The job-level figures of the default view, in the module docstring's order."""


def resolve_keys(keys: str | None) -> str:
    """``keys`` checked (``ValueError`` naming the choices), or :data:`KEYS_ENV`'s value, or
    ``"default"``."""
    where = "keys"
    if keys is None:
        keys = os.environ.get(KEYS_ENV, "").strip() or "default"
        where = KEYS_ENV
    value = str(keys).strip().lower()
    if value not in KEY_SETS:
        raise ValueError(f"{where}={keys!r}: expected one of {', '.join(map(repr, KEY_SETS))} "
                         "(the trackers' key set)")
    return value


def check_section(section: str | None) -> str | None:
    """``section`` checked: ``None`` (automatic), ``""`` (bare keys) or a name without ``/``."""
    if section is None:
        return None
    if not isinstance(section, str) or "/" in section or section != section.strip():
        raise ValueError(f"section={section!r}: expected a name without '/' (or '' for keys "
                         "without a section)")
    return section


class TrackerLayout:
    """Splits a row's values into what a tracker shows and the detail (module docstring).

    Args:
        keys: ``"default"``, ``"all"``, or ``None`` (:data:`KEYS_ENV`, else ``"default"``).
        section: the section of the default view's figures; ``None``: ``train`` for training
            rows, ``gpu`` for wall-clock rows; ``""``: bare keys.
        include_train: keep the ``train/*`` keys (off when a framework logs them itself).

    Stateful only in one way: it remembers which alert rules have fired in this run.
    """

    def __init__(self, keys: str | None = None, *, section: str | None = None,
                 include_train: bool = True) -> None:
        self.keys = resolve_keys(keys)
        self.section = check_section(section)
        self.include_train = include_train
        self._fired: set[str] = set()
        self._full = full_gpus()
        self._sources = tuple((h, h.source or f"gpu/all/{h.suffix}_{h.agg}") for h in HEADLINES)

    def reset(self) -> None:
        """Forget the alerts seen (a new run)."""
        self._fired = set()

    def name(self, headline: str, training: bool = True) -> str:
        """The tracker key of a default-view figure (``"mfu_pct"`` -> ``"train/mfu_pct"``)."""
        section = self.section
        if section is None:
            section = "train" if training else "gpu"
        if not section:
            return headline
        if section == "gpu" and headline.startswith("gpu_"):
            headline = headline[4:]
        return f"{section}/{headline}"

    def split(self, values: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """``(shown, detail)``: the keys a tracker charts, under their tracker names, and the
        rest of gpulens's keys under the schema's names (W&B logs them hidden; MLflow drops
        them).  ``keys="all"``: every key shown, no detail."""
        train = self.include_train
        scaled = is_scaled(values, self._full)
        if self.keys == "all":
            return ({k: v for k, v in values.items()
                     if (train or not k.startswith("train/")) and within_budget(k, scaled)}, {})
        shown: dict[str, float] = {}
        detail: dict[str, float] = {}
        gpus: set[str] = set()
        for key, value in values.items():
            kind, gpu = _kind(key, scaled)
            if kind == _SKIP:
                continue
            if kind == _TRAIN:
                if train:
                    shown[key] = value
                continue
            if kind == _ALERT:
                if value >= 1.0:
                    self._fired.add(key)
                if key in self._fired:  # before: neither (a chart that starts hidden in W&B
                    shown[key] = value  # would stay hidden)
                continue
            if kind == _OWN:
                detail[key] = value
                if gpu is not None:
                    gpus.add(gpu)
                continue
            shown[key] = value
        training = STEP_KEY in values
        one = next(iter(gpus)) if len(gpus) == 1 else None
        for h, source in self._sources:
            found: float | None
            found = values.get(source)
            if found is None and not h.source and one is not None:
                found = values.get(f"gpu/{one}/{h.suffix}")
            if found is None:
                continue
            name = self.name(h.name, training)
            if name in shown:  # the user's own scalar of that name wins
                warn_once(f"layout-clash:{name}", "gpulens: %r is both a scalar of yours and a "
                          "GPU figure of gpulens's tracker view; the trackers get yours (the "
                          "figure stays in the JSONL record)", name)
                continue
            shown[name] = found
            # once under the view's name, not twice (a GPU's own key stays: the saved view
            # draws every GPU)
            detail.pop(source, None)
        return shown, detail


_SKIP, _TRAIN, _ALERT, _OWN, _USER = range(5)


@functools.lru_cache(maxsize=10_000)
def _kind(key: str, scaled: bool) -> tuple[int, str | None]:
    """What :meth:`TrackerLayout.split` does with ``key``, and its GPU index for a
    ``gpu/{i}/`` key.  Cached: a row holds tens of keys a GPU, the same ones every step, and
    the W&B sink splits each row in the training process, on a thread that shares the GIL with
    the training thread (matching the patterns anew took 3.4-4.7x the CPU a row:
    ``benchmarks/results/2026-11-27-cpu-relay-layout``)."""
    if key == STEP_KEY or not within_budget(key, scaled):
        return _SKIP, None
    if key.startswith("train/"):
        return _TRAIN, None
    if key.startswith(ALERT_PREFIX):
        return _ALERT, None
    if key.startswith(OWN_PREFIXES):
        m = _GPU_INDEX.match(key)
        return _OWN, (m.group(1) if m is not None else None)
    return _USER, None


def run_metadata(context: RunContext) -> dict[str, str | float | int]:
    """What the trackers record about a run: gpulens's version, the backend (``"simulated"``
    for simulated GPUs, said so plainly), hostname, sampling interval (s), the GPUs (count,
    ``"2 x NAME"`` summary, each GPU's name as ``gpu.{i}.name``; in a distributed job the
    job's GPUs, names up to :data:`~gpulens.schema.FULL_GPUS`), a distributed job's shape
    (``job.world``, ``job.nodes``, ``job.launcher``, ``node.{n}`` = ``"NAME: ranks 0-7, 8 x
    GPU"``, and up to :data:`~gpulens.schema.FULL_GPUS` GPUs each GPU's ``gpu.{i}.node`` and
    ``gpu.{i}.uuid``; every GPU's identity is in the JSONL ``run_start``) and the run's
    :attr:`~gpulens.model.RunContext.meta` (dtype, MFU peak and its source, FLOPs ...)."""
    from gpulens import __version__

    out: dict[str, str | float | int] = {
        "version": __version__,
        "backend": context.backend,
        "hostname": context.hostname,
        "interval_s": float(context.interval),
    }
    if context.backend == "simulated":
        out["simulated"] = ("yes: the GPU figures of this run come from gpulens's simulator, "
                            "not from hardware")
    job = getattr(context, "job", None)
    gpus = list(context.gpus)  # a job's: every rank's GPUs where the start exchange found them
    known = [g for r in job.ranks for g in r.gpus] if job is not None else []
    if len(known) > len(gpus):
        gpus = known
    out["gpu_count"] = len(gpus)
    if gpus:
        names: dict[str, int] = {}
        for g in gpus:
            names[g.name] = names.get(g.name, 0) + 1
        out["gpus"] = ", ".join(f"{n} x {name}" for name, n in names.items())
        if job is None or len(gpus) <= FULL_GPUS:
            for g in gpus:
                out[f"gpu.{g.index}.name"] = g.name
    if job is not None:  # the job's shape: a few keys a node, never one a GPU beyond 8
        out["job.world"] = job.world
        out["job.nodes"] = job.nodes
        out["job.launcher"] = job.launcher
        by_node: dict[int, list[int]] = {}
        for r in job.ranks:
            by_node.setdefault(r.node, []).append(r.rank)
        node_names = job.node_names()
        for n, ranks in sorted(by_node.items()):
            gpus = [g for r in job.ranks if r.node == n for g in r.gpus]
            kinds = sorted({g.name for g in gpus})
            out[f"node.{n}"] = (f"{node_names.get(n, '?')}: ranks {_spans(sorted(ranks))}, "
                                f"{len(gpus)} x {', '.join(kinds) or '?'}")
        if job.world <= FULL_GPUS:
            for r in job.ranks:
                for g in r.gpus:
                    out[f"gpu.{g.index}.node"] = r.node
                    out[f"gpu.{g.index}.uuid"] = g.uuid
        if job.missing:
            out["job.missing_ranks"] = _spans(list(job.missing))
    for key, value in (context.meta or {}).items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            value = str(value)
        out.setdefault(str(key), value)
    return out


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    for v in values:
        if parts and "-" not in parts[-1].split(", ")[-1] and int(parts[-1]) == v - 1:
            parts[-1] = f"{parts[-1]}-{v}"
        elif parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == v - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{v}"
        else:
            parts.append(str(v))
    return ", ".join(parts)
