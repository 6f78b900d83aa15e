"""How long one admission decision takes: over a long run's metadata (100k trajectories in the frame), and at
cluster scale (1,000 store nodes, 512 ranks, 4,096 groups in one mini-batch)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import polars as pl

from admission import AdmissionConfig, LinkModel, PlannerState, plan
from admission.config import Assignment
from bench.staleness.workload import SOURCES, SimParams, admission_config

SCALE_NODES = 1000
"""Store nodes of the scale decision: half on the ranks' hosts, half on hosts of their own."""
SCALE_RANK_HOSTS = 64
"""Hosts of the ranks, :data:`SCALE_RANKS_PER_HOST` ranks each."""
SCALE_RANKS_PER_HOST = 8
"""DP ranks per rank host (512 ranks in all)."""
SCALE_GROUPS = 4096
"""Groups in the one mini-batch the scale decision admits."""
SCALE_GROUP_SIZE = 8
"""G of the scale decision."""
SCALE_LINK_MBIT = 100_000.0
"""Every host's rate each way in the scale decision, Mbit/s."""


def plan_ms_p50_100k(reps: int = 30) -> float:
    """p50 ms of one admission decision with 100k trajectories in the metadata frame."""
    rng = np.random.default_rng(0)
    n, g = 100_000, 8
    ng = n // g
    gids = np.repeat(np.array([f"g{i:06d}" for i in range(ng)]), g)
    meta = pl.DataFrame({
        "seq": np.arange(n), "node": np.repeat(np.array([f"node{i % 4}" for i in range(ng)]), g),
        "group_id": gids, "sample_idx": np.tile(np.arange(g, dtype=np.int32), ng),
        "policy_version": np.repeat(np.arange(ng) // 64, g), "policy_version_min": np.repeat(np.arange(ng) // 64, g),
        "data_source": np.repeat(rng.choice(list(SOURCES), ng), g),
        "prompt_len": rng.integers(64, 512, n).astype(np.int32),
        "response_len": rng.integers(50, 4000, n).astype(np.int32),
        "reward": rng.random(n).astype(np.float32), "finish_reason": np.full(n, "stop"),
        "status": np.full(n, "completed"),
    })
    cfg = admission_config(SimParams(), "mini_batch")
    # a long run: all but the newest 20 groups admitted already; one mini-batch is admissible now
    state = PlannerState(train_batch=190, admitted=frozenset(f"g{i:06d}" for i in range(ng - 20)))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = plan(meta, state, cfg, inflight={"math": 64, "chat": 64}, current_version=760)
        ts.append((time.perf_counter() - t0) * 1e3)
        if len(res.plans) != 1:
            msg = f"expected one admitted mini-batch, got {len(res.plans)}"
            raise RuntimeError(msg)
    return float(statistics.median(ts))


def scale_frame(seed: int = 0) -> pl.DataFrame:
    """Metadata of :data:`SCALE_GROUPS` complete groups of :data:`SCALE_GROUP_SIZE` rows on
    :data:`SCALE_NODES` store nodes (each group on one node; every node holds 4 or 5 groups, in random order), with
    payload bytes."""
    rng = np.random.default_rng(seed)
    ng, g = SCALE_GROUPS, SCALE_GROUP_SIZE
    n = ng * g
    nodes = np.array([f"grpc://10.{i // 250}.{i % 250}.1:8815" for i in range(SCALE_NODES)])
    prompt = rng.integers(64, 512, n).astype(np.int32)
    response = rng.integers(50, 4000, n).astype(np.int32)
    return pl.DataFrame({
        "seq": np.arange(n), "node": np.repeat(nodes[rng.permutation(np.arange(ng) % SCALE_NODES)], g),
        "group_id": np.repeat(np.array([f"g{i:06d}" for i in range(ng)]), g),
        "sample_idx": np.tile(np.arange(g, dtype=np.int32), ng), "policy_version": np.zeros(n, dtype=np.int64),
        "prompt_len": prompt, "response_len": response, "reward": rng.random(n).astype(np.float32),
        "status": np.full(n, "completed"), "bytes": 8 * (prompt.astype(np.int64) + response),
    })


def scale_links() -> LinkModel:
    """:data:`SCALE_RANK_HOSTS` hosts of :data:`SCALE_RANKS_PER_HOST` ranks; the first half of the store nodes
    spread over the rank hosts, the other half each on a host of its own; every link at :data:`SCALE_LINK_MBIT`."""
    hosts = [f"rank-host-{i}" for i in range(SCALE_RANK_HOSTS)]
    node_host = {f"grpc://10.{i // 250}.{i % 250}.1:8815": hosts[i % SCALE_RANK_HOSTS] if i < SCALE_NODES // 2
                 else f"store-host-{i}" for i in range(SCALE_NODES)}
    ranks = tuple(h for h in hosts for _ in range(SCALE_RANKS_PER_HOST))
    return LinkModel(node_host=node_host, rank_host=ranks, default_mbit=SCALE_LINK_MBIT)


def scale_config(assignment: Assignment) -> AdmissionConfig:
    """One mini-batch of every scale group over all ranks, split by ``assignment`` (``links`` or ``tokens``)."""
    return AdmissionConfig(train_batch_groups=SCALE_GROUPS, group_size=SCALE_GROUP_SIZE, mini_batches=1,
                           dp_ranks=SCALE_RANK_HOSTS * SCALE_RANKS_PER_HOST, token_budget=16384,
                           policy="mini_batch", assignment=assignment, links=scale_links())


def plan_ms_p50_scale(assignment: Assignment = "links", reps: int = 20) -> float:
    """p50 ms of one admission decision at cluster scale: :func:`scale_frame` planned by :func:`scale_config`,
    the one mini-batch of all its groups admitted at once."""
    meta, cfg = scale_frame(), scale_config(assignment)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = plan(meta, PlannerState(), cfg, inflight=0)
        ts.append((time.perf_counter() - t0) * 1e3)
        if len(res.plans) != 1 or len(res.plans[0].group_ids) != SCALE_GROUPS:
            msg = f"expected one admitted mini-batch of {SCALE_GROUPS} groups, got {len(res.plans)}"
            raise RuntimeError(msg)
    return float(statistics.median(ts))


def plan_time_metrics(reps: int | None = None) -> dict[str, float]:
    """The decision times ``bench.staleness`` reports: ``plan_ms_p50_100k`` (p50 of 30 decisions),
    ``plan_ms_p50_scale`` (the rank split by links) and ``plan_ms_p50_scale_tokens`` (by tokens; p50 of 20 each);
    ``reps`` decisions each when given."""
    return {"plan_ms_p50_100k": plan_ms_p50_100k(reps or 30),
            "plan_ms_p50_scale": plan_ms_p50_scale("links", reps or 20),
            "plan_ms_p50_scale_tokens": plan_ms_p50_scale("tokens", reps or 20)}
