"""The Flight server: one method per RPC, each decodes, calls the :class:`Store`, encodes.

All wire decoding lives in ``schemas.wire``; all state lives in ``flight_store.store``. This
module only maps RPCs to store calls and errors to Flight errors (project errors already are
``FlightError`` subclasses carrying ``extra_info = b"knit:<Class>..."``; a ``WireError`` becomes
:class:`WireDecodeError`; anything else becomes ``FlightInternalError``).

Security: with ``tls_cert_file``/``tls_key_file`` (:class:`~flight_store.config.ServerConfig`) the
node serves ``grpc+tls://``; with ``auth_token_file`` every call must carry ``authorization: Bearer
<token>`` (checked in constant time by a server middleware before any RPC runs), otherwise it fails
with ``FlightUnauthenticatedError`` and sees nothing. Metrics: with ``metrics_port`` each RPC is
timed and its bytes counted (:class:`flight_store.metrics.StoreMetrics`), served as Prometheus text
on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.config import ClusterMember, ServerConfig
from flight_store.errors import KnitError, SchemaMismatchError, error_info
from flight_store.groups import check_columns, writer_meta
from flight_store.membership import Membership
from flight_store.memory import ANSWER_COPIES, HELD_CALL_RSS, Incoming
from flight_store.metrics import RpcBytes, StoreMetrics
from flight_store.rpc import TokenAuthFactory, descriptor_bytes, error_json, guard, receive
from flight_store.secrets import read_public, read_secret, read_token_file
from flight_store.store import Store
from flight_store.write_slots import WriteSlots
from schemas import replies
from schemas.arrow import SCHEMA_VERSION, TRAJECTORY_SCHEMA
from schemas.read_channel import encode_read_end, slices_by_hand
from schemas.wire import (
    LIMITS,
    DemandBody,
    DispatchBody,
    GroupRef,
    ImagesTicket,
    MetadataTicket,
    PublishVersionBody,
    PutGroup,
    PutGroups,
    PutImages,
    PutWeights,
    ReadChannelDescriptor,
    ReleaseBody,
    ResolveBody,
    SetClusterBody,
    SliceRef,
    SlicesTicket,
    WeightsTicket,
    WireError,
    decode_action_body,
    decode_descriptor,
    decode_exchange,
    decode_list_criteria,
    decode_ticket,
)

log = logging.getLogger(__name__)
ANSWER_ROWS = 16384
"""Most rows of one message of a metadata answer (~2 MB): a scan of 100k rows streams, it is not one message."""
SMALL_ANSWER = 1 << 20
"""A DoGet answer under this many bytes is not accounted as a read nor trimmed after: the forced trim and
a Python generator per answer would cost a large share of a micro-batch's read."""
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()
"""Made once: a stream without options reads the environment for its defaults on every answer."""
_STORED_META = {k.decode(): v.decode() for k, v in (TRAJECTORY_SCHEMA.metadata or {}).items()}
"""The schema metadata of every stored batch (:func:`~flight_store.blocks.view` reads them as the schema)."""
_UNOBSERVED = contextlib.nullcontext(RpcBytes())
"""What an RPC records into on a node without metrics: one shared record nobody reads (made once, not per read)."""
SMALL_ANSWER_SLICES = 16
"""A small answer of at most this many slices (one micro-batch) is made whole and sent by Arrow alone; a
longer one (a whole step's micro-batches, streamed) is made as it is sent, so its first rows go out first."""


