"""What a valid trajectory batch is: types, defaults and value rules, one implementation for every writer.

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
  ``policy_version_min`` = ``policy_version``, ``num_images`` = ``len(image_keys)`` (or 0),
  ``image_keys`` = ``[]``, ``loss_mask`` = all ones of the response length,
  ``created_at``/``completed_at`` = now, ``finish_reason`` = ``"stop"``, ``status`` =
  ``"completed"``, ``data_source`` = ``"default"``, ``prompt_len``/``response_len`` = the list
  lengths (for the records helpers; the wire requires them);
* ``bytes`` is always recomputed as the row's payload size (:func:`payload_bytes`);
* the batch is validated structurally first (``RecordBatch.validate(full=True)``, one pass: offsets
  monotonic and in bounds, lengths, UTF-8); if that fails, column by column, so a corrupt batch is refused
  naming its column (a sent ``bytes`` column is dropped unread: it is recomputed);
* nulls are refused in every column (and inside list values); timestamps may carry a time zone (the
  instant is stored as naive UTC);
* the value rules of :func:`check_rules`: every ``group_id`` equals the group's; ``sample_idx >= 0``
  and unique; rewards finite; ``loss_mask`` values 0 or 1; versions >= 0 and ``policy_version_min <=
  policy_version``; ``status`` in ``STATUSES``; list lengths agree (``response_logprobs`` and
  ``loss_mask`` have ``len(response_ids)`` values, ``prompt_len``/``response_len`` equal the list
  lengths, ``num_images`` equals ``len(image_keys)``).

The common case (a batch of the schema's columns and types, no nulls, every rule kept, ``sample_idx``
0..rows-1, status "completed") is proven in one native pass over the batch's buffers
(``schemas/_kernels.c``, :func:`_checked_natively`); any other batch goes through the Python checks
above, which are the reference and name what is wrong. The native pass never accepts what they refuse.

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

from schemas import _kernels
from schemas.arrow import IMAGE_SCHEMA, OPTIONAL_ON_WRITE, PAYLOAD_COLUMNS, STATUSES, TRAJECTORY_SCHEMA
from schemas.images import IMAGE_DTYPES, key_of

_EXPECTED: dict[str, pa.DataType] = {f.name: f.type for f in TRAJECTORY_SCHEMA}
_IMAGE_EXPECTED: dict[str, pa.DataType] = {f.name: f.type for f in IMAGE_SCHEMA}
_LIST_COLUMNS = tuple(name for name, typ in _EXPECTED.items() if pa.types.is_list(typ))
_FILLED_FROM_LISTS = {"prompt_len": "prompt_ids", "response_len": "response_ids"}
"""Columns the records helpers may leave out (the wire requires them): the length of this list column."""


class TrajectoryError(ValueError):
    """A trajectory (or image) batch that breaks the schema or a value rule; ``column`` names where."""

    def __init__(self, message: str, *, column: str | None = None) -> None:
        super().__init__(message)
        self.column = column


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
        if pa.types.is_list(src) or pa.types.is_large_list(src):
            return _castable(src.value_type, dst.value_type)
        return False
    if pa.types.is_fixed_size_binary(dst):
        return pa.types.is_binary(src) or pa.types.is_large_binary(src)
    if pa.types.is_timestamp(dst):
        return pa.types.is_timestamp(src)  # naive = UTC; a zoned one is the same instant, stored as naive UTC
    if pa.types.is_large_binary(dst):
        return pa.types.is_binary(src)
    return False


def _check_structure(name: str, arr: pa.Array) -> None:
    try:
        arr.validate(full=True)  # offsets in bounds and monotonic, lengths, UTF-8: before anything reads it
    except pa.ArrowException as exc:
        msg = f"column {name!r} is not a valid Arrow array: {exc}"
        raise TrajectoryError(msg, column=name) from None


def conform_column(name: str, arr: pa.Array | pa.ChunkedArray, expected: pa.DataType, *,
                   validated: bool = False, typed: bool = False) -> pa.Array:
    """``arr`` as type ``expected`` (safe cast where allowed); refuses corrupt structure and nulls, naming ``name``.

    ``validated``: the caller checked the structure already (:func:`normalize_batch` does so for a whole batch);
    ``typed``: and ``arr`` is known to be of type ``expected`` (its batch's schema is the expected one).
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not validated:
        _check_structure(name, arr)
    if not typed and arr.type != expected:
        if not _castable(arr.type, expected):
            msg = f"column {name!r} has type {arr.type}, expected {expected}"
            raise TrajectoryError(msg, column=name)
        try:
            arr = arr.cast(expected, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            msg = f"column {name!r} of type {arr.type} cannot be cast to {expected}: {exc}"
            raise TrajectoryError(msg, column=name) from None
    if arr.null_count:
        msg = f"column {name!r} has {arr.null_count} null value(s); nulls are not allowed"
        raise TrajectoryError(msg, column=name)
    if pa.types.is_list(expected) and arr.values.null_count:  # all child values first: the common case, cheap
        values = pc.list_flatten(arr)
        if values.null_count:
            msg = f"column {name!r} has {values.null_count} null list element(s); nulls are not allowed"
            raise TrajectoryError(msg, column=name)
    return _without_validity(arr)


def _without_validity(arr: pa.Array) -> pa.Array:
    """``arr`` without an all-valid validity bitmap (so a row's bytes are its values and offsets only)."""
    if arr.buffers()[0] is None:
        return arr
    children = [arr.values] if pa.types.is_list(arr.type) else None
    top = 2 if pa.types.is_list(arr.type) else len(arr.buffers())
    return pa.Array.from_buffers(arr.type, len(arr), [None, *arr.buffers()[1:top]], null_count=0, offset=arr.offset,
                                 children=children)


def offset_lengths(arr: pa.Array) -> np.ndarray:
    """Length of each value of a ``list``, ``string`` or ``binary`` array without nulls (32-bit offsets), read off
    its offsets: int32."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=len(arr) + 1, offset=4 * arr.offset)
    return offsets[1:] - offsets[:-1]  # np.diff costs 3x more on a group's few rows


def list_lengths(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Length of each list of ``arr``, int64 (read off the offsets of a ``list`` array without nulls)."""
    if isinstance(arr, pa.Array) and pa.types.is_list(arr.type) and not arr.null_count:
        return offset_lengths(arr).astype(np.int64)
    return pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)


def payload_bytes(columns: dict[str, pa.Array], lengths: dict[str, np.ndarray] | None = None) -> pa.Array:
    """Per-row payload size in bytes: list values times their width, plus one 4-byte offset per list.

    ``lengths``: list lengths already known, by column (the others are read off the offsets).
    """
    known = lengths or {}
    total = np.full(len(columns[PAYLOAD_COLUMNS[0]]), 4 * len(PAYLOAD_COLUMNS), dtype=np.int64)
    for name, width in _PAYLOAD_WIDTHS:
        got = known.get(name)
        total += (list_lengths(columns[name]) if got is None else got) * width
    return pa.array(total)


_PAYLOAD_WIDTHS = tuple((name, _EXPECTED[name].value_type.byte_width) for name in PAYLOAD_COLUMNS)
"""The value width of each payload (list) column."""


def _ones_like_lists(template: pa.Array) -> pa.Array:
    offsets = np.asarray(template.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    values = pa.array(np.ones(int(offsets[-1]), dtype=np.uint8))
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=pa.list_(pa.uint8()))


def utc_now() -> dt.datetime:
    """Now, as the naive UTC datetime the timestamp columns hold."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def _default(name: str, cols: dict[str, pa.Array], n: int, now: dt.datetime) -> pa.Array:
    """The default value of optional column ``name`` for ``n`` rows, from the other columns."""
    if name == "policy_version_min":
        return cols["policy_version"]
    if name == "image_keys":
        return pa.array([[]] * n, type=_EXPECTED["image_keys"])
    if name == "num_images":
        return pa.array(list_lengths(cols["image_keys"]).astype(np.int16), type=pa.int16())
    if name == "loss_mask":
        return _ones_like_lists(cols["response_ids"])
    if name in ("created_at", "completed_at"):
        return pa.repeat(pa.scalar(now, type=pa.timestamp("us")), n)
    if name in _FILLED_FROM_LISTS:
        return pa.array(list_lengths(cols[_FILLED_FROM_LISTS[name]]).astype(np.int32), type=pa.int32())
    value = {"finish_reason": "stop", "status": "completed", "data_source": "default"}[name]
    return pa.repeat(pa.scalar(value, type=pa.string()), n)


_FILL_ORDER = ("policy_version_min", "image_keys", "num_images", "loss_mask", "created_at", "completed_at",
               "finish_reason", "status", "data_source", "prompt_len", "response_len")
"""Optional columns in the order they are filled (``num_images`` after ``image_keys``)."""


def fill_defaults(cols: dict[str, pa.Array], n: int, *, now: dt.datetime | None = None,
                  nulls_are_missing: bool = False, fillable: frozenset[str] = OPTIONAL_ON_WRITE) -> None:
    """Fill the optional columns of ``cols`` (in place) with their defaults.

    A missing column is filled whole. With ``nulls_are_missing`` (the records helpers, whose rows
    leave fields unset one by one), the null values of a present optional column are filled row by
    row; otherwise nulls are left for :func:`conform_column` to refuse.
    """
    stamp = now or utc_now()
    for name in _FILL_ORDER:
        if name not in fillable:
            continue
        got = cols.get(name)
        if got is None:
            cols[name] = _default(name, cols, n, stamp)
        elif nulls_are_missing and got.null_count:
            cols[name] = pc.if_else(pc.is_null(got), _default(name, cols, n, stamp).cast(got.type), got)


def _check_lengths(name: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = int(bad[0])
        msg = f"column {name!r} row {i}: {int(got[i])} values, expected {int(want[i])} ({what})"
        raise TrajectoryError(msg, column=name)


def _check_values(cols: dict[str, pa.Array]) -> None:
    """Rewards finite, loss masks 0 or 1, versions not negative."""
    reward = cols["reward"].to_numpy(zero_copy_only=False)
    if not np.isfinite(reward).all():
        bad = np.flatnonzero(~np.isfinite(reward))
        msg = f"column 'reward' row {int(bad[0])} is {float(reward[bad[0]])}; rewards must be finite"
        raise TrajectoryError(msg, column="reward")
    mask = cols["loss_mask"].flatten().to_numpy(zero_copy_only=False)
    if mask.size and int(mask.max()) > 1:
        msg = f"column 'loss_mask' holds {int(mask.max())}; a loss mask is 0 (not trained on) or 1"
        raise TrajectoryError(msg, column="loss_mask")
    for name in ("policy_version", "policy_version_min"):
        values = cols[name].to_numpy()
        if values.size and values.min() < 0:
            msg = f"column {name!r} holds a negative version {int(values.min())}"
            raise TrajectoryError(msg, column=name)


def _all_equal(arr: pa.Array, value: str) -> bool:
    """Whether every value of the string array ``arr`` (no nulls) is ``value``, read off its buffers."""
    want = value.encode()
    if not (offset_lengths(arr) == len(want)).all():
        return False
    first = int(np.frombuffer(arr.buffers()[1], dtype=np.int32, count=1, offset=4 * arr.offset)[0])
    data = arr.buffers()[2]
    return data is not None and bytes(data[first:first + len(want) * len(arr)]) == want * len(arr)


def check_rules(cols: dict[str, pa.Array], group_id: str) -> dict[str, np.ndarray]:
    """The value rules every row of group ``group_id`` must keep (columns already of the schema's types).

    Returns the list lengths it read, by column (for :func:`payload_bytes`). Every check is a few numpy
    operations on whole columns: a group's few rows make per-call overhead, not data, the cost.
    """
    n = len(cols["group_id"])
    if n and not _all_equal(cols["group_id"], group_id):
        first = next(g for g in cols["group_id"].to_pylist() if g != group_id)
        msg = f"column 'group_id' holds {first!r} but the descriptor names group {group_id!r}"
        raise TrajectoryError(msg, column="group_id")
    sample_idx = cols["sample_idx"].to_numpy()
    if n and sample_idx.min() < 0:
        msg = "column 'sample_idx' has a negative value"
        raise TrajectoryError(msg, column="sample_idx")
    if len(set(sample_idx.tolist())) != n:
        msg = f"column 'sample_idx' repeats a value within one stream of group {group_id!r}"
        raise TrajectoryError(msg, column="sample_idx")
    return _check_row_rules(cols)


def _check_row_rules(cols: dict[str, pa.Array]) -> dict[str, np.ndarray]:
    """The rules of :func:`check_rules` that hold row by row, whatever the row's group; returns the list lengths."""
    if not _all_equal(cols["status"], "completed"):  # the common case, read off the buffers
        bad_status = [s for s in cols["status"].unique().to_pylist() if s not in STATUSES]
        if bad_status:
            msg = f"column 'status' holds {bad_status[0]!r}, not one of {STATUSES}"
            raise TrajectoryError(msg, column="status")
    _check_values(cols)
    vmin, vmax = cols["policy_version_min"].to_numpy(), cols["policy_version"].to_numpy()
    bad = np.nonzero(vmin > vmax)[0]
    if bad.size:
        i = int(bad[0])
        msg = (f"column 'policy_version_min' row {i}: {int(vmin[i])} > policy_version {int(vmax[i])} "
               "(the oldest version that produced a token cannot be newer than the last)")
        raise TrajectoryError(msg, column="policy_version_min")
    lengths = {name: list_lengths(cols[name]) for name in _LIST_COLUMNS}
    got = np.stack([lengths["response_logprobs"], lengths["loss_mask"], cols["response_len"].to_numpy(),
                    cols["prompt_len"].to_numpy(), cols["num_images"].to_numpy()])
    want = np.stack([lengths["response_ids"]] * 3 + [lengths["prompt_ids"], lengths["image_keys"]])
    if (got != want).any():  # name the first column that disagrees (one comparison for all of them)
        for (name, what), g, w in zip(_LENGTH_RULES, got, want, strict=True):
            _check_lengths(name, g, w, what)
    return lengths


_LENGTH_RULES = (("response_logprobs", "len(response_ids)"), ("loss_mask", "len(response_ids)"),
                 ("response_len", "len(response_ids)"), ("prompt_len", "len(prompt_ids)"),
                 ("num_images", "len(image_keys)"))
"""The columns :func:`check_rules` compares with a list's length, in its order."""


def _check_names(names: Sequence[str], fillable: frozenset[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            msg = f"column {name!r} appears more than once"
            raise TrajectoryError(msg, column=name)
        if name not in _EXPECTED:
            msg = f"unknown column {name!r}; the trajectory schema has {list(_EXPECTED)}"
            raise TrajectoryError(msg, column=name)
        seen.add(name)
    for name in _EXPECTED:
        if name not in seen and name not in fillable and name != "bytes":
            msg = f"required column {name!r} is missing"
            raise TrajectoryError(msg, column=name)


def _finish(cols: dict[str, pa.Array], group_id: str) -> pa.RecordBatch:
    cols["bytes"] = payload_bytes(cols, check_rules(cols, group_id))
    return pa.RecordBatch.from_arrays([cols[name] for name in _EXPECTED], schema=TRAJECTORY_SCHEMA)


def build_batch(cols: dict[str, pa.Array], group_id: str, *, now: dt.datetime | None = None,
                nulls_are_missing: bool = False, fillable: frozenset[str] = OPTIONAL_ON_WRITE) -> pa.RecordBatch:
    """Columns of one group -> a batch of exactly ``TRAJECTORY_SCHEMA``: defaults filled, types and rules checked.

    The engine connector and the records helpers call this; :func:`normalize_batch` (the store's
    entry) does the same for a batch that arrived.
    """
    _check_names([c for c in cols if c != "bytes"], fillable)
    fill_defaults(cols, len(cols["group_id"]), now=now, nulls_are_missing=nulls_are_missing, fillable=fillable)
    for name in _EXPECTED:
        if name != "bytes":
            cols[name] = conform_column(name, cols[name], _EXPECTED[name])
    return _finish(cols, group_id)


def normalize_batch(batch: pa.RecordBatch, group_id: str, *, now: dt.datetime | None = None) -> pa.RecordBatch:
    """Validate ``batch`` for group ``group_id`` and return it as ``TRAJECTORY_SCHEMA``.

    Raises:
        TrajectoryError: naming the offending column.
    """
    return _checked_natively(batch, group_id) or _finish(_conformed(batch, now), group_id)


_NATIVE_ROLES: dict[str, pa.DataType] = {
    "group_id": pa.string(), "sample_idx": pa.int32(), "policy_version": pa.int64(),
    "policy_version_min": pa.int64(), "prompt_len": pa.int32(), "response_len": pa.int32(), "reward": pa.float32(),
    "status": pa.string(), "num_images": pa.int16(), "prompt_ids": pa.list_(pa.int32()),
    "response_ids": pa.list_(pa.int32()), "response_logprobs": pa.list_(pa.float32()),
    "loss_mask": pa.list_(pa.uint8()), "image_keys": pa.list_(pa.binary(32)),
}
"""The columns ``_kernels.check_group_batch`` reads, in the order of its roles, with the types it reads them as."""


def _native_table() -> bytes:
    """What ``_kernels.check_group_batch`` is told of the schema: the column count, each role's column index, and
    the value width of each payload list (the last five roles, in :data:`PAYLOAD_COLUMNS` order)."""
    for name, typ in _NATIVE_ROLES.items():
        if _EXPECTED[name] != typ:  # the schema changed: the native pass would misread it
            msg = f"schemas/_kernels.c reads column {name!r} as {typ}; the schema has {_EXPECTED[name]}"
            raise TypeError(msg)
    if tuple(_NATIVE_ROLES)[-5:] != PAYLOAD_COLUMNS:
        msg = f"schemas/_kernels.c counts the payload of {tuple(_NATIVE_ROLES)[-5:]}, not of {PAYLOAD_COLUMNS}"
        raise TypeError(msg)
    index = [TRAJECTORY_SCHEMA.get_field_index(name) for name in _NATIVE_ROLES]
    return np.array([len(TRAJECTORY_SCHEMA), *index, *(w for _, w in _PAYLOAD_WIDTHS)], dtype=np.int32).tobytes()


_NATIVE_TABLE = _native_table()
SIGNATURE: bytes = _kernels.signature(TRAJECTORY_SCHEMA.__arrow_c_schema__())
"""The trajectory schema's column names and types as the native passes compare them (``_kernels.signature``)."""
_FIELDS_SIGNATURE = _kernels.signature(TRAJECTORY_SCHEMA.__arrow_c_schema__(), True)
"""The same with each field's nullability and metadata: a batch with it keeps its fields."""
_BYTES_INDEX = TRAJECTORY_SCHEMA.get_field_index("bytes")


def _checked_natively(batch: pa.RecordBatch, group_id: str) -> pa.RecordBatch | None:
    """The common case in one native pass: a batch of the schema's columns and types, structurally valid, with no
    null (and no validity bitmap) anywhere, whose rows keep every rule of :func:`check_rules` with ``sample_idx``
    0..rows-1 and ``status`` "completed", returned as ``TRAJECTORY_SCHEMA`` with ``bytes`` recomputed; ``None``
    for any other batch, which the Python rules then decide on (and name what is wrong).

    ``_kernels.check_group_batch`` (schemas/_kernels.c) reads the batch through the Arrow C data interface and
    compares its schema's column names and types with the trajectory schema's (:data:`SIGNATURE`); it accepts a
    subset of what the Python rules accept (the tests hold it to that), in ~10 us instead of ~150.
    """
    if not batch.num_rows:
        return None
    try:
        batch.validate(full=True)  # offsets in bounds and monotonic: what the native pass may read
    except pa.ArrowException:
        return None
    out = np.empty(batch.num_rows, dtype=np.int64)
    schema, array = batch.__arrow_c_array__()
    code = _kernels.check_group_batch(schema, array, SIGNATURE, _FIELDS_SIGNATURE, group_id.encode(), b"completed",
                                      _NATIVE_TABLE, out)
    if code > 0:
        return None
    if code == 0:  # the schema's own fields (the common case): only `bytes` and the schema's metadata to set
        checked = batch.set_column(_BYTES_INDEX, TRAJECTORY_SCHEMA.field(_BYTES_INDEX), pa.array(out))
        return checked.replace_schema_metadata(TRAJECTORY_SCHEMA.metadata)
    columns = [batch.column(i) for i in range(_BYTES_INDEX)] + [pa.array(out)] + [
        batch.column(i) for i in range(_BYTES_INDEX + 1, batch.num_columns)]
    return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)  # the schema itself, not the writer's


def _conformed(batch: pa.RecordBatch, now: dt.datetime | None) -> dict[str, pa.Array]:
    """The columns of ``batch`` (``bytes`` left out) checked for names and structure, of the schema's types, and
    with the optional ones filled: what :func:`normalize_batch` checks the rules on."""
    typed = batch.schema.equals(TRAJECTORY_SCHEMA)  # the common case: every column, in order, of its type
    if not typed:
        _check_names(batch.schema.names, OPTIONAL_ON_WRITE)
    try:
        batch.validate(full=True)  # every column in one pass; the slow path below names the broken one
        validated = True
    except pa.ArrowException:
        validated = False
    cols = {name: conform_column(name, batch.column(i), _EXPECTED[name], validated=validated, typed=typed)
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
    if len(batches) == 1 and batches[0].num_rows == rows:  # the common case: one batch of rows 0..rows-1
        fast = _checked_natively(batches[0], group_id)
        if fast is not None:
            return [fast]
    # the Python rules (which name what is wrong): the native pass declined the one batch, or there are several,
    # of which it could take at most the one holding sample_idx 0..n-1
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
    cols["bytes"] = payload_bytes(cols, _check_row_rules(cols))
    return pa.RecordBatch.from_arrays([cols[name] for name in _EXPECTED], schema=TRAJECTORY_SCHEMA)


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
