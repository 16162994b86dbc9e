"""The lifecycle the framework callbacks share (gpulens.integrations.session): one row per log
with phases and work, one stop, a finalizer without a reference cycle; the step gate of the
loop-fed integrations; and the callbacks' work and logged metrics on their cheap paths."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gpulens
from gpulens.integrations.phases import StepPhases
from gpulens.integrations.session import GateAction, StepGate, TrainingSession
from gpulens.log import reset_warnings
from gpulens.model import Outcome
from gpulens.testing import MemorySink, SimulatedNVML
from tests.support.jsonl import read_rows


class Work:
    """A work source that says what it was asked."""

    def __init__(self) -> None:
        self.takes = 0
        self.closed = 0

    def take_deferred(self) -> dict[str, Any]:
        self.takes += 1
        return {"tokens": 100}

    def settle(self) -> None:
        return None

    def cut(self) -> Work:
        return self

    def close(self) -> None:
        self.closed += 1


class StopSpy:
    """Records every ``Monitor.stop`` call's ``collective`` and ``outcome``."""

    def __init__(self, monitor: gpulens.Monitor) -> None:
        self.calls: list[tuple[bool, str]] = []
        real = monitor.stop

        def stop(timeout: float | None = None, *, collective: bool = True,
                 outcome: Outcome = "finished") -> Any:
            self.calls.append((collective, outcome))
            return real(timeout, collective=collective, outcome=outcome)

        monitor.stop = stop  # type: ignore[method-assign]


def monitor(sink: MemorySink) -> gpulens.Monitor:
    return gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
                           isolation="thread")


def steps_written(mon: gpulens.Monitor) -> list[int]:
    """The steps of the rows the session hands ``mon`` (``log_at``), in order, as they are
    handed (a sink sees them later, from another thread)."""
    written: list[int] = []
    real = mon.log_at

    def log_at(at: Any, step: int, **values: Any) -> None:
        written.append(step)
        real(at, step, **values)

    mon.log_at = log_at  # type: ignore[method-assign]
    return written


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Collection off: what is freed is freed by its reference count alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_row_per_log_with_phases_and_work_then_one_stop() -> None:
    sink, work = MemorySink(), Work()
    mon = monitor(sink)
    spy = StopSpy(mon)
    session = TrainingSession(mon, start_step=3, steps_done=3, phases=StepPhases(cuda=False),
                              work=work).start()
    assert session.running and mon.running
    for _ in range(2):
        session.step_begin()
        session.before_optimizer()
        session.step_end()
    assert session.steps_since_row(5) == 2
    session.row(5, 5, {"loss": 0.5})
    session.resume()
    session.stop()
    session.stop()  # idempotent
    assert spy.calls == [(True, "finished")] and work.closed == 1 and not session.running
    (row,) = sink.rows
    assert row.step == 5 and row.values["train/loss"] == 0.5
    assert row.values["perf/steps"] == 2  # the window began at the start step, 3
    assert {"perf/forward_backward_s", "perf/optimizer_s"} <= set(row.values)
    assert row.values["perf/tokens_per_s"] > 0 and work.takes == 1


def test_a_dropped_session_stops_its_monitor_alone_without_a_cycle(no_gc: None) -> None:
    class Callback:  # what holds a session: a framework callback
        session: TrainingSession | None = None

    sink, work = MemorySink(), Work()
    owner = Callback()
    mon = monitor(sink)
    spy = StopSpy(mon)
    owner.session = TrainingSession(mon, start_step=0, steps_done=0, work=work).start()
    owner.session.row(1, 1, {})
    alive = weakref.ref(owner)
    del owner
    assert alive() is None  # freed by its reference count: nothing points back at it
    # this rank alone: no gather; its training never reached the framework's end hook
    assert spy.calls == [(False, "failed")] and not mon.running
    assert work.closed == 1
    assert [r.step for r in sink.rows] == [1]


def test_a_start_that_fails_lets_go_of_the_work() -> None:
    class Broken(gpulens.Monitor):
        def start(self, step: int = 0) -> gpulens.Monitor:
            raise ValueError("no such sink")

    work = Work()
    session = TrainingSession(Broken(interval=0.1), start_step=0, steps_done=0, work=work)
    with pytest.raises(ValueError, match="no such sink"):
        session.start()
    assert work.closed == 1 and not session.running
    session.stop()  # nothing to stop
    assert work.closed == 1


