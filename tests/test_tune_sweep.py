"""The sweep's logic against a made-up training whose throughput is a formula: which trials it
runs, in which order, and what it chooses. No device, no clock: every case is exact."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from html import unescape
from pathlib import Path

import pytest

from gpulens.tune.model import (
    Config,
    Trial,
    TuneInterrupted,
    TuneResult,
    TuneSettings,
    workers_grid,
)
from gpulens.tune.report import headline, render_html, render_markdown, render_text
from gpulens.tune.space import BatchSpace
from gpulens.tune.sweep import Sweep


@dataclass
class Formula:
    """Step time = compute + (loader if no workers, else max(compute, loader / workers))."""

    compute: Callable[[int], float] = lambda b: 0.01 + 0.001 * b
    per_sample_load_s: float = 0.0
    oom_at: int | None = None
    wall_s: float = 1.0
    calls: list[Config] = field(default_factory=list)

    def __call__(self, c: Config, role: str) -> Trial:
        self.calls.append(c)
        if self.oom_at is not None and c.batch_size >= self.oom_at:
            return Trial(c, "oom", wall_s=self.wall_s, error="OutOfMemoryError")
        compute = self.compute(c.batch_size) * c.accumulation
        load = self.per_sample_load_s * c.batch_size * c.accumulation
        step = compute + load if c.num_workers == 0 else max(compute, load / c.num_workers)
        samples = c.batch_size * c.accumulation
        return Trial(c, "ok", steps=10, seconds=10 * step, wall_s=self.wall_s,
                     samples_per_s=samples / step, step_s=step,
                     data_wait_pct=100 * (step - compute) / step,
                     peak_reserved_gb=0.5 * c.batch_size, total_gb=80.0)


def run(formula: Formula, current: Config | None = None, world: int = 1,
        **kw: object) -> TuneResult:
    settings = TuneSettings(**kw).check()  # type: ignore[arg-type]
    space = BatchSpace.from_settings(settings, world)
    return Sweep(formula, settings, space, current=current).run()


def batches(result: TuneResult, role: str | None = None) -> list[int]:
    return [t.config.batch_size for t in result.trials if role is None or t.role == role]


def bent(knee: int, extra_s: float) -> Callable[[int], float]:
    """Compute time that rises faster past ``knee`` samples (a larger batch gets slower)."""
    return lambda b: 0.01 + 0.001 * b + (extra_s * (b - knee) if b > knee else 0.0)


def test_coarse_then_refine_finds_the_peak_between_powers_of_two() -> None:
    f = Formula(compute=bent(48, 0.002))
    r = run(f, workers=(0,), loader_options=False)
    assert batches(r, "coarse") == [1, 2, 4, 8, 16, 32, 64, 128]  # 64, 128: two declines
    assert batches(r, "refine") == [24, 48, 40, 56]
    assert r.chosen is not None and r.chosen.config.batch_size == 48
    assert r.oom_batch is None and r.fits_batch == 128
    assert any("coarse pass stopped after batch 128" in n for n in r.notes)
    assert r.confirm is not None and r.trials[-1] is r.confirm and r.confirm.role == "confirm"


def test_the_worker_sweep_stops_at_the_first_count_under_the_data_wait_target() -> None:
    f = Formula(compute=bent(32, 0.002), per_sample_load_s=0.0015)
    r = run(f, workers=(0, 1, 2, 4, 8), loader_options=False, refine_trials=0)
    at32 = {t.config.num_workers: t for t in r.trials if t.config.batch_size == 32}
    assert sorted(at32) == [1, 2]  # started at the count 16 needed, stopped at 2
    assert at32[1].data_wait_pct is not None and at32[1].data_wait_pct >= 5
    assert at32[2].data_wait_pct is not None and at32[2].data_wait_pct < 5
    assert r.chosen is not None and r.chosen.config == Config(32, 2)
    assert not [t for t in r.trials if t.config.num_workers > 2]


def test_more_workers_that_do_not_help_end_the_worker_sweep() -> None:
    # the "data wait" here is not the loader's: more workers change nothing
    def flat(c: Config, role: str) -> Trial:
        return Trial(c, "ok", wall_s=1.0, samples_per_s=100.0 * c.batch_size / (c.batch_size + 1),
                     data_wait_pct=20.0)

    settings = TuneSettings(workers=(0, 1, 2, 4), max_batch=4, refine_trials=0,
                            loader_options=False, confirm=False).check()
    r = Sweep(flat, settings, BatchSpace.from_settings(settings)).run()
    assert [(t.config.batch_size, t.config.num_workers) for t in r.trials] == [
        (1, 0), (1, 1), (2, 0), (2, 1), (4, 0), (4, 1)]
    assert r.chosen is not None and r.chosen.config == Config(4, 0)


def test_out_of_memory_is_a_result_and_bounds_the_search() -> None:
    f = Formula(oom_at=100)
    r = run(f, workers=(0,), loader_options=False)
    assert batches(r, "coarse") == [1, 2, 4, 8, 16, 32, 64, 128]
    oom = [t for t in r.trials if t.status == "oom"]
    assert oom and all(t.config.batch_size >= 100 for t in oom)
    assert r.chosen is not None and r.chosen.config.batch_size < 100
    # the best size was the largest that fitted, so the search went toward the edge
    assert batches(r, "refine") == [48, 88, 72, 104]
    assert (r.fits_batch, r.oom_batch) == (88, 104)
    assert r.confirm is not None and r.confirm.ok
    assert any("Out of memory from batch" in line for line in headline(r))


def test_a_tie_goes_to_the_smaller_batch() -> None:
    plateau = Formula(compute=lambda b: 0.001 * b if b >= 16 else 0.016)  # flat from 16 up
    r = run(plateau, workers=(0,), max_batch=256, loader_options=False)
    assert r.chosen is not None and r.chosen.config.batch_size == 16


def test_the_budget_stops_the_sweep_and_the_choice_stands() -> None:
    f = Formula(wall_s=10.0)
    r = run(f, workers=(0,), budget_s=35.0, confirm=True)
    assert len(r.trials) == 3 and r.stopped == "budget"
    assert r.chosen is not None and r.chosen.config.batch_size == 4
    assert any("time budget" in n for n in r.notes)


class Closed:
    """A progress display that notes whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    def update(self, trial: Trial, done: int, expected: int, spent_s: float,
               left_s: float | None) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_ctrl_c_ends_the_sweep_with_the_trials_that_finished() -> None:
    settings = TuneSettings(workers=(0,), max_batch=64, loader_options=False).check()
    space = BatchSpace.from_settings(settings, 1)
    full = Sweep(Formula(), settings, space, current=Config(4)).run()
    assert full.confirm is not None and full.trials[-1] is full.confirm
    assert full.chosen is not None
    # Ctrl-C in the first trial, in the coarse pass, in the confirmation
    for at in (1, 4, len(full.trials)):
        f = Formula()

        def measure(c: Config, role: str, f: Formula = f, at: int = at) -> Trial:
            if len(f.calls) + 1 == at:
                raise KeyboardInterrupt
            return f(c, role)

        progress = Closed()
        with pytest.raises(TuneInterrupted) as caught:
            Sweep(measure, settings, space, current=Config(4), progress=progress,
                  device="CPU", notes=["a note of the caller"]).run()
        assert isinstance(caught.value, KeyboardInterrupt) and progress.closed
        r = caught.value.result
        assert [t.config for t in r.trials] == [t.config for t in full.trials[:at - 1]]
        assert r.stopped == "interrupted" and r.confirm is None and r.device == "CPU"
        assert r.notes[:2] == [f"interrupted (Ctrl-C) after {at - 1} finished trial(s): a "
                               "partial sweep, the choice is the best of those trials",
                               "a note of the caller"]
        assert (r.chosen is None) == (at == 1)
        if at == len(full.trials):
            assert r.chosen is not None and r.chosen.config == full.chosen.config
        text = headline(r)
        assert f"{at - 1} trials in" in text[-3] and "stopped early: interrupted" in text[-3]
        if at == 1:
            assert text[0] == "No configuration could be timed: interrupted first."
        else:  # what ran, not a recommendation ("Use ..."/"Keep ...")
            assert text[0].startswith(f"Fastest of the {at - 1} trial(s) that finished "
                                      "before the interrupt: ")


