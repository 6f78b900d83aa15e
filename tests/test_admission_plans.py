"""The plan builder on arrays against the plain reference (``tests/plans_reference.py``), on random inputs.

``admission.plans.build_plans`` must give exactly the reference's plans and ranks: the same ranks, micro-batches,
slices, advantages and tokens, for any G, D, budget, cost model, assignment and link model, with oversized
trajectories, gaps in ``sample_idx``, a group whose rows sit on two nodes, and groups' rows apart in the frame.
The packing alone, and the planner's consumed frame, are checked the same way. The plan objects are built
without validation, so each is also checked to be what validation makes of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
import plans_reference as reference
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

import admission.planner as planner_module
from admission import AdmissionConfig, LinkModel, PlannerState, Quota, pack_micro_batches, plan
from admission.plans import Batch, build_plans
from schemas.plan import MiniBatchPlan

ROWS_SCHEMA = {"group_id": pl.String, "node": pl.String, "sample_idx": pl.Int64, "_tok": pl.Int64,
               "advantage": pl.Float64, "_bytes": pl.Int64}
HOSTS = ("h0", "h1", "h2")


@dataclass
class Inputs:
    rows: pl.DataFrame
    batches: list[Batch]
    config: AdmissionConfig


@st.composite
def links(draw: st.DrawFn, nodes: list[str], ranks: int) -> LinkModel:
    node_host = {n: draw(st.sampled_from(HOSTS)) for n in nodes if draw(st.booleans())}
    rank_host = tuple(draw(st.sampled_from(HOSTS)) for _ in range(draw(st.integers(0, ranks))))
    rate = st.sampled_from([10.0, 100.0, 1000.0])
    return LinkModel(node_host=node_host, rank_host=rank_host, up_mbit={h: draw(rate) for h in HOSTS},
                     down_mbit={h: draw(rate) for h in HOSTS}, default_mbit=draw(rate))


@st.composite
def inputs(draw: st.DrawFn) -> Inputs:
    d = draw(st.integers(1, 5))
    gmax = draw(st.integers(1, 5))
    budget = draw(st.integers(1, 400))
    nodes = [f"grpc://n{i}:8815" for i in range(draw(st.integers(1, 4)))]
    names = [f"g{draw(st.integers(0, 99)):02d}-{i}" for i in range(draw(st.integers(0, 14)))]
    rows: list[dict[str, object]] = []
    for name in names:
        size = draw(st.integers(1, gmax))
        idx = sorted(draw(st.sets(st.integers(0, 2 * gmax), min_size=size, max_size=size)))
        node, other = draw(st.sampled_from(nodes)), draw(st.sampled_from(nodes))
        moved = draw(st.integers(0, size))  # rows from here on sit on the other node
        rows += [{"group_id": name, "node": node if j < moved else other, "sample_idx": s,
                  "_tok": draw(st.integers(0, 2 * budget)), "advantage": draw(st.floats(-3.0, 3.0)),
                  "_bytes": draw(st.integers(0, 10**6))} for j, s in enumerate(idx)]
    frame = pl.DataFrame(rows, schema=ROWS_SCHEMA)
    if draw(st.booleans()):
        frame = frame.sort(["group_id", "sample_idx"])
    else:  # groups' rows apart and out of sample order
        frame = frame[draw(st.permutations(range(frame.height)))]
    order = draw(st.permutations(names))
    cuts = sorted(draw(st.lists(st.integers(0, len(order)), min_size=1, max_size=3)))
    parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    batches: list[Batch] = [(s, s // 2, s % 2, list(p)) for s, p in enumerate(parts)]
    config = AdmissionConfig(train_batch_groups=d, group_size=gmax, dp_ranks=d, token_budget=budget,
                             cost_model=draw(st.sampled_from(["tokens", "sq_tokens"])),
                             assignment=draw(st.sampled_from(["links", "tokens"])), links=draw(links(nodes, d)))
    return Inputs(rows=frame, batches=batches, config=config)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(inputs())
def test_build_plans_is_the_reference(x: Inputs) -> None:
    plans, rank_of = build_plans(x.rows, x.batches, x.config)
    want_plans, want_rank_of = reference.build_plans(x.rows, x.batches, x.config)
    assert rank_of == want_rank_of
    assert [p.model_dump() for p in plans] == [p.model_dump() for p in want_plans]
    assert plans == want_plans
    for p in plans:  # built unvalidated: each is what validation makes of it
        assert MiniBatchPlan.model_validate_json(p.model_dump_json()) == p
        assert p.model_fields_set == set(MiniBatchPlan.model_fields)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 300), max_size=14), max_size=6), st.integers(1, 200))
def test_packing_is_the_reference(rank_tokens: list[list[int]], budget: int) -> None:
    arrays = [np.array(t, dtype=np.int64) for t in rank_tokens]
    assert pack_micro_batches(arrays, budget) == reference.pack_micro_batches(arrays, budget)


def test_packing_splits_and_pads() -> None:
    # rank 0 packs into three micro-batches; rank 1's two trajectories split into two; rank 2 pads with empties
    packed = pack_micro_batches([np.array([90, 80, 70]), np.array([10, 20]), np.array([500])], 100)
    assert packed == [[([0], False), ([1], False), ([2], False)], [([1], False), ([0], False), ([], False)],
                      [([0], True), ([], False), ([], False)]]


def test_build_plans_names_a_negative_sample_idx() -> None:
    rows = pl.DataFrame([{"group_id": "g7", "node": "n", "sample_idx": -1, "_tok": 3, "advantage": 0.0,
                          "_bytes": 1}], schema=ROWS_SCHEMA)
    with pytest.raises(ValueError, match=r"'g7'.*sample_idx -1"):
        build_plans(rows, [(0, 0, 0, ["g7"])], AdmissionConfig(train_batch_groups=1, group_size=1))


@st.composite
def frames(draw: st.DrawFn) -> tuple[pl.DataFrame, AdmissionConfig]:
    k = draw(st.sampled_from([1, 2]))
    d = draw(st.integers(1, 3))
    b = k * draw(st.integers(d, 4))
    g = draw(st.integers(1, 4))
    quotas = (Quota(column="data_source", counts={"a": (ca := draw(st.integers(0, b))), "b": b - ca}),)
    config = AdmissionConfig(train_batch_groups=b, group_size=g, mini_batches=k, dp_ranks=d,
                             token_budget=draw(st.integers(20, 600)), policy=draw(st.sampled_from(
                                 ["mini_batch", "train_batch", "streaming"])),
                             quotas=quotas if draw(st.booleans()) else (),
                             assignment=draw(st.sampled_from(["links", "tokens"])))
    rows: list[dict[str, object]] = []
    for i in range(draw(st.integers(0, 3 * b))):
        src, home = draw(st.sampled_from(["a", "b"])), draw(st.integers(0, 3))
        lens = [draw(st.integers(1, 300)) for _ in range(g)]
        again = [home, (home + draw(st.integers(1, 3))) % 4] if draw(st.integers(0, 4)) == 0 else [home]  # routed again
        rows += [{"node": f"n{n}", "group_id": f"g{i:03d}", "sample_idx": j, "policy_version": 0, "data_source": src,
                  "prompt_len": 5, "response_len": lens[j], "reward": float(draw(st.integers(0, 3))),
                  "status": "completed", "bytes": 10 * lens[j]} for n in again for j in range(g)]
    meta = pl.DataFrame(rows, schema={"node": pl.String, "group_id": pl.String, "sample_idx": pl.Int64,
                                      "policy_version": pl.Int64, "data_source": pl.String, "prompt_len": pl.Int64,
                                      "response_len": pl.Int64, "reward": pl.Float64, "status": pl.String,
                                      "bytes": pl.Int64})
    return meta[draw(st.permutations(range(meta.height)))], config


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(frames())
def test_planner_matches_the_reference_plans_and_consumed(x: tuple[pl.DataFrame, AdmissionConfig]) -> None:
    meta, config = x
    got = plan(meta, PlannerState(), config, inflight=None, current_version=3)
    with mock.patch.object(planner_module, "_plans_and_consumed", reference.plans_and_consumed):
        want = plan(meta, PlannerState(), config, inflight=None, current_version=3)
    assert got.plans == want.plans and got.state == want.state
    assert_frame_equal(got.consumed, want.consumed)
    assert_frame_equal(got.dropped, want.dropped)
