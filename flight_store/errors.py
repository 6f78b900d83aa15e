"""Typed errors of the data plane, and how they cross the Flight boundary.

Every project error is a :class:`KnitError` and, at the same time, a subclass of the
``pyarrow.flight`` error class it maps to, so:

* the server can raise it as is: pyarrow turns it into the matching gRPC status and keeps the
  ``extra_info`` bytes (``b"knit:<ClassName>\\n<json attributes>"``);
* a raw ``pyarrow.flight`` client sees a ``FlightError`` subclass whose message names the
  offending column, group or key;
* :mod:`flight_store.client`'s store clients re-raise the SAME project class
  (:func:`from_flight_error`), so callers write ``except BudgetExceededError``.

Whether to retry: ``retryable`` is a class attribute (and a field of the JSON in ``extra_info``). A
retryable error (``FlightUnavailableError``: a full budget, too many writers, a node that cannot be
reached) may succeed later with the SAME call; any other error will fail again until the call
changes (``FlightServerError``: bad input, unknown or released groups, a write larger than the node,
a group sent to the wrong node, a rewrite with other content). Every write is idempotent, so a
retry after an answer that never arrived is safe.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pyarrow.flight as flight

_PREFIX = b"knit:"


class KnitError(Exception):
    """Base of every project error. ``retryable`` says whether the same call may succeed later."""

    retryable: ClassVar[bool] = False
    _attrs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str = "", **attrs: Any) -> None:
        for name in self._attrs:
            setattr(self, name, attrs.pop(name, None))
        if attrs:
            msg = f"unexpected attributes for {type(self).__name__}: {sorted(attrs)}"
            raise TypeError(msg)
        info = {"message": message, "retryable": self.retryable, **{n: getattr(self, n) for n in self._attrs}}
        extra = _PREFIX + type(self).__name__.encode() + b"\n" + json.dumps(info).encode()
        if isinstance(self, flight.FlightError):
            flight.FlightError.__init__(self, message, extra)
        else:
            Exception.__init__(self, message)
        self.extra_info = extra
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).__name__, self.message, {n: getattr(self, n) for n in self._attrs}))


class SchemaMismatchError(KnitError, flight.FlightServerError):
    """An incoming batch (or a requested projection) does not fit the schema; ``column`` names where."""

    _attrs = ("column",)
    column: str | None


class WireDecodeError(KnitError, flight.FlightServerError):
    """A descriptor, ticket or action body is malformed JSON, of an unknown version, or invalid; or a DoPut's
    message is not Arrow IPC of its stream's schema."""


class UnknownGroupError(KnitError, flight.FlightServerError):
    """The group (or a row of it) is not stored on this node; ``group_id`` names it."""

    _attrs = ("group_id",)
    group_id: str | None


class UnknownImageError(KnitError, flight.FlightServerError):
    """No image with this content key is stored; ``key`` is its hex form."""

    _attrs = ("key",)
    key: str | None


class UnknownWeightsError(KnitError, flight.FlightServerError):
    """No weights are stored, or not the requested ``version``."""

    _attrs = ("version",)
    version: int | None


class GroupReleasedError(KnitError, flight.FlightServerError):
    """The group was released (consumed); its payload is gone. ``group_id`` names it."""

    _attrs = ("group_id",)
    group_id: str | None


class CapacityExceededError(KnitError, flight.FlightServerError):
    """A write larger than the node's whole memory budget: it can never be stored here (do not retry)."""

    _attrs = ("needed", "capacity")
    needed: int | None
    capacity: int | None


class WrongNodeError(KnitError, flight.FlightServerError):
    """The group belongs to another node (routing, see ``schemas.routing``): write it to ``owner``.

    ``owner`` is the owner's id, ``location`` where it listens.
    """

    _attrs = ("group_id", "owner", "location")
    group_id: str | None
    owner: str | None
    location: str | None


class ConflictError(KnitError, flight.FlightServerError):
    """The group was written before with other content; ``column`` names the first column that differs."""

    _attrs = ("group_id", "column")
    group_id: str | None
    column: str | None


