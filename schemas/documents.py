"""Config documents: a component's typed config as validated JSON, the form a child process receives.

Every component is configured by one small dataclass (``StoreConfig``, ``RolloutConfig``,
``TrainConfig``, ...). The process that starts another one never re-types the config as argv: it
writes the config as a JSON document (:func:`dump`) and the child reads it back with
:func:`load`, which validates every field strictly (no ``"5"`` for an int, no unknown field) and
runs the dataclass's own checks (``__post_init__``), so a bad document fails with an error that
names the field before anything starts.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(kw_only=True)
    ... class Cfg:
    ...     steps: int = 3
    >>> load(Cfg, dump(Cfg(steps=5)))
    Cfg(steps=5)
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class ConfigDocumentError(ValueError):
    """A config document that is not valid JSON, has an unknown field, or a value of the wrong type."""


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _dataclasses_in(tp: Any) -> list[type[Any]]:
    """The dataclasses a field annotation may hold (itself, or the members of a union / container)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return [tp]
    return [c for arg in typing.get_args(tp) for c in _dataclasses_in(arg)]


def _unknown_fields(cls: type[Any], doc: Any, where: str) -> list[str]:
    """Dotted paths of keys in ``doc`` that no field of ``cls`` (or of its nested dataclasses) declares."""
    if not isinstance(doc, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    out = [f"{where}{k}" for k in doc if k not in names]
    for name in names & doc.keys():
        inner = _dataclasses_in(hints[name])
        values = doc[name] if isinstance(doc[name], list) else [doc[name]]
        if len(inner) == 1:
            for v in values:
                out += _unknown_fields(inner[0], v, f"{where}{name}.")
    return out


def dump(config: Any) -> bytes:
    """``config`` (a dataclass instance) as a JSON document."""
    return _adapter(type(config)).dump_json(config, indent=1)


def load(cls: type[T], raw: bytes | str) -> T:
    """The ``cls`` instance a JSON document describes, validated strictly.

    Raises:
        ConfigDocumentError: naming the first fields that are wrong.
    """
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        msg = f"{cls.__name__} document is not valid JSON: {exc}"
        raise ConfigDocumentError(msg) from None
    unknown = _unknown_fields(cls, doc, "")
    if unknown:
        msg = f"invalid {cls.__name__} document: unknown field(s) {', '.join(unknown)}"
        raise ConfigDocumentError(msg)
    try:
        return _adapter(cls).validate_json(raw, strict=True)  # type: ignore[no-any-return]
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        msg = f"invalid {cls.__name__} document: {errs}"
        raise ConfigDocumentError(msg) from None


def write(config: Any, path: str | Path) -> Path:
    """Write ``config`` as a document to ``path``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(dump(config))
    return out


def read(cls: type[T], path: str | Path) -> T:
    """The ``cls`` instance in the document at ``path``."""
    return load(cls, Path(path).read_bytes())
