"""knittrans' path in the peers benchmark: ranks read exactly their own micro-batch slices.

The driver holds no payload: the groups are in two ``knit serve`` nodes (processes of their own),
and each rank (a Ray actor) is sent only its step's micro-batch specs. A rank reads its micro-batches
one read per node and micro-batch (``StoreReader.stream``), packs each into the trainer's
tensors (``train.packing.pack_tensors``) on a prefetch thread while the previous one computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from bench.cluster.workload import Workload
from bench.peers.common import Encoder, MicroSpec, arrow_payload_bytes, run_micro_batches


class KnitRank:
    """One trainer rank reading through its own :class:`~flight_store.reading.StoreReader`."""

    def __init__(self, rank: int, stores: list[str]) -> None:
        from flight_store.reading import StoreReader

        self.rank = rank
        self.client = StoreReader(stores)

    def ready(self) -> int:
        import torch  # noqa: F401  (import cost outside the clock)

        import train.packing
        import train.prefetch  # noqa: F401

        return self.rank

    def step(self, micros: list[MicroSpec], ms_per_ktok: float, depth: int, checksums: bool = False) -> dict[str, Any]:
        from schemas.plan import PlannedSlice
        from train.packing import PACK_COLUMNS, pack_tensors

        slices = [[PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in m["slices"]] for m in micros]
        tables = self.client.stream(slices, columns=PACK_COLUMNS)  # one read per node and micro-batch

        def get(spec: MicroSpec) -> dict[str, Any]:
            table = next(tables)
            return {"tensors": pack_tensors(table, spec["advantages"], mode="padded").to_torch(),
                    "bytes": arrow_payload_bytes(table), "wire_bytes": table.nbytes}

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=depth, checksums=checksums)

    def step_mm(self, micros: list[MicroSpec], ms_per_ktok: float, ms_per_image: float, dedup: bool,
                depth: int, process: Callable[[list[Any]], Any] | None = None) -> dict[str, Any]:
        """A multimodal step: rows carry image keys; each distinct image of a mini-batch is fetched once, and
        encoded once (``dedup``) or once per row referencing it (the encoder without deduplication).

        ``process``: what the encoder is given is ``process(images)`` (an image processor run in the rank's
        clock, on the images the micro-batch encodes), not the raw pixels."""
        import numpy as np
        import torch

        from schemas.images import table_to_images
        from schemas.plan import PlannedSlice
        from train.mm_data import MM_COLUMNS
        from train.packing import pack_tensors

        slices = [[PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in m["slices"]] for m in micros]
        tables = self.client.stream(slices, columns=MM_COLUMNS)
        held: dict[bytes, np.ndarray] = {}  # this mini-batch's images, each fetched once
        mini = [-1]

        def get(spec: MicroSpec) -> dict[str, Any]:
            table = next(tables)
            if spec["mini"] != mini[0]:
                mini[0] = spec["mini"]
                held.clear()
            row_keys = table.column("image_keys").to_pylist()
            node_of = {k: node for (node, _, a, b), keys in zip(spec["slices"], _per_slice(row_keys, spec), strict=True)
                       for k in keys}
            new = [k for k in dict.fromkeys(k for keys in row_keys for k in keys) if k not in held]
            got = table_to_images(self.client.fetch_images(new, nodes=node_of)) if new else {}
            held.update(got)
            refs = new if dedup else [k for keys in row_keys for k in keys]
            if process is not None:
                encode = process([held[k] for k in refs]) if refs else None
            else:
                encode = torch.from_numpy(np.stack([held[k] for k in refs])) if refs else None
            tensors = pack_tensors(table.drop_columns(["image_keys"]), spec["advantages"], mode="padded").to_torch()
            return {"tensors": tensors, "encode": encode,
                    "bytes": table.nbytes + sum(int(a.nbytes) for a in got.values())}

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=depth, encoder=Encoder(ms_per_image))


def _per_slice(row_keys: list[list[bytes]], spec: MicroSpec) -> list[list[bytes]]:
    """The rows' image keys of each of ``spec``'s slices (rows come in slice order)."""
    out, at = [], 0
    for _, _, a, b in spec["slices"]:
        out.append([k for keys in row_keys[at:at + b - a] for k in keys])
        at += b - a
    return out


class KnitPath:
    """The knittrans path: groups put into the stores, ranks fetch their own slices."""

    name = "knittrans"

    def __init__(self, w: Workload, stores: list[str]) -> None:
        import ray

        from flight_store.reading import StoreReader
        from flight_store.writing import StoreWriter

        self.w = w
        self.client = StoreReader(stores)
        self.writer = StoreWriter.sharing(self.client)
        actor = ray.remote(num_cpus=1)(KnitRank)
        self.ranks: list[Any] = [actor.remote(r, stores) for r in range(w.ranks)]  # type: ignore[attr-defined]
        ray.get([r.ready.remote() for r in self.ranks])

    def load(self, groups: list[pa.RecordBatch]) -> dict[str, Any]:
        """``put_group`` each group (one DoPut each, as a rollout worker writes); wall time and payload bytes."""
        t0 = time.perf_counter()
        for g in groups:
            self.writer.put_group(g)
        return {"put_s": time.perf_counter() - t0, "bytes": sum(g.nbytes for g in groups)}

    def step(self, per_rank: list[list[MicroSpec]], ms_per_ktok: float, depth: int = 1,
             checksums: bool = False) -> list[dict[str, Any]]:
        import ray

        return list(ray.get([r.step.remote(m, ms_per_ktok, depth, checksums)
                             for r, m in zip(self.ranks, per_rank, strict=True)]))

    def load_mm(self, groups: list[pa.RecordBatch], images: list[pa.Table]) -> dict[str, Any]:
        """Each group's images (once, whatever G) then the group, to the group's node; wall time and bytes."""
        t0 = time.perf_counter()
        for g, imgs in zip(groups, images, strict=True):
            node = self.writer.node_for(str(g.column("group_id")[0]))
            self.writer.put_images(imgs, node=node)
            self.writer.put_group(g, node=node)
        return {"put_s": time.perf_counter() - t0,
                "bytes": sum(g.nbytes for g in groups) + sum(t.nbytes for t in images)}

    def step_mm(self, per_rank: list[list[MicroSpec]], ms_per_ktok: float, ms_per_image: float,
                dedup: bool, depth: int = 1) -> list[dict[str, Any]]:
        import ray

        return list(ray.get([r.step_mm.remote(m, ms_per_ktok, ms_per_image, dedup, depth)
                             for r, m in zip(self.ranks, per_rank, strict=True)]))

    def fetch_latencies(self, micros: list[MicroSpec]) -> list[float]:
        """One ``fetch`` of each micro-batch's slices in this process (data only: no packing, no compute)."""
        from schemas.plan import PlannedSlice
        from train.packing import PACK_COLUMNS

        out = []
        for m in micros:
            slices = [PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in m["slices"]]
            t0 = time.perf_counter()
            self.client.fetch(slices, columns=PACK_COLUMNS)
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        self.writer.close()
        self.client.close()
