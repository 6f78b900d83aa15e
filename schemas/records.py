"""Row-level pydantic mirror of the trajectory schema, for writers that build rows one at a time.

``TrajectoryRecord`` has one field per column of ``TRAJECTORY_SCHEMA`` (a test holds the two equal
field for field); ``records_to_batch`` turns records into one Arrow record batch. Engines that
produce columns directly (``connectors.vllm``) build the batch without going through records.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.arrow import IMAGE_KEY_BYTES, STATUSES, TRAJECTORY_SCHEMA

Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]
NonNeg32 = Annotated[int, Field(ge=0, lt=2**31)]
Int16 = Annotated[int, Field(ge=0, lt=2**15)]


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


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
    data_source: str = "default"
    prompt_len: NonNeg32 | None = None  # defaults to len(prompt_ids)
    response_len: NonNeg32 | None = None  # defaults to len(response_ids)
    reward: float = 0.0
    finish_reason: str = "stop"
    status: str = "completed"
    num_images: Int16 | None = None  # defaults to len(image_keys)
    created_at: datetime = Field(default_factory=_utcnow)
    completed_at: datetime = Field(default_factory=_utcnow)
    bytes: Annotated[int, Field(ge=0)] = 0  # the store recomputes it
    # payload
    prompt_ids: list[Int32]  # [prompt_len] token ids
    response_ids: list[Int32]  # [response_len] token ids
    response_logprobs: list[float]  # [response_len] sampled-token logprobs, float32
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] | None = None  # [response_len]; defaults to all ones
    image_keys: list[Annotated[builtins.bytes, Field(min_length=IMAGE_KEY_BYTES, max_length=IMAGE_KEY_BYTES)]] = []

    @model_validator(mode="after")
    def _fill_and_check(self) -> TrajectoryRecord:
        if self.status not in STATUSES:
            msg = f"status {self.status!r} is not one of {STATUSES}"
            raise ValueError(msg)
        n = len(self.response_ids)
        if len(self.response_logprobs) != n:
            msg = f"response_logprobs has {len(self.response_logprobs)} values for {n} response_ids"
            raise ValueError(msg)
        if self.loss_mask is None:
            self.loss_mask = [1] * n
        elif len(self.loss_mask) != n:
            msg = f"loss_mask has {len(self.loss_mask)} values for {n} response_ids"
            raise ValueError(msg)
        if self.policy_version_min is None:
            self.policy_version_min = self.policy_version
        if self.prompt_len is None:
            self.prompt_len = len(self.prompt_ids)
        if self.response_len is None:
            self.response_len = n
        if self.num_images is None:
            self.num_images = len(self.image_keys)
        return self


def records_to_batch(records: Sequence[TrajectoryRecord]) -> pa.RecordBatch:
    """Build one trajectory-schema record batch from records (columns in schema order)."""
    if not records:
        msg = "records_to_batch needs at least one record"
        raise ValueError(msg)
    rows = [r.model_dump() for r in records]
    cols = {f.name: [row[f.name] for row in rows] for f in TRAJECTORY_SCHEMA}
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)
