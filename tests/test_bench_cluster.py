"""bench.cluster: its link bounds, windows, deployments and cluster model (fast), and ``python -m bench.cluster
--tiny`` across real hosts (network namespaces, capped links, a multi-node Ray cluster): the result has its keys,
the coordinated and hash-placed knittrans ran on the same groups, and the bytes each path moved over the driver's
link are what each path's design says (verl's batch in and out of the driver, knittrans' payload never there)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cluster.deployment import PRESETS, NamedDeployment, dilate
from bench.cluster.model import Costs, Load, Scenario, hash_skew, scenario_point, step_s, transfer_s
from bench.cluster.report import link_bound_s, summarize
from bench.cluster.topology import ClusterShape, machine_ticks, window_of
from launcher.hosts import Host

ROOT = Path(__file__).resolve().parents[1]
MB = 1_000_000


def test_shape_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="link_mbit=0"):
        ClusterShape(n_stores=2, n_ranks=2, link_mbit=0)
    with pytest.raises(ValueError, match="n_stores=0"):
        ClusterShape(n_stores=0, n_ranks=2, link_mbit=100)
    with pytest.raises(ValueError, match="burst_kb=256"):
        ClusterShape(n_stores=2, n_ranks=2, link_mbit=100, burst_kb=256)


def test_tbf_burst_is_at_most_16_kb() -> None:
    """A host refuses a bucket that would let a small read pass unshaped, before any ``tc`` runs."""
    host = Host(None, 1, "no-such-netns", "198.18.0.1", "no-such-link")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="burst_kb=256"):
        host.shape(200.0, burst_kb=256)
    assert Host.shape.__kwdefaults__ == {"burst_kb": 16}
    assert ClusterShape(n_stores=1, n_ranks=1, link_mbit=1.0).burst_kb <= 16


def test_link_bound_is_the_busiest_link_over_the_rate() -> None:
    """Every host's link each way is a link; the bound is the most bytes any carried over the rate."""
    hosts = {"rx": [1 * MB, 3 * MB, 0], "tx": [2 * MB, 0, 5 * MB]}
    assert link_bound_s(hosts, 8.0) == pytest.approx(5.0)  # 8 Mbit/s: 1 MB/s
    hosts["rx"][1] = 7 * MB
    assert link_bound_s(hosts, 8.0) == pytest.approx(7.0)


def test_window_encloses_the_step_and_reads_the_machine_cpu() -> None:
    """A step's bytes are those between the samples enclosing it (none left out); CPU is busy over total ticks."""
    samples = [(0.0, [(0, 0), (0, 0)], (0, 0)), (1.0, [(10, 5), (0, 0)], (50, 200)),
               (2.0, [(30, 5), (4, 9)], (150, 400)), (3.0, [(30, 5), (4, 9)], (170, 600))]
    win = window_of(samples, 1.2, 1.8)
    assert win["rx"] == [20, 4] and win["tx"] == [0, 9]
    assert win["machine_cpu"] == pytest.approx(0.5)
    whole = window_of(samples, 0.5, 2.5)
    assert whole["rx"] == [30, 4] and whole["machine_cpu"] == pytest.approx(170 / 600)
    busy, total = machine_ticks()
    assert 0 <= busy <= total


def test_deployment_compute_and_dilation_keep_the_ratio() -> None:
    dep = PRESETS["qwen2.5-0.5b/h100x8/100gbit"]
    per_token = 2 * 0.494e9 * 5  # update (3 passes' worth), old log-prob, reference
    assert dep.compute_ms_per_ktok == pytest.approx(1e6 * per_token / (8 * 989e12 * 0.4))
    for link in (100.0, 400.0):
        run = dilate(dep.name, link)
        assert run.link_mbit == pytest.approx(link)
        assert run.factor == pytest.approx(100_000 / link)
        # compute x link rate is the deployment's: the share of the step the transfer can hide is kept
        assert run.compute_ms_per_ktok * run.link_mbit == pytest.approx(dep.compute_ms_per_ktok * dep.nic_mbit)
        assert run.record()["deployment"]["name"] == dep.name
    with pytest.raises(ValueError, match="unknown deployment 'gpt'"):
        dilate("gpt", 100.0)
    with pytest.raises(ValueError, match=r"mfu=1\.5"):
        NamedDeployment(name="x", params=1e9, mfu=1.5)


def test_model_transfer_is_the_link_arithmetic_plus_calls() -> None:
    costs = Costs(knit_call_s=0.01, tq_call_s=0.02, tq_lookup_s_per_key=0.001, verl_call_s=0.1,
                  controller_bytes_per_s=2 * MB, process_s_per_image=0.05)
    rate = 1 * MB
    knit = Load(busiest_link_bytes=3 * MB, micro_batches=4, images_processed=2, plan_s=0.2)
    assert transfer_s("knittrans", knit, rate, costs) == pytest.approx(3 + 0.04 + 0.1 + 0.2)
    tq = Load(busiest_link_bytes=3 * MB, micro_batches=4, keys=100)
    assert transfer_s("transferqueue", tq, rate, costs) == pytest.approx(3 + 0.08 + 0.1)
    verl = Load(busiest_link_bytes=4 * MB, driver_in_bytes=4 * MB, driver_out_bytes=4 * MB, controller_bytes=4 * MB)
    assert transfer_s("verl", verl, rate, costs) == pytest.approx(8 + 2 + 0.2)  # in, then out, then the driver
    assert step_s("verl", 2.0, 3.0, 4) == pytest.approx(5.0)
    assert step_s("knittrans", 2.0, 3.0, 4) == pytest.approx(3.5)  # only the first micro-batch's transfer shows
    assert step_s("knittrans", 4.0, 1.0, 2) == pytest.approx(4.5)  # the compute under the transfer
    with pytest.raises(ValueError, match="unknown path 'x'"):
        transfer_s("x", knit, rate, costs)


