"""What each column of a trajectory batch must be: its type and the safe casts to it, its default, its rules.

:mod:`schemas.trajectory` applies these to whole batches (a writer's, or one that arrived at a store);
the records helpers and the engine connector reach them through it, so every writer and the store
check a batch with the same functions.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.arrow import OPTIONAL_ON_WRITE, PAYLOAD_COLUMNS, STATUSES, TRAJECTORY_SCHEMA

COLUMN_TYPES: dict[str, pa.DataType] = {f.name: f.type for f in TRAJECTORY_SCHEMA}
"""Each trajectory column's type, in schema order."""
_LIST_COLUMNS = tuple(name for name, typ in COLUMN_TYPES.items() if pa.types.is_list(typ))
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

    ``validated``: the caller checked the structure already (:func:`schemas.trajectory.normalize_batch` does so
    for a whole batch);
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
    for name, width in PAYLOAD_WIDTHS:
        got = known.get(name)
        total += (list_lengths(columns[name]) if got is None else got) * width
    return pa.array(total)


PAYLOAD_WIDTHS = tuple((name, COLUMN_TYPES[name].value_type.byte_width) for name in PAYLOAD_COLUMNS)
"""The value width of each payload (list) column."""


def _ones_like_lists(template: pa.Array) -> pa.Array:
    offsets = np.asarray(template.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    values = pa.array(np.ones(int(offsets[-1]), dtype=np.uint8))
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=pa.list_(pa.uint8()))


def utc_now() -> dt.datetime:
    """Now, as the naive UTC datetime the timestamp columns hold."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def versions_per_token(versions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's version repeated once per response token (``lengths``): the flat values of a ``token_versions``
    column whose rows each came from one version. int32; a version beyond int32 is refused, naming the column."""
    if versions.size and int(versions.max()) > np.iinfo(np.int32).max:
        msg = f"column 'policy_version' holds {int(versions.max())}, more than token_versions (int32) can hold"
        raise TrajectoryError(msg, column="policy_version")
    return np.repeat(versions.astype(np.int32), lengths)


def token_versions_of(versions: np.ndarray, response_ids: pa.Array) -> pa.Array:
    """The default ``token_versions`` column: each row's ``versions`` value once per token of its response."""
    offsets = np.asarray(response_ids.offsets.to_numpy(zero_copy_only=False), dtype=np.int32)
    offsets = offsets - offsets[0]
    values = pa.array(versions_per_token(versions, np.diff(offsets)), type=pa.int32())
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=pa.list_(pa.int32()))


def _row_min(token_versions: pa.Array, fallback: np.ndarray) -> np.ndarray:
    """Each row's smallest token version (int64), ``fallback`` for a row without tokens (or a null one)."""
    lengths = pc.fill_null(pc.list_value_length(token_versions), 0).to_numpy().astype(np.int64)
    values = pc.list_flatten(token_versions).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.array(fallback, dtype=np.int64, copy=True)
    filled = lengths > 0
    if filled.any():
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[filled]
        out[filled] = np.minimum.reduceat(values, starts)
    return out


def _default(name: str, cols: dict[str, pa.Array], n: int, now: dt.datetime) -> pa.Array:
    """The default value of optional column ``name`` for ``n`` rows, from the other columns."""
    if name == "policy_version_min":  # the oldest token's version when the writer said which made each token
        given = cols.get("token_versions")
        if given is None:
            return cols["policy_version"]
        return pa.array(_row_min(given, cols["policy_version"].to_numpy(zero_copy_only=False)), type=pa.int64())
    if name == "token_versions":
        return token_versions_of(cols["policy_version"].to_numpy(zero_copy_only=False), cols["response_ids"])
    if name == "image_keys":
        return pa.array([[]] * n, type=COLUMN_TYPES["image_keys"])
    if name == "num_images":
        return pa.array(list_lengths(cols["image_keys"]).astype(np.int16), type=pa.int16())
    if name == "loss_mask":
        return _ones_like_lists(cols["response_ids"])
    if name == "num_turns":
        return pa.repeat(pa.scalar(1, type=pa.int16()), n)
    if name == "loss_tokens":
        return pa.array(_mask_sums(cols["loss_mask"]), type=pa.int32())
    if name in ("created_at", "completed_at"):
        return pa.repeat(pa.scalar(now, type=pa.timestamp("us")), n)
    if name in _FILLED_FROM_LISTS:
        return pa.array(list_lengths(cols[_FILLED_FROM_LISTS[name]]).astype(np.int32), type=pa.int32())
    value = {"finish_reason": "stop", "status": "completed", "data_source": "default"}[name]
    return pa.repeat(pa.scalar(value, type=pa.string()), n)


_FILL_ORDER = ("policy_version_min", "token_versions", "image_keys", "num_images", "loss_mask", "num_turns",
               "loss_tokens", "created_at", "completed_at", "finish_reason", "status", "data_source", "prompt_len",
               "response_len")
