"""What a valid trajectory batch is, checked whole: one implementation for every writer and the store.

The records helpers (``schemas.records``), the engine connector (``connectors.vllm``) and the store
(``flight_store``) all build or check trajectory batches with these functions, so a batch one of
them accepts, the others accept too.

:func:`normalize_batch` turns one batch a writer sent into a batch of exactly
``TRAJECTORY_SCHEMA`` (schema column order), or raises :class:`TrajectoryError` naming the column:

* names and types against ``TRAJECTORY_SCHEMA``; columns may come in any order; unknown or
  duplicate columns are refused;
* cheap safe casts are accepted (integer widths, ``large_list``/``list`` of castable values,
  ``large_string``/dictionary-encoded strings, ``bool`` loss masks, timestamp units, binary image
  keys of 32 bytes); a cast that would lose information is refused;
* columns in ``OPTIONAL_ON_WRITE`` may be missing and are filled (:func:`fill_defaults`):
  ``token_versions`` = ``policy_version`` once per response token, ``policy_version_min`` = the smallest
  token version (``policy_version`` when ``token_versions`` is left out), ``num_images`` = ``len(image_keys)`` (or 0),
  ``image_keys`` = ``[]``, ``loss_mask`` = all ones of the response length, ``num_turns`` = 1,
  ``loss_tokens`` = ``sum(loss_mask)``,
  ``created_at``/``completed_at`` = now, ``finish_reason`` = ``"stop"``, ``status`` =
  ``"completed"``, ``data_source`` = ``"default"``, ``prompt_len``/``response_len`` = the list
  lengths (for the records helpers; the wire requires them);
* ``bytes`` is always recomputed as the row's payload size (:func:`~schemas.trajectory_rules.payload_bytes`);
* the batch is validated structurally first (``RecordBatch.validate(full=True)``, one pass: offsets
  monotonic and in bounds, lengths, UTF-8); if that fails, column by column, so a corrupt batch is refused
  naming its column (a sent ``bytes`` column is dropped unread: it is recomputed);
* nulls are refused in every column (and inside list values); timestamps may carry a time zone (the
  instant is stored as naive UTC);
* the value rules of :func:`~schemas.trajectory_rules.check_rules`: every ``group_id`` equals the group's;
  ``sample_idx >= 0`` and unique; rewards finite; ``loss_mask`` values 0 or 1, ``loss_tokens`` their sum;
  ``num_turns >= 1``; versions >= 0 and
  ``policy_version_min <= policy_version``, each token version between them; ``status`` in ``STATUSES``;
  list lengths agree (``response_logprobs``, ``loss_mask`` and ``token_versions`` have ``len(response_ids)``
  values, ``prompt_len``/``response_len`` equal the list
  lengths, ``num_images`` equals ``len(image_keys)``).

What each column must be (types, casts, defaults, rules) is :mod:`schemas.trajectory_rules`. The common
case (a batch of the schema's columns and types, no nulls, every rule kept, ``sample_idx`` 0..rows-1) is
proven in one native pass over the batch's buffers (:func:`schemas.native.checked_natively`); any other
batch goes through the Python rules, which are the reference and name what is wrong. The native pass
never accepts what they refuse.

:func:`normalize_group` normalises the batches of one whole group (one DoPut stream): exactly the
declared number of rows, ``sample_idx`` 0..rows-1 once each; :func:`normalize_groups` checks the same for
several whole groups at once (a bulk write). :func:`normalize_images` does the same for
the image table, and checks each image's content key against its bytes.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.arrow import IMAGE_SCHEMA, OPTIONAL_ON_WRITE, TRAJECTORY_SCHEMA
from schemas.images import IMAGE_DTYPES, key_of
from schemas.native import checked_natively
from schemas.trajectory_rules import (
    COLUMN_TYPES,
    TrajectoryError,
    check_names,
    check_row_rules,
    check_rules,
    conform_column,
    fill_defaults,
    payload_bytes,
    utc_now,
)

_IMAGE_EXPECTED: dict[str, pa.DataType] = {f.name: f.type for f in IMAGE_SCHEMA}

__all__ = ["TrajectoryError", "build_batch", "fill_defaults", "normalize_batch", "normalize_group",
           "normalize_groups", "normalize_images"]


def _finish(cols: dict[str, pa.Array], group_id: str) -> pa.RecordBatch:
    cols["bytes"] = payload_bytes(cols, check_rules(cols, group_id))
    return pa.RecordBatch.from_arrays([cols[name] for name in COLUMN_TYPES], schema=TRAJECTORY_SCHEMA)


def build_batch(cols: dict[str, pa.Array], group_id: str, *, now: dt.datetime | None = None,
                nulls_are_missing: bool = False, fillable: frozenset[str] = OPTIONAL_ON_WRITE) -> pa.RecordBatch:
    """Columns of one group -> a batch of exactly ``TRAJECTORY_SCHEMA``: defaults filled, types and rules checked.

    The engine connector and the records helpers call this; :func:`normalize_batch` (the store's
    entry) does the same for a batch that arrived.
    """
    check_names([c for c in cols if c != "bytes"], fillable)
    fill_defaults(cols, len(cols["group_id"]), now=now, nulls_are_missing=nulls_are_missing, fillable=fillable)
    for name in COLUMN_TYPES:
        if name != "bytes":
            cols[name] = conform_column(name, cols[name], COLUMN_TYPES[name])
    return _finish(cols, group_id)


def normalize_batch(batch: pa.RecordBatch, group_id: str, *, now: dt.datetime | None = None) -> pa.RecordBatch:
    """Validate ``batch`` for group ``group_id`` and return it as ``TRAJECTORY_SCHEMA``.

    Raises:
        TrajectoryError: naming the offending column.
    """
    fast = checked_natively(batch, group_id)
    return fast.batch if fast is not None else _finish(_conformed(batch, now), group_id)


def _conformed(batch: pa.RecordBatch, now: dt.datetime | None) -> dict[str, pa.Array]:
    """The columns of ``batch`` (``bytes`` left out) checked for names and structure, of the schema's types, and
    with the optional ones filled: what :func:`normalize_batch` checks the rules on."""
    typed = batch.schema.equals(TRAJECTORY_SCHEMA)  # the common case: every column, in order, of its type
    if not typed:
        check_names(batch.schema.names, OPTIONAL_ON_WRITE)
    try:
        batch.validate(full=True)  # every column in one pass; the slow path below names the broken one
        validated = True
    except pa.ArrowException:
        validated = False
    cols = {name: conform_column(name, batch.column(i), COLUMN_TYPES[name], validated=validated, typed=typed)
            for i, name in enumerate(batch.schema.names) if name != "bytes"}  # by index: by name costs 2x
    if not typed:  # a column left out: its default
        fill_defaults(cols, batch.num_rows, now=now)
    return cols


def normalize_group(batches: Sequence[pa.RecordBatch], group_id: str, rows: int) -> list[pa.RecordBatch]:
    """Normalise the batches of one whole group: exactly ``rows`` rows, ``sample_idx`` 0..rows-1 once each.

    Raises:
        TrajectoryError: a batch breaks a rule, the stream holds another number of rows, or the
            ``sample_idx`` repeat or leave a gap (named).
    """
    return normalize_group_sized(batches, group_id, rows)[0]


def normalize_group_sized(batches: Sequence[pa.RecordBatch], group_id: str,
                          rows: int) -> tuple[list[pa.RecordBatch], list[np.ndarray | None]]:
    """:func:`normalize_group`, and each batch's :func:`~schemas.native.row_bytes` where the native pass read them
    (``None`` elsewhere)."""
    if len(batches) == 1 and batches[0].num_rows == rows:  # the common case: one batch of rows 0..rows-1
        fast = checked_natively(batches[0], group_id)
        if fast is not None:
            return [fast.batch], [fast.row_bytes]
    out = group_by_rules(batches, group_id, rows)
    return out, [None] * len(out)


def group_by_rules(batches: Sequence[pa.RecordBatch], group_id: str, rows: int) -> list[pa.RecordBatch]:
    """:func:`normalize_group` by the Python rules alone (the reference; they name what is wrong): for a group
    the native pass declined, or sent as several batches."""
    now = utc_now()
    out = [_finish(_conformed(b, now), group_id) for b in batches if b.num_rows]
    got = sum(b.num_rows for b in out)
    if got != rows:
        msg = f"group {group_id!r} declares {rows} rows but its stream carried {got}"
        raise TrajectoryError(msg, column="sample_idx")
    if len(out) == 1 and out[0].column("sample_idx").to_numpy().max() < rows:
        return out  # the common case: check_rules found them distinct and >= 0, so 0..rows-1 once each
    idx = np.concatenate([b.column("sample_idx").to_numpy() for b in out])
    counts = np.bincount(np.clip(idx, 0, rows), minlength=rows + 1)
    if counts[:rows].max() > 1:
        msg = f"column 'sample_idx' repeats {int(np.argmax(counts[:rows] > 1))} in group {group_id!r}"
        raise TrajectoryError(msg, column="sample_idx")
    if counts[rows] or counts[:rows].min() == 0:
        missing = int(np.argmin(counts[:rows])) if counts[:rows].min() == 0 else rows
        msg = (f"column 'sample_idx' of group {group_id!r} must hold 0..{rows - 1} once each; "
               f"{missing} is missing (values {sorted(set(idx.tolist()))[:8]}...)")
        raise TrajectoryError(msg, column="sample_idx")
    return out


def normalize_groups(table: pa.Table, groups: Sequence[tuple[str, int]]) -> pa.RecordBatch:
    """Normalise the rows of several whole groups in one pass over whole columns: ``groups`` lists each group's
    ``(group_id, rows)`` in the order of ``table``'s rows (a bulk write's stream).

    Every rule :func:`normalize_group` keeps holds for each group's rows (its ``group_id`` on every row,
    ``sample_idx`` 0..rows-1 once each); the checks run once for all the groups, so their cost is paid once
    per call, not per group. Returns one batch of ``TRAJECTORY_SCHEMA``, the groups' rows in order.

    Raises:
        TrajectoryError: some row breaks a rule. Which group is not said: a caller that must name the groups
            it refuses checks them one by one with :func:`normalize_group` then.
    """
    rows = np.array([r for _, r in groups], dtype=np.int64)
    if not groups or int(rows.sum()) != table.num_rows or (rows <= 0).any():
        msg = f"{len(groups)} groups declare {int(rows.sum())} rows but the stream carried {table.num_rows}"
        raise TrajectoryError(msg, column="sample_idx")
    batch = table.combine_chunks().to_batches()[0]  # one batch (a copy only when the stream had several)
    cols = _conformed(batch, utc_now())
    ids = pa.array([g for g, _ in groups], type=pa.string())
    owner = np.repeat(np.arange(len(groups)), rows)  # each row's group, by position
    if not pc.all(pc.equal(cols["group_id"], ids.take(owner))).as_py():
        msg = "a row's group_id is not the group the descriptor declares for it"
        raise TrajectoryError(msg, column="group_id")
    first = np.concatenate(([0], np.cumsum(rows)[:-1]))
    sample_idx = cols["sample_idx"].to_numpy().astype(np.int64)
    if (sample_idx < 0).any() or (sample_idx >= rows[owner]).any() or (
            np.bincount(first[owner] + sample_idx, minlength=len(sample_idx)) != 1).any():
        msg = "a group's sample_idx are not 0..rows-1 once each"
        raise TrajectoryError(msg, column="sample_idx")
    cols["bytes"] = payload_bytes(cols, check_row_rules(cols))
    return pa.RecordBatch.from_arrays([cols[name] for name in COLUMN_TYPES], schema=TRAJECTORY_SCHEMA)


def normalize_images(table: pa.Table | pa.RecordBatch) -> pa.Table:
    """Validate an image table (columns in any order, safe casts) and return it as ``IMAGE_SCHEMA``."""
    names = table.schema.names
    for name in names:
        if names.count(name) > 1:
            msg = f"image column {name!r} appears more than once"
            raise TrajectoryError(msg, column=name)
        if name not in _IMAGE_EXPECTED:
            msg = f"unknown image column {name!r}; the image schema has {list(_IMAGE_EXPECTED)}"
            raise TrajectoryError(msg, column=name)
    arrays = []
    for name, typ in _IMAGE_EXPECTED.items():
        if name not in names:
            msg = f"required image column {name!r} is missing"
            raise TrajectoryError(msg, column=name)
        arrays.append(conform_column(name, table.column(name), typ))
    out = pa.Table.from_arrays(arrays, schema=IMAGE_SCHEMA)
    _check_images(out)
    return out


def _check_images(table: pa.Table) -> None:
    """Each image's dtype known, its data ``prod(shape) * itemsize`` bytes, and its key the hash of them."""
    keys = table.column("image_key").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data")
    for i, (key, shape, dtype) in enumerate(zip(keys, shapes, dtypes, strict=True)):
        if dtype not in IMAGE_DTYPES:
            msg = f"image {key.hex()} has dtype {dtype!r}, not one of {sorted(IMAGE_DTYPES)}"
            raise TrajectoryError(msg, column="dtype")
        if any(d < 0 for d in shape):
            msg = f"image {key.hex()} has a negative dimension in shape {shape}"
            raise TrajectoryError(msg, column="shape")
        buf = data[i].as_buffer()
        want = math.prod(shape) * np.dtype(dtype).itemsize  # exact: a huge shape must not wrap around
        if buf.size != want:
            msg = f"image {key.hex()} has {buf.size} bytes of data, but shape {shape} of {dtype} needs {want}"
            raise TrajectoryError(msg, column="data")
        actual = key_of(dtype, shape, buf)
        if actual != key:
            msg = (f"image key {key.hex()} does not match its content (SHA-256 of dtype, shape and bytes is "
                   f"{actual.hex()})")
            raise TrajectoryError(msg, column="image_key")

