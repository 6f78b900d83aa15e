"""The run folder's codec: every record a run writes and reads back goes through here, one codec per file kind.

A ``knit run`` folder holds three kinds of file, each written by one process and read by others:

* JSON documents (``run_config.json``, ``summary.json``, ``trainer_rank{r}.json``, ``rollout.json``):
  :func:`write_document` / :func:`read_document`;
* JSON-lines logs, appended and flushed one record at a time so a kill loses at most the line being written
  (``progress.jsonl``, ``resumes.jsonl``, ``events/*.jsonl``, the rank reports' side files):
  :class:`LineWriter` / :func:`append_line` / :func:`read_lines` (a last line cut short is left out);
* Arrow frames as Parquet (``consumed.parquet``, ``metadata.parquet``, ``ledger.parquet``):
  :func:`write_frame` / :func:`read_frame`, checked against the frame's schema (``schemas.run_frames``).

The records are pydantic models (``schemas.ledger``, ``schemas.run_records``, ``schemas.run_summary``). A file
that does not parse, or a record that lacks a field or holds a value of the wrong type, raises
:class:`RunFolderError` naming the file, the line (for a log) and the field, never a ``KeyError``.

The folder's contract version (:data:`CONTRACT_VERSION`) is written in ``run_config.json``
(:func:`write_run_config`) and ``summary.json``; a folder of another version is refused by name
(:func:`read_run_config`, :func:`check_version`).

Example:
    >>> import tempfile
    >>> from pydantic import BaseModel
    >>> class Line(BaseModel):
    ...     step: int
    >>> path = Path(tempfile.mkdtemp()) / "progress.jsonl"
    >>> append_line(path, Line(step=1))
    >>> [x.step for x in read_lines(Line, path)]
    [1]
    >>> _ = path.write_text('{"stp": 2}\\n')
    >>> list(read_lines(Line, path))
    Traceback (most recent call last):
    ...
    schemas.run_folder.RunFolderError: ...progress.jsonl: line 1: field step: Field required
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas import documents

CONTRACT_VERSION = 1
"""The version of the run folder's records. A change a reader of the version before cannot take (a field renamed,
removed, or retyped) raises it."""

RUN_CONFIG = "run_config.json"
SUMMARY = "summary.json"
POLICY_SUMMARY = "policy_summary.json"
PROGRESS = "progress.jsonl"
RESUMES = "resumes.jsonl"
ROLLOUT_REPORT = "rollout.json"
CONSUMED = "consumed.parquet"
METADATA = "metadata.parquet"
LEDGER = "ledger.parquet"
EVENTS = "events"
"""The run folder's sub-folder of event logs (``schemas.ledger``)."""
ROLLOUT_EVENTS = "rollout.jsonl"
TRAINED_EVENTS = "trained.jsonl"

M = TypeVar("M")
T = TypeVar("T")


class RunFolderError(ValueError):
    """A run-folder file that cannot be read as its record: damaged, of another contract version, or lacking a field.

    ``path`` is the file, ``line`` the line of a log (1-based; None for a document or frame), ``field`` the dotted
    field or column (None when the whole file is wrong).
    """

    def __init__(self, path: str | Path, problem: str, *, field: str | None = None, line: int | None = None) -> None:
        self.path, self.field, self.line, self.problem = str(path), field, line, problem
        where = "".join((str(path), f": line {line}" if line is not None else "",
                         f": field {field}" if field is not None else ""))
        super().__init__(f"{where}: {problem}")


def _adapter(model: Any) -> TypeAdapter[Any]:
    return model if isinstance(model, TypeAdapter) else TypeAdapter(model)


def _invalid(path: Path, exc: ValidationError, line: int | None = None) -> RunFolderError:
    """The first error of ``exc`` as a :class:`RunFolderError` naming its field."""
    first = exc.errors()[0]  # its location: the fields from the record down (a union's member by its kind)
    return RunFolderError(path, first["msg"], field=".".join(str(p) for p in first["loc"]) or None, line=line)


def parse(model: type[M] | TypeAdapter[M], doc: Any, path: str | Path, *, line: int | None = None) -> M:
    """``doc`` (parsed JSON) as ``model``, a :class:`RunFolderError` naming ``path``, ``line`` and the field if not."""
    try:
        return _adapter(model).validate_python(doc)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise _invalid(Path(path), exc, line) from None


def read_document(model: type[M] | TypeAdapter[M], path: str | Path) -> M:
    """The record in the JSON document at ``path``.

    Raises:
        RunFolderError: the file is missing, not JSON, or not a ``model``.
    """
    p = Path(path)
    return parse(model, _load_json(p), p)


def _load_json(p: Path) -> Any:
    """The JSON document in ``p`` (a typed error naming it when it is missing or not JSON)."""
    try:
        return json.loads(p.read_bytes())
    except FileNotFoundError:
        raise RunFolderError(p, "missing") from None
    except ValueError as exc:
        raise RunFolderError(p, f"not valid JSON ({exc})") from None


def dumps(record: Any, *, indent: int | None = None) -> str:
    """``record`` (a model, or what a ``TypeAdapter`` serialises) as JSON text."""
    if isinstance(record, BaseModel):
        return record.model_dump_json(indent=indent)
    return json.dumps(TypeAdapter(type(record)).dump_python(record, mode="json"), indent=indent)


