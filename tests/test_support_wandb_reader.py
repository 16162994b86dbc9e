"""The ``.wandb`` reader against real offline W&B runs (the tests of other features rely on it)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.support import wandb_reader
from tests.support.wandb_offline import OFFLINE_ENV, reset_wandb
from tests.support.wandb_reader import (
    BLOCK_SIZE,
    FIRST,
    LAST,
    MIDDLE,
    MetricDefinition,
    WandbFileError,
)

USER_KEYS = ("train/global_step", "train/loss", "gpu/0/util_pct", "gpu/0/power_w", "note")
BIG_CONFIG = "0123456789abcdef" * 5000  # 80 kB: the run record spans three blocks
ROWS = 400  # ~100 kB of history: records cross block boundaries


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for step in range(1, ROWS + 1):
        rows.append(
            {
                "train/global_step": step * 10,
                "train/loss": 1.0 / step,
                "gpu/0/util_pct": (step * 37) % 101 + 0.25,
                "gpu/0/power_w": 120.5 + step,
                "note": f"row {step}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict[str, Any]]]:
    """One real offline run: returns (run file, run id, rows logged)."""
    wandb_dir = tmp_path_factory.mktemp("wandb-reader")
    rows = _rows()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in OFFLINE_ENV.items():
            mp.setenv(name, value)
        mp.setenv("WANDB_DIR", str(wandb_dir))
        reset_wandb()
        import wandb

        run = wandb.init(project="gpulens-reader-test", config={"blob": BIG_CONFIG, "lr": 0.5})
        run_id = run.id
        try:
            wandb.define_metric("train/global_step")
            wandb.define_metric("train/*", step_metric="train/global_step", summary="max")
            wandb.define_metric("gpu/*", step_metric="train/global_step")
            for row in rows:
                wandb.log(row)
            config: Any = wandb.config
            config.update({"late": [1, 2]})
        finally:
            wandb.finish()
    path = wandb_reader.wait_for_finished_run(wandb_dir, run_id)
    reset_wandb()
    return path, run_id, rows


def test_history_reads_back_exactly(real_run: tuple[Path, str, list[dict[str, Any]]]) -> None:
    path, _, rows = real_run
    history = wandb_reader.read_history(path)
    assert len(history) == len(rows)
    assert [{k: h[k] for k in USER_KEYS} for h in history] == rows
    assert [h["_step"] for h in history] == list(range(len(rows)))
    timestamps = [h["_timestamp"] for h in history]
    assert timestamps == sorted(timestamps)


def test_metric_definitions_are_read(real_run: tuple[Path, str, list[dict[str, Any]]]) -> None:
    path, _, _ = real_run
    definitions = wandb_reader.read_metric_definitions(path)
    assert definitions == [
        MetricDefinition(
            name="train/global_step",
            glob="",
            step_metric="",
            step_sync=False,
            hidden=False,
            summary=(),
        ),
        MetricDefinition(
            name="",
            glob="train/*",
            step_metric="train/global_step",
            step_sync=True,
            hidden=False,
            summary=("max",),
        ),
        MetricDefinition(
            name="",
            glob="gpu/*",
            step_metric="train/global_step",
            step_sync=True,
            hidden=False,
            summary=(),
        ),
    ]


def test_config_and_summary(real_run: tuple[Path, str, list[dict[str, Any]]]) -> None:
    path, _, rows = real_run
    assert wandb_reader.read_config(path) == {"blob": BIG_CONFIG, "lr": 0.5, "late": [1, 2]}
    summary = wandb_reader.read_summary(path)
    assert summary["gpu/0/power_w"] == rows[-1]["gpu/0/power_w"]
    assert summary["note"] == rows[-1]["note"]


def test_fragmented_records_are_reassembled(
    real_run: tuple[Path, str, list[dict[str, Any]]],
) -> None:
    path, _, _ = real_run
    assert path.stat().st_size > 3 * BLOCK_SIZE
    fragments = list(wandb_reader.iter_fragments(path))
    types = {f.type for f in fragments}
    assert {FIRST, MIDDLE, LAST} <= types  # the big config record and block-crossing rows
    assert len(wandb_reader.read_records(path)) < len(fragments)


def test_find_run_file(
    real_run: tuple[Path, str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, run_id, _ = real_run
    root = path.parents[2]  # <WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb
    assert wandb_reader.find_run_file(root) == path
    assert wandb_reader.find_run_file(root, run_id) == path
    with pytest.raises(FileNotFoundError):
        wandb_reader.find_run_file(root, "nosuchrun")
    with pytest.raises(FileNotFoundError):
        wandb_reader.find_run_file(tmp_path)
    copy = tmp_path / "two" / "a" / f"run-{run_id}x.wandb"
    copy.parent.mkdir(parents=True)
    shutil.copy(path, copy)
    shutil.copy(path, tmp_path / "two" / f"run-{run_id}.wandb")
    with pytest.raises(ValueError, match="2 run files"):
        wandb_reader.find_run_file(tmp_path / "two")


def test_wait_for_finished_run_never_returns_a_partial_file(wandb_offline: Path) -> None:
    """wandb.finish() may return before wandb-core wrote the file: the wait covers that."""
    import wandb

    for attempt in range(8):
        run = wandb.init(project="gpulens-finish-race")
        for step in range(3):
            run.log({"train/global_step": step, "attempt": attempt})
        run_id = run.id
        run.finish()
        path = wandb_reader.wait_for_finished_run(wandb_offline, run_id, timeout_s=20)
        history = wandb_reader.read_history(path)
        assert [(h["train/global_step"], h["attempt"]) for h in history] == [
            (step, attempt) for step in range(3)
        ]
    with pytest.raises(TimeoutError, match=r"no run-nosuch\.wandb"):
        wandb_reader.wait_for_finished_run(wandb_offline, "nosuch", timeout_s=0.1)


def test_wait_for_finished_run_times_out_on_an_unfinished_file(
    real_run: tuple[Path, str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, run_id, _ = real_run
    fragments = list(wandb_reader.iter_fragments(path))
    exit_fragment = fragments[-1]  # wandb writes the exit record last
    unfinished = tmp_path / "offline-run-x" / path.name
    unfinished.parent.mkdir()
    unfinished.write_bytes(path.read_bytes()[: exit_fragment.offset])
    with pytest.raises(TimeoutError, match="no exit record yet"):
        wandb_reader.wait_for_finished_run(tmp_path, run_id, timeout_s=0.2)


def _corrupt(src: Path, dst: Path, offset: int, value: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[offset : offset + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def test_corruption_is_detected(
    real_run: tuple[Path, str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, _, _ = real_run
    first = next(wandb_reader.iter_fragments(path))
    with pytest.raises(WandbFileError, match="file header"):
        wandb_reader.read_records(_corrupt(path, tmp_path / "ident", 0, b":W&C"))
    with pytest.raises(WandbFileError, match="file header"):
        wandb_reader.read_records(_corrupt(path, tmp_path / "version", 6, b"\x01"))
    payload_byte = first.offset + 7 + 3
    flipped = bytes([path.read_bytes()[payload_byte] ^ 0xFF])
    with pytest.raises(WandbFileError, match="CRC mismatch"):
        wandb_reader.read_records(_corrupt(path, tmp_path / "crc", payload_byte, flipped))
    too_long = struct.pack("<H", BLOCK_SIZE)
    with pytest.raises(WandbFileError, match="crosses a block boundary"):
        wandb_reader.read_records(_corrupt(path, tmp_path / "len", first.offset + 4, too_long))
    fragments = list(wandb_reader.iter_fragments(path))
    inside = fragments[len(fragments) // 2]
    truncated = tmp_path / "truncated"
    truncated.write_bytes(path.read_bytes()[: inside.offset + 7 + len(inside.payload) // 2])
    with pytest.raises(WandbFileError, match="cut inside"):
        wandb_reader.read_records(truncated)
    first_fragment = next(f for f in fragments if f.type == FIRST)
    after_first = tmp_path / "after_first"
    after_first.write_bytes(
        path.read_bytes()[: first_fragment.offset + 7 + len(first_fragment.payload)]
    )
    with pytest.raises(WandbFileError, match="ends inside a fragmented record"):
        wandb_reader.read_records(after_first)
    short = tmp_path / "short"
    short.write_bytes(b":W&B")
    with pytest.raises(WandbFileError, match="shorter than"):
        wandb_reader.read_records(short)


def test_wandb_offline_fixture_makes_a_fresh_quiet_run(wandb_offline: Path) -> None:
    import os

    import wandb

    assert os.environ["WANDB_MODE"] == "offline"
    assert os.environ["WANDB_DIR"] == str(wandb_offline)
    run = wandb.init(project="gpulens-fixture-test")
    wandb.log({"x": 1.5})
    assert run.settings.mode == "offline"
    assert Path(run.dir).is_relative_to(wandb_offline)  # not a WANDB_DIR of an earlier test
    # left open on purpose: the fixture must finish it


def test_wandb_offline_fixture_finished_the_previous_run(wandb_offline: Path) -> None:
    import wandb

    assert wandb.run is None
    previous = sorted(wandb_offline.parent.parent.glob("*/wandb-dir/wandb/*/run-*.wandb"))
    finished = [p for p in previous if not p.is_relative_to(wandb_offline)]
    if finished:  # run after the test above: its run was closed with an exit record
        kinds = [r.WhichOneof("record_type") for r in wandb_reader.read_records(finished[-1])]
        assert "exit" in kinds
