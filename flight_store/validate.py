"""Validation and normalisation of incoming trajectory batches (no gRPC, no store state).

:func:`normalize_batch` turns one batch a writer sent into a batch of exactly
``TRAJECTORY_SCHEMA`` (schema column order), or raises :class:`SchemaMismatchError` naming the
column. It keeps these rules:

* names and types against ``TRAJECTORY_SCHEMA``; columns may come in any order; unknown or
  duplicate columns are refused;
* cheap safe casts are accepted (integer widths, ``large_list``/``list`` of castable values,
  ``large_string``/dictionary-encoded strings, ``bool`` loss masks, timestamp units, binary image
  keys of 32 bytes); a cast that would lose information is refused;
* columns in ``OPTIONAL_ON_WRITE`` may be missing and are filled: ``policy_version_min`` =
  ``policy_version``, ``num_images`` = ``len(image_keys)`` (or 0), ``image_keys`` = ``[]``,
  ``loss_mask`` = all ones of the response length, ``created_at``/``completed_at`` = now,
  ``finish_reason`` = ``"stop"``, ``status`` = ``"completed"``, ``data_source`` = ``"default"``;
* ``bytes`` is always recomputed as the row's payload size (:func:`payload_bytes`);
* nulls are refused in every column (and inside list values);
* every ``group_id`` equals the descriptor's; ``sample_idx >= 0``; ``status`` in ``STATUSES``;
* list lengths agree: ``response_logprobs`` and ``loss_mask`` have ``len(response_ids)`` values,
  ``prompt_len``/``response_len`` equal the list lengths, ``num_images`` equals ``len(image_keys)``.

:func:`check_unique_samples` refuses a stream whose batches repeat a ``sample_idx``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store.errors import SchemaMismatchError
from schemas.arrow import IMAGE_SCHEMA, OPTIONAL_ON_WRITE, PAYLOAD_COLUMNS, STATUSES, TRAJECTORY_SCHEMA

_EXPECTED: dict[str, pa.DataType] = {f.name: f.type for f in TRAJECTORY_SCHEMA}


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether ``src`` may be cast (safely, cheaply) to ``dst``."""
    if src == dst:
        return True
    if pa.types.is_integer(dst):
        return pa.types.is_integer(src) or (pa.types.is_boolean(src) and dst == pa.uint8())
    if pa.types.is_string(dst):
        if pa.types.is_large_string(src) or pa.types.is_string_view(src):
            return True
        return pa.types.is_dictionary(src) and _castable(src.value_type, dst)
    if pa.types.is_list(dst):
        if pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_list_view(src):
            return _castable(src.value_type, dst.value_type)
        return False
    if pa.types.is_fixed_size_binary(dst):
        return pa.types.is_binary(src) or pa.types.is_large_binary(src)
    if pa.types.is_timestamp(dst):
        return pa.types.is_timestamp(src) and src.tz is None
    if pa.types.is_large_binary(dst):
        return pa.types.is_binary(src)
    return False


