"""The weights a store holds: the latest weights table and its version, and the newest published version.

Both only move forward: a weights table older than the stored one is ignored, and so is a
published policy version older than the stored one.

Not thread-safe by itself: the store calls a :class:`WeightsSlot` under its lock.

Example:
    >>> import pyarrow as pa
    >>> slot = WeightsSlot("n0")
    >>> slot.accepts(3)
    True
    >>> slot.set(pa.table({"name": ["w"]}), 3)
    >>> slot.accepts(2), slot.get()[1]
    (False, 3)
"""

from __future__ import annotations

import logging

import pyarrow as pa

from flight_store.errors import UnknownWeightsError

log = logging.getLogger(__name__)


class WeightsSlot:
    """The latest weights table (with its version) and the newest published policy version."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.table: pa.Table | None = None
        self.version: int | None = None
        """Version of :attr:`table` (``None`` before any weights)."""
        self.published = 0
        """The newest published policy version (0 before any publish)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weights table (0 without one)."""
        return self.table.nbytes if self.table is not None else 0

    def accepts(self, version: int) -> bool:
        """Whether weights of ``version`` would replace the stored ones (not older); logs a refusal."""
        if self.version is not None and version < self.version:
            log.info("ignoring weights v%d older than stored v%d", version, self.version)
            return False
        return True

    def set(self, table: pa.Table, version: int) -> None:
        """Keep ``table`` as the latest weights, of ``version``."""
        self.table, self.version = table, version

    def get(self, version: int | None = None) -> tuple[pa.Table, int]:
        """The latest weights and their version (exactly ``version`` when given); else :class:`UnknownWeightsError`."""
        if self.table is None or self.version is None:
            msg = f"no weights are stored on node {self.node_name}"
            raise UnknownWeightsError(msg, version=version)
        if version is not None and version != self.version:
            msg = f"weights v{version} are not stored on node {self.node_name} (latest v{self.version})"
            raise UnknownWeightsError(msg, version=version)
        return self.table, self.version

    def newer(self, version: int) -> bool:
        """Whether ``version`` is newer than the published one."""
        return version > self.published

    def publish(self, version: int) -> None:
        """Record ``version`` as published (never moves back)."""
        self.published = max(self.published, version)