def test_a_ctrl_c_that_python_swallowed_still_ends_the_sweep_before_the_next_trial() -> None:
    """A Ctrl-C landing in a fork's after-fork hooks (a trial's loader workers starting) is
    printed as "Exception ignored" and its ``KeyboardInterrupt`` dropped: the trial finishes,
    and the sweep ends before the next one, with what finished (it went on to the end)."""
    import os
    import signal

    settings = TuneSettings(workers=(0,), max_batch=64, loader_options=False).check()
    space = BatchSpace.from_settings(settings, 1)
    f = Formula()

    def measure(c: Config, role: str) -> Trial:
        if len(f.calls) == 2:
            try:  # as Python does with an exception raised in an after-fork hook
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)  # the handler runs here
            except KeyboardInterrupt:
                pass
        return f(c, role)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TuneInterrupted) as caught:
        Sweep(measure, settings, space, current=Config(4)).run()
    assert len(caught.value.result.trials) == 3  # the third trial finished, no fourth began
    assert signal.getsignal(signal.SIGINT) is before


def test_a_fixed_global_batch_varies_the_split() -> None:
    f = Formula(compute=bent(16, 0.003))
    r = run(f, workers=(0,), global_batch=96, world=2, loader_options=False)
    for t in r.trials:
        assert t.config.batch_size * t.config.accumulation * 2 == 96
    assert batches(r, "coarse") == [1, 2, 4, 8, 16, 48]
    assert r.chosen is not None and r.chosen.config.batch_size in (12, 16, 24)


