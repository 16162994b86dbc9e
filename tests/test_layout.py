"""The package's layout, checked by reading its source (``ast``), so a regression fails here.

* The shared types (``Row``, ``Event``, ``GpuInfo``, ``RunContext``, ``Mark``, ``MarkFields``,
  ``SinkSpec``, ``SinkStats``) come from :mod:`gpulens.model` in the engine's layers
  (``sources/``, ``transport/``, ``engine/``), and those layers take nothing from
  :mod:`gpulens.sinks` but the step logger that writes the sinks and the ``Sink`` protocol
  (:data:`SINK_MACHINERY`).
* The engine's layers import nothing of the client (monitor, integrations, command line,
  the distributed gather's start exchange) nor the test doubles of :mod:`gpulens.testing`;
  of the gather they take only its per-row work (:data:`ENGINE_MAY_RUN`), which a one-node
  job's engines run.
* No file under ``src/`` is longer than 600 lines.
* :mod:`gpulens.model` imports nothing of gpulens but :mod:`gpulens.schema`.
* No block of six or more code lines stands in two files of one group (the rules; the sinks;
  the integrations: the framework callbacks, the session they share, the others).  A line is
  compared without its white space and comments; blank and comment-only lines are passed
  over.  What two files of a group share belongs in one helper.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gpulens"
ENGINE_LAYERS = ("sources", "transport", "engine")
SHARED_TYPES = frozenset({"Row", "Event", "GpuInfo", "RunContext", "Mark", "MarkFields",
                          "SinkSpec", "SinkStats"})
SINK_MACHINERY: dict[str, frozenset[str]] = {
    # the Sink protocol, the type of what the engine builds from a SinkSpec
    "gpulens.sinks.base": frozenset({"Sink"}),
    # the per-sink writer the engine writes its sinks with (the flow's step logger -> sinks)
    "gpulens.sinks.writer": frozenset({"StepLogger", "STALL_S"}),
}
CLIENT = ("gpulens.monitor", "gpulens.integrations", "gpulens.cli", "gpulens.distributed",
          "gpulens.testing")
ENGINE_MAY_RUN = ("gpulens.distributed.rows",)
"""Client modules made to run in the engine too (torch-free: ``tests/test_import_light.py``)."""
MAX_LINES = 600
SHARED_LINES = 6
"""Code lines in a row that two files of a group may not share."""
GROUPS: dict[str, list[Path]] = {
    "rules": sorted((PACKAGE / "engine" / "rules").glob("*.py")),
    "sinks": sorted((PACKAGE / "sinks").glob("*.py")),
    # the framework callbacks, the session they share and the other integrations
    "integrations": sorted((PACKAGE / "integrations").glob("*.py")),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every import in the file, at any depth (``names`` is empty for a
    plain ``import module``); relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    out: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            out.append((module, tuple(alias.name for alias in node.names)))
    return out


def _modules(*layers: str) -> list[Path]:
    return sorted(p for layer in layers for p in (PACKAGE / layer).rglob("*.py"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_layers_exist() -> None:
    """The checks below read these folders: a rename must not make them pass on nothing."""
    for layer in ENGINE_LAYERS:
        assert len(_modules(layer)) >= 3, layer


@pytest.mark.parametrize("path", _modules(*ENGINE_LAYERS), ids=_module_name)
def test_engine_layers_take_shared_types_from_model_and_only_sink_machinery(path: Path) -> None:
    wrong = []
    for module, names in _imports(path):
        shared = SHARED_TYPES.intersection(names)
        if shared and module != "gpulens.model":
            wrong.append(f"{sorted(shared)} from {module} (they live in gpulens.model)")
        if _within(module, "gpulens.sinks"):
            allowed = SINK_MACHINERY.get(module)
            extra = sorted(set(names) - allowed) if allowed is not None and names else None
            if allowed is None or extra is None or extra:
                wrong.append(f"{module}: {', '.join(extra or names) or 'the module'} (the "
                             "engine's layers take only " + ", ".join(
                                 f"{m}.{{{', '.join(sorted(n))}}}"
                                 for m, n in SINK_MACHINERY.items()) + ")")
    assert not wrong, f"{_module_name(path)} imports " + "; ".join(wrong)


@pytest.mark.parametrize("path", _modules(*ENGINE_LAYERS), ids=_module_name)
def test_engine_layers_import_nothing_of_the_client(path: Path) -> None:
    wrong = sorted({module for module, _ in _imports(path)
                    if any(_within(module, c) for c in CLIENT) and module not in ENGINE_MAY_RUN})
    assert not wrong, f"{_module_name(path)} imports {wrong}"


def test_no_file_in_src_is_over_600_lines() -> None:
    long = {}
    for path in sorted(SRC.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            with path.open("rb") as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                long[str(path.relative_to(SRC))] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_model_imports_only_the_schema_of_gpulens() -> None:
    path = PACKAGE / "model.py"
    assert path.is_file()
    ours = sorted({module for module, _ in _imports(path)
                   if _within(module, "gpulens") and module != "gpulens.schema"})
    assert not ours, f"gpulens.model imports {ours}"


def _code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, the line without white space and comment)`` of each line that has code
    (docstrings count as code; a ``#`` inside a string is not a comment)."""
    cut: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            cut[tok.start[0]] = tok.start[1]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = "".join(line[:cut.get(number, len(line))].split())
        if code:
            out.append((number, code))
    return out


