"""``gpulens.from_config`` with real Hydra composition (struct configs, ``+key=value`` overrides,
the ``gpu_monitor`` config group registered through ``hydra_plugins``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl import read_rows

hydra = pytest.importorskip("hydra")
from omegaconf import OmegaConf  # noqa: E402

import gpulens  # noqa: E402
from gpulens.integrations.hydra import from_config, settings_from_config  # noqa: E402

APP_CONFIG = """\
trainer:
  max_steps: 10
  logger: [console]
"""


@pytest.fixture
def compose(tmp_path: Path) -> Iterator[Any]:
    """``compose(overrides)``: Hydra's composition of a config that knows nothing of gpulens."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(APP_CONFIG)
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        yield lambda overrides: hydra_compose(config_name="config", overrides=overrides)


def test_off_by_default_on_a_struct_config(compose: Any) -> None:
    cfg = compose([])
    assert OmegaConf.is_struct(cfg)
    assert from_config(cfg) is None
    assert gpulens.from_config is from_config  # the lazy export


def test_keys_added_on_the_command_line(compose: Any, tmp_path: Path) -> None:
    sink = tmp_path / "gpu.jsonl"
    cfg = compose(["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_interval=0.05",
                   f"+trainer.gpu_monitor_sinks=[jsonl:{sink}]"])
    monitor = from_config(cfg)
    assert monitor is not None and not monitor.running
    assert monitor.interval == 0.05
    # parsed by the one parser into a spec named as written (built in the engine at start)
    assert [s.name for s in monitor.sinks] == [f"jsonl:{sink}"]  # type: ignore[union-attr]


def test_gpm_switch_from_the_command_line_and_the_group(compose: Any) -> None:
    """``trainer.gpu_monitor_gpm`` / ``gpu_monitor.gpm`` reach the monitor's settings (GPM is
    read by default)."""
    on = settings_from_config(compose(["+trainer.enable_gpu_monitoring=true"]))
    off = settings_from_config(compose(["+trainer.enable_gpu_monitoring=true",
                                        "+trainer.gpu_monitor_gpm=false"]))
    group = settings_from_config(compose(["+gpu_monitor=default", "gpu_monitor.gpm=false"]))
    assert on is not None and on.gpm is True
    assert off is not None and off.gpm is False
    assert group is not None and group.gpm is False


def test_explicit_false_turns_it_off(compose: Any) -> None:
    assert from_config(compose(["+trainer.enable_gpu_monitoring=false"])) is None


def test_config_group_from_hydra_plugins(compose: Any) -> None:
    cfg = compose(["+gpu_monitor=default", "gpu_monitor.interval=0.2",
                   "gpu_monitor.backend=simulated"])
    assert cfg.gpu_monitor.enabled is True
    monitor = from_config(cfg)
    assert monitor is not None and monitor.interval == 0.2
    # trainer.* keys win over the group
    assert from_config(compose(["+gpu_monitor=default",
                                "+trainer.enable_gpu_monitoring=false"])) is None