class BudgetExceededError(KnitError, flight.FlightUnavailableError):
    """The node's memory budget is full; nothing was stored. Retry after groups are released."""

    retryable = True
    _attrs = ("needed", "available")
    needed: int | None
    available: int | None


class TooManyWritersError(KnitError, flight.FlightUnavailableError):
    """The node is receiving as many writes as it takes at once (``limit``); nothing stored. Retry shortly."""

    retryable = True
    _attrs: ClassVar[tuple[str, ...]] = ("limit",)
    limit: int | None


class TooManyPeerWritersError(TooManyWritersError):
    """The calling connection (``peer``) has as many writes in progress on the node as one peer may (``limit``);
    nothing stored. Retry once one of them ended."""

    _attrs: ClassVar[tuple[str, ...]] = ("limit", "peer")
    peer: str | None


class WriteTimedOutError(KnitError, flight.FlightUnavailableError):
    """The write's stream stalled longer than the node's idle limit and was given up; nothing stored. Retry."""

    retryable = True


class LimitExceededError(KnitError, flight.FlightServerError):
    """A request larger than a documented limit (``limit`` names it, ``value`` says how large it was)."""

    _attrs = ("limit", "value")
    limit: str | None
    value: int | None


class NodeUnavailableError(KnitError, flight.FlightUnavailableError):
    """A store node cannot be reached (connection refused, timed out). ``node`` names it.

    ``group_ids`` lists the groups a failed fetch wanted from it (``None`` for other calls).
    """

    retryable = True
    _attrs = ("node", "group_ids")
    node: str | None
    group_ids: list[str] | None


ERROR_CLASSES: dict[str, type[KnitError]] = {
    cls.__name__: cls
    for cls in (
        KnitError,
        SchemaMismatchError,
        WireDecodeError,
        UnknownGroupError,
        UnknownImageError,
        UnknownWeightsError,
        GroupReleasedError,
        CapacityExceededError,
        WrongNodeError,
        ConflictError,
        BudgetExceededError,
        TooManyWritersError,
        TooManyPeerWritersError,
        WriteTimedOutError,
        LimitExceededError,
        NodeUnavailableError,
    )
}


def _rebuild(name: str, message: str, attrs: dict[str, Any]) -> KnitError:
    return ERROR_CLASSES[name](message, **attrs)


def error_info(exc: KnitError) -> dict[str, Any]:
    """``exc`` as JSON (``error``: its class, ``message``, ``retryable`` and its attributes): how a bulk
    write names what it refused, group by group."""
    return {"error": type(exc).__name__, "message": exc.message, "retryable": exc.retryable,
            **{n: getattr(exc, n) for n in exc._attrs}}


def from_error_info(info: dict[str, Any]) -> KnitError:
    """The typed error of :func:`error_info`'s JSON (a class this client does not know: :class:`KnitError`)."""
    cls = ERROR_CLASSES.get(str(info.get("error")), KnitError)
    return cls(str(info.get("message", "")), **{k: v for k, v in info.items() if k in cls._attrs})


def from_flight_error(exc: BaseException, *, node: str | None = None) -> BaseException:
    """The project error that ``exc`` (as a Flight client received it) stands for, or ``exc`` itself.

    A ``FlightUnavailableError`` / ``FlightTimedOutError`` without project info (the node is down or
    too slow) becomes :class:`NodeUnavailableError` naming ``node``.
    """
    if isinstance(exc, KnitError):
        return exc
    extra = getattr(exc, "extra_info", b"") or b""
    if isinstance(extra, bytes) and extra.startswith(_PREFIX):
        head, _, body = extra[len(_PREFIX) :].partition(b"\n")
        cls = ERROR_CLASSES.get(head.decode(errors="replace"))
        if cls is not None:
            try:
                info = json.loads(body) if body else {}
            except json.JSONDecodeError:
                info = {}
            message = str(info.pop("message", str(exc)))
            attrs = {k: v for k, v in info.items() if k in cls._attrs}
            return cls(message, **attrs)
    if node is not None and isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError):
        msg = f"store node {node} is unavailable: {exc}"
        return NodeUnavailableError(msg, node=node)
    return exc
