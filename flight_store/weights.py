"""The weights a store holds: the last few weights tables by version, and the newest published version.

Both only move forward: a weights table not newer than the latest stored one is ignored, and so is
a published policy version older than the stored one. The newest ``keep`` versions are kept
(``StoreConfig.weights_versions``); storing one more frees the oldest. Each table is copied into a
block of its own (:func:`flight_store.blocks.pack`), so it holds exactly what the budget counts.

Not thread-safe by itself: the store calls a :class:`WeightsSlot` under its lock.

Example:
    >>> import pyarrow as pa
    >>> slot = WeightsSlot("n0", keep=1)
    >>> slot.accepts(3)
    True
    >>> freed = slot.set(pa.record_batch({"name": ["w"]}), 3)
    >>> slot.accepts(3), slot.get()[1]
    (False, 3)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import pyarrow as pa

from flight_store.blocks import Block, pack, view
from flight_store.errors import UnknownWeightsError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoredWeights:
    """One weights version in its block."""

    block: Block
    schema: pa.Schema
    nbytes: int
    """Payload bytes of the table."""
    held: int
    """Memory counted against the budget."""

    @property
    def table(self) -> pa.Table:
        """The table (zero-copy views into its block)."""
        return pa.Table.from_batches([view(self.block, self.schema)])


class WeightsSlot:
    """The newest ``keep`` weights tables by version, and the newest published policy version."""

    def __init__(self, node_name: str, *, keep: int = 2) -> None:
        self.node_name = node_name
        self.keep = keep
        self._versions: OrderedDict[int, StoredWeights] = OrderedDict()
        self.published = 0
        """The newest published policy version (0 before any publish)."""

    @property
    def version(self) -> int | None:
        """The latest stored weights version (``None`` before any weights)."""
        return next(reversed(self._versions)) if self._versions else None

    @property
    def versions(self) -> list[int]:
        """The stored versions, oldest first."""
        return list(self._versions)

    def held(self, version: int) -> int:
        """Memory the stored ``version`` holds."""
        return self._versions[version].held

    def stored(self, version: int) -> StoredWeights:
        """The stored ``version``."""
        return self._versions[version]

    def accepts(self, version: int) -> bool:
        """Whether weights of ``version`` would be newer than the latest stored; logs a refusal."""
        latest = self.version
        if latest is not None and version <= latest:
            log.info("ignoring weights v%d: v%d is stored already", version, latest)
            return False
        return True

    def leaving(self) -> int | None:
        """The version storing another one would push out (``None`` while fewer than ``keep`` are stored)."""
        return self.versions[0] if len(self._versions) >= self.keep else None

    def set(self, batch: pa.RecordBatch, version: int, packed: tuple[Block, int] | None = None) -> list[StoredWeights]:
        """Keep ``batch`` (already checked: see :func:`one_batch`) as the newest weights, of ``version``; returns the
        versions it pushed out (their memory is the caller's to free)."""
        block, held = packed if packed is not None else pack(batch)
        self._versions[version] = StoredWeights(block=block, schema=batch.schema, nbytes=batch.nbytes, held=held)
        freed = []
        while len(self._versions) > self.keep:
            freed.append(self._versions.popitem(last=False)[1])
        return freed

    def get(self, version: int | None = None) -> tuple[pa.Table, int]:
        """The latest weights and their version (exactly ``version`` when given); else :class:`UnknownWeightsError`."""
        if not self._versions:
            msg = f"no weights are stored on node {self.node_name}"
            raise UnknownWeightsError(msg, version=version)
        chosen = self.version if version is None else version
        stored = self._versions.get(chosen) if chosen is not None else None
        if stored is None or chosen is None:
            msg = (f"weights v{version} are not stored on node {self.node_name} (stored: "
                   f"{', '.join(f'v{v}' for v in self._versions)})")
            raise UnknownWeightsError(msg, version=version)
        return stored.table, chosen

    def newer(self, version: int) -> bool:
        """Whether ``version`` is newer than the published one."""
        return version > self.published

    def publish(self, version: int) -> None:
        """Record ``version`` as published (never moves back)."""
        self.published = max(self.published, version)


def one_batch(table: pa.Table) -> pa.RecordBatch:
    """A weights table as the one record batch it is stored as."""
    combined = table.combine_chunks().to_batches()
    return combined[0] if combined else pa.RecordBatch.from_pylist([], schema=table.schema)
