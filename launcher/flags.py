"""Command-line flags derived from a component's config dataclass: one source for every default.

:func:`add_flags` walks a config dataclass (and the dataclasses nested in it) and adds one flag per
field: ``--field-name``, or ``--section.field-name`` where two sections have a field of the same
name. A flag's help is the first line of the docstring written under the field, and its default is
the field's default (shown in the help, never copied: a flag that is not given leaves the field
alone). :func:`build` turns the parsed flags into the config, validated by the dataclass itself
(its ``__post_init__`` checks) and by pydantic, so a bad value fails with an error naming the flag.

Values: ``int``/``float``/``str``/paths as written; ``bool`` as ``--x``/``--no-x``; ``none`` for an
optional field; lists and sets as ``a,b,c``; mappings as ``a=1,b=2``; anything else (e.g. a tuple
of quotas) as JSON.

Example:
    >>> from admission import AdmissionConfig
    >>> parser = argparse.ArgumentParser()
    >>> flags = add_flags(parser, AdmissionConfig)
    >>> args = parser.parse_args(["--train-batch-groups", "8", "--group-size", "4", "--clip-high", "0.28"])
    >>> cfg = build(AdmissionConfig, flags, args)
    >>> cfg.train_batch_groups, cfg.mini_batches, cfg.grpo.clip_high
    (8, 1, 0.28)
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Flag:
    """One leaf field of a config tree and the flag that sets it."""

    path: tuple[str, ...]
    """Field names from the root config down to the leaf."""
    flag: str
    """``--name`` or ``--section.name``."""
    annotation: Any
    """The field's type."""
    owner: type[Any]
    """The dataclass that declares the field."""

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)


def field_docs(cls: type[Any]) -> dict[str, str]:
    """``{field: docstring}`` of the string literals written right under each field of ``cls``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(~?)([^`<]*?)\s*(?:<[^`>]*>)?`")
"""A Sphinx role: colon, role name, colon, then the target in backticks (``~`` keeps its last part; a
``title <target>`` shows the title)."""
_LITERAL = re.compile(r"``(.+?)``")


def plain_text(doc: str) -> str:
    """A docstring's reStructuredText as a terminal shows it: roles and double-backtick literals become their
    text (an attribute role on ``host`` -> host, a class role on ``~a.b.Name`` -> Name, a literal None -> None)."""

    def role(match: re.Match[str]) -> str:
        text = match.group(2)
        return text.rsplit(".", 1)[-1] if match.group(1) else text

    return _LITERAL.sub(r"\1", _ROLE.sub(role, doc))


def _section_type(annotation: Any) -> type[Any] | None:
    """The dataclass a field holds (also ``X | None``), or None for a leaf."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if _is_union(annotation) and len(args) == 1:
        annotation = args[0]
    return annotation if dataclasses.is_dataclass(annotation) and isinstance(annotation, type) else None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _leaves(cls: type[Any], path: tuple[str, ...], skip: frozenset[str]) -> list[tuple[tuple[str, ...], Any]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[tuple[str, ...], Any]] = []
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if ".".join(here) in skip:
            continue
        section = _section_type(hints[f.name])
        out += _leaves(section, here, skip) if section is not None else [(here, hints[f.name])]
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type[Any], *, skip: tuple[str, ...] = ()) -> list[Flag]:
    """Add a flag for every leaf field of ``cls`` (dotted paths in ``skip`` are left out); returns them."""
    leaves = _leaves(cls, (), frozenset(skip))
    counts: dict[str, int] = {}
    for path, _ in leaves:
        counts[path[-1]] = counts.get(path[-1], 0) + 1
    flags = []
    docs: dict[type[Any], dict[str, str]] = {}  # parsing a class's source costs ~10 ms: once per class
    for path, annotation in leaves:
        name = path[-1] if counts[path[-1]] == 1 else ".".join(path)
        owner = _owner(cls, path)
        flag = Flag(path=path, flag="--" + name.replace("_", "-"), annotation=annotation, owner=owner)
        default = _default_at(cls, path)
        if owner not in docs:
            docs[owner] = field_docs(owner)
        doc = plain_text(docs[owner].get(path[-1], "").split("\n\n")[0].replace("\n", " "))
        shown = "required" if default is dataclasses.MISSING else f"default: {show_default(default)}"
        help_text = f"{doc} ({shown})".replace("%", "%%")
        if _base(annotation) is bool:
            parser.add_argument(flag.flag, dest=flag.dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag.flag, dest=flag.dest, default=argparse.SUPPRESS, metavar=_metavar(annotation),
                                help=help_text)
        flags.append(flag)
    return flags


