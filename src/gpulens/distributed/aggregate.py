"""What each level of the gather computes, on fixed-size vectors of float64 (NaN: not
available).

* A rank's row becomes an *entry* (:func:`pack_rank`, :data:`RANK_FIELDS` then the schema's
  GPU suffixes), which it writes to its node's shared file.
* A node's leader reduces its ranks' entries of one row (:func:`reduce_node`) into

  - the *node row* it writes to its own sinks (JSONL, Prometheus): every GPU of the node
    (``gpu/{i}/*``), each rank's busy time and scores (``rank/{r}/*``) and the node's
    aggregates (``node/{n}/*``);
  - the *node summary* it sends to rank 0 (:class:`NodeSummary`, one vector of a size fixed
    for the job): the aggregates (count, sum, min, max of each of :data:`AGG_SUFFIXES`), the
    work summed over its ranks, its busy-time minimum and median, and a few *featured*
    entries: every rank's while the job has at most :data:`FULL_GPUS` GPUs, else the
    :data:`K_WORST` least active GPUs and the :data:`K_SLOW` busiest ranks by GPU time and by
    CPU time.

* Rank 0 merges the summaries of one row (:func:`merge_job`): job aggregates
  (``gpu/all/*``: means weighted by count, min of mins, max of maxes, sums of power and
  energy), per-node aggregates (``node/{n}/*``), the job's ``K_WORST`` least active GPUs in
  fixed slots (``gpu/worst{j}/*`` with the GPU and node as values, not as new keys), the
  slowest ranks (``rank/slowest{j}/*``) and how many ranks and nodes the row holds
  (``job/*``).  Rank 0 receives O(nodes) values a row, whatever the node size.

Busy time per step: a rank's GPU busy time is its SM activity (GPM), else its NVML
utilization, times the step time; its CPU busy time is its training thread's CPU seconds per
step.  Scores, after NVIDIA's straggler detection (``nvidia-resiliency-ext``): a rank's
*relative* score is the best (smallest) busy time of the job (of its node, in a node row)
over its own; its *individual* score is its own best so far over its current one.  1.0 is
the pace of the best; a rank at 0.8 is busy 25 % longer.
"""

from __future__ import annotations

import array
import heapq
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpulens.engine.spec import WORK_CPU, WORK_FLOPS, WORK_SAMPLES, WORK_TOKENS
from gpulens.engine.window import JOB_SUFFIXES
from gpulens.schema import FULL_GPUS, GPU_ROW_KEYS, gpu_key

K_WORST = 3
"""The least active GPUs each node sends up, and the job row names (``gpu/worst{j}``)."""
K_SLOW = 2
K_WORST_NODES = 2
"""The least active nodes the job row names (``node/worst{j}``)."""
"""The busiest ranks (by GPU time, and by CPU time) each node sends up."""
MISSING_SLOTS = 8
"""Missing ranks a node summary names (the count is exact beyond it)."""

AGG_SUFFIXES: tuple[str, ...] = tuple(sorted(JOB_SUFFIXES))
"""The per-GPU figures every node aggregates (count, sum, min, max): the job aggregates'
(``gpu/all/*``) of a job on one node."""
SUMMED = ("power_w", "energy_j")
"""Aggregates that are also given as sums (``..._sum``): the job's power and energy."""
NODE_KEYS: tuple[tuple[str, str], ...] = (
    ("util_pct", "mean"), ("util_pct", "min"), ("sm_active_pct", "mean"), ("sm_active_pct", "min"),
    ("tensor_active_pct", "mean"), ("power_w", "sum"), ("energy_j", "sum"), ("mem_used_gb", "max"),
    ("temp_c", "max"), ("throttle_pct", "max"),
)
"""Each node's figures in rank 0's row (``node/{n}/<suffix>_<stat>``), about a dozen with the
node's ranks, worst GPU and busy times: O(nodes) keys a row; a node's own row has every
aggregate."""
WORST_KEYS: tuple[str, ...] = ("util_pct", "sm_active_pct", "tensor_active_pct", "power_w",
                               "temp_c", "mem_used_gb", "sm_clock_mhz", "throttle_pct")
