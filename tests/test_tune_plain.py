"""``gpulens.tune.tune`` end to end on a CPU: real steps of a tiny model whose costs are set by
the test (:mod:`tests.support.tune_load`): the worker count where the data wait falls under
5 %, the best batch size where a larger one is slower, an out-of-memory error survived."""

from __future__ import annotations

import io
import re

import pytest
import torch

from gpulens.tune import Config, print_report, render_html, tune
from tests.support.tune_load import (
    ControlledStep,
    SlowSamples,
    make_loader,
    make_loader_factory,
)

# Step: 70 ms + 1 ms/sample up to 32 samples, 3 ms/sample beyond (batch 64 is a fifth slower
# per sample than 32); out of memory from 96. Loader: 4.5 ms/sample, so one worker keeps up
# with batch 8 (36 ms < 78 ms), not with 32 (144 ms > 102 ms); two do (72 ms). Margins of
# ~30 %, one sleep per step or batch, batches that cross from workers by value: they hold on
# a loaded two-core machine, where the main process (which needs the CPU) is slowed and the
# sleeping loader is not. Eight timed steps, not three: a warm-up step slowed by the machine lets
# one worker's prefetch queue fill, and a window as short as that queue lasts reads no wait
# (benchmarks/tune_prefetch_lead.py). At batch 32 with one worker this sweep read 28.7 % with
# eight steps, 15.1 % with eight after a warm-up 0.5 s slower, 9.4 % with six after that one.
STEP = {"fixed_s": 0.07, "per_sample_s": 0.001, "knee": 32, "slow_per_sample_s": 0.003}
LOAD_S = 0.0045
SIZES = (8, 16, 32, 64, 96)


def test_workers_batch_size_and_an_out_of_memory_trial() -> None:
    step = ControlledStep(**STEP, oom_at=96)  # type: ignore[arg-type]
    loader = make_loader(SlowSamples(per_sample_s=LOAD_S), batch_size=8)
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    err = io.StringIO()
    result = tune(loader, step, model=step.model, optimizer=step.optimizer,
                  batch_sizes=SIZES, workers=(0, 1, 2, 4), warmup_steps=1, steps=8,
                  progress=False)
    chosen = result.chosen
    seen = [(t.config.batch_size, t.config.num_workers, t.data_wait_pct, t.samples_per_s)
            for t in result.trials]
    # batch size and workers; the loader's own options at that size (prefetch, pinning) are a
    # refinement whose win is within noise here (a loaded run chose prefetch_factor 4)
    assert chosen is not None, seen
    assert (chosen.config.batch_size, chosen.config.num_workers) == (32, 2), seen
    # the worker sweep: one worker fell short somewhere, two brought the wait under 5 %, and
    # it stopped there (no trial with more workers at the chosen batch size)
    short = [t for t in result.trials if t.config.num_workers == 1 and t.ok
             and t.data_wait_pct is not None and t.data_wait_pct >= 5]
    assert short, seen
    assert any(t.config == Config(short[0].config.batch_size, 2) for t in result.trials)
    assert chosen.data_wait_pct is not None and chosen.data_wait_pct < 5
    assert not [t for t in result.trials if t.config.num_workers > 2]
    # the workers' own pace: a worker's time per batch is at least its sleep for one batch
    # (4.5 ms a sample); no pace without workers
    for t in (t for t in result.trials if t.ok):
        if t.config.num_workers == 0:
            assert t.loader_batch_s is None and t.data_wait_by is None
        else:
            assert t.data_wait_by in ("window", "loader pace"), seen
            assert t.loader_batch_s is not None, seen
            assert t.loader_batch_s >= LOAD_S * t.config.batch_size, seen
    # a larger batch is slower, and was measured so
    at64 = result.best_at(64)
    assert at64 is not None and at64.throughput < chosen.throughput
    # the out-of-memory trial is data; the sweep went on and the step ran again after it
    oom = [t for t in result.trials if t.status == "oom"]
    assert [t.config.batch_size for t in oom] == [96] and result.oom_batch == 96
    assert "OutOfMemoryError" in (oom[0].error or "")
    assert step.batches.index(96) < len(step.batches) - 1
    assert result.confirm is not None and result.confirm.ok
    assert step.held and all(ref() is None for ref in step.held)  # the frames were released
    # the current setting (the DataLoader's: batch 8, no workers) came first
    assert result.current is result.trials[0] and result.current.config == Config(8, 0)
    assert result.speedup_pct is not None and result.speedup_pct > 0
    # every trial reports its phases, none GPU memory (a CPU)
    for t in (t for t in result.trials if t.ok):
        assert t.forward_backward_pct is not None and t.optimizer_pct is not None
        assert t.peak_reserved_gb is None and t.mfu_pct is None and t.tokens_per_s is None
    # the weights are back as they were
    for k, v in step.model.state_dict().items():
        assert torch.equal(v, before[k])
    print_report(result, file=err)
    text = err.getvalue()
    assert re.search(r"Use batch 32, 2 workers: \S+ samples/s, \+\d", text)
    assert "Out of memory from batch 96" in text
    assert render_html(result).count('<svg class="chart"') == 2  # no memory chart on a CPU


