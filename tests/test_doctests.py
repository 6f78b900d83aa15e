"""The examples in the code's docstrings run: every ``>>>`` of every module of the project's packages.

A module whose optional heavy dependency (an extra: torch, vLLM, Megatron, DuckDB, Ray) is not installed is
skipped, named with what is missing; everything else must import and its examples must give what they show.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "flight_store", "admission", "connectors", "train", "bench", "launcher")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


WITH_EXAMPLES = sorted(_name(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                       if ">>>" in p.read_text())
"""The modules whose docstrings hold examples."""


def test_examples_are_found() -> None:
    assert "flight_store.publishing" in WITH_EXAMPLES and "admission.planner" in WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an optional extra not installed here
        if exc.name and exc.name.split(".")[0] in PACKAGES:
            raise
        pytest.skip(f"{name} needs {exc.name}, not installed")
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(module, name)
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0, f"{name} has '>>>' but no example doctest finds"
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {name} fail (output above)"