"""Optional columns in the order they are filled (``num_images`` after ``image_keys``, ``loss_tokens`` after
``loss_mask``; ``policy_version_min`` before ``token_versions``, whose writer's values it is the smallest of)."""


def _mask_sums(loss_mask: pa.Array) -> np.ndarray:
    """Each row's count of ones in ``loss_mask`` (its trained tokens), int64."""
    if isinstance(loss_mask, pa.ChunkedArray):
        loss_mask = loss_mask.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(loss_mask), 0).to_numpy().astype(np.int64)
    values = pc.list_flatten(loss_mask).to_numpy(zero_copy_only=False).astype(np.int64)
    sums = np.zeros(len(lengths), dtype=np.int64)
    filled = lengths > 0
    if filled.any():
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[filled]
        sums[filled] = np.add.reduceat(values, starts)
    return sums


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
    """Rewards finite, loss masks 0 or 1, at least one turn, versions not negative."""
    reward = cols["reward"].to_numpy(zero_copy_only=False)
    if not np.isfinite(reward).all():
        bad = np.flatnonzero(~np.isfinite(reward))
        msg = f"column 'reward' row {int(bad[0])} is {float(reward[bad[0]])}; rewards must be finite"
        raise TrajectoryError(msg, column="reward")
    mask = cols["loss_mask"].flatten().to_numpy(zero_copy_only=False)
    if mask.size and int(mask.max()) > 1:
        msg = f"column 'loss_mask' holds {int(mask.max())}; a loss mask is 0 (not trained on) or 1"
        raise TrajectoryError(msg, column="loss_mask")
    turns = cols["num_turns"].to_numpy()
    if turns.size and turns.min() < 1:
        i = int(np.argmin(turns))
        msg = f"column 'num_turns' row {i} is {int(turns[i])}; a response holds at least one model turn"
        raise TrajectoryError(msg, column="num_turns")
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
    return check_row_rules(cols)


def check_row_rules(cols: dict[str, pa.Array]) -> dict[str, np.ndarray]:
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
    got = np.stack([lengths["response_logprobs"], lengths["loss_mask"], lengths["token_versions"],
                    cols["response_len"].to_numpy(), cols["prompt_len"].to_numpy(), cols["num_images"].to_numpy()])
    want = np.stack([lengths["response_ids"]] * 4 + [lengths["prompt_ids"], lengths["image_keys"]])
    if (got != want).any():  # name the first column that disagrees (one comparison for all of them)
        for (name, what), g, w in zip(_LENGTH_RULES, got, want, strict=True):
            _check_lengths(name, g, w, what)
    _check_lengths("loss_tokens", cols["loss_tokens"].to_numpy(), _mask_sums(cols["loss_mask"]), "sum(loss_mask)")
    check_token_versions(cols["token_versions"], lengths["token_versions"], vmin, vmax)
    return lengths


def check_token_versions(token_versions: pa.Array, lengths: np.ndarray, vmin: np.ndarray, vmax: np.ndarray) -> None:
    """Every token's version within its row's ``[policy_version_min, policy_version]`` (rows of ``lengths`` tokens).

    One version for the whole batch (the common case) costs two reductions; otherwise one comparison per token.
    """
    values = pc.list_flatten(token_versions).to_numpy(zero_copy_only=False)
    if not values.size:
        return
    if vmin.min() == vmax.max():
        if values.min() == values.max() == vmax[0]:
            return
        bad_token = int(np.flatnonzero(values != vmax[0])[0])
    else:
        row = np.repeat(np.arange(len(lengths)), lengths)
        outside = (values < vmin[row]) | (values > vmax[row])
        if not outside.any():
            return
        bad_token = int(np.flatnonzero(outside)[0])
    i = int(np.searchsorted(np.cumsum(lengths), bad_token, side="right"))
    msg = (f"column 'token_versions' row {i} holds version {int(values[bad_token])}, outside the row's "
           f"[policy_version_min, policy_version] = [{int(vmin[i])}, {int(vmax[i])}]")
    raise TrajectoryError(msg, column="token_versions")


_LENGTH_RULES = (("response_logprobs", "len(response_ids)"), ("loss_mask", "len(response_ids)"),
                 ("token_versions", "len(response_ids)"), ("response_len", "len(response_ids)"),
                 ("prompt_len", "len(prompt_ids)"), ("num_images", "len(image_keys)"))
"""The columns :func:`check_rules` compares with a list's length, in its order."""


def check_names(names: Sequence[str], fillable: frozenset[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            msg = f"column {name!r} appears more than once"
            raise TrajectoryError(msg, column=name)
        if name not in COLUMN_TYPES:
            msg = f"unknown column {name!r}; the trajectory schema has {list(COLUMN_TYPES)}"
            raise TrajectoryError(msg, column=name)
        seen.add(name)
    for name in COLUMN_TYPES:
        if name not in seen and name not in fillable and name != "bytes":
            msg = f"required column {name!r} is missing"
            raise TrajectoryError(msg, column=name)