"""Figures of each of the job's worst GPUs in its slot (``gpu/worst{j}/<suffix>``)."""

RANK_FIELDS: tuple[str, ...] = (
    "step", "time", "rank", "gpu", "node", "perf/steps", "perf/step_time_s", "host/cpu_pct",
    "host/ram_used_gb", WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS, WORK_CPU, "perf/data_wait_s",
    "perf/forward_backward_s", "perf/optimizer_s",
)
_F = {name: i for i, name in enumerate(RANK_FIELDS)}
_G0 = len(RANK_FIELDS)
RANK_WIDTH = _G0 + len(GPU_ROW_KEYS)
"""Cells of a rank's entry."""
_SUMS = (WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS)

Entry = list[float]


_finite = math.isfinite


def pack_rank(step: int, time: float, values: Mapping[str, float], rank: int,
              gpu: int, node: int | None = None) -> Entry:
    """A rank's raw row as its entry: :data:`RANK_FIELDS`, then ``gpu/{gpu}/<suffix>`` for
    each of the schema's GPU suffixes (NaN where absent)."""
    nan = math.nan
    out = [float(step), float(time), float(rank), float(gpu),
           float(node) if node is not None else nan]
    out += [float(values.get(k, nan)) for k in RANK_FIELDS[5:]]
    out += [float(values.get(gpu_key(gpu, s), nan)) for s in GPU_ROW_KEYS]
    return out


def gpu_figures(entry: Entry) -> dict[str, float]:
    """An entry's GPU figures by suffix (the finite ones)."""
    return {s: v for s, v in zip(GPU_ROW_KEYS, entry[_G0:], strict=True) if _finite(v)}


def field_of(entry: Entry, name: str) -> float:
    return entry[_F[name]]


def activity(entry: Entry) -> float:
    """SM activity (GPM) where the GPU reports it, else NVML utilization, %; NaN if neither."""
    sm = entry[_G0 + _GPU_INDEX["sm_active_pct"]]
    return sm if _finite(sm) else entry[_G0 + _GPU_INDEX["util_pct"]]


_GPU_INDEX = {s: i for i, s in enumerate(GPU_ROW_KEYS)}


def busy(entry: Entry) -> tuple[float, float]:
    """``(GPU busy s, CPU busy s)`` per step of an entry (NaN where not measured)."""
    steps = entry[_F["perf/steps"]]
    steps = steps if _finite(steps) and steps > 0 else 1.0
    act = activity(entry)
    step_time = entry[_F["perf/step_time_s"]]
    gpu = act / 100 * step_time if _finite(act) and _finite(step_time) else math.nan
    cpu = entry[_F[WORK_CPU]]
    return gpu, (cpu / steps if _finite(cpu) else math.nan)


@dataclass
class Agg:
    """Count, sum, min and max of one figure over GPUs."""

    n: float = 0.0
    total: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        self.lo = min(self.lo, v)
        self.hi = max(self.hi, v)

    def merge(self, n: float, total: float, lo: float, hi: float) -> None:
        if n > 0:
            self.n += n
            self.total += total
            self.lo = min(self.lo, lo)
            self.hi = max(self.hi, hi)

    def keys(self, prefix: str, suffix: str, out: dict[str, float]) -> None:
        if self.n <= 0:
            return
        out[f"{prefix}/{suffix}_mean"] = self.total / self.n
        out[f"{prefix}/{suffix}_min"] = self.lo
        out[f"{prefix}/{suffix}_max"] = self.hi
        if suffix in SUMMED:
            out[f"{prefix}/{suffix}_sum"] = self.total


