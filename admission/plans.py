"""From admitted mini-batches to plans: the rank split, the packing and the plan objects, on arrays.

:func:`build_plans` takes the admitted groups' rows and the admitted mini-batches and writes one
:class:`~schemas.plan.MiniBatchPlan` per mini-batch (DP rank -> micro-batches -> slices, one advantage per
row in slice order). Per mini-batch:

1. each group's cost (:func:`~admission.packing.trajectory_cost` summed over its rows), payload bytes and
   node (its first row's) go to :func:`~admission.assignment.group_ranks`, which splits the groups over the
   ranks;
2. a rank's rows are its groups' rows, groups in id order, rows in frame order;
   :func:`~admission.packing.pack_items` packs every rank's rows into the common number of micro-batches;
3. a micro-batch's rows keep their order on the rank; consecutive rows of one group on one node with
   consecutive ``sample_idx`` make one slice.

Groups' offsets, costs and bytes come from the sorted rows by ``np.add.reduceat``; slices are where the
micro-batch, the group, the node or ``sample_idx`` continuity changes. A plan is these columns
(:class:`~schemas.plan.MiniBatchPlan`), made without pydantic's validation: every value is the planner's own, of
the model's types and in range (``sample_idx`` and tokens are checked here, once per frame), and the slices hold
as many rows as there are advantages by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from admission.assignment import group_ranks
from admission.config import AdmissionConfig
from admission.packing import pack_items, trajectory_cost
from schemas.plan import MiniBatchPlan

Batch = tuple[int, int, int, list[str]]
"""An admitted mini-batch: (step, train batch, position, group ids)."""

class _Groups:
    """The admitted groups' rows as arrays: one run of rows per group, the groups in id order (so a group's
    index orders groups as their ids do), the rows of a group in frame order."""

    def __init__(self, rows: pl.DataFrame, config: AdmissionConfig) -> None:
        starts, ids = _runs(rows)
        if not ids.is_sorted():  # groups apart or out of id order: gather them in id order, rows in their order
            rows = rows.sort("group_id", maintain_order=True)
            starts, ids = _runs(rows)
        self.rows = rows
        """The rows, in group-id order."""
        names: list[str] = ids.to_list()
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.start = starts
        self.length = np.diff(np.r_[starts, rows.height]).astype(np.int64)
        self.tok = rows["_tok"].cast(pl.Int64).to_numpy()
        self.sample_idx = rows["sample_idx"].cast(pl.Int64).to_numpy()
        for col, values in (("sample_idx", self.sample_idx), ("_tok", self.tok)):
            if values.size and int(values.min()) < 0:
                row = int(np.argmin(values))
                msg = f"group {rows['group_id'][row]!r}: {col} {int(values[row])} is negative"
                raise ValueError(msg)
        self.advantage = rows["advantage"].cast(pl.Float64).to_numpy()
        self.node, firsts = _dense_codes(rows["node"].cast(pl.Categorical).to_physical().to_numpy())
        self.node_names: list[str] = [str(n) for n in rows["node"].gather(firsts).to_list()]  # by code
        self.first_node = list(map(self.node_names.__getitem__, self.node[starts].tolist()))
        cost = trajectory_cost(self.tok, config.cost_model)
        nbytes = rows["_bytes"].cast(pl.Int64).to_numpy()
        self.cost = np.add.reduceat(cost, starts) if starts.size else np.zeros(0)
        self.nbytes = (np.add.reduceat(nbytes, starts) if starts.size else np.zeros(0)).astype(np.float64)


def _dense_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes made dense, in code order (``np.unique``'s inverse, by a table rather than a sort), and the
    first position of each."""
    codes = codes.astype(np.int64)
    if codes.size == 0:
        return codes, codes
    seen = np.zeros(int(codes.max()) + 1, dtype=bool)
    seen[codes] = True
    dense = np.cumsum(seen) - 1
    node = dense[codes]
    firsts = np.full(int(dense[-1]) + 1, codes.size, dtype=np.int64)
    np.minimum.at(firsts, node, np.arange(codes.size))
    return node, firsts