def write_document(record: BaseModel, path: str | Path, *, indent: int | None = 1) -> Path:
    """Write ``record`` as the JSON document ``path`` (whole or not at all: a temporary file renamed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(record.model_dump_json(indent=indent))
    os.replace(tmp, p)
    return p


def read_lines(model: type[M] | TypeAdapter[M], path: str | Path) -> Iterator[M]:
    """The records of the JSON-lines log at ``path``, in order (none when it does not exist); a last line cut short by
    a kill is left out.

    Raises:
        RunFolderError: a whole line that is not JSON or not a ``model`` (naming the line and the field).
    """
    p = Path(path)
    if not p.exists():
        return
    adapter = _adapter(model)
    with p.open() as f:
        for n, text in enumerate(f, start=1):
            if not text.endswith("\n"):
                return
            if not text.strip():
                continue
            try:
                doc = json.loads(text)
            except ValueError as exc:
                raise RunFolderError(p, f"not valid JSON ({exc})", line=n) from None
            yield parse(adapter, doc, p, line=n)


def append_line(path: str | Path, record: BaseModel) -> None:
    """Append one record to the JSON-lines log ``path`` (its folder made)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(record.model_dump_json() + "\n")


def write_lines(path: str | Path, records: list[Any]) -> None:
    """Write the JSON-lines log ``path`` anew with ``records`` (models)."""
    Path(path).write_text("".join(r.model_dump_json() + "\n" for r in records))


class LineWriter:
    """A JSON-lines log open for a process's life: each record appended and flushed at once (thread-safe).

    ``path=None`` writes nothing (a process told to keep no log).
    """

    def __init__(self, path: str | Path | None, *, mode: str = "a") -> None:
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, mode)  # noqa: SIM115 - open for the writer's life, closed by close()

    @property
    def name(self) -> str | None:
        """The log's path (None: none is written)."""
        return None if self._file is None else self._file.name

    def write(self, record: Any) -> None:
        """Append ``record`` (a model, or a value its ``TypeAdapter`` serialises) and flush."""
        with self._lock:
            if self._file is not None:
                self._file.write(dumps(record) + "\n")
                self._file.flush()

    def sync(self) -> None:
        """Make what was written durable."""
        with self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the log (safe to call twice)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_frame(path: str | Path, schema: pa.Schema, *, required: Collection[str] | None = None) -> pa.Table:
    """The Parquet frame at ``path``, checked against ``schema``: the ``required`` columns (default: every field of
    ``schema``) present, each column of ``schema`` it holds with a type that casts to the field's; columns beyond the
    schema (a run's quota columns) kept.

    Raises:
        RunFolderError: the file is missing or not Parquet, or a column is missing or of another type.
    """
    p = Path(path)
    try:
        table = pq.read_table(p)
    except FileNotFoundError:
        raise RunFolderError(p, "missing") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise RunFolderError(p, f"not a Parquet file ({exc})") from None
    return conform(table, schema, p, required=required)


def conform(table: pa.Table, schema: pa.Schema, path: str | Path, *,
            required: Collection[str] | None = None) -> pa.Table:
    """``table`` with its columns of ``schema`` cast to their types (the others kept), or a :class:`RunFolderError`
    naming ``path`` and the column; ``required``: the columns it must hold (default: every field of ``schema``)."""
    for name in schema.names if required is None else required:
        if name not in table.column_names:
            raise RunFolderError(path, "column missing", field=name)
    for f in schema:
        if f.name not in table.column_names:
            continue
        column = table.column(f.name)
        if column.type != f.type:
            try:
                column = column.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise RunFolderError(path, f"column of type {column.type}, the contract says {f.type}",
                                     field=f.name) from None
            table = table.set_column(table.column_names.index(f.name), f.name, column)
    return table


def write_frame(table: pa.Table, path: str | Path, schema: pa.Schema) -> Path:
    """Write ``table`` (checked against ``schema``: :func:`conform`) as the Parquet frame ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(conform(table, schema, p), p)
    return p


# ---- the contract version --------------------------------------------------------------------


def check_version(version: Any, path: str | Path, field: str = "contract_version") -> None:
    """Refuse a record of another contract version (``version`` None: written before the folder carried one)."""
    if version != CONTRACT_VERSION:
        what = "absent (a run folder older than the contract)" if version is None else f"{version!r}"
        raise RunFolderError(path, f"contract version {what}; this knit reads version {CONTRACT_VERSION}",
                             field=field)


def write_run_config(config: Any, path: str | Path) -> Path:
    """``run_config.json``: ``{"contract_version", "config"}``, the run's config (a dataclass,
    ``schemas.documents``) under the folder's contract version."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {"contract_version": CONTRACT_VERSION, "config": json.loads(documents.dump(config))}
    p.write_text(json.dumps(doc, indent=1))
    return p


def check_run_folder(out: str | Path) -> None:
    """Refuse the run folder ``out`` unless its ``run_config.json`` carries this contract version.

    Raises:
        RunFolderError: naming ``run_config.json`` and ``contract_version`` (or the file, missing or damaged).
    """
    _run_config_doc(Path(out) / RUN_CONFIG)


def _run_config_doc(p: Path) -> dict[str, Any]:
    doc = _load_json(p)
    if not isinstance(doc, dict):
        raise RunFolderError(p, "not a JSON object")
    check_version(doc.get("contract_version"), p)
    return doc


def read_run_config(cls: type[T], path: str | Path) -> T:
    """The run's config in ``run_config.json`` (a ``cls``), after its contract version is checked.

    Raises:
        RunFolderError: the file is missing or damaged, of another version, or its config is not a ``cls``.
    """
    p = Path(path)
    doc = _run_config_doc(p)
    if not isinstance(doc.get("config"), dict):
        raise RunFolderError(p, "missing", field="config")
    try:
        return documents.load(cls, json.dumps(doc["config"]))
    except documents.ConfigDocumentError as exc:
        raise RunFolderError(p, str(exc), field="config") from None