def shared_blocks(files: dict[str, str], n: int = SHARED_LINES) -> list[str]:
    """Each longest run of ``n`` or more code lines (:func:`_code_lines`) that two of ``files``
    (name -> text) share, as ``"a.py:3-10 ~ b.py:40-47"``."""
    lines = {name: _code_lines(text) for name, text in files.items()}
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for name, code in lines.items():
        for k in range(len(code) - n + 1):
            seen.setdefault(tuple(c for _, c in code[k:k + n]), []).append((name, k))
    # a window that stands in two files; windows that follow one another on both sides
    # make one block
    starts = sorted({(a, i, b, j) for places in seen.values() for a, i in places
                     for b, j in places if a < b})
    blocks: list[str] = []
    taken = set(starts)
    for a, i, b, j in starts:
        if (a, i - 1, b, j - 1) in taken:
            continue  # inside a block begun above
        length = n
        while (a, i + length - n + 1, b, j + length - n + 1) in taken:
            length += 1
        blocks.append(f"{a}:{lines[a][i][0]}-{lines[a][i + length - 1][0]} ~ "
                      f"{b}:{lines[b][j][0]}-{lines[b][j + length - 1][0]}")
    return blocks


def test_shared_blocks_finds_a_copied_block_whatever_its_spacing_and_comments() -> None:
    body = [f"x{k} = f(x{k - 1}, {k})" for k in range(1, 9)]
    one = "def a():\n" + "".join(f"    {line}\n" for line in body) + "    return 1\n"
    # the same eight lines at another indentation, spaced out and commented
    two = ("class B:\n    def b(self):\n" + "".join(
        f"        {line.replace(' = ', '=')}  # step {k}\n\n        # a note\n"
        for k, line in enumerate(body)) + "        return 2\n")
    assert shared_blocks({"one.py": one, "two.py": two}) == ["one.py:2-9 ~ two.py:3-24"]
    # five lines in common are allowed; a string holding "#" is code, not a comment
    five = "".join(f"{line}\n" for line in body[:5]) + "y = '# not a comment'\n"
    assert shared_blocks({"one.py": one, "five.py": five}) == []
    assert shared_blocks({"one.py": one}) == []  # a file may repeat itself: not this check


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_no_block_of_six_lines_stands_in_two_files_of_a_group(group: str) -> None:
    paths = GROUPS[group]
    assert len(paths) >= 5 and all(p.is_file() for p in paths), paths
    shared = shared_blocks({str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8")
                            for p in paths})
    assert not shared, (f"the {group} share blocks of {SHARED_LINES}+ lines (move them into "
                        f"one helper): " + "; ".join(shared))


def test_the_readme_names_every_folder_of_the_package() -> None:
    """The README's "How it fits together" shows the folders as they are: each folder of
    ``src/gpulens`` (and ``engine/rules``) is named there, and each name there is a folder."""
    readme = (SRC.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## How it fits together", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\b([a-z_]+)/", section))
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders |= {p.name for p in (PACKAGE / "engine").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - named == set(), f"folders the README does not show: {folders - named}"
    assert named - folders == set(), f"the README shows folders that are not there: " \
                                     f"{named - folders}"
