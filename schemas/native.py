"""The native pass over a trajectory batch (``schemas/_kernels.c``): what it is told of the schema, and its answer.

:func:`checked_natively` proves the common case (a batch of the schema's columns and types, no nulls,
every rule of :func:`schemas.trajectory_rules.check_rules` kept, ``sample_idx`` 0..rows-1) in one pass over
the batch's buffers; any other batch goes to the Python rules, which are the reference and name what is
wrong. The native pass never accepts what they refuse (``tests/test_native_checks.py`` holds the two
to the same verdicts).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa

from schemas import _kernels
from schemas.arrow import NATIVE_PAYLOAD_COLUMNS, STATUSES, TRAJECTORY_SCHEMA
from schemas.trajectory_rules import COLUMN_TYPES, PAYLOAD_WIDTHS, offset_lengths, versions_per_token

_NATIVE_ROLES: dict[str, pa.DataType] = {
    "group_id": pa.string(), "sample_idx": pa.int32(), "policy_version": pa.int64(),
    "policy_version_min": pa.int64(), "prompt_len": pa.int32(), "response_len": pa.int32(), "reward": pa.float32(),
    "status": pa.string(), "num_images": pa.int16(), "num_turns": pa.int16(), "loss_tokens": pa.int32(),
    "prompt_ids": pa.list_(pa.int32()),
    "response_ids": pa.list_(pa.int32()), "response_logprobs": pa.list_(pa.float32()),
    "loss_mask": pa.list_(pa.uint8()), "image_keys": pa.list_(pa.binary(32)),
}
"""The columns ``_kernels.check_group_batch`` reads, in the order of its roles, with the types it reads them as."""

_TOKEN_VERSIONS = "token_versions"
"""The last column of the schema, optional on write: the native pass checks it when sent (its lengths and versions)
and counts its bytes either way; a batch without it gets it filled here."""
_WITHOUT_TOKEN_VERSIONS = TRAJECTORY_SCHEMA.remove(TRAJECTORY_SCHEMA.get_field_index(_TOKEN_VERSIONS))
_TOKEN_VERSIONS_FIELD = TRAJECTORY_SCHEMA.field(_TOKEN_VERSIONS)


def _native_table(schema: pa.Schema) -> bytes:
    """What ``_kernels.check_group_batch`` is told of ``schema``: the column count, each role's column index, the
    value width of each payload list it counts (the last five roles, in :data:`NATIVE_PAYLOAD_COLUMNS` order), and
    the index of ``token_versions`` (-1 when the schema leaves it out)."""
    for name, typ in _NATIVE_ROLES.items():
        if COLUMN_TYPES[name] != typ:  # the schema changed: the native pass would misread it
            msg = f"schemas/_kernels.c reads column {name!r} as {typ}; the schema has {COLUMN_TYPES[name]}"
            raise TypeError(msg)
    if tuple(_NATIVE_ROLES)[-5:] != NATIVE_PAYLOAD_COLUMNS or TRAJECTORY_SCHEMA.names[-1] != _TOKEN_VERSIONS:
        msg = (f"schemas/_kernels.c counts the payload of {tuple(_NATIVE_ROLES)[-5:]}, not of {NATIVE_PAYLOAD_COLUMNS},"
               f" and {_TOKEN_VERSIONS!r} must be the schema's last column")
        raise TypeError(msg)
    index = [schema.get_field_index(name) for name in _NATIVE_ROLES]
    widths = dict(PAYLOAD_WIDTHS)
    return np.array([len(schema), *index, *(widths[c] for c in NATIVE_PAYLOAD_COLUMNS),
                     schema.get_field_index(_TOKEN_VERSIONS)], dtype=np.int32).tobytes()


class _Variant:
    """What the native pass is told of one form of the schema (with ``token_versions``, or without)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.table = _native_table(schema)
        self.signature: bytes = _kernels.signature(schema.__arrow_c_schema__())
        self.fields_signature: bytes = _kernels.signature(schema.__arrow_c_schema__(), True)


