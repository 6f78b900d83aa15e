"""The store's side of validation: ``schemas.trajectory``'s rules, refusals as :class:`SchemaMismatchError`.

The rules themselves (types, safe casts, defaults, value rules) live in :mod:`schemas.trajectory`,
shared with every writer; this module only turns their :class:`~schemas.trajectory.TrajectoryError`
into the error that crosses the Flight boundary typed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

from flight_store.errors import SchemaMismatchError
from schemas import trajectory


@contextlib.contextmanager
def _as_schema_mismatch() -> Iterator[None]:
    try:
        yield
    except trajectory.TrajectoryError as exc:
        raise SchemaMismatchError(str(exc), column=exc.column) from None


def normalize_batch(batch: pa.RecordBatch, group_id: str, *, now: dt.datetime | None = None) -> pa.RecordBatch:
    """:func:`schemas.trajectory.normalize_batch`, refusing with :class:`SchemaMismatchError`."""
    with _as_schema_mismatch():
        return trajectory.normalize_batch(batch, group_id, now=now)


def normalize_group(batches: Sequence[pa.RecordBatch], group_id: str, rows: int) -> list[pa.RecordBatch]:
    """:func:`schemas.trajectory.normalize_group`, refusing with :class:`SchemaMismatchError`."""
    return normalize_group_sized(batches, group_id, rows)[0]


def normalize_group_sized(batches: Sequence[pa.RecordBatch], group_id: str,
                          rows: int) -> tuple[list[pa.RecordBatch], list[np.ndarray | None]]:
    """:func:`schemas.trajectory.normalize_group_sized`, refusing with :class:`SchemaMismatchError`."""
    try:  # every DoPut of a group passes here: no context manager to build
        return trajectory.normalize_group_sized(batches, group_id, rows)
    except trajectory.TrajectoryError as exc:
        raise SchemaMismatchError(str(exc), column=exc.column) from None


def normalize_groups(table: pa.Table, groups: Sequence[tuple[str, int]]) -> pa.RecordBatch:
    """:func:`schemas.trajectory.normalize_groups`, refusing with :class:`SchemaMismatchError`."""
    with _as_schema_mismatch():
        return trajectory.normalize_groups(table, groups)


def normalize_images(table: pa.Table | pa.RecordBatch) -> pa.Table:
    """:func:`schemas.trajectory.normalize_images`, refusing with :class:`SchemaMismatchError`."""
    with _as_schema_mismatch():
        return trajectory.normalize_images(table)
