"""Concurrent writers and readers on real nodes: exact counts, no duplicate, no loss."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import polars as pl

from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice

WRITERS = 8
GROUPS_PER_WRITER = 200
GROUP_SIZE = 2


def test_8_writers_x_200_groups_with_a_concurrent_reader(store_nodes, make_group) -> None:
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    shared = StoreReader(locs)  # half the writers share its connections, half have their own
    stop = threading.Event()
    seen: list[pl.DataFrame] = []

    def writer(w: int) -> int:
        client = StoreWriter.sharing(shared) if w % 2 else StoreWriter(locs)
        try:
            for i in range(GROUPS_PER_WRITER):
                gid = f"w{w}-g{i}"
                batch = make_group(gid, size=GROUP_SIZE)
                client.put_group(batch)
                if i % 10 == 0:
                    client.put_group(batch)  # a retried write: must not duplicate
            return GROUPS_PER_WRITER
        finally:
            client.close()

    def reader() -> None:
        with StoreReader(locs) as client:
            while not stop.is_set():
                seen.append(client.scan_new(columns=["group_id", "sample_idx"]))
            seen.append(client.scan_new(columns=["group_id", "sample_idx"]))

    r = threading.Thread(target=reader)
    r.start()
    with ThreadPoolExecutor(WRITERS) as pool:
        done = sum(pool.map(writer, range(WRITERS)))
    stop.set()
    r.join(timeout=60)
    assert done == WRITERS * GROUPS_PER_WRITER

    total = WRITERS * GROUPS_PER_WRITER * GROUP_SIZE
    streamed = pl.concat([f for f in seen if f.height])
    assert streamed.height == total  # the incremental reader saw every row exactly once
    assert streamed.select("group_id", "sample_idx").is_duplicated().sum() == 0
    meta = shared.scan_metadata(columns=["group_id", "sample_idx"])
    assert meta.height == total
    assert meta.select("group_id", "sample_idx").n_unique() == total
    for loc in locs:  # seq is contiguous per node: nothing lost, nothing doubled
        seqs = meta.filter(pl.col("node") == loc)["seq"].sort().to_list()
        assert seqs == list(range(len(seqs)))
    placed = meta.select("group_id", "node").unique()
    assert all(shared.node_for(g) == n for g, n in placed.iter_rows())  # each group on its hashed node
    stats = shared.stats()
    assert sum(s.rows for s in stats.values()) == total
    assert sum(s.groups.stored for s in stats.values()) == WRITERS * GROUPS_PER_WRITER
    # every group is served from the node that holds it
    slices = [
        PlannedSlice(node=n, group_id=g, start=0, stop=GROUP_SIZE)
        for g, n in meta.select("group_id", "node").unique().sort("group_id").head(64).iter_rows()
    ]
    assert shared.fetch(slices).num_rows == 64 * GROUP_SIZE
    shared.close()