def test_a_fixed_global_batch_accumulates(capsys: pytest.CaptureFixture[str]) -> None:
    step = ControlledStep(**STEP, accumulate=True)  # type: ignore[arg-type]
    result = tune(make_loader_factory(SlowSamples(n=1024)), step,
                  optimizer_step=step.optimizer_step, global_batch=64, min_batch=16,
                  workers=(0,), warmup_steps=1, steps=3, current=(64, 0))
    assert {(t.config.batch_size, t.config.accumulation) for t in result.trials} == {
        (16, 4), (32, 2), (64, 1)}
    assert result.chosen is not None and result.chosen.config == Config(32, 0, accumulation=2)
    # each optimizer step follows batch x accumulation = 64 samples of forward+backward
    groups = ",".join(step.events).split(",o")
    assert groups[-1] == ""
    for group in groups[:-1]:
        sizes = [int(f[1:]) for f in group.strip(",").split(",")]
        assert len(set(sizes)) == 1 and sum(sizes) == 64, group
    # the progress display: one line per trial on stderr
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gpulens tune")]
    assert len(lines) == len(result.trials) and "left" in lines[-1]


def test_user_errors_are_one_line() -> None:
    step = ControlledStep()
    with pytest.raises(ValueError, match="global_batch accumulates gradients"):
        tune(make_loader_factory(SlowSamples(n=64)), step, global_batch=64, progress=False)
    with pytest.raises(ValueError, match="must take a batch_size"):
        tune(lambda n: [], step, progress=False)
    with pytest.raises(TypeError, match="unknown setting"):
        tune(make_loader_factory(SlowSamples(n=64)), step, budget=3, progress=False)


def test_an_error_that_is_not_out_of_memory_propagates() -> None:
    def broken(batch: object) -> None:
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        tune(make_loader_factory(SlowSamples(n=64)), broken, workers=(0,), progress=False)


def test_the_random_generators_are_put_back() -> None:
    """The trials' loaders share the user's loader's generator (and draw worker seeds and
    shuffles from torch's global one): a seeded training tuned first must see the data order
    it would have seen untuned."""
    import random

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    generator = torch.Generator().manual_seed(7)
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=generator)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(3)
    random.seed(3)
    before = (generator.get_state(), torch.get_rng_state(), random.getstate())
    order = [b[0] for b in DataLoader(data, batch_size=8, shuffle=True,
                                      generator=torch.Generator().manual_seed(7))]
    tune(loader, step, model=model, optimizer=optimizer, batch_sizes=(8, 16), workers=(0,),
         warmup_steps=1, steps=2, loader_options=False, confirm=False, progress=False)
    assert torch.equal(generator.get_state(), before[0])
    assert torch.equal(torch.get_rng_state(), before[1]) and random.getstate() == before[2]
    assert all(torch.equal(a, b[0]) for a, b in zip(order, loader, strict=True))


def test_cuda_generators_the_trials_started_are_put_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA started in the trials (the model still on the CPU, the step moving the work to the
    GPU): there was no CUDA state to save before, and the generators must be back where they
    started, as the training would find them had it started CUDA itself. Without a GPU: CUDA's
    start is played by the step, with CPU generators as the devices' (seeded as a
    ``torch.manual_seed`` queued before CUDA starts seeds them)."""
    seeds = (11, 12)
    devices: list[torch.Generator] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(devices))
    monkeypatch.setattr(torch.cuda, "default_generators", ())

    def get_rng_state_all() -> list[torch.Tensor]:
        raise AssertionError("no CUDA state to read before CUDA started")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_rng_state_all)
    model = torch.nn.Linear(4, 1)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not devices:  # the first step starts "CUDA"
            devices.extend(torch.Generator().manual_seed(s) for s in seeds)
            monkeypatch.setattr(torch.cuda, "default_generators", tuple(devices))
        for gen in devices:  # dropout on each device
            torch.rand(8, generator=gen)
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    tune(torch.utils.data.DataLoader(data, batch_size=8), step, model=model,
         batch_sizes=(8, 16), workers=(0,), warmup_steps=1, steps=2, loader_options=False,
         confirm=False, progress=False)
    assert len(devices) == 2
    for gen, seed in zip(devices, seeds, strict=True):
        fresh = torch.Generator().manual_seed(seed)
        assert torch.equal(torch.rand(8, generator=gen), torch.rand(8, generator=fresh))
