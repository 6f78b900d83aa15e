"""Advantages, trajectory costs and micro-batch packing: the numbers a plan is made of.

* :func:`advantage_expr` is the group-relative advantage of every row (``GrpoConfig``); the planner
  and the benchmarks' baselines compute advantages with it.
* :func:`trajectory_cost` is what DP balancing weighs a trajectory by; the rank split of a mini-batch's
  groups, whole groups per rank, is :mod:`admission.assignment`'s (by links or by tokens).
* :func:`pack_items` packs every rank's trajectories into micro-batches of at most ``budget`` tokens
  (first-fit decreasing), a trajectory longer than the budget alone and flagged, then equalises the count
  across ranks by splitting the largest micro-batches of the ranks that have fewer (a differing count would
  deadlock collective schedules). Only when a rank has fewer trajectories than the common count does it get
  empty micro-batches (zero rows, zero loss). It works on flat arrays for all ranks at once: first-fit runs
  over item positions with a matrix of bin loads (one row per rank), the splits over rounds with one split
  per short rank each. :func:`pack_micro_batches` is the same packing on per-rank lists.
* :mod:`admission.plans` applies both to admitted mini-batches and writes the plans.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from admission.config import GrpoConfig

_SEALED = np.iinfo(np.int64).max // 4
"""Taken from an oversized micro-batch's room: no other trajectory fits beside it."""


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


