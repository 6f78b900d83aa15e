"""The architecture as a test: the contracts in pyproject.toml (import-linter), strings included.

The contracts (``[tool.importlinter]``): ``bench`` on top, then ``launcher``, then ``train | connectors``
(independent), then ``admission | flight_store`` (independent), then ``schemas``; the planner imports
neither pyarrow (so no Flight), torch nor an engine; the store neither torch nor an engine; schemas
nothing heavy; the trainer never vLLM; the rollout never Megatron. Only the benchmarks import the launcher.

Import statements are not the only arrows: a ``"package.module:function"`` string resolved at run
time, or ``[sys.executable, "-m", "package.module"]``, reaches another module just the same. Every
such string in the project's code is added to the import graph as an import of the module that
names it, and must keep the same contracts (and name a module that exists).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

importlinter = pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "flight_store", "admission", "connectors", "train", "bench", "launcher")
_TARGET = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.\w+)*):\w+(?:\.\w+)*$")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def named_targets(tree: ast.AST) -> list[str]:
    """Modules a source names as strings: ``"pkg.mod:function"``, and ``"-m", "pkg.mod"`` in a list or call."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _TARGET.match(node.value)
            if m:
                found.append(m.group(1))
        elts = node.elts if isinstance(node, ast.List | ast.Tuple) else node.args if isinstance(node, ast.Call) else []
        for a, b in itertools.pairwise(elts):
            if (isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant)
                    and isinstance(b.value, str) and b.value.split(".")[0] in PACKAGES):
                found.append(b.value)
    return found


def string_arrows() -> list[tuple[str, str]]:
    """``(importer, imported)`` for every module named as a string in the project's packages."""
    arrows = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in named_targets(ast.parse(path.read_text(), filename=str(path))):
                arrows.append((module_name(path), target))
    return arrows


def _lint(extra_arrows: list[tuple[str, str]]) -> bool:
    """import-linter over the import graph plus ``extra_arrows``; True when every contract is kept."""
    from importlinter import configuration
    from importlinter.adapters.building import GraphBuilder
    from importlinter.application import use_cases
    from importlinter.application.app_config import settings

    class WithStrings(GraphBuilder):  # type: ignore[misc]
        def build(self, *args: Any, **kwargs: Any) -> Any:
            graph = super().build(*args, **kwargs)
            for importer, imported in extra_arrows:
                graph.add_import(importer=importer, imported=imported, line_number=0, line_contents="(string)")
            return graph

    configuration.configure()
    settings.configure(GRAPH_BUILDER=WithStrings())
    try:
        return bool(use_cases.lint_imports(str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True,
                                           is_debug_mode=True))
    finally:
        configuration.configure()


def test_every_string_names_a_module_that_exists() -> None:
    arrows = string_arrows()
    missing = [(a, b) for a, b in arrows
               if not (ROOT / Path(*b.split("."))).with_suffix(".py").exists()
               and not (ROOT / Path(*b.split(".")) / "__init__.py").exists()]
    assert not missing, missing


def test_the_code_keeps_every_contract_strings_included() -> None:
    assert _lint(string_arrows()), "a contract is broken: see the report above"


def test_a_forbidden_arrow_is_caught() -> None:
    """The check can fail: the planner naming the store, or the store naming the trainer, breaks a contract."""
    for arrow in [("admission.planner", "flight_store.client"), ("flight_store.server", "train.trainer"),
                  ("schemas.arrow", "flight_store.errors"), ("train.trainer", "launcher.run")]:
        assert not _lint([arrow]), arrow


def test_strings_are_found() -> None:
    code = 'CMDS = ["x", "-m", "train", "--config"]\nREWARD = "connectors.tasks:exact_match_reward"\nprint("a:b")'
    assert sorted(named_targets(ast.parse(code))) == ["connectors.tasks", "train"]


def test_schemas_and_the_planner_never_name_flight() -> None:
    for package in ("schemas", "admission"):
        for path in (ROOT / package).rglob("*.py"):
            assert "pyarrow.flight" not in path.read_text(), path