_WITH, _WITHOUT = _Variant(TRAJECTORY_SCHEMA), _Variant(_WITHOUT_TOKEN_VERSIONS)
SIGNATURE: bytes = _WITH.signature
"""The trajectory schema's column names and types as the native passes compare them (``_kernels.signature``)."""
_STATUSES = b"\0".join(s.encode() for s in STATUSES)
_BYTES_INDEX = TRAJECTORY_SCHEMA.get_field_index("bytes")
_RESPONSE_IDS = TRAJECTORY_SCHEMA.get_field_index("response_ids")
_VERSION = TRAJECTORY_SCHEMA.get_field_index("policy_version")

ACCEPTED, ACCEPTED_OTHER_FIELDS = 0, -1
"""The native pass's answers for a batch it proves valid: with the schema's own fields, or with a writer's
fields of the same names and types (another nullability or field metadata, or ``token_versions`` left out)."""
STEPS_ASIDE: dict[int, str] = {1: "another schema", 2: "not a batch it reads", 3: "a null or a validity bitmap"}
"""Its answers for a batch outside the common case (which the Python rules may well accept)."""
RULE_COLUMNS: dict[int, tuple[str, ...]] = {
    4: ("group_id",), 5: ("sample_idx",), 6: ("status",), 7: ("reward",), 8: ("loss_mask", "loss_tokens"),
    9: ("policy_version", "policy_version_min"),
    10: ("response_logprobs", "loss_mask", "response_len", "prompt_len", "num_images"),
    11: (_TOKEN_VERSIONS, "policy_version"), 12: ("num_turns",),
}
"""Its answers for a batch breaking a rule: the columns the Python rules may name for it (``_kernels.c``'s reasons)."""


