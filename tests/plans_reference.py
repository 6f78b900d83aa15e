"""The plan builder as a plain reference: per-row Python, first-fit decreasing per rank, validated models.

``tests/test_admission_plans.py`` checks that :func:`admission.plans.build_plans`,
:func:`admission.packing.pack_micro_batches` and the planner's consumed frame are exactly what these give.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl

from admission.assignment import assign_groups
from admission.config import AdmissionConfig
from admission.packing import advantage_expr, trajectory_cost
from admission.planner import CONSUMED_SCHEMA
from admission.staleness import staleness_exprs
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice, RankPlan

Batch = tuple[int, int, int, list[str]]


def lpt_ranks(costs: np.ndarray, ranks: int) -> list[int]:
    """LPT one group at a time: decreasing cost (then index), each to the rank of least (load, groups, index)."""
    out = [0] * len(costs)
    heap = [(0.0, 0, r) for r in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        load, n, r = heap[0]
        out[i] = r
        heapq.heapreplace(heap, (load + float(costs[i]), n + 1, r))
    return out


def ffd(tokens: np.ndarray, budget: int) -> tuple[list[list[int]], list[bool]]:
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
    """Per rank, (trajectory indices, oversized) of equal count on every rank."""
    packed = [ffd(t, budget) for t in rank_tokens]
    target = max((len(b) for b, _ in packed), default=0)
    out: list[list[tuple[list[int], bool]]] = []
    for tokens, (bins, over) in zip(rank_tokens, packed, strict=True):
        mbs = [(sorted(b), o) for b, o in zip(bins, over, strict=True)]
        while len(mbs) < target:
            j = max(range(len(mbs)), key=lambda i: (len(mbs[i][0]), -i)) if mbs else -1
            if j < 0 or len(mbs[j][0]) < 2:
                mbs.append(([], False))
                continue
            items = sorted(mbs[j][0], key=lambda i: (-int(tokens[i]), i))
            a, b = items[0::2], items[1::2]
            mbs[j] = (sorted(a), False)
            mbs.insert(j + 1, (sorted(b), False))
        out.append(mbs)
    return out


def build_plans(rows: pl.DataFrame, batches: Sequence[Batch],
                config: AdmissionConfig) -> tuple[list[MiniBatchPlan], dict[str, int]]:
    """The plans of admitted mini-batches, and the DP rank of every admitted group."""
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
        rank_rows: list[list[tuple[str, int]]] = []
        for r, members in enumerate(assign_groups(costs, nbytes, [by_group[n]["node"][0] for n in names], config)):
            members = sorted(members, key=lambda i: names[i])
            rank_rows.append([(names[i], j) for i in members for j in range(len(by_group[names[i]]["idx"]))])
            for i in members:
                rank_of[names[i]] = r
        toks = [np.array([by_group[n]["tok"][j] for n, j in rr], dtype=np.int64) for rr in rank_rows]
        ranks = [RankPlan(dp_rank=r, micro_batches=[micro_batch(by_group, [rr[i] for i in idxs], oversized)
                                                    for idxs, oversized in mbs])
                 for r, (rr, mbs) in enumerate(zip(rank_rows, pack_micro_batches(toks, config.token_budget),
                                                   strict=True))]
        plans.append(MiniBatchPlan(step=step, train_batch=t, position=k, group_ids=names, ranks=ranks))
    return plans, rank_of


def micro_batch(by_group: dict[str, dict[str, list[Any]]], rows: list[tuple[str, int]], oversized: bool) -> MicroBatch:
    """One micro-batch of (group, row) pairs: consecutive sample_idx of one group on one node make a slice."""
    slices: list[PlannedSlice] = []
    advs: list[float] = []
    tokens = 0
    for n, j in rows:
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


def plans_and_consumed(meta: pl.DataFrame, batches: list[Batch], config: AdmissionConfig,
                       current_version: int) -> tuple[list[MiniBatchPlan], pl.DataFrame]:
    """The planner's plans and consumed frame through :func:`build_plans`, with a join per table."""
    if not batches:
        return [], pl.DataFrame(schema=CONSUMED_SCHEMA)
    assign = [(name, step, t, k) for step, t, k, names in batches for name in names]
    a = pl.DataFrame({"group_id": [x[0] for x in assign], "step": [x[1] for x in assign],
                      "train_batch": [x[2] for x in assign], "position": [x[3] for x in assign]},
                     schema={"group_id": pl.String, "step": pl.Int64, "train_batch": pl.Int64, "position": pl.Int64})
    g = pl.col("group_id")
    has_bytes = "bytes" in meta.columns
    trained = "loss_tokens" if "loss_tokens" in meta.columns else "response_len"
    nbytes = pl.col("bytes").cast(pl.Int64) if has_bytes else pl.col("_tok")
    rows = (
        meta.filter(g.is_in(a["group_id"].implode()))
        .with_columns(pl.col(trained).cast(pl.Int64).alias("loss_tokens"))
        .select(["group_id", "node", "sample_idx", "policy_version", "policy_version_min", "prompt_len",
                 "response_len", "loss_tokens", "reward", *(["bytes"] if has_bytes else [])])
        .with_columns(pl.col("reward").cast(pl.Float64),
                      advantage_expr(config.grpo).cast(pl.Float64).alias("advantage"),
                      (pl.col("prompt_len").cast(pl.Int64) + pl.col("response_len").cast(pl.Int64)).alias("_tok"))
        .with_columns(nbytes.alias("_bytes"))
        .sort(["group_id", "sample_idx"])
    )
    plans, rank_of = build_plans(rows, batches, config)
    ranks_frame = pl.DataFrame({"group_id": list(rank_of), "dp_rank": list(rank_of.values())},
                               schema={"group_id": pl.String, "dp_rank": pl.Int64})
    consumed = (
        rows.join(a, on="group_id").join(ranks_frame, on="group_id")
        .with_columns(pl.lit(current_version, dtype=pl.Int64).alias("admitted_at_version"))
        .with_columns(staleness_exprs(config.mini_batches))
        .select([pl.col(c).cast(dt) for c, dt in CONSUMED_SCHEMA.items()])
        .sort(["step", "group_id", "sample_idx"])
    )
    if config.quota_columns:
        qv = meta.group_by("group_id").agg(pl.col(c).first().cast(pl.String) for c in config.quota_columns)
        consumed = consumed.join(qv, on="group_id", how="left").sort(["step", "group_id", "sample_idx"])
    return plans, consumed