def featured_slots(world: int, full: int = FULL_GPUS) -> int:
    """Entries a node summary carries: every rank's in a job of at most ``full`` ranks
    (:func:`~gpulens.schema.full_gpus`), else the worst few."""
    return full if world <= full else K_WORST + 2 * K_SLOW


@dataclass
class NodeSummary:
    """What a node's leader sends rank 0 for one row (module doc)."""

    node: int
    seq: int
    step: int
    time: float
    ranks: int
    """Ranks whose entries it holds."""
    expected: int
    """Ranks of the node."""
    missing: tuple[int, ...] = ()
    lost: int = 0
    """Entries overwritten in the node's file before the leader read them (so far)."""
    work: dict[str, float] = field(default_factory=dict)
    aggs: dict[str, Agg] = field(default_factory=dict)
    busy: tuple[float, float, float, float] = (math.nan,) * 4
    """GPU busy min and median, CPU busy min and median, s per step over the node's ranks."""
    featured: list[tuple[Entry, float, float]] = field(default_factory=list)
    """(entry, individual GPU score, individual CPU score)."""

    _HEAD = 8

    def encode(self, slots: int) -> bytes:
        """The fixed-size vector: ``_HEAD + MISSING_SLOTS + 3 + 4 + 4 * len(AGG_SUFFIXES) +
        slots * (RANK_WIDTH + 2)`` cells."""
        nan = math.nan
        v = [float(self.node), float(self.seq), float(self.step), self.time,
             float(self.ranks), float(self.expected), float(len(self.missing)),
             float(self.lost)]
        miss = list(self.missing[:MISSING_SLOTS])
        v += [float(r) for r in miss] + [nan] * (MISSING_SLOTS - len(miss))
        v += [self.work.get(k, nan) for k in _SUMS]
        v += list(self.busy)
        for s in AGG_SUFFIXES:
            a = self.aggs.get(s)
            v += [a.n, a.total, a.lo, a.hi] if a is not None and a.n > 0 else [0.0, 0.0, nan,
                                                                              nan]
        for entry, ig, ic in self.featured[:slots]:
            v += [*entry, ig, ic]
        v += [nan] * ((RANK_WIDTH + 2) * (slots - min(slots, len(self.featured))))
        return array.array("d", v).tobytes()

    @classmethod
    def done(cls, node: int) -> bytes:
        """The message a leader sends last, at stop (``expected`` -1)."""
        return cls(node=node, seq=0, step=0, time=0.0, ranks=0, expected=-1).encode(0)

    @classmethod
    def decode(cls, raw: bytes) -> NodeSummary:
        v = array.array("d")
        v.frombytes(raw)
        h = cls._HEAD
        n_missing = int(v[6])
        missing = tuple(int(x) for x in v[h:h + min(n_missing, MISSING_SLOTS)])
        at = h + MISSING_SLOTS
        work = {k: x for k, x in zip(_SUMS, v[at:at + 3], strict=True) if _finite(x)}
        at += 3
        busy_t = (v[at], v[at + 1], v[at + 2], v[at + 3])
        at += 4
        aggs: dict[str, Agg] = {}
        for s in AGG_SUFFIXES:
            n, total, lo, hi = v[at:at + 4]
            at += 4
            if n > 0:
                aggs[s] = Agg(n, total, lo, hi)
        featured = []
        width = RANK_WIDTH + 2
        while at + width <= len(v):
            chunk = v[at:at + width].tolist()
            at += width
            if _finite(chunk[_F["rank"]]):
                featured.append((chunk[:RANK_WIDTH], chunk[RANK_WIDTH], chunk[RANK_WIDTH + 1]))
        summary = cls(node=int(v[0]), seq=int(v[1]), step=int(v[2]), time=v[3],
                      ranks=int(v[4]), expected=int(v[5]), missing=missing, lost=int(v[7]),
                      work=work, aggs=aggs, busy=busy_t, featured=featured)
        summary.missing_count = n_missing
        return summary

    missing_count: int = -1
    """Missing ranks in all (``len(missing)`` unless more than :data:`MISSING_SLOTS`)."""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _min(values: list[float]) -> float:
    return min(values) if values else math.nan


