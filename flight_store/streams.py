"""Reading planned slices from store nodes: one ticket per node, rows back in plan order.

A fetch sends each node ONE slices ticket (:func:`slices_ticket`) for all the slices it holds, over
a read channel (:class:`ReadChannel`, a long-lived DoExchange: no call per read), and puts the
answers back in the order of the plan (:func:`in_order`). Used by
:class:`flight_store.reading.StoreReader`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import from_error_info
from schemas.arrow import SCHEMA_VERSION, TRAJECTORY_SCHEMA
from schemas.plan import PlannedSlice
from schemas.read_channel import CANONICAL_JSON, loads_compact
from schemas.wire import ReadChannelDescriptor


def empty_table(cols: list[str] | None) -> pa.Table:
    """An empty trajectory table of ``cols`` (all columns when ``None``)."""
    schema = TRAJECTORY_SCHEMA if cols is None else pa.schema([TRAJECTORY_SCHEMA.field(c) for c in cols])
    return schema.empty_table()


def by_node(slices: Iterable[PlannedSlice]) -> dict[str, list[PlannedSlice]]:
    """``slices`` grouped by node (nodes in order of first appearance, slices in order)."""
    per_node: dict[str, list[PlannedSlice]] = {}
    for s in slices:
        per_node.setdefault(s.node, []).append(s)
    return per_node


def staggered(per_node: Mapping[str, object], nodes: Sequence[str], start: int) -> list[str]:
    """The nodes of ``per_node`` in the order of ``nodes`` rotated to begin at ``nodes[start % len(nodes)]`` (nodes
    ``nodes`` does not list last, in their order): where a read begins, so that readers with different ``start``
    begin on different nodes."""
    if not nodes:
        return list(per_node)
    k = start % len(nodes)
    ring = [n for n in (*nodes[k:], *nodes[:k]) if n in per_node]
    return ring + [n for n in per_node if n not in set(ring)]


def group_ids(slices: Iterable[PlannedSlice]) -> list[str]:
    """The distinct group ids of ``slices``, in order."""
    return list(dict.fromkeys(s.group_id for s in slices))


def slices_ticket(slices: Iterable[PlannedSlice], cols: list[str] | None) -> bytes:
    """The DoGet ticket of ``slices`` (one node's) projected to ``cols``: the bytes of the model
    (:class:`~schemas.wire.SlicesTicket`; a test holds them equal), built without it (a model per slice costs
    tens of microseconds a read). Unvalidated: the node validates every ticket it is sent and answers a bad one
    with a typed error."""
    doc: dict[str, object] = {"v": SCHEMA_VERSION, "kind": "slices",
                              "slices": [{"group_id": s.group_id, "start": s.start, "stop": s.stop} for s in slices]}
    if cols is not None:
        doc["columns"] = cols
    return CANONICAL_JSON.encode(doc).encode()


def in_order(slices: Sequence[PlannedSlice], tables: dict[str, pa.Table]) -> pa.Table:
    """The rows of ``slices`` in their order, from one table per node holding that node's rows in order."""
    if len(tables) == 1:
        return next(iter(tables.values()))
    offsets = dict.fromkeys(tables, 0)
    parts = []
    for s in slices:
        parts.append(tables[s.node].slice(offsets[s.node], s.rows))
        offsets[s.node] += s.rows
    metas = [t.schema.metadata or {} for t in tables.values()]
    shared = {k: v for k, v in metas[0].items() if all(m.get(k) == v for m in metas[1:])}  # what every node says
    return pa.concat_tables(parts).replace_schema_metadata(shared or None)


def keys_by_node(keys: Sequence[bytes], nodes: Mapping[bytes, str]) -> dict[str, list[bytes]]:
    """``keys`` grouped by the node ``nodes`` names for each (a key it does not name is a KeyError)."""
    out: dict[str, list[bytes]] = {}
    for k in keys:
        out.setdefault(nodes[k], []).append(k)
    return out


class ChannelBrokenError(Exception):
    """A read channel failed on the way (the node went away, the channel's deadline passed, the answer was
    malformed): the read is to be made again another way. The channel is closed."""


_NO_COLUMNS = pa.schema([])
"""What a read channel's client sends batches of: none (its requests are metadata-only messages)."""


class ReadChannel:
    """One read channel with one node: a DoExchange answering ``slices`` tickets of ``columns``, one at a time.

    It lives ``lifetime`` seconds (the call's deadline, so a node that stops waits at most that for it);
    :attr:`fresh` says whether it has more than half of that left. Not thread-safe: one request at a time.
    """

    def __init__(self, client: flight.FlightClient, node: str, columns: list[str] | None, lifetime: float,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self.node = node
        self.columns = columns
        self._renew_at = time.monotonic() + lifetime / 2
        self._schema: pa.Schema | None = None
        self._metadata: dict[str, str] | None = None
        descriptor = flight.FlightDescriptor.for_command(ReadChannelDescriptor(columns=columns).to_bytes())
        options = flight.FlightCallOptions(timeout=lifetime, headers=headers)
        try:
            self._writer, self._reader = client.do_exchange(descriptor, options)
            self._writer.begin(_NO_COLUMNS)
        except (flight.FlightError, pa.ArrowException) as exc:
            raise ChannelBrokenError(str(exc)) from None

    @property
    def fresh(self) -> bool:
        """Whether the channel has more than half its lifetime left (a read then has at least that long)."""
        return time.monotonic() < self._renew_at

    def send(self, ticket: bytes) -> None:
        """Ask for the rows of ``ticket`` (a ``slices`` ticket of this channel's columns)."""
        try:
            self._writer.write_metadata(ticket)
        except (flight.FlightError, pa.ArrowException) as exc:
            self.close()
            raise ChannelBrokenError(str(exc)) from None

    def receive(self) -> pa.Table:
        """The answer to the request sent last, whole; the node's typed error if it refused it (the channel
        goes on), :class:`ChannelBrokenError` if the channel failed (it is closed)."""
        batches: list[pa.RecordBatch] = []
        try:
            while True:
                chunk = self._reader.read_chunk()
                data, end = chunk.data, chunk.app_metadata  # each access wraps anew
                if data is not None:
                    batches.append(data)
                if end is not None:
                    break
            answer = loads_compact(end.to_pybytes())
            error = answer.get("error") if isinstance(answer, dict) else None
            if not isinstance(error, dict):
                table = pa.Table.from_batches(batches, schema=self._schema_of(answer["metadata"] or {}))
                if table.num_rows != answer["rows"]:
                    msg = f"{table.num_rows} rows where it announced {answer['rows']}"
                    raise ValueError(msg)
                return table
        except (StopIteration, flight.FlightError, pa.ArrowException, ValueError, KeyError, TypeError) as exc:
            self.close()
            raise ChannelBrokenError(f"read channel to {self.node} failed: {exc!r}") from None
        raise from_error_info(error)

    def _schema_of(self, metadata: dict[str, str]) -> pa.Schema:
        """The channel's schema with an answer's ``metadata`` (the last one made is kept: answers repeat it)."""
        if self._schema is None or metadata != self._metadata:
            schema = self._reader.schema
            self._schema, self._metadata = schema.with_metadata(metadata) if metadata else schema, metadata
        return self._schema

    def close(self) -> None:
        """End the channel (the node's handler returns); errors of a channel already broken are ignored."""
        for step in (self._writer.done_writing, self._writer.close):  # close even if the half-close failed
            with contextlib.suppress(flight.FlightError, pa.ArrowException):
                step()
