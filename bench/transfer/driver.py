"""The driver's side of the transfer benchmark: verl's single-controller path, and byte counting.

:class:`CountingClient` (and :class:`CountingImageClient`) wrap the driver's store client and count
every payload byte the baseline's driver receives (the on-demand path's driver share is measured from
the stores' own ``bytes_out`` counters instead, which a wrapper the path never calls could not see).
:func:`baseline_step` and :func:`mm_baseline_step` are one train step of the baseline: the driver
gathers the train batch, builds DataProto shards, ``ray.put``s them, and the ranks load them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from bench.transfer.workload import Workload, dataproto_shards, group_advantages, serialize
from schemas.plan import PlannedSlice


class CountingClient:
    """The driver's store client, counting every payload byte the driver receives."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.payload_bytes = 0
        self.metadata_bytes = 0

    def fetch(self, slices: Sequence[PlannedSlice], columns: Sequence[str] | None = None) -> pa.Table:
        t = self.client.fetch(slices, columns=columns)
        self.payload_bytes += t.nbytes
        return t

    def scan_new(self) -> Any:
        frame = self.client.scan_new()
        self.metadata_bytes += int(frame.estimated_size())
        return frame


class CountingImageClient(CountingClient):
    """The driver's client, counting trajectory and image payload bytes it receives."""

    def fetch_images(self, keys: Any, nodes: Any) -> pa.Table:
        t = self.client.fetch_images(keys, nodes=nodes)
        self.payload_bytes += t.nbytes
        return t


def baseline_step(driver: CountingClient, ranks: list[Any], slices: list[PlannedSlice], w: Workload) -> dict[str, Any]:
    """One train step of verl's path: the driver fetches the whole train batch, builds and serialises one
    DataProto shard per rank, ``ray.put``s them; each rank ``ray.get``s and ``torch.load``s its own."""
    import ray

    from train.packing import PACK_COLUMNS

    t0 = time.perf_counter()
    wall0 = time.time()
    table = driver.fetch(slices, columns=[*PACK_COLUMNS, "reward"])  # the whole train batch, through the driver
    t_fetch = time.perf_counter()
    shards = dataproto_shards(table, group_advantages(table), w.ranks)
    blobs = [serialize(s) for s in shards]
    refs = [ray.put(b) for b in blobs]
    t_put = time.perf_counter()
    done = ray.get([r.load_baseline.remote([ref]) for r, ref in zip(ranks, refs, strict=True)])
    total = max(d["end"] for d in done) - wall0
    return {"transfer_s": max(total, time.perf_counter() - t0), "fetch_s": t_fetch - t0, "build_put_s": t_put - t_fetch,
            "serialized_bytes": sum(len(b) for b in blobs), "driver_payload_bytes": table.nbytes}


def mm_baseline_step(driver: CountingImageClient, ranks: list[Any], slices: list[PlannedSlice], w: Workload, *,
                     train: bool, micro_batches: int) -> dict[str, Any]:
    """verl's path with images: the driver gathers the batch, replicates each image into every trajectory
    (DataProto rows carry their own pixel tensors), serialises one shard per rank, ray.put; ranks load it."""
    import ray
    import torch

    from schemas.images import table_to_images
    from train.mm_data import MM_COLUMNS

    t0 = time.perf_counter()
    wall0 = time.time()
    before = driver.payload_bytes
    table = driver.fetch(slices, columns=[*MM_COLUMNS, "reward"])
    row_keys = table.column("image_keys").to_pylist()
    node_of_row = [s.node for s in slices for _ in range(s.rows)]
    node_of_key: dict[bytes, str] = {}
    for node, keys in zip(node_of_row, row_keys, strict=True):
        for k in keys:
            node_of_key.setdefault(k, node)
    images = table_to_images(driver.fetch_images(list(node_of_key), node_of_key))
    t_fetch = time.perf_counter()
    shards = dataproto_shards(table, group_advantages(table), w.ranks)
    pixels = np.stack([np.stack([images[k] for k in keys]) for keys in row_keys])  # replicated per trajectory
    for shard, idx in zip(shards, np.array_split(np.arange(table.num_rows), w.ranks), strict=True):
        shard["pixel_values"] = torch.from_numpy(pixels[idx])
    blobs = [serialize(s) for s in shards]
    refs = [ray.put(b) for b in blobs]
    t_put = time.perf_counter()
    done = ray.get([r.load_mm_baseline.remote([ref], train, micro_batches) for r, ref in zip(ranks, refs, strict=True)])
    transfer = max(max(d["loaded"] for d in done) - wall0, 0.0)
    return {"transfer_s": transfer, "total_s": max(max(d["end"] for d in done) - wall0, time.perf_counter() - t0),
            "fetch_s": t_fetch - t0, "build_put_s": t_put - t_fetch, "serialized_bytes": sum(len(b) for b in blobs),
            "driver_payload_bytes": driver.payload_bytes - before, "rows": table.num_rows,
            "compute_s": max(d["compute_s"] for d in done), "encoder_passes": sum(d["encoder_passes"] for d in done)}