class BestSoFar:
    """Each rank's smallest busy time so far (the individual score's reference)."""

    def __init__(self) -> None:
        self._best: dict[tuple[int, int], float] = {}

    def score(self, rank: int, which: int, value: float) -> float:
        """``best / value`` after taking ``value`` in (NaN where ``value`` is not a positive
        figure)."""
        if not _finite(value) or value <= 0:
            return math.nan
        key = (rank, which)
        best = min(self._best.get(key, value), value)
        self._best[key] = best
        return best / value


def _score(best: float, value: float) -> float:
    return best / value if _finite(best) and _finite(value) and value > 0 else math.nan


def reduce_node(node: int, seq: int, entries: Mapping[int, Entry], expected: int,
                missing: Iterable[int], lost: int, world: int, best: BestSoFar,
                full: int = FULL_GPUS) -> tuple[NodeSummary, dict[str, float]]:
    """A node's entries of one row (by rank) -> its summary for rank 0 and the figures of its
    own row (module doc)."""
    ranks = sorted(entries)
    first = entries[ranks[0]]
    out: dict[str, float] = {}
    aggs: dict[str, Agg] = {}
    work: dict[str, float] = {}
    gpu_busy: dict[int, float] = {}
    cpu_busy: dict[int, float] = {}
    scores: dict[int, tuple[float, float]] = {}
    for r in ranks:
        e = entries[r]
        key = int(e[_F["gpu"]])
        for suffix, value in gpu_figures(e).items():
            out[gpu_key(key, suffix)] = value
            if suffix in _AGG_SET:
                aggs.setdefault(suffix, Agg()).add(value)
        for k in _SUMS:
            if _finite(e[_F[k]]):
                work[k] = work.get(k, 0.0) + e[_F[k]]
        g, c = busy(e)
        if _finite(g):
            gpu_busy[r] = g
        if _finite(c):
            cpu_busy[r] = c
        scores[r] = (best.score(r, 0, g), best.score(r, 1, c))
    g_min, c_min = _min(list(gpu_busy.values())), _min(list(cpu_busy.values()))
    for r in ranks:
        for name, figures, lo, own in (("gpu", gpu_busy, g_min, scores[r][0]),
                                       ("cpu", cpu_busy, c_min, scores[r][1])):
            if r in figures:
                out[f"rank/{r}/{name}_busy_s"] = figures[r]
                out[f"rank/{r}/{name}_relative_score"] = _score(lo, figures[r])
                if _finite(own):
                    out[f"rank/{r}/{name}_individual_score"] = own
    prefix = f"node/{node}"
    for suffix, agg in aggs.items():
        agg.keys(prefix, suffix, out)
    missing_t = tuple(sorted(missing))
    out[f"{prefix}/ranks"] = float(len(ranks))
    out[f"{prefix}/partial"] = 1.0 if len(ranks) < expected else 0.0
    summary = NodeSummary(
        node=node, seq=seq, step=int(first[_F["step"]]), time=first[_F["time"]],
        ranks=len(ranks), expected=expected, missing=missing_t, lost=lost, work=work,
        aggs=aggs,
        busy=(g_min, _median(list(gpu_busy.values())), c_min, _median(list(cpu_busy.values()))),
        featured=[(entries[r], *scores[r]) for r in _featured(
            entries, gpu_busy, cpu_busy, featured_slots(world, full), world <= full)])
    summary.missing_count = len(missing_t)
    worst = _worst(entries)
    if worst:
        out[f"{prefix}/worst_gpu"] = entries[worst[0]][_F["gpu"]]
    return summary, out


