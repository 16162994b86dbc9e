"""Choose which carried wheels to install on the device machine, and check the result.

The device image already holds torch, lightning, nvidia-ml-py, psutil and many more. The peers
that the overhead benchmark compares against (wandb, mlflow-skinny, nvitop) are not there, and
travel as wheels in ``.whl/`` (their requirements that the image lacks) and ``.whl/fallback/``
(newer copies of packages the image has, used only where the image's version does not satisfy a
requirement). Installing a carried wheel with ``pip install --target DIR`` and
``PYTHONPATH=DIR`` shadows the image's copy, so this script installs as little as possible:

    python3 benchmarks/wheel_plan.py plan  [--wheels .whl]   # prints wheel paths, one a line
    python3 benchmarks/wheel_plan.py check [--wheels .whl]   # after install: every requirement met?

For each distribution in the requirement closure of the roots (wandb, mlflow-skinny, nvitop) it
keeps the image's copy when its version satisfies every requirement on it, else takes the carried
wheel. It reads wheel metadata from the zip files and needs only the standard library and
``packaging`` (taken from the carried fallback wheel if the image lacks it).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

ROOTS = ("wandb", "mlflow-skinny", "nvitop")


def _import_packaging(wheel_dir: Path) -> None:
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:  # a wheel is a zip file: importable from sys.path as it is
        for whl in sorted((wheel_dir / "fallback").glob("packaging-*.whl")):
            sys.path.append(str(whl))


@dataclass
class Wheel:
    """One carried wheel: canonical name, version, path and its Requires-Dist lines."""

    name: str
    version: str
    path: Path
    requires: list[str] = field(default_factory=list)


def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def read_wheels(wheel_dir: Path) -> dict[str, Wheel]:
    """Carried wheels by canonical name; ``.whl/*.whl`` wins over ``.whl/fallback/*.whl``."""
    found: dict[str, Wheel] = {}
    for whl in sorted(wheel_dir.glob("fallback/*.whl")) + sorted(wheel_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(zf.read(meta_name).decode("utf-8"))
        name = _canon(meta["Name"])
        found[name] = Wheel(name, meta["Version"], whl, meta.get_all("Requires-Dist") or [])
    return found


def installed() -> dict[str, tuple[str, list[str]]]:
    """Distributions visible to this interpreter: canonical name -> (version, Requires-Dist)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and _canon(name) not in out:  # first on sys.path wins, as for imports
            out[_canon(name)] = (dist.version, list(dist.requires or []))
    return out


def resolve(
    wheels: dict[str, Wheel], have: dict[str, tuple[str, list[str]]]
) -> tuple[dict[str, str], list[str]]:
    """Pick a provider ("image" or "wheel") for every distribution in the roots' closure.

    Returns (name -> provider, problems). Iterates to a fixed point, since switching a package
    to a carried wheel can bring new requirements.
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    choice: dict[str, str] = {}
    problems: list[str] = []
    for _ in range(20):
        specs: dict[str, list[tuple[str, Requirement]]] = {}
        todo = [(r, "root") for r in ROOTS]
        seen: set[str] = set()
        changed = False
        problems = []
        while todo:
            name, _by = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name not in choice:
                image = name in have and not (name in ROOTS and name in wheels)
                choice[name] = "image" if image else "wheel"
                changed = True
            prov = choice[name]
            if prov == "wheel" and name not in wheels:
                problems.append(f"{name}: needed (by {_by}) but neither in the image nor carried")
                continue
            reqs = wheels[name].requires if prov == "wheel" else have[name][1]
            for line in reqs:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                dep = _canon(req.name)
                specs.setdefault(dep, []).append((name, req))
                todo.append((dep, name))
        for name, wanted in specs.items():
            pick = choice.get(name)
            if pick is None:
                continue
            version: str | None = None
            if pick == "wheel" and name in wheels:
                version = wheels[name].version
            elif pick == "image":
                version = have[name][0]
            if version is None:
                continue
            bad = [(by, r) for by, r in wanted if Version(version) not in r.specifier]
            if not bad:
                continue
            if pick == "image" and name in wheels:
                alt = Version(wheels[name].version)
                if all(alt in r.specifier for _, r in wanted):
                    choice[name] = "wheel"
                    changed = True
                    continue
            problems.extend(f"{name}=={version} does not satisfy {by}: {r}" for by, r in bad)
        choice = {k: v for k, v in choice.items() if k in seen}
        if not changed:
            break
    return choice, problems


def main(argv: list[str] | None = None) -> int:
    """Command line: ``plan`` prints the wheels to install, ``check`` verifies the environment."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("plan", "check"))
    parser.add_argument("--wheels", type=Path, default=Path(".whl"))
    args = parser.parse_args(argv)
    _import_packaging(args.wheels)
    wheels = read_wheels(args.wheels)
    have = installed()
    if args.mode == "plan":
        choice, problems = resolve(wheels, have)
        kept = []
        for name in sorted(choice):
            if choice[name] == "wheel":
                print(wheels[name].path)
            elif name in wheels:
                kept.append(f"{name}=={have[name][0]}")
        if kept:
            print(f"the image's own copies serve: {', '.join(kept)}", file=sys.stderr)
        shadow = sorted(n for n, p in choice.items() if p == "wheel" and n in have)
        if shadow:
            print(f"carried copies shadow the image's: {', '.join(shadow)}", file=sys.stderr)
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        return 1 if problems else 0
    # check: with PYTHONPATH set, every distribution the closure needs is present and satisfies
    # every requirement on it (what `pip check` does, restricted to the roots' closure).
    choice, problems = resolve({}, have)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    missing = [r for r in ROOTS if r not in have]
    for r in missing:
        print(f"PROBLEM: {r} is not installed", file=sys.stderr)
    if not problems and not missing:
        print(
            "wheel check: "
            + ", ".join(f"{r}=={have[r][0]}" for r in ROOTS)
            + f" and {len(choice) - len(ROOTS)} requirements satisfied"
        )
    return 1 if (problems or missing) else 0


if __name__ == "__main__":
    raise SystemExit(main())
