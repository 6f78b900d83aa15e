"""What a store holds, and the ONE commit path that changes it (live writes and spill-log replay alike).

:class:`StoreContents` bundles the group table, the metadata log, the image table, the weights
slot and the groups in flight with the memory account, and commits already validated, deduplicated, budgeted and logged
changes to all of them at once: a group (its rows, metadata rows, image references, memory), a
release, new images, a weights table, a published version. It never refuses anything (the
store's write methods validate, reserve memory and append to the spill log first; replay commits
what the log holds, which was accepted once).

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from flight_store.blocks import Block, pack
from flight_store.dispatched import DispatchTable
from flight_store.groups import GroupTable
from flight_store.images import Image, ImageTable
from flight_store.memory import MemoryAccount
from flight_store.metadata import MetadataLog
from flight_store.weights import WeightsSlot


class StoreContents:
    """Groups, metadata log, images and weights of one store, and the commits that change them.

    Args:
        node_name: named in the errors of the tables.
        memory: the account every commit adds to (and every release frees from).
    """

    def __init__(self, node_name: str, memory: MemoryAccount, *, weights_versions: int = 2,
                 history_rows: int = 100_000, tombstones: int = 100_000) -> None:
        self.memory = memory
        self.history_rows = history_rows
        """Metadata rows of released groups kept for scans (beyond them the oldest groups' rows are dropped)."""
        self._history: deque[tuple[str, int]] = deque()  # released groups whose rows are still in the log
        self._history_rows = 0
        self.groups = GroupTable(node_name, tombstones=tombstones)
        self.metadata = MetadataLog()
        self.images = ImageTable(node_name)
        self.weights = WeightsSlot(node_name, keep=weights_versions)
        self.dispatched = DispatchTable()
        """Groups in flight to this node (soft state: never in the spill log)."""
        self.bytes_in = 0
        """Payload bytes committed (groups, images, weights)."""

    def commit_group(
        self, group_id: str, fresh: Sequence[pa.RecordBatch], packed: Sequence[tuple[Block, int]] | None = None,
        meta: dict[str, str] | None = None, seq: int | None = None, image_keys: frozenset[bytes] | None = None,
        sizes: Sequence[np.ndarray | None] = (),
    ) -> int:
        """Add the validated batches of the new group ``group_id`` (and their :func:`~flight_store.blocks.pack`).

        Their metadata rows get the next ``seq`` (or from ``seq``: a compacted log restores gaps), copied out of
        the blocks when the log next settles (:meth:`~flight_store.metadata.MetadataLog.settle`); the images
        they name (``image_keys``, when the caller read them already) gain a reference; ``meta`` is the writer's
        schema metadata; ``sizes`` their row sizes where validation read them
        (:class:`~schemas.native.Checked`). Returns the rows added.
        """
        if packed is None:
            packed = [pack(b) for b in fresh]
        first = self.metadata.append([block for block, _ in packed], sum(b.num_rows for b in fresh), seq)
        self.images.add_refs(self.groups.add(group_id, fresh, packed, meta, first, image_keys, sizes))
        payload = self.groups.live(group_id).nbytes
        self.memory.hold(sum(held for _, held in packed), payload)
        self.bytes_in += payload
        self.dispatched.resolve(group_id, "written")  # in flight until now: resolved with its rows, atomically
        return sum(b.num_rows for b in fresh)

    def commit_release(self, group_ids: Iterable[str], digests: Mapping[str, bytes] | None = None) -> int:
        """Free the payload of the unreleased groups among ``group_ids`` and the images only they named.

        ``digests``: the groups' content digests, when computed already. Returns how many groups were freed;
        their metadata history stays.
        """
        freed = 0
        self.metadata.settle()  # the log's rows still waiting in the blocks are copied before a block goes
        for gid in group_ids:
            group = self.groups.release(gid, (digests or {}).get(gid))
            if group is None:
                continue
            self.memory.hold(-group.held, -group.nbytes)
            for img in self.images.drop_refs(group.image_keys):
                self.memory.hold(-img.held, -img.nbytes)
            self._history.append((gid, group.rows))
            self._history_rows += group.rows
            freed += 1
        self._trim_history()
        return freed

    def _trim_history(self) -> None:
        """Drop the metadata rows of the oldest released groups beyond :attr:`history_rows` (a quarter at once)."""
        if self._history_rows <= self.history_rows + self.history_rows // 4:
            return
        gone: list[str] = []
        while self._history and self._history_rows > self.history_rows:
            gid, rows = self._history.popleft()
            self._history_rows -= rows
            gone.append(gid)
        self.metadata.drop(gone)

    def restore_tombstones(self, table: pa.Table) -> None:
        """Tombstones of released groups from a compacted spill log (``group_id``, ``rows``, ``seq``, ``digests``)."""
        for gid, rows, seq, digests in zip(*(table.column(c).to_pylist() for c in ("group_id", "rows", "seq",
                                                                                  "digests")), strict=True):
            self.groups.remember(gid, rows, digests, seq)
            self.groups.released_total += 1

    def commit_images(self, new: dict[bytes, Image]) -> int:
        """Add the images :meth:`ImageTable.new` selected; returns how many."""
        self.images.add(new)
        payload = sum(v.nbytes for v in new.values())
        self.memory.hold(sum(v.held for v in new.values()), payload)
        self.bytes_in += payload
        return len(new)

    def commit_weights(self, batch: pa.RecordBatch, version: int, packed: tuple[Block, int] | None = None) -> None:
        """Keep ``batch`` as the newest weights, of ``version`` (versions beyond the kept ones are freed)."""
        for old in self.weights.set(batch, version, packed):
            self.memory.hold(-old.held, -old.nbytes)
        stored = self.weights.stored(version)
        self.memory.hold(stored.held, stored.nbytes)
        self.bytes_in += stored.nbytes

    def commit_version(self, version: int) -> None:
        """Record ``version`` as the newest published policy version."""
        self.weights.publish(version)
