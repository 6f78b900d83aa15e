"""What a store holds, and the ONE commit path that changes it (live writes and spill-log replay alike).

:class:`StoreContents` bundles the group table, the metadata log, the image table and the weights
slot with the memory account, and commits already validated, deduplicated, budgeted and logged
changes to all of them at once: a group (its rows, metadata rows, image references, memory), a
release, new images, a weights table, a published version. It never refuses anything (the
store's write methods validate, reserve memory and append to the spill log first; replay commits
what the log holds, which was accepted once).

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyarrow as pa

from flight_store.groups import GroupTable
from flight_store.images import Image, ImageTable
from flight_store.memory import Block, MemoryAccount, pack
from flight_store.metadata import MetadataLog
from flight_store.weights import WeightsSlot


class StoreContents:
    """Groups, metadata log, images and weights of one store, and the commits that change them.

    Args:
        node_name: named in the errors of the tables.
        memory: the account every commit adds to (and every release frees from).
    """

    def __init__(self, node_name: str, memory: MemoryAccount) -> None:
        self.memory = memory
        self.groups = GroupTable(node_name)
        self.metadata = MetadataLog()
        self.images = ImageTable(node_name)
        self.weights = WeightsSlot(node_name)
        self.bytes_in = 0
        """Payload bytes committed (groups, images, weights)."""

    def commit_group(
        self, group_id: str, fresh: Sequence[pa.RecordBatch], packed: Sequence[tuple[Block, int]] | None = None,
        meta: dict[str, str] | None = None,
    ) -> int:
        """Add the validated batches of the new group ``group_id`` (and their :func:`~flight_store.memory.pack`).

        Their metadata rows get the next ``seq``; the images they name gain a reference; ``meta`` is the
        writer's schema metadata. Returns the rows added.
        """
        if packed is None:
            packed = [pack(b) for b in fresh]
        self.images.add_refs(self.groups.add(group_id, fresh, packed, meta))
        self.metadata.append(fresh)
        payload = sum(b.nbytes for b in fresh)
        self.memory.hold(sum(held for _, held in packed), payload)
        self.bytes_in += payload
        return sum(b.num_rows for b in fresh)

    def commit_release(self, group_ids: Iterable[str]) -> int:
        """Free the payload of the unreleased groups among ``group_ids`` and the images only they named.

        Returns how many groups were freed; their metadata history stays.
        """
        freed = 0
        for gid in group_ids:
            group = self.groups.release(gid)
            if group is None:
                continue
            self.memory.hold(-group.held, -group.nbytes)
            for img in self.images.drop_refs(group.image_keys):
                self.memory.hold(-img.held, -img.nbytes)
            freed += 1
        return freed

    def commit_images(self, new: dict[bytes, Image]) -> int:
        """Add the images :meth:`ImageTable.new` selected; returns how many."""
        self.images.add(new)
        payload = sum(v.nbytes for v in new.values())
        self.memory.hold(sum(v.held for v in new.values()), payload)
        self.bytes_in += payload
        return len(new)

    def commit_weights(self, table: pa.Table, version: int) -> None:
        """Keep ``table`` as the latest weights, of ``version`` (the older table is freed)."""
        grown = table.nbytes - self.weights.nbytes
        self.memory.hold(grown, grown)
        self.weights.set(table, version)
        self.bytes_in += table.nbytes

    def commit_version(self, version: int) -> None:
        """Record ``version`` as the newest published policy version."""
        self.weights.publish(version)