def test_step_gate_starts_then_ends_one_window_per_new_step() -> None:
    gate = StepGate()
    seen = []
    started = False
    for step in (5, 5, 6, 6, 4, 8):
        action = gate.at(step, started=started)
        started = started or action is GateAction.START
        seen.append(action)
    assert seen == [GateAction.START, GateAction.PASS, GateAction.ROW, GateAction.PASS,
                    GateAction.PASS, GateAction.ROW]
    opened = StepGate()  # a window opened before the first call (start_step=)
    assert opened.at(7, started=True) is GateAction.ROW


def test_hf_rows_carry_the_masked_tokens_read_once_landed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny GPT-2 in a real Trainer with padded batches: each row's throughput is the real
    (unpadded) tokens of its window, from counts read only once they had reached the host
    (``DeferredCount.landed``): at a later ``log()`` on the training thread, without a wait."""
    transformers = pytest.importorskip("transformers")
    import threading

    from gpulens.integrations.transformers import GPUMonitorCallback
    from gpulens.work import hf

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    readers: list[str] = []
    real_item = hf.DeferredCount.item

    def item(self: Any) -> float:
        readers.append(threading.current_thread().name)
        assert self.landed(), "a count read before it reached the host"
        return real_item(self)

    monkeypatch.setattr(hf.DeferredCount, "item", item)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16,
                                     vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    real = 11  # tokens of every row; the other 5 are padding

    class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            mask = torch.tensor([1] * real + [0] * (16 - real))
            ids = torch.arange(16) % 64
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)}

    sink = tmp_path / "gpu.jsonl"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=2,
        per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
        save_strategy="no", dataloader_num_workers=0)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(),
        callbacks=[GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05)])
    trainer.train()
    rows = read_rows(sink)
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:  # 2 steps a window, each a batch of 4 rows
        window = row["perf/step_time_s"] * row["perf/steps"]
        assert row["perf/tokens_per_s"] * window == pytest.approx(2 * 4 * real)
        assert row["perf/tflops"] > 0
    assert readers and set(readers) == {threading.main_thread().name}  # no thread woken


@pytest.mark.filterwarnings(
    # Lightning 2.6.6 with torch 2.13: a deprecation inside Lightning's own pytree helper
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
    "ignore:The '.*dataloader' does not have many workers:UserWarning",
)
def test_lightning_reads_logged_metrics_only_for_extra_sinks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ``trainer.logged_metrics`` makes Lightning compute its results a second time;
    the loggers leave ``train/*`` out, so without extra sinks it is never read."""
    pl = pytest.importorskip("lightning.pytorch")
    from gpulens.integrations import _lightning_internals
    from gpulens.integrations.lightning import GPUMonitorCallback

    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    reads: list[int] = []
    real = _lightning_internals.logged_metrics

    def spy(trainer: Any) -> dict[str, Any]:
        reads.append(1)
        return real(trainer)

    monkeypatch.setattr(_lightning_internals, "logged_metrics", spy)

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.net(batch).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)

    def fit(callback: Any) -> Any:
        logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
        trainer = pl.Trainer(max_steps=4, log_every_n_steps=2, logger=logger,
                             callbacks=[callback], accelerator="cpu", devices=1,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=str(tmp_path))
        trainer.fit(Module())
        return logger

    logger = fit(GPUMonitorCallback(interval=0.05))
    assert not reads
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert "gpu/0/util_pct" in rows[0] and "train/" not in rows[0]
    sink = tmp_path / "gpu.jsonl"
    fit(GPUMonitorCallback(sinks=[f"jsonl:{sink}"], interval=0.05))
    assert len(reads) == 2  # one a row
    assert all("train/loss" in r for r in read_rows(sink))


class LogAtSpy:
    """Records every ``Monitor.log_at`` call: (at, step, keywords), and when it came."""

    def __init__(self, monitor: gpulens.Monitor) -> None:
        self.calls: list[tuple[Any, int, dict[str, Any], float]] = []
        real = monitor.log_at

        def log_at(at: Any, step: int, **kw: Any) -> None:
            self.calls.append((at, step, dict(kw), time.monotonic()))
            real(at, step, **kw)

        monitor.log_at = log_at  # type: ignore[method-assign]


