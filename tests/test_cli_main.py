"""The ``gpulens`` command line as a whole: help, version, bad subcommands, a light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

GPULENS = [sys.executable, "-m", "gpulens.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPULENS, *args], capture_output=True, text=True, timeout=240)


def test_no_subcommand_prints_usage_and_exits_2() -> None:
    proc = run()
    assert proc.returncode == 2
    for cmd in ("watch", "record", "report", "serve"):
        assert cmd in proc.stderr


def test_version_and_help() -> None:
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gpulens ")
    for cmd in ("watch", "record", "report", "serve"):
        proc = run(cmd, "--help")
        assert proc.returncode == 0 and "usage: gpulens" in proc.stdout, proc.stderr


def test_every_subcommand_and_option_says_what_it_does() -> None:
    import argparse

    from gpulens.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"watch", "record", "report", "serve", "tune"}
    listed = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        assert listed[name], f"{name} has no one-line help in `gpulens --help`"
        assert p.description and len(p.description) > 80, f"{name} has no description"
        for action in p._actions:
            assert action.help and action.help != argparse.SUPPRESS, (
                f"gpulens {name} {'/'.join(action.option_strings) or action.dest}: no help")


def test_help_pages_show_descriptions_and_option_help() -> None:
    proc = run("record", "--help")
    assert "--summary-json FILE   also write the summary as JSON" in proc.stdout
    assert "--summary-md FILE     also write the summary as Markdown" in proc.stdout
    assert "Write one row of GPU telemetry every --interval seconds" in proc.stdout
    proc = run("report", "--help")
    assert "the report shows the last run unless --run chooses" in proc.stdout
    proc = run("watch", "--help")
    assert "85.9 GB = 80.0 GiB" in proc.stdout and "It fits 80 columns" in proc.stdout
    assert "from 100 columns the processes on the GPUs" in proc.stdout
    proc = run("serve", "--help")
    assert "Binds 127.0.0.1 unless --host" in proc.stdout
    assert "gpulens COMMAND --help" in run("--help").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["report"], "the following arguments are required: RUN.jsonl"),
        (["serve", "--port", "http"], "not a port number: 'http'"),
        (["serve", "--port", "-5"], "port must be 0-65535"),
        (["watch", "--interval", "fast"], "not a number: 'fast'"),
        (["report", "x.jsonl", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_one_line_exit_2(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_import_is_light() -> None:
    code = (
        "import sys, gpulens.cli; gpulens.cli.build_parser(); "
        "heavy = [m for m in ('rich', 'prometheus_client', 'torch', 'wandb', 'mlflow', "
        "'gpulens.report', 'gpulens.sinks.prometheus') if m in sys.modules]; print(heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_console_script_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "gpulens"]
    assert ep.value == "gpulens.cli:main"


def test_python_dash_m_gpulens_runs_the_command_line() -> None:
    """``python -m gpulens`` (what a user tries first, as ``python -m pip``) is the command."""
    proc = subprocess.run([sys.executable, "-m", "gpulens", "--help"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: gpulens")
    for cmd in ("watch", "record", "report", "serve", "tune"):
        assert cmd in proc.stdout
