"""Arrow schemas: the single source of truth for every table the data plane stores or moves.

Three tables:

* the **trajectory** table, one row per response of a prompt group (keys, metadata, payload);
* the **metadata projection**, what the admission planner scans (no payload bytes), plus the
  store-assigned ``seq`` cursor;
* the **image** table, one row per distinct image, keyed by its content hash.

Column kinds (docs/design.md, Records): keys identify a row, metadata is small and scanned by the
planner, payload is large and fetched only by the rank that consumes it.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3
"""Version of the schemas and of the wire documents; bumped on any incompatible change."""

IMAGE_KEY_BYTES = 32
"""Image keys are SHA-256 digests of the image bytes (see ``schemas.images.image_key``)."""

STATUSES = ("completed", "aborted", "filtered")
"""Values of the ``status`` column."""

# ---- trajectory table --------------------------------------------------------------------------

KEY_FIELDS: tuple[pa.Field, ...] = (
    pa.field("group_id", pa.string(), nullable=False),  # prompt-group id, unique per store cluster
    pa.field("sample_idx", pa.int32(), nullable=False),  # 0..G-1 within the group
)

METADATA_FIELDS: tuple[pa.Field, ...] = (
    pa.field("policy_version", pa.int64(), nullable=False),  # optimizer steps applied to the generating weights
    pa.field("policy_version_min", pa.int64(), nullable=False),  # oldest version that produced any token
    pa.field("data_source", pa.string(), nullable=False),  # dataset / task name, the usual quota key
    pa.field("prompt_len", pa.int32(), nullable=False),  # tokens
    pa.field("response_len", pa.int32(), nullable=False),  # tokens
    pa.field("reward", pa.float32(), nullable=False),  # scalar reward of the response
    pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length" | "abort" | ...
    pa.field("status", pa.string(), nullable=False),  # one of STATUSES
    pa.field("num_images", pa.int16(), nullable=False),  # images referenced by image_keys
    pa.field("num_turns", pa.int16(), nullable=False),  # model turns in the response (>= 1; tool tokens between)
    pa.field("loss_tokens", pa.int32(), nullable=False),  # response tokens with loss_mask 1 (= sum(loss_mask))
    pa.field("created_at", pa.timestamp("us"), nullable=False),  # UTC, when generation started
    pa.field("completed_at", pa.timestamp("us"), nullable=False),  # UTC, when generation ended
    pa.field("bytes", pa.int64(), nullable=False),  # payload bytes of this row (set by the store)
)

PAYLOAD_FIELDS: tuple[pa.Field, ...] = (
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),  # [prompt_len] token ids
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),  # [response_len] token ids
    pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),  # [response_len] sampled-token logprobs
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),  # [response_len] 1 = trained on
    pa.field("image_keys", pa.list_(pa.binary(IMAGE_KEY_BYTES)), nullable=False),  # [num_images] keys
    pa.field("token_versions", pa.list_(pa.int32()), nullable=False),  # [response_len] version that made each token
)

TRAJECTORY_SCHEMA = pa.schema(
    [*KEY_FIELDS, *METADATA_FIELDS, *PAYLOAD_FIELDS],
    metadata={"knittrans.schema_version": str(SCHEMA_VERSION), "knittrans.table": "trajectory"},
)
"""What a DoPut of a prompt group carries (columns in any order)."""

PAYLOAD_COLUMNS: tuple[str, ...] = tuple(f.name for f in PAYLOAD_FIELDS)
METADATA_COLUMNS: tuple[str, ...] = tuple(f.name for f in (*KEY_FIELDS, *METADATA_FIELDS))

OPTIONAL_ON_WRITE: frozenset[str] = frozenset(
    {"policy_version_min", "num_images", "num_turns", "loss_tokens", "created_at", "completed_at", "bytes",
     "image_keys", "loss_mask", "finish_reason", "status", "data_source", "token_versions"}
)
"""Columns a writer may leave out; every writer fills them the same way (``schemas.trajectory.fill_defaults``).

``token_versions`` left out means every token of a row came from its ``policy_version``: a rollout that never
loads new weights mid-response. A partial rollout (one that goes on generating a response under newer weights)
writes it, and ``policy_version_min``/``policy_version`` are then its smallest and largest value.

``num_turns`` left out is 1 (a single-turn response); ``loss_tokens`` left out is the row's ``sum(loss_mask)``, and
a writer that sends it must send exactly that: the planner reads the count of trained tokens from the metadata,
which never carries the mask itself."""

NATIVE_PAYLOAD_COLUMNS: tuple[str, ...] = PAYLOAD_COLUMNS[:-1]
"""The payload columns the native pass counts (``schemas.native``); ``token_versions``, the last, is checked and
counted beside it."""

# ---- metadata projection -----------------------------------------------------------------------

SEQ_FIELD = pa.field("seq", pa.int64(), nullable=False)  # position in the node's append-only metadata log

RELEASED_FIELD = pa.field("released", pa.bool_(), nullable=False)  # the group was consumed (at the scan's time)

METADATA_SCHEMA = pa.schema(
    [SEQ_FIELD, *KEY_FIELDS, *METADATA_FIELDS, RELEASED_FIELD],
    metadata={"knittrans.schema_version": str(SCHEMA_VERSION), "knittrans.table": "metadata"},
)
"""What DoGet(metadata) streams; clients add a ``node`` column when they fan out."""

# ---- image table -------------------------------------------------------------------------------

IMAGE_SCHEMA = pa.schema(
    [
        pa.field("image_key", pa.binary(IMAGE_KEY_BYTES), nullable=False),  # sha256 of dtype+shape+data
        pa.field("shape", pa.list_(pa.int32()), nullable=False),  # e.g. [3, 448, 448]
        pa.field("dtype", pa.string(), nullable=False),  # numpy dtype name, e.g. "uint8", "float16"
        pa.field("data", pa.large_binary(), nullable=False),  # C-contiguous raw bytes, prod(shape)*itemsize
    ],
    metadata={"knittrans.schema_version": str(SCHEMA_VERSION), "knittrans.table": "image"},
)
"""One row per distinct image; written once whatever the group size."""
