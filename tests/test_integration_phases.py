"""``StepPhases``: the step anatomy behind ``perf/data_wait_pct`` and friends."""

from __future__ import annotations

import time

import pytest

from gpulens.integrations.phases import StepPhases


def one_step(phases: StepPhases, wait: float, fb: float, opt: float | None) -> None:
    time.sleep(wait)
    phases.step_begin()
    time.sleep(fb)
    if opt is not None:
        phases.before_optimizer()
        time.sleep(opt)
    phases.step_end()


def test_host_clock_splits_a_step_into_its_phases() -> None:
    phases = StepPhases(cuda=False)
    phases.resume()
    for _ in range(2):
        one_step(phases, wait=0.04, fb=0.01, opt=0.01)
    out = phases.collect(steps=2)
    assert out["perf/data_wait_s"] >= 0.04
    assert out["perf/forward_backward_s"] >= 0.01
    assert out["perf/optimizer_s"] >= 0.01
    assert out["perf/data_wait_pct"] > out["perf/optimizer_pct"]
    total = sum(out[f"perf/{p}_pct"] for p in ("data_wait", "forward_backward", "optimizer"))
    assert total == pytest.approx(100.0)
    assert phases.collect(steps=2) == {}  # nothing new: absent, never zeros


def test_resume_leaves_logging_and_evaluation_out() -> None:
    phases = StepPhases(cuda=False)
    phases.resume()
    one_step(phases, wait=0.0, fb=0.005, opt=0.0)
    time.sleep(0.5)  # logging / evaluation after the step
    phases.resume()
    one_step(phases, wait=0.0, fb=0.005, opt=0.0)
    out = phases.collect(steps=2)
    # the 0.5 s between the steps is left out (the bound leaves room for a loaded machine)
    assert out["perf/data_wait_s"] < 0.25


def test_step_without_optimizer_mark_counts_as_forward_backward() -> None:
    phases = StepPhases(cuda=False)
    phases.resume()
    one_step(phases, wait=0.0, fb=0.01, opt=None)  # a gradient-accumulation micro-batch
    out = phases.collect(steps=1)
    assert "perf/optimizer_pct" not in out
    assert out["perf/forward_backward_s"] >= 0.01