def conform_column(name: str, arr: pa.Array, expected: pa.DataType) -> pa.Array:
    """``arr`` as type ``expected`` (safe cast where allowed); refuses nulls, naming ``name``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.type != expected:
        if not _castable(arr.type, expected):
            msg = f"column {name!r} has type {arr.type}, expected {expected}"
            raise SchemaMismatchError(msg, column=name)
        try:
            arr = arr.cast(expected, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            msg = f"column {name!r} of type {arr.type} cannot be cast to {expected}: {exc}"
            raise SchemaMismatchError(msg, column=name) from None
    if arr.null_count:
        msg = f"column {name!r} has {arr.null_count} null value(s); nulls are not allowed"
        raise SchemaMismatchError(msg, column=name)
    if pa.types.is_list(expected):
        values = pc.list_flatten(arr)
        if values.null_count:
            msg = f"column {name!r} has {values.null_count} null list element(s); nulls are not allowed"
            raise SchemaMismatchError(msg, column=name)
    return arr


def _list_lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)


def payload_bytes(columns: dict[str, pa.Array]) -> pa.Array:
    """Per-row payload size in bytes: list values times their width, plus one 4-byte offset per list."""
    total: np.ndarray | None = None
    for name in PAYLOAD_COLUMNS:
        arr = columns[name]
        width = arr.type.value_type.byte_width
        part = _list_lengths(arr) * width + 4
        total = part if total is None else total + part
    if total is None:  # pragma: no cover - PAYLOAD_COLUMNS is never empty
        total = np.zeros(0, dtype=np.int64)
    return pa.array(total, type=pa.int64())


def _ones_like_lists(template: pa.Array) -> pa.Array:
    offsets = np.asarray(template.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    values = pa.array(np.ones(int(offsets[-1]), dtype=np.uint8))
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=pa.list_(pa.uint8()))


def _check_lengths(name: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = int(bad[0])
        msg = f"column {name!r} row {i}: {int(got[i])} values, expected {int(want[i])} ({what})"
        raise SchemaMismatchError(msg, column=name)


def normalize_batch(batch: pa.RecordBatch, group_id: str, *, now: dt.datetime | None = None) -> pa.RecordBatch:
    """Validate ``batch`` for group ``group_id`` and return it as ``TRAJECTORY_SCHEMA``.

    Raises:
        SchemaMismatchError: naming the offending column.
    """
    names = batch.schema.names
    seen: set[str] = set()
    for name in names:
        if name in seen:
            msg = f"column {name!r} appears more than once"
            raise SchemaMismatchError(msg, column=name)
        if name not in _EXPECTED:
            msg = f"unknown column {name!r}; the trajectory schema has {list(_EXPECTED)}"
            raise SchemaMismatchError(msg, column=name)
        seen.add(name)
    for name in _EXPECTED:
        if name not in seen and name not in OPTIONAL_ON_WRITE:
            msg = f"required column {name!r} is missing"
            raise SchemaMismatchError(msg, column=name)

    n = batch.num_rows
    cols: dict[str, pa.Array] = {}
    for name in names:
        if name == "bytes":
            continue
        cols[name] = conform_column(name, batch.column(name), _EXPECTED[name])

    # keys
    gids = cols["group_id"]
    if n and not pc.all(pc.equal(gids, pa.scalar(group_id))).as_py():
        first = next(g for g in gids.to_pylist() if g != group_id)
        msg = f"column 'group_id' holds {first!r} but the descriptor names group {group_id!r}"
        raise SchemaMismatchError(msg, column="group_id")
    if n and pc.min(cols["sample_idx"]).as_py() < 0:
        msg = "column 'sample_idx' has a negative value"
        raise SchemaMismatchError(msg, column="sample_idx")
    if len(set(cols["sample_idx"].to_numpy().tolist())) != n:
        msg = f"column 'sample_idx' repeats a value within one stream of group {group_id!r}"
        raise SchemaMismatchError(msg, column="sample_idx")

    # fill optional columns
    stamp = pa.scalar(now or dt.datetime.now(dt.UTC).replace(tzinfo=None), type=pa.timestamp("us"))
    fills: dict[str, pa.Array] = {}
    if "policy_version_min" not in cols:
        fills["policy_version_min"] = cols["policy_version"]
    if "image_keys" not in cols:
        fills["image_keys"] = pa.array([[]] * n, type=_EXPECTED["image_keys"])
    if "num_images" not in cols:
        keys = fills.get("image_keys", cols.get("image_keys"))
        fills["num_images"] = pa.array(_list_lengths(keys).astype(np.int16), type=pa.int16())
    if "loss_mask" not in cols:
        fills["loss_mask"] = _ones_like_lists(cols["response_ids"])
    for name in ("created_at", "completed_at"):
        if name not in cols:
            fills[name] = pa.repeat(stamp, n)
    for name, value in (("finish_reason", "stop"), ("status", "completed"), ("data_source", "default")):
        if name not in cols:
            fills[name] = pa.repeat(pa.scalar(value, type=pa.string()), n)
    cols.update(fills)

    # value rules
    if n and not pc.all(pc.is_in(cols["status"], value_set=pa.array(STATUSES))).as_py():
        bad = next(s for s in cols["status"].to_pylist() if s not in STATUSES)
        msg = f"column 'status' holds {bad!r}, not one of {STATUSES}"
        raise SchemaMismatchError(msg, column="status")
    resp = _list_lengths(cols["response_ids"])
    _check_lengths("response_logprobs", _list_lengths(cols["response_logprobs"]), resp, "len(response_ids)")
    _check_lengths("loss_mask", _list_lengths(cols["loss_mask"]), resp, "len(response_ids)")
    _check_lengths("response_len", cols["response_len"].to_numpy().astype(np.int64), resp, "len(response_ids)")
    prompt = _list_lengths(cols["prompt_ids"])
    _check_lengths("prompt_len", cols["prompt_len"].to_numpy().astype(np.int64), prompt, "len(prompt_ids)")
    nimg = _list_lengths(cols["image_keys"])
    _check_lengths("num_images", cols["num_images"].to_numpy().astype(np.int64), nimg, "len(image_keys)")

    cols["bytes"] = payload_bytes(cols)
    return pa.RecordBatch.from_arrays([cols[name] for name in _EXPECTED], schema=TRAJECTORY_SCHEMA)


def normalize_stream(batches: Sequence[pa.RecordBatch], group_id: str) -> list[pa.RecordBatch]:
    """Normalise every batch of one DoPut stream; refuses a ``sample_idx`` repeated across batches."""
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    out = [normalize_batch(b, group_id, now=now) for b in batches if b.num_rows]
    seen: set[int] = set()
    for b in out:
        idx = b.column("sample_idx").to_numpy().tolist()
        dup = seen.intersection(idx)
        if dup:
            msg = f"column 'sample_idx' repeats {min(dup)} within one stream of group {group_id!r}"
            raise SchemaMismatchError(msg, column="sample_idx")
        seen.update(idx)
    return out


_IMAGE_EXPECTED: dict[str, pa.DataType] = {f.name: f.type for f in IMAGE_SCHEMA}


def normalize_images(table: pa.Table | pa.RecordBatch) -> pa.Table:
    """Validate an image table (columns in any order, safe casts) and return it as ``IMAGE_SCHEMA``."""
    names = table.schema.names
    for name in names:
        if name not in _IMAGE_EXPECTED:
            msg = f"unknown image column {name!r}; the image schema has {list(_IMAGE_EXPECTED)}"
            raise SchemaMismatchError(msg, column=name)
    arrays = []
    for name, typ in _IMAGE_EXPECTED.items():
        if name not in names:
            msg = f"required image column {name!r} is missing"
            raise SchemaMismatchError(msg, column=name)
        col = table.column(name)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        arrays.append(conform_column(name, col, typ))
    return pa.Table.from_arrays(arrays, schema=IMAGE_SCHEMA)
