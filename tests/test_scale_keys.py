"""The trackers' key budget (issue 17): the distinct keys W&B and MLflow get over a run stay
under 300 at every job size, and do not grow above :data:`gpulens.schema.FULL_GPUS` GPUs.  The
rows are rank 0's as the gather builds them (``benchmarks/tracker_keys.py``: every GPU's
entry, each node's reduction, the job's merge), run through the trackers' layout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 300


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_tracker_keys", ROOT / "benchmarks" / "tracker_keys.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


keys = _load()


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, int]]:
    return {n: keys.count(n, 8, rows=4) for n in (1, 2, 8, 16, 64, 512, 4096)}


def test_under_budget_at_every_size(counts: dict[int, dict[str, int]]) -> None:
    for n, c in counts.items():
        assert c["wandb"] < BUDGET and c["all"] < BUDGET, (n, c)
        assert c["mlflow"] == counts[1]["mlflow"]  # the default view: a handful, any size


def test_flat_above_the_threshold(counts: dict[int, dict[str, int]]) -> None:
    assert counts[16]["wandb"] == counts[64]["wandb"] == counts[512]["wandb"] == counts[
        4096]["wandb"]
    assert counts[8]["wandb"] > counts[16]["wandb"]  # up to 8 GPUs: every GPU's charts


def test_large_rows_name_gpus_as_values_not_keys() -> None:
    import random

    from gpulens.distributed import aggregate as agg
    from gpulens.sinks.layout import TrackerLayout

    row = keys.job_row(64, 8, 1, random.Random(0), agg.BestSoFar())
    shown, detail = TrackerLayout("default").split(row)
    sent = set(shown) | set(detail)
    assert not [k for k in sent if k.split("/")[1].isdigit()]  # no gpu/{i}, node/{n}, rank/{r}
    worst = [k for k in sent if k.startswith("gpu/worst")]
    assert {"gpu/worst1/gpu", "gpu/worst1/node", "gpu/worst1/sm_active_pct"} <= set(worst)
    assert 0 <= row["gpu/worst1/gpu"] < 64 and 0 <= row["gpu/worst1/node"] < 8
    assert row["job/world"] == 64 and row["job/gpus"] == 64