def pack_items(rank: np.ndarray, tokens: np.ndarray, ranks: int, budget: int) -> tuple[np.ndarray, int]:
    """Pack every rank's trajectories into the same number of micro-batches.

    Args:
        rank: [n] int, the rank of each trajectory, non-decreasing (a rank's trajectories side by side, in
            their order on the rank: first-fit breaks ties between equal lengths by it).
        tokens: [n] int, the tokens of each trajectory.
        ranks: the number of ranks (ranks with no trajectory get empty micro-batches only).
        budget: maximum tokens of one micro-batch.

    Returns:
        ``(micro_batch, count)``: [n] the micro-batch of each trajectory on its rank, and the common count.
        A micro-batch holding a trajectory longer than ``budget`` holds only it (oversized).
    """
    rank = np.asarray(rank, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if rank.size and (np.any(np.diff(rank) < 0) or rank[0] < 0 or rank[-1] >= ranks):
        msg = f"pack_items: rank must be non-decreasing in [0, {ranks}), got {rank.tolist()[:8]}..."
        raise ValueError(msg)
    if rank.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    counts = np.bincount(rank, minlength=ranks)
    local = np.arange(rank.size) - (np.cumsum(counts) - counts)[rank]
    micro, bins = _first_fit(rank, local, tokens, counts, budget)
    target = int(bins.max())
    _equalise(rank, local, tokens, micro, bins, target)
    return micro, target


def _first_fit(rank: np.ndarray, local: np.ndarray, tokens: np.ndarray, counts: np.ndarray,
               budget: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing on every rank at once: the bin of each item and each rank's bin count.

    Row ``i`` of the room matrix (tokens each bin has left) is the rank with the ``i``-th most items, so the
    ranks that have an item at sorted position ``p`` are its first rows; an unopened bin has the whole budget,
    so the first bin an item fits is an open one or the next to open.
    """
    ranks = counts.size
    order = _longest_first(rank, local, tokens)
    row_rank = np.argsort(-counts, kind="stable")
    row_of = np.empty(ranks, dtype=np.int64)
    row_of[row_rank] = np.arange(ranks)
    width = int(counts.max())
    pos = np.arange(rank.size) - (np.cumsum(counts) - counts)[rank[order]]  # place in the rank's sorted order
    rows = row_of[rank[order]]
    sorted_tok = np.zeros((width, ranks), dtype=np.int64)  # [position, row]
    sorted_tok[pos, rows] = tokens[order]
    active = np.searchsorted(-counts[row_rank], -np.arange(width), side="left")  # rows with an item at p
    any_over = np.asarray((sorted_tok > budget).any(axis=1), dtype=bool).tolist()
    room = np.full((ranks, width + 1), budget, dtype=np.int64)
    flat = room.reshape(-1)
    base = np.arange(ranks, dtype=np.int64) * (width + 1)
    opened = np.zeros(ranks, dtype=np.int64)
    bin_at = np.zeros((width, ranks), dtype=np.int64)
    w = 1
    for p in range(width):
        k = int(active[p])
        t = sorted_tok[p, :k]
        b = np.argmax(room[:k, :w] >= t[:, None], axis=1)
        at = base[:k]
        if any_over[p]:
            over = t > budget
            b[over] = opened[:k][over]
            at = at + b
            flat[at] -= np.where(over, _SEALED, t)
        else:
            at = at + b
            flat[at] -= t
        np.maximum(opened[:k], b + 1, out=opened[:k])
        bin_at[p, :k] = b
        w = max(w, int(b.max()) + 2)
    micro = np.empty(rank.size, dtype=np.int64)
    micro[order] = bin_at[pos, rows]
    return micro, opened[row_of]


def _longest_first(rank: np.ndarray, local: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The items by rank, then decreasing tokens, then rank order: a stable sort of one integer key where the
    key fits 63 bits (the items are rank-major, so stability keeps the rank order), else a lexical sort."""
    lo, hi = int(tokens.min()), int(tokens.max())
    span = hi - lo + 1
    if int(rank[-1]) + 1 < (1 << 62) // span:
        return np.argsort(rank * span + (hi - tokens), kind="stable")
    return np.lexsort((local, -tokens, rank))


def _equalise(rank: np.ndarray, local: np.ndarray, tokens: np.ndarray, micro: np.ndarray, bins: np.ndarray,
              target: int) -> None:
    """Bring every rank to ``target`` bins (``micro`` and ``bins`` updated in place).

    Each round, every rank short of ``target`` splits its largest bin (the first of equal size) into the
    items at even and odd positions in decreasing-token order, the odd ones in a new bin right after it
    (half a bin never exceeds the budget); a rank whose largest bin has fewer than two items opens an empty
    bin at its end instead.
    """
    ranks = bins.size
    while True:
        short = np.flatnonzero(bins < target)
        if short.size == 0:
            return
        sizes = np.bincount(rank * target + micro, minlength=ranks * target).reshape(ranks, target)[short]
        largest = sizes.argmax(axis=1)
        splits = sizes[np.arange(short.size), largest] >= 2
        bins[short] += 1
        if not splits.any():
            continue
        split_at = np.full(ranks, -1, dtype=np.int64)
        split_at[short[splits]] = largest[splits]
        at = split_at[rank]
        in_split = at >= 0
        moved = np.flatnonzero(in_split & (micro == at))
        micro[in_split & (micro > at)] += 1
        moved = moved[np.lexsort((local[moved], -tokens[moved], rank[moved]))]
        r = rank[moved]
        first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        nth = np.arange(moved.size) - np.repeat(first, np.diff(np.r_[first, moved.size]))
        micro[moved[nth % 2 == 1]] += 1


def pack_micro_batches(rank_tokens: list[np.ndarray], budget: int) -> list[list[tuple[list[int], bool]]]:
    """Pack each rank's trajectories into the same number of micro-batches (:func:`pack_items` on lists).

    Args:
        rank_tokens: per rank, [n_r] tokens of each trajectory.
        budget: maximum tokens of one micro-batch.

    Returns:
        per rank, a list of (trajectory indices, oversized) of equal length on every rank.
    """
    lengths = [len(t) for t in rank_tokens]
    tokens = (np.concatenate([np.asarray(t, dtype=np.int64) for t in rank_tokens]) if rank_tokens
              else np.zeros(0, dtype=np.int64))
    micro, target = pack_items(np.repeat(np.arange(len(lengths)), lengths), tokens, len(lengths), budget)
    out: list[list[tuple[list[int], bool]]] = []
    start = 0
    for n in lengths:
        members: list[list[int]] = [[] for _ in range(target)]
        for i, m in enumerate(micro[start:start + n].tolist()):
            members[m].append(i)
        over = [len(b) == 1 and int(tokens[start + b[0]]) > budget for b in members]
        out.append(list(zip(members, over, strict=True)))
        start += n
    return out
