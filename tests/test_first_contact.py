"""What a newcomer meets before any GPU figure: `make` says what it installs while pip is
quiet, and the Hydra example leaves its output under its run dir (tests/test_examples.py:
test_hydra_example_writes_under_its_run_dir, which shares a run of the example), which git
ignores and `make clean` removes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
# stands in for python: `-m venv DIR` makes DIR/bin/python (this script); `-m pip install
# ... --target DIR ... uv` makes DIR/bin/uv, a stand-in that says what it was asked (or fails
# when FAKE_UV=fail); anything else says what it was asked to do
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
# `pip config get`: no find-links configured
if [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "$3" = "config" ]; then exit 1; fi
echo "RAN python $*"
case "$*" in *" --target "*" uv")
    [ "$FAKE_UV" = "fail" ] && exit 1
    target=$(echo "$*" | sed 's/.* --target \\([^ ]*\\) .*/\\1/')
    mkdir -p "$target/bin"; printf '#!/bin/sh\\necho "RAN uv $*"\\n' > "$target/bin/uv"
    chmod +x "$target/bin/uv";;
esac
"""


def make() -> str:
    exe = shutil.which("make")
    if exe is None:
        pytest.skip("make is not installed")
    return exe


@pytest.mark.parametrize(("uv", "links"), [("ok", "/opt/wheels-x"), ("fail", "/opt/wheels-x"),
                                         ("ok", "")])
def test_make_says_what_it_installs_before_each_quiet_step(tmp_path: Path, uv: str,
                                                           links: str) -> None:
    """uv first (installed beside the environment); the CPU torch by uv from pip's find-links,
    asked for as ``+cpu`` so that only the wheel on disk matches; then uv does the rest. Where
    uv cannot be installed, or no find-links are configured, pip installs torch (and, without
    uv, the rest)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    if links:
        env["PIP_FIND_LINKS"] = links
    proc = subprocess.run([make(), "--no-print-directory", "-C", str(ROOT), "venv",
                           f"VENV={venv}", f"PYTHON={fake}"],
                          capture_output=True, text=True, timeout=240,
                          env={**env, "FAKE_UV": uv})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    ran = [i for i, line in enumerate(lines)
           if line.startswith(("RAN python -m pip install", "RAN uv pip install"))]
    assert len(ran) == 4, proc.stdout
    told = [i for i, line in enumerate(lines) if line.startswith("gpulens make [")]
    # a line before every install step, saying what comes and that it takes a while
    steps = ("[1/4] upgrading pip", "[2/4] installing uv beside the environment",
             "[3/4] installing torch==2.13.0", "[4/4] installing gpulens with every extra")
    for step, i in zip(steps, ran, strict=True):
        assert i - 1 in told and step in lines[i - 1], (step, lines[i - 1])
    assert f"--target {venv}/.uv" in lines[ran[1]]
    if uv == "ok" and links:
        # --compile-bytecode: with PYTHONDONTWRITEBYTECODE set no process writes the .pyc files
        assert lines[ran[2]] == (f"RAN uv pip install --quiet --compile-bytecode --python "
                                 f"{venv}/bin/python --find-links {links} torch==2.13.0+cpu")
    else:
        assert lines[ran[2]] == "RAN python -m pip install --quiet --quiet torch==2.13.0"
    if uv == "ok":
        assert lines[ran[3]] == (f"RAN uv pip install --quiet --compile-bytecode --python "
                                 f"{venv}/bin/python -e .[all,dev] torch==2.13.0")
    else:
        assert "uv could not be installed: pip does steps 3 and 4" in proc.stdout
        assert lines[ran[3]] == "RAN python -m pip install --quiet --quiet -e .[all,dev]"
    assert "The first install takes" in proc.stdout and "quiet meanwhile" in proc.stdout
    assert lines[-1].endswith(f"{venv} is ready")
    assert (venv / ".installed").exists()


def test_make_clean_removes_the_hydra_outputs(tmp_path: Path) -> None:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for folder in ("outputs/hydra_app/2026-01-01_00-00-00", "multirun/hydra_app/x", "keep"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "gpulens.jsonl").write_text("{}\n")
    proc = subprocess.run([make(), "--no-print-directory", "clean"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    assert (tmp_path / "keep" / "gpulens.jsonl").exists()


def test_git_ignores_the_hydra_outputs() -> None:
    git = shutil.which("git")
    if git is None or subprocess.run([git, "-C", str(ROOT), "rev-parse"],
                                     capture_output=True, timeout=120).returncode != 0:
        pytest.skip("not a git checkout")
    for path in ("outputs/hydra_app/2026-01-01_00-00-00/gpulens.jsonl",
                 "multirun/hydra_app/x/0/gpulens.jsonl"):
        proc = subprocess.run([git, "-C", str(ROOT), "check-ignore", "-q", "--no-index", path],
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, f"{path} is not ignored"
