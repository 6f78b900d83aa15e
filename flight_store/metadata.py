"""The append-only metadata log of a store: one row per stored trajectory, numbered by ``seq``.

Rows follow ``METADATA_SCHEMA`` without ``released`` (``seq`` = the row's number, ascending, then the
metadata columns). A write numbers its rows at once; their metadata columns are copied out of the group's
stored blocks later, for all the groups written since in one pass (:meth:`MetadataLog.settle`: when the log
is read, before a group is released, or past :data:`SETTLE_AT` groups), which costs a write a few us where a
copy per write cost ~50. The copies are the log's OWN (so releasing a group frees its payload while its
history stays), kept as a list of record batches compacted as they pile up (:data:`COMPACT_AT`), and read
from a cursor (``seq >= since``, found by binary search) over a lazily built, cached table. The history of
released groups is bounded: the store drops their rows (:meth:`MetadataLog.drop`) beyond
``StoreConfig.history_rows``, keeping the ``seq`` of every other row, so memory follows the live data.

Not thread-safe by itself: the store calls a :class:`MetadataLog` under its lock.

Example:
    >>> from schemas.records import TrajectoryRecord, records_to_batch
    >>> from flight_store.blocks import pack
    >>> from flight_store.validate import normalize_group
    >>> log = MetadataLog()
    >>> batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
    ...     prompt_ids=[1], response_ids=[2], response_logprobs=[-0.5]) for i in range(3)])
    >>> block, _ = pack(normalize_group([batch], "g0", 3)[0])
    >>> log.append([block], 3)  # the first row's seq
    0
    >>> log.table().slice(1).column("seq").to_pylist()
    [1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store.blocks import Block, view
from flight_store.errors import SchemaMismatchError
from schemas.arrow import METADATA_COLUMNS, METADATA_SCHEMA, TRAJECTORY_SCHEMA

LOG_SCHEMA = pa.schema([f for f in METADATA_SCHEMA if f.name != "released"], metadata=METADATA_SCHEMA.metadata)
"""What the log stores: ``METADATA_SCHEMA`` without ``released`` (computed when the log is read)."""

_META_INDEX = [TRAJECTORY_SCHEMA.get_field_index(c) for c in METADATA_COLUMNS]
"""Where the metadata columns are in a trajectory batch (selecting by index costs a third of by name)."""

COMPACT_AT = 64
"""Merged metadata chunks kept before all are merged into one."""
SETTLE_AT = 1024
"""Groups whose metadata rows wait in their blocks before they are copied even when nobody reads the log (a settle
reads each block: ~15 us a group, so it holds the store's lock ~15 ms at most)."""
_META_COLUMNS = frozenset(METADATA_SCHEMA.names)


def check_columns(columns: Sequence[str] | None) -> None:
    """Refuse a projection naming a column the metadata schema lacks (:class:`SchemaMismatchError`)."""
    for c in columns or ():
        if c not in _META_COLUMNS:
            msg = f"unknown metadata column {c!r}; metadata columns are {METADATA_SCHEMA.names}"
            raise SchemaMismatchError(msg, column=c)


def project(table: pa.Table, since: int, columns: Sequence[str] | None) -> pa.Table:
    """Rows of the log ``table`` with ``seq >= since``; ``seq`` first, then ``columns`` (all when ``None``)."""
    if since:
        seq = table.column("seq").to_numpy()  # ascending
        table = table.slice(int(np.searchsorted(seq, since, side="left")))
    if columns is not None:
        table = table.select(["seq", *(c for c in dict.fromkeys(columns) if c != "seq")])
    return table


def with_released(table: pa.Table, released: Sequence[str], columns: Sequence[str] | None) -> pa.Table:
    """Log rows (all log columns) with the ``released`` column (rows of ``released`` groups), projected."""
    flags = pc.is_in(table.column("group_id"), value_set=pa.array(released, pa.string()))
    table = table.append_column(METADATA_SCHEMA.field("released"), flags)
    return project(table, 0, columns)


def _merge(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    return pa.Table.from_batches(batches, schema=LOG_SCHEMA).combine_chunks().to_batches()


class MetadataLog:
    """Metadata rows in ``seq`` order; :meth:`append` numbers new rows, :meth:`table` reads them all."""

    def __init__(self) -> None:
        self.seq = 0
        """Rows in the log (= the ``seq`` of the next row)."""
        self._batches: list[pa.RecordBatch] = []
        self._merged = 0  # leading entries of _batches already merged
        self._cache: pa.Table | None = None
        self._pending: list[tuple[int, int, Sequence[Block]]] = []  # (first seq, rows, blocks) not copied yet
        self._pending_rows = 0

    def append(self, blocks: Sequence[Block], rows: int, seq: int | None = None) -> int:
        """Number the ``rows`` rows of a group stored in ``blocks`` (packed trajectory batches, see
        :func:`~flight_store.blocks.pack`) from ``seq`` (default the next number); returns the first row's ``seq``.

        Their metadata columns are copied out of ``blocks`` by the next :meth:`settle`: the caller keeps the
        blocks until then (the store settles before it releases a group)."""
        first = self.seq if seq is None else seq
        self.seq = max(self.seq, first + rows)  # a restored group's rows lie below the numbers already handed out
        self._pending.append((first, rows, blocks))
        self._pending_rows += rows
        self._cache = None
        if len(self._pending) > SETTLE_AT:
            self.settle()  # bound what waits even when nobody scans
        return first

    def settle(self) -> None:
        """Copy the metadata columns (and ``seq``) of the groups appended since the last call out of their blocks:
        one batch of the log's own for all of them."""
        if not self._pending:
            return
        views = [view(block, TRAJECTORY_SCHEMA) for _, _, blocks in self._pending for block in blocks]
        seq = np.concatenate([np.arange(first, first + rows, dtype=np.int64) for first, rows, _ in self._pending])
        rows = pa.Table.from_batches(views, schema=TRAJECTORY_SCHEMA).select(_META_INDEX)
        rows = rows.add_column(0, LOG_SCHEMA.field("seq"), pa.array(seq)).combine_chunks()
        # serialized and read back: one copy of every column into one buffer, never a view into a block
        self._batches.append(pa.ipc.read_record_batch(rows.to_batches()[0].serialize(), LOG_SCHEMA))
        self._pending.clear()
        self._pending_rows = 0
        if len(self._batches) - self._merged > COMPACT_AT:
            self._compact()

    def drop(self, group_ids: Sequence[str]) -> int:
        """Forget the rows of ``group_ids`` (released history); the others keep their ``seq``. Returns rows dropped."""
        table = self.table()
        keep = pc.invert(pc.is_in(table.column("group_id"), value_set=pa.array(list(group_ids), pa.string())))
        kept = table.filter(keep).combine_chunks()
        dropped = table.num_rows - kept.num_rows
        self._batches = kept.to_batches() or []
        self._merged = len(self._batches)
        self._cache = None
        return dropped

    @property
    def rows(self) -> int:
        """Rows held."""
        return sum(b.num_rows for b in self._batches) + self._pending_rows

    def table(self) -> pa.Table:
        """The whole log as one table (cached until the next change; building it compacts the chunks)."""
        if self._cache is None:
            self.settle()
            self._compact()
            self._cache = pa.Table.from_batches(self._batches, schema=LOG_SCHEMA)
        return self._cache

    @property
    def cached(self) -> bool:
        """Whether :meth:`table` would answer without building (and compacting) anything."""
        return self._cache is not None

    def _compact(self) -> None:
        """Merge the small per-write metadata batches that arrived since the last read into one.

        Only metadata (never payload) is copied; when more than :data:`COMPACT_AT` chunks pile up, all
        are merged, so a scan streams few IPC messages whatever the number of writes.
        """
        merged, tail = self._batches[: self._merged], self._batches[self._merged :]
        if len(tail) > 1:
            tail = _merge(tail)
        merged.extend(tail)
        if len(merged) > COMPACT_AT:
            merged = _merge(merged)
        self._batches = merged
        self._merged = len(merged)
