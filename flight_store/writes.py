"""Admission of writers to a node: a cap on DoPuts received at once, and an idle limit per stream.

Every DoPut takes a slot of :class:`WriteSlots` before it reads its stream (none free: a retryable
:class:`TooManyWritersError`) and gives it back when it answers. A watchdog thread gives up a write
whose stream has not delivered a batch for ``idle_timeout_s``: its slot and the memory it reserved
(:class:`~flight_store.memory.Incoming`) go back at once, so writers that stall cannot hold a node
hostage; when its stream resumes or ends, the write is refused (retryable
:class:`WriteTimedOutError`) and nothing of it is stored.

What stays: the stalled call's server thread, blocked in gRPC until the client sends or its
connection closes (gRPC ends a call only when its handler returns, and a handler waiting for the
client's next message cannot return; the node never sees more than that thread and the bytes it
already counted).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from flight_store.errors import TooManyWritersError, WriteTimedOutError
from flight_store.memory import Incoming

log = logging.getLogger(__name__)


class Write:
    """One DoPut holding a slot: when it last received a batch, and what it reserved."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.incoming: Incoming | None = None
        self.given_up = False

    def touch(self) -> None:
        """A batch arrived (or the stream ended); refuses the write if the watchdog gave it up meanwhile."""
        if self.given_up:
            msg = "the write's stream stalled longer than the node's idle limit and was given up; nothing stored"
            raise WriteTimedOutError(msg)
        self.last = time.monotonic()


class WriteSlots:
    """At most ``max_writers`` DoPuts received at once; a stream idle for ``idle_timeout_s`` loses its slot.

    Example:
        >>> slots = WriteSlots(max_writers=1, idle_timeout_s=30.0)
        >>> with slots.slot() as write:
        ...     write.touch()
        >>> slots.active
        0
        >>> slots.close()
    """

    def __init__(self, *, max_writers: int, idle_timeout_s: float) -> None:
        self.max_writers = max_writers
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._open: set[Write] = set()
        self.given_up = 0
        """Writes given up for idling, since the node started."""
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="knit-write-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def active(self) -> int:
        """Writes holding a slot now."""
        with self._lock:
            return len(self._open)

    @contextlib.contextmanager
    def slot(self) -> Iterator[Write]:
        """Hold a slot for one DoPut (refused with :class:`TooManyWritersError` when none is free)."""
        write = Write()
        with self._lock:
            if len(self._open) >= self.max_writers:
                msg = (f"the node is receiving {len(self._open)} writes, its limit; retry shortly "
                       "(nothing was stored)")
                raise TooManyWritersError(msg, limit=self.max_writers)
            self._open.add(write)
        try:
            yield write
        finally:
            with self._lock:
                self._open.discard(write)

    def _watch(self) -> None:
        period = min(0.25, self.idle_timeout_s / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._open if now - w.last > self.idle_timeout_s]
                for w in idle:
                    w.given_up = True
                    self._open.discard(w)
                    self.given_up += 1
            for w in idle:
                if w.incoming is not None:
                    w.incoming.release()
                log.warning("gave up a write idle for more than %.1f s (its slot and reservation are free)",
                            self.idle_timeout_s)

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()
        self._watchdog.join(timeout=5)
