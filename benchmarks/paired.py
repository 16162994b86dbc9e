"""Paired, randomised A/A statistics shared by the overhead benchmarks (issue 11).

The method, in one place so that every script says the same thing:

* **Rounds, arms, pairing.** A run is a series of rounds; each round runs every arm once (an
  arm: a baseline loop, or the same loop with one monitor). An arm's value in a round is one
  number of seconds per step (the median of its timed steps, or a block's mean where steps are
  timed as a block). Pairing within a round takes out the slow drift of clocks and temperature
  between rounds: a monitor's **per-round difference** is
  ``100 * (value(arm) / value(baseline) - 1)`` percentage points (pp) of the same round's
  baseline step; a monitor against another monitor is the difference of their two per-round
  differences.
* **Order.** The arms' orders are balanced and random (:func:`round_order`): every complete
  set of rounds (a Williams design: ``n`` orders for ``n`` arms, ``2n`` where ``n`` is odd; all
  six for three arms) puts each arm in each place equally often and, inside the rounds, right
  after each other arm equally often; the sets come in a seeded random order and the arms'
  roles are drawn per run. So an effect of the place in the round or of the arm before (a
  monitor's stop in the next block's burn-in) falls on every arm alike. Not balanced: the step
  from one round's last arm to the next round's first (random), and an incomplete last set
  (``paths_aa.py`` rounds its target to whole sets where the budget allows).
* **A/A arm.** Every baseline runs twice per round (``<baseline>`` and ``<baseline>_b``, the
  same code). The A/A arm's per-round difference is what two identical arms differ by in this
  run: its 95 % interval is the run's **A/A envelope**, and its range is shown beside it.
* **Seeds.** A run of a script whose runs are pooled (``paths_aa.py``, ``step_work_ab.py``)
  draws its order seed afresh (``fresh_seed``) unless one is given, and records it. Runs pooled
  over several calls must have different seeds: with one seed every run goes through the same
  sequence of orders, and whatever depends on the order and on the time since the start adds
  up across the runs instead of averaging out (2026-11-28, ten jobs with seed 0: the A/A arm
  slower than the baseline in nine; four with seeds 1-4: mixed signs).
* **Between runs.** Rounds of one run share that run's state (its process, its memory layout,
  its place on the host's CPUs); an arm's effect can differ from run to run by more than the
  rounds' own spread says. Where rounds of several runs are pooled, :func:`between_runs` sets
  each run's mean beside the others (Cochran's Q, I squared) and gives the random-effects
  interval (DerSimonian-Laird weights, Hartung-Knapp's t interval), which widens where the
  runs disagree and where they are few; the pools judge the bound on it, widened to the pooled
  rounds' interval where that is wider (:meth:`BetweenRuns.judged`).
* **Interval.** The mean of the per-round differences, with a 95 % percentile-bootstrap
  interval (4000 resamples of the rounds, seeded).
* **Verdict.** "higher than X" / "lower than X" only where the interval excludes 0 **and** lies
  wholly outside the A/A envelope (no overlap with the A/A arm's interval); otherwise "not
  separable". An A/A interval that itself excludes 0 is a bias of the method in that run, and is
  reported as such.
* **Bound.** Where a run must show that an arm costs nothing measurable (``paths_aa.py``), the
  claim is "indistinguishable within +-b pp": the arm's 95 % interval contains 0 **and** lies
  wholly inside [-b, +b] (:func:`equivalence`). An interval that contains 0 but reaches past
  +-b is "unresolved" (too few rounds for that claim), never "indistinguishable"; one that
  excludes 0 is "differs", whatever its size, and the verdict above says whether it also
  leaves the A/A envelope.
* **Rounds.** With ``s`` the standard deviation of the A/A arm's per-round differences, the
  95 % half-width of a mean over ``n`` rounds is ``1.96 s / sqrt(n)``. A difference ``d`` clears
  both 0 and an A/A interval of the same width when ``d >= 2 * 1.96 s / sqrt(n)``, so resolving
  ``d`` needs ``n = ceil((2 * 1.96 s / d)^2)`` rounds (``rounds_needed``), and ``n`` rounds
  resolve ``2 * 1.96 s / sqrt(n)`` (``resolvable_pp``). A pilot's ``s`` sets ``n``; the time
  budget caps it, and the report says when the cap left the target unresolved. The same ``n``
  with ``d = b`` gives an interval of half-width ``b / 2``: about a true difference of 0 it
  lies inside +-b unless its mean strays past ``b / 2`` (about 1 run in 20), so it is the
  number of rounds a bound of +-b asks for.

Standard library only: the scripts that import it run on machines with nothing else.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054
"""Two-sided 95 % point of the standard normal distribution."""
RESOLVE_PP = 0.2
"""The difference (percentage points of a step) a run should be able to resolve."""
BOOTSTRAP = 4000


def aa_name(baseline: str) -> str:
    """The A/A arm of ``baseline``: the same code, run a second time in every round."""
    return f"{baseline}_b"


def fresh_seed() -> int:
    """A new order seed for a run that was given none (module doc, "Seeds")."""
    return secrets.randbelow(2**31)


def shared_seeds(keys: Sequence[tuple[int, ...]]) -> list[int]:
    """The seeds of runs that ran one sequence of orders: each run's key is its seed first
    (then whatever tells its files apart as one run, e.g. the rank), and a key met twice is
    two runs of one seed (module doc, "Seeds")."""
    return sorted({key[0] for key in keys if keys.count(key) > 1})


def shared_seeds_refused(shared: Sequence[int]) -> str:
    return (f"runs share the order seed(s) {list(shared)}: they ran the same sequence of "
            "orders, so order and time effects add up instead of averaging out; not pooled "
            "(--same-orders pools them anyway and says so)")


def shared_seeds_pooled(shared: Sequence[int]) -> str:
    return (f"These runs share the order seed(s) {list(shared)} (pooled with --same-orders): "
            "one sequence of orders repeated, so effects of the order and of the time since "
            "the start do not average out over them.")


def williams(n: int) -> list[list[int]]:
    """The orders of a Williams design for ``n`` arms: each arm once in each place and right
    after each other arm once (``n`` even; ``n`` odd: twice each, over ``2n`` orders)."""
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def whole_designs(target: int, cap: int, arms: int) -> int:
    """``target`` rounds rounded to whole balanced designs (:func:`williams`): up where
    ``cap`` allows, else down, else as it was (an incomplete last design is unbalanced)."""
    size = len(williams(arms))
    up = -(-target // size) * size
    if up <= cap:
        return up
    down = target // size * size
    return down if down > 0 else target


def round_order(arms: Sequence[str], seed: int, round_index: int) -> list[str]:
    """The order of ``arms`` in round ``round_index``, the same on every rank of a distributed
    run: the rounds go through complete Williams designs (:func:`williams`), each design's
    orders in a random order seeded by ``(seed, its index)``, the arms' roles in the design
    drawn once per seed (module doc, "Order")."""
    n = len(arms)
    if n < 2:
        return list(arms)
    roles = list(arms)
    random.Random(f"gpulens-bench:{seed}:roles").shuffle(roles)
    design = williams(n)
    block, place = divmod(round_index, len(design))
    rows = list(range(len(design)))
    random.Random(f"gpulens-bench:{seed}:{block}").shuffle(rows)
    return [roles[i] for i in design[rows[place]]]


def per_round_pp(arm: Mapping[int, float], base: Mapping[int, float]) -> dict[int, float]:
    """Per round present in both: ``100 * (arm / base - 1)``, in percentage points."""
    return {r: 100.0 * (arm[r] / base[r] - 1.0) for r in sorted(arm) if r in base and base[r] > 0}


def minus(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """Per round present in both: ``a - b``."""
    return {r: a[r] - b[r] for r in sorted(a) if r in b}


def mean_ci(values: Sequence[float], seed: int = 0,
            resamples: int = BOOTSTRAP) -> tuple[float, float, float]:
    """The mean of ``values`` and its 95 % percentile-bootstrap interval (seeded)."""
    if not values:
        return math.nan, math.nan, math.nan
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    return m, means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]


def sd(values: Sequence[float]) -> float:
    """Sample standard deviation (NaN below two values)."""
    return statistics.stdev(values) if len(values) >= 2 else math.nan


def rounds_needed(sd_pp: float, resolve_pp: float = RESOLVE_PP) -> int | None:
    """Rounds for a difference of ``resolve_pp`` to clear 0 and the A/A envelope (module doc);
    ``None`` when the SD is unknown."""
    if not math.isfinite(sd_pp):
        return None
    return max(2, math.ceil((2 * Z95 * sd_pp / resolve_pp) ** 2))


def resolvable_pp(sd_pp: float, rounds: int) -> float:
    """The smallest difference ``rounds`` rounds resolve at this A/A noise (module doc)."""
    if rounds < 2 or not math.isfinite(sd_pp):
        return math.nan
    return 2 * Z95 * sd_pp / math.sqrt(rounds)


@dataclass(frozen=True)
class Estimate:
    """A per-round difference summarised: mean, 95 % interval, range, rounds."""

    mean: float
    lo: float
    hi: float
    min: float
    max: float
    sd: float
    n: int

    @staticmethod
    def of(per_round: Mapping[int, float], seed: int = 0) -> Estimate:
        values = list(per_round.values())
        m, lo, hi = mean_ci(values, seed)
        return Estimate(m, lo, hi, min(values, default=math.nan),
                        max(values, default=math.nan), sd(values), len(values))

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    def as_dict(self) -> dict[str, float | int]:
        return {"mean_pp": self.mean, "ci95_pp": [self.lo, self.hi],  # type: ignore[dict-item]
                "range_pp": [self.min, self.max], "sd_pp": self.sd,  # type: ignore[dict-item]
                "rounds": self.n}


T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95 % points of Student's t for 1 to 30 degrees of freedom."""


