"""The W&B run handed from the training process to the engine process (``sinks/wandb_run``)."""

from __future__ import annotations

import pickle
import sys
import threading
import time
import types
from typing import Any

import pytest

from gpulens.sinks import sink_spec
from gpulens.sinks.wandb import WandbSink
from gpulens.sinks.wandb_run import SERVICE_ENV, RunGone, RunHandle, ask_step


class PicklableRun:
    """Stands in for a ``wandb.Run``: it pickles (to what W&B's own would: an attach id)."""

    def __init__(self, attach_id: str = "abc123") -> None:
        self.attach_id = attach_id


def test_handle_gives_the_run_itself_where_it_was_made() -> None:
    run = PicklableRun()
    handle = RunHandle(run)
    assert handle.resolve() == (run, False)


def test_handle_crosses_as_bytes_and_attaches_with_the_service_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVICE_ENV, "3-1-unix-/tmp/wandb-socket")
    handle = RunHandle(PicklableRun("xyz"))
    monkeypatch.delenv(SERVICE_ENV)  # an engine spawned before wandb.init had none
    copy = pickle.loads(pickle.dumps(handle))
    assert repr(copy) == "RunHandle(to attach)"
    run, attached = copy.resolve()
    assert attached and isinstance(run, PicklableRun) and run.attach_id == "xyz"
    import os

    assert os.environ[SERVICE_ENV] == "3-1-unix-/tmp/wandb-socket"


def test_a_run_that_cannot_cross_is_a_one_line_error() -> None:
    class Unpicklable:
        lock = threading.Lock()

        def __reduce__(self) -> Any:
            raise TypeError("cannot pickle '_thread.lock' object")

    with pytest.raises(ValueError, match=r"pass WandbSink\(run=\.\.\.\)") as info:
        sink_spec("wandb", run=Unpicklable())
    assert "\n" not in str(info.value)


def test_spec_with_a_run_holds_a_handle() -> None:
    spec = sink_spec("wandb", run=PicklableRun(), include_train=False)
    assert isinstance(spec.options["run"], RunHandle)
    assert spec.where == "engine"


def test_prepare_hands_over_the_active_run(monkeypatch: pytest.MonkeyPatch) -> None:
    active = PicklableRun("active")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=active))
    prepared = sink_spec("wandb").prepared()
    handle = prepared.options["run"]
    assert isinstance(handle, RunHandle) and handle.resolve() == (active, False)


class Answer:
    def __init__(self, step: int | None) -> None:
        self.step = step

    def wait_or(self, timeout: float) -> Any:
        if self.step is None:
            raise TimeoutError("no answer")
        return self


class Interface:
    def __init__(self, step: int | None) -> None:
        self.step = step
        self.asked = 0

    def deliver_history_step(self) -> Answer:
        self.asked += 1
        return Answer(self.step)


def test_ask_step_waits_a_bounded_time() -> None:
    run = types.SimpleNamespace(_interface=Interface(7))
    assert ask_step(run) == 7
    gone = types.SimpleNamespace(_interface=Interface(None))
    with pytest.raises(RunGone, match="did not answer within 5 s"):
        ask_step(gone)
    plain = types.SimpleNamespace(step=3)  # a wandb without the request: run.step
    assert ask_step(plain) == 3


class AttachedRun:
    """An attached run whose service stops answering after ``answers`` questions."""

    def __init__(self, answers: int) -> None:
        self.logged: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.answers = answers
        self.step_now = 0
        self._interface = self

    def deliver_history_step(self) -> Answer:
        self.answers -= 1
        return Answer(self.step_now if self.answers >= 0 else None)

    def log(self, data: dict[str, Any], **kwargs: Any) -> None:
        self.logged.append((data, kwargs))
        if kwargs.get("commit"):
            self.step_now += 1


def _attached_sink(run: AttachedRun) -> WandbSink:
    sink = WandbSink(run=run)
    sink._attached = True
    sink._defined = {}
    return sink


