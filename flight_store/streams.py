"""Reading planned slices from store nodes: one ticket per node, rows back in plan order, streams.

A fetch sends each node ONE slices ticket (:func:`slices_ticket`) for all the slices it holds and
puts the answers back in the order of the plan (:func:`in_order`); a stream of several
micro-batches reads each node's single answer a micro-batch at a time (:class:`NodeStream`).
Used by :class:`flight_store.client.StoreClient`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from flight_store.errors import WireDecodeError
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.plan import PlannedSlice
from schemas.wire import encode_slices_ticket


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


def group_ids(slices: Iterable[PlannedSlice]) -> list[str]:
    """The distinct group ids of ``slices``, in order."""
    return list(dict.fromkeys(s.group_id for s in slices))


def slices_ticket(slices: Iterable[PlannedSlice], cols: list[str] | None) -> bytes:
    """The DoGet ticket of ``slices`` (one node's) projected to ``cols``."""
    return encode_slices_ticket(((s.group_id, s.start, s.stop) for s in slices), cols)


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


class NodeStream:
    """One node's DoGet answer of several micro-batches, read a given number of rows at a time."""

    def __init__(self, reader: flight.FlightStreamReader, node: str) -> None:
        self.reader = reader
        self.node = node
        self._pending: deque[pa.RecordBatch] = deque()
        self._rows = 0  # rows in _pending

    def take(self, rows: int) -> pa.Table:
        """The next ``rows`` rows (zero-copy slices of the received batches)."""
        while self._rows < rows:
            try:
                batch = self.reader.read_chunk().data
            except StopIteration:
                msg = f"node {self.node} ended its stream {rows - self._rows} rows short"
                raise WireDecodeError(msg) from None
            self._pending.append(batch)
            self._rows += batch.num_rows
        out: list[pa.RecordBatch] = []
        need = rows
        while need:
            batch = self._pending.popleft()
            if batch.num_rows > need:
                self._pending.appendleft(batch.slice(need))
                batch = batch.slice(0, need)
            out.append(batch)
            need -= batch.num_rows
        self._rows -= rows
        return pa.Table.from_batches(out, schema=self.reader.schema)

    def finish(self, _client: object = None) -> None:
        """Check that the stream ends here (no rows beyond the ones asked for)."""
        extra = self._rows
        for chunk in self.reader:
            extra += chunk.data.num_rows
        if extra:
            msg = f"node {self.node} streamed {extra} rows more than asked for"
            raise WireDecodeError(msg)


def keys_by_node(keys: Sequence[bytes], nodes: Mapping[bytes, str]) -> dict[str, list[bytes]]:
    """``keys`` grouped by the node ``nodes`` names for each (a key it does not name is a KeyError)."""
    out: dict[str, list[bytes]] = {}
    for k in keys:
        out.setdefault(nodes[k], []).append(k)
    return out
