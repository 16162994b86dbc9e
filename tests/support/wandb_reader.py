"""Read an offline W&B run back from its ``.wandb`` file, so tests can check what was logged.

A run started with ``WANDB_MODE=offline`` writes every record it would have sent to
``<WANDB_DIR>/wandb/offline-run-<time>-<id>/run-<id>.wandb``. The file is a LevelDB-style log
(checked against wandb 0.31's wandb-core):

- a 7-byte file header ``<4s H B>``: the ident ``b":W&B"``, the magic ``0xBEE1`` and version 0;
- then 32 KiB blocks, counted from the start of the file (the header sits in block 0);
- each record fragment has a 7-byte header ``<I H B>``: CRC-32, payload length, fragment type
  (FULL=1, FIRST=2, MIDDLE=3, LAST=4); a fragment never crosses a block boundary, and a block
  tail shorter than 7 bytes is zero padding;
- the CRC is plain CRC-32 (zlib's, not CRC-32C) over the type byte followed by the payload; it
  is verified here;
- the reassembled payloads are ``wandb.proto.wandb_internal_pb2.Record`` messages.

After ``wandb.finish()`` returns, wandb-core may still be writing the file (seen here: an empty
file ~10 ms after ``finish()``, complete right after), so read a run with
``wait_for_finished_run(wandb_dir, run_id)``, which waits for the run's ``exit`` record.

Metric names: wandb 0.31 writes a flat key such as ``"train/loss"`` as ``nested_key=["train/loss"]``
and a nested dict ``{"a": {"b": 1}}`` as ``nested_key=["a", "b"]``; here both become plain
string keys, nested parts joined with ``"."`` (``"a.b"``), as the W&B UI shows them.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FILE_VERSION = 0
FILE_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024

FULL = 1
FIRST = 2
MIDDLE = 3
LAST = 4


class WandbFileError(ValueError):
    """The file is not a well-formed ``.wandb`` log (bad header, CRC, framing or payload)."""


@dataclass(frozen=True)
class MetricDefinition:
    """One ``define_metric`` call as recorded in the run.

    ``name`` is set for a plain metric, ``glob`` for a pattern such as ``"gpu/*"``;
    ``step_metric`` is the x-axis metric ("" when none); ``step_sync`` and ``hidden`` are the
    recorded options; ``summary`` lists the summary aggregations asked for (e.g. ``("max",)``).
    """

    name: str
    glob: str
    step_metric: str
    step_sync: bool
    hidden: bool
    summary: tuple[str, ...]


@dataclass(frozen=True)
class Fragment:
    """One physical record of the log: its byte ``offset`` in the file, fragment ``type``
    (FULL, FIRST, MIDDLE or LAST) and ``payload`` bytes."""

    offset: int
    type: int
    payload: bytes


def iter_fragments(path: str | Path) -> Iterator[Fragment]:
    """Yield the physical records of a ``.wandb`` file, CRC-checked, in file order.

    Raises ``WandbFileError`` on a bad file header, a CRC mismatch, a record that crosses a
    block boundary, non-zero block padding, or a file cut inside a record.
    """
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise WandbFileError(f"{path}: {len(data)} bytes, shorter than the 7-byte file header")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if ident != FILE_IDENT or magic != FILE_MAGIC or version != FILE_VERSION:
        raise WandbFileError(
            f"{path}: file header {data[:7]!r} is not :W&B / 0x{FILE_MAGIC:04X} / v{FILE_VERSION}"
        )
    offset = FILE_HEADER.size
    while offset < len(data):
        block_left = BLOCK_SIZE - offset % BLOCK_SIZE
        if block_left < RECORD_HEADER.size:
            if data[offset : offset + block_left].strip(b"\x00"):
                raise WandbFileError(f"{path}: non-zero block padding at offset {offset}")
            offset += block_left
            continue
        if offset + RECORD_HEADER.size > len(data):
            raise WandbFileError(f"{path}: file cut inside a record header at offset {offset}")
        crc, length, rtype = RECORD_HEADER.unpack_from(data, offset)
        if length > block_left - RECORD_HEADER.size:
            raise WandbFileError(
                f"{path}: record at offset {offset} (length {length}) crosses a block boundary"
            )
        start = offset + RECORD_HEADER.size
        if start + length > len(data):
            raise WandbFileError(f"{path}: file cut inside the record at offset {offset}")
        payload = data[start : start + length]
        if zlib.crc32(bytes([rtype]) + payload) != crc:
            raise WandbFileError(f"{path}: CRC mismatch in the record at offset {offset}")
        yield Fragment(offset=offset, type=rtype, payload=payload)
        offset = start + length


def iter_payloads(path: str | Path) -> Iterator[bytes]:
    """Yield each record payload (bytes) of a ``.wandb`` file, fragments reassembled.

    Raises ``WandbFileError`` as ``iter_fragments`` does, and on fragments out of order
    (MIDDLE or LAST without FIRST, FULL or FIRST inside a fragmented record, an unknown type).
    """
    pending: list[bytes] | None = None
    for fragment in iter_fragments(path):
        where = f"{path}: record type {fragment.type} at offset {fragment.offset}"
        if fragment.type == FULL:
            if pending is not None:
                raise WandbFileError(f"{where} inside a fragmented record")
            yield fragment.payload
        elif fragment.type == FIRST:
            if pending is not None:
                raise WandbFileError(f"{where} inside a fragmented record")
            pending = [fragment.payload]
        elif fragment.type in (MIDDLE, LAST):
            if pending is None:
                raise WandbFileError(f"{where} without a FIRST before it")
            pending.append(fragment.payload)
            if fragment.type == LAST:
                yield b"".join(pending)
                pending = None
        else:
            raise WandbFileError(f"{where}: unknown type")
    if pending is not None:
        raise WandbFileError(f"{path}: file ends inside a fragmented record")


def read_records(path: str | Path) -> list[Any]:
    """Parse every record of a ``.wandb`` file into ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    pb: Any = wandb_internal_pb2  # generated code: no type stubs
    records: list[Any] = []
    for payload in iter_payloads(path):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except Exception as exc:  # protobuf's DecodeError
            raise WandbFileError(f"{path}: a payload is not a wandb Record: {exc}") from exc
        records.append(record)
    return records


