"""What the cluster model (:mod:`bench.cluster.model`) takes from this machine, measured by the driver on its cluster.

Before the workloads, on the same hosts and links: the cost of one call that moves almost nothing (a knittrans
read of one row, a TransferQueue ``get_data`` of one row, verl's worker group call, TransferQueue's key lookup
of one key and per further key), the single controller's serialisation rate (verl's driver: the rollouts'
``DataProto`` parts unpickled, concatenated, reordered, chunked per rank and pickled again, bytes per second
of the batch), and the image processor's time per image on a rank. Each is the median of :data:`REPS` runs.
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

import numpy as np

REPS = 7
"""Runs of each measurement (medians)."""
CALIBRATION_ROWS = 32
"""Rows of the calibration group (TransferQueue's lookup per key is timed over them, less one key's)."""
SERIALISE_ROWS, SERIALISE_WIDTH = 64, 4096
"""The batch the controller's serialisation rate is measured on: rows of this many tokens (about 14 MB)."""


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def serialisation_rate(ranks: int, parts: int = 2) -> float:
    """verl's driver work on a batch, in bytes per second: unpickle ``parts`` rollout parts, concatenate, reorder,
    chunk into ``ranks`` and pickle each chunk (numpy serialisation, as the driver runs)."""
    import torch
    from verl.protocol import DataProto

    rows, width = SERIALISE_ROWS, SERIALISE_WIDTH
    rng = np.random.default_rng(0)
    part = {"input_ids": torch.from_numpy(rng.integers(0, 32000, (rows // parts, width))),
            "attention_mask": torch.ones(rows // parts, width, dtype=torch.int64),
            "old_log_probs": torch.from_numpy(rng.random((rows // parts, width), dtype=np.float32))}
    blobs = [pickle.dumps(DataProto.from_dict(tensors=part)) for _ in range(parts)]
    nbytes = parts * sum(t.numel() * t.element_size() for t in part.values())
    order = torch.from_numpy(rng.permutation(rows))
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        data = DataProto.concat([pickle.loads(b) for b in blobs])
        data = data.select_idxs(order)
        for chunk in data.chunk(ranks):
            pickle.dumps(chunk)
        times.append(time.perf_counter() - t0)
    return nbytes / _med(times)


def calibrate(driver: Any) -> dict[str, Any]:
    """The model's per-call costs, controller rates and processor cost, measured on ``driver``'s cluster."""
    import ray
    import transfer_queue as tq

    from bench.cluster.actors import TQ_FIELDS
    from bench.cluster.workload import Workload, make_group
    from bench.peers.tq import group_fields
    from flight_store.writing import StoreWriter

    spec = driver.spec
    w = Workload(groups=2, group_size=CALIBRATION_ROWS, mini_batches=1, ranks=1, prompt_len=16, response_mean=16,
                 response_max=16)
    g = make_group("calibration", w, np.random.default_rng(0))
    store = spec["stores"][0]
    with StoreWriter.sharing(driver.client) as writer:
        writer.put_group(g, node=store)
    rank = driver.ranks[0]
    knit = ray.get(rank.knit_call_s.remote([[store, "calibration", 0, 1]], REPS))
    keys, fields, tags, _ = group_fields(g)
    tq.kv_batch_put(keys=keys, partition_id="calibration", fields=fields, tags=tags)
    one, every = [], []
    for _ in range(REPS):
        t0 = time.perf_counter()
        driver.tq.kv_retrieve_meta(keys=keys[:1], partition_id="calibration")
        t1 = time.perf_counter()
        meta = driver.tq.kv_retrieve_meta(keys=keys, partition_id="calibration").select_fields(list(TQ_FIELDS))
        one.append(t1 - t0)
        every.append(time.perf_counter() - t1)
    per_key = max(_med(every) - _med(one), 0.0) / (len(keys) - 1)
    tq_call = ray.get(rank.tq_call_s.remote(meta.select_samples([0]), REPS))
    verl = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        driver.group.ready()
        verl.append(time.perf_counter() - t0)
    out = {"knit_call_s": _med(knit), "tq_call_s": _med(tq_call), "tq_lookup_s": _med(one),
           "tq_lookup_s_per_key": max(per_key, 1e-9),
           "verl_call_s": _med(verl), "controller_bytes_per_s": serialisation_rate(spec["n_ranks"]), "reps": REPS}
    mm = spec["workloads"].get("mm")
    if mm is not None:
        out["process_s_per_image"] = _med(ray.get(rank.process_s.remote(list(mm["image_shape"]),
                                                                         mm["images_per_group"], REPS)))
    tq.kv_clear(keys=keys, partition_id="calibration")
    driver.client.release(["calibration"])
    return out