def t975(df: int) -> float:
    """Student's t, two-sided 95 %, ``df`` degrees of freedom (a table to 30, then the
    Cornish-Fisher expansion, within 0.001 there)."""
    if df < 1:
        return math.nan
    if df <= len(T975):
        return T975[df - 1]
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class BetweenRuns:
    """Several runs' means of one per-round difference, set side by side (module doc)."""

    runs: int
    q: float
    """Cochran's Q: the runs' squared distances from their fixed-effect mean, each in units
    of its own variance; about ``runs - 1`` where they agree."""
    i2: float
    """I squared: the share of Q beyond ``runs - 1``, 0 where the runs agree."""
    tau: float
    """The between-run SD (pp) of the arm's effect (DerSimonian-Laird)."""
    mean: float
    lo: float
    hi: float
    """The random-effects mean and its 95 % interval (pp): Hartung-Knapp, Student's t with
    ``runs - 1`` degrees of freedom, never narrower than DerSimonian-Laird's normal one."""
    normal_half: float
    """DerSimonian-Laird's normal half-width (pp), for comparison: too narrow with few runs."""

    def as_dict(self) -> dict[str, float | int]:
        return {"runs": self.runs, "q": self.q, "i2": self.i2, "tau_pp": self.tau,
                "mean_pp": self.mean, "ci95_pp": [self.lo, self.hi]}  # type: ignore[dict-item]

    def judged(self, rounds: Estimate) -> Estimate:
        """The interval a bound is judged on: the union of this one and the pooled rounds'
        (never narrower than what the rounds alone say)."""
        return Estimate(self.mean, min(self.lo, rounds.lo), max(self.hi, rounds.hi),
                        rounds.min, rounds.max, rounds.sd, rounds.n)


