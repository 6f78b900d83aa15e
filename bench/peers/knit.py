"""knittrans' path in the peers benchmark: ranks DoGet exactly their own micro-batch slices.

The driver holds no payload: the groups are in two ``knit serve`` nodes (processes of their own),
and each rank (a Ray actor) is sent only its step's micro-batch specs. A rank reads its micro-batches
over one DoGet per node for the whole step (``StoreClient.stream``), packs each into the trainer's
tensors (``train.packing.pack``) on a prefetch thread while the previous one computes.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from bench.peers.common import MicroSpec, run_micro_batches
from bench.transfer.workload import Workload


class KnitRank:
    """One trainer rank reading through its own :class:`~flight_store.client.StoreClient`."""

    def __init__(self, rank: int, stores: list[str]) -> None:
        from flight_store.client import StoreClient

        self.rank = rank
        self.client = StoreClient(stores)

    def ready(self) -> int:
        import torch  # noqa: F401  (import cost outside the clock)

        import train.packing
        import train.prefetch  # noqa: F401

        return self.rank

    def step(self, micros: list[MicroSpec], ms_per_ktok: float, depth: int, checksums: bool = False) -> dict[str, Any]:
        from schemas.plan import PlannedSlice
        from train.packing import PACK_COLUMNS, pack

        slices = [[PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in m["slices"]] for m in micros]
        tables = self.client.stream(slices, columns=PACK_COLUMNS)  # one DoGet per node for the whole step

        def get(spec: MicroSpec) -> dict[str, Any]:
            table = next(tables)
            return {"tensors": pack(table, spec["advantages"], mode="padded").to_torch(), "bytes": table.nbytes}

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=depth, checksums=checksums)


class KnitPath:
    """The knittrans path: groups put into the stores, ranks fetch their own slices."""

    name = "knittrans"

    def __init__(self, w: Workload, stores: list[str]) -> None:
        import ray

        from flight_store.client import StoreClient

        self.w = w
        self.client = StoreClient(stores)
        actor = ray.remote(num_cpus=1)(KnitRank)
        self.ranks: list[Any] = [actor.remote(r, stores) for r in range(w.ranks)]  # type: ignore[attr-defined]
        ray.get([r.ready.remote() for r in self.ranks])

    def load(self, groups: list[pa.RecordBatch]) -> dict[str, Any]:
        """``put_group`` each group (one DoPut each, as a rollout worker writes); wall time and payload bytes."""
        t0 = time.perf_counter()
        for g in groups:
            self.client.put_group(g)
        return {"put_s": time.perf_counter() - t0, "bytes": sum(g.nbytes for g in groups)}

    def step(self, per_rank: list[list[MicroSpec]], ms_per_ktok: float, depth: int = 1,
             checksums: bool = False) -> list[dict[str, Any]]:
        import ray

        return list(ray.get([r.step.remote(m, ms_per_ktok, depth, checksums)
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
        self.client.close()
