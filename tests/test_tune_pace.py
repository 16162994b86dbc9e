"""The loader's own pace (:mod:`gpulens.tune.pace`): batch times noted in real loader workers
under every start method, the seconds per batch read from them, and a trial's figures
corrected where its window ran on batches queued before it opened."""

from __future__ import annotations

import functools
import itertools
import math
import multiprocessing
import time

import pytest
import torch
from torch.utils.data import DataLoader

from gpulens.tune.model import Config, Trial, TuneResult
from gpulens.tune.pace import CAPACITY, LoaderPace, batch_s, corrected
from gpulens.tune.progress import trial_line
from gpulens.tune.report import headline
from tests.support.tune_load import SlowSamples, collate_numpy


def test_batch_s_is_the_lower_quartile_of_one_workers_gaps_inside_the_window() -> None:
    finished = [[0.5, 1.2, 1.4, 1.6, 1.9, 9.0],  # 0.5 before the window, 9.0 after it
                [1.1, 1.35, 1.7]]                # gaps of its own
    # gaps 0.2, 0.2, 0.3, 0.25, 0.35: the lower quartile
    assert batch_s(finished, 1.0, 2.0) == pytest.approx(0.2)
    # fewer than two gaps a worker: too few to tell a slow loader from a few steps
    assert batch_s([[1.2, 1.4, 1.6], [1.1, 1.35]], 1.0, 2.0) is None
    assert batch_s([[1.1], [1.2]], 1.0, 2.0) is None
    assert batch_s([], 1.0, 2.0) is None


