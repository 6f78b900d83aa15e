"""Unit tests of admission: config validation, feasibility, packing, advantages, policies, plan wire form."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_series_equal

from admission import (
    AdmissionConfig,
    Filters,
    Planner,
    PlannerState,
    Quota,
    balance_groups,
    pack_micro_batches,
    plan,
    solve_composition,
)
from schemas.plan import MiniBatchPlan

QUOTA = (Quota(column="data_source", counts={"math": 2, "chat": 2}),)


def rows(gid: str, src: str, *, g: int = 2, version: int = 0, lens: list[int] | None = None,
         rewards: list[float] | None = None, status: str = "completed", node: str = "n0",
         finish: str = "stop") -> list[dict[str, object]]:
    lens = lens or [10] * g
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(g)]
    return [{"node": node, "group_id": gid, "sample_idx": i, "policy_version": version,
             "policy_version_min": version, "data_source": src, "prompt_len": 5, "response_len": lens[i],
             "reward": rewards[i], "finish_reason": finish, "status": status if i == 0 else "completed"}
            for i in range(g)]


def frame(*groups: list[dict[str, object]]) -> pl.DataFrame:
    data = [r for grp in groups for r in grp]
    return pl.DataFrame(data).with_columns(pl.int_range(pl.len(), dtype=pl.Int64).alias("seq"))


def cfg(**kw: object) -> AdmissionConfig:
    base: dict[str, object] = {"train_batch_groups": 4, "group_size": 2, "mini_batches": 2, "dp_ranks": 1,
                               "quotas": QUOTA}
    base.update(kw)
    return AdmissionConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "needle"), [
    ({"mini_batches": 3}, "mini_batches=3"),
    ({"dp_ranks": 3}, "dp_ranks=3"),
    ({"group_size": 0}, "group_size"),
    ({"policy": "eager"}, "'eager'"),
    ({"cost_model": "flops"}, "'flops'"),
    ({"max_staleness": -1}, "-1"),
    ({"quotas": (Quota(column="data_source", counts={"math": 1, "chat": 2}),)}, "sum to 3"),
    ({"quotas": (Quota(column="data_source", shares={"math": 0.3, "chat": 0.7}),)}, "0.3"),
])
def test_config_errors_name_the_value(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        cfg(**kw)


def test_quota_needs_counts_or_shares() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Quota(column="data_source")
    with pytest.raises(ValueError, match="sum to"):
        Quota(column="data_source", shares={"a": 0.5})
    assert cfg(quotas=(Quota(column="data_source", shares={"math": .5, "chat": .5}),)).quota_counts() == [
        {"math": 2, "chat": 2}]


def test_feasibility_blocks_quota_breaking_composition() -> None:
    # classes: 0 = math, 1 = chat; 2 chat completed, 0 math completed; 1 math in flight
    kw = {"class_values": np.array([[0], [1]]), "total": 4, "size": 2}
    need = [np.array([2, 2])]
    assert solve_composition(avail=np.array([0, 2]), supply=np.array([1, 0]), need=need, **kw) is None
    x = solve_composition(avail=np.array([0, 2]), supply=np.array([2, 0]), need=need, **kw)
    assert x is not None and x.tolist() == [0, 2]
    # over-consuming chat is impossible
    assert solve_composition(avail=np.array([0, 3]), supply=np.array([5, 0]), need=[np.array([3, 1])],
                             **kw) is None


def test_feasibility_two_quotas_interact() -> None:
    # classes (src, level): (a,x) (b,y) available; quotas a:1 b:1, x:0 y:2 -> (a,x) is never allowed
    cv = np.array([[0, 0], [1, 1], [0, 1]])
    need = [np.array([1, 1]), np.array([0, 2])]
    x = solve_composition(avail=np.array([1, 1, 0]), supply=np.array([0, 0, 1]), class_values=cv, need=need,
                          total=2, size=1)
    assert x is not None and x.tolist() == [0, 1, 0]
    assert solve_composition(avail=np.array([1, 0, 0]), supply=np.array([0, 5, 0]), class_values=cv, need=need,
                             total=2, size=1) is None


def test_balance_and_packing() -> None:
    split = balance_groups(np.array([10.0, 9, 8, 1, 1, 1]), 2)
    loads = sorted(sum([10.0, 9, 8, 1, 1, 1][i] for i in r) for r in split)
    assert loads == [13.0, 17.0]  # optimal for this instance (no subset sums to 15)
    assert all(balance_groups(np.ones(5), 4))  # every rank gets a group
    packed = pack_micro_batches([np.array([50, 50, 50, 50]), np.array([10, 10]), np.array([500])], 100)
    assert [len(p) for p in packed] == [2, 2, 2]
    assert packed[2][0] == ([0], True) and packed[2][1] == ([], False)  # one trajectory, padded
    assert all(not o for _, o in packed[1])


def test_mini_batch_admits_early_but_keeps_quota() -> None:
    c = cfg()
    meta = frame(rows("c1", "chat"), rows("c2", "chat"))
    # only one math group still in flight: two chat now would leave math 2 unreachable
    res = plan(meta, PlannerState(), c, inflight={"math": 1, "chat": 0})
    assert res.plans == []
    res = plan(meta, PlannerState(), c, inflight={"math": 2})
    assert [sorted(p.group_ids) for p in res.plans] == [["c1", "c2"]]
    assert res.state.position == 1 and res.state.used() == {("data_source", "chat"): 2}
    # the next mini-batch may only be math
    meta2 = pl.concat([meta, frame(rows("c3", "chat"), rows("m1", "math"))])
    res2 = plan(meta2, res.state, c, inflight={"math": 1})
    assert res2.plans == []
    meta3 = pl.concat([meta2, frame(rows("m2", "math"))])
    res3 = plan(meta3, res.state, c, inflight={})
    assert [sorted(p.group_ids) for p in res3.plans] == [["m1", "m2"]]
    assert res3.state.train_batch == 1 and res3.state.position == 0 and res3.state.used() == {}


def test_train_batch_waits_for_whole_batch() -> None:
    c = cfg(policy="train_batch")
    g = [rows("c1", "chat"), rows("c2", "chat"), rows("m1", "math")]
    assert plan(frame(*g), PlannerState(), c, inflight={"math": 5}).plans == []
    res = plan(frame(*g, rows("m2", "math")), PlannerState(), c)
    assert [p.step for p in res.plans] == [0, 1]
    assert sorted(x for p in res.plans for x in p.group_ids) == ["c1", "c2", "m1", "m2"]


def test_colocated_only_fresh_versions() -> None:
    c = cfg(policy="colocated", quotas=())
    p = Planner(c)
    assert len(p.update(frame(*(rows(f"g{i}", "chat") for i in range(4))))) == 2
    # train batch 1 needs version >= 2: version-1 groups are stale
    p.update(frame(*(rows(f"h{i}", "chat", version=1) for i in range(4))))
    assert set(p.dropped_frame().filter(pl.col("reason") == "stale")["group_id"]) == {f"h{i}" for i in range(4)}
    assert len(p.update(frame(*(rows(f"k{i}", "chat", version=2) for i in range(4))))) == 2
    assert p.staleness_report()["run"]["arch_max"] == 0


def test_drops_aborted_filtered_unmatched() -> None:
    c = cfg(filters=Filters(drop_uniform_reward=True, drop_finish_reasons=frozenset({"length"})))
    meta = frame(rows("ab", "chat", status="aborted"), rows("uni", "chat", rewards=[1.0, 1.0]),
                 rows("len", "math", finish="length"), rows("odd", "code"), rows("part", "math", g=1))
    res = plan(meta, PlannerState(), c, inflight={"math": 4, "chat": 4})
    reasons = dict(res.dropped.select("group_id", "reason").iter_rows())
    assert reasons == {"ab": "aborted", "uni": "uniform_reward", "len": "finish_reason", "odd": "unmatched",
                       "part": "size"}  # a group is written whole: fewer rows than G is final
    assert res.state.dropped == frozenset(reasons)


def test_a_group_of_the_wrong_size_is_dropped_and_repeated_rows_are_an_error() -> None:
    res = plan(frame(rows("x", "chat", g=3)), PlannerState(), cfg(), inflight={"math": 4})
    assert dict(res.dropped.select("group_id", "reason").iter_rows()) == {"x": "size"}
    twice = frame(rows("y", "chat")).with_columns(pl.lit(0, dtype=pl.Int32).alias("sample_idx"))
    with pytest.raises(ValueError, match="'y' has 2 rows but 1 distinct sample_idx"):
        plan(twice, PlannerState(), cfg(), inflight={"math": 4})


def test_missing_column_is_named() -> None:
    with pytest.raises(ValueError, match="data_source"):
        plan(frame(rows("x", "chat")).drop("data_source"), PlannerState(), cfg())


def test_advantages_group_normalised_and_in_slice_order() -> None:
    c = cfg(quotas=(), mini_batches=1, train_batch_groups=1, group_size=4, token_budget=1000)
    meta = frame(rows("g", "chat", g=4, rewards=[1.0, 0.0, 0.0, 1.0]))
    res = plan(meta, PlannerState(), c)
    mb = res.plans[0].ranks[0].micro_batches[0]
    r = np.array([1.0, 0.0, 0.0, 1.0])
    expect = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    assert [(s.start, s.stop) for s in mb.slices] == [(0, 4)]
    np.testing.assert_allclose(mb.advantages, expect, rtol=1e-6)
    assert_series_equal(res.consumed["advantage"], pl.Series("advantage", expect), check_exact=False)


def test_token_budget_split_and_oversized_flag() -> None:
    c = cfg(quotas=(), mini_batches=1, train_batch_groups=2, group_size=3, dp_ranks=2, token_budget=40)
    meta = frame(rows("a", "chat", g=3, lens=[30, 30, 100]), rows("b", "chat", g=3, lens=[5, 5, 5]))
    p = plan(meta, PlannerState(), c).plans[0]
    counts = {len(r.micro_batches) for r in p.ranks}
    assert counts == {3}
    over = [mb for r in p.ranks for mb in r.micro_batches if mb.oversized]
    assert len(over) == 1 and over[0].rows == 1 and over[0].tokens == 105
    assert all(mb.tokens <= 40 for r in p.ranks for mb in r.micro_batches if not mb.oversized)


def test_staleness_accounting() -> None:
    c = cfg(quotas=(), mini_batches=2, train_batch_groups=2)
    p = Planner(c)
    p.update(frame(rows("a", "chat", version=0), rows("b", "chat", version=0)))  # t=0: steps 0, 1
    p.update(frame(rows("c", "chat", version=0, lens=[30, 30]), rows("d", "chat", version=3)))  # t=1, tK=2
    con = p.consumed_frame().sort("group_id", "sample_idx")
    assert con["step"].to_list() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert con["arch_staleness"].to_list() == [0, 0, 0, 0, 2, 2, 0, 0]
    assert con["signed_staleness"].to_list() == [0, 0, 0, 0, 2, 2, -1, -1]
    run = p.staleness_report()["run"]
    assert run["arch_mean"] == pytest.approx(0.5)
    assert run["arch_token_weighted"] == pytest.approx(2 * 60 / (60 + 60))
    assert run["arch_max"] == 2 and run["signed_mean"] == pytest.approx(0.25)


def test_staleness_bound_drops_old_groups() -> None:
    c = cfg(quotas=(), mini_batches=1, train_batch_groups=1, max_staleness=1)
    st = PlannerState(train_batch=5)
    res = plan(frame(rows("old", "chat", version=3), rows("ok", "chat", version=4)), st, c)
    assert [p.group_ids for p in res.plans] == [["ok"]]
    assert res.dropped.row(0, named=True)["reason"] == "stale"


def test_plan_round_trips_on_the_wire() -> None:
    c = cfg(dp_ranks=2)
    meta = frame(rows("c1", "chat", node="n1"), rows("c2", "chat", node="n2"))
    p = plan(meta, PlannerState(), c, inflight={"math": 2}).plans[0]
    back = MiniBatchPlan.model_validate_json(p.model_dump_json())
    assert back == p
    assert {s.node for r in back.ranks for mb in r.micro_batches for s in mb.slices} == {"n1", "n2"}


def test_state_round_trip_and_purity() -> None:
    c = cfg()
    meta = frame(rows("c1", "chat"), rows("c2", "chat"))
    snapshot = meta.clone()
    st = PlannerState()
    res = plan(meta, st, c, inflight={"math": 2})
    assert st == PlannerState() and meta.equals(snapshot)
    assert PlannerState.from_dict(res.state.to_dict()) == res.state
    again = plan(meta, res.state, c, inflight={"math": 2})
    assert again.plans == []  # admitted groups are never admitted again


def test_forget_and_drain_leave_the_planner_holding_nothing_per_settled_group() -> None:
    c = cfg()
    p = Planner(c)
    meta = frame(rows("c1", "chat"), rows("c2", "chat"), rows("x", "chat", status="aborted"))
    assert [pl_.group_ids for pl_ in p.update(meta, inflight={"math": 2})] == [["c1", "c2"]]
    state = p.state
    assert state.admitted == {"c1", "c2"} and state.dropped == {"x"}
    consumed, dropped = p.drain()
    assert consumed.height == 4 and dropped["group_id"].to_list() == ["x"]
    assert p.consumed_frame().height == 0 and p.dropped_frame().height == 0
    p.forget(["c1", "x", "never-seen"])
    assert p.state.admitted == {"c2"} and p.state.dropped == frozenset()
    assert (p.state.train_batch, p.state.position, p.state.quota_used) == (
        state.train_batch, state.position, state.quota_used)  # only the ids go
    assert PlannerState.from_dict(p.state.to_dict()) == p.state
    assert p.update(meta.filter(pl.col("group_id") == "c2"), inflight={"math": 2}) == []  # remembered: ignored


def test_inflight_as_frame() -> None:
    c = cfg()
    meta = frame(rows("c1", "chat"), rows("c2", "chat"))
    fl = pl.DataFrame({"data_source": ["math", "math"]})
    assert len(plan(meta, PlannerState(), c, inflight=fl).plans) == 1
    with pytest.raises(ValueError, match="per-class"):
        plan(meta, PlannerState(), c, inflight=3)


def test_plan_over_100k_rows_admits_only_new_groups_on_quota() -> None:
    """At the scale of a long run (100k rows, all but 20 groups admitted) the one plan takes only new groups,
    whole, half of each source, split over both ranks. Its decision time is measured by bench.staleness."""
    rng = np.random.default_rng(0)
    n, g = 100_000, 8
    ng = n // g
    meta = pl.DataFrame({
        "seq": np.arange(n), "node": np.full(n, "n0"),
        "group_id": np.repeat(np.array([f"g{i:06d}" for i in range(ng)]), g),
        "sample_idx": np.tile(np.arange(g, dtype=np.int32), ng),
        "policy_version": np.repeat(np.arange(ng) // 64, g),
        "data_source": np.repeat(rng.choice(["math", "chat"], ng), g),
        "prompt_len": np.full(n, 100, dtype=np.int32), "response_len": rng.integers(50, 4000, n).astype(np.int32),
        "reward": rng.random(n), "status": np.full(n, "completed"),
    })
    c = AdmissionConfig(train_batch_groups=64, group_size=8, mini_batches=4, dp_ranks=2,
                        quotas=(Quota(column="data_source", shares={"math": .5, "chat": .5}),))
    st = PlannerState(train_batch=190, admitted=frozenset(f"g{i:06d}" for i in range(ng - 20)))
    res = plan(meta, st, c, inflight={"math": 64, "chat": 64}, current_version=760)
    assert len(res.plans) == 1 and res.dropped.is_empty()
    taken = set(res.plans[0].group_ids)
    assert len(taken) == 16 and not taken & st.admitted  # one mini-batch (64 / 4) of the 20 new groups
    assert res.state.admitted == st.admitted | taken
    assert dict(res.consumed.group_by("data_source").len().iter_rows()) == {"math": 8 * 8, "chat": 8 * 8}
    assert {r.dp_rank for r in res.plans[0].ranks} == {0, 1}


def test_unknown_inflight_only_refuses_quota_overruns() -> None:
    c = cfg()
    meta = frame(rows("c1", "chat"), rows("c2", "chat"))
    res = plan(meta, PlannerState(), c)  # inflight=None: supply unknown, assumed unbounded
    assert [sorted(p.group_ids) for p in res.plans] == [["c1", "c2"]]
    meta2 = pl.concat([meta, frame(rows("c3", "chat"), rows("m1", "math"))])
    assert plan(meta2, res.state, c).plans == []  # chat quota is full
    # without quotas nothing can be overrun: one completed mini-batch is admitted at once
    p = Planner(cfg(quotas=(), mini_batches=2))
    assert len(p.update(frame(rows("a", "x"), rows("b", "y")))) == 1


def test_staleness_splits_into_generation_span_and_architectural() -> None:
    # train batch 1 (tK = 2) takes rows started at v0 and finished at v1 or v2
    p = Planner(cfg(policy="mini_batch", quotas=()))
    assert len(p.update(frame(*(rows(f"g{i}", "chat") for i in range(4))), current_version=0)) == 2
    late = [rows(f"h{i}", "chat", version=1 + (i % 2)) for i in range(4)]
    for grp in late:
        for r in grp:
            r["policy_version_min"] = 0  # the first tokens came from v0, the last from v1 or v2
    assert len(p.update(frame(*late), current_version=2)) == 2
    c = p.consumed_frame().filter(pl.col("train_batch") == 1).sort("group_id")
    assert c["generation_span"].to_list() == [1, 1, 2, 2, 1, 1, 2, 2]
    assert c["arch_staleness"].to_list() == [1, 1, 0, 0, 1, 1, 0, 0]  # tK = 2: 2 - v, clipped at 0
    assert (c["total_staleness"] == c["arch_staleness"] + c["generation_span"]).all()
    run = p.staleness_report()["run"]
    assert run["span_max"] == 2 and run["span_mean"] == 0.75 and run["total_mean"] == 0.75 + run["arch_mean"]


def test_streaming_admits_in_completion_order_whatever_the_quota() -> None:
    p = Planner(cfg(policy="streaming"))  # the 50/50 math/chat quota is configured, and ignored
    plans = p.update(frame(*(rows(f"c{i}", "chat") for i in range(3)), rows("m0", "math"), rows("c3", "chat")))
    assert [pl_.group_ids for pl_ in plans] == [["c0", "c1"], ["c2", "m0"]]  # m = 2, earliest completed first
    c = p.consumed_frame()
    counts = dict(c.group_by("data_source").agg(pl.col("group_id").n_unique()).iter_rows())
    assert counts == {"chat": 3, "math": 1}  # train batch 0 breaks the 2 + 2 quota
    assert [pl_.group_ids for pl_ in p.update(frame(rows("c3", "chat"), rows("c4", "chat")))] == [["c3", "c4"]]
    mb = Planner(cfg(policy="mini_batch"))  # the same supply under the quota: chat waits for math
    assert [pl_.group_ids for pl_ in mb.update(frame(*(rows(f"c{i}", "chat") for i in range(3)),
                                                     rows("m0", "math"), rows("c3", "chat")))] == [["c0", "m0"]]