def test_a_later_row_launches_nothing_at_the_log_and_is_written_at_the_next_mark() -> None:
    """Hugging Face's ``on_log`` comes just after a device sync: ``row(..., later=True)``
    launches no device operation and writes nothing there; the next step's optimizer mark
    writes it, its window ending at the log, with its own step's tokens and phases (not the
    next step's, which began in between)."""
    from gpulens.work.hf import TokenCounter
    from tests.test_integration_phases import FakeGpu
    from tests.test_work_hf import OpCount

    sink, counter = MemorySink(), TokenCounter(None)
    mon = monitor(sink)
    spy = LogAtSpy(mon)
    gpu = FakeGpu()  # a device timeline the test moves on: no sleeps make the phases
    gpu.now = float("inf")  # every mark's event has completed when it is read
    session = TrainingSession(mon, start_step=0, steps_done=0,
                              phases=StepPhases(cuda=True, event_factory=gpu.event),
                              work=counter).start()

    def step(real_tokens: int) -> None:
        session.step_begin()
        batch = {"input_ids": torch.ones((1, 9), dtype=torch.long),
                 "attention_mask": torch.tensor([[1] * real_tokens + [0] * (9 - real_tokens)])}
        with OpCount() as hook:
            counter.observe(batch)
        assert hook.ops == []  # the forward hook: just after a sync too
        gpu.queued += 0.02  # forward and backward
        session.before_optimizer()
        session.step_end()

    step(4)
    with OpCount() as at_log:
        session.row(1, 1, {"loss": 1.0}, later=True)
    logged = time.monotonic()
    session.resume()
    assert at_log.ops == [] and spy.calls == []
    gpu.queued += 0.3  # the next step's data wait: after the log, so not the row's
    step(7)
    (at, row_step, kw, written) = spy.calls[0]
    assert row_step == 1 and kw["loss"] == 1.0 and at[0] <= logged < written
    assert kw["tokens"].item() == 4
    assert kw["perf/data_wait_s"] == 0.0  # its own wait, not the next step's
    assert kw["perf/forward_backward_s"] == pytest.approx(0.02)
    session.row(2, 2, {"loss": 0.5}, later=True)
    session.stop()  # writes the held row first
    assert [c[1] for c in spy.calls] == [1, 2] and spy.calls[1][2]["tokens"].item() == 7
    assert spy.calls[1][2]["perf/data_wait_s"] == pytest.approx(0.3)
    assert [r.step for r in sink.rows] == [1, 2]


def test_a_held_row_is_written_when_the_session_is_dropped(no_gc: None) -> None:
    sink = MemorySink()
    session: TrainingSession | None = TrainingSession(monitor(sink), start_step=0,
                                                      steps_done=0).start()
    assert session is not None
    session.row(1, 1, {"loss": 2.0}, later=True)
    session = None  # dropped without stop(): its finalizer writes the held row
    assert [r.step for r in sink.rows] == [1] and sink.rows[0].values["train/loss"] == 2.0


def test_a_session_dropped_while_its_model_lives_on_is_stopped_and_unhooked(
        no_gc: None) -> None:
    """The forward hook on the model holds the session weakly: a notebook that keeps its model
    and drops the callback (and with it the session) still gets the held row written, the
    monitor stopped and the hook removed, by reference counting alone."""
    sink = MemorySink()
    model = torch.nn.Linear(2, 2)
    mon = monitor(sink)
    session: TrainingSession | None = TrainingSession(mon, start_step=0, steps_done=0,
                                                      model=model).start()
    assert session is not None and len(model._forward_hooks) == 1
    session.row(1, 1, {"loss": 2.0}, later=True)
    ref = weakref.ref(session)
    session = None
    assert ref() is None
    assert [r.step for r in sink.rows] == [1] and not model._forward_hooks
    assert mon._stopped
    model(torch.ones(1, 2))  # the model trains on, hook-free


