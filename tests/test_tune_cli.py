"""``gpulens tune MODULE:FUNCTION``: the report on stdout, the HTML/Markdown/JSON files, one-line
errors, and ``--isolate`` (each trial in a fresh process)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpulens.cli import main
from gpulens.tune import Config, TuneResult
from tests.support.tune_load import WORKER_STARTS_ENV

JOB = "tests.support.tune_load:cli_job"
QUICK = ["--workers", "0", "--warmup", "1", "--steps", "2", "--no-loader-options"]


def test_tune_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html, md, js = tmp_path / "t.html", tmp_path / "t.md", tmp_path / "t.json"
    rc = main(["tune", JOB, "--batch-sizes", "4,8,16,32,64", *QUICK, "-o", str(html),
               "--markdown", str(md), "--json", str(js)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Use batch 16, 0 workers" in out and "against the current setting (batch 4" in out
    assert "Out of memory from batch 64" in out
    assert "gpulens tune: trial 1/~" in err and f"wrote HTML report: {html}" in err
    result = TuneResult.from_dict(json.loads(js.read_text()))
    assert result.chosen is not None and result.chosen.config == Config(16, 0)
    assert result.oom_batch == 64
    assert result.confirm is not None and result.trials[-1] is result.confirm
    assert '<svg class="chart"' in html.read_text() and "(chosen)" in md.read_text()


@pytest.mark.parametrize(("spec", "message"), [
    ("nocolon", "expected MODULE:FUNCTION"),
    ("tests.support.no_such_module:f", "cannot import 'tests.support.no_such_module'"),
    ("tests.support.tune_load:missing", "has no function 'missing'"),
    ("tests.support.tune_load:not_a_job", "returned a int, not a gpulens.tune.TuneJob"),
])
def test_a_bad_job_is_one_line(spec: str, message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", spec, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpulens tune: error: ") and message in err[0]


def test_a_value_error_of_the_users_code_keeps_its_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Only gpulens's own errors are one line: the user's setup (or step) raising ValueError is
    the user's bug, not a bad argument (no exit code 2 and a line that looks like gpulens's)."""
    with pytest.raises(ValueError, match="learning rate must be positive"):
        main(["tune", "tests.support.tune_load:setup_raises_value_error", "--quiet"])
    assert "gpulens tune: error" not in capsys.readouterr().err


def test_bad_settings_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", JOB, "--min-batch", "64", "--max-batch", "8", "--quiet"]) == 2
    assert "max_batch (8) is below min_batch (64)" in capsys.readouterr().err


def test_isolated_trials_run_in_fresh_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    js = tmp_path / "t.json"
    starts = tmp_path / "worker-starts.txt"
    monkeypatch.setenv(WORKER_STARTS_ENV, str(starts))
    # two processes: the first describes the job and measures batch 4 (the current setting),
    # the second runs out of memory at 64; a loader worker in each (not a daemon process)
    rc = main(["tune", JOB + "_one_worker", "--isolate", "--batch-sizes", "4,64", "--workers", "1",
               "--warmup", "1", "--steps", "2", "--no-loader-options", "--no-confirm",
               "--json", str(js), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    result = TuneResult.from_dict(json.loads(js.read_text()))
    assert [(t.config.batch_size, t.status) for t in result.trials] == [(4, "ok"), (64, "oom")]
    assert result.chosen is not None and result.chosen.config == Config(4, 1)
    assert result.notes[0] == "each trial ran in a fresh process"
    # the trial processes are spawned (CUDA), their loader workers start as the user's
    # training starts them: the platform's default, not spawned again (a fresh interpreter
    # that imports torch: seconds a trial)
    assert starts.read_text().split() == [multiprocessing.get_all_start_methods()[0]] * 2


def test_ctrl_c_reports_the_trials_that_finished(tmp_path: Path) -> None:
    """Ctrl-C once a trial has finished: the running trial stops, one line says so, the report
    and the files hold the finished trials, marked partial, and the exit code is 130. Sent as a
    terminal sends it, to the process group (the loader's worker gets it too)."""
    js, md = tmp_path / "t.json", tmp_path / "t.md"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "tune", JOB + "_one_worker", "--workers", "1",
         "--steps", "20", "--json", str(js), "--markdown", str(md)],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:  # the progress lines, one per finished trial
            seen.append(line)
            if line.startswith("gpulens tune: trial 1/"):
                break
        assert seen and seen[-1].startswith("gpulens tune: trial 1/"), "".join(seen)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.startswith("gpulens tune: interrupted")]
    assert len(lines) == 1, err
    done = int(lines[0].split(" after ")[1].split()[0])
    assert lines[0] == (f"gpulens tune: interrupted (Ctrl-C) after {done} finished trial(s); "
                        "their results follow, marked partial")
    assert done >= 1 and err.count("gpulens tune: trial ") == done
    assert "(partial: interrupted)" in out and "stopped early: interrupted" in out
    result = TuneResult.from_dict(json.loads(js.read_text()))
    assert result.stopped == "interrupted" and len(result.trials) == done
    first = result.trials[0]
    assert (first.role, first.config, first.status) == ("current", Config(4, 1), "ok")
    assert first.samples_per_s is not None and first.samples_per_s > 0
    assert result.chosen is not None and result.confirm is None
    assert "(partial: interrupted)" in md.read_text() and "(chosen)" in md.read_text()
