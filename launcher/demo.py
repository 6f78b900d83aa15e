"""``knit demo``: the data flow in miniature on two in-process store nodes, in seconds.

connect -> write groups -> scan metadata (polars) -> plan one micro-batch -> fetch -> release.
"""

from __future__ import annotations

import time

import numpy as np
import polars as pl

from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from schemas.records import TrajectoryRecord, records_to_batch


def _group(rng: np.random.Generator, group_id: str, size: int, source: str, version: int) -> list[TrajectoryRecord]:
    prompt = rng.integers(0, 32000, size=int(rng.integers(8, 64))).tolist()
    out = []
    for i in range(size):
        n = int(rng.integers(4, 128))
        out.append(
            TrajectoryRecord(
                group_id=group_id,
                sample_idx=i,
                policy_version=version,
                data_source=source,
                prompt_ids=prompt,
                response_ids=rng.integers(0, 32000, size=n).tolist(),
                response_logprobs=(-rng.random(n)).tolist(),
                reward=float(rng.random() < 0.5),
            )
        )
    return out


def run_demo(*, groups: int = 16, group_size: int = 4, seed: int = 0) -> int:
    """Run the demo, printing what each step did; returns 0 when every step checked out."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    with StoreServer() as n0, StoreServer() as n1, \
            StoreWriter([n0.location, n1.location]) as writer, StoreReader.sharing(writer) as client, \
            StorePublisher.sharing(writer) as publisher:
        # write: one DoPut per prompt group, placed by a stable hash of its id
        for g in range(groups):
            source = ("math", "code", "chat")[g % 3]
            writer.put_group(records_to_batch(_group(rng, f"prompt-{g}", group_size, source, version=0)))

        # scan: metadata only, from both nodes, as one polars frame
        meta = client.scan_new(columns=["group_id", "sample_idx", "data_source", "reward", "response_len"])
        by_source = (
            meta.group_by("data_source")
            .agg(
                pl.len().alias("rows"),
                pl.col("reward").mean().alias("mean_reward"),
                pl.col("response_len").sum().alias("tokens"),
            )
            .sort("data_source")
        )

        # plan: the first two complete groups form one micro-batch
        firsts = meta.select("group_id", "node").unique(maintain_order=True).head(2)
        slices = [
            PlannedSlice(node=node, group_id=gid, start=0, stop=group_size) for gid, node in firsts.iter_rows()
        ]

        # fetch: one request per node (over read channels), rows in plan order; then release what was consumed
        batch = client.fetch(slices, columns=["group_id", "sample_idx", "response_ids", "loss_mask"])
        released = client.release([s.group_id for s in slices])
        publisher.publish_version(1)

        print(f"knit demo: {len(client.nodes)} store nodes, {meta.height} trajectories in {groups} groups")
        print(by_source)
        print(
            f"fetched micro-batch: {batch.num_rows} rows, {batch.nbytes} bytes from {len({s.node for s in slices})} "
            f"node(s); released {sum(released.values())} groups; policy version {client.get_version()}"
        )
        print(f"done in {time.perf_counter() - t0:.2f} s")
        expected = groups * group_size
        ok = meta.height == expected and batch.num_rows == len(slices) * group_size
        return 0 if ok else 1