def test_config_group_is_typed(compose: Any) -> None:
    with pytest.raises(Exception, match="interval"):
        compose(["+gpu_monitor=default", "gpu_monitor.interval=fast"])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["+trainer.enable_gpu_monitoring=maybe"], "trainer.enable_gpu_monitoring"),
        (["+trainer.enable_gpu_monitoring=1"], "trainer.enable_gpu_monitoring"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_interval=0"],
         "trainer.gpu_monitor_interval"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_interval=soon"],
         "trainer.gpu_monitor_interval"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_sinks=[kafka]"],
         "trainer.gpu_monitor_sinks"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_sinks=3"],
         "trainer.gpu_monitor_sinks"),
        (["+gpu_monitor=default", "gpu_monitor.gpus=[-1]"], "gpu_monitor.gpus"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_gpm=sometimes"],
         "trainer.gpu_monitor_gpm"),
        (["+gpu_monitor=default", "gpu_monitor.backend=cuda"], "gpu_monitor.backend"),
    ],
)
def test_bad_value_names_the_key(compose: Any, overrides: list[str], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_config(compose(overrides))


@pytest.mark.parametrize(
    ("overrides", "key", "meant"),
    [
        (["+trainer.enable_gpu_monitor=true"], "trainer.enable_gpu_monitor",
         "trainer.enable_gpu_monitoring"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_intervl=0.2"],
         "trainer.gpu_monitor_intervl", "trainer.gpu_monitor_interval"),
        (["+trainer.enable_gpu_monitoring=true", "+trainer.gpu_monitor_sink=[wandb]"],
         "trainer.gpu_monitor_sink", "trainer.gpu_monitor_sinks"),
        (["+gpu_monitor=default", "+gpu_monitor.intervall=0.2"], "gpu_monitor.intervall",
         "gpu_monitor.interval"),
    ],
)
def test_a_misspelt_key_is_an_error_not_ignored(compose: Any, overrides: list[str], key: str,
                                                meant: str) -> None:
    """A struct config takes any key added with ``+``: a typo would leave monitoring off, or
    on with the default interval and sinks, without a word."""
    with pytest.raises(ValueError) as raised:
        from_config(compose(overrides))
    message = str(raised.value)
    assert message.startswith(f"{key}: not a gpulens key")
    assert f"did you mean {meant}?" in message and "\n" not in message


def test_the_apps_own_trainer_keys_are_not_checked(compose: Any) -> None:
    cfg = compose(["+trainer.gpu_count=8", "+trainer.enable_profiler=true"])
    assert from_config(cfg) is None


@pytest.mark.parametrize("key", ["enable_gpu_offload", "enable_gpu_profiling",
                                 "cpu_monitor_interval", "gpu_memory_interval",
                                 "enable_gpu_memory_monitoring"])
def test_an_apps_own_key_like_gpulenss_is_not_taken_for_a_typo(compose: Any, key: str) -> None:
    """An app's own ``trainer`` key that resembles gpulens's (the same prefix, or one letter
    off) is the app's: with monitoring off, ``from_config`` must not fail the app's start."""
    assert from_config(compose([f"+trainer.{key}=true"])) is None
    on = compose(["+trainer.enable_gpu_monitoring=true", f"+trainer.{key}=true"])
    assert settings_from_config(on) is not None


def test_sinks_as_comma_separated_string_and_defaults(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    cfg = OmegaConf.create({"trainer": {"enable_gpu_monitoring": True,
                                        "gpu_monitor_sinks": f"jsonl:{a}, jsonl:{b}"}})
    monitor = from_config(cfg)
    assert monitor is not None and len(monitor.sinks) == 2
    # default_sinks only when the config names none
    monitor = from_config(OmegaConf.create({"trainer": {"enable_gpu_monitoring": True}}),
                          default_sinks=[f"jsonl:{a}"])
    assert monitor is not None and len(monitor.sinks) == 1


def test_monitor_from_config_writes_rows(compose: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    sink = tmp_path / "gpu.jsonl"
    monitor = from_config(compose(["+trainer.enable_gpu_monitoring=true",
                                   "+trainer.gpu_monitor_interval=0.05",
                                   f"+trainer.gpu_monitor_sinks=[jsonl:{sink}]"]))
    assert monitor is not None
    from gpulens.transport import spawn

    spare = spawn._spare  # made ready while the app builds its model; the start takes it
    assert spare is not None
    with monitor:
        assert monitor._transport.pid == spare.proc.pid  # type: ignore[union-attr]
        for step in (1, 2, 3):
            monitor.log(step, loss=1.0 / step)
    rows = read_rows(sink)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "gpu/0/power_w" in rows[-1]


def test_plain_mapping_needs_no_omegaconf() -> None:
    probe = (
        "import sys, gpulens\n"
        "m = gpulens.from_config({'trainer': {'enable_gpu_monitoring': True,"
        " 'gpu_monitor_sinks': ['jsonl:/dev/null']}})\n"
        "assert m is not None\n"
        "heavy = [n for n in ('omegaconf', 'hydra', 'torch') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", probe], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
