"""The gpulens.work modules import no torch, transformers or other heavy package: the engine
imports them, and torch is imported only by the functions that need it."""

from __future__ import annotations

import sys

import pytest

from tests.test_import_light import CORE, HEAVY, _new_modules

WORK_MODULES = (
    "gpulens.work",
    "gpulens.work.flops",
    "gpulens.work.peaks",
    "gpulens.work.precision",
    "gpulens.work.mfu",
    "gpulens.work.counter",
    "gpulens.work.hf",
)


@pytest.mark.parametrize("module", WORK_MODULES)
def test_work_modules_are_light(module: str) -> None:
    tops = {name.split(".")[0] for name in _new_modules(module)}
    assert "gpulens" in tops
    assert sorted(tops.intersection(HEAVY)) == []
    foreign = sorted(t for t in tops if t not in sys.stdlib_module_names and t not in CORE)
    assert foreign == []
