"""Smoke tests of the benchmark scripts: they run on the CPU with simulated GPUs and print their
figures. No timing is asserted (the figures depend on the machine); the structure is. The
statistics of the A/A method (``benchmarks/paired.py``) are unit-tested here too.

Each script runs whole in its ``--quick`` mode: in a subprocess, or, for those that train
through the frameworks and leave no process-wide state behind (``paths_aa.py`` in one
process, ``callback_cost.py``), its ``main`` in this process (``tests.support.inprocess``:
torch, transformers and Lightning are not imported again), which also checks that it left no
thread or process running."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.inprocess import run_main
from tests.support.wandb_offline import reset_wandb

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
NUMBER = r"-?\d+(?:\.\d+)?"
SIGNED = r"[+-]\d+\.\d+"
EST = rf"{SIGNED} \[{SIGNED}, {SIGNED}\]"
VERDICT = r"(not separable|higher than \S+|lower than \S+)"

# A loaded machine with the suite in several workers can take minutes over a script that
# imports torch. The timeouts bound a hang.
pytestmark = pytest.mark.timeout(900)


def _load_paired() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_paired", BENCH / "paired.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


paired = _load_paired()


def bench_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OUT", None)
    env.update(
        GPULENS_BACKEND="simulated",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        MLFLOW_TRACKING_URI=(tmp_path / "mlruns").as_uri(),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    return env


def run_script(name: str, tmp_path: Path, *args: str, timeout: float = 600) -> str:
    """Run ``benchmarks/<name> --quick ...`` in a subprocess; return its stdout."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", *args],
        cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def run_inprocess(name: str, tmp_path: Path, *args: str, preload: tuple[str, ...] = ()) -> str:
    """Run ``benchmarks/<name> --quick ...``'s ``main`` in this process
    (``tests.support.inprocess``: torch, transformers and Lightning are not imported again,
    and what the script changes in the process is put back); return its stdout."""
    reset_wandb()  # its next run reads the environment of this test
    return run_main(BENCH / name, ["--quick", *args], tmp_path, bench_env(tmp_path), preload)


#: What the scripts that train through the frameworks import (``run_main``'s preload).
FRAMEWORKS = ("torch", "transformers", "transformers.trainer", "lightning.pytorch", "wandb")


