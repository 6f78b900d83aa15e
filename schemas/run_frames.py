"""The Arrow schemas of the run folder's frames: ``consumed.parquet`` (the planner's consumed trajectories),
``metadata.parquet`` (the stores' metadata at the end), ``ledger.parquet`` (the prompt ledger) and the in-flight
groups a planner counts as supply to come.

Read and written through ``schemas.run_folder.read_frame`` / ``write_frame``, which check a frame against these
(a column missing, or of a type that does not cast, names the file and the column). A run's quota columns ride
beside these in ``consumed.parquet``.

Example:
    >>> CONSUMED_FRAME.field("arch_staleness").type
    DataType(int64)
    >>> LEDGER_FRAME.names[:3]
    ['prompt_id', 'attempt', 'group_id']
"""

from __future__ import annotations

import pyarrow as pa

from schemas.arrow import METADATA_SCHEMA

CONSUMED_FRAME = pa.schema([
    ("group_id", pa.string()), ("node", pa.string()), ("sample_idx", pa.int64()), ("step", pa.int64()),
    ("train_batch", pa.int64()), ("position", pa.int64()), ("dp_rank", pa.int64()), ("policy_version", pa.int64()),
    ("policy_version_min", pa.int64()), ("prompt_len", pa.int64()), ("response_len", pa.int64()),
    ("loss_tokens", pa.int64()),
    ("reward", pa.float64()), ("advantage", pa.float64()), ("admitted_at_version", pa.int64()),
    ("arch_staleness", pa.int64()), ("signed_staleness", pa.int64()), ("generation_span", pa.int64()),
    ("total_staleness", pa.int64()),
], metadata={"knittrans.table": "consumed"})
"""``consumed.parquet``: one row per admitted trajectory, in admission order: its keys and node, the step, train
batch, position and data-parallel rank it went to, its versions and lengths, reward and advantage, and its
staleness (``admission.staleness``: architectural, signed, generation span, total)."""

METADATA_FRAME = METADATA_SCHEMA
"""``metadata.parquet``: the stores' metadata at the end of the run (``schemas.arrow.METADATA_SCHEMA``)."""

LEDGER_FRAME = pa.schema([
    ("prompt_id", pa.string()), ("attempt", pa.int64()), ("group_id", pa.string()),
    ("dispatched_version", pa.int64()), ("completed", pa.bool_()), ("trained_step", pa.int64()),
    ("dropped_reason", pa.string()), ("life", pa.int64()), ("dispatch_reason", pa.string()),
], metadata={"knittrans.table": "ledger"})
"""``ledger.parquet``: one row per prompt and attempt: the prompt, its attempt (0 = the first dispatch; null for a
prompt drawn and never dispatched), the group that attempt wrote, the policy version it was dispatched under, whether
the stores hold it with every sample completed, the surviving step that trained it (null: none) and, when none did,
why (``rolled_back``, a planner drop reason such as ``aborted``, ``interrupted`` for a group the run stopped before it
was written, ``node_lost`` for one written to a store node lost for good, ``never_dispatched``); ``life``: the start
of the run that dispatched it (0 = the first); ``dispatch_reason``: why an attempt after the first went out
(``aborted``, ``interrupted``, ``rolled_back``, ``node_lost``, ``rollout_lost``, ...)."""

INFLIGHT_FRAME = pa.schema([
    ("group_id", pa.string()), ("data_source", pa.string()), ("prompt_id", pa.string()),
    ("dispatch_version", pa.int64()), ("state", pa.string()), ("dispatched_at", pa.float64()), ("node", pa.string()),
], metadata={"knittrans.table": "inflight"})
"""The groups in flight on the stores (``schemas.replies.InflightGroup`` with its node): what a planner counts as
supply to come."""
