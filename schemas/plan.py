"""Admission plans on the wire: mini-batch -> DP rank -> ordered micro-batches -> slices.

The planner (``admission``) builds these; rank 0 of the trainer broadcasts them; every rank
fetches exactly the slices of its own micro-batches. Advantages travel with the plan, one value
per planned row, in slice order, so a rank needs nothing but its slices and the plan.

A :class:`MiniBatchPlan` is columnar: one list per field of every slice and micro-batch of all its
ranks, rank-major, with the node names and group ids as tables the slices index. A mini-batch of
4,096 groups over 512 ranks is some 30,000 slices: as columns it is built and sent in a few
milliseconds; one object per slice would cost tens. Each rank reads its own part as objects,
:meth:`MiniBatchPlan.for_rank` (:class:`RankPlan` -> :class:`MicroBatch` -> :class:`PlannedSlice`), built on
demand. A plan can also be written as those objects (``MiniBatchPlan(..., ranks=[RankPlan(...)])``); it is
stored as columns either way.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any

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
    """One optimizer step: which groups, split across DP ranks and micro-batches, as columns.

    Micro-batch ``j`` (rank-major: rank block ``j // micro_batches_per_rank``) holds the slices
    ``micro_slices[j]`` to ``micro_slices[j + 1]``; slice ``i`` is rows ``[slice_start[i], slice_stop[i])`` of
    group ``group_ids[slice_group[i]]`` on ``nodes[slice_node[i]]``; ``advantages`` holds one value per row of
    the slices in order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: NonNeg
    """Global optimizer step s = t*K + k."""
    train_batch: NonNeg
    """t."""
    position: NonNeg
    """k, the mini-batch's position inside its train batch."""
    group_ids: list[str]
    rank_ids: list[NonNeg]
    """The DP rank of each rank block, in order."""
    micro_batches_per_rank: NonNeg
    """Every rank's micro-batch count (one count: a differing one would deadlock collectives)."""
    nodes: list[str]
    """The store nodes the slices read from."""
    slice_group: list[NonNeg]
    slice_node: list[NonNeg]
    slice_start: list[NonNeg]
    slice_stop: list[NonNeg]
    micro_slices: list[NonNeg]
    """``len(rank_ids) * micro_batches_per_rank + 1`` offsets into the slices."""
    micro_tokens: list[NonNeg]
    micro_oversized: list[bool]
    advantages: list[float]

    @model_validator(mode="before")
    @classmethod
    def _from_ranks(cls, data: Any) -> Any:
        """A plan written as rank objects (``ranks=[RankPlan, ...]``) stored as columns."""
        if not isinstance(data, dict) or "ranks" not in data:
            return data
        data = dict(data)
        ranks = [RankPlan.model_validate(r) for r in data.pop("ranks")]
        counts = {len(r.micro_batches) for r in ranks}
        if len(counts) > 1:
            msg = f"ranks have different micro-batch counts {sorted(counts)}; collectives would deadlock"
            raise ValueError(msg)
        group_ids = list(data.get("group_ids", []))
        group_at = {g: i for i, g in enumerate(group_ids)}
        node_at: dict[str, int] = {}
        cols: dict[str, list[Any]] = {k: [] for k in ("slice_group", "slice_node", "slice_start", "slice_stop",
                                                      "micro_tokens", "micro_oversized", "advantages")}
        offsets = [0]
        for mb in (mb for r in ranks for mb in r.micro_batches):
            for s in mb.slices:
                if s.group_id not in group_at:
                    msg = f"slice of group {s.group_id!r}, which is not among the plan's group_ids"
                    raise ValueError(msg)
                cols["slice_group"].append(group_at[s.group_id])
                cols["slice_node"].append(node_at.setdefault(s.node, len(node_at)))
                cols["slice_start"].append(s.start)
                cols["slice_stop"].append(s.stop)
            offsets.append(offsets[-1] + len(mb.slices))
            cols["micro_tokens"].append(mb.tokens)
            cols["micro_oversized"].append(mb.oversized)
            cols["advantages"] += mb.advantages
        return {**data, **cols, "rank_ids": [r.dp_rank for r in ranks], "nodes": list(node_at),
                "micro_batches_per_rank": counts.pop() if counts else 0, "micro_slices": offsets}

    @model_validator(mode="after")
    def _consistent(self) -> MiniBatchPlan:
        n_slices, n_micro = len(self.slice_group), len(self.rank_ids) * self.micro_batches_per_rank
        wrong = [name for name, n, want in (
            ("slice_node", len(self.slice_node), n_slices), ("slice_start", len(self.slice_start), n_slices),
            ("slice_stop", len(self.slice_stop), n_slices), ("micro_slices", len(self.micro_slices), n_micro + 1),
            ("micro_tokens", len(self.micro_tokens), n_micro), ("micro_oversized", len(self.micro_oversized), n_micro),
        ) if n != want]
        if wrong:
            msg = f"plan for step {self.step}: column(s) {wrong} have the wrong length"
            raise ValueError(msg)
        at = self.micro_slices
        if at[0] != 0 or at[-1] != n_slices or any(b < a for a, b in pairwise(at)):
            msg = f"plan for step {self.step}: micro_slices must rise from 0 to {n_slices}"
            raise ValueError(msg)
        for name, index, table in (("group", self.slice_group, self.group_ids), ("node", self.slice_node, self.nodes)):
            if index and max(index) >= len(table):
                msg = f"plan for step {self.step}: a slice names {name} {max(index)} of {len(table)}"
                raise ValueError(msg)
        rows = sum(self.slice_stop) - sum(self.slice_start)
        if any(b < a for a, b in zip(self.slice_start, self.slice_stop, strict=True)) or rows != len(self.advantages):
            msg = f"plan for step {self.step}: slices of {rows} rows but {len(self.advantages)} advantages"
            raise ValueError(msg)
        return self

    @property
    def ranks(self) -> list[RankPlan]:
        """Every rank's part as objects, in rank-block order."""
        out, row = [], 0
        for b in range(len(self.rank_ids)):
            rank, row = self._rank(b, row)
            out.append(rank)
        return out

    def for_rank(self, dp_rank: int) -> RankPlan:
        """Rank ``dp_rank``'s part as objects."""
        try:
            block = self.rank_ids.index(dp_rank)
        except ValueError:
            msg = f"plan for step {self.step} has no dp_rank {dp_rank}"
            raise KeyError(msg) from None
        first = self.micro_slices[block * self.micro_batches_per_rank]
        return self._rank(block, sum(self.slice_stop[:first]) - sum(self.slice_start[:first]))[0]

    def _rank(self, block: int, row: int) -> tuple[RankPlan, int]:
        """Rank block ``block`` as objects, its first row at ``row`` of the advantages; and the row after it."""
        count, at = self.micro_batches_per_rank, self.micro_slices
        micro: list[MicroBatch] = []
        for j in range(block * count, (block + 1) * count):
            slices = [PlannedSlice.model_construct(node=self.nodes[self.slice_node[i]],
                                                   group_id=self.group_ids[self.slice_group[i]],
                                                   start=self.slice_start[i], stop=self.slice_stop[i])
                      for i in range(at[j], at[j + 1])]
            rows = sum(s.stop - s.start for s in slices)
            micro.append(MicroBatch.model_construct(slices=slices, advantages=self.advantages[row:row + rows],
                                                    tokens=self.micro_tokens[j], oversized=self.micro_oversized[j]))
            row += rows
        return RankPlan.model_construct(dp_rank=self.rank_ids[block], micro_batches=micro), row
