"""The rules that read a distributed job at scale, on rows as rank 0 writes them: slow_rank
says whether a node, a GPU or a rank is slow (from rows with every GPU, and from a large job's
rows that hold only aggregates and the slowest ranks), and comm_bound says when the job waits
on its interconnect.  Each fires once per episode; a healthy stream fires nothing."""

from __future__ import annotations

import random
from collections.abc import Callable

from gpulens.engine.rules import RuleEngine, RulesConfig
from gpulens.model import Event, JobShape, RankInfo

T0 = 1_800_000_000.0
STEP_S = 0.25
JOB = JobShape(world=24, nodes=3, launcher="test", ranks=tuple(
    RankInfo(rank=r, local_rank=r % 8, node=r // 8, node_name=f"host-{r // 8}")
    for r in range(24)))


def run(make: Callable[[int, random.Random], dict[str, float]], steps: int = 80,
        config: RulesConfig | None = None) -> list[Event]:
    rules = RuleEngine(config or RulesConfig(distributed=True, job=JOB))
    rng = random.Random(0)
    events: list[Event] = []
    for step in range(1, steps + 1):
        values = {"perf/steps": 1.0, "perf/step_time_s": STEP_S, **make(step, rng)}
        events += rules.feed(values, step, T0 + step * STEP_S)
    return events


def large_row(gpu_busy: dict[int, float], node_min: dict[int, float],
              node_median: dict[int, float], rng: random.Random) -> dict[str, float]:
    """A 24-rank job's row: aggregates, each node's busy figures, the slowest ranks only."""
    v = {"gpu/all/sm_active_pct_mean": 60.0, "job/world": 24.0}
    for n in range(3):
        v[f"node/{n}/gpu_busy_s_min"] = node_min.get(n, 0.15) * rng.uniform(0.98, 1.02)
        v[f"node/{n}/gpu_busy_s_median"] = node_median.get(n, 0.15) * rng.uniform(0.98, 1.02)
    for r, b in gpu_busy.items():
        v[f"rank/{r}/gpu_busy_s"] = b * rng.uniform(0.98, 1.02)
        v[f"rank/{r}/node"] = float(r // 8)
    return v


def firing(events: list[Event], name: str) -> list[Event]:
    return [e for e in events if e.name == name and e.kind == "alert" and e.state == "firing"]


def test_a_slow_gpu_of_a_large_job_is_named_with_its_node() -> None:
    events = run(lambda s, rng: large_row({13: 0.24, 2: 0.16}, {}, {}, rng))
    (e,) = firing(events, "slow_rank")
    assert "GPU 13 (rank 13, node 1 host-1) is chronically slow" in e.message
    assert e.data["rank"] == 13.0 and e.step <= 21
    assert "node 1 (" not in e.message.split("is chronically")[0]  # not the node as a whole


def test_a_slow_node_is_named_as_the_node_not_rank_by_rank() -> None:
    events = run(lambda s, rng: large_row({17: 0.22, 20: 0.22, 3: 0.155}, {2: 0.21},
                                          {2: 0.22}, rng))
    (e,) = firing(events, "slow_rank")
    assert e.message.count("chronically") == 0 and "node 2 host-2 is slow as a whole" in e.message
    assert e.data["node"] == 2.0 and "rank 17" not in e.message


def test_healthy_large_job_fires_nothing() -> None:
    assert run(lambda s, rng: large_row({5: 0.155, 9: 0.156}, {}, {}, rng)) == []


def comm_row(sm: float, nvlink: float, rng: random.Random) -> dict[str, float]:
    v: dict[str, float] = {}
    for i in range(4):
        v[f"gpu/{i}/sm_active_pct"] = sm * rng.uniform(0.97, 1.03)
        v[f"gpu/{i}/nvlink_rx_gb_per_s"] = nvlink * rng.uniform(0.97, 1.03)
        v[f"gpu/{i}/nvlink_tx_gb_per_s"] = nvlink * rng.uniform(0.97, 1.03)
    return v


def test_comm_bound_fires_once_with_its_evidence() -> None:
    # compute-bound with moderate traffic for 40 steps, then the SMs wait on heavy traffic
    events = run(lambda s, rng: comm_row(85.0, 40.0, rng) if s <= 40
                 else comm_row(30.0, 120.0, rng), steps=100)
    (e,) = firing(events, "comm_bound")
    assert 40 < e.step <= 60
    assert "NVLink" in e.message and "SMs were active" in e.message
    assert e.data["sm_active_pct"] < 50 and e.data["link_share_pct"] >= 50


def test_comm_bound_quiet_when_the_sms_stay_busy_or_nothing_moves() -> None:
    assert not firing(run(lambda s, rng: comm_row(85.0, 150.0, rng)), "comm_bound")
    assert not firing(run(lambda s, rng: comm_row(20.0, 0.0, rng)), "comm_bound")
