"""The Flight server: one method per RPC, each decodes, calls the :class:`Store`, encodes.

All wire decoding lives in ``schemas.wire``; all state lives in ``flight_store.store``. This
module only maps RPCs to store calls and errors to Flight errors (project errors already are
``FlightError`` subclasses carrying ``extra_info = b"knit:<Class>..."``; a ``WireError`` becomes
:class:`WireDecodeError`; anything else becomes ``FlightInternalError``).
"""

from __future__ import annotations

import json
import logging
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
        **flight_kwargs: Any,
    ) -> None:
        super().__init__(location, **flight_kwargs)
        self.coalesce_below = coalesce_below
        """A DoGet of several slices under this many bytes is sent as one copied batch (0 = never)."""
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0] if rest else "127.0.0.1"
        self.location = f"{scheme}://{host}:{self.port}"
        """Where clients connect (the real port when constructed with port 0)."""
        self.store = store if store is not None else Store(memory_budget=memory_budget)
        if node_name is not None or store is None:
            self.store.config.node_name = node_name or self.location
        self.node_name = self.store.config.node_name

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
            if isinstance(doc, PutGroup):
                rows = self.store.put_group(doc.group_id, table.to_batches())
                return {"group_id": doc.group_id, "rows_added": rows}
            if isinstance(doc, PutImages):
                return {"stored": self.store.put_images(table)}
            if isinstance(doc, PutWeights):
                return {"version": doc.version, "stored": self.store.put_weights(table, doc.version)}
            msg = f"unsupported descriptor {doc!r}"  # pragma: no cover - the union is exhaustive
            raise WireError(msg)

        answer = _guard("DoPut", run)
        writer.write(pa.py_buffer(json.dumps(answer).encode()))

    # ---- DoGet ---------------------------------------------------------------------------------

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        def run() -> flight.FlightDataStream:
            doc = decode_ticket(ticket.ticket)
            if isinstance(doc, MetadataTicket):
                return flight.RecordBatchStream(self.store.metadata(doc.since, doc.columns))
            if isinstance(doc, SlicesTicket):
                refs = [(s.group_id, s.start, s.stop) for s in doc.slices]
                batches = self.store.slices(refs, doc.columns, coalesce_below=self.coalesce_below)
                schema = batches[0].schema
                return flight.RecordBatchStream(pa.Table.from_batches(batches, schema=schema))
            if isinstance(doc, ImagesTicket):
                return flight.RecordBatchStream(self.store.images([bytes.fromhex(k) for k in doc.keys]))
            if isinstance(doc, WeightsTicket):
                table, _ = self.store.weights(doc.version)
                return flight.RecordBatchStream(table)
            msg = f"unsupported ticket {doc!r}"  # pragma: no cover
            raise WireError(msg)

        return _guard("DoGet", run)

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

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
