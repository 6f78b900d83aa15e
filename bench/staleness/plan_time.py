"""How long one admission decision takes over a long run's metadata: 100k trajectories in the frame."""

from __future__ import annotations

import statistics
import time

import numpy as np
import polars as pl

from admission import PlannerState, plan
from bench.staleness.workload import SOURCES, SimParams, admission_config


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
