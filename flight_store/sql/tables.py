"""The tables the SQL gateway answers over, and how it reads them from the store nodes.

A :class:`Snapshot` is what every node knows at one moment, read through the ordinary store client
(:class:`~flight_store.reading.StoreReader`): the metadata rows (one per trajectory, with ``node``), the
groups in flight, and each node's ``stats``. Only metadata moves; payload columns are never read. A node
that cannot be reached is left out (its ``nodes`` row says ``reachable = false``) instead of failing the
query. :class:`Snapshots` keeps the newest snapshot for ``max_age_s`` seconds, so a dashboard's burst of
queries reads the nodes once.

The tables (DuckDB views in the catalog ``knit``, schema ``main``, over the snapshot's Arrow tables):

=============  ===================================================================================
table          one row per
=============  ===================================================================================
trajectories   stored trajectory: the metadata columns (``schemas.arrow.METADATA_SCHEMA``: ``seq``,
               ``group_id``, ``sample_idx``, ``policy_version``, ``policy_version_min``, ``data_source``,
               ``prompt_len``, ``response_len``, ``reward``, ``finish_reason``, ``status``,
               ``num_images``, ``created_at``, ``completed_at``, ``bytes``, ``released``) and ``node``
groups         stored prompt group: its samples, versions, reward, tokens, and ``released`` (consumed by
               a train batch)
inflight       group the rollout dispatched and has not written yet (the planner's supply to come)
nodes          store node: whether it answered, its counters, the policy version it last published
=============  ===================================================================================
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from flight_store.reading import INFLIGHT_COLUMNS, StoreReader
from schemas.arrow import METADATA_SCHEMA

CATALOG = "knit"
SCHEMA = "main"

NODES_SCHEMA = pa.schema([
    pa.field("node", pa.string()),  # the node's location
    pa.field("reachable", pa.bool_()),  # it answered this snapshot's reads
    pa.field("rows", pa.int64()),  # trajectory rows held (unreleased groups)
    pa.field("groups_stored", pa.int64()),
    pa.field("groups_released", pa.int64()),
    pa.field("groups_inflight", pa.int64()),
    pa.field("bytes", pa.int64()),  # payload bytes held
    pa.field("images", pa.int64()),
    pa.field("policy_version", pa.int64()),  # the newest policy version published to the node (train steps)
    pa.field("weights_version", pa.int64()),
    pa.field("memory_used", pa.int64()),
    pa.field("memory_budget", pa.int64()),
    pa.field("uptime_s", pa.float64()),
])
"""The ``nodes`` table (``null`` counters for a node that did not answer)."""

VIEWS: dict[str, str] = {
    "trajectories": "SELECT * FROM _trajectories",
    "groups": """
        SELECT node, group_id, any_value(data_source) AS data_source, count(*) AS samples,
               min(policy_version) AS policy_version, max(policy_version) AS policy_version_max,
               avg(reward) AS reward_mean, min(reward) AS reward_min, max(reward) AS reward_max,
               sum(prompt_len + response_len)::BIGINT AS tokens, sum(response_len)::BIGINT AS response_tokens,
               count(*) FILTER (WHERE status = 'completed') AS completed, sum(bytes)::BIGINT AS bytes,
               bool_or(released) AS released, min(created_at) AS created_at, max(completed_at) AS completed_at
        FROM _trajectories GROUP BY node, group_id""",
    "inflight": "SELECT * FROM _inflight",
    "nodes": "SELECT * FROM _nodes",
}
"""Table -> the DuckDB view defining it over the snapshot's Arrow tables (``_trajectories``, ``_inflight``,
``_nodes``, registered per query)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the nodes held at :attr:`taken_at`, as Arrow tables."""

    trajectories: pa.Table
    inflight: pa.Table
    nodes: pa.Table
    taken_at: float
    """``time.monotonic()`` when the reads began."""

    @property
    def sources(self) -> dict[str, pa.Table]:
        """The Arrow tables the views read, by the name they are registered under."""
        return {"_trajectories": self.trajectories, "_inflight": self.inflight, "_nodes": self.nodes}


def read_snapshot(reader: StoreReader) -> Snapshot:
    """Read every reachable node's metadata, groups in flight and stats (three fan-outs, metadata only)."""
    start = time.monotonic()
    metadata = reader.scan_metadata(partial=True)
    failed = set(reader.last_failed_nodes)
    inflight = reader.inflight(partial=True).groups
    failed |= set(reader.last_failed_nodes)
    stats = reader.stats(partial=True)
    failed |= set(reader.last_failed_nodes)
    rows = []
    for n in reader.nodes:
        s = stats.get(n)
        if s is None or n in failed:
            rows.append({"node": n, "reachable": False})
            continue
        rows.append({"node": n, "reachable": True, "rows": s.rows, "groups_stored": s.groups.stored,
                     "groups_released": s.groups.released, "groups_inflight": s.groups.inflight, "bytes": s.bytes,
                     "images": s.images, "policy_version": s.policy_version, "weights_version": s.weights_version,
                     "memory_used": s.memory_used, "memory_budget": s.memory_budget, "uptime_s": s.uptime_s})
    return Snapshot(trajectories=metadata.to_arrow(), inflight=inflight.to_arrow(),
                    nodes=pa.Table.from_pylist(rows, schema=NODES_SCHEMA), taken_at=start)


def empty_snapshot() -> Snapshot:
    """A snapshot of nodes holding nothing: the tables' columns, no rows (as :func:`read_snapshot` types them)."""
    metadata = pl.from_arrow(METADATA_SCHEMA.empty_table())
    trajectories = metadata.with_columns(pl.lit(None, dtype=pl.String).alias("node")).to_arrow()  # type: ignore[union-attr]
    return Snapshot(trajectories=trajectories, inflight=pl.DataFrame(schema=INFLIGHT_COLUMNS).to_arrow(),
                    nodes=NODES_SCHEMA.empty_table(), taken_at=time.monotonic())


class Snapshots:
    """The newest :class:`Snapshot`, read again when older than ``max_age_s`` (one read at a time: queries that
    arrive during a read wait for it and share it)."""

    def __init__(self, reader: StoreReader, max_age_s: float) -> None:
        self._reader = reader
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self.reads = 0
        """Snapshots read from the nodes so far."""

    def get(self) -> Snapshot:
        with self._lock:
            latest = self._latest
            if latest is None or time.monotonic() - latest.taken_at > self._max_age_s:
                latest = self._latest = read_snapshot(self._reader)
                self.reads += 1
            return latest