def _owner(cls: type[Any], path: tuple[str, ...]) -> type[Any]:
    for name in path[:-1]:
        section = _section_type(typing.get_type_hints(cls)[name])
        if section is None:  # pragma: no cover - paths come from _leaves
            msg = f"{cls.__name__}.{name} is not a config section"
            raise TypeError(msg)
        cls = section
    return cls


def _default_at(cls: type[Any], path: tuple[str, ...]) -> Any:
    """What a config of ``cls`` holds at ``path`` when no flag is given: the default the ENCLOSING section
    gives (a section's factory may set its fields otherwise than their own class), else the field's own."""
    value = _default_of(cls, path[0])
    if len(path) == 1:
        return value
    if value is dataclasses.MISSING or value is None:  # no section instance to read: the section class's defaults
        return _default_at(_owner(cls, path[:2]), path[1:])
    for name in path[1:]:
        value = getattr(value, name)
    return value


def _whole_sections(cls: type[Any], doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with each section given in part completed from that field's default (``RunConfig.admission``'s
    quota, say), not from the section class's defaults."""
    for name, value in doc.items():
        if isinstance(value, Mapping):
            default = _default_of(cls, name)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                doc[name] = dataclasses.asdict(default) | dict(value)
    return doc


def _default_of(cls: type[Any], name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def show_default(value: Any) -> str:
    """A default as a flag's help shows it (and as the flag would take it)."""
    if isinstance(value, list | tuple | frozenset | set):
        return ",".join(map(str, value)) or "empty"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "empty"
    return str(value)


def _base(annotation: Any) -> Any:
    """The annotation without ``| None``."""
    if _is_union(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _metavar(annotation: Any) -> str:
    base = _base(annotation)
    origin = typing.get_origin(base)
    if typing.get_origin(base) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(base))) + "}"
    if origin in (list, frozenset, set):
        return "A,B,..."
    if origin in (dict, Mapping) or base is Mapping:
        return "K=V,..."
    if origin is tuple:
        return "JSON"
    return getattr(base, "__name__", "VALUE").upper()


def _parse(annotation: Any, text: str) -> Any:
    """A flag's text -> a value pydantic validates against ``annotation`` (lax: ``"5"`` is an int)."""
    if _is_union(annotation) and type(None) in typing.get_args(annotation) and text.lower() in ("none", "null"):
        return None
    base = _base(annotation)
    origin = typing.get_origin(base)
    if origin in (list, frozenset, set):
        args = typing.get_args(base)
        if args and _section_type(args[0]) is None and not typing.get_origin(args[0]):
            return [part.strip() for part in text.split(",") if part.strip()]
    if origin in (dict, Mapping):
        out: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                msg = f"expected KEY=VALUE pairs separated by commas, got {part!r}"
                raise ValueError(msg)
            out[key.strip()] = value.strip()
        return out
    if origin in (tuple, list) or _section_type(base) is not None:
        return json.loads(text)
    return text


def build(cls: type[T], flags: list[Flag], args: argparse.Namespace, *,
          base: T | Mapping[str, Any] | None = None) -> T:
    """The ``cls`` config from parsed flags, starting from ``base`` (a config, or some of its fields as a
    nested mapping; default: the field defaults).

    Raises:
        ValueError: naming the flag whose value is wrong (or the config check that failed).
    """
    if base is None or isinstance(base, Mapping):
        doc: dict[str, Any] = _whole_sections(cls, copy.deepcopy(dict(base or {})))
    else:
        doc = dataclasses.asdict(base)  # type: ignore[call-overload]
    given = vars(args)
    for flag in flags:
        if flag.dest not in given:
            continue
        try:
            value = _parse(flag.annotation, given[flag.dest]) if isinstance(given[flag.dest], str) \
                else given[flag.dest]
        except ValueError as exc:
            msg = f"{flag.flag}: {exc}"
            raise ValueError(msg) from None
        node = doc
        owner: type[Any] = cls
        for name in flag.path[:-1]:
            if not isinstance(node.get(name), dict):  # a section not given yet: start from its default
                default = _default_of(owner, name)
                is_config = dataclasses.is_dataclass(default) and not isinstance(default, type)
                node[name] = dataclasses.asdict(default) if is_config else {}  # type: ignore[arg-type]
            node = node[name]
            owner = _section_type(typing.get_type_hints(owner)[name]) or owner
        node[flag.path[-1]] = value
    try:
        return TypeAdapter(cls).validate_python(doc)
    except ValidationError as exc:
        by_path = {f.path: f.flag for f in flags}
        errs = []
        for e in exc.errors()[:5]:
            loc = tuple(str(p) for p in e["loc"])
            errs.append(f"{by_path.get(loc, '.'.join(loc) or cls.__name__)}: {e['msg']}")
        msg = "; ".join(errs)
        raise ValueError(msg) from None
