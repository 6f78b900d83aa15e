"""Admission plans on the wire: mini-batch -> DP rank -> ordered micro-batches -> slices.

The planner (``admission``) builds these; rank 0 of the trainer broadcasts them; every rank
fetches exactly the slices of its own micro-batches. Advantages travel with the plan, one value
per planned row, in slice order, so a rank needs nothing but its slices and the plan.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonNeg = Annotated[int, Field(ge=0)]


class PlannedSlice(BaseModel):
    """Rows ``sample_idx in [start, stop)`` of group ``group_id`` stored on ``node``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    group_id: str
    start: NonNeg
    stop: NonNeg

    @property
    def rows(self) -> int:
        return self.stop - self.start


class MicroBatch(BaseModel):
    """One forward/backward pass on one rank."""

    model_config = ConfigDict(extra="forbid")

    slices: list[PlannedSlice]
    advantages: list[float]
    """One per row of ``slices``, in order (group-normalised rewards)."""
    tokens: NonNeg = 0
    """prompt + response tokens of the rows."""
    oversized: bool = False
    """True when a single trajectory exceeds the token budget and was placed alone."""

    @model_validator(mode="after")
    def _check(self) -> MicroBatch:
        n = sum(s.rows for s in self.slices)
        if n != len(self.advantages):
            msg = f"micro-batch has {n} rows but {len(self.advantages)} advantages"
            raise ValueError(msg)
        return self

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.slices)


class RankPlan(BaseModel):
    """The ordered micro-batches of one data-parallel rank."""

    model_config = ConfigDict(extra="forbid")

    dp_rank: NonNeg
    micro_batches: list[MicroBatch]


class MiniBatchPlan(BaseModel):
    """One optimizer step: which groups, split across DP ranks and micro-batches."""

    model_config = ConfigDict(extra="forbid")

    step: NonNeg
    """Global optimizer step s = t*K + k."""
    train_batch: NonNeg
    """t."""
    position: NonNeg
    """k, the mini-batch's position inside its train batch."""
    group_ids: list[str]
    ranks: list[RankPlan]

    @model_validator(mode="after")
    def _same_count(self) -> MiniBatchPlan:
        counts = {len(r.micro_batches) for r in self.ranks}
        if len(counts) > 1:
            msg = f"ranks have different micro-batch counts {sorted(counts)}; collectives would deadlock"
            raise ValueError(msg)
        return self

    def for_rank(self, dp_rank: int) -> RankPlan:
        for r in self.ranks:
            if r.dp_rank == dp_rank:
                return r
        msg = f"plan for step {self.step} has no dp_rank {dp_rank}"
        raise KeyError(msg)
