"""The tracker view (issue 14 item 2), alerts in the trackers (issue 13) and the run's metadata
in W&B's config and MLflow's params (issue 14 item 4), read back from the trackers' stores: the
offline W&B run file and a real MLflow server on loopback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.model import Event, GpuInfo, Row, RunContext
from gpulens.sinks import resolve_sink, sink_spec
from gpulens.sinks.mlflow import MlflowSink
from gpulens.sinks.wandb import WandbSink
from gpulens.testing import MemorySink, SimulatedNVML
from tests.support.mlflow_server import MlflowTracking
from tests.support.wandb_reader import (
    read_alerts,
    read_config,
    read_history,
    read_metric_definitions,
    read_tags,
    wait_for_finished_run,
)

HEADLINE = {"train/gpu_sm_active_pct_mean", "train/gpu_util_pct_mean",
            "train/gpu_mem_used_gb_max", "train/gpu_power_w_mean", "train/energy_per_step_j",
            "train/step_time_s"}


def _train(mon: gpulens.Monitor, steps: int, dt: float = 0.05, **work: Any) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, learning_rate=0.1, grad_norm=3.0, **work)


def _row(gpus: int, step: int = 1, **extra: float) -> dict[str, float]:
    """A row as the engine finishes it: every per-GPU key, the job aggregates, perf, alerts."""
    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=gpus),
                         dtype="bf16", flops_per_token=6e9, isolation="thread") as mon:
        _train(mon, 2, tokens=4096)
    values = dict(sink.rows[-1].values)
    values.update(extra)
    return values


# -- the key selection ------------------------------------------------------------------------

@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_default_view_is_a_handful_of_keys_beside_the_loss(gpus: int) -> None:
    from gpulens.sinks.layout import TrackerLayout

    values = _row(gpus)
    assert len(values) > 20 * gpus  # the schema's keys: JSONL keeps all of them
    shown, detail = TrackerLayout().split(values)
    # the same small set whatever the number of GPUs: job figures, no per-GPU charts
    assert set(shown) == HEADLINE | {"train/tokens_per_s", "train/mfu_pct", "train/loss",
                                     "train/learning_rate", "train/grad_norm"}
    # one '/' each: the same section under MLflow's and both of W&B's groupings, and that
    # section is the loss's
    assert {k.split("/")[0] for k in shown} == {"train"}
    assert all(k.count("/") == 1 for k in shown)
    one_or_all = "gpu/0/" if gpus == 1 else "gpu/all/"
    mean = "sm_active_pct" if gpus == 1 else "sm_active_pct_mean"
    assert shown["train/gpu_sm_active_pct_mean"] == values[one_or_all + mean]
    if gpus > 1:
        assert shown["train/gpu_mem_used_gb_max"] == values["gpu/all/mem_used_gb_max"]
    assert shown["train/mfu_pct"] == values["perf/mfu_pct"]
    # the rest is detail, under the schema's names; a figure shown is not detail again
    assert f"gpu/{gpus - 1}/power_w" in detail and "host/cpu_pct" in detail
    assert "perf/steps" in detail and "gpu/0/sm_active_pct" in detail
    for key in ("perf/step_time_s", "perf/mfu_pct", "perf/tokens_per_s",
                "gpu/all/power_w_mean", "gpu/all/mem_used_gb_max"):
        assert key not in detail, key
    assert "train/global_step" not in shown and "train/global_step" not in detail


def test_all_keeps_the_schema_and_include_train_drops_train() -> None:
    from gpulens.schema import BOOKKEEPING_SUFFIXES
    from gpulens.sinks.layout import TrackerLayout

    values = _row(2)
    shown, detail = TrackerLayout("all").split(values)
    # every key but the per-GPU bookkeeping (samples, the energy's error bound ...: JSONL's)
    assert shown == {k: v for k, v in values.items()
                     if k.rpartition("/")[2] not in BOOKKEEPING_SUFFIXES} and detail == {}
    assert any(k.rpartition("/")[2] in BOOKKEEPING_SUFFIXES for k in values)
    shown, _ = TrackerLayout(include_train=False, section="").split(values)
    assert not any(k.startswith("train/") for k in shown)
    assert "gpu_power_w_mean" in shown and "mfu_pct" in shown  # bare: MLflow "Model metrics"
    # wall-clock rows (gpulens record: no train/global_step) get a section of their own
    shown, _ = TrackerLayout().split({k: v for k, v in values.items() if not
                                      k.startswith("train/")} | {"record/elapsed_s": 3.0})
    assert {"gpu/sm_active_pct_mean", "gpu/power_w_mean", "record/elapsed_s"} <= set(shown)


def test_a_layout_kept_for_a_run_splits_each_row_as_a_new_one_would() -> None:
    """A sink keeps one layout for the run, and the layout keeps each key's kind: rows of
    other shapes (more GPUs, a job above the key budget, a user's new key) come out as they
    would from a layout that never saw a row."""
    from gpulens.sinks.layout import TrackerLayout

    kept = TrackerLayout()
    one, eight = _row(1), _row(8)
    scaled = eight | {"job/world": 4096.0}  # the same keys, above the budget: no gpu/{i}/
    for values in (one, eight, scaled, one | {"eval/acc": 0.5}, eight, scaled):
        assert kept.split(values) == TrackerLayout().split(values)
    assert "gpu/3/power_w" in kept.split(eight)[1]
    assert not any(k.startswith("gpu/3/") for part in kept.split(scaled) for k in part)


def test_alert_keys_appear_once_their_rule_fired() -> None:
    from gpulens.sinks.layout import TrackerLayout

    layout = TrackerLayout()
    base = {"train/global_step": 1.0, "alerts/input_bound": 0.0, "alerts/thermal": 0.0}
    assert not any(k.startswith("alerts/") for k in layout.split(base)[0])
    shown, _ = layout.split(base | {"alerts/input_bound": 1.0})
    assert shown["alerts/input_bound"] == 1.0 and "alerts/thermal" not in shown
    shown, _ = layout.split(base)  # resolved: the chart goes on, at 0
    assert shown["alerts/input_bound"] == 0.0 and "alerts/thermal" not in shown


def test_user_keys_pass_and_win_a_clash(caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.sinks.layout import TrackerLayout

    values = {"train/global_step": 1.0, "eval/acc": 0.5, "train/mfu_pct": 42.0,
              "perf/mfu_pct": 10.0}
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        shown, _ = TrackerLayout().split(values)
    assert shown == {"eval/acc": 0.5, "train/mfu_pct": 42.0}
    assert "train/mfu_pct" in caplog.text


def test_key_set_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_sink("wandb:all").keys == "all"  # type: ignore[attr-defined]
    assert resolve_sink("wandb").keys == "default"  # type: ignore[attr-defined]
    sink = resolve_sink("mlflow:all")
    assert isinstance(sink, MlflowSink) and sink.keys == "all" and sink.run_id is None
    sink = resolve_sink("mlflow:0123abcd,all")
    assert isinstance(sink, MlflowSink) and (sink.run_id, sink.keys) == ("0123abcd", "all")
    assert MlflowSink("0123abcd").keys == "default"
    with pytest.raises(ValueError, match="wandb:every"):
        resolve_sink("wandb:every")
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "all")  # integrations make their own sinks
    assert WandbSink(include_train=False).keys == "all"
    # an integration's MLflow spec, built in the engine process (whose environment is this one)
    built = sink_spec("mlflow", include_train=False).build()
    assert isinstance(built, MlflowSink) and built.keys == "all"
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "some")
    with pytest.raises(ValueError, match="GPULENS_TRACKER_KEYS='some'"):
        WandbSink()
    # named sinks: when the monitor is made, one line, not a WARNING at the engine's open
    # and every row dropped
    for name in ("wandb", "mlflow"):
        with pytest.raises(ValueError, match="GPULENS_TRACKER_KEYS='some'"):
            gpulens.Monitor(sinks=[name])


# -- W&B ----------------------------------------------------------------------------------------

def test_wandb_default_view_hides_detail_and_records_the_run(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test", config={"lr": 0.1, "model": {"layers": 2}},
                     tags=["mine"])
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=2),
                         dtype="bf16") as mon:
        _train(mon, 4)
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    defs = {d.name: d for d in read_metric_definitions(path) if d.name}
    shown = {k for k, d in defs.items() if not d.hidden}
    assert shown == HEADLINE | {"train/loss", "train/learning_rate", "train/grad_norm"}
    # every per-GPU figure is still logged, for the saved view, but out of the automatic panels
    for key in ("gpu/0/power_w", "gpu/1/sm_active_pct", "gpu/all/power_w_max",
                "host/cpu_pct", "perf/steps"):
        assert defs[key].hidden and defs[key].step_metric == "gpulens/step", key
    # a figure the view shows is stored once, under the view's name
    for key in ("perf/step_time_s", "perf/energy_per_step_j", "gpu/all/power_w_mean",
                "gpu/all/sm_active_pct_mean"):
        assert key not in defs, key
    # the shown keys on every row; the detail (rows 50 ms apart) on the first of the second
    rows = [h for h in read_history(path) if "gpulens/step" in h]
    assert [h["gpulens/step"] for h in rows] == [1, 2, 3, 4]
    assert all("train/gpu_power_w_mean" in h for h in rows)
    assert [h["gpulens/step"] for h in rows if "gpu/1/power_w" in h] == [1]
    assert rows[0]["train/gpu_power_w_mean"] == pytest.approx(
        (rows[0]["gpu/0/power_w"] + rows[0]["gpu/1/power_w"]) / 2)
    # the run's metadata, beside the user's own config, and the simulated GPUs said plainly
    config = read_config(path)
    assert config["lr"] == 0.1 and config["model"] == {"layers": 2}
    meta = config["gpulens"]
    assert meta["backend"] == "simulated" and meta["simulated"].startswith("yes")
    assert meta["gpus"] == "2 x Simulated H100 80GB HBM3" and meta["gpu_count"] == 2
    assert meta["gpu.1.name"] == "Simulated H100 80GB HBM3"
    assert meta["version"] == gpulens.__version__ and meta["hostname"]
    assert meta["dtype"] == "bf16" and meta["peak_tflops"] > 0 and meta["peak_source"]
    assert read_tags(path) == ["mine", "simulated-gpus"]


def test_wandb_detail_at_most_once_an_interval_of_the_rows_times(
        wandb_offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hidden keys go into W&B on the first row after ``detail_interval`` seconds of the
    rows' own times (0: every row); the shown ones into every row; the setting comes from
    ``GPULENS_WANDB_DETAIL_S`` when not given, and a bad value is one line."""
    import wandb

    values = _row(2)
    context = RunContext(gpus=(), backend="simulated", hostname="h", interval=0.05)
    run = wandb.init(project="gpulens-test")
    sink = WandbSink(run, detail_interval=1.0)
    sink.open(context)
    times = [100.0, 100.4, 100.9, 101.0, 101.7, 102.5, 99.0]  # the last: the clock went back
    for step, t in enumerate(times, start=1):
        sink.write(Row(step=step, time=t, values=dict(values)))
        run.log({"loss": 1.0 / step})
    sink.close()
    every = WandbSink(run, detail_interval=0)
    every.open(context)
    for step in (20, 21):
        every.write(Row(step=step, time=200.0, values=dict(values)))
        run.log({"loss": 0.01})
    every.close()
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    history = [h for h in read_history(path) if "gpulens/step" in h]
    assert [h["gpulens/step"] for h in history] == [1, 2, 3, 4, 5, 6, 7, 20, 21]
    assert all("train/gpu_sm_active_pct_mean" in h for h in history)
    assert [h["gpulens/step"] for h in history if "gpu/1/power_w" in h] == [1, 4, 6, 7, 20, 21]
    monkeypatch.setenv("GPULENS_WANDB_DETAIL_S", "5")
    assert WandbSink().detail_interval == 5.0 and WandbSink(detail_interval=0).detail_interval == 0
    monkeypatch.setenv("GPULENS_WANDB_DETAIL_S", "often")
    with pytest.raises(ValueError, match="GPULENS_WANDB_DETAIL_S='often'"):
        WandbSink()
    with pytest.raises(ValueError, match="GPULENS_WANDB_DETAIL_S='often'"):
        gpulens.Monitor(sinks=["wandb"])  # when it is made, not at the engine's open
    with pytest.raises(ValueError, match="detail_interval=-1"):
        WandbSink(detail_interval=-1)
    # the same option in a spec (what an integration's sink is built from)
    spec = sink_spec("wandb", detail_interval=0)
    assert spec.build().detail_interval == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="detail_interval='soon'"):
        sink_spec("wandb", detail_interval="soon")


