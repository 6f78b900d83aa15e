"""Smoke test of the staleness simulator (bench.staleness) driving the production planner."""

from __future__ import annotations

from admission import PlannerState, plan
from bench.staleness import SimParams, simulate
from bench.staleness.plan_time import plan_time_metrics, scale_config, scale_frame


def test_simulator_small_workload() -> None:
    p = SimParams(groups=8, group_size=2, mini_batches=2, dp_ranks=1, train_batches=4, slots=32,
                  train_s_per_token=2e-4)
    tb = simulate(p, "train_batch", 16, 0)
    mb = simulate(p, "mini_batch", 16, 0)
    co = simulate(p, "colocated", 8, 0)
    for r in (tb, mb, co):
        assert r["quota_violations"] == 0
        assert len(r["per_step_arch_mean"]) == 8
        # every train batch holds B x G trajectories, so the run's mean is the mean of the train batches' means
        assert len(r["per_train_batch_arch_mean"]) == 4
        assert abs(sum(r["per_train_batch_arch_mean"]) / 4 - r["arch_mean"]) < 1e-9
        assert 0.0 <= r["trainer_idle_fraction"] <= 1.0 and r["throughput"] > 0
    assert co["arch_max"] == 0
    assert mb["arch_mean"] <= tb["arch_mean"]  # same lookahead: early admission is never staler here


def test_plan_time_metrics_at_scale() -> None:
    """The decision times bench.staleness reports, the scale decision admitting its one mini-batch whole."""
    m = plan_time_metrics(reps=1)
    assert set(m) == {"plan_ms_p50_100k", "plan_ms_p50_scale", "plan_ms_p50_scale_tokens"}
    assert all(v > 0 for v in m.values())
    res = plan(scale_frame(), PlannerState(), scale_config("links"), inflight=0)
    (only,) = res.plans
    assert len(only.ranks) == 512 and len(only.group_ids) == 4096
    assert res.consumed.height == 4096 * 8 and res.consumed["node"].n_unique() == 1000
    links = scale_config("links").links
    assert len({links.host_of_node(n) for n in res.consumed["node"].unique()}) == 64 + 500