def test_the_current_setting_is_measured_first_and_the_gain_stated() -> None:
    f = Formula(compute=bent(32, 0.002))
    r = run(f, current=Config(4, 0), workers=(0,), loader_options=False)
    assert r.trials[0].role == "current" and r.current is r.trials[0]
    assert batches(r, "coarse")[:3] == [1, 2, 8]  # batch 4 was already measured
    assert r.speedup_pct is not None and r.speedup_pct > 50
    assert "against the current setting (batch 4, 0 workers" in headline(r)[0]


def test_loader_options_are_tried_at_the_chosen_batch() -> None:
    f = Formula(per_sample_load_s=0.01)  # the loader never keeps up
    settings = TuneSettings(workers=(0, 1), max_batch=8, refine_trials=0).check()
    sweep = Sweep(f, settings, BatchSpace.from_settings(settings), cuda=True, pin_memory=True)
    r = sweep.run()
    loader = [t.config for t in r.trials if t.role == "loader"]
    assert loader == [Config(2, 1, pin_memory=False), Config(2, 1, prefetch_factor=4)]
    assert r.chosen is not None and r.chosen.config.batch_size == 2  # loader-bound: a tie


def test_space() -> None:
    s = BatchSpace.from_settings(TuneSettings(max_batch=100).check())
    assert s.coarse() == [1, 2, 4, 8, 16, 32, 64]
    assert [s.between(16, 32), s.between(32, 64), s.between(8, 16), s.between(1, 2)] == [
        24, 48, None, None]
    listed = BatchSpace.from_settings(TuneSettings(batch_sizes=(8, 12, 16, 24, 32, 48)).check())
    assert listed.coarse() == [8, 16, 32, 48]
    assert listed.between(16, 32) == 24
    with pytest.raises(ValueError, match="not a multiple of the world size"):
        BatchSpace.from_settings(TuneSettings(global_batch=9).check(), world_size=2)
    with pytest.raises(ValueError, match="max_batch"):
        TuneSettings(min_batch=8, max_batch=4).check()
    assert workers_grid((0, 1, 2, 4, 8), 3) == (0, 1, 2)


