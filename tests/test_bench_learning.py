"""bench.learning's figures from run folders' curves (the runs themselves take hours: the bench, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.learning import reused_runs, summarise, time_to_reach


def _run(reward: list[float], wall: list[float], staleness: float) -> dict[str, object]:
    return {"reward": reward, "wall_s": wall, "arch_staleness_mean": staleness,
            "offpolicy": {"is_weight_mean": 1.0, "token_staleness_mean": staleness}}


def test_time_to_train_batch_s_final_reward_on_a_moving_average_and_the_gap_colocated_closes() -> None:
    runs = {
        "train_batch": [_run([0.1] * 5 + [0.3] * 5, [10.0 * (b + 1) for b in range(10)], 1.5),
                        _run([0.1] * 6 + [0.5] * 4, [12.0 * (b + 1) for b in range(10)], 1.5)],
        "mini_batch_decoupled": [_run([0.1, 0.4] + [0.5] * 8, [8.0 * (b + 1) for b in range(10)], 0.5),
                                 _run([0.2] * 10, [8.0 * (b + 1) for b in range(10)], 0.5)],
        "colocated": [_run([0.5] * 10, [20.0 * (b + 1) for b in range(10)], 0.0),
                      _run([0.5] * 10, [20.0 * (b + 1) for b in range(10)], 0.0)],
    }
    metrics, ratios = summarise(runs)
    base = metrics["train_batch"]
    assert base["final_reward"] == pytest.approx((0.3 * 5 + 0.1 + 0.5 * 4) / 10)  # the last 5, seed-mean
    # the mean of the last five first reaches the seed's final: seed 0's 0.3 at batch 10 (100 s), seed 1's
    # (0.1 + 4 * 0.5) / 5 = 0.42 at batch 10 too (120 s); a single batch of 0.5 at batch 7 does not count
    assert base["time_to_train_batch_final_s"] == pytest.approx(110.0)
    fast = metrics["mini_batch_decoupled"]  # seed 0's first full window (batches 1-5) averages 0.4 >= 0.3: 40 s
    assert fast["seeds_reaching_train_batch_final"] == 1 and fast["time_to_train_batch_final_s"] == 40.0
    gap = (fast["final_reward"] - base["final_reward"]) / (0.5 - base["final_reward"])
    assert base["mean_reward"] == pytest.approx((0.1 * 5 + 0.3 * 5 + 0.1 * 6 + 0.5 * 4) / 20)
    assert fast["mean_reward"] == pytest.approx((0.1 + 0.4 + 0.5 * 8 + 0.2 * 10) / 20)
    whole = (fast["mean_reward"] - base["mean_reward"]) / (0.5 - base["mean_reward"])
    # its median over the seeds that reached it (seed 0), against train_batch's on the same seeds (100 s)
    assert ratios == {"mini_batch_decoupled_time_to_reward_vs_train_batch": round(40.0 / 100.0, 4),
                      "colocated_time_to_reward_vs_train_batch": round(100.0 / 110.0, 4),
                      "mini_batch_decoupled_final_reward_gap_closed_vs_colocated": round(gap, 4),
                      "mini_batch_decoupled_mean_reward_gap_closed_vs_colocated": round(whole, 4)}
    assert metrics["colocated"]["final_reward_gap_to_train_batch_per_seed"] == [0.2, 0.08]
    assert fast["offpolicy"]["token_staleness_mean"] == [0.5, 0.5]
    # where the seeds disagree on which end is ahead, no share of the gap is given
    runs["colocated"][1] = _run([0.5] * 5 + [0.4] * 5, [20.0 * (b + 1) for b in range(10)], 0.0)
    metrics, ratios = summarise(runs)
    assert metrics["colocated"]["final_reward_gap_to_train_batch_per_seed"] == [0.2, -0.02]
    assert "mini_batch_decoupled_final_reward_gap_closed_vs_colocated" not in ratios
    assert "mini_batch_decoupled_mean_reward_gap_closed_vs_colocated" in ratios  # 0.3 and 0.19: both ahead
    assert time_to_reach(runs["train_batch"][0], 0.9) is None


def test_reused_runs_are_taken_from_an_earlier_result_of_the_same_length(tmp_path: Path) -> None:
    record = _run([0.1, 0.2], [10.0, 20.0], 1.0)
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"params": {"train_batches": 2}, "per_run": {"train_batch-s0": record},
                                   "task_success_before": {"add_small_success": 0.3}}))
    records, before = reused_runs([earlier], 2)
    assert records == {"train_batch-s0": record} and before == {"add_small_success": 0.3}
    with pytest.raises(ValueError, match="ran 2 train batches, this invocation 30"):
        reused_runs([earlier], 30)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"params": {"train_batches": 2}, "metrics": {}}))
    with pytest.raises(ValueError, match="no per-run records"):
        reused_runs([bare], 2)
