"""Smoke test of benchmarks/dashboard_clients.py (tests/test_benchmarks_smoke.py's style): it
runs tiny on the CPU and prints every figure. No timing is asserted; the structure is, and that
every page got every row."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.test_benchmarks_smoke import NUMBER, run_script, table_rows


def test_dashboard_clients_quick_prints_cpu_latency_and_history(tmp_path: Path) -> None:
    out = run_script("dashboard_clients.py", tmp_path, "--json", str(tmp_path / "d.json"))
    rows = table_rows(out, "figure")
    for name in ("server CPU, no page connected", "server CPU, 10 pages connected",
                 "added by 10 pages"):
        assert re.fullmatch(rf"{NUMBER} % of a core", rows[name][0]), (name, rows[name])
    assert re.fullmatch(rf"{NUMBER} / {NUMBER} / {NUMBER} ms",
                        rows["publish to page, median / p99 / max"][0])
    assert rows["live rows each page got in the window"][0].endswith("none missing")
    assert rows["pages disconnected as slow / refused"][0] == "0 / 0"
    history = table_rows(out, "history")
    assert set(history) == {"1 GPU", "8 GPUs"}
    for cells in history.values():
        assert re.fullmatch(rf"{NUMBER} MB", cells[2])
    data = json.loads((tmp_path / "d.json").read_text())
    c = data["clients"]
    assert c["clients"] == 10 and c["every_page_every_row"] and not c["page_errors"]
    assert c["server"]["clients_total"] == 10 and c["server"]["published"] > 0
    assert data["history"]["8 GPUs"]["keys"] > data["history"]["1 GPU"]["keys"] > 10
    assert data["meta"]["quick"] is True