def test_hash_skew_and_extrapolation() -> None:
    assert hash_skew(10, 1) == 1.0
    assert hash_skew(4, 2) > hash_skew(400, 2) > 1.0
    assert hash_skew(1, 8) == 8.0  # never above every group on one node
    text = scenario_point(Scenario(deployment=PRESETS["qwen2.5-7b/h100x8/100gbit"], gpus=64))
    mm = scenario_point(Scenario(deployment=PRESETS["qwen2.5-vl-7b/h100x8/100gbit"], gpus=64, images_per_prompt=4))
    fast = scenario_point(Scenario(deployment=PRESETS["qwen2.5-vl-7b/h100x8/400gbit"], gpus=64, images_per_prompt=4))
    assert mm["step_vs_verl"] > text["step_vs_verl"] >= 1.0  # images per row cost the single controller most
    assert fast["transfer_s_verl"] < mm["transfer_s_verl"]
    hashed = scenario_point(Scenario(deployment=PRESETS["qwen2.5-7b/h100x8/100gbit"], gpus=64, hash_placement=True))
    assert hashed["transfer_s_knittrans"] >= text["transfer_s_knittrans"]
    with pytest.raises(ValueError, match="gpus=8"):
        Scenario(deployment=PRESETS["qwen2.5-7b/h100x8/100gbit"], gpus=8)


def _rec(transfer: float, busiest: int, **extra: object) -> dict[str, object]:
    ranks = [{"tokens": 1000, "micro_batches": 2, "bytes": busiest, "encoder_passes": 0}]
    return {"transfer_s": transfer, "step_s": transfer + 0.01, "micro_batches": 2, "driver_rx": busiest,
            "driver_tx": busiest, "rank_bytes": [busiest], "ranks": ranks, "plan_s": 0.0, "keys": 4,
            "dispatched_bytes": busiest, "hosts": {"rx": [busiest, 0], "tx": [0, busiest], "machine_cpu": 0.3},
            **extra}


def test_summary_sets_coordinated_against_hash_and_the_model_against_measurement() -> None:
    steps = {"verl": [_rec(4.0, 2 * MB)], "transferqueue": [_rec(1.2, MB)], "knittrans": [_rec(1.0, MB)],
             "knittrans_hash": [_rec(1.5, int(1.5 * MB))]}
    cal = {"knit_call_s": 1e-3, "tq_call_s": 1e-3, "tq_lookup_s_per_key": 1e-4, "verl_call_s": 1e-3,
           "controller_bytes_per_s": 1e9, "reps": 7}
    runs = [{"n": 2, "d": 1, "raw": {"calibration": cal, "workloads": {"text": {"steps": steps}}}}]
    metrics, ratios, predicted = summarize(runs, 8.0, 0.0)
    assert ratios["cluster_coordinated_vs_hash_transfer_text_n2_d1"] == pytest.approx(1.5)
    assert ratios["cluster_knittrans_transfer_vs_link_bound_text_n2_d1"] == pytest.approx(1.0)
    assert ratios["cluster_verl_transfer_vs_link_bound_text_n2_d1"] == pytest.approx(2.0)
    assert ratios["cluster_transfer_vs_verl_text_n2"] == pytest.approx(4.0)
    knit = predicted["cluster_transfer_ms_per_step_knittrans_text_n2_d1"]
    assert knit == pytest.approx(1000 + 2)  # 1 MB at 1 MB/s and two calls
    assert metrics["cluster_model_max_rel_error"] >= abs(knit - 1000) / 1000
    assert metrics["cluster_cpu_util_max"] == pytest.approx(0.3)


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
        at = f"{kind}_n2_d2"
        for key in (f"cluster_transfer_vs_verl_{kind}_n2", f"cluster_step_vs_verl_{kind}_n2",
                    f"cluster_step_vs_transferqueue_{kind}_n2", f"cluster_coordinated_vs_hash_transfer_{at}",
                    *(f"cluster_{p}_transfer_vs_link_bound_{at}" for p in ("knittrans", "transferqueue", "verl"))):
            assert ratios[key] > 0, key
        for p in ("verl", "transferqueue", "knittrans", "knittrans_hash"):
            assert metrics[f"cluster_step_ms_{p}_{at}"] > 0
            assert predicted[f"cluster_transfer_ms_per_step_{p}_{at}"] > 0
        groups = doc["raw"][0]["step_groups"][kind]
        assert all(step["knittrans"] == step["knittrans_hash"] == step["verl"] for step in groups)  # the same groups
        verl = doc["raw"][0]["steps"][kind]["verl"]
        knit_driver = metrics[f"cluster_driver_link_bytes_knittrans_{at}"]
        verl_driver = metrics[f"cluster_driver_link_bytes_verl_{at}"]
        dispatched = min(r["dispatched_bytes"] for r in verl)
        assert verl_driver > 1.8 * dispatched  # the batch came into the driver and went out again
        assert knit_driver < verl_driver / 5
        assert metrics[f"cluster_rank_bytes_total_knittrans_{at}"] > 0
    assert metrics["cluster_link_mbit"] == 200
    assert 0 < metrics["cluster_cpu_util_max"] <= 1
    assert math.isfinite(metrics["cluster_model_max_rel_error"])
    assert doc["params"]["burst_kb"] <= 16 and doc["params"]["calibration"][0]["knit_call_s"] > 0
    assert "Qwen2VLImageProcessor" in doc["params"]["images_verl_transferqueue"]
    assert out.with_suffix(".png").exists()
