"""DP balancing and micro-batch packing.

* :func:`balance_groups` splits a mini-batch's groups over D ranks, whole groups per rank, by LPT
  (longest processing time first) on the cost model: every rank gets at least one group when there
  are at least D groups.
* :func:`pack_micro_batches` packs each rank's trajectories into micro-batches of at most
  ``budget`` tokens (first-fit decreasing), a trajectory longer than the budget alone and flagged,
  then equalises the count across ranks by splitting the largest micro-batches of the ranks that have
  fewer (a differing count would deadlock collective schedules). Only when a rank has fewer
  trajectories than the common count does it get empty micro-batches (zero rows, zero loss).
"""

from __future__ import annotations

import heapq

import numpy as np


def trajectory_cost(tokens: np.ndarray, cost_model: str) -> np.ndarray:
    """Cost of each trajectory: its tokens, or tokens squared (attention-dominated)."""
    t = np.asarray(tokens, dtype=np.float64)
    if cost_model == "tokens":
        return t
    if cost_model == "sq_tokens":
        return t * t
    msg = f"unknown cost model {cost_model!r}"
    raise ValueError(msg)


def balance_groups(costs: np.ndarray, ranks: int) -> list[list[int]]:
    """LPT partition of groups (by cost) into ``ranks`` lists of group indices.

    Ties are broken by index so the result is deterministic.
    """
    if ranks < 1:
        msg = f"ranks must be >= 1, got {ranks}"
        raise ValueError(msg)
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    heap = [(0.0, 0, r) for r in range(ranks)]  # (load, groups, rank)
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in order:
        load, n, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + float(costs[i]), n + 1, r))
    return out


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
