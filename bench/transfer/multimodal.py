"""Multimodal transfer per train step: images replicated into every trajectory (verl) vs fetched by reference.

``--multimodal``: the image workload (``python -m bench.transfer --multimodal [--quick] --out F.json``).
Every prompt group references ``images_per_group`` images (default one image of a 448x448 RGB
picture as a Qwen2-VL-style processor ships it, 1024 patches x 1176 values in fp16, which is what
verl's DataProto carries in ``multi_modal_inputs``; ``--image-format pixels-uint8``: the raw
3x448x448 uint8 pixels instead, 4x fewer bytes). Each image is DoPut once to the node of its
group (content key), whatever G (default 8).

baseline (verl, kept faithful, and as fast as we could make it)
    the driver fetches the train batch's trajectories AND their distinct images from the stores,
    replicates each image into every trajectory that references it (DataProto rows carry their
    own pixel tensors; verl's ``repeat(G)`` does this), adds them to the DataProto layout above as
    one ``pixel_values`` tensor (a single tensor, cheaper to pickle than verl's per-row dicts),
    serialises one shard per rank, ``ray.put``s; each rank ``ray.get``s and ``torch.load``s.
on-demand (knittrans)
    per mini-batch, each rank DoGets its micro-batches' slices (one DoGet per node, packing
    columns plus ``image_keys``), collects the distinct keys of ALL its micro-batches, and DoGets
    each distinct image once (one DoGet per node; ``train.mm_data.fetch_mm_mini_batch``), on the
    prefetch thread, one mini-batch ahead.

Two phases, each with one warm-up step per path that is not counted:

transfer (calibrated compute stand-in, as in the text mode)
    ``ratios.mm_transfer_speedup_raw`` = baseline transfer (driver's first fetch until every rank
    holds its tensors) / the on-demand fetch time with no overlap credited (the prefetch thread's
    DoGets + packing + image decoding, summed over the rank's mini-batches; max over ranks), per
    train step. The exposed wait left after prefetch (``metrics.ondemand_transfer_ms``) depends on
    the compute stand-in: a diagnostic, nothing is divided by it.
    ``ratios.mm_bytes_reduction`` = 1 - bytes moved on-demand / baseline, per train step: the
    baseline moves the store->driver payload (Arrow bytes) plus the serialised shards
    driver->ranks; on-demand moves the Arrow bytes the ranks receive (trajectories + images).
transfer + train (real compute on CPU: the tiny encoder and backbone of :func:`tiny_models`)
    baseline: the path above, then each rank encodes every trajectory's image copy (dedup off)
    per micro-batch and trains the backbone, one Adam step per mini-batch; time = driver's
    first fetch until every rank finished the train batch. On-demand: dedup on
    (``train.multimodal.DedupVisionEncoder``: one encoder pass per distinct image per
    mini-batch, one backward through it), prefetch on; time = the rank's step loop (exposed
    wait + compute), max over ranks. ``ratios.mm_transfer_plus_train_speedup`` = baseline /
    on-demand: the data path's gain and the encoder's dedup gain together (the same gradients,
    less encoder compute). Models and optimizers are built outside every timed region. There is no
    gradient all-reduce in either path. ``metrics.encoder_passes`` (images through the encoder's
    forward on-demand, counted by a forward hook) must equal ``metrics.distinct_images`` (distinct
    images the ranks fetched, summed over ranks and mini-batches); ``metrics.baseline_encoder_passes``
    counts the baseline's per-trajectory passes the same way. ``metrics.driver_payload_bytes_ondemand``:
    what the stores served during the on-demand phases (their ``bytes_out`` counters) minus what the
    ranks received; it must stay below one image's bytes (the stores count each image row alone, the
    ranks a table of them, so offsets differ by a few bytes; a driver fetching payload would show).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import pyplot, write_result
from bench._hosts import network_mode
from bench.transfer.cluster import admit, cluster, start_ranks, steps_as_json
from bench.transfer.driver import CountingImageClient, mm_baseline_step
from bench.transfer.workload import Workload, make_group
from schemas.plan import PlannedSlice


def main_multimodal(args: argparse.Namespace, w: Workload) -> int:
    """``--multimodal``: the image workload, transfer alone, then transfer plus the tiny encoder and backbone."""
    total_a = w.steps + 1  # one warm-up step per path and phase
    with cluster() as stores:
        run = _run(stores, w)
    od_a_steps = [[rank[s] for rank in run["od_a"]] for s in range(1, total_a)]  # drop the warm-up step
    base_bytes = statistics.mean(b["driver_payload_bytes"] + b["serialized_bytes"] for b in run["base_a"])
    od_bytes = statistics.mean(sum(r["traj_bytes"] + r["image_bytes"] for r in step) for step in od_a_steps)
    metrics = _metrics(run, od_a_steps, base_bytes, od_bytes)
    ratios = {
        "mm_transfer_speedup_raw": metrics["baseline_transfer_ms"] / metrics["ondemand_fetch_ms_no_overlap"],
        "mm_bytes_reduction": 1.0 - od_bytes / base_bytes,
        "mm_transfer_plus_train_speedup": metrics["baseline_transfer_plus_train_ms"]
        / metrics["ondemand_transfer_plus_train_ms"],
    }
    params = {**asdict(w), "quick": args.quick, "network": network_mode(),
              "compute": "transfer phase: calibrated stand-in; train phase: tiny encoder + backbone on CPU"}
    out = Path(args.out)
    write_result(out, metrics, ratios, params)
    _plot_mm(out.with_suffix(".png"), metrics)
    ok = (ratios["mm_transfer_speedup_raw"] >= 10 and ratios["mm_bytes_reduction"] >= 0.85
          and metrics["encoder_passes"] == metrics["distinct_images"] > 0
          and abs(metrics["driver_payload_bytes_ondemand"]) < metrics["image_bytes_each"]
          and ratios["mm_transfer_plus_train_speedup"] >= 3)
    _print_summary(metrics, ratios, ok)
    return 0 if ok else 1


def _run(stores: list[str], w: Workload) -> dict[str, Any]:
    """Store every train batch and its images, then both phases, each on both paths; the raw records."""
    import ray

    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter

    total_a, total_b = w.steps + 1, w.train_steps + 1  # one warm-up step per path and phase
    rng = np.random.default_rng(w.seed)
    client = StoreReader(stores)
    group_ids = [[f"s{s}-g{g}" for g in range(w.groups)] for s in range(total_a + total_b)]
    with StoreWriter.sharing(client) as writer:
        node_of, image_bytes_stored = _store(writer, group_ids, w, rng)
    ranks = start_ranks(stores, w)
    driver = CountingImageClient(client)
    plans = admit(driver, w, total_a + total_b)
    steps = steps_as_json(plans, w, total_a + total_b)
    micro = max(1, round(statistics.mean(len(r.micro_batches) for p in plans for r in p.ranks)))

    def slices_of(s: int) -> list[PlannedSlice]:
        return [PlannedSlice(node=node_of[g], group_id=g, start=0, stop=w.group_size) for g in group_ids[s]]

    def phase(first: int, stop: int, train: bool) -> tuple[list[dict[str, Any]], list[Any], int]:
        """Baseline steps (warm-up dropped), then on-demand per rank; and the payload bytes the stores served
        on-demand beyond what the ranks received (the driver's share)."""
        base = [mm_baseline_step(driver, ranks, slices_of(s), w, train=train, micro_batches=micro)
                for s in range(first, stop)][1:]
        before = {n: st.bytes_out for n, st in client.stats().items()}
        od = ray.get([r.run_mm_ondemand.remote(steps[first:stop], train) for r in ranks])
        served = sum(st.bytes_out - before[n] for n, st in client.stats().items())
        return base, od, served - sum(r["traj_bytes"] + r["image_bytes"] for rank in od for r in rank)

    # phase A, transfer: baseline (driver, images replicated per trajectory) vs on-demand (by reference)
    base_a, od_a, payload_a = phase(0, total_a, False)
    # phase B, transfer + train: baseline with dedup off vs on-demand with dedup on
    base_b, od_b, payload_b = phase(total_a, total_a + total_b, True)
    client.release([g for ids in group_ids for g in ids])
    left = {n: st.images for n, st in client.stats().items()}
    client.close()
    return {"base_a": base_a, "od_a": od_a, "base_b": base_b, "od_b": od_b, "micro": micro,
            "driver_payload_ondemand": payload_a + payload_b,
            "image_bytes_stored": image_bytes_stored, "left": left,
            "image_bytes_each": image_bytes_stored // (len(group_ids) * w.groups * w.images_per_group)}


def _store(client: Any, group_ids: list[list[str]], w: Workload,
           rng: np.random.Generator) -> tuple[dict[str, str], int]:
    """DoPut every group's images once (whatever G) and the group beside them; node per group, image bytes."""
    from schemas.images import images_to_table

    node_of: dict[str, str] = {}
    image_bytes_stored = 0
    for ids in group_ids:
        for gid in ids:
            node = client.node_for(gid)
            imgs = [rng.integers(0, 256, w.image_shape, dtype=np.uint8) if w.image_dtype == "uint8"
                    else rng.standard_normal(w.image_shape, dtype=np.float32).astype(np.float16)
                    for _ in range(w.images_per_group)]
            table, keys = images_to_table(imgs)
            client.put_images(table, node=node)  # once per group, whatever G
            image_bytes_stored += table.nbytes
            node_of[gid] = client.put_group(make_group(gid, w, rng, keys), node=node)
    return node_of, image_bytes_stored


def _metrics(run: dict[str, Any], od_a_steps: list[list[dict[str, Any]]], base_bytes: float,
             od_bytes: float) -> dict[str, Any]:
    """``metrics`` of the result file, from both phases' records (warm-up steps dropped)."""
    base_a, base_b = run["base_a"], run["base_b"]
    od_b_all = [[rank[s] for rank in run["od_b"]] for s in range(len(run["od_b"][0]))]
    od_b_steps = od_b_all[1:]
    base_ms = [1e3 * b["transfer_s"] for b in base_a]
    od_ms = [1e3 * max(r["wait_s"] for r in step) for step in od_a_steps]
    od_raw_ms = [1e3 * max(r["fetch_s"] for r in step) for step in od_a_steps]
    base_train_ms = [1e3 * b["total_s"] for b in base_b]
    od_train_ms = [1e3 * max(r["step_s"] for r in step) for step in od_b_steps]
    return {
        "baseline_transfer_ms": statistics.mean(base_ms),
        "baseline_transfer_ms_per_step": base_ms,
        "baseline_driver_fetch_ms": 1e3 * statistics.mean(b["fetch_s"] for b in base_a),
        "baseline_replicate_serialize_put_ms": 1e3 * statistics.mean(b["build_put_s"] for b in base_a),
        "baseline_driver_payload_bytes_per_step": int(statistics.mean(b["driver_payload_bytes"] for b in base_a)),
        "baseline_serialized_bytes_per_step": int(statistics.mean(b["serialized_bytes"] for b in base_a)),
        "baseline_bytes_moved_per_step": int(base_bytes),
        "ondemand_transfer_ms": statistics.mean(od_ms),
        "ondemand_transfer_ms_per_step": od_ms,
        "ondemand_fetch_ms_no_overlap": statistics.mean(od_raw_ms),
        "ondemand_fetch_ms_no_overlap_per_step": od_raw_ms,
        "ondemand_doget_ms": 1e3 * statistics.mean(max(r["doget_s"] for r in st) for st in od_a_steps),
        "ondemand_image_doget_ms": 1e3 * statistics.mean(max(r["image_doget_s"] for r in st) for st in od_a_steps),
        "ondemand_bytes_moved_per_step": int(od_bytes),
        "ondemand_image_bytes_per_step": int(statistics.mean(sum(r["image_bytes"] for r in st) for st in od_a_steps)),
        "ondemand_step_ms_standin": 1e3 * statistics.mean(max(r["step_s"] for r in st) for st in od_a_steps),
        "driver_payload_bytes_ondemand": run["driver_payload_ondemand"],
        "image_bytes_stored": run["image_bytes_stored"],
        "image_bytes_each": run["image_bytes_each"],
        "images_left_after_release": run["left"],
        "baseline_transfer_plus_train_ms": statistics.mean(base_train_ms),
        "baseline_train_compute_ms": 1e3 * statistics.mean(b["compute_s"] for b in base_b),
        "ondemand_transfer_plus_train_ms": statistics.mean(od_train_ms),
        "ondemand_train_exposed_wait_ms": 1e3 * statistics.mean(max(r["wait_s"] for r in st) for st in od_b_steps),
        "ondemand_train_compute_ms": 1e3 * statistics.mean(max(r["compute_s"] for r in st) for st in od_b_steps),
        "encoder_passes": sum(r["encoder_passes"] for step in od_b_all for r in step),
        "distinct_images": sum(r["distinct_images"] for step in od_b_all for r in step),
        "image_references": sum(r["image_refs"] for step in od_b_all for r in step),
        "baseline_encoder_passes": sum(b["encoder_passes"] for b in base_b),
        "micro_batches_per_rank_mini_batch": run["micro"],
    }


def _print_summary(metrics: dict[str, Any], ratios: dict[str, Any], ok: bool) -> None:
    """One line: both phases' speedups, bytes saved, encoder passes, and whether the targets are met."""
    print(f"multimodal: baseline {metrics['baseline_transfer_ms']:.1f} ms/step, on-demand exposed "
          f"{metrics['ondemand_transfer_ms']:.2f} ms/step (raw {metrics['ondemand_fetch_ms_no_overlap']:.1f} ms): "
          f"speedup (no overlap credited) {ratios['mm_transfer_speedup_raw']:.1f}x, "
          f"bytes -{100 * ratios['mm_bytes_reduction']:.1f}%, transfer+train "
          f"{metrics['baseline_transfer_plus_train_ms']:.0f} vs {metrics['ondemand_transfer_plus_train_ms']:.0f} ms "
          f"({ratios['mm_transfer_plus_train_speedup']:.1f}x), encoder passes {metrics['encoder_passes']} for "
          f"{metrics['distinct_images']} "
          f"distinct images (baseline {metrics['baseline_encoder_passes']}) -> {'OK' if ok else 'TARGETS MISSED'}")


def _plot_mm(path: Path, m: dict[str, Any]) -> None:
    """Transfer per train step on both paths (log scale), and transfer + train (optional: needs matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.bar(["verl DataProto\n(replicated)", "on-demand raw\n(by reference)", "on-demand exposed\n(prefetch)"],
          [m["baseline_transfer_ms"], m["ondemand_fetch_ms_no_overlap"], max(m["ondemand_transfer_ms"], 1e-3)])
    a.set_yscale("log")
    a.set_ylabel("transfer ms per train step")
    b.bar(["baseline\n(dedup off)", "on-demand\n(dedup on)"],
          [m["baseline_transfer_plus_train_ms"], m["ondemand_transfer_plus_train_ms"]])
    b.set_ylabel("transfer + train ms per train step")
    fig.suptitle("Multimodal transfer (2 ranks, images by reference)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
