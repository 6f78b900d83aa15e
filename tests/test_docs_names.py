"""The README and docs/ name only what exists: every ``path/to/file.py`` and ``package.module[.name]`` in backticks.

A dotted name resolves to the longest prefix that is a module of the project, and the rest to names defined in it
(a function, class, assignment or import; a method or attribute of a class, ``self.x`` included). What a class
inherits is not followed: a name missing from a class with bases passes. In the README's package table, a bare
``file.py`` in a package's row must be a file of that package. The sources are read, never imported (no extra
needs to be installed).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "flight_store", "admission", "connectors", "train", "bench", "launcher")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RETIRED = {"bench.transfer"}
"""Named by docs/benchmarks.md's record of retired benchmarks, on purpose."""
_FILE_SUFFIXES = {"json", "jsonl", "parquet", "log", "md", "png", "txt", "py", "pem", "csv"}
_TICKED = re.compile(r"`([^`]+)`")
_PATH = re.compile(rf"^((?:{'|'.join(PACKAGES)}|tests)/[\w/]*\w\.py)$")
_DOTTED = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?:\(.*\))?$")
_TABLE_ROW = re.compile(rf"^\| `({'|'.join(PACKAGES)})/` \|")


def _module_file(dotted: str) -> Path | None:
    base = ROOT / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi")):
        if candidate.exists():
            return candidate
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """Names a module or class body defines -> their node (``None``: a value, not looked into)."""
    out: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, ast.If | ast.Try):
            out.update(_defined([*node.body, *node.orelse]))
    return out


def _has(node: ast.AST | None, names: list[str]) -> bool:
    for name in names:
        if node is None:
            return True
        if isinstance(node, ast.ClassDef):
            found = _defined(node.body)
            found.update({a.attr: None for a in ast.walk(node) if isinstance(a, ast.Attribute)
                          and isinstance(a.value, ast.Name) and a.value.id == "self"})
            if name not in found and node.bases:
                return True
        elif isinstance(node, ast.Module):
            found = _defined(node.body)
        else:
            return True  # a function: its locals are not names the docs point at
        if name not in found:
            return False
        node = found[name]
    return True


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the project, or a name defined in one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:i]))
        if path is not None:
            return i == len(parts) or path.suffix == ".pyi" or _has(ast.parse(path.read_text()), parts[i:])
    return False


def stale_names(doc: Path) -> list[str]:
    """``"file:line: name"`` for each name in ``doc`` that does not exist."""
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        row = _TABLE_ROW.match(line)
        for token in (t.strip() for t in _TICKED.findall(line)):
            path, dotted = _PATH.match(token), _DOTTED.match(token)
            missing = (
                (path is not None and not (ROOT / path.group(1)).exists())
                or (dotted is not None and dotted.group(1) not in RETIRED
                    and dotted.group(1).rsplit(".", 1)[1] not in _FILE_SUFFIXES and not resolves(dotted.group(1)))
                or (row is not None and re.fullmatch(r"\w+\.py", token) is not None
                    and not (ROOT / row.group(1) / token).exists())
            )
            if missing:
                out.append(f"{doc.name}:{n}: {token}")
    return out


def test_docs_name_only_what_exists() -> None:
    stale = [s for doc in DOCS for s in stale_names(doc)]
    assert not stale, stale


def test_a_stale_name_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("`flight_store/reading.py` and `flight_store.reading.StoreReader.fetch` exist;\n"
                   "`train/nowhere.py`, `flight_store.reading.nothing` and `admission.nothing` do not;\n"
                   "`logs/launcher.json` is a file of a run.\n"
                   "| `train/` | `loop.py`, `absent.py` | |\n")
    found = [s.split(": ", 1)[1] for s in stale_names(doc)]
    assert found == ["train/nowhere.py", "flight_store.reading.nothing", "admission.nothing", "absent.py"]
