"""The Flight server: one method per RPC, each decodes, calls the :class:`Store`, encodes.

All wire decoding lives in ``schemas.wire``; all state lives in ``flight_store.store``. This
module only maps RPCs to store calls and errors to Flight errors (project errors already are
``FlightError`` subclasses carrying ``extra_info = b"knit:<Class>..."``; a ``WireError`` becomes
:class:`WireDecodeError`; anything else becomes ``FlightInternalError``).

Security: with ``tls_cert``/``tls_key`` the node serves ``grpc+tls://``; with ``auth_token`` every
call must carry ``authorization: Bearer <token>`` (checked in constant time by a server
middleware before any RPC runs), otherwise it fails with ``FlightUnauthenticatedError`` and sees
nothing. Metrics: with ``metrics_port`` each RPC is timed and its bytes counted
(:class:`flight_store.metrics.StoreMetrics`), served as Prometheus text on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import KnitError, SchemaMismatchError, WireDecodeError
from flight_store.store import Store
from schemas.arrow import SCHEMA_VERSION, TRAJECTORY_SCHEMA
from schemas.wire import (
    ACTION_DESCRIPTIONS,
    ImagesTicket,
    MetadataTicket,
    PublishVersionBody,
    PutGroup,
    PutImages,
    PutWeights,
    ReleaseBody,
    SliceRef,
    SlicesTicket,
    WeightsTicket,
    WireError,
    decode_action_body,
    decode_descriptor,
    decode_ticket,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _guard(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` and turn any error into one a Flight client receives typed."""
    try:
        return fn()
    except WireError as exc:
        raise WireDecodeError(str(exc)) from None
    except (KnitError, flight.FlightError):
        raise
    except Exception as exc:
        log.exception("%s failed", what)
        msg = f"{what} failed: {type(exc).__name__}: {exc}"
        raise flight.FlightInternalError(msg) from None


class _TokenAuthFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses every call whose ``authorization`` header is not ``Bearer <token>`` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = b"Bearer " + token.encode()

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[Any]]) -> None:
        values = headers.get("authorization", [])
        for v in values:
            got = v.encode() if isinstance(v, str) else bytes(v)
            if hmac.compare_digest(got, self._expected):
                return None
        what = "no bearer token" if not values else "a wrong bearer token"
        msg = f"unauthenticated: the call to {info.method} carried {what}"
        raise flight.FlightUnauthenticatedError(msg)


class _NoRecord:
    __slots__ = ("bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0


def _valid_token(token: str) -> bool:
    return bool(token) and token.isascii() and token.isprintable() and token.strip() == token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); refuses an empty file."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        msg = f"auth token file {str(path)!r} is empty"
        raise ValueError(msg)
    return token


def _descriptor_bytes(descriptor: flight.FlightDescriptor) -> bytes:
    if descriptor.descriptor_type == flight.DescriptorType.CMD:
        return bytes(descriptor.command)
    path = descriptor.path or []
    if len(path) != 1:
        msg = f"a path descriptor must hold exactly one JSON document, got {len(path)} elements"
        raise WireError(msg)
    return bytes(path[0])


