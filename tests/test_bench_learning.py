"""bench.learning's figures from run folders' curves (the runs themselves take hours: the bench, not a test)."""

from __future__ import annotations

import pytest

from bench.learning import summarise, time_to_reach


def _run(reward: list[float], wall: list[float], staleness: float) -> dict[str, object]:
    return {"reward": reward, "wall_s": wall, "arch_staleness_mean": staleness,
            "offpolicy": {"is_weight_mean": 1.0, "token_staleness_mean": staleness}}


def test_time_to_train_batch_s_final_reward_and_its_ratio() -> None:
    runs = {
        "train_batch": [_run([0.1] * 5 + [0.3] * 5, [10.0 * (b + 1) for b in range(10)], 1.5),
                        _run([0.1] * 6 + [0.5] * 4, [12.0 * (b + 1) for b in range(10)], 1.5)],
        "mini_batch_decoupled": [_run([0.1, 0.4] + [0.5] * 8, [8.0 * (b + 1) for b in range(10)], 0.5),
                                 _run([0.2] * 10, [8.0 * (b + 1) for b in range(10)], 0.5)],
    }
    metrics, ratios = summarise(runs)
    base = metrics["train_batch"]
    assert base["final_reward"] == pytest.approx((0.3 * 5 + 0.1 + 0.5 * 4) / 10)  # the last 5, seed-mean
    # seed 0 reaches its final 0.3 at batch 5 (60 s); seed 1 reaches (0.1 + 4 * 0.5) / 5 = 0.42 at batch 6 (84 s)
    assert base["time_to_train_batch_final_s"] == pytest.approx(72.0)
    fast = metrics["mini_batch_decoupled"]
    assert fast["seeds_reaching_train_batch_final"] == 1 and fast["time_to_train_batch_final_s"] == 16.0
    assert ratios == {"mini_batch_decoupled_time_to_reward_vs_train_batch": round(16.0 / 72.0, 4)}
    assert fast["offpolicy"]["token_staleness_mean"] == [0.5, 0.5]
    assert time_to_reach(runs["train_batch"][0], 0.9) is None