_AGG_SET = frozenset(AGG_SUFFIXES)
_NODE_STATS: dict[str, list[str]] = {}
for _suffix, _stat in NODE_KEYS:
    _NODE_STATS.setdefault(_suffix, []).append(_stat)


def _worst(entries: Mapping[int, Entry]) -> list[int]:
    """Ranks by their GPU's activity, least active first (those without any: left out)."""
    scored = [(activity(e), r) for r, e in entries.items() if _finite(activity(e))]
    return [r for _, r in sorted(scored)]


def _featured(entries: Mapping[int, Entry], gpu_busy: Mapping[int, float],
              cpu_busy: Mapping[int, float], slots: int, every: bool) -> list[int]:
    if every:
        return sorted(entries)[:slots]
    chosen: list[int] = []
    for group in (_worst(entries)[:K_WORST],
                  sorted(gpu_busy, key=lambda r: -gpu_busy[r])[:K_SLOW],
                  sorted(cpu_busy, key=lambda r: -cpu_busy[r])[:K_SLOW]):
        chosen += [r for r in group if r not in chosen]
    return chosen[:slots]


def merge_job(summaries: list[NodeSummary], world: int, nodes: int,
              full: int = FULL_GPUS) -> dict[str, float]:
    """Rank 0: the nodes' summaries of one row -> the job's figures (module doc).  The GPU
    figures of rank 0's own node come from its own node row, not from here."""
    out: dict[str, float] = {}
    aggs: dict[str, Agg] = {}
    work: dict[str, float] = {}
    ranks = 0
    featured: list[tuple[Entry, float, float, int]] = []
    g_best = c_best = math.inf
    for s in summaries:
        ranks += s.ranks
        for k, v in s.work.items():
            work[k] = work.get(k, 0.0) + v
        prefix = f"node/{s.node}"
        for suffix, a in s.aggs.items():
            aggs.setdefault(suffix, Agg()).merge(a.n, a.total, a.lo, a.hi)
            if a.n > 0:
                stats = {"mean": a.total / a.n, "min": a.lo, "max": a.hi, "sum": a.total}
                for stat in _NODE_STATS.get(suffix, ()):
                    out[f"{prefix}/{suffix}_{stat}"] = stats[stat]
        out[f"{prefix}/ranks"] = float(s.ranks)
        out[f"{prefix}/partial"] = 1.0 if s.ranks < s.expected else 0.0
        least = _worst({int(e[_F["rank"]]): e for e, _, _ in s.featured})
        if least:
            worst_entry = next(e for e, _, _ in s.featured if int(e[_F["rank"]]) == least[0])
            out[f"{prefix}/worst_gpu"] = worst_entry[_F["gpu"]]
        for name, value in (("gpu_busy_s_min", s.busy[0]), ("gpu_busy_s_median", s.busy[1]),
                            ("cpu_busy_s_min", s.busy[2]), ("cpu_busy_s_median", s.busy[3])):
            if _finite(value):
                out[f"{prefix}/{name}"] = value
        if _finite(s.busy[0]):
            g_best = min(g_best, s.busy[0])
        if _finite(s.busy[2]):
            c_best = min(c_best, s.busy[2])
        featured += [(e, ig, ic, s.node) for e, ig, ic in s.featured]
    for suffix, agg in aggs.items():
        agg.keys("gpu/all", suffix, out)
    out.update(work)
    out["job/ranks"] = float(ranks)
    out["job/nodes"] = float(len(summaries))
    out["job/world"] = float(world)
    out["job/partial"] = 1.0 if ranks < world or len(summaries) < nodes else 0.0
    gpus = int(aggs["util_pct"].n) if "util_pct" in aggs else 0
    if gpus:
        out["job/gpus"] = float(gpus)
    if world <= full:
        for e, ig, ic, _ in featured:
            _rank_keys(e, ig, ic, g_best, c_best, out)
            for suffix, value in gpu_figures(e).items():
                out[gpu_key(int(e[_F["gpu"]]), suffix)] = value
        return out
    # each featured entry's figures once: (activity, GPU busy, CPU busy, rank, node, entry)
    figs: list[tuple[float, float, float, int, int, Entry]] = [
        (activity(e), *busy(e), int(e[_F["rank"]]), node, e) for e, _, _, node in featured]
    quietest = heapq.nsmallest(K_WORST * 2, (f for f in figs if _finite(f[0])),
                               key=lambda f: f[0])
    seen: set[int] = set()
    for _, _, _, r, node, e in quietest:
        if r in seen or len(seen) >= K_WORST:
            continue
        seen.add(r)
        j = len(seen)
        figures = gpu_figures(e)
        out[f"gpu/worst{j}/gpu"] = e[_F["gpu"]]
        out[f"gpu/worst{j}/node"] = float(node)
        for suffix in WORST_KEYS:
            if suffix in figures:
                out[f"gpu/worst{j}/{suffix}"] = figures[suffix]
    _worst_nodes(summaries, out)
    slow = heapq.nlargest(K_SLOW * 2, (f for f in figs if _finite(f[1])), key=lambda f: f[1])
    seen.clear()
    for _, g, _, r, node, _ in slow:
        if r in seen or len(seen) >= K_SLOW:
            continue
        seen.add(r)
        j = len(seen)
        out[f"rank/slowest{j}/rank"] = float(r)
        out[f"rank/slowest{j}/node"] = float(node)
        out[f"rank/slowest{j}/gpu_relative_score"] = _score(g_best, g)
        out[f"rank/slowest{j}/gpu_busy_s"] = g
    # per-rank figures of the job's slowest few by GPU and by CPU time (the slow-rank rule's
    # candidates): O(1) keys a row, not O(ranks)
    by_cpu = heapq.nlargest(K_SLOW, (f for f in figs if _finite(f[2])), key=lambda f: f[2])
    chosen = seen | {f[3] for f in by_cpu}
    for e, ig, ic, _ in featured:
        if int(e[_F["rank"]]) in chosen:
            _rank_keys(e, ig, ic, g_best, c_best, out)
    return out