def test_batch_s_reads_the_time_per_batch_of_a_worker_that_waits_for_uneven_work() -> None:
    """Two workers, 16 ms a batch, fed three micro-batches back to back every 120 ms step (a
    Trainer with accumulation 3): each worker's gaps are 16 ms (two indices in a row) and about
    one or two steps; the median would read a step."""
    finished: list[list[float]] = [[], []]
    for step in range(10):
        for micro in range(3):
            n = 3 * step + micro
            worker = n % 2
            start = max(0.12 * step, finished[worker][-1] if finished[worker] else 0.0)
            finished[worker].append(start + 0.016)
    gaps = sorted(b - a for f in finished for a, b in itertools.pairwise(f))
    assert gaps[len(gaps) // 2] > 0.09  # the median: a step
    assert batch_s(finished, 0.0, 2.0) == pytest.approx(0.016)


def test_service_times_read_the_time_per_batch_where_a_few_gaps_read_the_steps() -> None:
    """One worker, 10 ms a batch, steps of 25-75 ms (a loader that keeps up): its gaps are
    the steps that freed its queue, not the steps the window timed, and three of them can
    read a slow loader. Its service times (finish less start) read 10 ms; without starts (the
    worker's first batch, or a torch whose fetchers are not wrapped) the gaps stand in."""
    finished = [[0.100, 0.175, 0.200, 0.275]]  # paced by steps of 75, 25, 75 ms before
    began = [[math.nan, 0.165, 0.190, 0.265]]  # each began when its index came
    assert batch_s(finished, 0.1, 0.3) == pytest.approx(0.025)  # the gaps: a step, not 10 ms
    assert batch_s(finished, 0.1, 0.3, began) == pytest.approx(0.010)
    # no start noted (a torch whose fetchers are not where they were): the gaps stand in
    assert batch_s(finished, 0.1, 0.3, [[math.nan] * 4]) == pytest.approx(0.025)
    # every noted batch begun before the window closed counts, the warm-up's too (service
    # times hold no wait; a short window holds too few to average out one slow batch): here
    # 0.2 s and 0.4 s; not one begun after the window (1.0), nor the first (no start)
    slow = [[0.10, 0.50, 0.90, 1.40]]
    began_slow = [[math.nan, 0.30, 0.50, 1.00]]  # 0.3 -> 0.5, then 0.5 -> 0.9 (a slow one)
    assert batch_s(slow, 0.45, 0.60, began_slow) == pytest.approx(0.3)
    assert batch_s(slow, 0.75, 0.90, began_slow) == pytest.approx(0.3)
    assert batch_s(slow, 0.05, 0.20, [[math.nan] * 4]) is None  # no start, one finish


FIGURES = {"steps": 8, "seconds": 0.8, "step_s": 0.1, "data_wait_s": 0.0,
           "forward_backward_s": 0.08, "optimizer_s": 0.02, "data_wait_pct": 0.0,
           "forward_backward_pct": 80.0, "optimizer_pct": 20.0, "samples_per_s": 160.0,
           "tokens_per_s": None, "tflops": 2.0, "mfu_pct": None}


def test_a_loader_that_cannot_keep_up_sets_the_wait_the_rates_and_the_shares() -> None:
    # one worker, 0.15 s a batch, a step busy 0.1 s: once the queue is gone, 0.05 s of wait
    out = corrected(FIGURES, 0.15, workers=1, batches_per_step=1)
    assert out["data_wait_by"] == "loader pace" and out["loader_batch_s"] == 0.15
    assert out["data_wait_s"] == pytest.approx(0.05) and out["step_s"] == pytest.approx(0.15)
    assert out["samples_per_s"] == pytest.approx(160.0 / 1.5)
    assert out["tflops"] == pytest.approx(2.0 / 1.5)
    assert out["tokens_per_s"] is None and out["mfu_pct"] is None  # absent stays absent
    assert out["data_wait_pct"] == pytest.approx(100 / 3)
    assert out["forward_backward_pct"] == pytest.approx(80 / 1.5)
    assert out["seconds"] == 0.8  # the window as timed
    # two batches a step (accumulation), two workers: the same pace per step
    assert corrected(FIGURES, 0.15, workers=2, batches_per_step=2)["data_wait_s"] == \
        pytest.approx(0.05)


def test_a_paced_wait_within_the_margin_of_the_timed_one_leaves_the_window_figures() -> None:
    # paced 0.0015 s against 0.0 timed: 1.5 % of the 0.1 s step, under the 2 % margin
    assert corrected(FIGURES, 0.1015, 1, 1)["data_wait_by"] == "window"
    assert corrected(FIGURES, 0.1025, 1, 1)["data_wait_by"] == "loader pace"


def test_a_paced_wait_that_reaches_the_target_counts_inside_the_margin() -> None:
    """A loader 6 % short after a slow warm-up: the window timed 4.5 % (under the 5 % target),
    the pace says 5.7 %: 1.2 % more, inside the margin, but across the target."""
    # busy 0.0955 s: forward+backward 0.0755, optimizer 0.02
    timed = dict(FIGURES, step_s=0.1, data_wait_s=0.0045, forward_backward_s=0.0755,
                 data_wait_pct=4.5, forward_backward_pct=75.5)
    per_batch = 0.0955 / (1 - 0.057)
    assert corrected(timed, per_batch, 1, 1)["data_wait_by"] == "window"  # no target given
    out = corrected(timed, per_batch, 1, 1, target_pct=5.0)
    assert out["data_wait_by"] == "loader pace"
    assert out["data_wait_pct"] == pytest.approx(5.7, abs=0.05)
    # both under the target, or both over it: the margin decides
    assert corrected(timed, 0.0955 / (1 - 0.049), 1, 1, 5.0)["data_wait_by"] == "window"
    over = dict(FIGURES, step_s=0.1, data_wait_s=0.06, forward_backward_s=0.02,
                data_wait_pct=60.0, forward_backward_pct=20.0)
    assert corrected(over, 0.04 / (1 - 0.605), 1, 1, 5.0)["data_wait_by"] == "window"


def test_a_loader_that_keeps_up_or_a_larger_measured_wait_leaves_the_window_figures() -> None:
    # two workers at 0.15 s a batch feed a 0.1 s step: no wait from the loader
    out = corrected(FIGURES, 0.15, workers=2, batches_per_step=1)
    assert out["data_wait_by"] == "window" and out["loader_batch_s"] == 0.15
    assert {k: out[k] for k in FIGURES} == FIGURES
    # the window measured more wait than the pace asks for (e.g. the batch's transfer)
    waited = dict(FIGURES, step_s=0.2, data_wait_s=0.1)
    assert corrected(waited, 0.15, workers=1, batches_per_step=1)["data_wait_s"] == 0.1
    # no gap seen, or no phases: as timed
    assert corrected(FIGURES, None, 1, 1)["data_wait_by"] == "window"
    no_phases = {"steps": 8, "step_s": 0.1, "samples_per_s": 160.0}
    assert corrected(no_phases, 0.5, 1, 1)["samples_per_s"] == 160.0


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_real_workers_note_their_batches_under_every_start_method(method: str) -> None:
    """Two workers, 40 ms a batch of sleep, a consumer that never waits on its own: each
    worker's gaps are its time per batch."""
    ctx = multiprocessing.get_context(method)
    pace = LoaderPace(2)
    loader = DataLoader(SlowSamples(n=64, per_sample_s=0.005), batch_size=8, num_workers=2,
                        collate_fn=pace.wrap(collate_numpy), multiprocessing_context=ctx)
    t0 = time.perf_counter()
    batches = list(loader)
    t1 = time.perf_counter()
    assert len(batches) == 8 and batches[0][0].shape == (8, 8)  # the batches as collated
    finished, began = pace.batches()
    assert [len(f) for f in finished] == [4, 4]
    for times, starts in zip(finished, began, strict=True):
        assert times == sorted(times) and t0 < times[0] and times[-1] < t1
        # a worker's first batch has no start (its fetches are wrapped as it ends); from the
        # second on each began before it finished, by at least the batch's 40 ms of sleep
        assert math.isnan(starts[0])
        assert all(0.04 <= f - b < 0.4 for f, b in zip(times[1:], starts[1:], strict=True))
    per_batch = pace.batch_s(t0, t1)
    assert per_batch is not None and 0.04 <= per_batch < 0.4
    # the fetchers were wrapped in the workers only, never in this (the training) process
    from torch.utils.data._utils import fetch

    assert not hasattr(fetch._MapDatasetFetcher.fetch, "gpulens_timed")


def test_a_loader_with_other_workers_than_the_pace_is_not_noted() -> None:
    """A Trainer subclass that builds its own loader with two workers where the trial set
    one: its gaps would be read against the wrong count, so none are noted."""
    pace = LoaderPace(1)
    loader = DataLoader(SlowSamples(n=48, per_sample_s=0.001), batch_size=8, num_workers=2,
                        collate_fn=pace.wrap(collate_numpy))
    assert len(list(loader)) == 6
    assert pace.batches()[0] == [[]]


def test_the_main_process_notes_nothing_and_the_ring_keeps_the_latest() -> None:
    pace = LoaderPace(1)
    collate = pace.wrap(collate_numpy)
    collate([(torch.zeros(2), torch.zeros(1))])  # no worker: nothing to note
    assert pace.batches()[0] == [[]]
    # the collator's own attributes read through (a Trainer's ``data_collator.tokenizer``)
    assert pace.wrap(functools.partial(collate_numpy)).func is collate_numpy
    with pytest.raises(ValueError, match="needs loader workers"):
        LoaderPace(0)
    # the ring buffer: more batches than it holds keeps the latest CAPACITY, oldest first
    for i in range(CAPACITY + 3):
        pace._times[i % CAPACITY] = float(i)
    pace._counts[0] = CAPACITY + 3
    kept = pace.batches()[0][0]
    assert len(kept) == CAPACITY and kept[0] == 3.0 and kept[-1] == CAPACITY + 2.0


def test_a_wait_from_the_loaders_pace_is_said_in_the_progress_line_and_the_report() -> None:
    paced = Trial(config=Config(16, 1), status="ok", samples_per_s=106.7, data_wait_pct=33.3,
                  **{k: v for k, v in corrected(FIGURES, 0.15, 1, 1).items()
                     if k in ("data_wait_by", "loader_batch_s")})
    timed = Trial(config=Config(16, 2), status="ok", samples_per_s=160.0, data_wait_pct=0.4,
                  data_wait_by="window", loader_batch_s=0.15)
    assert trial_line(paced).endswith("data wait 33.3 % (loader pace)")
    assert trial_line(timed).endswith("data wait 0.4 %")
    result = TuneResult(trials=[paced, timed], chosen=timed)
    assert sum("their data wait is the workers' pace" in line for line in headline(result)) == 1
    back = TuneResult.from_dict(result.to_dict())  # the new fields round-trip
    assert back.trials[0].data_wait_by == "loader pace" and back.trials[0].loader_batch_s == 0.15
    assert not any("workers' pace" in line for line in headline(TuneResult([timed], timed)))