def test_wandb_defines_each_key_once_per_monitor(wandb_offline: Path) -> None:
    """``define_metric`` is a message to wandb-core per key: each key is defined once by a
    monitor, not per row.  A monitor started again on the same run (a second ``train()``)
    writes from a new engine process, with a run object of its own, and defines its keys
    again there (once each)."""
    import wandb

    run = wandb.init(project="gpulens-test")
    for _ in range(2):
        with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=2),
                             dtype="bf16") as mon:
            _train(mon, 2)
    run_id = run.id
    wandb.finish()
    names = [d.name for d in read_metric_definitions(wait_for_finished_run(wandb_offline,
                                                                           run_id)) if d.name]
    assert "gpu/1/power_w" in names and "train/gpu_power_w_mean" in names
    assert max(names.count(n) for n in names) == 2, sorted(
        n for n in set(names) if names.count(n) > 2)


def test_wandb_all_shows_every_key(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    with gpulens.Monitor(interval=0.05, sinks=["wandb:all"],
                         backend=SimulatedNVML(gpus=2)) as mon:
        _train(mon, 2)
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    defs = {d.name: d for d in read_metric_definitions(path) if d.name}
    assert not any(d.hidden for k, d in defs.items() if k != "gpulens/step")
    assert {"gpu/0/power_w", "gpu/all/power_w_mean", "host/cpu_pct"} <= set(defs)
    assert not any(k.startswith("train/gpu_") for k in defs)


def test_wandb_keeps_a_users_own_gpulens_config(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test", config={"gpulens": {"interval": 0.2}})
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        _train(mon, 1)
    run_id = run.id
    wandb.finish()
    config = read_config(wait_for_finished_run(wandb_offline, run_id))
    assert config["gpulens"] == {"interval": 0.2}
    assert config["gpulens_run"]["backend"] == "simulated"


def _context(gpus: int = 1) -> RunContext:
    return RunContext(
        gpus=tuple(GpuInfo(index=i, name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{i}",
                           pci_bus_id=f"0:{i}") for i in range(gpus)),
        hostname="node-1", backend="nvml", interval=0.5, meta={"dtype": "bf16"})


def _alert(name: str, state: str, step: int, severity: str = "warning") -> Event:
    return Event(kind="alert", name=name, state=state, step=step, time=time.time(),
                 severity=severity, message=f"data wait 41 % of the step at step {step}",
                 advice="more DataLoader workers")


def _alert_rows() -> list[Row]:
    rows = []
    for step in range(1, 7):
        firing = 3 <= step <= 4
        events: tuple[Event, ...] = ()
        if step == 3:
            events = (_alert("input_bound", "firing", 3),)
        elif step == 5:
            events = (_alert("input_bound", "resolved", 5),)
        elif step == 6:
            events = (_alert("thermal", "firing", 6, "critical"),)
        rows.append(Row(step=step, time=time.time(), values={
            "train/global_step": float(step), "gpu/0/power_w": 300.0,
            "alerts/input_bound": 1.0 if firing else 0.0,
            "alerts/thermal": 1.0 if step == 6 else 0.0}, events=events))
    return rows


def test_wandb_alerts_are_sent_and_charted(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    sink = WandbSink()
    sink.open(_context())
    for row in _alert_rows():
        sink.write(row)  # its cost beside rows without alerts: benchmarks/unit_timings.py
    sink.close()
    run_id = run.id
    wandb.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    alerts = read_alerts(path)
    assert [(a.title, a.level) for a in alerts] == [("gpulens: input_bound", "WARN"),
                                                    ("gpulens: thermal", "ERROR")]
    assert alerts[0].text == ("Step 3: data wait 41 % of the step at step 3 Try: more "
                              "DataLoader workers")
    history = read_history(path)
    charted = [(h["gpulens/step"], h["alerts/input_bound"]) for h in history
               if "alerts/input_bound" in h]
    assert charted == [(3, 1.0), (4, 1.0), (5, 0.0), (6, 0.0)]  # from its first firing on
    defs = {d.name: d for d in read_metric_definitions(path) if d.name}
    assert not defs["alerts/input_bound"].hidden
    assert sink.alerts_sent == 2


def test_wandb_alert_that_fails_is_a_warning_not_an_exception(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("W&B is unreachable")

    run.alert = broken  # type: ignore[method-assign]
    sink = WandbSink()
    sink.open(_context())
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for row in _alert_rows():
            sink.write(row)  # never raises into the training thread
    sink.close()
    wandb.finish()
    said = [r.message for r in caplog.records if "W&B alert" in r.message]
    assert len(said) == 1 and "W&B is unreachable" in said[0]  # once per cause


# -- MLflow -------------------------------------------------------------------------------------

def _metric_keys(tracking: MlflowTracking, run_id: str) -> set[str]:
    return set(tracking.client().get_run(run_id).data.metrics)


def test_mlflow_default_view_params_and_all(mlflow_tracking: MlflowTracking) -> None:
    import mlflow

    with mlflow.start_run() as run, gpulens.Monitor(
            interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=8), dtype="bf16") as mon:
        _train(mon, 3)
    run_id = run.info.run_id
    keys = _metric_keys(mlflow_tracking, run_id)
    assert keys == HEADLINE | {"train/loss", "train/learning_rate", "train/grad_norm"}
    power = mlflow_tracking.client().get_metric_history(run_id, "train/gpu_power_w_mean")
    assert sorted(m.step for m in power) == [1, 2, 3] and all(70 < m.value < 700 for m in power)
    params = mlflow_tracking.client().get_run(run_id).data.params
    assert params["gpulens.backend"] == "simulated"
    assert params["gpulens.simulated"].startswith("yes")
    assert params["gpulens.gpus"] == "8 x Simulated H100 80GB HBM3"
    assert params["gpulens.gpu.7.name"] == "Simulated H100 80GB HBM3"
    assert params["gpulens.version"] == gpulens.__version__
    assert params["gpulens.dtype"] == "bf16" and float(params["gpulens.peak_tflops"]) > 0
    assert params["gpulens.interval_s"] == "0.05" and params["gpulens.hostname"]

    with mlflow.start_run() as run, gpulens.Monitor(
            interval=0.05, sinks=["mlflow:all"], backend=SimulatedNVML(gpus=2)) as mon:
        _train(mon, 2)
    keys = _metric_keys(mlflow_tracking, run.info.run_id)
    assert {"gpu/1/power_w", "gpu/all/power_w_mean", "host/cpu_pct", "perf/steps",
            "train/global_step"} <= keys
    assert not any(k.startswith("train/gpu_") for k in keys)


def test_mlflow_beside_a_frameworks_bare_loss(mlflow_tracking: MlflowTracking) -> None:
    """Hugging Face's MLflowCallback logs ``loss`` without a section ("Model metrics"): with
    ``include_train=False`` the GPU figures go there too."""
    import mlflow

    with mlflow.start_run() as run, gpulens.Monitor(
            interval=0.05, sinks=[MlflowSink(include_train=False)],
            backend=SimulatedNVML(gpus=2)) as mon:
        _train(mon, 2)
    keys = _metric_keys(mlflow_tracking, run.info.run_id)
    assert keys == {"gpu_sm_active_pct_mean", "gpu_util_pct_mean", "gpu_mem_used_gb_max",
                    "gpu_power_w_mean", "energy_per_step_j", "step_time_s"}


def test_mlflow_resumed_run_keeps_its_params(mlflow_tracking: MlflowTracking,
                                             caplog: pytest.LogCaptureFixture) -> None:
    client = mlflow_tracking.client()
    exp = client.get_experiment_by_name(mlflow_tracking.experiment_name)
    run_id = client.create_run(exp.experiment_id).info.run_id
    client.log_param(run_id, "gpulens.hostname", "the-first-host")
    client.log_param(run_id, "gpulens.backend", "simulated")
    sink = MlflowSink(run_id, tracking_uri=mlflow_tracking.uri)
    with caplog.at_level(logging.INFO, logger="gpulens"):
        sink.open(_context(2))
        sink.write(Row(step=1, time=time.time(), values={"train/global_step": 1.0,
                                                         "gpu/all/power_w_mean": 300.0}))
        sink.close()
    params = client.get_run(run_id).data.params
    assert params["gpulens.hostname"] == "the-first-host"  # kept, not a failure
    assert params["gpulens.gpu.1.name"] == "NVIDIA H100 80GB HBM3"  # the new ones written
    assert params["gpulens.dtype"] == "bf16"
    assert "gpulens.backend, gpulens.hostname" in caplog.text
    assert [m.value for m in client.get_metric_history(run_id, "train/gpu_power_w_mean")] == [
        300.0]


def test_mlflow_alert_tags_and_metrics(mlflow_tracking: MlflowTracking) -> None:
    client = mlflow_tracking.client()
    exp = client.get_experiment_by_name(mlflow_tracking.experiment_name)
    run_id = client.create_run(exp.experiment_id).info.run_id
    sink = MlflowSink(run_id, tracking_uri=mlflow_tracking.uri)
    sink.open(_context())
    tags: list[dict[str, str]] = []
    for row in _alert_rows():
        sink.write(row)
        run_tags = client.get_run(run_id).data.tags
        tags.append({k: v for k, v in run_tags.items() if k.startswith("gpulens.alert.")})
    sink.close()
    assert tags[1] == {}
    assert tags[2]["gpulens.alert.input_bound"] == (
        "firing at step 3: data wait 41 % of the step at step 3 Try: more DataLoader workers")
    assert tags[4]["gpulens.alert.input_bound"] == (
        "resolved at step 5 (fired at step 3: data wait 41 % of the step at step 3 Try: more "
        "DataLoader workers)")
    assert tags[5]["gpulens.alert.thermal"].startswith("firing at step 6")
    history = client.get_metric_history(run_id, "alerts/input_bound")
    assert sorted((m.step, m.value) for m in history) == [(3, 1.0), (4, 1.0), (5, 0.0),
                                                          (6, 0.0)]


# -- the saved W&B view ---------------------------------------------------------------------

WORKSPACE_SCRIPT = """
import json, sys
from gpulens.integrations.wandb_workspace import gpu_beside_loss
view = gpu_beside_loss("my-team", "my-project", gpus=int(sys.argv[1]) or None,
                       loss="train/loss", loss_x="train/global_step")
print(json.dumps(view._to_model().model_dump(by_alias=True, exclude_none=True)))
"""


def _no_login_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "cfg"), WANDB_MODE="online",
               PYTHONPATH=os.pathsep.join([str(Path(gpulens.__file__).parents[1]),
                                           env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("gpus", [8, 0], ids=["8-gpus", "any-gpus"])
def test_wandb_workspace_view_is_built_offline_without_login(tmp_path: Path,
                                                             gpus: int) -> None:
    pytest.importorskip("wandb_workspaces")
    proc = subprocess.run([sys.executable, "-c", WORKSPACE_SCRIPT, str(gpus)],
                          capture_output=True, text=True, env=_no_login_env(tmp_path),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert (view["entity"], view["project"], view["displayName"]) == (
        "my-team", "my-project", "GPU beside loss")
    main, detail = view["spec"]["section"]["panelBankConfig"]["sections"]
    assert main["name"] == "GPU beside loss" and main["pinned"] and main["isOpen"]
    assert not detail["isOpen"]
    configs = [p["config"] for p in main["panels"]]
    assert configs[0]["metrics"] == ["train/loss"]
    assert configs[0]["xAxis"] == "train/global_step"  # the loss on Hugging Face's axis
    power = next(c for c in configs if c["chartTitle"].startswith("Power"))
    assert power["xAxis"] == "gpulens/step"  # GPU keys on the same step numbers
    if gpus:
        assert power["metrics"] == [f"gpu/{i}/power_w" for i in range(8)]  # one chart, 8 GPUs
    else:
        assert power["useMetricRegex"] and power["metricRegex"] == r"^gpu/\d+/power_w$"
    assert any(c["metrics"] == ["train/mfu_pct"] for c in configs)
    assert main["flowConfig"]["columnsPerPage"] * main["flowConfig"]["rowsPerPage"] >= len(
        configs)  # one page: no panel hidden behind a pager
    assert not (tmp_path / "home" / ".netrc").exists()


def test_wandb_workspace_save_without_login_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("wandb_workspaces")
    env = _no_login_env(tmp_path)
    env["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens: no traffic leaves
    proc = subprocess.run([sys.executable, "-m", "gpulens.integrations.wandb_workspace",
                           "--entity", "e", "--project", "p"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "wandb login" in line and "Traceback" not in proc.stderr


# -- the MLflow UI, in headless Chromium ----------------------------------------------------------

def test_mlflow_ui_shows_the_loss_in_the_first_section_with_8_gpus(
        mlflow_tracking: MlflowTracking) -> None:
    """The run page a user opens first: with 8 GPUs the loss and the GPU figures share the one
    section on top (before: ``alerts``, ``gpu/0`` ... ``gpu/7``, ``gpu/all``, ``host``,
    ``perf`` came first, about 200 charts)."""
    import mlflow

    from tests.support.chromium import Chromium, chromium_path

    if chromium_path() is None:
        pytest.skip("chromium is not installed")
    with mlflow.start_run() as run, gpulens.Monitor(
            interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=8)) as mon:
        _train(mon, 3)
    url = (f"{mlflow_tracking.uri}/#/experiments/{run.info.experiment_id}/runs/"
           f"{run.info.run_id}/model-metrics")
    titles = ("[...document.querySelectorAll('div')].filter(e => "
              r"/^[\w\/ .-]+\s*\(\d+\)$/.test((e.innerText || '').trim()))"
              r".map(e => e.innerText.trim().replace(/\s+/g, ' '))")
    with Chromium(timeout=240) as browser:
        page = browser.open(url, width=1280, height=1400)  # 3 rows of charts: no lazy cards
        sections = page.wait_for(f"(() => {{ const t = {titles}; "
                                 "return t.length > 1 ? t : null; })()", timeout=90)
        # chart titles carry the full key; cards are drawn as they come into view
        charts = page.wait_for(
            "(() => { const k = [...document.querySelectorAll('h4[title]')].map(e => e.title);"
            " return k.includes('train/loss') ? k : null; })()", timeout=240)
    assert sections == ["train (9)", "Model metrics (0)"]  # 6 GPU and job figures + 3 of ours
    assert {"train/gpu_sm_active_pct_mean", "train/gpu_power_w_mean", "train/loss"} <= set(
        charts)
    assert not any(k.startswith(("gpu/", "perf/", "host/")) for k in charts)
