"""Growth without bound: a node that writes and releases groups for a long time stays flat.

A ``knit serve`` node process (spill log, memory budget, RSS guard) takes thousands of small groups,
each released shortly after (what a trainer does), plus a weights version now and then. With the
default bounds of its history and tombstones, its resident memory, its metadata history and its spill
log must stay flat once warmed up, and a write must never
be refused while the node holds next to nothing. ``SOAK_GROUPS`` sets the length (the closing note of
this change ran 20,000).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa

from flight_store.config import ServerConfig, StoreConfig
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.records import TrajectoryRecord, records_to_batch

GROUPS = int(os.environ.get("SOAK_GROUPS", "10000"))


def _group(gid: str) -> pa.RecordBatch:
    return records_to_batch([TrajectoryRecord(group_id=gid, sample_idx=i, policy_version=0, prompt_ids=[1, 2],
                                              response_ids=[3] * 32, response_logprobs=[-0.5] * 32, reward=i % 2)
                             for i in range(4)])


def test_a_node_writing_and_releasing_for_long_stays_flat(node_process, tmp_path: Path) -> None:
    store = StoreConfig(memory_budget=64 << 20, spill_dir=str(tmp_path / "spill"), spill_compact_bytes=2 << 20)
    history_rows, tombstones = store.bookkeeping()  # the defaults: what a sixteenth of the budget holds each
    warm_up = -(-max(history_rows * 5 // 4 // 4, tombstones) // 1000) * 1000  # both bounds reached
    assert warm_up < GROUPS - 1000, "too short a soak to see the node warmed up"
    _, location = node_process(ServerConfig(log_level="WARNING", store=store))
    weights = pa.table({"name": ["w"], "shape": [[4096]], "dtype": ["float32"], "data": [bytes(4 * 4096)]})
    rss: dict[int, int] = {}
    t0 = time.monotonic()
    # no retry: a refused write fails the test
    with StoreReader(location, retries=0) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        pending: list[str] = []
        for i in range(GROUPS):
            gid = f"g{i}"
            writer.put_group(_group(gid))
            pending.append(gid)
            if len(pending) == 8:  # a mini-batch consumed
                client.release(pending)
                pending = []
            if i % 500 == 0:
                publisher.put_weights(weights, i)
                publisher.publish_version(i)
            if i % 1000 == 0 or i == GROUPS - 1:
                rss[i] = int(client.stats()[location].memory_rss)
        stats = client.stats()[location]
    elapsed = time.monotonic() - t0
    growth = (rss[GROUPS - 1] - rss[warm_up]) / rss[warm_up]
    print(f"soak: {GROUPS} groups in {elapsed:.1f} s; RSS {rss[warm_up] >> 20} -> {rss[GROUPS - 1] >> 20} MiB "
          f"({100 * growth:+.1f}%); metadata rows held {stats.metadata_rows_held}, tombstones "
          f"{stats.tombstones}, spill log {stats.spill_bytes >> 10} KiB after {stats.spill_compactions} "
          f"compactions; RSS MiB every 1000 groups {[v >> 20 for v in rss.values()]}")
    assert growth < 0.10, rss
    # the history (trimmed a quarter at once, so up to 5/4 of its bound) and the live rows; the tombstones
    assert stats.metadata_rows_held <= history_rows * 5 // 4 + 4 * 8
    assert stats.tombstones <= tombstones
    assert stats.spill_compactions > 0 and stats.spill_bytes < 3 * (2 << 20)
    assert (tmp_path / "spill" / "store.log").stat().st_size == stats.spill_bytes
