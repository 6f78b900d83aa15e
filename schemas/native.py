"""The native pass over a trajectory batch (``schemas/_kernels.c``): what it is told of the schema, and its answer.

:func:`checked_natively` proves the common case (a batch of the schema's columns and types, no nulls,
every rule of :func:`schemas.trajectory_rules.check_rules` kept, ``sample_idx`` 0..rows-1) in one pass over
the batch's buffers; any other batch goes to the Python rules, which are the reference and name what is
wrong. The native pass never accepts what they refuse (``tests/test_native_checks.py`` holds the two
to the same verdicts).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas import _kernels
from schemas.arrow import PAYLOAD_COLUMNS, STATUSES, TRAJECTORY_SCHEMA
from schemas.trajectory_rules import COLUMN_TYPES, PAYLOAD_WIDTHS

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
        if COLUMN_TYPES[name] != typ:  # the schema changed: the native pass would misread it
            msg = f"schemas/_kernels.c reads column {name!r} as {typ}; the schema has {COLUMN_TYPES[name]}"
            raise TypeError(msg)
    if tuple(_NATIVE_ROLES)[-5:] != PAYLOAD_COLUMNS:
        msg = f"schemas/_kernels.c counts the payload of {tuple(_NATIVE_ROLES)[-5:]}, not of {PAYLOAD_COLUMNS}"
        raise TypeError(msg)
    index = [TRAJECTORY_SCHEMA.get_field_index(name) for name in _NATIVE_ROLES]
    return np.array([len(TRAJECTORY_SCHEMA), *index, *(w for _, w in PAYLOAD_WIDTHS)], dtype=np.int32).tobytes()


_NATIVE_TABLE = _native_table()
SIGNATURE: bytes = _kernels.signature(TRAJECTORY_SCHEMA.__arrow_c_schema__())
"""The trajectory schema's column names and types as the native passes compare them (``_kernels.signature``)."""
_FIELDS_SIGNATURE = _kernels.signature(TRAJECTORY_SCHEMA.__arrow_c_schema__(), True)
"""The same with each field's nullability and metadata: a batch with it keeps its fields."""
_STATUSES = b"\0".join(s.encode() for s in STATUSES)
_BYTES_INDEX = TRAJECTORY_SCHEMA.get_field_index("bytes")

ACCEPTED, ACCEPTED_OTHER_FIELDS = 0, -1
"""The native pass's answers for a batch it proves valid: with the schema's own fields, or with a writer's
fields of the same names and types (another nullability or field metadata)."""
STEPS_ASIDE: dict[int, str] = {1: "another schema", 2: "not a batch it reads", 3: "a null or a validity bitmap"}
"""Its answers for a batch outside the common case (which the Python rules may well accept)."""
RULE_COLUMNS: dict[int, tuple[str, ...]] = {
    4: ("group_id",), 5: ("sample_idx",), 6: ("status",), 7: ("reward",), 8: ("loss_mask",),
    9: ("policy_version", "policy_version_min"),
    10: ("response_logprobs", "loss_mask", "response_len", "prompt_len", "num_images"),
}
"""Its answers for a batch breaking a rule: the columns the Python rules may name for it (``_kernels.c``'s reasons)."""


def native_verdict(batch: pa.RecordBatch, group_id: str) -> tuple[int, np.ndarray]:
    """The native pass's answer for ``batch`` as the whole of group ``group_id``, and each row's payload bytes (read
    only when accepted): :data:`ACCEPTED`, :data:`ACCEPTED_OTHER_FIELDS`, or a reason of :data:`STEPS_ASIDE` or
    :data:`RULE_COLUMNS`."""
    out = np.empty(batch.num_rows, dtype=np.int64)
    if not batch.num_rows:
        return 2, out
    try:
        batch.validate(full=True)  # offsets in bounds and monotonic: what the native pass may read
    except pa.ArrowException:
        return 2, out
    schema, array = batch.__arrow_c_array__()
    code = _kernels.check_group_batch(schema, array, SIGNATURE, _FIELDS_SIGNATURE, group_id.encode(), _STATUSES,
                                      _NATIVE_TABLE, out)
    return code, out


def checked_natively(batch: pa.RecordBatch, group_id: str) -> pa.RecordBatch | None:
    """``batch``, the whole of group ``group_id``, as ``TRAJECTORY_SCHEMA`` with ``bytes`` recomputed, when the
    native pass proves it valid: the schema's columns and types, structurally valid, no null (and no validity
    bitmap) anywhere, every rule of :func:`~schemas.trajectory_rules.check_rules` kept, ``sample_idx`` 0..rows-1;
    ``None`` for any other batch, which the Python rules then decide on (and name what is wrong).

    ``_kernels.check_group_batch`` reads the batch through the Arrow C data interface and compares its schema's
    column names and types with the trajectory schema's (:data:`SIGNATURE`); it accepts a subset of what the
    Python rules accept, in ~10 us instead of ~150.
    """
    code, out = native_verdict(batch, group_id)
    if code == ACCEPTED:  # the schema's own fields: only `bytes` and the schema's metadata to set
        checked = batch.set_column(_BYTES_INDEX, TRAJECTORY_SCHEMA.field(_BYTES_INDEX), pa.array(out))
        return checked.replace_schema_metadata(TRAJECTORY_SCHEMA.metadata)
    if code == ACCEPTED_OTHER_FIELDS:
        columns = batch.columns
        columns[_BYTES_INDEX] = pa.array(out)
        return pa.RecordBatch.from_arrays(columns, schema=TRAJECTORY_SCHEMA)  # the schema itself, not the writer's
    return None