def test_result_round_trips_and_renders() -> None:
    f = Formula(compute=bent(32, 0.002), per_sample_load_s=0.002, oom_at=128)
    r = run(f, current=Config(8, 0), workers=(0, 1, 2))
    r.device = "Test GPU"
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.to_dict() == r.to_dict()
    assert back.chosen is not None and back.chosen.config == r.chosen.config  # type: ignore[union-attr]
    md = render_markdown(r)
    assert "| # | why | batch | workers |" in md and "accum" not in md
    assert "(chosen)" in md and "out of memory" in md
    html = render_html(r)
    assert html.count('<svg class="chart"') == 3  # throughput, data wait, memory
    assert 'data-xscale="log2"' in html and "out of memory from 128" in html
    text = render_text(r)
    assert "samples/s by batch size" in text and "*" in text


def test_the_html_report_in_a_browser(tmp_path: Path) -> None:
    """The page's script runs; hovering the throughput chart reads out a batch size."""
    from tests.test_report import check_page_in_chromium

    f = Formula(compute=bent(32, 0.002), per_sample_load_s=0.0015, oom_at=128)
    r = run(f, current=Config(8, 0), workers=(0, 1, 2))
    html = render_html(r).replace("</body>", (
        "<script>var s=document.querySelector('#tune-throughput svg'),"
        "q=s.getBoundingClientRect();s.dispatchEvent(new MouseEvent('mousemove',"
        "{clientX:q.left+q.width*0.6,clientY:q.top+q.height/2,bubbles:true}));"
        "document.body.setAttribute('data-tip',document.getElementById('tip').textContent);"
        "</script></body>"))
    page = tmp_path / "tune.html"
    page.write_text(html)
    dom = check_page_in_chromium(page, tmp_path, min_charts=3)
    tip = re.search(r'<body data-tip="([^"]*)"', dom)
    assert tip, "the hover script did not run"
    lines = unescape(tip.group(1)).splitlines()
    assert re.fullmatch(r"batch size \d+", lines[0]), lines
    assert 1 <= int(lines[0].split()[-1]) <= 128
    assert any(line.startswith("2 workers: ") for line in lines), lines
    assert not any("out of memory" in line or "chosen" in line for line in lines), lines


def test_the_current_setting_can_be_the_answer() -> None:
    f = Formula(compute=bent(8, 0.01))
    r = run(f, current=Config(8, 0), workers=(0,), loader_options=False)
    assert r.chosen is r.current
    assert headline(r)[0].startswith("Keep the current setting, batch 8, 0 workers: ")


def test_a_trial_that_needed_allocator_retries_is_not_chosen_over_a_clean_one() -> None:
    """The H200 case: the fastest batch ran only with the allocator's retries (the memory edge)
    and ran out of memory when run again; the next size down ran clean and is chosen."""

    class Edge(Formula):
        def __call__(self, c: Config, role: str) -> Trial:
            t = super().__call__(c, role)
            if t.ok and c.batch_size >= 192:
                return dataclasses.replace(t, alloc_retries=1)
            return dataclasses.replace(t, alloc_retries=0) if t.ok else t

    r = run(Edge(oom_at=256), workers=(0,), loader_options=False,
            batch_sizes=(32, 64, 96, 128, 192, 256))
    fastest = max((t for t in r.trials if t.ok), key=lambda t: t.throughput)
    assert fastest.config.batch_size == 192 and fastest.alloc_retries == 1
    assert r.chosen is not None and r.chosen.config.batch_size == 128
    assert any("batch 192 ran faster only with the allocator's retries" in n for n in r.notes)


def test_with_retries_everywhere_the_fastest_is_still_chosen() -> None:
    class AllEdge(Formula):
        def __call__(self, c: Config, role: str) -> Trial:
            t = super().__call__(c, role)
            return dataclasses.replace(t, alloc_retries=2) if t.ok else t

    r = run(AllEdge(oom_at=256), workers=(0,), loader_options=False,
            batch_sizes=(32, 64, 128, 192, 256))
    assert r.chosen is not None and r.chosen.config.batch_size == 192