class StoreServer(flight.FlightServerBase):
    """A store node: a :class:`Store` served over Arrow Flight, configured by one :class:`ServerConfig`.

    The server listens as soon as it is constructed (port 0 picks a free port; read it back from
    :attr:`location`). With ``tls_cert_file``/``tls_key_file`` it serves ``grpc+tls://``; with
    ``auth_token_file`` every call must carry that token (both files are read here). Its store is
    ``config.store`` named ``config.node_name`` (default: the location); the RSS guard stays as
    ``config.store`` says (:func:`flight_store.node.serve`, which owns its process, turns it on).

    Example:
        >>> from flight_store.config import StoreConfig
        >>> with StoreServer(ServerConfig(store=StoreConfig(memory_budget=1 << 30))) as server:
        ...     from flight_store.client import StoreAdmin
        ...     with StoreAdmin(server.location) as admin:
        ...         admin.health()[server.location].ok
        True
    """

    def __init__(self, config: ServerConfig | None = None) -> None:
        config = config if config is not None else ServerConfig()
        self._ready = False  # the server listens from super().__init__ on; calls wait for the rest (see _serving)
        self.config = config
        """What this node was started with."""
        kwargs: dict[str, Any] = {}
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            kwargs["tls_certificates"] = [
                flight.CertKeyPair(read_public(config.tls_cert_file), read_secret(config.tls_key_file, "TLS key"))
            ]
        if config.auth_token_file is not None:
            kwargs["middleware"] = {"knit_auth": TokenAuthFactory(read_token_file(config.auth_token_file))}
        super().__init__(config.bind_location, **kwargs)
        self.coalesce_below = config.coalesce_below
        """A DoGet of several slices under this many bytes is sent as one copied batch (0 = never)."""
        self.location = f"{config.scheme}://{config.advertised_host}:{self.port}"
        """Where clients connect (the real port when configured with port 0)."""
        self.node_name = config.node_name or self.location
        """Name reported by health/stats and in error messages; the node's id for routing."""
        self.membership = Membership(list(config.cluster) or [ClusterMember(id=self.node_name, location=self.location)],
                                     self_id=self.node_name, version=config.cluster_version)
        """The cluster's members, those routing leaves out, the view's version (``set_cluster`` changes them)."""
        self._writes = WriteSlots(max_writers=config.max_writers, idle_timeout_s=config.write_idle_timeout_s,
                                  max_writers_per_peer=config.max_writers_per_peer,
                                  evict_idle_s=config.write_evict_idle_s)
        self.store = Store(dataclasses.replace(config.store, node_name=self.node_name))
        self.metrics: StoreMetrics | None = None
        """The node's :class:`~flight_store.metrics.StoreMetrics` when ``metrics_port`` was given."""
        self.metrics_port: int | None = None
        """Port of ``/metrics`` (``None`` without metrics)."""
        if config.metrics_port is not None:
            self.metrics = StoreMetrics(node=self.node_name, stats=self.stats)
            self.metrics_port = self.metrics.serve(config.metrics_port, host=config.host)
        self._ready = True

    def _serving(self) -> None:
        """Refuse, retryably, a call that arrives while the node is still starting: it listens before its store is
        built, which with a spill log means replaying it (a restarted node's clients call it meanwhile)."""
        if not self._ready:
            msg = "the node is starting (its store is not ready: e.g. its spill log is being replayed); retry shortly"
            raise flight.FlightUnavailableError(msg)

    def cluster_view(self) -> replies.ClusterReply:
        """The ``cluster`` action's answer (:meth:`Membership.view`)."""
        return self.membership.view()

    def _observe(self, rpc: str) -> contextlib.AbstractContextManager[RpcBytes]:
        """The RPC's :class:`RpcBytes`, timed and counted when the node serves metrics (a plain one otherwise)."""
        return _UNOBSERVED if self.metrics is None else self.metrics.observe(rpc)

    # ---- DoPut ---------------------------------------------------------------------------------

    def do_put(
        self,
        context: flight.ServerCallContext,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        self._serving()
        with self._observe("do_put") as rec:
            answer = guard("DoPut", lambda: self._put(context, descriptor, reader, rec))
        writer.write(pa.py_buffer(answer.to_bytes()))

    def _put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
             reader: flight.MetadataRecordBatchReader, rec: RpcBytes) -> replies.Reply:
        """One DoPut: decode, take a writer slot, receive batch by batch (each counted as it arrives), store."""
        doc = decode_descriptor(descriptor_bytes(descriptor))
        if isinstance(doc, GroupRef):
            msg = "a 'group' descriptor names a stored group (GetFlightInfo); to write one, use kind 'put_group'"
            raise WireError(msg)
        if isinstance(doc, PutGroups):
            return self._put_groups(context, doc, reader, rec)
        if isinstance(doc, PutGroup):
            self.membership.check_owner(doc.group_id)  # before a byte of the stream is read
        what = (f"group {doc.group_id!r}" if isinstance(doc, PutGroup) else
                f"weights v{doc.version}" if isinstance(doc, PutWeights) else "images")
        group = doc.group_id if isinstance(doc, PutGroup) else None
        with self._received(context, reader, rec, what, doc.rows if isinstance(doc, PutGroup) else None,
                            group) as (batches, incoming):
            if isinstance(doc, PutGroup):
                rows = self.store.put_group(doc.group_id, batches, doc.rows, writer_meta(reader.schema),
                                            incoming=incoming)
                return replies.PutGroupReply(group_id=doc.group_id, rows_added=rows)
            table = pa.Table.from_batches(batches, schema=reader.schema)
            if isinstance(doc, PutImages):
                return replies.PutImagesReply(stored=self.store.put_images(table, incoming=incoming))
            return replies.PutWeightsReply(version=doc.version,
                                   stored=self.store.put_weights(table, doc.version, incoming=incoming))

    def _put_groups(self, context: flight.ServerCallContext, doc: PutGroups,
                    reader: flight.MetadataRecordBatchReader, rec: RpcBytes) -> replies.PutGroupsReply:
        """A bulk DoPut: receive the whole stream, then validate and commit each group on its own."""
        total = sum(g.rows for g in doc.groups)
        what = f"{len(doc.groups)} groups"
        with self._received(context, reader, rec, what, total, None) as (batches, incoming):
            got = sum(b.num_rows for b in batches)
            if got != total:
                msg = f"{what} declare {total} rows but the stream carried {got}; nothing stored"
                raise SchemaMismatchError(msg, column="sample_idx")
            stored, refused = self.store.put_groups([(g.group_id, g.rows) for g in doc.groups], batches,
                                                    writer_meta(reader.schema), incoming=incoming,
                                                    check=self.membership.check_owner)
            why = {gid: replies.RefusedGroup.model_validate(error_info(exc)) for gid, exc in refused.items()}
            return replies.PutGroupsReply(stored=stored, refused=why)

    @contextlib.contextmanager
    def _received(self, context: flight.ServerCallContext, reader: flight.MetadataRecordBatchReader, rec: RpcBytes,
                  what: str, rows: int | None, group: str | None) -> Iterator[tuple[list[pa.RecordBatch], Incoming]]:
        """A DoPut's whole stream, received in a writer slot, each batch counted against the budget as it
        arrives (``rows``: the most it may carry; ``group``: a group's write, checked early against the budget)."""
        with (self.store.memory.reading(HELD_CALL_RSS), self._writes.slot(context.peer()) as write,
              self.store.incoming(what, new_group=group) as incoming):
            write.incoming = incoming
            batches = receive(reader, write, incoming, rows, what)
            rec.bytes_in += incoming.received
            if context.is_cancelled():  # the client went away or its deadline passed: nothing is stored
                msg = "the DoPut was cancelled before its stream ended; nothing stored"
                raise flight.FlightCancelledError(msg)
            yield batches, incoming

    # ---- DoGet ---------------------------------------------------------------------------------

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        self._serving()
        raw = ticket.ticket
        with self._observe("do_get") as rec:
            schema, batches, nbytes = guard("DoGet", lambda: self._answer(decode_ticket(raw)))
            rec.bytes_out += nbytes
        if isinstance(batches, list) and nbytes < SMALL_ANSWER:
            # a micro-batch's answer goes out as Arrow's own stream: no Python per batch and no forced
            # trim once sent (what it borrows is under SMALL_ANSWER; the next write's trim gives it back)
            return flight.RecordBatchStream(pa.Table.from_batches(batches, schema=schema), options=_IPC_OPTIONS)
        return flight.GeneratorStream(schema, self._stream(batches, nbytes))

    def _stream(self, batches: Iterable[pa.RecordBatch], nbytes: int) -> Iterator[pa.RecordBatch]:
        """The answer's batches, made as they are sent. A large answer's memory is a read while it
        streams, which the RSS guard does not count against writes; once sent, what it borrowed goes
        back to the OS."""
        if nbytes < SMALL_ANSWER:
            yield from batches
            return
        try:
            # this thread's earlier answers were freed once sent: their pages go back before this one is copied
            # (not for a small answer: a micro-batch's copy into warm pages costs a third of one into fresh ones)
            pa.default_memory_pool().release_unused()
            with self.store.memory.reading(nbytes * ANSWER_COPIES):
                yield from batches
        finally:
            del batches
            self.store.memory.free_unused(force=True)

    def _answer(self, doc: Any) -> tuple[pa.Schema, Iterable[pa.RecordBatch], int]:
        """The answer to a ticket: its schema, its batches (a list, or made as they are sent) and its payload
        bytes (for slices see :meth:`_slices`)."""
        if isinstance(doc, SlicesTicket):
            first, batches, meta, nbytes = self._slices([(s.group_id, s.start, s.stop) for s in doc.slices],
                                                        doc.columns)
            schema = first.schema.with_metadata({k.encode(): v.encode() for k, v in meta.items()})
            if len(doc.slices) <= SMALL_ANSWER_SLICES and nbytes < SMALL_ANSWER:
                return schema, [first, *batches], nbytes
            return schema, itertools.chain([first], batches), nbytes
        if isinstance(doc, MetadataTicket):  # streamed in chunks of ANSWER_ROWS rows (zero-copy slices)
            table = self.store.metadata(doc.since, doc.columns)
            return table.schema, table.to_batches(max_chunksize=ANSWER_ROWS), table.get_total_buffer_size()
        if isinstance(doc, ImagesTicket):
            table = self.store.images([bytes.fromhex(k) for k in doc.keys], missing_ok=doc.missing_ok)
        elif isinstance(doc, WeightsTicket):
            table = self.store.weights(doc.version)[0]
        else:  # pragma: no cover
            msg = f"unsupported ticket {doc!r}"
            raise WireError(msg)
        return table.schema, table.to_batches(), table.get_total_buffer_size()

    # ---- DoExchange: read channels -------------------------------------------------------------

    def do_exchange(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
                    reader: flight.MetadataRecordBatchReader, writer: flight.MetadataRecordBatchWriter) -> None:
        """A read channel (:class:`~schemas.wire.ReadChannelDescriptor`): each request a ``slices`` ticket, each
        answer its rows and an end message, until the client ends the channel or its deadline passes. A refused
        request is answered with its typed error and the channel goes on."""
        self._serving()
        channel = guard("DoExchange", lambda: decode_exchange(descriptor_bytes(descriptor)))
        guard("DoExchange", lambda: check_columns(channel.columns))
        names = channel.columns if channel.columns is not None else TRAJECTORY_SCHEMA.names
        writer.begin(pa.schema([TRAJECTORY_SCHEMA.field(c) for c in names]), options=_IPC_OPTIONS)
        with self.store.memory.reading(HELD_CALL_RSS):  # the held channel's thread and buffers
            while True:
                try:
                    request = reader.read_chunk().app_metadata
                except StopIteration:
                    return  # the client ended the channel
                try:
                    with self._observe("read") as rec:
                        first, rest, meta, nbytes = guard("read", functools.partial(self._read, request, channel))
                        rec.bytes_out += nbytes
                except (KnitError, flight.FlightError) as exc:
                    writer.write_metadata(json.dumps({"error": error_json(exc)}).encode())
                    continue
                last, rows = first, 0
                for batch in rest if nbytes < SMALL_ANSWER else self._stream(rest, nbytes):
                    writer.write_batch(last)
                    rows += last.num_rows
                    last = batch
                writer.write_with_metadata(last, encode_read_end(rows + last.num_rows, meta))

    def _read(self, request: pa.Buffer | None,
              channel: ReadChannelDescriptor) -> tuple[pa.RecordBatch, Iterator[pa.RecordBatch], dict[str, str], int]:
        """The answer to a read channel's request, a ``slices`` ticket of the channel's columns (see :meth:`_slices`;
        its end message carries the metadata a DoGet's schema carries)."""
        if request is None:
            msg = "a read channel's request is a metadata-only message whose app metadata is a slices ticket"
            raise WireError(msg)
        raw = request.to_pybytes()
        got = slices_by_hand(raw)
        if got is None:
            doc = decode_ticket(raw)
            if not isinstance(doc, SlicesTicket):
                msg = f"a read channel answers slices tickets, got a {doc.kind!r} ticket"
                raise WireError(msg)
            got = [(s.group_id, s.start, s.stop) for s in doc.slices], doc.columns
        refs, columns = got
        if columns != channel.columns:
            msg = f"this read channel answers columns {channel.columns}, the ticket asks for {columns}"
            raise SchemaMismatchError(msg, column=None)
        return self._slices(refs, columns)

    def _slices(self, refs: list[tuple[str, int, int]], columns: list[str] | None,
                ) -> tuple[pa.RecordBatch, Iterator[pa.RecordBatch], dict[str, str], int]:
        """The rows of ``refs`` (``(group_id, start, stop)`` slices) of ``columns``: the first batch, the others
        (made as they are sent), the schema metadata of the answer (the batches' own and the writer metadata all
        its groups share) and the payload bytes (summed from the rows served: ``nbytes`` of sliced columns dedups
        byte ranges, ~50 us warm)."""
        batches, meta, nbytes = self.store.slices_with_meta(refs, columns, coalesce_below=self.coalesce_below)
        return next(batches), batches, {**_STORED_META, **meta}, nbytes  # at least one slice

    # ---- actions -------------------------------------------------------------------------------

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return list(replies.ACTION_DESCRIPTIONS.items())

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        self._serving()
        with self._observe(f"action_{action.type}" if action.type in replies.ACTION_DESCRIPTIONS else "action_unknown"):
            answer = guard(f"action {action.type!r}", lambda: self._act(action))
        return iter([answer.to_bytes()])

    def _act(self, action: flight.Action) -> replies.Reply:
        """The answer to one action (its body decoded by ``schemas.wire``, its answer a ``schemas.replies`` model)."""
        body = decode_action_body(action.type, action.body.to_pybytes() if action.body else b"")
        if action.type == "health":
            return replies.HealthReply(ok=True, node=self.node_name, schema_version=SCHEMA_VERSION)
        if action.type == "cluster":
            return self.cluster_view()
        if isinstance(body, SetClusterBody):
            return self.membership.update(body)
        if action.type == "stats":
            return self.stats()
        if isinstance(body, ReleaseBody):
            return replies.ReleaseReply(released=self.store.release(body.group_ids))
        if isinstance(body, PublishVersionBody):
            return replies.VersionReply(version=self.store.publish_version(body.version))
        if action.type == "get_version":
            return replies.VersionReply(version=self.store.get_version())
        if isinstance(body, DispatchBody):
            for g in body.groups:
                self.membership.check_owner(g.group_id)
            stored = self.store.supply.dispatch(body.groups)
            return replies.DispatchReply(registered=len(body.groups) - len(stored), stored=stored)
        if isinstance(body, DemandBody):
            self.store.supply.set_demand(body.classes)
            return replies.DemandReply(demand=body.classes)
        if isinstance(body, ResolveBody):
            return replies.ResolveReply(resolved=self.store.supply.resolve(body.group_ids, body.reason))
        if action.type == "inflight":
            return self.store.supply.inflight()
        msg = f"unknown action {action.type!r}"  # pragma: no cover - decode_action_body checks
        raise WireError(msg)

    def stats(self) -> replies.NodeStats:
        """The ``stats`` action's answer: the store's counters and the writes being received."""
        return self.store.stats().model_copy(update={"writers": self._writes.active,
                                                     "writes_given_up": self._writes.given_up,
                                                     "writes_evicted": self._writes.evicted})

    # ---- ListFlights / GetFlightInfo -----------------------------------------------------------

    def _group_info(self, group_id: str) -> flight.FlightInfo:
        rows, nbytes, runs = self.store.group_info(group_id)
        descriptor = flight.FlightDescriptor.for_command(GroupRef(group_id=group_id).to_bytes())
        ticket = SlicesTicket(slices=[SliceRef(group_id=group_id, start=a, stop=b) for a, b in runs])
        endpoint = flight.FlightEndpoint(ticket.to_bytes(), [])
        return flight.FlightInfo(TRAJECTORY_SCHEMA, descriptor, [endpoint], rows, nbytes)

    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterator[flight.FlightInfo]:
        """Up to ``groups_per_list`` stored groups in arrival order (criteria ``after``/``limit`` page on)."""
        self._serving()
        crit = guard("ListFlights", lambda: decode_list_criteria(criteria or b""))
        limit = min(crit.limit or LIMITS["groups_per_list"], LIMITS["groups_per_list"])
        for gid in self.store.group_ids(after=crit.after, limit=limit):
            try:
                yield self._group_info(gid)
            except KnitError:  # released between the listing and now
                continue

    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        def run() -> flight.FlightInfo:
            doc = decode_descriptor(descriptor_bytes(descriptor))
            if not isinstance(doc, GroupRef | PutGroup):
                msg = f"GetFlightInfo describes prompt groups only (kind 'group'), got a {doc.kind!r} descriptor"
                raise SchemaMismatchError(msg, column=None)
            return self._group_info(doc.group_id)

        self._serving()
        return guard("GetFlightInfo", run)

    def __enter__(self) -> StoreServer:
        return self

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop serving, then close the metrics endpoint and the spill log; returns whether every call ended.

        gRPC lets running calls finish; a DoPut whose client stalls mid-stream never does (its handler
        waits for the client's next message), so after ``timeout_s`` the node stops waiting for it: such a
        write was refused already (idle limit) and stores nothing. A read channel ends at its deadline
        (a store client's within 2 s), or when ``timeout_s`` is up if its client gave it none.
        """
        stopper = threading.Thread(target=super().shutdown, name="knit-shutdown", daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        clean = not stopper.is_alive()
        if not clean:
            log.warning("node %s: calls still open after %.0f s (%d stalled writer(s), read channels without a "
                        "deadline); stopping without them", self.node_name, timeout_s, self._writes.active)
        self._writes.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.store.close()
        return clean

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
