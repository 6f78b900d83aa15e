"""Background fetch of micro-batches: while micro-batch i computes, micro-batch i+1 is being fetched.

A single worker thread owns the fetches (``StoreReader.fetch``: one read per node holding the
slices, over its read channels, rows in plan order) and the packing (Arrow -> numpy); the step loop only waits. The
lookahead is bounded: at most ``depth`` micro-batches are fetched ahead of the one the step loop
took last (``depth=0`` fetches on demand, the no-overlap reference). The time the step loop blocks
in :meth:`Prefetcher.get` is the *exposed wait*, recorded per micro-batch.

Example:
    >>> pf = Prefetcher(fetch=lambda item: item * 2, depth=1)
    >>> pf.submit([1, 2, 3])
    >>> [pf.get().value for _ in range(3)]
    [2, 4, 6]
    >>> pf.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Fetched:
    """One finished fetch."""

    item: Any
    """What was submitted."""
    value: Any
    """What ``fetch(item)`` returned."""
    fetch_s: float
    """Seconds the worker spent fetching and packing it."""
    wait_s: float = 0.0
    """Seconds the step loop blocked in ``get`` for it (exposed wait)."""


class Prefetcher:
    """Fetch submitted items in order on one background thread, at most ``depth`` ahead of ``get``.

    Args:
        fetch: called on the worker thread for each submitted item; its result (or exception) is
            handed to ``get`` in submission order.
        depth: items fetched ahead of the last one taken by ``get`` (0 = only when asked).
    """

    def __init__(self, fetch: Callable[[Any], Any], *, depth: int = 1) -> None:
        if depth < 0:
            msg = f"prefetch depth must be >= 0, got {depth}"
            raise ValueError(msg)
        self._fetch = fetch
        self._depth = depth
        self._cond = threading.Condition()
        self._todo: deque[Any] = deque()
        self._done: deque[Fetched | BaseException] = deque()
        self._taken = 0  # items handed out by get()
        self._started = 0  # items the worker began
        self._asked = 0  # get() calls waiting or done (for depth 0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="knit-prefetch", daemon=True)
        self._thread.start()

    def submit(self, items: Iterable[Any]) -> None:
        """Queue items to fetch, in order, after the ones already queued."""
        with self._cond:
            self._todo.extend(items)
            self._cond.notify_all()

    def _may_start(self) -> bool:
        return bool(self._todo) and (self._started < max(self._taken + self._depth, self._asked))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._may_start():
                    self._cond.wait()
                if self._closed:
                    return
                item = self._todo.popleft()
                self._started += 1
            t0 = time.perf_counter()
            result: Fetched | BaseException
            try:
                result = Fetched(item=item, value=self._fetch(item), fetch_s=time.perf_counter() - t0)
            except BaseException as exc:  # handed to the step loop, which re-raises it
                result = exc
            with self._cond:
                self._done.append(result)
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Fetched:
        """The next item's result in submission order; blocks (exposed wait) until it is fetched."""
        t0 = time.perf_counter()
        with self._cond:
            self._asked = self._taken + 1
            self._cond.notify_all()
            if not self._done and not self._todo and self._started == self._taken:
                msg = "Prefetcher.get() with nothing submitted"
                raise RuntimeError(msg)
            if not self._cond.wait_for(lambda: bool(self._done) or self._closed, timeout=timeout):
                msg = f"no micro-batch arrived within {timeout} s"
                raise TimeoutError(msg)
            if self._closed and not self._done:
                msg = "Prefetcher closed while waiting"
                raise RuntimeError(msg)
            result = self._done.popleft()
            self._taken += 1
            self._cond.notify_all()
        if isinstance(result, BaseException):
            raise result
        result.wait_s = time.perf_counter() - t0
        return result

    def close(self) -> None:
        """Stop the worker (an in-progress fetch finishes first)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