class StoreServer(flight.FlightServerBase):
    """A store node: a :class:`Store` served over Arrow Flight.

    The server listens as soon as it is constructed (``location`` with port 0 picks a free port;
    read it back from :attr:`location`).

    Args:
        location: ``grpc://host:port`` (``grpc+tls://`` is used whenever ``tls_cert`` is given).
        store: an existing store to serve (default: a new one from ``memory_budget``/``spill_dir``).
        memory_budget: bytes of payload the node may hold (``None`` = unlimited).
        node_name: name reported by health/stats (default: the location).
        coalesce_below: a DoGet of several slices under this many bytes is sent as one copied batch.
        tls_cert: PEM certificate chain (bytes) to serve TLS with; needs ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        auth_token: when set, every call must send ``authorization: Bearer <auth_token>``.
        spill_dir: directory of the durable spill log (replayed if it holds one).
        metrics_port: serve Prometheus ``/metrics`` on this port (0 = a free one, read
            :attr:`metrics_port`); ``None`` = no metrics.
        rss_guard: also hold the process's resident memory to ``memory_budget`` (see
            :attr:`~flight_store.store.StoreConfig.rss_guard`; ``knit serve`` turns it on).

    Example:
        >>> with StoreServer("grpc://127.0.0.1:0", memory_budget=1 << 30) as server:
        ...     from flight_store.client import StoreClient
        ...     with StoreClient(server.location) as client:
        ...         client.health()[server.location]["ok"]
        True
    """

    def __init__(
        self,
        location: str = "grpc://127.0.0.1:0",
        *,
        store: Store | None = None,
        memory_budget: int | None = None,
        node_name: str | None = None,
        coalesce_below: int = 1 << 20,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        auth_token: str | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        metrics_port: int | None = None,
        rss_guard: bool = False,
        **flight_kwargs: Any,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            msg = "tls_cert and tls_key must be given together"
            raise ValueError(msg)
        if auth_token is not None and not _valid_token(auth_token):
            msg = "auth_token must be a non-empty string of printable ASCII characters (a gRPC header value) or None"
            raise ValueError(msg)
        if tls_cert is not None:
            flight_kwargs["tls_certificates"] = [flight.CertKeyPair(tls_cert, tls_key)]
            scheme, _, rest = location.partition("://")
            if scheme in ("grpc", "grpc+tcp"):
                location = f"grpc+tls://{rest}"
        if auth_token is not None:
            middleware = dict(flight_kwargs.pop("middleware", None) or {})
            middleware["knit_auth"] = _TokenAuthFactory(auth_token)
            flight_kwargs["middleware"] = middleware
        super().__init__(location, **flight_kwargs)
        self.coalesce_below = coalesce_below
        """A DoGet of several slices under this many bytes is sent as one copied batch (0 = never)."""
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0] if rest else "127.0.0.1"
        self.location = f"{scheme}://{host}:{self.port}"
        """Where clients connect (the real port when constructed with port 0)."""
        own_store = store is None
        self.store = store if store is not None else Store(
            memory_budget=memory_budget, spill_dir=spill_dir, rss_guard=rss_guard
        )
        if node_name is not None or own_store:
            self.store.config.node_name = node_name or self.location
        self.node_name = self.store.config.node_name
        self.metrics: Any = None
        """The node's :class:`~flight_store.metrics.StoreMetrics` when ``metrics_port`` was given."""
        self.metrics_port: int | None = None
        """Port of ``/metrics`` (``None`` without metrics)."""
        if metrics_port is not None:
            from flight_store.metrics import StoreMetrics

            self.metrics = StoreMetrics(node=self.node_name, stats=self._metric_stats)
            self.metrics_port = self.metrics.serve(metrics_port)

    def _metric_stats(self) -> dict[str, Any]:
        s = self.store.stats()
        groups = s.get("groups")
        return {**s, "groups_by_state": groups if isinstance(groups, dict) else {}}

    @contextlib.contextmanager
    def _observe(self, rpc: str) -> Iterator[Any]:
        if self.metrics is None:
            yield _NoRecord()
            return
        with self.metrics.observe(rpc) as rec:
            yield rec

    # ---- DoPut ---------------------------------------------------------------------------------

    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        def run() -> dict[str, Any]:
            doc = decode_descriptor(_descriptor_bytes(descriptor))
            table = reader.read_all()
            rec.bytes_in += table.nbytes
            if isinstance(doc, PutGroup):
                rows = self.store.put_group(doc.group_id, table.to_batches())
                return {"group_id": doc.group_id, "rows_added": rows}
            if isinstance(doc, PutImages):
                return {"stored": self.store.put_images(table)}
            if isinstance(doc, PutWeights):
                return {"version": doc.version, "stored": self.store.put_weights(table, doc.version)}
            msg = f"unsupported descriptor {doc!r}"  # pragma: no cover - the union is exhaustive
            raise WireError(msg)

        with self._observe("do_put") as rec, self.store.write_in_flight():
            answer = _guard("DoPut", run)
        writer.write(pa.py_buffer(json.dumps(answer).encode()))

    # ---- DoGet ---------------------------------------------------------------------------------

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        raw = ticket.ticket
        if self.metrics is None:
            # everything here runs before the answer's first byte goes out; without metrics there is
            # nothing to count, and ``table.nbytes`` is not free: for sliced columns it dedups byte
            # ranges (~50 us warm, ~0.1-0.2 ms on the cold caches of a node streaming MBs per call)
            return flight.RecordBatchStream(_guard("DoGet", lambda: self._get_table(raw)))
        with self._observe("do_get") as rec:
            table = _guard("DoGet", lambda: self._get_table(raw))
            rec.bytes_out += table.nbytes
        return flight.RecordBatchStream(table)

    def _get_table(self, raw: bytes) -> pa.Table:
        doc = decode_ticket(raw)
        if isinstance(doc, MetadataTicket):
            return self.store.metadata(doc.since, doc.columns)
        if isinstance(doc, SlicesTicket):
            refs = [(s.group_id, s.start, s.stop) for s in doc.slices]
            batches = self.store.slices(refs, doc.columns, coalesce_below=self.coalesce_below)
            return pa.Table.from_batches(batches, schema=batches[0].schema)
        if isinstance(doc, ImagesTicket):
            return self.store.images([bytes.fromhex(k) for k in doc.keys])
        if isinstance(doc, WeightsTicket):
            return self.store.weights(doc.version)[0]
        msg = f"unsupported ticket {doc!r}"  # pragma: no cover
        raise WireError(msg)

    # ---- actions -------------------------------------------------------------------------------

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return list(ACTION_DESCRIPTIONS.items())

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        def run() -> dict[str, Any]:
            body = decode_action_body(action.type, action.body.to_pybytes() if action.body else b"")
            if action.type == "health":
                return {"ok": True, "node": self.node_name, "schema_version": SCHEMA_VERSION}
            if action.type == "stats":
                return self.store.stats()
            if isinstance(body, ReleaseBody):
                return {"released": self.store.release(body.group_ids)}
            if isinstance(body, PublishVersionBody):
                return {"version": self.store.publish_version(body.version)}
            if action.type == "get_version":
                return {"version": self.store.get_version()}
            msg = f"unknown action {action.type!r}"  # pragma: no cover - decode_action_body checks
            raise WireError(msg)

        with self._observe(f"action_{action.type}" if action.type in ACTION_DESCRIPTIONS else "action_unknown"):
            answer = _guard(f"action {action.type!r}", run)
        return iter([json.dumps(answer).encode()])

    # ---- ListFlights / GetFlightInfo -----------------------------------------------------------

    def _group_info(self, group_id: str) -> flight.FlightInfo:
        rows, nbytes, runs = self.store.group_info(group_id)
        descriptor = flight.FlightDescriptor.for_command(PutGroup(group_id=group_id).to_bytes())
        ticket = SlicesTicket(slices=[SliceRef(group_id=group_id, start=a, stop=b) for a, b in runs])
        endpoint = flight.FlightEndpoint(ticket.to_bytes(), [])
        return flight.FlightInfo(TRAJECTORY_SCHEMA, descriptor, [endpoint], rows, nbytes)

    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterator[flight.FlightInfo]:
        for gid in self.store.group_ids():
            try:
                yield self._group_info(gid)
            except KnitError:  # released between the listing and now
                continue

    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        def run() -> flight.FlightInfo:
            doc = decode_descriptor(_descriptor_bytes(descriptor))
            if not isinstance(doc, PutGroup):
                msg = f"GetFlightInfo describes prompt groups only, got a {doc.kind!r} descriptor"
                raise SchemaMismatchError(msg, column=None)
            return self._group_info(doc.group_id)

        return _guard("GetFlightInfo", run)

    def __enter__(self) -> StoreServer:
        return self

    def shutdown(self) -> None:
        """Stop serving, then close the metrics endpoint and the spill log."""
        super().shutdown()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.store.close()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
