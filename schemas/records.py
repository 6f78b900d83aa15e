"""Row-level pydantic mirror of the trajectory schema, for writers that build rows one at a time.

``TrajectoryRecord`` has one field per column of ``TRAJECTORY_SCHEMA`` (a test holds the two equal
field for field); ``records_to_batch`` turns records into one Arrow record batch. Engines that
produce columns directly (``connectors.vllm``) build the batch without going through records.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from schemas import trajectory
from schemas.arrow import IMAGE_KEY_BYTES, OPTIONAL_ON_WRITE, TRAJECTORY_SCHEMA

Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]
NonNeg32 = Annotated[int, Field(ge=0, lt=2**31)]
Int16 = Annotated[int, Field(ge=0, lt=2**15)]


class TrajectoryRecord(BaseModel):
    """One response of a prompt group.

    Example:
        >>> r = TrajectoryRecord(group_id="g0", sample_idx=0, policy_version=3, data_source="math",
        ...                      prompt_ids=[1, 2], response_ids=[5, 6, 7], response_logprobs=[-0.1] * 3,
        ...                      reward=1.0)
        >>> records_to_batch([r]).num_rows
        1
    """

    model_config = ConfigDict(extra="forbid")

    # keys
    group_id: Annotated[str, Field(min_length=1)]
    sample_idx: NonNeg32
    # metadata
    policy_version: Annotated[int, Field(ge=0)]
    policy_version_min: Annotated[int, Field(ge=0)] | None = None  # defaults to policy_version
    data_source: str | None = None  # defaults to "default"
    prompt_len: NonNeg32 | None = None  # defaults to len(prompt_ids)
    response_len: NonNeg32 | None = None  # defaults to len(response_ids)
    reward: float = 0.0
    finish_reason: str | None = None  # defaults to "stop"
    status: str | None = None  # defaults to "completed"
    num_images: Int16 | None = None  # defaults to len(image_keys)
    num_turns: Annotated[int, Field(ge=1, lt=2**15)] | None = None  # model turns; defaults to 1
    loss_tokens: NonNeg32 | None = None  # defaults to sum(loss_mask)
    created_at: datetime | None = None  # UTC; defaults to now
    completed_at: datetime | None = None  # UTC; defaults to now
    bytes: Annotated[int, Field(ge=0)] = 0  # recomputed from the payload
    # payload
    prompt_ids: list[Int32]  # [prompt_len] token ids
    response_ids: list[Int32]  # [response_len] token ids
    response_logprobs: list[float]  # [response_len] sampled-token logprobs, float32
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] | None = None  # [response_len] 1 = trained on; defaults to ones
    image_keys: list[Annotated[builtins.bytes, Field(min_length=IMAGE_KEY_BYTES, max_length=IMAGE_KEY_BYTES)]] = []
    token_versions: list[NonNeg32] | None = None  # [response_len] version that made each token; = policy_version


def records_to_batch(records: Sequence[TrajectoryRecord]) -> pa.RecordBatch:
    """Build one trajectory-schema record batch from the records of one group (columns in schema order).

    Fields left unset get the same defaults the store gives a missing column, and the batch is
    checked by the same rules (:mod:`schemas.trajectory`).

    Raises:
        ValueError: no records, or a rule is broken (a :class:`~schemas.trajectory.TrajectoryError`
            naming the column).
    """
    if not records:
        msg = "records_to_batch needs at least one record"
        raise ValueError(msg)
    rows = [r.model_dump() for r in records]
    cols = {f.name: pa.array([row[f.name] for row in rows], type=f.type)
            for f in TRAJECTORY_SCHEMA if f.name != "bytes"}
    return trajectory.build_batch(cols, str(rows[0]["group_id"]), nulls_are_missing=True,
                                  fillable=OPTIONAL_ON_WRITE | {"prompt_len", "response_len"})