def between_runs(per_run: Sequence[Sequence[float]]) -> BetweenRuns | None:
    """The runs' per-round differences (one list per run) -> :class:`BetweenRuns`; ``None``
    with fewer than two runs of at least two rounds each (shorter runs are left out). Each
    run's mean has the variance ``sd^2 / n``; the random-effects weights add the between-run
    variance ``tau^2`` (DerSimonian-Laird) to it; the interval is Hartung-Knapp's (the runs'
    weighted spread about the mean, Student's t with ``k - 1`` degrees of freedom), widened to
    the normal one where that is wider: with a handful of runs the normal interval is too
    narrow."""
    runs = [list(r) for r in per_run if len(r) >= 2]
    if len(runs) < 2:
        return None
    k = len(runs)
    means = [statistics.fmean(r) for r in runs]
    var = [max(statistics.variance(r), 1e-12) / len(r) for r in runs]
    w = [1 / v for v in var]
    fixed = sum(wi * m for wi, m in zip(w, means, strict=True)) / sum(w)
    q = sum(wi * (m - fixed) ** 2 for wi, m in zip(w, means, strict=True))
    c = sum(w) - sum(wi * wi for wi in w) / sum(w)
    tau2 = max(0.0, (q - (k - 1)) / c)
    w_re = [1 / (v + tau2) for v in var]
    mean = sum(wi * m for wi, m in zip(w_re, means, strict=True)) / sum(w_re)
    hk = sum(wi * (m - mean) ** 2 for wi, m in zip(w_re, means, strict=True)) / (
        (k - 1) * sum(w_re))
    normal = Z95 / math.sqrt(sum(w_re))
    half = max(t975(k - 1) * math.sqrt(hk), normal)
    i2 = max(0.0, (q - (k - 1)) / q) if q > 0 else 0.0
    return BetweenRuns(k, q, i2, math.sqrt(tau2), mean, mean - half, mean + half, normal)


