"""Durability of a store: its changes as spill-log records, and replay through the same commit path.

With a ``spill_dir``, the store appends every change it accepted to the node's
:class:`~flight_store.spill.SpillLog` (fsynced) BEFORE committing it in memory, so before DoPut
returns: a group's new rows, a release, new images, a weights table, a published version (see
:mod:`flight_store.spill` for the file format). The store does so under its lock, so the log
order is the commit order.

A store opened on an existing spill directory replays the log with :meth:`Journal.replay`: each
record goes to the SAME commit method a live write ends with
(:class:`~flight_store.contents.StoreContents`), skipping only what a live write does before it
(validation, the memory budget, the RSS guard, logging; everything in the log was accepted
once). So unreleased groups come back with the same ``seq`` for their metadata rows (numbering
continues after them), released groups stay released (their metadata history is kept), images,
weights and the published version are restored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from flight_store.contents import StoreContents
from flight_store.spill import SpillLog, decode_batches, encode_batches

log = logging.getLogger(__name__)


class Journal:
    """The store's spill log, one record per accepted change; a no-op without a ``spill_dir``."""

    def __init__(self, spill_dir: str | None) -> None:
        self._spill = SpillLog(spill_dir) if spill_dir is not None else None

    # ---- live writes: append a record (fsynced) before the commit ---------------------------------

    def group(self, group_id: str, fresh: Sequence[pa.RecordBatch], meta: dict[str, str]) -> None:
        """Log a new group: its rows, and the writer's schema metadata."""
        header: dict[str, object] = {"kind": "group", "group_id": group_id}
        if meta:
            header["meta"] = meta
        self._append(header, encode_batches(fresh))

    def release(self, group_ids: list[str]) -> None:
        """Log the release of unreleased groups."""
        self._append({"kind": "release", "group_ids": group_ids})

    def images(self, rows: Sequence[pa.RecordBatch]) -> None:
        """Log new image rows."""
        self._append({"kind": "images"}, encode_batches(rows))

    def weights(self, table: pa.Table, version: int) -> None:
        """Log a weights table that replaces the stored one."""
        self._append({"kind": "weights", "version": int(version)}, encode_batches(table.to_batches(), table.schema))

    def version(self, version: int) -> None:
        """Log a newer published policy version."""
        self._append({"kind": "version", "version": int(version)})

    def _append(self, header: dict[str, object], body: bytes = b"") -> None:
        if self._spill is not None:
            self._spill.append(header, body)

    # ---- reopening: replay every record through the commit path -----------------------------------

    def replay(self, contents: StoreContents, node_name: str) -> dict[str, int]:
        """Commit every intact record of the log to ``contents``, in log order; returns what was restored.

        The answer counts records, groups (unreleased), released groups and metadata rows (empty
        counts without a spill log). The caller holds the store's lock.
        """
        if self._spill is None:
            return {}
        t0 = time.perf_counter()
        records = 0
        for header, body in self._spill.replay():
            records += 1
            _apply(contents, header, body, self._spill.path)
        stored, released, _ = contents.groups.counts()
        rows = contents.metadata.seq
        if records:
            log.info(
                "node %s: replayed %d spill records from %s in %.3fs: %d groups, %d released, %d metadata rows",
                node_name, records, self._spill.path, time.perf_counter() - t0, stored, released, rows,
            )
        return {"records": records, "groups": stored, "released": released, "rows": rows}

    def close(self) -> None:
        """Close the spill log; the store logs nothing after this (it keeps serving from memory)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None


def _apply(contents: StoreContents, header: dict[str, Any], body: bytes, path: Path) -> None:
    """Commit one spill record to ``contents`` (an unknown kind is skipped with a warning)."""
    kind = header.get("kind")
    if kind == "group":
        contents.commit_group(str(header["group_id"]), decode_batches(body), meta=header.get("meta"))
    elif kind == "release":
        contents.commit_release([str(g) for g in header.get("group_ids", [])])
    elif kind == "images":
        contents.commit_images(contents.images.new(decode_batches(body)))
    elif kind == "weights":
        contents.commit_weights(pa.Table.from_batches(decode_batches(body)), int(header["version"]))
    elif kind == "version":
        contents.commit_version(int(header["version"]))
    else:
        log.warning("spill log %s: skipping a record of unknown kind %r", path, kind)
