"""From admitted groups to plans: GRPO advantages, DP balancing, micro-batch packing.

* :func:`advantage_expr` is the group-relative advantage of every row (``GrpoConfig``); the planner
  and the benchmarks' baselines compute advantages with it.
* the rank split of a mini-batch's groups, whole groups per rank, is :mod:`admission.assignment`'s (by links
  or by tokens).
* :func:`pack_micro_batches` packs each rank's trajectories into micro-batches of at most
  ``budget`` tokens (first-fit decreasing), a trajectory longer than the budget alone and flagged,
  then equalises the count across ranks by splitting the largest micro-batches of the ranks that have
  fewer (a differing count would deadlock collective schedules). Only when a rank has fewer
  trajectories than the common count does it get empty micro-batches (zero rows, zero loss).
* :func:`build_plans` applies both to admitted mini-batches and writes the plans (mini-batch -> DP
  rank -> micro-batches -> slices, with one advantage per row in slice order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl

from admission.assignment import assign_groups
from admission.config import AdmissionConfig, GrpoConfig
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice, RankPlan

Batch = tuple[int, int, int, list[str]]
"""An admitted mini-batch: (step, train batch, position, group ids)."""


def advantage_expr(grpo: GrpoConfig, *, reward: str = "reward", group: str = "group_id") -> pl.Expr:
    """GRPO advantage of each row: its reward minus its group's mean reward, divided by the group's reward
    std (ddof 1, 0 for a one-row group) plus ``grpo.eps`` when ``grpo.normalize_std``.

    Example:
        >>> df = pl.DataFrame({"group_id": ["a", "a"], "reward": [1.0, 0.0]})
        >>> df.select(advantage_expr(GrpoConfig(normalize_std=False)))["reward"].to_list()
        [0.5, -0.5]
    """
    g = pl.col(group)
    centred = pl.col(reward) - pl.col(reward).mean().over(g)
    if not grpo.normalize_std:
        return centred
    return centred / (pl.col(reward).std(ddof=1).over(g).fill_null(0.0) + grpo.eps)


def trajectory_cost(tokens: np.ndarray, cost_model: str) -> np.ndarray:
    """Cost of each trajectory: its tokens, or tokens squared (attention-dominated)."""
    t = np.asarray(tokens, dtype=np.float64)
    if cost_model == "tokens":
        return t
    if cost_model == "sq_tokens":
        return t * t
    msg = f"unknown cost model {cost_model!r}"
    raise ValueError(msg)


def _ffd(tokens: np.ndarray, budget: int) -> tuple[list[list[int]], list[bool]]:
    """First-fit decreasing into bins of ``budget`` tokens; oversized items alone."""
    bins: list[list[int]] = []
    loads: list[int] = []
    oversized: list[bool] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        t = int(tokens[i])
        if t > budget:
            bins.append([i])
            loads.append(t)
            oversized.append(True)
            continue
        for b in range(len(bins)):
            if not oversized[b] and loads[b] + t <= budget:
                bins[b].append(i)
                loads[b] += t
                break
        else:
            bins.append([i])
            loads.append(t)
            oversized.append(False)
    return bins, oversized


def pack_micro_batches(rank_tokens: list[np.ndarray], budget: int) -> list[list[tuple[list[int], bool]]]:
    """Pack each rank's trajectories into the same number of micro-batches.

    Args:
        rank_tokens: per rank, [n_r] tokens of each trajectory.
        budget: maximum tokens of one micro-batch.

    Returns:
        per rank, a list of (trajectory indices, oversized) of equal length on every rank.
    """
    packed = [_ffd(t, budget) for t in rank_tokens]
    target = max((len(b) for b, _ in packed), default=0)
    out: list[list[tuple[list[int], bool]]] = []
    for tokens, (bins, over) in zip(rank_tokens, packed, strict=True):
        mbs = [(sorted(b), o) for b, o in zip(bins, over, strict=True)]
        while len(mbs) < target:
            j = max(range(len(mbs)), key=lambda i: (len(mbs[i][0]), -i)) if mbs else -1
            if j < 0 or len(mbs[j][0]) < 2:
                mbs.append(([], False))  # fewer trajectories than the common count
                continue
            items = sorted(mbs[j][0], key=lambda i: (-int(tokens[i]), i))
            a, b = items[0::2], items[1::2]  # splitting a bin never exceeds the budget
            mbs[j] = (sorted(a), False)
            mbs.insert(j + 1, (sorted(b), False))
        out.append(mbs)
    return out


def build_plans(rows: pl.DataFrame, batches: Sequence[Batch],
                config: AdmissionConfig) -> tuple[list[MiniBatchPlan], dict[str, int]]:
    """The plans of admitted mini-batches, and the DP rank of every admitted group.

    Args:
        rows: one row per trajectory of the admitted groups, sorted by ``group_id, sample_idx``, with
            ``node``, ``_tok`` (prompt + response tokens), ``_bytes`` (payload bytes) and ``advantage``.
        batches: the admitted mini-batches in step order.
        config: admission configuration (DP ranks, cost model, token budget).
    """
    by_group: dict[str, dict[str, list[Any]]] = {}
    for key, sub in rows.partition_by("group_id", as_dict=True, maintain_order=True).items():
        by_group[str(key[0])] = {
            "node": sub["node"].to_list(), "idx": sub["sample_idx"].to_list(), "tok": sub["_tok"].to_list(),
            "adv": sub["advantage"].to_list(), "bytes": sub["_bytes"].to_list(),
        }
    plans: list[MiniBatchPlan] = []
    rank_of: dict[str, int] = {}
    for step, t, k, names in batches:
        costs = np.array([trajectory_cost(np.array(by_group[n]["tok"]), config.cost_model).sum() for n in names])
        nbytes = np.array([sum(by_group[n]["bytes"]) for n in names], dtype=np.float64)
        rank_rows: list[list[tuple[str, int]]] = []  # (group, row position)
        for r, members in enumerate(assign_groups(costs, nbytes, [by_group[n]["node"][0] for n in names], config)):
            members = sorted(members, key=lambda i: names[i])
            rank_rows.append([(names[i], j) for i in members for j in range(len(by_group[names[i]]["idx"]))])
            for i in members:
                rank_of[names[i]] = r
        toks = [np.array([by_group[n]["tok"][j] for n, j in rr], dtype=np.int64) for rr in rank_rows]
        ranks = [RankPlan(dp_rank=r, micro_batches=[_micro_batch(by_group, [rr[i] for i in idxs], oversized)
                                                    for idxs, oversized in mbs])
                 for r, (rr, mbs) in enumerate(zip(rank_rows, pack_micro_batches(toks, config.token_budget),
                                                   strict=True))]
        plans.append(MiniBatchPlan(step=step, train_batch=t, position=k, group_ids=names, ranks=ranks))
    return plans, rank_of


def _micro_batch(by_group: dict[str, dict[str, list[Any]]], rows: list[tuple[str, int]], oversized: bool) -> MicroBatch:
    slices: list[PlannedSlice] = []
    advs: list[float] = []
    tokens = 0
    for n, j in rows:  # rows come in (group, sample order): merge consecutive sample_idx into one slice
        grp = by_group[n]
        s = int(grp["idx"][j])
        last = slices[-1] if slices else None
        if last is not None and last.group_id == n and last.stop == s and last.node == grp["node"][j]:
            slices[-1] = PlannedSlice(node=last.node, group_id=n, start=last.start, stop=s + 1)
        else:
            slices.append(PlannedSlice(node=str(grp["node"][j]), group_id=n, start=s, stop=s + 1))
        advs.append(float(grp["adv"][j]))
        tokens += int(grp["tok"][j])
    return MicroBatch(slices=slices, advantages=advs, tokens=tokens, oversized=oversized)