def table_rows(out: str, first_col: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell, for the table whose header starts so."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in out.splitlines():
        if line.startswith(f"| {first_col} |"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif in_table:
            break
    return rows


def table_lines(out: str, header_start: str) -> list[list[str]]:
    """The rows of the Markdown table whose header starts with ``| header_start``."""
    rows: list[list[str]] = []
    in_table = False
    for line in out.splitlines():
        if line.startswith(f"| {header_start}"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif in_table:
            break
    return rows


def test_bench_log_quick_prints_every_figure(tmp_path: Path) -> None:
    out = run_script("bench_log.py", tmp_path, "--json", str(tmp_path / "log.json"),
                     "--tracemalloc", "--rss-sinks", "none,object", "--rss-seconds", "0.5")
    rows = table_rows(out, "figure")
    assert re.fullmatch(rf"{NUMBER} us", rows["log() median, 8 simulated GPUs, 10 Hz"][0])
    assert re.fullmatch(rf"{NUMBER} ms/step", rows["5 ms step loop, without gpulens"][0])
    assert re.fullmatch(
        rf"{NUMBER} ms/step", rows["5 ms step loop, with gpulens (log every step)"][0]
    )
    assert re.fullmatch(NUMBER, rows["loop time ratio with / without (medians)"][0])
    growth = [k for k in rows if k.startswith("training process RSS growth")]
    assert growth and re.fullmatch(rf"{NUMBER} MiB", rows[growth[0]][0])
    # the engine process's memory, beside the training process's (issue 11)
    sampler = [k for k in rows if k.startswith("engine process RSS growth")]
    assert sampler and re.fullmatch(rf"{NUMBER} MiB", rows[sampler[0]][0])
    both = [k for k in rows if k.startswith("engine process RSS at row")]
    assert both and re.fullmatch(rf"{NUMBER} / {NUMBER} MiB \(USS {NUMBER} MiB\)",
                                 rows[both[0]][0])
    assert re.match(r"[+-]\d+ \(of \d+\)",
                    rows["objects tracked by the GC: growth over the same rows"][0])
    fig = json.loads((tmp_path / "log.json").read_text())
    assert fig["log_calls"] == 300
    # every logged row reached the sink: the figure is about a complete run
    assert fig["mem_rows_written"] == fig["mem_rows"] and fig["mem_drained"]
    assert "mem_traced_growth_kib" in fig
    assert fig["loop_ratio"] > 0  # a figure, not checked: this machine's load moves it
    # the default sampler is a process of its own: its RSS is a real reading
    assert fig["mem_isolation"] == "process" and fig["mem_sampler_rss_end_mib"] > 1
    # (d): the engine process's memory per sink, each in a fresh process
    by_sink = {r["config"]: r for r in fig["sampler_rss"]}
    assert set(by_sink) == {"none", "object"}
    for r in by_sink.values():
        assert r["isolation"] == "process" and r["sampler_rss_mib"] > 1
        assert 0 < r["sampler_uss_mib"] <= r["sampler_rss_mib"]
    assert by_sink["object"]["rows_written"] == {"CountingSink": by_sink["object"]["rows_logged"]}
    rss = table_rows(out, "sink")
    assert set(rss) == {"none (sampler in a process)", "object (sampler in a process)"}
    for cells in rss.values():
        assert re.fullmatch(NUMBER, cells[0]) and re.fullmatch(NUMBER, cells[1])


SUITE_ARMS = {
    "none", "none_b", "gpulens", "gpulens_thread", "wandb", "mlflow", "nvitop",
    "wandb_log", "wandb_log_b", "wandb_stats", "gpulens_wandb",
}


def test_overhead_quick_runs_every_suite_with_an_aa_arm(tmp_path: Path) -> None:
    """Every suite (the peers, the W&B loops) in shuffled rounds, each arm beside its
    baseline's A/A envelope with a verdict; the pilot's A/A noise sets the rounds."""
    out = run_script("overhead_gpu.py", tmp_path, "--json", str(tmp_path / "overhead.json"),
                     "--suite", "peers,wandb", "--pilot", "2", "--max-rounds", "2",
                     "--steps", "3", "--warmup", "1", timeout=600)
    data = json.loads((tmp_path / "overhead.json").read_text())
    arms = data["arms"]
    assert set(arms) == SUITE_ARMS
    ran = {n for n, f in arms.items() if "skipped" not in f}
    # nvitop needs a GPU (it says why it skipped); every other arm runs on a CPU
    assert ran == SUITE_ARMS - {"nvitop"}, {n: arms[n].get("skipped") for n in SUITE_ARMS - ran}
    assert arms["nvitop"]["skipped"]
    for name in ran:
        assert arms[name]["rounds"] == 2, name

    # the order is shuffled each round (seeded, recorded); each round runs every arm once
    orders = data["meta"]["orders"]
    assert len(orders) == 2 and all(sorted(o) == sorted(ran) for o in orders)
    assert orders[0] != orders[1]
    runnable = [a for a in data["meta"]["arms"] if a in ran]
    assert orders == [paired.round_order(runnable, 0, r) for r in range(2)]
    assert "orders: 0: " + " ".join(orders[0]) in out

    # the pilot rule: A/A SD -> rounds needed; here --max-rounds caps it and says so
    plan = data["meta"]["plan"]
    assert plan["pilot_rounds"] == 2 and plan["rounds_done"] == 2
    assert plan["rounds_needed"] >= 2 and plan["cap_by"] == "--max-rounds"
    assert re.search(r"A/A noise: per-round SD \d+\.\d+ pp after a 2-round pilot -> \d+ "
                     r"rounds to resolve 0\.2 pp", out)
    if plan["rounds_needed"] > 2:
        assert "UNRESOLVED by --max-rounds" in out

    # each arm against its baseline (A/A arms too), beside that group's A/A envelope
    comps = {(c["arm"], c["than"]): c for c in data["comparisons"]}
    groups = {"none": "none_b", "wandb_log": "wandb_log_b"}
    for arm in ran:
        base = arms[arm]["baseline"]
        if arm == base:
            continue
        c = comps[(arm, base)]
        aa = comps.get((groups[base], base))
        assert c["rounds"] == 2 and c["aa_envelope"] == (aa and {
            k: v for k, v in aa.items() if k not in ("arm", "than", "aa_envelope", "verdict")})
        assert re.fullmatch(VERDICT, c["verdict"])
    # gpulens set against the peers of the same baseline
    for pair in [("gpulens", "gpulens_thread"), ("gpulens", "wandb"),
                 ("gpulens_wandb", "wandb_stats")]:
        if set(pair) <= ran:
            assert pair in comps
    printed = table_lines(out, "arm | against")
    assert {(cells[0], cells[1]) for cells in printed} == set(comps)
    for cells in printed:  # difference: mean [95 % CI]; the envelope; the verdict
        assert re.fullmatch(EST, cells[2]), cells
        assert re.fullmatch(rf"{EST}; range \[{SIGNED}, {SIGNED}\]", cells[4]), cells
        assert cells[5] == comps[(cells[0], cells[1])]["verdict"]

    # gpulens arms name their engine process among the child processes, with its RSS
    for name in ("gpulens", "gpulens_wandb"):
        assert arms[name]["rss_children_mib_max"].get("gpulens-sampler", 0) > 1, name
    assert "gpulens-sampler" not in arms["none"]["rss_children_mib_max"]
    assert "sampler in a process" in arms["gpulens"]["note"]
    assert "sampler in a thread" in arms["gpulens_thread"]["note"]
    assert data["meta"]["quick"] is True and data["meta"]["complete"] is True


def _paths_checks(data: dict[str, Any], out: str, names: list[str]) -> None:
    """Each path's arms ran every round, each beside the A/A envelope, with the +-0.3 pp
    claim stated."""
    assert list(data["paths"]) == names
    for name in names:
        run = data["paths"][name]
        assert run["failed"] is None, run["failed"]
        arms = [name, f"{name}_b", f"{name}_gpulens"]
        if name == "lightning" and data["meta"]["args"]["lightning_dsm"]:
            arms.append("lightning_dsm")  # Lightning's own peer, beside the same envelope
        assert set(run["arms"]) == set(arms)
        for arm in arms:
            assert len(run["arms"][arm]["per_round_ms"]) == 2, arm
            assert run["arms"][arm]["train_thread_cpu_ms_per_step"] > 0
        assert [sorted(o) for o in run["orders"]] == [sorted(arms)] * 2
        comps = {c["arm"]: c for c in run["comparisons"]}
        assert set(comps) == set(arms[1:])
        for c in comps.values():
            assert c["rounds"] == 2 and c["aa_envelope"] is not None
            assert c["within_bound"] in ("within +-0.3 pp", "unresolved", "differs")
        assert run["plan"]["resolve_pp"] == 0.3 and run["plan"]["rounds_done"] == 2
        assert f"### {name}" in out and f"| {name}_gpulens | {name} |" in out


def test_paths_aa_quick_interleaves_blocks_of_each_user_path(tmp_path: Path) -> None:
    """The default: one training run through short blocks of every arm, gpulens's hooks
    active in its own blocks."""
    names = ["hf_ls1", "hf_ls10", "lightning", "wandb_loop"]
    out = run_inprocess("paths_aa.py", tmp_path, "--paths", ",".join(names), "--rounds", "2",
                        "--measured-steps", "10", "--burn-steps", "2", "--lightning-dsm",
                        "--json", str(tmp_path / "p.json"), preload=FRAMEWORKS)
    data = json.loads((tmp_path / "p.json").read_text())
    _paths_checks(data, out, names)
    assert data["meta"]["world_size"] == 1 and data["meta"]["args"]["mode"] == "interleaved"
    assert "within +-0.3 pp?" in out and "mode interleaved" in out
    # the CPU of the process's other threads, by name: gpulens's only in gpulens's blocks
    for name in names:
        for arm, figures in data["paths"][name]["arms"].items():
            (threads,) = figures["other_threads_us_per_step_by_rank"]
            # (a spare made at Lightning's setup, before the first block, waits for the first
            # gpulens block to take it; its retirement timer sleeps meanwhile)
            ours = {t for t in threads
                    if t.startswith("gpulens-") and t != "gpulens-spare-retire"}
            assert bool(ours) == arm.endswith("_gpulens"), (arm, threads)
        assert "other threads' CPU by name, rank 0" in out
        # each arm's step by position in its blocks: 2 burn-in + 10 counted
        profile = data["paths"][name]["profile_ms_rank0"]
        assert set(profile) == set(data["paths"][name]["arms"])
        assert all(len(steps) == 12 for steps in profile.values())
        # every counted step, one by one: 10 a block, a span that runs forward in time
        for arm, rounds in data["paths"][name]["steps_rank0"].items():
            assert sorted(rounds) == ["0", "1"], (name, arm)
            for rec in rounds.values():
                assert all(len(rec[k]) == 10 for k in ("ms", "cpu_ms", "gc_ms", "full_gc"))
                assert all(v > 0 for v in rec["ms"]) and all(g >= 0 for g in rec["gc_ms"])
                assert 0 < rec["span"][1] - rec["span"][0] < 600
                if name != "wandb_loop":  # each step split at its first forward
                    assert len(rec["gap_ms"]) == len(rec["busy_ms"]) == 10
                    for m, g, b in zip(rec["ms"], rec["gap_ms"], rec["busy_ms"], strict=True):
                        assert g >= 0 and b > 0 and abs(g + b - m) < 0.01 * m
    assert "step by position in the block" in out
    assert "counted steps one by one (rank 0)" in out
    assert "each step split at its first forward: gap" in out
    for name in ("hf_ls1", "lightning"):  # one rank: (gap, busy) per arm and round
        (split,) = data["paths"][name]["split_ms_by_rank"]
        assert all(len(split[arm]) == 2 for arm in data["paths"][name]["arms"])


def test_paths_aa_variants_add_gpulens_arms_with_their_own_settings(tmp_path: Path) -> None:
    """``--variants``: an extra gpulens arm per entry on the HF paths, each compared with the
    baseline, its callback given its own attributes (an unknown one is an error); other
    paths keep their three arms."""
    out = run_inprocess("paths_aa.py", tmp_path, "--paths", "hf_ls1,lightning", "--rounds", "2",
                        "--measured-steps", "4", "--burn-steps", "2", "--variants",
                        'bare={"count_work": false, "time_phases": false}',
                        "--json", str(tmp_path / "p.json"), preload=FRAMEWORKS)
    data = json.loads((tmp_path / "p.json").read_text())
    hf = data["paths"]["hf_ls1"]
    assert list(hf["arms"]) == ["hf_ls1", "hf_ls1_b", "hf_ls1_gpulens", "hf_ls1_bare_gpulens"]
    assert {c["arm"] for c in hf["comparisons"]} == set(list(hf["arms"])[1:])
    assert (threads := hf["arms"]["hf_ls1_bare_gpulens"]["other_threads_us_per_step_by_rank"])
    assert any(t.startswith("gpulens-") for t in threads[0])  # its own monitor ran
    assert list(data["paths"]["lightning"]["arms"]) == ["lightning", "lightning_b",
                                                         "lightning_gpulens"]
    assert not hf["failed"] and not data["paths"]["lightning"]["failed"]
    assert "| hf_ls1_bare_gpulens | hf_ls1 |" in out
    # paired against the default gpulens arm: the total, and each rank's gap and busy part
    vs = hf["variants_vs_gpulens"]["hf_ls1_bare_gpulens"]
    assert vs["total_pp"]["n"] == 2 and len(vs["by_rank"]) == 1
    assert set(vs["by_rank"][0]) == {"gap_ms", "busy_ms"}
    g, v = (hf["arms"][a]["per_round_ms"] for a in ("hf_ls1_gpulens", "hf_ls1_bare_gpulens"))
    base = hf["arms"]["hf_ls1"]["per_round_ms"]
    want = sum(100 * (g[r] - v[r]) / base[r] for r in base) / len(base)
    assert vs["total_pp"]["mean"] == pytest.approx(want)
    assert "| hf_ls1_bare_gpulens | " in out and "minus each variant, paired per round" in out
    assert "variants_vs_gpulens" not in data["paths"]["lightning"] or not data["paths"][
        "lightning"]["variants_vs_gpulens"]
    with pytest.raises(SystemExit, match="no attribute 'nonsense'"):
        run_inprocess("paths_aa.py", tmp_path, "--paths", "hf_ls1", "--rounds", "2",
                      "--measured-steps", "4", "--burn-steps", "2",
                      "--variants", 'x={"nonsense": 1}', preload=FRAMEWORKS)


def test_session_parts_quick_runs_every_part_and_the_later_row(tmp_path: Path) -> None:
    """Each part of a callback's session on the plain loop, against ``off`` and its A/A arm,
    with the step by position in the block (burn-in included)."""
    out = run_script("session_parts.py", tmp_path, "--json", str(tmp_path / "s.json"))
    data = json.loads((tmp_path / "s.json").read_text())
    arms = ["off", "off_b", "mon", "phases", "tokens", "full", "later"]
    assert list(data["values"]) == arms and data["rounds"] == 2
    assert all(len(v) == 2 for v in data["values"].values())
    assert {c["arm"] for c in data["comparisons"]} == set(arms[1:])
    positions = table_lines(out, "arm | 0 | 1 |")
    assert [r[0] for r in positions] == arms and all(len(r) == 1 + 2 + 4 for r in positions)
    assert all(len(p) == 6 for p in data["profile_ms"].values())


def test_nvml_interference_quick_reads_each_kind_in_another_process(tmp_path: Path) -> None:
    """Each kind of NVML read made from a spawned reader (the simulated NVML on a CPU),
    with what each read took."""
    out = run_script("nvml_interference.py", tmp_path, "--json", str(tmp_path / "n.json"))
    data = json.loads((tmp_path / "n.json").read_text())
    assert set(data["durations"]) == {"fast", "samples", "energy", "gpm"}
    assert all(d["n"] >= 1 and d["median_ms"] > 0 for d in data["durations"].values())
    assert {c["arm"] for c in data["comparisons"]} == {
        "idle_b", "fast@50", "samples@50", "energy@50", "gpm@50", "engine"}
    assert "| read | calls |" in out
    assert data["fresh_reader"] is False and "one reader process for the whole run" in out


def test_nvml_interference_fresh_reader_touches_only_its_arms_reads(tmp_path: Path) -> None:
    """``--fresh-reader``: a reader per block that reads (and primes) only its arm's kinds, so
    an idle block runs beside a reader that never touched GPM; the reads are still timed."""
    sys.path.insert(0, str(BENCH))
    import nvml_interference as ni  # benchmarks/nvml_interference.py

    assert ni.kinds_of("idle") == ni.kinds_of("idle_b") == ()
    assert ni.kinds_of("gpm@50") == ("gpm",) and ni.kinds_of("engine") == ni.KINDS
    out = run_script("nvml_interference.py", tmp_path, "--fresh-reader",
                     "--json", str(tmp_path / "n.json"))
    data = json.loads((tmp_path / "n.json").read_text())
    assert data["fresh_reader"] is True and "a fresh reader process for every block" in out
    assert set(data["durations"]) <= {"fast", "samples", "energy", "gpm"}
    assert sum(d["n"] for d in data["durations"].values()) >= 1  # reads made in the blocks


def test_paths_aa_quick_blocks_mode_runs_one_training_per_arm(tmp_path: Path) -> None:
    out = run_inprocess("paths_aa.py", tmp_path, "--mode", "blocks", "--paths", "lightning",
                        "--rounds", "2", "--steps", "3", "--warmup", "2",
                        "--json", str(tmp_path / "p.json"), preload=FRAMEWORKS)
    data = json.loads((tmp_path / "p.json").read_text())
    _paths_checks(data, out, ["lightning"])
    assert "mode blocks" in out


def test_start_ddp_times_every_ranks_hf_begin_both_ways(tmp_path: Path) -> None:
    """``start_ddp.py`` under torchrun (gloo, simulated GPUs): each rank's table and JSON of
    the HF callback's ``on_train_begin`` with and without its spare."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(BENCH / "start_ddp.py"), "--runs", "1", "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())["s"]
        assert {way: len(s) for way, s in got.items()} == {"with the spare": 1, "without": 1}
        assert all(s > 0 for way in got.values() for s in way)
        assert f"rank {rank} of 2" in (tmp_path / "out" / f"rank{rank}.md").read_text()
    # rank 0's table of the hooks' ends beyond the ranks' meeting: one figure a rank and way,
    # and the job's, the latest of them; --summarize writes the same table again
    table = (tmp_path / "out" / "ranks.md").read_text()
    for way in ("with the spare", "without"):
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {way} |")]
        *ranks, job = [float(x) for x in re.findall(r"-?\d+\.\d{3}", row)]
        assert len(ranks) == 2 and job == max(ranks), row
    again = subprocess.run([sys.executable, str(BENCH / "start_ddp.py"), "--summarize", "2",
                            "--out", str(tmp_path / "out")], capture_output=True, text=True,
                           env=bench_env(tmp_path), timeout=120)
    assert again.returncode == 0 and (tmp_path / "out" / "ranks.md").read_text() == table


def test_tune_prefetch_lead_eight_steps_see_the_short_loader(tmp_path: Path) -> None:
    """``tune_prefetch_lead.py --steps 8``: the DDP sweep with rank 0's warm-up as it is and
    0.8 s longer; eight timed steps outlast rank 1's prefetch queue either way, so its one
    worker's shortfall shows at batch 16 and both arms choose two workers. After the slow
    warm-up the window ran on queued batches first (it read 27.9 % where the loader's steady
    wait is about 41 %); the worker's own pace puts the wait back where it is without the
    delay."""
    proc = subprocess.run([sys.executable, str(BENCH / "tune_prefetch_lead.py"), "--steps", "8",
                           "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| 8 \|", line)]
    assert [r.split(" | ")[1] for r in rows] == ["0 s", "0.8 s"], proc.stdout
    waits = []
    for row in rows:
        waits.append(float(re.findall(rf"({NUMBER}) %", row)[0]))
        assert waits[-1] >= 5 and row.endswith("| batch 16, 2 workers |"), proc.stdout
    assert waits[1] >= 0.85 * waits[0], proc.stdout
    assert "| loader pace (" in rows[1], proc.stdout
    assert (tmp_path / "out" / "table.md").read_text() == proc.stdout
    # the slow warm-up happened: rank 0's first trial (batch 4, no workers, in both arms) took
    # about 0.8 s longer with it
    first = [json.loads((tmp_path / "out" / arm / "rank0.json").read_text())["local"][0]
             for arm in ("steps8-delay0", "steps8-delay0.8")]
    assert [t["config"]["num_workers"] for t in first] == [0, 0], first
    assert first[1]["wall_s"] - first[0]["wall_s"] >= 0.5, first


def test_tune_pace_cases_prints_both_cases(tmp_path: Path) -> None:
    """``tune_pace_cases.py --repeat 2``: the three tables, a row per case (case 2: each
    worker count read both ways; case 3: the long window and the short ones), what it prints
    written. With service times, one worker's time per
    batch reads about its 10 ms (not a step of 25-75 ms)."""
    out = tmp_path / "cases.md"
    proc = subprocess.run([sys.executable, str(BENCH / "tune_pace_cases.py"), "--repeat", "2",
                           "--out", str(out)], cwd=tmp_path, env=bench_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d", line)]
    assert len(rows) == 4 + 4 + 2, proc.stdout
    assert all(re.search(r"\((window|loader pace)\) \| [12] \|$", r) for r in rows[:4]), rows
    cells = [r.strip("| ").split(" | ") for r in rows[4:8]]
    assert [(c[0], c[1], c[2]) for c in cells] == [
        ("1", "service times", "2"), ("1", "gaps only", "2"),
        ("2", "service times", "2"), ("2", "gaps only", "2")], rows
    service_ms = float(cells[0][5].removesuffix(" ms"))
    assert 9.0 <= service_ms < 25.0, rows  # 10 ms of sleep a batch, on a loaded machine
    # the gaps arm read gaps (whole steps of 25-75 ms), not service times
    assert cells[1][5] == "-" or float(cells[1][5].removesuffix(" ms")) > 20.0, rows
    assert [r.split(" | ")[:2] for r in rows[8:]] == [["| 150 steps", "1"], ["| 3 steps", "2"]]
    assert out.read_text() == proc.stdout


def test_paths_aa_quick_under_torchrun_takes_the_slowest_rank(tmp_path: Path) -> None:
    json_path = tmp_path / "ddp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(BENCH / "paths_aa.py"), "--quick", "--paths", "hf_ls1", "--rounds", "2",
         "--measured-steps", "4", "--burn-steps", "2", "--json", str(json_path)],
        cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(json_path.read_text())
    _paths_checks(data, proc.stdout, ["hf_ls1"])
    assert data["meta"]["world_size"] == 2
    for arm in data["paths"]["hf_ls1"]["arms"].values():
        for rnd, ranks in arm["per_rank_ms"].items():
            assert len(ranks) == 2 and arm["per_round_ms"][rnd] == pytest.approx(max(ranks))
    # every rank's steps split at the first forward, each rank in the table
    split = data["paths"]["hf_ls1"]["split_ms_by_rank"]
    assert len(split) == 2 and all(len(split[r]["hf_ls1_gpulens"]) == 2 for r in (0, 1))
    assert sum(line.startswith("| 1 | hf_ls1") for line in proc.stdout.splitlines()) == 3


def test_callback_cost_quick_splits_the_callbacks_cpu_by_hook(tmp_path: Path) -> None:
    out = run_inprocess("callback_cost.py", tmp_path, "--groups", "hf,lightning",
                        "--json", str(tmp_path / "c.json"), preload=FRAMEWORKS)
    data = json.loads((tmp_path / "c.json").read_text())
    for group, hook in (("hf", "on_log"), ("lightning", "on_train_batch_end")):
        g = data["groups"][group]
        assert set(g["arms"]) == {group, f"{group}_b", f"{group}_gpulens"}
        assert set(g["differences"]) == {f"{group}_b", f"{group}_gpulens"}
        inside = g["inside_gpulens_us_per_step"]
        assert inside[hook] > 0 and inside["TokenCounter.observe"] > 0
        assert inside["(all gpulens, nested once)"] >= inside[hook]
        assert f"### {group}" in out


def test_step_work_ab_switches_the_callbacks_work_per_segment_in_one_run(
        tmp_path: Path) -> None:
    out = run_inprocess("step_work_ab.py", tmp_path, "--rounds", "3", "--segment", "4",
                        "--log-every", "2", "--warmup", "4", "--json",
                        str(tmp_path / "s.json"), preload=FRAMEWORKS)
    res = json.loads((tmp_path / "s.json").read_text())["result"]
    assert res["rounds"] == 3
    assert res["on_minus_off"]["rounds"] == res["off_b_minus_off"]["rounds"] == 3
    host = res["host_us_per_on_step"]
    # only the on segments ran gpulens's hooks: every one was timed, the forward's too
    assert host["on_log"] > 0 and host["observe"] > 0 and host["_busy_device"] > 0
    # every step's time kept, with its segment's kind (the warm-up's: none)
    kinds = res["kind_of_step"]
    assert set(res["per_step_s"]) == set(kinds) and len(kinds) >= 3 * 3 * 4
    assert {k for k in kinds.values() if k} == {"on", "off", "off_b"}
    assert "| `on` (every hook) |" in out and "| `off_b` (A/A) |" in out


# --- the statistics of the A/A method -----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_round_orders_are_balanced_over_each_complete_design(n: int) -> None:
    """Over each complete set of rounds (n orders, 2n for odd n) every arm is in every place
    equally often and right after every other arm equally often: a place or carry-over effect
    falls on all arms alike."""
    arms = [f"a{i}" for i in range(n)]
    size = len(paired.williams(n))
    assert size == (2 * n if n % 2 else n)
    for block in range(3):
        orders = [paired.round_order(arms, 11, block * size + r) for r in range(size)]
        places = Counter((a, o.index(a)) for o in orders for a in o)
        after = Counter((x, y) for o in orders for x, y in itertools.pairwise(o))
        assert set(places.values()) == {size // n} and len(places) == n * n
        assert set(after.values()) == {size // n if n % 2 else 1}
        assert len(after) == n * (n - 1)


def test_round_order_is_a_seeded_shuffle_without_fixed_neighbours() -> None:
    arms = [f"a{i}" for i in range(7)]
    orders = [paired.round_order(arms, 0, r) for r in range(40)]
    assert all(sorted(o) == arms for o in orders)
    assert orders == [paired.round_order(arms, 0, r) for r in range(40)]  # repeatable
    assert orders != [paired.round_order(arms, 1, r) for r in range(40)]  # the seed matters
    # no arm always follows the same neighbour (a cyclic rotation would fix every neighbour)
    followers = {a: {o[o.index(a) - 1] for o in orders if o.index(a) > 0} for a in arms}
    assert all(len(f) >= 3 for f in followers.values()), followers
    firsts = {o[0] for o in orders}
    assert len(firsts) >= 4


def test_per_round_differences_pair_by_round_not_by_position() -> None:
    base = {0: 0.100, 1: 0.102, 3: 0.098}
    arm = {0: 0.101, 2: 0.5, 3: 0.098}
    pr = paired.per_round_pp(arm, base)
    assert list(pr) == [0, 3]
    assert pr[0] == pytest.approx(1.0) and pr[3] == pytest.approx(0.0)


def _est(lo: float, hi: float) -> object:
    return paired.Estimate((lo + hi) / 2, lo, hi, lo - 1, hi + 1, 0.1, 10)


@pytest.mark.parametrize(
    ("interval", "envelope", "want"),
    [
        ((0.30, 0.60), (-0.10, 0.10), "higher than none"),
        ((-0.60, -0.30), (-0.10, 0.10), "lower than none"),
        ((0.05, 0.40), (-0.10, 0.10), "not separable"),  # excludes 0, overlaps the envelope
        ((0.15, 0.40), (0.05, 0.20), "not separable"),  # a biased A/A envelope
        ((0.25, 0.40), (0.05, 0.20), "higher than none"),
        ((-0.10, 0.40), (-0.10, 0.10), "not separable"),  # straddles 0
    ],
)
def test_verdict_needs_zero_and_the_aa_envelope_excluded(
    interval: tuple[float, float], envelope: tuple[float, float], want: str
) -> None:
    est, env = _est(*interval), _est(*envelope)
    assert paired.verdict(est, env, "none") == want
    assert paired.verdict(est, None, "none") == "not separable"


def test_equivalence_needs_zero_inside_and_the_whole_interval_within_the_bound() -> None:
    est = paired.Estimate  # mean, lo, hi, min, max, sd, n
    assert paired.equivalence(est(0.05, -0.2, 0.25, -1, 1, 0.3, 20), 0.3) == "within +-0.3 pp"
    assert paired.equivalence(est(0.1, -0.2, 0.4, -1, 1, 0.3, 20), 0.3) == "unresolved"
    assert paired.equivalence(est(0.2, 0.05, 0.28, -1, 1, 0.3, 20), 0.3) == "differs"
    assert paired.equivalence(est(0.0, math.nan, math.nan, 0, 0, math.nan, 1), 0.3) == \
        "unresolved"


def test_rounds_needed_and_resolvable_difference() -> None:
    # 2 * 1.96 * 0.25 / 0.2 = 4.9 -> 24.01 -> 25 rounds
    assert paired.rounds_needed(0.25) == 25
    assert paired.resolvable_pp(0.25, 25) == pytest.approx(2 * paired.Z95 * 0.25 / 5)
    assert paired.resolvable_pp(0.25, 25) <= 0.2 < paired.resolvable_pp(0.25, 24)
    assert paired.rounds_needed(math.nan) is None
    assert paired.rounds_needed(0.001) == 2
    capped = paired.Plan(4, 0.25, 25, 10, 10, 0.25)
    assert capped.capped and capped.unresolved
    assert "25 rounds to resolve 0.2 pp" in capped.line()
    assert "at most 10" in capped.line() and "UNRESOLVED by the time budget" in capped.line()
    enough = paired.Plan(4, 0.05, 2, 30, 4, 0.05)
    assert not enough.capped and not enough.unresolved and "UNRESOLVED" not in enough.line()


def test_mean_interval_is_seeded_and_contains_the_mean() -> None:
    values = [0.1, -0.2, 0.3, 0.05, 0.0, 0.15, -0.1, 0.2]
    m, lo, hi = paired.mean_ci(values)
    assert lo < m < hi and (m, lo, hi) == paired.mean_ci(values)
    assert m == pytest.approx(sum(values) / len(values))
    m1, lo1, hi1 = paired.mean_ci([0.4])
    assert m1 == 0.4 and math.isnan(lo1) and math.isnan(hi1)


def test_compare_sets_each_arm_beside_its_own_groups_envelope() -> None:
    rounds = range(6)
    values = {
        "none": {r: 0.100 for r in rounds},
        "none_b": {r: 0.100 + (0.0001 if r % 2 else -0.0001) for r in rounds},
        "mon": {r: 0.1010 + (0.00005 if r % 2 else -0.00005) for r in rounds},
        "other": {r: 0.10005 for r in rounds},
        "hf": {r: 0.200 for r in rounds},
        "hf_b": {r: 0.200 + (0.0004 if r % 2 else -0.0004) for r in rounds},
        "hf_mon": {r: 0.2002 for r in rounds},
    }
    base_of = {"none": "none", "none_b": "none", "mon": "none", "other": "none",
               "hf": "hf", "hf_b": "hf", "hf_mon": "hf"}
    comps = {(c.arm, c.than): c for c in paired.compare(values, base_of, [("mon", "other"),
                                                                          ("mon", "hf_mon")])}
    assert ("mon", "hf_mon") not in comps  # different baselines are never compared
    assert comps[("mon", "none")].verdict == "higher than none"  # +1 pp; envelope within 0.1
    assert comps[("mon", "other")].verdict == "higher than other"
    # +0.05 pp in every round: the interval excludes 0, but not the A/A envelope
    other = comps[("other", "none")]
    assert other.est.lo > 0 and other.est.lo < other.envelope.hi
    assert other.verdict == "not separable"
    assert comps[("mon", "none")].envelope == comps[("none_b", "none")].est
    assert comps[("hf_mon", "hf")].envelope == comps[("hf_b", "hf")].est
    assert comps[("hf_mon", "hf")].verdict == "not separable"  # +0.1 pp inside +-0.2 pp


def test_fidelity_quick_prints_steps_and_checks(tmp_path: Path) -> None:
    out = run_script("fidelity_gpu.py", tmp_path, "--json", str(tmp_path / "fidelity.json"))
    steps = table_rows(out, "step")
    assert [v[0] for v in steps.values()] == ["busy", "idle"] * 3
    assert all(re.fullmatch(NUMBER, v[2]) for v in steps.values())  # sm_active_pct
    checks = table_rows(out, "check")
    assert "busy steps: gpulens sm_active_pct >= 80" in checks
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert data["backend"] == "simulated" and len(data["steps"]) == 6


def test_pipe_wake_prints_both_readers(tmp_path: Path) -> None:
    out = run_script("pipe_wake.py", tmp_path)
    rows = table_rows(out, "reader")
    assert set(rows) == {"sleeps in read", "polls"}
    for cells in rows.values():
        assert re.fullmatch(NUMBER, cells[0]) and re.fullmatch(NUMBER, cells[1])


def test_log_ab_pairs_rounds_and_judges_against_its_aa_arm(tmp_path: Path) -> None:
    """Two rounds of tiny arms, both arms on this tree: every figure is printed, and the
    verdict is read against the A/A arm (one of its three words)."""
    src = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "log_ab.py"), "--a", src, "--b", src, "--rounds", "2",
         "--calls", "50", "--gap-us", "200", "--settle-s", "0.1", "--json",
         str(tmp_path / "ab.json")],
        cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = table_rows(proc.stdout, "figure")
    assert {"log() median, A", "log() median, B", "B - A (paired by round)",
            "B - B' (A/A: the method's own noise)"} <= set(rows)
    import json

    got = json.loads((tmp_path / "ab.json").read_text())
    assert len(got["rounds"]) == 2 and all(set(r) == {"A", "B", "B'"} for r in got["rounds"])
    assert all(v > 0 for r in got["rounds"] for v in r.values())
    assert got["verdict"] in {"higher", "lower", "not separable"}
    assert f"verdict: B against A is {got['verdict']}" in proc.stdout


def test_unit_timings_quick_prints_every_figure_with_its_reference(tmp_path: Path) -> None:
    """The figures moved out of unit tests (issue 20): each with its side-by-side reference,
    ratio, bound and check; --quick runs one short round and never fails on a figure (its
    monitor stops with a 1 s timeout when the MLflow server is gone, a full run's 3 s)."""
    from tests.support.chromium import chromium_path

    out = run_script("unit_timings.py", tmp_path)
    rows = table_rows(out, "figure")
    names = ["log() worst, engine process killed", "stop() after the engine process died",
             "log() worst, MLflow server gone", "stop(timeout=1), MLflow server gone",
             "forked child's exit, a monitor running",
             "latest() when the engine process dies 0.3 s in",
             "verl log() worst, two calls a step",
             "record tail, first poll of a 20000-row record",
             "W&B sink write() worst, rows with alerts (offline)",
             "row finished after its log(), interval 0.5 s (median)"]
    if chromium_path() is not None:  # make test on a machine without it: skipped, and said
        names.append("dashboard row until drawn in Chromium")
    else:
        assert "chromium is not installed: the dashboard page scenario is skipped" in out
    for name in names:
        value, reference, ratio, bound, check = rows[name]
        assert re.fullmatch(rf"{NUMBER} ms", value) and re.fullmatch(rf"{NUMBER} ms", reference)
        assert re.fullmatch(NUMBER, ratio) and re.fullmatch(rf"{NUMBER} ms", bound)
        assert check in ("ok", "FAILED"), name


def test_start_stop_quick_prints_the_table_and_writes_raw_figures(tmp_path: Path) -> None:
    res = tmp_path / "res"
    out = run_script("start_stop.py", tmp_path, "--out", str(res), timeout=300)
    cell = rf"{NUMBER} \[{NUMBER}, {NUMBER}\]"
    assert re.search(rf"^none\s+-\s+-\s+-\s+-\s+{cell}$", out, re.M), out
    assert re.search(rf"^jsonl\s+{cell}\s+{cell}\s+{cell}\s+{cell}\s+{cell}$", out, re.M), out
    data = json.loads((res / "raw.json").read_text())
    assert data["meta"]["rounds"] == 1 and data["meta"]["cpus"]
    (jsonl,) = [r for r in data["results"] if r["arm"] == "jsonl"]
    assert 0 < jsonl["first_row_s"] <= jsonl["caught_up_s"] and jsonl["steps"] >= 40
    (stats,) = jsonl["sinks"].values()
    assert stats["written"] == jsonl["rows_logged"] == jsonl["rows_stored"]
    assert stats["dropped"] == 0


def test_interleaved_schedule_counts_whole_logging_periods_per_block() -> None:
    """Every block of every arm counts the same number of steps and of logs (every 10 steps),
    after a burn-in that takes the previous block's last log; rounds keep the seeded order."""
    sys.path.insert(0, str(BENCH))
    import paths  # benchmarks/paths.py

    arms = ["hf_ls10", "hf_ls10_b", "hf_ls10_gpulens"]
    sch = paths.Schedule(arms, rounds=4, first_round=2, seed=0, measured=20, burn=3, warmup=5)
    assert sch.orders == [paired.round_order(arms, 0, r) for r in range(2, 6)]
    counted: dict[tuple[int, str], list[int]] = {}
    for step in range(1, sch.total_steps + 1):
        where = sch.place(step)
        if step <= 5 or step > sch.total_steps - 3:
            assert where is None
        elif where[2]:
            counted.setdefault(where[:2], []).append(step)
    assert set(counted) == {(r, a) for r in range(2, 6) for a in arms}
    for steps in counted.values():
        assert len(steps) == 20 and steps == list(range(steps[0], steps[0] + 20))
        # a log at step L lands in the interval of step L + 1: two logs in every block
        assert sum(1 for s in steps if (s - 1) % 10 == 0) == 2
    on = sch.runs("gpulens")
    assert [s for s in range(1, sch.total_steps + 1) if on(s)] == sorted(
        s for s in range(1, sch.total_steps + 1)
        if (w := sch.place(s)) is not None and w[1] == "hf_ls10_gpulens")


def test_thread_sampler_counts_where_a_gpulens_thread_spends_its_time(tmp_path: Path) -> None:
    """The sampling profiler the GPU runs use on Python 3.12 (``GPULENS_BENCH_SAMPLE_THREADS``):
    a gpulens thread's stacks are counted, other threads' are not."""
    sys.path.insert(0, str(BENCH))
    import threading

    import paths  # benchmarks/paths.py

    stop = threading.Event()

    def spin_in_a_named_function() -> None:
        while not stop.is_set():
            sum(range(1000))

    ours = threading.Thread(target=spin_in_a_named_function, name="gpulens-test-7")
    other = threading.Thread(target=stop.wait, name="someone-else")
    ours.start()
    other.start()
    sampler = paths.ThreadSampler(tmp_path, period=0.001)
    try:
        for _ in range(50):
            sampler.sample()
    finally:
        stop.set()
        ours.join()
        other.join()
    assert set(sampler.counts) == {"gpulens-test-N"}
    (stacks,) = sampler.counts.values()
    assert sum(stacks.values()) == 50
    assert any("spin_in_a_named_function" in frame for stack in stacks for frame in stack)
    sampler.dump()
    text = (tmp_path / "samples_rank0.txt").read_text()
    assert text.startswith("===== gpulens-test-N: 50 samples")


def test_clock_times_each_garbage_collection_into_the_step_it_ran_in() -> None:
    """The per-step record the GPU runs keep: a full collection between two stamps lands in
    that step, with its time; none outside ``watch_gc``."""
    sys.path.insert(0, str(BENCH))
    import gc

    import paths  # benchmarks/paths.py

    clock = paths.Clock(cuda=False)
    clock.stamp()
    clock.watch_gc()
    try:
        clock.stamp()
        junk = [[i] for i in range(200_000)]
        gc.collect()
        del junk
        clock.stamp()
    finally:
        clock.unwatch_gc()
    gc.collect()
    clock.stamp()
    (s0, f0), (s1, f1), (s2, f2), (s3, f3) = clock.gc
    assert (s0, f0) == (s1, f1) == (0.0, 0)
    assert f2 >= 1 and s2 > 0  # gc.collect() (and any the list set off) in the second step
    assert (s3, f3) == (s2, f2)  # after unwatch_gc: not seen
    assert clock._on_gc not in gc.callbacks


_SEEDS = itertools.count(1000)


def _paths_doc(batch: int, rounds: dict[str, dict[str, float]],
               seed: int | None = None, *, no_seed: bool = False) -> dict[str, Any]:
    """A ``paths_aa.py`` JSON of path ``hf_ls1`` with these per-round step times (ms); no
    seed given: one no other doc of this test session has; ``no_seed``: an older run's JSON,
    without one."""
    args: dict[str, Any] = {"mode": "interleaved", "measured_steps": 20, "burn_steps": 5,
                            "interval": 0.1}
    if not no_seed:
        args["seed"] = next(_SEEDS) if seed is None else seed
    return {"meta": {"hardware": {"gpu": "NVIDIA H200"}, "world_size": 1, "date": "d",
                     "commit": "c", "model": {"n_params": 1, "batch": batch, "seq_len": 8},
                     "args": args},
            "paths": {"hf_ls1": {"arms": {a: {"per_round_ms": v} for a, v in rounds.items()}}}}


def test_paths_pool_pools_rounds_of_like_runs_and_refuses_unlike_ones(tmp_path: Path) -> None:
    """Rounds of two runs of one path pool into one comparison (each round kept paired), and
    so does the gpulens arm's difference to each variant arm; runs of another batch are
    refused."""
    one = {"hf_ls1": {"0": 100.0, "1": 100.0}, "hf_ls1_b": {"0": 100.0, "1": 100.0},
           "hf_ls1_gpulens": {"0": 101.0, "1": 101.0},
           "hf_ls1_nogather_gpulens": {"0": 100.5, "1": 100.5}}
    two = {"hf_ls1": {"0": 200.0, "1": 200.0, "2": 200.0},
           "hf_ls1_b": {"0": 200.0, "1": 200.0, "2": 200.0},
           "hf_ls1_gpulens": {"0": 202.0, "1": 202.0, "2": 202.0},
           "hf_ls1_nogather_gpulens": {"0": 201.0, "1": 201.0, "2": 201.0}}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(_paths_doc(19, one)))
    b.write_text(json.dumps(_paths_doc(19, two)))
    c.write_text(json.dumps(_paths_doc(18, two)))
    ok = subprocess.run([sys.executable, str(BENCH / "paths_pool.py"), str(a), str(b),
                         "--path", "hf_ls1", "--json", str(tmp_path / "pooled.json")],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    out = ok.stdout
    pooled = json.loads((tmp_path / "pooled.json").read_text())
    assert pooled["plan"]["rounds_done"] == 5 and [r["rounds"] for r in pooled["runs"]] == [2, 3]
    (g,) = [x for x in pooled["comparisons"] if x["arm"] == "hf_ls1_gpulens"]
    assert g["rounds"] == 5 and g["mean_pp"] == pytest.approx(1.0)  # +1 % in every round
    v = pooled["variants_vs_gpulens"]["hf_ls1_nogather_gpulens"]
    assert v["rounds"] == 5 and v["mean_pp"] == pytest.approx(0.5)  # half of it, paired
    assert "5 rounds pooled from 2 runs" in out and "| hf_ls1_nogather_gpulens | 5 |" in out
    proc = subprocess.run([sys.executable, str(BENCH / "paths_pool.py"), str(a), str(c),
                           "--path", "hf_ls1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "differ in batch" in proc.stderr


def _pool(tmp_path: Path, docs: list[dict[str, Any]], *extra: str
          ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    files = []
    for i, doc in enumerate(docs):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps(doc))
        files.append(str(f))
    out = tmp_path / "pooled.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, str(BENCH / "paths_pool.py"), *files, "--path",
                           "hf_ls1", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=60)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _rounds(n: int, gpulens: Callable[[int], float], aa: Callable[[int], float]
            ) -> dict[str, dict[str, float]]:
    return {"hf_ls1": {str(r): 100.0 for r in range(n)},
            "hf_ls1_b": {str(r): 100.0 + aa(r) for r in range(n)},
            "hf_ls1_gpulens": {str(r): 100.0 + gpulens(r) for r in range(n)}}


def test_paths_pool_refuses_runs_of_one_order_seed_unless_told(tmp_path: Path) -> None:
    """Two runs of one seed ran one sequence of orders: refused; --same-orders pools them and
    the report says so. A run from before seeds were recorded counts as seed 0."""
    docs = [_paths_doc(19, _rounds(4, lambda r: r % 2 * 0.2, lambda r: 0.1), seed=0)
            for _ in range(2)]
    proc, _ = _pool(tmp_path, docs)
    assert proc.returncode == 2 and "share the order seed(s) [0]" in proc.stderr
    proc, pooled = _pool(tmp_path, docs, "--same-orders")
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None and pooled["same_orders"] and pooled["seeds"] == [0, 0]
    assert "one sequence of orders repeated" in proc.stdout
    old = _paths_doc(19, _rounds(4, lambda r: r % 2 * 0.2, lambda r: 0.1), no_seed=True)
    proc, _ = _pool(tmp_path, [old, docs[0]])
    assert proc.returncode == 2 and "[0]" in proc.stderr
    proc, pooled = _pool(tmp_path, [old, _paths_doc(19, _rounds(4, lambda r: 0.1,
                                                                 lambda r: 0.0), seed=5)])
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None and pooled["seeds"] == [0, 5]


# per-round noise of +-0.5 pp around each run's own level, 30 rounds a run
_NOISE = [0.5 * (-1) ** r * (1 + (r % 3) / 2) / 1.5 for r in range(30)]


def test_paths_pool_judges_the_bound_on_runs_side_by_side(tmp_path: Path) -> None:
    """Two runs whose gpulens arm sits at -0.25 and +0.25 pp (30 rounds each, +-0.5 pp
    a round): the rounds pooled put it at 0 inside +-0.3, but two runs that disagree that much
    do not resolve the bound, and the report (Markdown and JSON) says "unresolved" once, judged
    on the runs side by side. Runs that agree: the bound is resolved."""
    def run(level: float) -> dict[str, Any]:
        return _paths_doc(19, _rounds(30, lambda r: level + _NOISE[r],
                                      lambda r: _NOISE[(r + 7) % 30]))

    proc, pooled = _pool(tmp_path, [run(-0.25), run(0.25)])
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None
    (g,) = [c for c in pooled["comparisons"] if c["arm"] == "hf_ls1_gpulens"]
    lo, hi = g["ci95_pp"]
    assert abs(g["mean_pp"]) < 0.01 and lo > -0.3 and hi < 0.3  # the rounds alone: within
    assert g["within_bound"] == "unresolved" and g["judged_on"] == "runs side by side"
    b = pooled["between_runs"]["hf_ls1_gpulens"]
    assert b["runs"] == 2 and b["i2"] > 0.5 and b["within_bound"] == "unresolved"
    (row,) = [x for x in proc.stdout.splitlines() if x.startswith("| hf_ls1_gpulens | hf_ls1 |")]
    assert row.endswith("| not separable |")  # the rounds' table gives no second bound verdict
    assert "| hf_ls1_gpulens | 2 |" in proc.stdout

    short = _paths_doc(19, _rounds(1, lambda r: 0.0, lambda r: 0.0))  # one round: no spread
    proc, _ = _pool(tmp_path, [run(-0.25), run(0.25), short])
    assert proc.returncode == 0, proc.stderr
    assert "hf_ls1_gpulens: 1 run(s) of fewer than 2 rounds left out" in proc.stdout

    proc, pooled = _pool(tmp_path, [run(0.0) for _ in range(4)])
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None
    (g,) = [c for c in pooled["comparisons"] if c["arm"] == "hf_ls1_gpulens"]
    b = pooled["between_runs"]["hf_ls1_gpulens"]
    assert b["i2"] == 0 and b["tau_pp"] == 0
    assert g["within_bound"] == b["within_bound"] == "within +-0.3 pp"


def test_paths_pool_sets_each_position_of_the_blocks_side_by_side_over_runs(
        tmp_path: Path) -> None:
    """Runs whose gpulens blocks are 2 ms slower at their first counted step (a start that
    reaches past the burn-in) and no slower elsewhere: the pooled report marks that position,
    and no other, and says the first counted step's excess (+2 ms, 2/20 ms of a block: 0.1 pp
    of a 100 ms step); the A/A arm shows none. Runs without the positions: no table."""
    burn, counted = 5, 20
    docs = []
    for k in range(4):
        wiggle = [0.01 * ((k * 7 + i * 3) % 5 - 2) for i in range(burn + counted)]
        base = [100.0] * (burn + counted)
        gpulens = [b + w for b, w in zip(base, wiggle, strict=True)]
        gpulens[0] += 300.0  # the start, in the burn-in
        gpulens[burn] += 2.0 + 0.1 * k
        aa = [b - w for b, w in zip(base, wiggle, strict=True)]
        doc = _paths_doc(19, _rounds(6, lambda r: 0.0, lambda r: 0.0))
        doc["paths"]["hf_ls1"]["profile_ms_rank0"] = {
            "hf_ls1": base, "hf_ls1_b": aa, "hf_ls1_gpulens": gpulens}
        docs.append(doc)
    proc, pooled = _pool(tmp_path, docs)
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None
    pos = pooled["by_position"]
    assert pos["burn_steps"] == burn
    g = pos["arms"]["hf_ls1_gpulens"]
    assert g["runs"] == 4 and len(g["positions"]) == burn + counted
    excluding_zero = [i for i, p in enumerate(g["positions"])
                      if p["ci95_ms"][0] > 0 or p["ci95_ms"][1] < 0]
    assert excluding_zero == [0, burn]
    first = g["first_counted_excess"]
    assert first["mean_ms"] == pytest.approx(2.15, abs=0.02)
    assert first["pp"] == pytest.approx(100 * 2.15 / counted / 100.0, abs=0.002)
    aa = pos["arms"]["hf_ls1_b"]["first_counted_excess"]
    assert abs(aa["mean_ms"]) < 0.05
    rows = [x for x in proc.stdout.splitlines() if x.startswith(f"| {burn} | counted |")]
    assert len(rows) == 1 and rows[0].rstrip(" |").endswith("*")

    bare = [_paths_doc(19, _rounds(6, lambda r: 0.0, lambda r: 0.0)) for _ in range(2)]
    proc, pooled = _pool(tmp_path, bare)
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None and pooled["by_position"] == {}
    assert "at each position" not in proc.stdout


def test_between_runs_matches_a_hand_computation() -> None:
    """DerSimonian-Laird and Hartung-Knapp by hand: two runs of means 0 and 1, each of
    sample variance 0.5 over 2 rounds."""
    b = paired.between_runs([[-0.5, 0.5], [0.5, 1.5]])
    assert b is not None
    # a mean's variance 0.5 / 2 = 0.25: w = 4 each; fixed mean 0.5; Q = 4 * 0.25 * 2 = 2;
    # c = 8 - 32 / 8 = 4; tau^2 = (Q - 1) / c = 0.25; random-effects weights 1 / 0.5 = 2
    assert b.q == pytest.approx(2.0) and b.i2 == pytest.approx(0.5)
    assert b.tau == pytest.approx(0.5) and b.mean == pytest.approx(0.5)
    # Hartung-Knapp: sum 2 * 0.25 * 2 / (1 * 4) = 0.25, t(1) = 12.706; wider than normal's
    # 1.96 / sqrt(4)
    assert (b.lo, b.hi) == (pytest.approx(0.5 - 12.706 * 0.5), pytest.approx(0.5 + 12.706 * 0.5))
    assert paired.between_runs([[1.0, 2.0]]) is None
    assert paired.between_runs([[1.0], [2.0]]) is None  # runs of one round say nothing


def test_t975_and_whole_designs() -> None:
    assert paired.t975(1) == 12.706 and paired.t975(30) == 2.042
    assert paired.t975(60) == pytest.approx(2.000, abs=0.001)
    assert paired.t975(1000) == pytest.approx(1.9623, abs=0.0005)
    # three arms: designs of six rounds; up where the cap allows, else down
    assert paired.whole_designs(28, 40, 3) == 30
    assert paired.whole_designs(28, 29, 3) == 24
    assert paired.whole_designs(4, 4, 3) == 4  # no whole design fits: as it was
    assert paired.whole_designs(9, 9, 4) == 8  # four arms: designs of four


def _swab_doc(rank: int, batch: int, on: dict[str, float], off_b: dict[str, float],
              off: dict[str, float], seed: int = 0) -> dict[str, Any]:
    meta = {"rank": rank, "log_every": 1, "batch": batch, "seq": 1024, "segment": 10,
            "skip": 1, "world_size": 2, "hardware": {"gpu": "NVIDIA H200"},
            "host_marks": False, "monitor": "{}", "seed": seed}
    return {"meta": meta, "result": {"per_round_s": {"on": on, "off": off, "off_b": off_b}}}


def test_step_work_pool_pools_each_ranks_rounds_and_refuses_unlike_runs(
        tmp_path: Path) -> None:
    """Rounds of two step_work_ab runs pool per rank, each round paired inside itself; the
    verdict needs zero inside the interval and the interval within the bar; another batch is
    refused."""
    off = {str(r): 0.100 for r in range(6)}
    plus = {str(r): 0.100 * (1 + (0.001 if r % 2 else -0.001)) for r in range(6)}  # +-0.1 pp
    cost = {str(r): 0.101 for r in range(6)}  # +1 pp every round
    files = []
    for i, (rank, on) in enumerate([(0, plus), (0, plus), (1, cost), (1, cost)]):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(_swab_doc(rank, 19, on, plus, off, seed=i % 2)))
        files.append(str(f))
    proc = subprocess.run([sys.executable, str(BENCH / "step_work_pool.py"), *files,
                           "--json", str(tmp_path / "pooled.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pooled = json.loads((tmp_path / "pooled.json").read_text())["ranks"]
    zero, one = pooled["0"]["pooled"]["on"], pooled["1"]["pooled"]["on"]
    assert zero["rounds"] == one["rounds"] == 12  # two runs of six rounds each
    assert zero["mean_pp"] == pytest.approx(0.0, abs=1e-9) and zero["within_bar"]
    assert one["mean_pp"] == pytest.approx(1.0) and not one["within_bar"]
    assert "| 0 | **pooled** |" in proc.stdout
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_swab_doc(0, 18, plus, plus, off)))
    bad = subprocess.run([sys.executable, str(BENCH / "step_work_pool.py"), files[0],
                          str(other)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "do not pool" in bad.stderr
    same = tmp_path / "same.json"  # rank 0 of another run with the first run's seed
    same.write_text(json.dumps(_swab_doc(0, 19, plus, plus, off, seed=0)))
    bad = subprocess.run([sys.executable, str(BENCH / "step_work_pool.py"), files[0],
                          str(same)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "share the order seed(s) [0]" in bad.stderr
    told = subprocess.run([sys.executable, str(BENCH / "step_work_pool.py"), files[0],
                           str(same), "--same-orders"], capture_output=True, text=True,
                          timeout=60)
    assert told.returncode == 0 and "one sequence of orders repeated" in told.stdout


def test_block_design_finds_short_blocks_cheaper_where_the_step_wanders(tmp_path: Path) -> None:
    """Steps that wander in long runs (a slow square wave): short windows differ almost as
    much as whole blocks, so they need less device time for the same precision; the table
    has every block length that fits twice into a block, and the run's own."""
    import random

    rng = random.Random(0)
    level = 0.0
    steps: dict[str, dict[str, Any]] = {"hf_ls1": {}, "hf_ls1_b": {}}
    t = 0.0
    for rnd in range(30):
        for arm in ("hf_ls1", "hf_ls1_b"):
            ms = []
            for _ in range(20):
                if rng.random() < 0.1:  # a new level every ~10 steps, +-2 ms
                    level = rng.choice((-2.0, 2.0))
                ms.append(100.0 + level + rng.gauss(0, 0.2))
            steps[arm][str(rnd)] = {"ms": ms, "span": [t, t + 2.0]}
            t += 2.5
    doc = {"meta": {"args": {"measured_steps": 20, "burn_steps": 5}},
           "paths": {"hf_ls1": {"steps_rank0": steps, "arms": {"hf_ls1": {"per_round_ms": {
               r: 100.0 for r in steps["hf_ls1"]}}}}}}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, str(BENCH / "block_design.py"),
                           str(tmp_path / "p.json"), "--path", "hf_ls1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {r[0]: r for r in table_lines(proc.stdout, "B (counted steps)")}
    assert list(rows) == ["2", "3", "4", "5", "6", "7", "20 (the run)"]
    assert float(rows["20 (the run)"][4]) == pytest.approx(1.0)
    assert float(rows["4"][4]) < 0.8  # short blocks: less device time for the same precision


def test_pool_power_shows_the_rounds_interval_too_narrow_where_runs_differ() -> None:
    """Runs with a between-run SD as large as a round's: the pooled rounds' interval holds the
    true mean far less often than 95 %, the judged one (runs side by side) about as often as it
    says; and the table prints."""
    sys.path.insert(0, str(BENCH))
    import pool_power  # benchmarks/pool_power.py

    (row,) = pool_power.simulate([8], 10, 0.0, 0.5, 0.5, 0.3, 300, 1)
    assert row["cover_rounds"] < 0.85 and row["cover_judged"] >= 0.9
    out = subprocess.run([sys.executable, str(BENCH / "pool_power.py"), "--runs", "2,4",
                          "--rounds", "6", "--trials", "50"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| 4 | 24 |" in out.stdout and "resolves +-0.3" in out.stdout


def test_device_parallel_runs_each_job_k_times_each_a_folder_of_its_own(tmp_path: Path) -> None:
    """``GPULENS_JOB_REPEAT=2``: each job's command runs twice, one after the other, each with
    OUT of its own and the job's GPUs; the status says every run's exit; each job comes back
    as one archive. Without it, one run a job in the job's folder, as before."""
    import tarfile

    env = {**os.environ, "GPULENS_DEVICE_SETUP_DONE": "1", "GPULENS_PART_LIMIT_S": "60",
           "GPULENS_JOB_REPEAT": "2", "OUT": str(tmp_path / "out")}
    cmd = 'echo "$CUDA_VISIBLE_DEVICES $OUT" > "$OUT/where.md"'
    proc = subprocess.run(["bash", str(BENCH / "device_parallel.sh"), f"a=0:{cmd}",
                           "b=1,2:exit 3"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr
    status = [re.sub(r" after \d+ s$", "", x)
              for x in (tmp_path / "out" / "status.txt").read_text().splitlines()]
    assert sorted(status) == ["a run 1 exit 0", "a run 2 exit 0", "b run 1 exit 3",
                              "b run 2 exit 3"]
    with tarfile.open(tmp_path / "out" / "a.tgz") as tar:
        names = sorted(tar.getnames())
        assert "a/r1/where.md" in names and "a/r2/where.md" in names
        where = tar.extractfile("a/r2/where.md")
        assert where is not None
        assert where.read().decode().split() == ["0", str(tmp_path / "out" / "a" / "r2")]
    assert "==> a/r1/where.md" in proc.stdout
    env["GPULENS_JOB_REPEAT"] = "1"
    env["OUT"] = str(tmp_path / "one")
    proc = subprocess.run(["bash", str(BENCH / "device_parallel.sh"), f"a=3:{cmd}"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / "one" / "a.tgz") as tar:
        assert "a/where.md" in tar.getnames()


def test_paths_aa_splits_its_rounds_over_training_runs_and_tags_each(tmp_path: Path) -> None:
    """``--train-rounds 2`` with 3 rounds: two ``train()`` calls in the process (rounds 0-1,
    then 2), each round tagged with its call; the run's seed drawn and recorded."""
    out = run_inprocess("paths_aa.py", tmp_path, "--paths", "hf_ls1", "--rounds", "3",
                        "--train-rounds", "2", "--measured-steps", "4", "--burn-steps", "2",
                        "--json", str(tmp_path / "p.json"), preload=FRAMEWORKS)
    data = json.loads((tmp_path / "p.json").read_text())
    hf = data["paths"]["hf_ls1"]
    assert hf["train_call"] == {"0": 0, "1": 0, "2": 1} and not hf["failed"]
    assert all(sorted(a["per_round_ms"]) == ["0", "1", "2"] for a in hf["arms"].values())
    seed = data["meta"]["args"]["seed"]
    assert isinstance(seed, int) and f"seed {seed}" in out
    assert "one for each 2 rounds of the rest" in out


def test_paths_pool_sets_training_run_calls_side_by_side_with_unit_call(tmp_path: Path) -> None:
    """``--unit call``: each run's training-run calls (``train_call``) are set side by side
    instead of each run; the default stays one unit a run."""
    docs = []
    for _ in range(2):
        doc = _paths_doc(19, _rounds(6, lambda r: (0.4 if r < 3 else -0.4) + _NOISE[r],
                                     lambda r: _NOISE[(r + 5) % 30]))
        doc["paths"]["hf_ls1"]["train_call"] = {str(r): int(r >= 3) for r in range(6)}
        docs.append(doc)
    proc, pooled = _pool(tmp_path, docs)
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None and pooled["between_runs"]["hf_ls1_gpulens"]["runs"] == 2
    proc, pooled = _pool(tmp_path, docs, "--unit", "call")
    assert proc.returncode == 0, proc.stderr
    assert pooled is not None and pooled["unit"] == "call"
    b = pooled["between_runs"]["hf_ls1_gpulens"]
    assert b["runs"] == 4 and b["i2"] > 0.5  # the calls at +0.4 and -0.4 disagree
    assert "each training-run call counted as a run" in proc.stdout


def test_block_noise_recovers_a_part_that_moves_whole_blocks(tmp_path: Path) -> None:
    """Synthetic blocks of 20 steps: independent step noise (SD 1 ms; 2 ms in the gpulens
    arm), a shift of each whole block (SD 0.8 ms) and a last step 5 ms slower: the figures give
    each back, and a file with no shift gives a block part near 0."""
    import random

    sys.path.insert(0, str(BENCH))
    import block_noise  # benchmarks/block_noise.py

    def result(shift_sd: float, seed: int) -> Path:
        rng = random.Random(seed)
        arms = ("p", "p_b", "p_gpulens")
        steps: dict[str, dict[str, Any]] = {a: {} for a in arms}
        for r in range(400):
            for a in arms:
                shift = rng.gauss(100.0, shift_sd)
                sd = 2.0 if a == "p_gpulens" else 1.0
                ms = [shift + rng.gauss(0.0, sd) for _ in range(20)]
                ms[-1] += 5.0
                steps[a][str(r)] = {"ms": ms}
        path = tmp_path / f"{shift_sd}" / "g0" / "paths_aa.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"paths": {"p": {"steps_rank0": steps}}}))
        return path

    moved = block_noise.file_noise(result(0.8, 1))["p"]
    for arm, f in moved.items():
        sd = 2.0 if arm == "p_gpulens" else 1.0
        assert f["blocks"] == 400 and f["steps"] == 20
        assert f["s_ms"] == pytest.approx(sd, rel=0.05)
        assert f["last_ms"] == pytest.approx(5.0, abs=0.3)
        # each side of the difference with its own spread
        assert f["pred_ms"] == pytest.approx(math.sqrt((sd * sd + 1.0) / 20), rel=0.1)
        assert f["block_ms"] == pytest.approx(0.8, rel=0.15)
        assert abs(f["ac1"]) < 0.1
    still = block_noise.file_noise(result(0.0, 2))["p"]
    assert all(f["block_ms"] < 0.15 for f in still.values()), still
    out = subprocess.run([sys.executable, str(BENCH / "block_noise.py"),
                          str(tmp_path / "0.8" / "g0" / "paths_aa.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| 0.8/g0 | p | gpulens | 400 x 20 |" in out.stdout


def test_clock_listeners_run_after_the_stamp_their_work_in_the_next_step() -> None:
    """A listener's work (the benchmarks read every thread's CPU at a block's end) is not in
    the step whose stamp called it, but in the next: a block's last counted step is the
    training's alone."""
    sys.path.insert(0, str(BENCH))
    import paths  # benchmarks/paths.py

    clock = paths.Clock(cuda=False)
    seen: list[tuple[int, int]] = []

    def listener(index: int) -> None:
        seen.append((index, len(clock.wall)))
        if index == 1:
            time.sleep(0.2)

    clock.listeners.append(listener)
    clock.before.append(lambda index: seen.append((-index, len(clock.wall))))
    for _ in range(4):
        clock.stamp()
        time.sleep(0.01)
    # before: the index the stamp will have; after: the stamp just made
    assert seen == [(0, 0), (0, 1), (-1, 1), (1, 2), (-2, 2), (2, 3), (-3, 3), (3, 4)]
    wall, _ = clock.steps(1)  # step 2 ends at stamp 1, step 3 at stamp 2
    assert wall[1] >= 0.2 and wall[1] - wall[0] > 0.15, wall


@pytest.mark.parametrize("burn", [2, 0])
def test_a_schedules_reads_of_thread_cpu_fall_outside_its_counted_steps(
        burn: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Schedule.watch_threads`` reads every thread's CPU twice a block (milliseconds on a
    GPU host): with burn-in steps, neither read is in a counted step (both were, or one was:
    the last counted step of every block ran ~6 ms slow); and the reads still bracket the
    counted steps."""
    sys.path.insert(0, str(BENCH))
    import paths  # benchmarks/paths.py

    reads: list[int] = []
    clock = paths.Clock(cuda=False)

    def slow_read() -> dict[str, float]:
        reads.append(len(clock.wall))  # stamps made so far: the read is in step len + 1
        time.sleep(0.2)
        return {"worker": float(len(reads))}

    monkeypatch.setattr(paths, "threads_cpu", slow_read)
    sched = paths.Schedule(["a", "a_b"], rounds=2, first_round=0, seed=1, measured=3,
                           burn=burn, warmup=1)
    sched.watch_threads(clock)
    for _ in range(sched.total_steps):
        clock.stamp()
    sched.values(clock)
    counted = [ms for rec in sched.steps.values() for ms in rec["ms"]]
    assert len(counted) == 2 * 2 * 3 and len(reads) == 2 * 2 * 2
    # the step each read fell into (stamp k ends step k + 1), counted or not: no timing
    in_counted = {k + 1 for k in reads if (where := sched.place(k + 1)) is not None and where[2]}
    # no burn-in: a block's first counted step holds the reads that close the block before it
    # and open its own (nowhere else)
    assert len(in_counted) == (0 if burn else 2 * 2 - 1), (reads, in_counted)
    # and the steps' own times say the same (0.2 s reads; a counted step is otherwise ~0)
    slow = [ms for ms in counted if ms > 100]
    assert len(slow) == len(in_counted), counted
    assert sched.thread_steps == {"a": 6, "a_b": 6}
    assert sched.threads_s["a"]["worker"] + sched.threads_s["a_b"]["worker"] == 4.0  # 4 x (+1)


def test_start_split_times_its_arms_the_engines_start_phases_and_the_hf_begin(
    tmp_path: Path,
) -> None:
    """``start_split.py`` on simulated GPUs: each arm's start() and stop() (the spare arm's
    start on its spare), inside the thread arm's start() the engine's phases, the sampler's
    start among them, and the HF callback's ``on_train_begin`` with and without its spare."""
    out = subprocess.run([sys.executable, str(BENCH / "start_split.py"), "--repeat", "1",
                          "--hf", "1", "--json", str(tmp_path / "s.json")], capture_output=True,
                         text=True, timeout=300, env=bench_env(tmp_path))
    assert out.returncode == 0, out.stderr
    for arm in ("spawned", "spare"):
        assert re.search(rf"\| {arm} \| {NUMBER} \| {NUMBER} \| {NUMBER} \|", out.stdout), \
            out.stdout
    runs = json.loads((tmp_path / "s.json").read_text())
    (thread,) = runs["thread"]
    assert {"sampler start", "engine start (all)"} <= set(thread["phases_s"])
    assert 0 < thread["phases_s"]["sampler start"] <= thread["phases_s"]["engine start (all)"]
    assert thread["phases_s"]["engine start (all)"] <= thread["start_s"]
    assert "start" in thread["top"] and "phases_s" not in runs["spawned"][0]
    hf = runs["hf_on_train_begin_s"]
    assert len(hf["with the spare"]) == len(hf["without"]) == 1
    assert all(s > 0 for way in hf.values() for s in way)
    assert "| without |" in out.stdout


def test_start_aftereffect_starts_each_arm_mid_block_and_times_the_steps_after(
        tmp_path: Path) -> None:
    """Each arm starts after the block's burn-in: the readers (simulated NVML on a CPU) read,
    the monitors write their rows, and each counted step's time since the start is kept."""
    out = run_script("start_aftereffect.py", tmp_path, "--json", str(tmp_path / "a.json"),
                     "--records", str(tmp_path / "records"))
    data = json.loads((tmp_path / "a.json").read_text())
    arms = ["off", "off_b", "nvml", "gpm", "mon", "mon_nogpm", "mon_wandb", "mon_wandb_nice10",
            "mon_wandb_blas", "sess", "sess_phases", "sess_tokens"]
    assert list(data["values"]) == arms and data["rounds"] == 2
    assert {c["arm"] for c in data["comparisons"]} == set(arms[1:])
    assert set(data["reads"]) == {"nvml", "gpm"}  # seconds after the start of each read
    assert all(len(b) >= 1 and 0 < b[0] < 30 for blocks in data["reads"].values()
               for b in blocks)
    assert "nvml's reader: first read" in out
    since = data["since_start_s"]
    assert set(since) == set(arms) and all(len(b) == 2 for b in since.values())
    assert all(len(ends) == 4 and ends == sorted(ends) and ends[0] > 0
               for blocks in since.values() for ends in blocks)
    assert min(data["start_s"]["mon"]) > max(data["start_s"]["off"])  # start() is timed
    for arm in ("mon", "mon_nogpm", *arms[6:9], *arms[-3:]):  # a record
        # a block
        records = sorted((tmp_path / "records").glob(f"{arm}-*.jsonl"))
        assert len(records) == 2, arm
        for record in records:
            rows = [r for r in map(json.loads, record.read_text().splitlines())
                    if "step" in r and "event" not in r]
            assert rows and all("train/loss" in r for r in rows), record
            assert all(("gpu/0/sm_active_pct" in r) == (arm != "mon_nogpm") for r in rows)
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 6  # mon_wandb*: a W&B run each
    positions = table_lines(out, "arm | 0 | 1 |")
    assert [r[0] for r in positions] == arms and all(len(r) == 1 + 2 + 4 for r in positions)


def test_start_aftereffect_user_wandb_attaches_the_sink_to_the_loops_own_run(
        tmp_path: Path) -> None:
    """``--user-wandb``: the loop logs its loss to one W&B run of its own in every arm, and
    ``mon_wandb``'s sink writes its rows into that run (no run of the engine's own)."""
    from tests.support.wandb_reader import read_history

    run_script("start_aftereffect.py", tmp_path, "--user-wandb", "--arms", "off,mon_wandb",
               "--json", str(tmp_path / "a.json"), "--records", str(tmp_path / "records"))
    assert json.loads((tmp_path / "a.json").read_text())["user_wandb"] is True
    runs = list(tmp_path.rglob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = read_history(runs[0])
    losses = [r for r in history if "user/loss" in r]  # (rows queued at a stop take records
    assert len(losses) == 2 * 2 * (2 + 4)  # of their own) 2 rounds, 2 arms, burn-in + counted
    assert len({r["gpulens/step"] for r in history if "gpulens/step" in r}) == 2 * 4


def test_engine_priority_quick_starts_each_arms_engine_at_its_nice(tmp_path: Path) -> None:
    """The loop's own W&B run gets its loss every step in every arm; each monitor arm's
    engine runs at its ``GPULENS_ENGINE_NICE`` (recorded by the script as it ran)."""
    from tests.support.wandb_reader import read_history

    out = run_script("engine_priority.py", tmp_path, "--json", str(tmp_path / "e.json"))
    data = json.loads((tmp_path / "e.json").read_text())
    assert list(data["values"]) == ["off", "off_b", "nice0", "nice10"] and data["rounds"] == 2
    assert data["engine_nice"] == {"nice0": [0, 0], "nice10": [10, 10]}
    assert {c["arm"] for c in data["comparisons"]} == {"off_b", "nice0", "nice10"}
    assert all(c["aa_envelope"] is not None for c in data["comparisons"] if c["arm"] != "off_b")
    (run,) = tmp_path.rglob("offline-run-*/run-*.wandb")
    losses = [r for r in read_history(run) if "user/loss" in r]
    assert len(losses) == 2 * 4 * (2 + 6)  # rounds x arms x (burn-in + counted steps)
    assert "| nice10 |" in out and "CPUs busy" in out


def test_handoff_cost_times_the_view_and_the_old_write_by_gpus(tmp_path: Path) -> None:
    """verl's ``RowHandoff.write`` on the training thread, timed on a simulated run's rows at
    each GPU count beside the comprehension it replaced; the view keeps a handful of keys."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "handoff_cost.py"), "--gpus", "1,4", "--steps", "4",
         "--repeat", "2", "--json", str(tmp_path / "h.json")],
        cwd=tmp_path, env=bench_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads((tmp_path / "h.json").read_text())
    assert [f["gpus"] for f in figures] == [1, 4]
    assert figures[1]["keys"] > figures[0]["keys"] > figures[0]["kept"] > 0
    assert all(f["view_us"] > 0 and f["old_us"] > 0 and f["rows"] >= 2 for f in figures)
    assert "| GPUs | keys in a row |" in proc.stdout
