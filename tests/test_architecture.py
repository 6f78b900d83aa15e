"""The architecture as a test: the contracts in pyproject.toml (import-linter), strings included.

The contracts (``[tool.importlinter]``), as the README draws them: ``bench`` on top (it may import
``launcher``), then ``launcher`` (it imports everything below it), then ``train | connectors``
(independent), then ``admission | flight_store`` (independent), then ``schemas`` at the bottom; the
planner imports neither pyarrow (so no Flight), torch nor an engine; the store neither torch nor an
engine; schemas nothing heavy; the trainer never vLLM; the rollout never Megatron. A test pins the
layers, so the drawing and the contract cannot drift apart.

Import statements are not the only arrows: a ``"package.module:function"`` string resolved at run
time, or ``[sys.executable, "-m", "package.module"]``, reaches another module just the same. Every
such string in the project's code is added to the import graph as an import of the module that
names it, and must keep the same contracts (and name a module that exists).
"""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

importlinter = pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "flight_store", "admission", "connectors", "train", "bench", "launcher")
LAYERS = ["bench", "launcher", "train | connectors", "admission | flight_store", "schemas"]
"""Top to bottom; ``a | b``: side by side, importing neither each other."""
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


def test_the_layers_are_the_drawn_ones() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert sorted(config["root_packages"]) == sorted(PACKAGES)
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert layers["layers"] == LAYERS
    assert not {"containers", "ignore_imports", "unmatched_ignore_imports_alerting"} & set(layers)


def test_a_forbidden_arrow_is_caught() -> None:
    """The check can fail: an arrow upwards, or between two packages side by side, breaks a contract."""
    for arrow in [("launcher.run", "bench._hosts"), ("train.trainer", "launcher.run"),
                  ("train.trainer", "connectors.rollout"), ("connectors.rollout", "train.trainer"),
                  ("admission.planner", "flight_store.client"), ("flight_store.store", "admission.planner"),
                  ("flight_store.server", "train.trainer"), ("schemas.arrow", "flight_store.errors")]:
        assert not _lint([arrow]), arrow


def test_strings_are_found() -> None:
    code = 'CMDS = ["x", "-m", "train", "--config"]\nREWARD = "connectors.tasks:exact_match_reward"\nprint("a:b")'
    assert sorted(named_targets(ast.parse(code))) == ["connectors.tasks", "train"]


def test_schemas_never_name_flight() -> None:
    """Schemas may import pyarrow but not its Flight module; import-linter forbids only whole external packages
    (the planner's ban on all of pyarrow is its contract's)."""
    for path in (ROOT / "schemas").rglob("*.py"):
        assert "pyarrow.flight" not in path.read_text(), path