def _layout(schema: pa.Schema) -> bytes:
    """Per column of ``schema``, as ``_kernels.row_bytes`` reads it (int32): the fixed width of a value, or for a
    string or list column (32-bit offsets) ``-(width of its values) - 1``."""
    out = []
    for t in schema.types:
        if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_list(t):
            value = t.value_type if pa.types.is_list(t) else pa.uint8()
            out.append(-(value.byte_width if pa.types.is_fixed_size_binary(value) else value.bit_width // 8) - 1)
        else:
            out.append(t.bit_width // 8)
    return np.array(out, dtype=np.int32).tobytes()


_TRAJECTORY_LAYOUT = _layout(TRAJECTORY_SCHEMA)


def _row_bytes(schema: object, array: object, rows: int) -> np.ndarray:
    out = np.empty((rows, len(TRAJECTORY_SCHEMA)), dtype=np.int32)
    _kernels.row_bytes(schema, array, SIGNATURE, _TRAJECTORY_LAYOUT, out)
    return out


def row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """Payload bytes of each row (axis 0) and column (axis 1) of a valid batch of the trajectory schema (a stored
    one), as int32.

    A fixed-width value counts its width; a string or list counts its offset (4) and its values.
    For a whole stored batch the sum equals ``RecordBatch.nbytes``; summing rows is exact for any
    split, and cheap (``RecordBatch.nbytes`` of a slice costs ~40 us for this schema). Read off the
    offsets in one native pass (``_kernels.row_bytes``, which refuses a batch of other columns).
    """
    schema, array = batch.__arrow_c_array__()
    return _row_bytes(schema, array, batch.num_rows)


class Checked(NamedTuple):
    """A batch :func:`checked_natively` proved valid."""

    batch: pa.RecordBatch
    """As ``TRAJECTORY_SCHEMA``, with ``bytes`` recomputed."""
    row_bytes: np.ndarray | None
    """Its :func:`row_bytes`, read off the same C data export when the writer sent every column (``None`` when
    ``token_versions`` was filled here)."""


def _verdict(batch: pa.RecordBatch, group_id: str, *, sized: bool) -> tuple[int, np.ndarray, np.ndarray | None]:
    """:func:`native_verdict`, and (``sized``) the accepted batch's :func:`row_bytes` when it holds every column."""
    out = np.empty(batch.num_rows, dtype=np.int64)
    if not batch.num_rows:
        return 2, out, None
    try:
        batch.validate(full=True)  # offsets in bounds and monotonic: what the native pass may read
    except pa.ArrowException:
        return 2, out, None
    sent = batch.num_columns == len(TRAJECTORY_SCHEMA)  # with token_versions (a valid batch holds it last)
    variant = _WITH if sent else _WITHOUT
    schema, array = batch.__arrow_c_array__()
    code = _kernels.check_group_batch(schema, array, variant.signature, variant.fields_signature, group_id.encode(),
                                      _STATUSES, variant.table, out)
    accepted = code in (ACCEPTED, ACCEPTED_OTHER_FIELDS)
    sizes = _row_bytes(schema, array, batch.num_rows) if sized and sent and accepted else None
    return (ACCEPTED_OTHER_FIELDS if code == ACCEPTED and not sent else code), out, sizes


def native_verdict(batch: pa.RecordBatch, group_id: str) -> tuple[int, np.ndarray]:
    """The native pass's answer for ``batch`` as the whole of group ``group_id``, and each row's payload bytes (read
    only when accepted; ``token_versions`` counted whether sent or to be filled): :data:`ACCEPTED`,
    :data:`ACCEPTED_OTHER_FIELDS`, or a reason of :data:`STEPS_ASIDE` or :data:`RULE_COLUMNS`.

    The write path calls :func:`checked_natively`; this reason code is what holds the native pass to the Python
    rules' verdict on every kind of fault (tests/test_native_checks.py), which a bare accept/decline could not."""
    code, out, _ = _verdict(batch, group_id, sized=False)
    return code, out


def checked_natively(batch: pa.RecordBatch, group_id: str) -> Checked | None:
    """``batch``, the whole of group ``group_id``, as ``TRAJECTORY_SCHEMA`` with ``bytes`` recomputed (and its
    :func:`row_bytes`), when the native pass proves it valid: the schema's columns and types (``token_versions``
    sent or left out), structurally valid, no null (and no validity bitmap) anywhere, every rule of
    :func:`~schemas.trajectory_rules.check_rules` kept, ``sample_idx`` 0..rows-1; ``None`` for any other batch,
    which the Python rules then decide on (and name what is wrong).

    ``_kernels.check_group_batch`` reads the batch through the Arrow C data interface and compares its schema's
    column names and types with the trajectory schema's (:data:`SIGNATURE`, or the same without
    ``token_versions``); it accepts a subset of what the Python rules accept, an order of magnitude faster than
    they check it (docs/benchmarks.md, diagnostic timings). A
    ``token_versions`` column left out is filled here, as the rules fill it.
    """
    code, out, sizes = _verdict(batch, group_id, sized=True)
    if code == ACCEPTED:  # the schema's own fields: only `bytes` and the schema's metadata to set
        checked = batch.set_column(_BYTES_INDEX, TRAJECTORY_SCHEMA.field(_BYTES_INDEX), pa.array(out))
        return Checked(checked.replace_schema_metadata(TRAJECTORY_SCHEMA.metadata), sizes)
    if code == ACCEPTED_OTHER_FIELDS:
        columns = batch.columns
        columns[_BYTES_INDEX] = pa.array(out)
        if len(columns) < len(TRAJECTORY_SCHEMA):  # left out: each row's version once per response token
            columns.append(_filled_token_versions(batch))
        # the schema itself, not the writer's
        return Checked(pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA), sizes)
    return None


def _filled_token_versions(batch: pa.RecordBatch) -> pa.Array:
    """``token_versions`` of a batch that left it out: its ``policy_version`` once per response token (offsets of
    ``response_ids``, shared)."""
    response = batch.column(_RESPONSE_IDS)
    values = versions_per_token(batch.column(_VERSION).to_numpy(), offset_lengths(response))
    offsets = response.buffers()[1]
    first = int(np.frombuffer(offsets, dtype=np.int32, count=1, offset=4 * response.offset)[0])
    if first or response.offset:  # rebase a sliced column's offsets to 0
        rebased = np.frombuffer(offsets, dtype=np.int32, count=len(response) + 1, offset=4 * response.offset) - first
        return pa.ListArray.from_arrays(pa.array(rebased), pa.array(values), type=_TOKEN_VERSIONS_FIELD.type)
    return pa.Array.from_buffers(_TOKEN_VERSIONS_FIELD.type, len(response), [None, offsets],
                                 children=[pa.array(values, type=pa.int32())])