class FakeGpu:
    """A device timeline: events complete once ``now`` passes the time they were reached."""

    def __init__(self) -> None:
        self.now = 0.0  # seconds the device has executed
        self.queued = 0.0  # where the next recorded event lands on its timeline

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """record/query/elapsed_time like ``torch.cuda.Event``; no ``synchronize``: calling it fails."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.gpu.queued

    def query(self) -> bool:
        return self.at is not None and self.at <= self.gpu.now

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event not yet completed"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


def test_device_events_are_read_only_once_completed() -> None:
    gpu = FakeGpu()
    phases = StepPhases(cuda=True, event_factory=gpu.event)
    phases.resume()
    gpu.queued = 0.2  # the device sat idle 0.2 s waiting for the batch
    phases.step_begin()
    gpu.queued = 0.5
    phases.before_optimizer()
    gpu.queued = 0.6
    phases.step_end()
    gpu.now = 0.3  # the device is still in the backward pass
    first = phases.collect(steps=1)
    assert set(first) == {"perf/data_wait_pct", "perf/data_wait_s"}
    assert first["perf/data_wait_s"] == pytest.approx(0.2)
    gpu.now = 1.0
    later = phases.collect(steps=1)  # the rest is counted in the next window
    assert later["perf/forward_backward_s"] == pytest.approx(0.3)
    assert later["perf/optimizer_s"] == pytest.approx(0.1)
    assert "perf/data_wait_s" not in later


def test_device_clock_sees_no_wait_while_the_host_runs_ahead() -> None:
    gpu = FakeGpu()
    phases = StepPhases(cuda=True, event_factory=gpu.event)
    phases.resume()
    for step in range(3):  # the host fetches while the device is busy: no gap on its timeline
        phases.step_begin()
        gpu.queued += 0.1
        phases.before_optimizer()
        gpu.queued += 0.02
        phases.step_end()
        time.sleep(0.01 * (step + 1))
    gpu.now = gpu.queued
    out = phases.collect(steps=3)
    assert out["perf/data_wait_pct"] == pytest.approx(0.0)
    assert out["perf/forward_backward_s"] == pytest.approx(0.1)


def test_device_events_are_recorded_again_once_read() -> None:
    """No event is made per mark once a few steps have run: read events are reused, and the
    figures stay those of a fresh event per mark."""
    gpu = FakeGpu()
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        made.append(gpu.event())
        return made[-1]

    phases = StepPhases(cuda=True, event_factory=factory)
    phases.resume()
    for _ in range(50):
        gpu.queued += 0.01  # waiting for data
        phases.step_begin()
        gpu.queued += 0.03
        phases.before_optimizer()
        gpu.queued += 0.01
        phases.step_end()
        gpu.now = gpu.queued
        out = phases.collect(steps=1)
        assert out["perf/data_wait_s"] == pytest.approx(0.01)
        assert out["perf/forward_backward_s"] == pytest.approx(0.03)
        assert out["perf/optimizer_s"] == pytest.approx(0.01)
        phases.resume()
    assert len(made) <= 8  # 200 marks


def test_stream_lookup_builds_a_stream_only_for_a_stream_it_has_not_seen() -> None:
    """The marks' current stream: built once per torch stream (a C call's key), again only
    when the current stream changed, and the kept ones bounded."""
    from gpulens.integrations.phases import stream_lookup

    current = ["default"]
    built: list[str] = []

    def build() -> object:
        built.append(current[0])
        return ("Stream", current[0])

    lookup = stream_lookup(lambda: current[0], build, keep=2)
    assert [lookup() for _ in range(3)] == [("Stream", "default")] * 3 and built == ["default"]
    current[0] = "side"  # inside a torch.cuda.stream(...) context
    assert lookup() == ("Stream", "side")
    current[0] = "default"
    assert lookup() == ("Stream", "default") and built == ["default", "side"]
    current[0] = "third"  # a third stream: the kept ones are dropped, not grown
    lookup()
    current[0] = "default"
    lookup()
    assert built == ["default", "side", "third", "default"]


def test_events_of_another_kind_are_recorded_without_a_stream() -> None:
    """An ``event_factory``'s events (another accelerator's) get ``record()``, as before: only
    torch's own CUDA events are given the looked-up stream."""
    recorded: list[tuple[object, ...]] = []

    class Event:
        def record(self, *args: object) -> None:
            recorded.append(args)

        def query(self) -> bool:
            return True

        def elapsed_time(self, end: Event) -> float:
            return 1.0

    phases = StepPhases(cuda=True, event_factory=Event)
    phases.step_begin()
    phases.step_end()
    assert recorded == [(), ()] and phases._stream is None


@pytest.mark.parametrize("private", ["agrees", "raises", "missing"])
def test_the_marks_stream_comes_from_torchs_c_calls_only_where_they_agree_with_torch(
        monkeypatch: pytest.MonkeyPatch, private: str) -> None:
    """``current_stream_lookup`` reads torch's private C calls: used only when they give what
    ``torch.cuda.current_stream()`` gives (checked once); otherwise ``None`` (``record()``
    looks the stream up itself), never an error."""
    import torch

    from gpulens.integrations import phases

    public: list[int] = []

    def current_stream() -> tuple[str, int]:
        public.append(1)
        return ("stream", 7)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    if private == "missing":
        monkeypatch.delattr(torch._C, "_cuda_getCurrentStream", raising=False)
    else:
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)

        def get_stream(device: int) -> tuple[int, int, int]:
            if private == "raises":
                raise RuntimeError("another torch")
            return (7, device, 1)

        monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", get_stream, raising=False)
    lookup = phases.current_stream_lookup()
    if private != "agrees":
        assert lookup is None
        return
    assert lookup is not None
    calls = len(public)
    assert [lookup() for _ in range(5)] == [("stream", 7)] * 5
    assert len(public) == calls  # no Stream built per mark: the one seen is kept