def test_an_attached_run_gone_is_told_once_and_its_rows_fail(
        caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.model import Row

    run = AttachedRun(answers=2)
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    row = Row(step=1, time=0.0, values={"gpu/0/util_pct": 50.0})
    sink.write(row)  # asks twice: where to place it, then which record holds it
    assert [(d["gpulens/step"], kw) for d, kw in run.logged] == [(1.0, {"commit": False})]
    with caplog.at_level("WARNING", logger="gpulens"), pytest.raises(RunGone):
        sink.write(Row(step=2, time=0.1, values={"gpu/0/util_pct": 60.0}))
    with pytest.raises(RunGone):  # at once, no second wait
        sink.write(Row(step=3, time=0.2, values={"gpu/0/util_pct": 70.0}))
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "W&B did not answer" in told[0] and "later rows" in told[0]
    sink.close()  # nothing more is asked of a run that is gone
    assert run.answers < 0


def test_an_attached_run_commits_its_own_record_without_step() -> None:
    """From a second process W&B warns about ``step=``: a record of its own is committed by
    an empty ``commit=True`` log, and the row joins the next record."""
    from gpulens.model import Row

    run = AttachedRun(answers=100)
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    sink.write(Row(step=1, time=0.0, values={"gpu/0/util_pct": 50.0}))
    sink.write(Row(step=2, time=0.1, values={"gpu/0/util_pct": 60.0}))
    sink.close()
    assert all("step" not in kwargs for _, kwargs in run.logged)
    assert ({}, {"commit": True}) in run.logged
    steps = [d["gpulens/step"] for d, _ in run.logged if d]
    assert steps == [1.0, 2.0]


def test_the_placer_asks_twice_per_period_of_the_users_logs() -> None:
    """While rows wait, an attached sink asks W&B's step at half the period it has seen the
    step move at (the user's logs free a record each), within 20 ms and 0.2 s."""
    sink = _attached_sink(AttachedRun(answers=100))
    assert sink._poll_interval() == 0.02  # nothing seen yet
    for i in range(5):
        sink._steps_seen.append((10.0 + 0.11 * i, 7 + i))  # a user logging every 110 ms
    assert sink._poll_interval() == pytest.approx(0.055)
    sink._steps_seen.clear()
    sink._steps_seen.extend([(0.0, 1), (0.01, 2)])  # faster than 40 ms: 20 ms
    assert sink._poll_interval() == 0.02
    sink._steps_seen.clear()
    sink._steps_seen.extend([(0.0, 1), (3.0, 2)])  # once in 3 s: at most 0.2 s
    assert sink._poll_interval() == 0.2


class UserLoggingRun(AttachedRun):
    """An attached run whose user commits a record whenever the test says (``commit()``);
    each row logged records the W&B step it joined."""

    def __init__(self) -> None:
        super().__init__(answers=10_000)
        self.lock = threading.Condition()
        self.joined: list[tuple[float, int]] = []  # (gpulens/step, the record's step)

    def commit(self) -> None:
        with self.lock:
            self.step_now += 1

    def deliver_history_step(self) -> Answer:
        with self.lock:
            return Answer(self.step_now)

    def log(self, data: dict[str, Any], **kwargs: Any) -> None:
        with self.lock:
            if kwargs.get("commit"):
                self.step_now += 1
            elif data:
                self.joined.append((data["gpulens/step"], self.step_now))
                self.lock.notify_all()

    def wait_joined(self, n: int, timeout: float) -> bool:
        """Until ``n`` rows have joined records (False if ``timeout`` passed first)."""
        with self.lock:
            return self.lock.wait_for(lambda: len(self.joined) >= n, timeout)


def test_the_placer_puts_waiting_rows_into_records_as_the_user_frees_them() -> None:
    """Four rows come at once (a burst) while the user's pending record holds a row already:
    they wait, and the placer gives each the next record the user's logs free, without a new
    row to wake it, one row a record.  Without the placer they would wait for ``close()``.
    The user logs without ``step=`` (W&B's step 100 is ahead of the training steps), so no
    record of the sink's own is safe."""
    from gpulens.model import Row

    run = UserLoggingRun()
    run.step_now = 100
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    sink._start_placer()
    try:
        sink.write(Row(step=1, time=0.0, values={"gpu/0/util_pct": 50.0}))  # joins record 0
        for step in range(2, 6):  # the burst: record 0 is taken, so they wait
            sink.write(Row(step=step, time=0.01 * step, values={"gpu/0/util_pct": 50.0}))
        assert len(run.joined) == 1 and len(sink._queue) == 4
        for n in range(2, 6):  # the user logs: a record frees up each time
            run.commit()
            assert run.wait_joined(n, timeout=10), run.joined
        assert run.joined == [(1.0, 100), (2.0, 101), (3.0, 102), (4.0, 103), (5.0, 104)]
        assert not sink._queue
    finally:
        sink.close()


class ServiceGoneRun(AttachedRun):
    """An attached run far ahead of the rows (W&B's step 100), whose service goes away at
    stop: from then on every log raises as wandb's does (``MailboxClosedError`` there)."""

    def __init__(self) -> None:
        super().__init__(answers=1000)
        self.step_now = 100
        self.gone = False

    def log(self, data: dict[str, Any], **kwargs: Any) -> None:
        if self.gone:
            raise ConnectionResetError("the service is gone")
        super().log(data, **kwargs)


def test_rows_waiting_for_a_record_when_the_service_goes_are_counted_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rows the sink took that wait for a W&B record (the run is ahead of them) and whose
    service ends at stop (a crash's exit, ``wandb.finish()`` first): they are counted in
    ``rows_lost``, which the step logger moves from written to dropped, and said once.
    Before, they were thrown away uncounted: "19 written, 1 dropped" with 5 in W&B."""
    from gpulens.log import reset_warnings
    from gpulens.model import Row
    from gpulens.sinks.writer import _Delivery

    reset_warnings()  # said once a process: another test may have said it
    run = ServiceGoneRun()
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    for step in (1, 2, 3, 4):
        sink.write(Row(step=step, time=float(step), values={"gpu/0/util_pct": 50.0}))
    assert [d["gpulens/step"] for d, _ in run.logged] == [1.0]  # three wait for a record
    run.gone = True
    with caplog.at_level("WARNING", logger="gpulens"), pytest.raises(RunGone):
        sink.close()
    assert sink.rows_lost == 3
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "3 GPU row(s) waiting for a W&B record are lost" in told[0]

    delivery = _Delivery(sink, "wandb", capacity=10)
    delivery.stats.written = 4
    delivery.count_lost()
    assert (delivery.stats.written, delivery.stats.dropped) == (1, 3)
    assert delivery.why is not None and "stopped answering" in delivery.why


class FinishedRun:
    """A run of this process (not attached) whose logs raise from the ``fail_from``-th on,
    as a finished run's do (W&B's ``UsageError``); its step as wandb mirrors it."""

    def __init__(self, fail_from: int) -> None:
        self.logged: list[dict[str, Any]] = []
        self.calls = 0
        self.fail_from = fail_from
        self._local_step = 0

    def log(self, data: dict[str, Any], **kwargs: Any) -> None:
        self.calls += 1
        if self.calls >= self.fail_from:
            raise RuntimeError("You must call wandb.init() before wandb.log()")
        self.logged.append(data)
        if kwargs.get("commit", True) and "step" not in kwargs:
            self._local_step += 1


def test_rows_a_finished_run_refuses_are_kept_once_and_counted_lost_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The run refuses rows 2 and 3 (finished under the sink): each stays queued once (the
    writer's retry used to queue it again), none is taken off the queue before W&B took it
    (they used to leave it before the call that raised: one short), and at stop the two are
    counted lost, once; the sink lets go of the finished run even though its close raised,
    and a sink opened again starts its count at zero."""
    from gpulens.log import reset_warnings
    from gpulens.model import Row

    reset_warnings()
    run = FinishedRun(fail_from=2)
    sink = WandbSink(run=run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    for step in (1, 2, 3):
        run._local_step += 1  # the user's own commits: a free record for each row
        sink.write(Row(step=step, time=float(step), values={"gpu/0/util_pct": 50.0}))
    assert [d["gpulens/step"] for d in run.logged] == [1.0]
    assert [d["gpulens/step"] for d in sink._queue] == [2.0, 3.0]
    with caplog.at_level("WARNING", logger="gpulens"), pytest.raises(RunGone):
        sink.close()
    assert sink.rows_lost == 2 and sink._run is None
    assert any("2 GPU row(s) waiting for a W&B record are lost" in r.getMessage()
               for r in caplog.records)
    sink._reset()  # what open() does first
    assert sink.rows_lost == 0


def test_a_run_that_keeps_refusing_rows_holds_a_bounded_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows a refusing run never takes wait at most ``MAX_QUEUE`` (2 here); older ones are
    counted lost as they go, so a long run into a dead W&B run holds bounded memory."""
    from gpulens.model import Row
    from gpulens.sinks import wandb as wandb_sink

    monkeypatch.setattr(wandb_sink, "MAX_QUEUE", 2)
    run = FinishedRun(fail_from=2)
    sink = WandbSink(run=run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    for step in range(1, 7):
        run._local_step += 1
        sink.write(Row(step=step, time=float(step), values={"gpu/0/util_pct": 50.0}))
    assert [d["gpulens/step"] for d in sink._queue] == [5.0, 6.0]
    assert sink.rows_lost == 3  # rows 2-4


def test_rows_overwritten_in_a_full_queue_are_counted_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows come while the user's records stay taken (W&B's step 100 ahead of them): beyond
    ``MAX_QUEUE`` (3 here) each row is logged over the one waiting in the pending record.
    Those overwritten are lost, counted in ``rows_lost`` (stop() then counts them dropped, not
    written: a run with 1507 of 2000 rows overwritten said "2000 written, 0 dropped"); a row
    the overflow puts into a record the user freed meanwhile is not."""
    from gpulens.model import Row
    from gpulens.sinks import wandb as wandb_sink

    monkeypatch.setattr(wandb_sink, "MAX_QUEUE", 3)
    run = UserLoggingRun()
    run.step_now = 100
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    for step in range(1, 7):  # row 1 joins record 100; 2-4 wait; 5 and 6 overwrite
        sink.write(Row(step=step, time=0.01 * step, values={"gpu/0/util_pct": 50.0}))
    assert run.joined == [(1.0, 100), (2.0, 100), (3.0, 100)]
    assert sink.rows_overwritten == 2 and sink.rows_lost == 2
    assert sink.lost_why is not None and "overwritten" in sink.lost_why
    run.commit()  # the user logs: record 101 is free, and the next overflow row takes it
    sink.write(Row(step=7, time=0.07, values={"gpu/0/util_pct": 50.0}))
    assert run.joined[-1] == (4.0, 101)
    assert sink.rows_lost == 2


class HangingRun(UserLoggingRun):
    """An attached run that stops answering once ``finished`` is set (the user's
    ``wandb.finish()``): a question then waits its timeout (W&B gives no answer) or until
    ``release`` is set (the test's end); ``hung`` is set once one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.finished = threading.Event()
        self.release = threading.Event()
        self.hung = threading.Event()

    def deliver_history_step(self) -> Answer:
        if not self.finished.is_set():
            return super().deliver_history_step()
        release, hung = self.release, self.hung

        class Hanging(Answer):
            def wait_or(self, timeout: float) -> Any:
                hung.set()
                release.wait(timeout)
                raise TimeoutError("no answer")

        return Hanging(None)


def test_rows_waiting_in_a_wandb_sink_given_up_at_stop_are_counted_dropped() -> None:
    """The user finished the run and the monitor stops with a short budget (the exit path
    without stop(): 2 s, below the 5 s the sink waits for W&B's answer): the sink is given
    up while its placer waits for that answer, and the rows waiting in it for a record never
    reach W&B.  They are counted dropped, with why; they used to count as written ("33
    written, 7 dropped (its time was up at stop)" with 23 rows in the run file)."""
    from gpulens.model import Row, RunContext
    from gpulens.sinks.writer import StepLogger

    run = HangingRun()
    run.step_now = 100
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    sink.open = lambda context: sink._start_placer()  # type: ignore[method-assign]
    writer = StepLogger([sink], names=["wandb"])
    writer.open(RunContext(gpus=(), hostname="h", backend="simulated", interval=0.05))
    try:
        for step in range(1, 6):  # row 1 joins record 100, rows 2-5 wait for records
            writer.submit(Row(step=step, time=0.01 * step, values={"gpu/0/util_pct": 50.0}))
        assert run.wait_joined(1, timeout=10)
        deadline = time.monotonic() + 10
        while len(sink._queue) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        run.finished.set()  # wandb.finish(): from now on W&B does not answer
        assert run.hung.wait(10)  # the placer waits for W&B's answer, holding the sink
        writer.submit(Row(step=6, time=0.06, values={"gpu/0/util_pct": 50.0}))
        stats = writer.close(timeout=1.0, stall=0.5)["wandb"]
    finally:
        run.release.set()
    assert len(run.joined) == 1
    assert (stats.written, stats.dropped) == (1, 5), stats


def test_rows_falling_behind_the_users_records_are_said_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that logs to W&B every step as fast as rows come: the rows waiting for records
    grow (2,408 rows behind at the end of a 3,000-step run of 6 ms steps, unsaid until an
    INFO at stop).  Past ``BEHIND_ROWS`` (3 here) it is a WARNING, once."""
    from gpulens.log import reset_warnings
    from gpulens.model import Row
    from gpulens.sinks import wandb as wandb_sink

    reset_warnings()
    monkeypatch.setattr(wandb_sink, "BEHIND_ROWS", 3)
    run = UserLoggingRun()
    run.step_now = 100
    sink = _attached_sink(run)
    sink._define = lambda data: None  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="gpulens"):
        for step in range(1, 8):
            sink.write(Row(step=step, time=0.01 * step, values={"gpu/0/util_pct": 50.0}))
    told = [r.getMessage() for r in caplog.records if "behind" in r.getMessage()]
    assert len(told) == 1 and "3 rows behind" in told[0] and "Monitor.log" in told[0], told
