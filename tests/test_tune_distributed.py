"""``gpulens.tune.tune`` under torchrun (2 ranks, gloo, CPU): every rank runs every trial, the
decision uses the slowest rank's throughput and the largest data wait, and both ranks choose
the same configuration (``tests/support/tune_ddp.py``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulens.tune import Config, TuneResult
from tests.support.torchrun import kill_all_jobs, run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_job_left() -> Iterator[None]:
    yield
    kill_all_jobs()


def test_ranks_agree_on_the_slowest_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                           env.get("PYTHONPATH", "")]))
    done = run_torchrun([str(ROOT / "tests" / "support" / "tune_ddp.py"), str(tmp_path)],
                        cwd=tmp_path, env=env, timeout=300)
    assert done.ok, (done.stdout[-2000:], done.stderr[-6000:])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    results = [TuneResult.from_dict(r["result"]) for r in ranks]
    # the same trials, the same figures, the same choice on both ranks
    assert results[0].to_dict()["trials"] == results[1].to_dict()["trials"]
    for r in results:
        assert r.world_size == 2 and r.chosen is not None
        # rank 0 alone would take one worker at batch 16; rank 1 needs two
        assert r.chosen.config == Config(16, 2), [t.config for t in r.trials]
        assert r.oom_batch == 32  # both ranks ran out of memory there: recorded, survived
    local0, local1 = (r["local"] for r in ranks)
    # a trial with one worker where rank 1's loader fell short and rank 0's did not: the
    # agreed data wait (rank 1's) raised the workers for both
    short = [(a, b) for a, b in zip(local0, local1, strict=True)
             if a["config"]["num_workers"] == 1 and b["status"] == "ok"
             and b["data_wait_pct"] >= 5 > a["data_wait_pct"]]
    assert short, [(a["config"], a["data_wait_pct"], b["data_wait_pct"])
                   for a, b in zip(local0, local1, strict=True)]
    for t, a, b in zip(results[0].trials, local0, local1, strict=True):
        if t.status != "ok":
            assert t.status == "oom" and a["status"] == b["status"] == "oom"
            continue
        assert t.samples_per_s == pytest.approx(2 * min(a["samples_per_s"], b["samples_per_s"]))
        assert t.data_wait_pct == pytest.approx(max(a["data_wait_pct"], b["data_wait_pct"]))
        assert t.wall_s == pytest.approx(max(a["wall_s"], b["wall_s"]))
