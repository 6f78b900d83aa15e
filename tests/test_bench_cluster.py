"""``python -m bench.cluster --tiny``: the three paths across real hosts (network namespaces, capped links, a
multi-node Ray cluster); the result has its keys, and the bytes each path moved over the driver's link
are what each path's design says (verl's batch in and out of the driver, knittrans' payload never there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cluster.report import PATHS, predict
from bench.cluster.topology import ClusterShape

ROOT = Path(__file__).resolve().parents[1]


def test_shape_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="link_mbit=0"):
        ClusterShape(n_stores=2, n_ranks=2, link_mbit=0)
    with pytest.raises(ValueError, match="n_stores=0"):
        ClusterShape(n_stores=0, n_ranks=2, link_mbit=100)


def test_prediction_is_the_link_arithmetic() -> None:
    """verl: the batch in and out of the driver; the others: the busiest of a rank's and a store's share."""
    mb = 1_000_000
    raw = {"micro_batches_per_rank": [2, 2], "tokens_per_step": [0, 0], "verl_rollout_bytes": [0, 10 * mb],
           "steps": {"verl": [{"dispatched_bytes": 12 * mb}],
                     "transferqueue": [{"rank_bytes": [3 * mb, 5 * mb]}],
                     "knittrans": [{"rank_bytes": [1 * mb, 1 * mb]}]}}
    pred = predict(raw, 2, 8.0, 0.0, 2)  # 8 Mbit/s: 1 MB/s
    assert pred["transfer_ms_verl"] == pytest.approx(22_000)
    assert pred["transfer_ms_transferqueue"] == pytest.approx(5_000)
    assert pred["transfer_ms_knittrans"] == pytest.approx(1_000)
    assert pred["step_ms_knittrans"] == pytest.approx(1_000)  # no compute: the transfer is the step


@pytest.mark.hosts
@pytest.mark.ray
@pytest.mark.slow
def test_tiny_cluster_run_keys_and_driver_bytes(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    subprocess.run([sys.executable, "-m", "bench.cluster", "--tiny", "--out", str(out)], cwd=ROOT, check=True,
                   timeout=900, capture_output=True)
    doc = json.loads(out.read_text())
    ratios, metrics, predicted = doc["ratios"], doc["metrics"], doc["predicted"]
    for kind in ("text", "mm"):
        for key in (f"cluster_transfer_vs_verl_{kind}_n2", f"cluster_step_vs_verl_{kind}_n2",
                    f"cluster_step_vs_transferqueue_{kind}_n2"):
            assert ratios[key] > 0 and predicted[key] > 0
        for p in PATHS:
            assert metrics[f"cluster_step_ms_{p}_{kind}_n2_d2"] > 0
        verl = [r for r in doc["raw"][0]["steps"][kind]["verl"]]
        knit_driver = metrics[f"cluster_driver_link_bytes_knittrans_{kind}_n2_d2"]
        verl_driver = metrics[f"cluster_driver_link_bytes_verl_{kind}_n2_d2"]
        dispatched = min(r["dispatched_bytes"] for r in verl)
        assert verl_driver > 1.8 * dispatched  # the batch came into the driver and went out again
        assert knit_driver < metrics[f"cluster_rank_bytes_total_knittrans_{kind}_n2_d2"]  # no payload via the driver
        assert knit_driver < verl_driver / 5
        assert metrics[f"cluster_rank_bytes_total_knittrans_{kind}_n2_d2"] > 0
    assert metrics["cluster_link_mbit"] == 200
    assert 0 < metrics["cluster_cpu_util_max"] <= 1
    assert out.with_suffix(".png").exists()
