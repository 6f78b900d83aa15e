"""The group writer: DoPuts of the rollout's images and prompt groups, in order, off the step loop.

Guarantees:

* **order**: writes run in the order they were queued, one at a time, so a group's images are
  stored before the group that references them;
* **bounded queue**: ``put_*`` waits while ``max_queued`` writes are queued, so a slow store slows the
  step loop down instead of growing memory;
* **errors surface**: a failed write is re-raised by a later ``put_*`` (as soon as it is seen done) or
  by ``flush``; nothing fails silently;
* ``background=False`` writes inline (``put_*`` returns when the DoPut is done).

The writer times its DoPuts (``write_s``) and records when each group was written (``write_times``).

Example::

    writer = GroupWriter(client)
    writer.put_images(images, node); writer.put_group(batch, node)
    writer.close()  # flushes; raises the first failed write
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from flight_store.writing import StoreWriter
from schemas.wire import DispatchedGroup, ResolveReason


class GroupWriter:
    """Writes images and groups to their store nodes through ``client``, in queue order.

    Args:
        client: the rollout's store client (``put_images``, ``put_group``, ``dispatch``, ``resolve``).
        background: DoPut from one background thread; ``False`` writes inline.
        max_queued: with ``background``, most writes queued before ``put_*`` waits.
    """

    def __init__(self, client: StoreWriter, *, background: bool = True, max_queued: int = 64) -> None:
        if max_queued < 1:
            msg = f"max_queued={max_queued} must be >= 1"
            raise ValueError(msg)
        self._client = client
        self._max_queued = max_queued
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knit-rollout-writer") \
            if background else None
        self._queued: deque[Future[object]] = deque()
        self._lock = threading.Lock()
        self.write_s = 0.0
        """Seconds spent in DoPut calls (images and groups)."""
        self.write_times: list[float] = []
        """Unix time each group was written, in write order."""

    def put_images(self, table: pa.Table, node: str) -> None:
        """Queue the DoPut of an images table to ``node``."""

        def put() -> None:
            t0 = time.perf_counter()
            self._client.put_images(table, node=node)
            with self._lock:
                self.write_s += time.perf_counter() - t0

        self._submit(put)

    def put_group(self, batch: pa.RecordBatch, node: str | None,
                  on_written: Callable[[str], None] | None = None) -> None:
        """Queue the DoPut of one group's record batch to ``node`` (``None``: the node routing gives it when written;
        after everything queued before); ``on_written`` is called with the node that took it."""

        def put() -> None:
            t0 = time.perf_counter()
            written = self._client.put_group(batch, node=node)
            now = time.time()
            with self._lock:
                self.write_s += time.perf_counter() - t0
                self.write_times.append(now)
            if on_written is not None:
                on_written(written)

        self._submit(put)

    def dispatch(self, groups: list[DispatchedGroup]) -> None:
        """Queue the registration of groups in flight (``StoreWriter.dispatch``), in order with the writes."""
        self._submit(lambda: self._client.dispatch(groups))

    def resolve(self, group_ids: list[str], reason: ResolveReason) -> None:
        """Queue taking groups out of flight without rows (``StoreWriter.resolve``)."""
        self._submit(lambda: self._client.resolve(group_ids, reason))

    def flush(self) -> None:
        """Wait for every queued write; re-raise the first write error."""
        while self._queued:
            self._queued.popleft().result()

    def close(self) -> None:
        """Flush, then stop the writer thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _submit(self, fn: Callable[[], object]) -> None:
        if self._pool is None:
            fn()
            return
        while self._queued and self._queued[0].done():
            self._queued.popleft().result()  # surfaces a failed write promptly
        while len(self._queued) >= self._max_queued:
            self._queued.popleft().result()
        self._queued.append(self._pool.submit(fn))