def _runs(rows: pl.DataFrame) -> tuple[np.ndarray, pl.Series]:
    """The first row of each run of equal ``group_id`` and the run's id."""
    if rows.height == 0:
        return np.zeros(0, dtype=np.int64), rows["group_id"]
    run = rows.select(pl.col("group_id").rle_id())["group_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, run[1:] != run[:-1]]).astype(np.int64)
    return starts, rows["group_id"].gather(starts)


def build_plans(rows: pl.DataFrame, batches: Sequence[Batch],
                config: AdmissionConfig) -> tuple[list[MiniBatchPlan], dict[str, int]]:
    """The plans of admitted mini-batches, and the DP rank of every admitted group.

    Args:
        rows: one row per trajectory of the admitted groups, sorted by ``group_id, sample_idx``, with
            ``node``, ``_tok`` (prompt + response tokens), ``_bytes`` (payload bytes) and ``advantage``.
        batches: the admitted mini-batches in step order.
        config: admission configuration (DP ranks, cost model, token budget).
    """
    plans, groups, placed = _build(rows, batches, config)
    return plans, {groups.names[i]: int(placed[3, i]) for i in np.flatnonzero(placed[3] >= 0).tolist()}


def placed_rows(rows: pl.DataFrame, batches: Sequence[Batch],
                config: AdmissionConfig) -> tuple[list[MiniBatchPlan], pl.DataFrame]:
    """:func:`build_plans`' plans, and ``rows`` in group-id order (as given when they are sorted so) with each
    row's ``step``, ``train_batch``, ``position`` and ``dp_rank`` (Int64; -1 for a group no batch names)."""
    plans, groups, placed = _build(rows, batches, config)
    per_row = np.repeat(placed, groups.length, axis=1)
    return plans, groups.rows.with_columns(
        pl.Series(name, per_row[j], dtype=pl.Int64) for j, name in enumerate(PLACED))


PLACED = ("step", "train_batch", "position", "dp_rank")
"""What :func:`placed_rows` adds to each row: where its group went."""


def _build(rows: pl.DataFrame, batches: Sequence[Batch],
           config: AdmissionConfig) -> tuple[list[MiniBatchPlan], _Groups, np.ndarray]:
    """The plans, the rows as :class:`_Groups`, and [4, groups] int: each group's :data:`PLACED` (-1 when none)."""
    groups = _Groups(rows, config)
    placed = np.full((len(PLACED), len(groups.names)), -1, dtype=np.int64)
    plans: list[MiniBatchPlan] = []
    for step, t, k, names in batches:
        plan, gi, ranks = _mini_batch(groups, step, t, k, names, config)
        plans.append(plan)
        placed[:3, gi] = np.array([[step], [t], [k]], dtype=np.int64)
        placed[3, gi] = ranks
    return plans, groups, placed


def _mini_batch(groups: _Groups, step: int, t: int, k: int, names: list[str],
                config: AdmissionConfig) -> tuple[MiniBatchPlan, np.ndarray, np.ndarray]:
    """One mini-batch's plan, its groups' indices and the rank of each."""
    ranks, m = config.dp_ranks, len(names)
    gi = np.array([groups.index[n] for n in names], dtype=np.int64)
    nodes = list(map(groups.first_node.__getitem__, gi.tolist()))
    group_rank = group_ranks(groups.cost[gi], groups.nbytes[gi], nodes, config)
    order = np.lexsort((gi, group_rank))  # groups by rank, then id
    group_rank = group_rank[order]
    g = gi[order]
    length = groups.length[g]
    first = np.cumsum(length) - length
    row = np.repeat(groups.start[g] - first, length) + np.arange(int(length.sum()))  # rank-major, rank order
    item_rank = np.repeat(group_rank, length)
    item_group = np.repeat(g, length)
    micro, count = pack_items(item_rank, groups.tok[row], ranks, config.token_budget)
    key = item_rank * count + micro  # micro-batch, globally
    by_micro = np.argsort(key, kind="stable")
    row, key, item_group = row[by_micro], key[by_micro], item_group[by_micro]
    sample, node = groups.sample_idx[row], groups.node[row]
    cut = np.ones(row.size, dtype=bool)
    cut[1:] = ((key[1:] != key[:-1]) | (item_group[1:] != item_group[:-1]) | (node[1:] != node[:-1])
               | (sample[1:] != sample[:-1] + 1))
    heads = np.flatnonzero(cut)
    tails = np.r_[heads[1:], row.size][: heads.size] - 1
    pos = np.empty(len(groups.names), dtype=np.int64)
    pos[gi] = np.arange(m)  # a group's place in the mini-batch's group ids
    named = node[heads]
    code, first_at = _dense_codes(named)
    by_first = np.argsort(first_at)  # the nodes in the order the slices first name them
    number = np.empty_like(by_first)
    number[by_first] = np.arange(by_first.size)
    slice_node = number[code]
    used = named[first_at[by_first]]  # their codes in the groups' table
    n_micro = ranks * count
    row_at = np.r_[0, np.cumsum(np.bincount(key, minlength=n_micro))]
    tok = groups.tok[row]
    plan = MiniBatchPlan.model_construct(
        step=step, train_batch=t, position=k, group_ids=list(names), rank_ids=list(range(ranks)),
        micro_batches_per_rank=count, nodes=list(map(groups.node_names.__getitem__, used.tolist())),
        slice_group=pos[item_group[heads]].tolist(), slice_node=slice_node.tolist(),
        slice_start=sample[heads].tolist(), slice_stop=(sample[tails] + 1).tolist(),
        micro_slices=np.r_[0, np.cumsum(np.bincount(key[heads], minlength=n_micro))].tolist(),
        micro_tokens=np.diff(np.r_[0, np.cumsum(tok)][row_at]).tolist(),
        micro_oversized=(np.diff(np.r_[0, np.cumsum(tok > config.token_budget)][row_at]) > 0).tolist(),
        advantages=groups.advantage[row].tolist())
    return plan, g, group_rank