@dataclass(frozen=True)
class Judgement:
    """What a pool of runs says about the bound, for one arm (:func:`judge_runs`)."""

    between: BetweenRuns | None
    """The runs side by side; ``None`` with fewer than two runs of two rounds."""
    interval: Estimate
    """The interval judged: :meth:`BetweenRuns.judged`, or the rounds' alone."""
    verdict: str
    """:func:`equivalence` of that interval."""
    left_out: int
    """Runs too short to be set side by side (their rounds are in the pooled ones)."""

    @property
    def within(self) -> bool:
        return self.verdict.startswith("within")


def judge_runs(per_run: Sequence[Sequence[float]], rounds: Estimate,
               bound: float) -> Judgement:
    """One arm's pool judged against +-``bound``: the runs' per-round differences set side by
    side (:func:`between_runs`), the interval never narrower than ``rounds`` (the pooled
    rounds' estimate), and the verdict (module doc, "Between runs"). The one judgement the
    pooling scripts give."""
    b = between_runs(per_run)
    interval = b.judged(rounds) if b is not None else rounds
    return Judgement(b, interval, equivalence(interval, bound),
                     len(per_run) - (b.runs if b is not None else 0))


def variants_minus(values: Mapping[str, Mapping[int, float]], name: str
                   ) -> dict[str, dict[int, float]]:
    """Per variant arm of path ``name`` (``<name>_<variant>_gpulens``, ``paths_aa.py
    --variants``): per round, the default gpulens arm's difference to the baseline minus the
    variant's (pp; positive: the variant's setting takes that much away), paired."""
    base, main = values.get(name), values.get(f"{name}_gpulens")
    if not base or not main:
        return {}
    ours = per_round_pp(main, base)
    return {arm: minus(ours, per_round_pp(per, base)) for arm, per in values.items()
            if arm.startswith(f"{name}_") and arm.endswith("_gpulens")
            and arm != f"{name}_gpulens"}


def verdict(est: Estimate, envelope: Estimate | None, than: str) -> str:
    """"higher than X" / "lower than X" where the interval excludes 0 and lies wholly outside
    the A/A envelope's interval; otherwise "not separable"."""
    if not est.has_interval or envelope is None or not envelope.has_interval:
        return "not separable"
    if est.lo > 0 and est.lo > envelope.hi:
        return f"higher than {than}"
    if est.hi < 0 and est.hi < envelope.lo:
        return f"lower than {than}"
    return "not separable"


