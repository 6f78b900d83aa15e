"""The append-only metadata log of a store: one row per stored trajectory, numbered by ``seq``.

Rows follow ``METADATA_SCHEMA`` without ``released`` (``seq`` = the row's number, ascending, then the
metadata columns). They are kept as a list of small record batches holding their OWN copies of the
metadata columns (so releasing a group frees its payload while its history stays), compacted as
they pile up (:data:`COMPACT_AT`), and read from a cursor (``seq >= since``, found by binary
search) over a lazily built, cached table. The history of released groups is bounded: the store
drops their rows (:meth:`MetadataLog.drop`) beyond ``StoreConfig.history_rows``, keeping the
``seq`` of every other row, so memory follows the live data.

Not thread-safe by itself: the store calls a :class:`MetadataLog` under its lock.

Example:
    >>> from schemas.records import TrajectoryRecord, records_to_batch
    >>> from flight_store.validate import normalize_group
    >>> log = MetadataLog()
    >>> batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
    ...     prompt_ids=[1], response_ids=[2], response_logprobs=[-0.5]) for i in range(3)])
    >>> log.append(normalize_group([batch], "g0", 3))  # the first row's seq
    0
    >>> log.table().slice(1).column("seq").to_pylist()
    [1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store.errors import SchemaMismatchError
from schemas.arrow import METADATA_COLUMNS, METADATA_SCHEMA, TRAJECTORY_SCHEMA

LOG_SCHEMA = pa.schema([f for f in METADATA_SCHEMA if f.name != "released"], metadata=METADATA_SCHEMA.metadata)
"""What the log stores: ``METADATA_SCHEMA`` without ``released`` (computed when the log is read)."""

_META_INDEX = [TRAJECTORY_SCHEMA.get_field_index(c) for c in METADATA_COLUMNS]
"""Where the metadata columns are in a trajectory batch (selecting by index costs a third of by name)."""

COMPACT_AT = 64
"""Merged metadata chunks kept before all are merged into one."""
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

    def append(self, batches: Sequence[pa.RecordBatch], seq: int | None = None) -> int:
        """Number the rows of trajectory ``batches`` (from ``seq``, default the next number) and keep own copies
        of their metadata columns; returns the first row's ``seq``."""
        first, top = (self.seq if seq is None else seq), self.seq
        self.seq = first
        self._batches.extend(self._rows(b) for b in batches)
        self.seq = max(self.seq, top)  # a restored group's rows lie below the numbers already handed out
        self._cache = None
        if len(self._batches) - self._merged > COMPACT_AT:
            self._compact()  # bound the many tiny per-write batches even when nobody scans
        return first

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
        return sum(b.num_rows for b in self._batches)
    def table(self) -> pa.Table:
        """The whole log as one table (cached until the next change; building it compacts the chunks)."""
        if self._cache is None:
            self._compact()
            self._cache = pa.Table.from_batches(self._batches, schema=LOG_SCHEMA)
        return self._cache

    @property
    def cached(self) -> bool:
        """Whether :meth:`table` would answer without building (and compacting) anything."""
        return self._cache is not None

    def _rows(self, b: pa.RecordBatch) -> pa.RecordBatch:
        """Own copies of the metadata columns of ``b`` plus ``seq`` (payload buffers are not kept alive)."""
        n = b.num_rows
        seq = pa.array(np.arange(self.seq, self.seq + n, dtype=np.int64))
        self.seq += n  # the next number (a log restored from a compacted spill log may skip numbers)
        rows = b.select(_META_INDEX)  # a stored (normalized or restored) batch: the trajectory schema's columns
        # serialized and read back: one copy of every column into one buffer (a `take` costs 5x more)
        return pa.ipc.read_record_batch(rows.add_column(0, LOG_SCHEMA.field("seq"), seq).serialize(), LOG_SCHEMA)

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
