"""Settings are a value (issue 20): one frozen object, checked once, shared by the API, Hydra
and the command line; copies are ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import gpulens
from gpulens.settings import Settings
from gpulens.sinks import SinkSpec
from gpulens.testing import MemorySink


def test_a_monitor_holds_its_arguments_as_one_frozen_value(tmp_path: object) -> None:
    sink = MemorySink()
    mon = gpulens.Monitor([1, 0], 0.25, ["wandb:all", sink], "SIMULATED", buffer_rows=7,
                          isolation="Thread", dtype="bf16-mixed", flops_per_token=6)
    s = mon.settings
    assert s.gpus == (1, 0) and s.interval == 0.25 and s.backend == "simulated"
    assert s.buffer_rows == 7 and s.isolation == "thread" and s.dtype == "bf16"
    assert s.flops_per_token == 6.0 and isinstance(s.flops_per_token, float)
    spec, obj = s.sinks
    assert isinstance(spec, SinkSpec) and spec.name == "wandb:all" and spec.kind == "wandb"
    assert spec.options == {"keys": "all"} and obj is sink
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.interval = 1.0  # type: ignore[misc]
    # the same value makes the same monitor
    again = gpulens.Monitor.from_settings(s)
    assert again.settings is s and again.interval == 0.25 and again.gpus == [1, 0]
    assert not again.running


def test_copies_are_replace_and_are_checked_again() -> None:
    s = Settings(interval=0.5, sinks=("mlflow",), isolation="process", gpm=False)
    copy = dataclasses.replace(s, sinks=("wandb",))
    assert copy.isolation == "process" and copy.gpm is False and copy.interval == 0.5
    assert [x.name for x in copy.sinks] == ["wandb"]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"^interval must be > 0 seconds, got -1$"):
        dataclasses.replace(s, interval=-1)
    # with_sinks is that replace, with the run's dtype where the settings have none
    mon = gpulens.Monitor(isolation="thread", energy=False)
    copy_mon = mon.with_sinks(["mlflow"], dtype="torch.float16")
    assert copy_mon.settings == dataclasses.replace(
        mon.settings, sinks=copy_mon.settings.sinks, dtype="fp16")
    kept = gpulens.Monitor(dtype="bf16").with_sinks([], dtype="fp16")
    assert kept.settings.dtype == "bf16"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"interval": 0}, r"^interval must be > 0 seconds, got 0$"),
    ({"interval": "fast"}, r"^interval must be a number of seconds, got 'fast'$"),
    ({"gpus": (0, -1)}, r"^gpus must be CUDA device numbers >= 0, got -1$"),
    ({"backend": "cuda"}, r"^backend 'cuda': expected one of auto, nvml, simulated"),
    ({"buffer_rows": 0}, r"^buffer_rows must be a whole number >= 1, got 0$"),
    ({"isolation": "fork"}, r"^isolation 'fork': expected one of auto, process, thread$"),
    ({"distributed": "yes"}, r"^distributed must be True, False or None, got 'yes'$"),
    ({"energy": 1}, r"^energy must be True or False, got 1$"),
    ({"flops_per_token": -2.0}, r"^flops_per_token must be a number > 0, got -2.0$"),
    ({"sinks": ("kafka",)}, r"^unknown sink 'kafka'; known sinks: 'dashboard', 'jsonl'"),
    ({"sinks": (object(),)}, r"^sink <object object at .*> is neither a sink name nor"),
])
def test_a_bad_choice_is_one_line_when_the_value_is_made(kwargs: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        Settings(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_settings_with_sink_names_pickle() -> None:
    s = Settings(sinks=("jsonl:/tmp/gpulens-settings-test.jsonl", "mlflow:all",
                        "prometheus:0", "dashboard:127.0.0.1:0", "wandb"))
    assert pickle.loads(pickle.dumps(s)) == s


def test_hydra_builds_the_same_settings(tmp_path: object) -> None:
    pytest.importorskip("omegaconf")
    from omegaconf import OmegaConf

    from gpulens.integrations.hydra import settings_from_config

    cfg = OmegaConf.create({"gpu_monitor": {"interval": 0.2, "sinks": ["mlflow:all", "wandb"],
                                            "gpus": [0], "backend": "simulated"}})
    assert settings_from_config(cfg) == Settings(gpus=(0,), interval=0.2, backend="simulated",
                                                 sinks=("mlflow:all", "wandb"))
    # the same parser, the same words, with the key named
    bad = OmegaConf.create({"trainer": {"enable_gpu_monitoring": True,
                                        "gpu_monitor_sinks": ["mlflow:sqlite:///m.db"]}})
    with pytest.raises(ValueError) as err:
        settings_from_config(bad)
    with pytest.raises(ValueError) as direct:
        Settings(sinks=("mlflow:sqlite:///m.db",))
    assert str(err.value) == f"trainer.gpu_monitor_sinks: {direct.value}"
