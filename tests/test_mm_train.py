"""Multimodal end to end: images by reference in real stores, fetched once per mini-batch, Megatron in subprocesses.

* in-process (real Flight servers, no Megatron): ``fetch_mm_mini_batch`` DoGets each distinct image
  of a rank's mini-batch exactly once, from the node of the group referencing it, and the stores
  hold each image once whatever the group size;
* ``python -m train.mm_model`` (one Megatron rank, gloo): the CLIPViTModel encoder's gradients through
  ``DedupVisionEncoder`` equal those of per-reference encoding (fp32, rtol 1e-5), one pass per
  distinct image;
* ``python -m train --config FILE --nproc 2`` with ``TrainConfig.vision`` set (DP=2, gloo): the
  backbone and the encoder train,
  encoder passes equal the distinct images of each rank's mini-batch, the reduced encoder gradients
  and the encoder weights are identical on both ranks, and the stores free every image on release;
  the same run with ``VisionConfig(dedup=False)`` (every reference encoded) gives the same losses and, from the
  same initial weights, the same encoder gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from admission import AdmissionConfig
from schemas import documents
from schemas.images import images_to_table
from schemas.plan import MicroBatch, PlannedSlice
from schemas.records import TrajectoryRecord, records_to_batch

ROOT = Path(__file__).resolve().parents[1]
GROUPS, G, PROMPT, RESPONSE, VOCAB, IMG = 12, 4, 6, 10, 128, 28
STEPS = 6  # train_batch_groups=4, mini_batches=2 -> 2 groups per step, one per DP rank


def _groups(client: Any, n_groups: int) -> dict[str, tuple[str, list[bytes]]]:
    from flight_store.writing import StoreWriter

    with StoreWriter.sharing(client) as writer:
        return _write_groups(writer, n_groups)


def _write_groups(client: Any, n_groups: int) -> dict[str, tuple[str, list[bytes]]]:
    """Write ``n_groups`` groups: 1-2 images each (group 2k+1 shares one image with group 2k); same tokens."""
    rng = np.random.default_rng(0)
    base = [(rng.integers(1, VOCAB, PROMPT).tolist(), rng.integers(1, VOCAB, RESPONSE).tolist()) for _ in range(G)]
    out: dict[str, tuple[str, list[bytes]]] = {}
    shared: np.ndarray | None = None
    for g in range(n_groups):
        gid = f"g{g:02d}"
        own = rng.integers(0, 256, (3, IMG, IMG), dtype=np.uint8)
        if g % 2 == 0:
            shared = rng.integers(0, 256, (3, IMG, IMG), dtype=np.uint8)
        assert shared is not None
        imgs = [own] if g % 3 == 0 else [own, shared]
        node = client.node_for(gid)
        table, keys = images_to_table(imgs)
        client.put_images(table, node=node)
        batch = records_to_batch([
            TrajectoryRecord(group_id=gid, sample_idx=i, policy_version=0, prompt_ids=p, response_ids=r,
                             response_logprobs=[-float(np.log(VOCAB))] * RESPONSE, reward=float(i % 2),
                             image_keys=keys)
            for i, (p, r) in enumerate(base)
        ])
        assert client.put_group(batch, node=node) == node
        out[gid] = (node, keys)
    return out


@pytest.fixture
def stores() -> Any:
    client, servers = _servers()
    try:
        yield client
    finally:
        client.close()
        for s in servers:
            s.shutdown()


def test_mini_batch_fetches_each_distinct_image_once(stores: Any) -> None:
    from train.mm_data import fetch_mm_mini_batch

    groups = _groups(stores, 4)
    assert sum(s.images for s in stores.stats().values()) == len({k for _, ks in groups.values() for k in ks})
    # two micro-batches over groups g00..g03, rows split across micro-batches (g01 in both)
    gids = sorted(groups)
    mbs = [MicroBatch(slices=[PlannedSlice(node=groups[gids[0]][0], group_id=gids[0], start=0, stop=G),
                              PlannedSlice(node=groups[gids[1]][0], group_id=gids[1], start=0, stop=2)],
                      advantages=[0.5] * (G + 2)),
           MicroBatch(slices=[PlannedSlice(node=groups[gids[1]][0], group_id=gids[1], start=2, stop=G),
                              PlannedSlice(node=groups[gids[2]][0], group_id=gids[2], start=0, stop=G)],
                      advantages=[-0.5] * (G - 2 + G))]
    before = {n: s.bytes_out for n, s in stores.stats().items()}
    got = fetch_mm_mini_batch(stores, mbs)
    distinct = list(dict.fromkeys(k for g in gids[:3] for k in groups[g][1]))
    assert list(got.images) == distinct
    assert got.references == sum(len(groups[g][1]) * G for g in gids[:3]) > len(distinct)
    assert sum(len(ks) for ks in got.keys_by_node.values()) == len(distinct)  # each image asked once
    for node, ks in got.keys_by_node.items():  # ... from the node storing a group that references it
        assert all(any(k in groups[g][1] and groups[g][0] == node for g in gids[:3]) for k in ks)
    for k, arr in got.images.items():
        assert arr.shape == (3, IMG, IMG) and arr.dtype == np.uint8 and images_to_table([arr])[1] == [k]
    assert [p.rows for p in got.packed] == [G + 2, 2 * G - 2]
    assert [len(r) for r in got.row_keys] == [G + 2, 2 * G - 2]
    pixels = len(distinct) * 3 * IMG * IMG
    assert pixels <= got.image_bytes < 2 * pixels  # once per distinct image, not per reference
    served = sum(s.bytes_out - before[n] for n, s in stores.stats().items())
    assert served < got.trajectory_bytes + 2 * pixels


def _run(cmd: list[str], timeout: float = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:6])}... exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.mark.megatron
def test_clipvit_dedup_gradients_equal_per_reference_encoding() -> None:
    pytest.importorskip("megatron.core")
    out = json.loads(_run([sys.executable, "-m", "train.mm_model"]).strip().splitlines()[-1])
    assert out["mismatched"] == [] and out["same_param_names"]
    assert out["params_with_grad"] == out["params"] == out["nonzero_grads"] > 10  # every CLIPViT param trained
    assert out["dedup_forward_images"] == out["distinct_images"] == 5 and out["dedup_encoder_calls"] == 1
    assert out["reference_forward_images"] == out["references"] > out["distinct_images"]
    assert out["max_rel_diff"] < 1e-5


def _servers() -> tuple[Any, list[Any]]:
    from flight_store.config import ServerConfig
    from flight_store.reading import StoreReader
    from flight_store.server import StoreServer

    # named nodes: routing hashes node ids, and a location's port changes from run to run
    servers = [StoreServer(ServerConfig(node_name=f"node{i}")) for i in range(2)]
    return StoreReader([s.location for s in servers]), servers


def _train(tmp: Path, *, dedup: bool) -> dict[str, Any]:
    """Fresh stores with the fixed dataset, a DP=2 multimodal trainer run; reports, groups, images left."""
    from train.config import OptimConfig, TrainConfig, VisionConfig

    client, servers = _servers()
    try:
        groups = _groups(client, GROUPS)
        cfg = TrainConfig(stores=client.nodes, max_steps=STEPS, idle_timeout_s=20, optim=OptimConfig(lr=1e-2),
                          vision=VisionConfig(img_h=IMG, img_w=IMG, dedup=dedup),
                          admission=AdmissionConfig(train_batch_groups=4, group_size=G, mini_batches=2,
                                                    token_budget=32),
                          report_path=str(tmp / "rank{rank}.json"))
        config = documents.write(cfg, tmp / "train.json")
        _run([sys.executable, "-m", "train", "--config", str(config), "--nproc", "2"])
        reports = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
        left = sum(s.images for s in client.stats().values())
    finally:
        client.close()
        for s in servers:
            s.shutdown()
    return {"reports": reports, "groups": groups, "images_left": left}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("megatron.core")
    return {"dedup": _train(tmp_path_factory.mktemp("dedup"), dedup=True),
            "per_ref": _train(tmp_path_factory.mktemp("per_ref"), dedup=False)}


@pytest.mark.megatron
@pytest.mark.slow
def test_dp2_trains_backbone_and_encoder(dp_runs: Any) -> None:
    run = dp_runs["dedup"]
    reports, groups = run["reports"], run["groups"]
    steps = [r["steps"] for r in reports]
    assert all(len(s) == STEPS for s in steps)
    for rank_steps, report in zip(steps, reports, strict=True):
        slices = [c for c in report["consumed"] if c[0] == "slice"]
        for st in rank_steps:
            gids = {c[3] for c in slices if c[1] == st["step"]}
            distinct = {k for g in gids for k in groups[g][1]}
            assert st["encoder_passes"] == st["distinct_images"] == len(distinct) > 0
            assert st["image_refs"] == sum(len(groups[g][1]) * G for g in gids) > st["distinct_images"]
            assert st["micro_batches"] >= 2  # one encoder pass served several backbone micro-batches
    for a, b in zip(steps[0], steps[1], strict=True):  # DP ranks agree after the reduction
        assert a["loss"] == b["loss"]
        assert a["encoder_grad_checksum"] == pytest.approx(b["encoder_grad_checksum"], rel=1e-12)
        assert a["encoder_weight_checksum"] == pytest.approx(b["encoder_weight_checksum"], rel=1e-12)
        assert a["encoder_grad_norm"] > 0
    losses = [s["loss"] for s in steps[0]]
    assert np.mean(losses[-2:]) < np.mean(losses[:2])  # fixed tokens: the policy learns them
    weights = [s["encoder_weight_checksum"] for s in steps[0]]
    assert len(set(weights)) == STEPS  # the encoder's weights change every step
    assert run["images_left"] == 0  # released groups freed every image


@pytest.mark.megatron
@pytest.mark.slow
def test_dp2_dedup_trains_like_per_reference_encoding(dp_runs: Any) -> None:
    dedup = [r["steps"] for r in dp_runs["dedup"]["reports"]]
    per_ref = [r["steps"] for r in dp_runs["per_ref"]["reports"]]
    for rank in (0, 1):
        for a, b in zip(dedup[rank], per_ref[rank], strict=True):
            assert b["encoder_passes"] == b["image_refs"] > a["encoder_passes"] == a["distinct_images"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        # the first step starts from the same weights: the encoder's gradients agree (fp32)
        assert dedup[rank][0]["encoder_grad_checksum"] == pytest.approx(per_ref[rank][0]["encoder_grad_checksum"],
                                                                        rel=1e-5)
        assert dedup[rank][0]["encoder_grad_norm"] == pytest.approx(per_ref[rank][0]["encoder_grad_norm"], rel=1e-5)