def equivalence(est: Estimate, bound_pp: float) -> str:
    """``"within +-b pp"`` where the 95 % interval contains 0 and lies inside [-b, +b];
    ``"differs"`` where it excludes 0; ``"unresolved"`` otherwise (module doc)."""
    if not est.has_interval:
        return "unresolved"
    if est.lo > 0 or est.hi < 0:
        return "differs"
    if -bound_pp <= est.lo and est.hi <= bound_pp:
        return f"within +-{bound_pp:g} pp"
    return "unresolved"


def fmt_pp(x: float) -> str:
    return f"{x:+.3f}" if math.isfinite(x) else "-"


def fmt_est(est: Estimate) -> str:
    """``mean [lo, hi]`` in pp."""
    if not est.has_interval:
        return f"{fmt_pp(est.mean)} [-, -]"
    return f"{fmt_pp(est.mean)} [{fmt_pp(est.lo)}, {fmt_pp(est.hi)}]"


def fmt_envelope(env: Estimate | None) -> str:
    """The A/A envelope as shown beside each arm: its interval; its range."""
    if env is None:
        return "no A/A arm"
    rng = f"[{fmt_pp(env.min)}, {fmt_pp(env.max)}]"
    return f"{fmt_est(env)}; range {rng}"


@dataclass(frozen=True)
class Plan:
    """How many rounds the A/A noise asks for, and what the run could afford."""

    pilot_rounds: int
    pilot_sd_pp: float
    needed: int | None
    cap: int | None
    """The most rounds the run allowed itself after the pilot (``cap_by`` says why)."""
    done: int
    final_sd_pp: float
    resolve_pp: float = RESOLVE_PP
    cap_by: str = "the time budget"

    @property
    def resolvable(self) -> float:
        return resolvable_pp(self.final_sd_pp, self.done)

    @property
    def capped(self) -> bool:
        """The cap, not the A/A noise, set the number of rounds."""
        return self.cap is not None and self.needed is not None and self.cap < self.needed

    @property
    def unresolved(self) -> bool:
        r = self.resolvable
        return not math.isfinite(r) or r > self.resolve_pp

    def line(self) -> str:
        """One sentence for the report."""
        need = "unknown (no A/A SD)" if self.needed is None else str(self.needed)
        if self.pilot_rounds:
            out = (f"A/A noise: per-round SD {self.pilot_sd_pp:.3f} pp after a "
                   f"{self.pilot_rounds}-round pilot -> {need} rounds to resolve "
                   f"{self.resolve_pp} pp; {self.done} rounds ran")
        else:
            out = (f"A/A noise: {self.done} rounds fixed by the command (no pilot); their "
                   f"per-round SD asks for {need} rounds to resolve {self.resolve_pp} pp")
        if self.capped:
            out += f" ({self.cap_by}: at most {self.cap})"
        out += (f"; final SD {self.final_sd_pp:.3f} pp: {self.done} rounds resolve "
                f"{self.resolvable:.3f} pp")
        if self.unresolved:
            out += f" -- {self.resolve_pp} pp left UNRESOLVED" + (
                f" by {self.cap_by}" if self.capped else "")
        return out

    def as_dict(self) -> dict[str, object]:
        return {"pilot_rounds": self.pilot_rounds, "pilot_sd_pp": self.pilot_sd_pp,
                "rounds_needed": self.needed, "rounds_cap": self.cap, "cap_by": self.cap_by,
                "capped": self.capped, "rounds_done": self.done,
                "final_sd_pp": self.final_sd_pp, "resolve_pp": self.resolve_pp,
                "resolvable_pp": self.resolvable, "unresolved": self.unresolved}


