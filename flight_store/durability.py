"""Durability of a store: its changes as spill-log records, replay through the same commit path, compaction.

With a ``spill_dir``, the store appends every change it accepted to the node's
:class:`~flight_store.spill.SpillLog` (fsynced) BEFORE committing it in memory, so before DoPut
returns: a new group, a release, new images, a weights table, a published version (see
:mod:`flight_store.spill` for the file format and how damage is told from a torn tail). The store
does so under its lock, so the log order is the commit order. Only validated data is logged, so
replay cannot fail on a record that was acknowledged; a record that does not decode all the same
is corruption (:class:`~flight_store.spill.SpillCorruptionError` naming the file and offset).

A store opened on an existing spill directory replays the log with :meth:`Journal.replay`: each
record goes to the SAME commit method a live write ends with
(:class:`~flight_store.contents.StoreContents`), skipping only what a live write does before it
(validation, the memory budget, the RSS guard, logging). So unreleased groups come back with the
same ``seq`` for their metadata rows, released groups stay released (as tombstones: a retried write
of one is recognised), images, weights and the published version are restored.

Compaction (:meth:`Journal.maybe_compact`): once the log is larger than ``spill_compact_bytes`` and
twice what is live, it is rewritten atomically with only the live state: a ``state`` record (the next
``seq``, the published version), the tombstones, the live images and the unreleased groups with their
``seq``. Released payload leaves the disk.

Weights are the exception to the one log: each version is written once to its own file beside it
(``weights-<version>.log``, one frame, fsynced and renamed into place before the commit), removed once
superseded, and loaded after the log on replay. A weights table is hundreds of MB at each optimizer
step; in the log, every compaction would copy the kept versions again, about twice the weights' bytes
written per version (docs/benchmarks.md, measured by the tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from flight_store.blocks import Block
from flight_store.contents import StoreContents
from flight_store.spill import (
    Body,
    Recovery,
    SpillCorruptionError,
    SpillLog,
    decode_batches,
    encode_batches,
    frame_size,
    stream_of_messages,
)
from flight_store.weights import one_batch
from schemas.arrow import TRAJECTORY_SCHEMA

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights-{:012d}.log"
"""The file of one weights version beside the spill log (one framed record)."""
WEIGHTS_GLOB = "weights-" + "[0-9]" * 12 + ".log"


class Journal:
    """The store's spill log, one record per accepted change; a no-op without a ``spill_dir``."""

    def __init__(self, spill_dir: str | None, *, recovery: Recovery = "refuse", compact_bytes: int = 64 << 20) -> None:
        self._spill = SpillLog(spill_dir) if spill_dir is not None else None
        self._recovery = recovery
        self.compact_bytes = compact_bytes
        self.size = 0
        """Bytes in the log (as this journal wrote or read them)."""
        self.compactions = 0

    # ---- live writes: append a record (fsynced) before the commit ---------------------------------

    def group(self, group_id: str, blocks: Sequence[Block], meta: dict[str, str]) -> None:
        """Log a new group: its rows (its packed ``blocks``, written as they are), and the writer's schema metadata."""
        if self._spill is None:
            return
        header: dict[str, object] = {"kind": "group", "group_id": group_id}
        if meta:
            header["meta"] = meta
        self._append(header, stream_of_messages(TRAJECTORY_SCHEMA, blocks))

    def release(self, group_ids: list[str]) -> None:
        """Log the release of unreleased groups."""
        self._append({"kind": "release", "group_ids": group_ids})

    def images(self, rows: Sequence[pa.RecordBatch]) -> None:
        """Log new image rows."""
        if self._spill is not None:
            self._append({"kind": "images"}, encode_batches(rows))

    def weights(self, schema: pa.Schema, block: Block, version: int) -> None:
        """Log a weights table that becomes the newest (its packed ``block``, written as it is) in its own file:
        a version is written once and removed once superseded, never copied by a compaction."""
        if self._spill is not None:
            self._spill.write_file(WEIGHTS_FILE.format(version), {"kind": "weights", "version": int(version)},
                                   stream_of_messages(schema, [block]))

    def keep_weights(self, versions: Sequence[int], *, written: int | None = None) -> None:
        """Remove the weights files that ``versions`` (the kept ones) superseded, and the file of ``written`` (a
        version just written) unless it is kept. Files of newer versions are writes in flight: they stay."""
        if self._spill is None:
            return
        newest = max(versions, default=None)
        for path, version in self._weights_files():
            superseded = newest is not None and version < newest
            if version not in versions and (superseded or version == written):
                self._spill.remove_file(path.name)

    def _weights_files(self) -> list[tuple[Path, int]]:
        assert self._spill is not None
        return [(p, int(p.name[len("weights-"):-len(".log")])) for p in self._spill.directory.glob(WEIGHTS_GLOB)]

    def version(self, version: int) -> None:
        """Log a newer published policy version."""
        self._append({"kind": "version", "version": int(version)})

    def _append(self, header: dict[str, object], body: Body = b"") -> None:
        if self._spill is not None:
            self.size += self._spill.append(header, body)

    # ---- reopening: replay every record through the commit path -----------------------------------

    def replay(self, contents: StoreContents, node_name: str) -> dict[str, int]:
        """Commit every intact record of the log to ``contents``, in log order; returns what was restored.

        The answer counts records, groups (unreleased), released groups and metadata rows (empty
        counts without a spill log). The caller holds the store's lock.

        Raises:
            SpillCorruptionError: the log is damaged inside, or a record does not decode (with
                ``recovery="salvage"``, such a record is skipped with a warning instead).
        """
        if self._spill is None:
            return {}
        t0 = time.perf_counter()
        records = self._spill.records(recovery=self._recovery)
        files = self._spill.read_files(WEIGHTS_GLOB, recovery=self._recovery)
        for path, record in [(self._spill.path, r) for r in records] + files:
            try:
                _apply(contents, record.header, record.body, path)
            except (pa.ArrowException, KeyError, ValueError, TypeError) as exc:
                msg = (f"spill log {path}: the {record.header.get('kind')!r} record at offset "
                       f"{record.offset} does not decode ({type(exc).__name__}: {exc})")
                if self._recovery != "salvage":
                    raise SpillCorruptionError(msg, path=str(path), offset=record.offset) from None
                log.warning("%s; skipped (salvage)", msg)
        self.size = sum(frame_size(r.header, r.body) for r in records)
        self.keep_weights(contents.weights.versions)
        stored, released, _ = contents.groups.counts()
        rows = contents.metadata.seq
        count = len(records) + len(files)
        if count:
            log.info(
                "node %s: replayed %d spill records from %s in %.3fs: %d groups, %d released, %d metadata rows",
                node_name, count, self._spill.path, time.perf_counter() - t0, stored, released, rows,
            )
        return {"records": count, "groups": stored, "released": released, "rows": rows}

    # ---- compaction: the log rewritten with only what is live -----------------------------------

    def maybe_compact(self, contents: StoreContents) -> bool:
        """Rewrite the log with the live state when it is over ``compact_bytes`` and twice the live bytes it
        holds (the weights are in their own files)."""
        if self._spill is None or self.size <= self.compact_bytes:
            return False
        weights = sum(contents.weights.stored(v).nbytes for v in contents.weights.versions)
        if self.size <= 2 * (contents.memory.payload - weights):
            return False
        t0 = time.perf_counter()
        before = self.size
        records = snapshot(contents)
        self._spill.rewrite(records)
        self.size = sum(frame_size(h, b) for h, b in records)
        self.compactions += 1
        log.info("spill log %s compacted: %d -> %d bytes in %.3fs", self._spill.path, before, self.size,
                 time.perf_counter() - t0)
        return True

    def close(self) -> None:
        """Close the spill log; the store logs nothing after this (it keeps serving from memory)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None


def snapshot(contents: StoreContents) -> list[tuple[dict[str, Any], Body]]:
    """The records of a log holding exactly the live state of ``contents`` (see the module)."""
    out: list[tuple[dict[str, Any], Body]] = [
        ({"kind": "state", "next_seq": contents.metadata.seq, "version": contents.weights.published}, b"")]
    tombs = contents.groups.tombstones()
    if tombs:
        table = pa.table({"group_id": [g for g, _ in tombs], "rows": [t.rows for _, t in tombs],
                          "seq": [t.seq for _, t in tombs], "digests": [t.digests for _, t in tombs]})
        out.append(({"kind": "tombstones"}, encode_batches(table.to_batches(), table.schema)))
    images = contents.images.all_rows()
    if images:
        out.append(({"kind": "images"}, encode_batches(images)))
    for gid, group in contents.groups.live_items():
        header: dict[str, Any] = {"kind": "group", "group_id": gid, "seq": group.seq}
        if group.meta:
            header["meta"] = group.meta
        out.append((header, stream_of_messages(TRAJECTORY_SCHEMA, group.blocks)))
    return out


def _apply(contents: StoreContents, header: dict[str, Any], body: bytes, path: Path) -> None:
    """Commit one spill record to ``contents`` (an unknown kind is skipped with a warning)."""
    kind = header.get("kind")
    if kind == "group":
        contents.commit_group(str(header["group_id"]), decode_batches(body), meta=header.get("meta"),
                              seq=header.get("seq"))
    elif kind == "release":
        contents.commit_release([str(g) for g in header.get("group_ids", [])])
    elif kind == "images":
        contents.commit_images(contents.images.new(decode_batches(body)))
    elif kind == "weights":
        contents.commit_weights(one_batch(pa.Table.from_batches(decode_batches(body))), int(header["version"]))
    elif kind == "version":
        contents.commit_version(int(header["version"]))
    elif kind == "state":
        contents.metadata.seq = max(contents.metadata.seq, int(header["next_seq"]))
        contents.commit_version(int(header["version"]))
    elif kind == "tombstones":
        contents.restore_tombstones(pa.Table.from_batches(decode_batches(body)))
    else:
        log.warning("spill log %s: skipping a record of unknown kind %r", path, kind)
