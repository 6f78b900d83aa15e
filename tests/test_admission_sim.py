"""Smoke test of the staleness simulator (bench.staleness) driving the production planner."""

from __future__ import annotations

from bench.staleness import SimParams, simulate


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