def _item_key(item: Any) -> str:
    if item.key:
        return str(item.key)
    return ".".join(str(part) for part in item.nested_key)


def _item_value(item: Any) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    if "value" not in item.DESCRIPTOR.oneofs_by_name:  # SummaryItem, ConfigItem
        return None
    kind = item.WhichOneof("value")
    if kind is None or kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def _items_to_dict(items: Any) -> dict[str, Any]:
    return {_item_key(item): _item_value(item) for item in items}


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """Return the run's history rows in order, one dict per ``wandb.log`` commit.

    Each dict maps metric name to its JSON-decoded value and includes wandb's own keys
    (``_step``, ``_timestamp`` in unix seconds, ``_runtime`` in seconds).
    """
    return [
        _items_to_dict(record.history.item)
        for record in read_records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def read_summary(path: str | Path) -> dict[str, Any]:
    """Return the run summary as it stands after the last summary record (updates applied,
    removals honoured)."""
    summary: dict[str, Any] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") != "summary":
            continue
        summary.update(_items_to_dict(record.summary.update))
        for item in record.summary.remove:
            summary.pop(_item_key(item), None)
    return summary


def read_config(path: str | Path) -> dict[str, Any]:
    """Return the run config (``wandb.config``): the one given to ``wandb.init`` (in the run
    record) with later config records applied, without wandb's own ``_wandb`` entry."""
    config: dict[str, Any] = {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            changes = record.run.config
        elif kind == "config":
            changes = record.config
        else:
            continue
        config.update(_items_to_dict(changes.update))
        for item in changes.remove:
            config.pop(_item_key(item), None)
    config.pop("_wandb", None)
    return config


@dataclass(frozen=True)
class Alert:
    """One ``run.alert`` call as recorded in the run: ``title``, ``text``, ``level`` (``"INFO"``,
    ``"WARN"`` or ``"ERROR"``) and ``wait_duration_ms`` (W&B holds back an alert of the same
    title for that long)."""

    title: str
    text: str
    level: str
    wait_duration_ms: int


def read_alerts(path: str | Path) -> list[Alert]:
    """Return the run's alerts (``run.alert`` calls), in order."""
    return [
        Alert(title=str(r.alert.title), text=str(r.alert.text), level=str(r.alert.level),
              wait_duration_ms=int(r.alert.wait_duration))
        for r in read_records(path)
        if r.WhichOneof("record_type") == "alert"
    ]


def read_tags(path: str | Path) -> list[str]:
    """Return the run's tags as they stand after the last run record (``wandb.init(tags=)``,
    later ``run.tags = ...`` updates)."""
    tags: list[str] = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            tags = [str(t) for t in record.run.tags]
    return tags


def read_metric_definitions(path: str | Path) -> list[MetricDefinition]:
    """Return the ``define_metric`` records of the run, in order."""
    definitions: list[MetricDefinition] = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "metric":
            continue
        metric = record.metric
        summary = tuple(
            field.name
            for field, value in metric.summary.ListFields()
            if isinstance(value, bool) and value
        )
        definitions.append(
            MetricDefinition(
                name=str(metric.name),
                glob=str(metric.glob_name),
                step_metric=str(metric.step_metric),
                step_sync=bool(metric.options.step_sync),
                hidden=bool(metric.options.hidden),
                summary=summary,
            )
        )
    return definitions


def read_exit_code(path: str | Path) -> int:
    """The run's exit code, from its ``exit`` record (``KeyError`` where it has none)."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "exit":
            return int(record.exit.exit_code)
    raise KeyError(f"{path}: no exit record")


def find_run_file(wandb_dir: str | Path, run_id: str | None = None) -> Path:
    """Find the ``run-<id>.wandb`` file under ``wandb_dir`` (the ``WANDB_DIR`` of the run).

    With ``run_id`` the file of that run; without it, there must be exactly one run file.
    Raises ``FileNotFoundError`` when there is none and ``ValueError`` when it is ambiguous.
    """
    pattern = f"run-{run_id}.wandb" if run_id else "run-*.wandb"
    found = sorted(Path(wandb_dir).rglob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} under {wandb_dir}")
    if len(found) > 1:
        names = ", ".join(str(p) for p in found)
        raise ValueError(f"{len(found)} run files under {wandb_dir}, pass run_id: {names}")
    return found[0]


def wait_for_finished_run(
    wandb_dir: str | Path, run_id: str | None = None, timeout_s: float = 120.0
) -> Path:
    """Return the run file (as ``find_run_file``) once it holds the run's ``exit`` record.

    ``wandb.finish()`` can return before wandb-core has written the file; until the exit
    record is there the file may be missing, empty, cut inside a record, or a clean prefix.
    Polls every 20 ms; raises ``TimeoutError`` (with the last problem seen) after
    ``timeout_s`` seconds. An ambiguous ``wandb_dir`` raises ``ValueError`` at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path = find_run_file(wandb_dir, run_id)
            kinds = [record.WhichOneof("record_type") for record in read_records(path)]
            if "exit" in kinds:
                return path
            problem = f"{path}: {len(kinds)} records, no exit record yet"
        except (FileNotFoundError, WandbFileError) as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"run not finished after {timeout_s} s: {problem}")
        time.sleep(0.02)


def run_script_that_raises(folder: Path, text: str, wandb_dir: Path, raised: str,
                           env: dict[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """``text`` as ``folder/train.py`` in a fresh interpreter (this process's environment, and
    ``env``), which must end with exit code 1 and ``raised`` in its stderr (an uncaught
    exception); returns its stderr and the history of the one W&B run file under
    ``wandb_dir``."""
    import os
    import subprocess
    import sys

    script = folder / "train.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})}, cwd=folder)
    assert proc.returncode == 1 and raised in proc.stderr, proc.stderr
    return proc.stderr, read_history(find_run_file(wandb_dir))
