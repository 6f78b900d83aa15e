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

No two modules import each other, directly or around a loop, counting every ``import`` wherever it sits (inside a
function or under ``TYPE_CHECKING`` too): a local import hides an arrow from import-linter, not from the design.
And no two classes of the project share a name.
"""

from __future__ import annotations

import ast
import collections
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


def project_modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(importer: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules ``importer`` (at ``path``) imports, every ``import``/``from`` statement wherever it
    sits; ``from pkg import name`` counts as importing ``pkg.name`` when that is a module (a native one, not in
    ``modules``, adds no arrow), as importing ``pkg`` otherwise."""
    out: set[str] = set()
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            above = package[:len(package) - node.level + 1]
            source = ".".join([*above, *([node.module] if node.module else [])]) if node.level else node.module or ""
            for alias in node.names:
                name = f"{source}.{alias.name}"
                if name in modules:
                    out.add(name)
                elif not list((ROOT / Path(*source.split("."))).glob(f"{alias.name}.*")) and source in modules:
                    out.add(source)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(root: str) -> None:  # iterative: no recursion limit on a deep graph
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_local_imports_included() -> None:
    unknown = [sorted(c) for c in cycles(import_graph())]
    assert not unknown, f"modules that import each other (imports inside functions counted): {unknown}"


def test_a_cycle_is_caught_wherever_its_import_sits(tmp_path: Path) -> None:
    """The check can fail: an import inside a function closes a loop as much as one at the top."""
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"}
    modules["pkg.a"].write_text("from pkg.b import f\n")
    modules["pkg.b"].write_text("def f():\n    from pkg import c\n")
    modules["pkg.c"].write_text("if TYPE_CHECKING:\n    import pkg.a\n")
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [frozenset(modules)]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_one_class_per_name() -> None:
    """Two classes of one name in the project read as one thing in a traceback or a docstring's reference."""
    defined: dict[str, list[str]] = collections.defaultdict(list)
    for name, path in project_modules().items():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(name)
    assert not {c: ms for c, ms in defined.items() if len(ms) > 1}