def _worst_nodes(summaries: list[NodeSummary], out: dict[str, float]) -> None:
    """``node/worst{j}/*``: the :data:`K_WORST_NODES` least active nodes (mean SM activity,
    else mean utilization), each as its index and a few figures."""
    scored = []
    for s in summaries:
        a = s.aggs.get("sm_active_pct") or s.aggs.get("util_pct")
        if a is not None and a.n > 0:
            scored.append((a.total / a.n, s.node, s))
    for j, (_, node, s) in enumerate(sorted(scored)[:K_WORST_NODES], start=1):
        out[f"node/worst{j}/node"] = float(node)
        out[f"node/worst{j}/ranks"] = float(s.ranks)
        for suffix in ("sm_active_pct", "util_pct", "power_w"):
            a = s.aggs.get(suffix)
            if a is not None and a.n > 0:
                out[f"node/worst{j}/{suffix}_mean"] = a.total / a.n
        power = s.aggs.get("power_w")
        if power is not None and power.n > 0:
            out[f"node/worst{j}/power_w_sum"] = power.total


def _rank_keys(e: Entry, ig: float, ic: float, g_best: float, c_best: float,
               out: dict[str, float]) -> None:
    r = int(e[_F["rank"]])
    g, c = busy(e)
    node = e[_F["node"]]
    if _finite(node):
        out[f"rank/{r}/node"] = node
    for name, value, best, own in (("gpu", g, g_best, ig), ("cpu", c, c_best, ic)):
        if not _finite(value):
            continue
        out[f"rank/{r}/{name}_busy_s"] = value
        rel = _score(best, value)
        if _finite(rel):
            out[f"rank/{r}/{name}_relative_score"] = rel
        if _finite(own):
            out[f"rank/{r}/{name}_individual_score"] = own