def worst_aa_sd(values: Mapping[str, Mapping[int, float]], baselines: Iterable[str]) -> float:
    """The largest SD of the A/A per-round differences over the groups (the noisiest group
    sets the number of rounds); NaN if no group has two rounds yet."""
    sds = []
    for base in baselines:
        aa = aa_name(base)
        if base in values and aa in values:
            s = sd(list(per_round_pp(values[aa], values[base]).values()))
            if math.isfinite(s):
                sds.append(s)
    return max(sds) if sds else math.nan


@dataclass(frozen=True)
class Comparison:
    """One row of the report: ``arm`` against ``than`` (a baseline or another monitor)."""

    arm: str
    than: str
    est: Estimate
    envelope: Estimate | None

    @property
    def verdict(self) -> str:
        return verdict(self.est, self.envelope, self.than)

    def as_dict(self) -> dict[str, object]:
        return {"arm": self.arm, "than": self.than, **self.est.as_dict(),
                "aa_envelope": self.envelope.as_dict() if self.envelope else None,
                "verdict": self.verdict}


def compare(values: Mapping[str, Mapping[int, float]], baseline_of: Mapping[str, str],
            rivals: Iterable[tuple[str, str]] = (), seed: int = 0) -> list[Comparison]:
    """Every arm against its baseline (A/A arms included), then each ``(ours, theirs)`` pair
    of monitors of the same baseline against each other; each beside its group's envelope.

    ``values[arm][round]``: seconds per step; ``baseline_of[arm]``: the arm's baseline (a
    baseline maps to itself and is skipped).
    """
    envelopes: dict[str, Estimate] = {}
    for base in set(baseline_of.values()):
        aa = aa_name(base)
        if base in values and aa in values:
            pr = per_round_pp(values[aa], values[base])
            if pr:
                envelopes[base] = Estimate.of(pr, seed)
    out: list[Comparison] = []
    for arm, base in baseline_of.items():
        if arm == base or arm not in values or base not in values:
            continue
        pr = per_round_pp(values[arm], values[base])
        if pr:
            out.append(Comparison(arm, base, Estimate.of(pr, seed), envelopes.get(base)))
    for ours, theirs in rivals:
        group = baseline_of.get(ours)
        if group is None or baseline_of.get(theirs) != group:
            continue
        if not all(a in values for a in (ours, theirs, group)):
            continue
        d = minus(per_round_pp(values[ours], values[group]),
                  per_round_pp(values[theirs], values[group]))
        if d:
            out.append(Comparison(ours, theirs, Estimate.of(d, seed), envelopes.get(group)))
    return out


def table(comparisons: Sequence[Comparison], bound_pp: float | None = None) -> str:
    """The Markdown table of comparisons (see the module doc for each column); with
    ``bound_pp`` a last column says whether each difference is within +-bound
    (:func:`equivalence`)."""
    extra = f" | within +-{bound_pp:g} pp?" if bound_pp is not None else ""
    lines = ["| arm | against | difference (pp): mean [95 % CI] | per-round range (pp) "
             f"| A/A envelope (pp): interval; range | verdict{extra} |",
             "|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for c in comparisons:
        e = c.est
        cell = f" | {equivalence(e, bound_pp)}" if bound_pp is not None else ""
        lines.append(f"| {c.arm} | {c.than} | {fmt_est(e)} | [{fmt_pp(e.min)}, {fmt_pp(e.max)}] "
                     f"| {fmt_envelope(c.envelope)} | {c.verdict}{cell} |")
    return "\n".join(lines)


def bias_notes(comparisons: Sequence[Comparison]) -> list[str]:
    """A sentence for each A/A arm whose interval excludes 0 (a bias of the method)."""
    notes = []
    for c in comparisons:
        if c.arm == aa_name(c.than) and c.est.has_interval and (c.est.lo > 0 or c.est.hi < 0):
            notes.append(f"A/A arm {c.arm}: its interval {fmt_est(c.est)} pp excludes 0: two "
                         "identical arms differed in this run (order or drift bias); only "
                         "differences outside that envelope are claimed.")
    return notes