def test_a_held_row_is_written_after_the_next_training_forward_not_at_a_mark() -> None:
    """With a model the session writes a held row (and settles the kept masks) after the next
    training forward, where its kernels are queued; the marks after it find nothing to do.
    An evaluation forward writes nothing. The hook is removed at stop."""
    from gpulens.work.hf import TokenCounter

    sink = MemorySink()
    model = torch.nn.Linear(2, 2)
    counter = TokenCounter(None)
    mon = monitor(sink)
    written = steps_written(mon)
    session = TrainingSession(mon, start_step=0, steps_done=0, work=counter,
                              model=model).start()
    session.row(1, 1, {"loss": 1.0}, later=True)
    model.eval()
    model(torch.ones(1, 2))
    assert written == []
    model.train()
    counter.observe({"input_ids": torch.ones((1, 4), dtype=torch.long),
                     "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    model(torch.ones(1, 2))
    assert written == [1] and counter._raw == [] and len(counter._lengths) == 1  # settled
    session.before_optimizer()
    session.step_end()
    assert written == [1]
    session.row(2, 2, {"loss": 0.5}, later=True)
    replica = threading.Thread(target=model, args=(torch.ones(1, 2),))  # nn.DataParallel's
    replica.start()
    replica.join()
    assert written == [1]  # not from another thread: the session is not thread-safe
    session.step_end()
    assert written == [1, 2]  # the mark wrote it
    session.stop()
    assert not model._forward_hooks
    assert [r.step for r in sink.rows] == [1, 2]


def test_a_row_that_cannot_be_written_later_is_said_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    mon = monitor(MemorySink())
    session = TrainingSession(mon, start_step=0, steps_done=0).start()
    session.row(1, 1, {"loss": 1.0}, later=True)

    def broken(*args: Any, **kw: Any) -> None:
        raise OSError("disk gone")

    mon.log_at = broken  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="gpulens"):
        session.before_optimizer()  # training goes on
    session.stop()
    assert session.dropped_rows == 1 and "disk gone" in caplog.text


def test_micro_batches_are_settled_as_they_end_so_masks_do_not_pile_up() -> None:
    """Under gradient accumulation each micro-batch's end settles its mask (one device
    operation, the device busy): the counter never keeps more than one micro-batch's mask."""
    from gpulens.work.hf import TokenCounter

    counter = TokenCounter(None)
    session = TrainingSession(monitor(MemorySink()), start_step=0, steps_done=0,
                              work=counter).start()
    kept = []
    for n in (2, 5, 7, 9):
        counter.observe({"input_ids": torch.ones((1, 9), dtype=torch.long),
                         "attention_mask": torch.tensor([[1] * n + [0] * (9 - n)])})
        kept.append(len(counter._raw))
        session.micro_step_end()
    assert kept == [1, 1, 1, 1] and counter._raw == []
    assert counter.take_deferred()["tokens"].item() == 2 + 5 + 7 + 9
    session.stop()


def test_a_model_that_takes_no_hook_leaves_the_work_to_the_marks(
        caplog: pytest.LogCaptureFixture) -> None:
    reset_warnings()
    class NoHooks(torch.nn.Linear):
        def register_forward_hook(self, *args: Any, **kw: Any) -> Any:
            raise RuntimeError("a scripted module takes no hooks")

    mon = monitor(MemorySink())
    written = steps_written(mon)
    with caplog.at_level("WARNING", logger="gpulens"):
        session = TrainingSession(mon, start_step=0, steps_done=0,
                                  model=NoHooks(2, 2)).start()
    assert "cannot hook the model's forward" in caplog.text
    session.row(1, 1, {"loss": 1.0}, later=True)
    session.before_optimizer()
    assert written == [1]
    session.stop()


def test_a_fault_after_a_forward_is_said_once_and_training_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    reset_warnings()
    mon = monitor(MemorySink())
    model = torch.nn.Linear(2, 2)
    session = TrainingSession(mon, start_step=0, steps_done=0, model=model).start()

    def broken() -> None:
        raise OSError("pipe gone")

    session._busy_device = broken  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="gpulens"):
        for _ in range(3):
            assert model(torch.ones(1, 2)).shape == (1, 2)  # the forward's output, untouched
    assert caplog.text.count("pipe gone") == 1
    session.stop()
