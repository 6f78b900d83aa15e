"""Admission of writers to a node: a cap on DoPuts received at once, a cap per peer, and an idle limit per stream.

Every DoPut takes a slot of :class:`WriteSlots` before it reads its stream and gives it back when it answers.
Its peer holding ``max_writers_per_peer`` slots already: a retryable :class:`TooManyPeerWritersError`. No slot
free: the new writer takes the slot of the write idle longest, if that one has delivered no rows for
``evict_idle_s`` (the evicted write is refused as a given-up one is, below); otherwise a retryable
:class:`TooManyWritersError`. So however many connections hold idle streams, an honest writer gets a slot
within ``evict_idle_s`` of its first try, and a write that keeps delivering rows is never evicted.

A peer is one client connection (gRPC's peer, ``ipv4:host:port``): the bearer token is shared by every part of
a run and the address by every process of a host, so only the connection tells one writer from another; a
client that holds many idle streams on its connection fills its own share, never the node. A watchdog thread
gives up a write whose stream has delivered no rows for ``idle_timeout_s``: its slot and the memory it reserved
(:class:`~flight_store.memory.Incoming`) go back at once, so writers that stall cannot hold a node hostage;
when its stream resumes or ends, the write is refused (retryable :class:`WriteTimedOutError`) and nothing of it
is stored.

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

from flight_store.errors import TooManyPeerWritersError, TooManyWritersError, WriteTimedOutError
from flight_store.memory import Incoming

log = logging.getLogger(__name__)


class Write:
    """One DoPut holding a slot: its peer, when it last received a batch, and what it reserved."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.last = time.monotonic()
        self.incoming: Incoming | None = None
        self.given_up: str | None = None
        """Why the node gave the write up (its slot is someone else's now), ``None`` while it holds its slot."""

    def touch(self) -> None:
        """Rows arrived (or the stream ended); refuses the write if the node gave it up meanwhile."""
        if self.given_up is not None:
            msg = f"the write's stream {self.given_up} and was given up; nothing stored"
            raise WriteTimedOutError(msg)
        self.last = time.monotonic()


class WriteSlots:
    """At most ``max_writers`` DoPuts received at once, ``max_writers_per_peer`` of them from one peer; a stream
    idle for ``idle_timeout_s`` loses its slot, one idle for ``evict_idle_s`` loses it to a new writer when the
    node is full.

    Example:
        >>> slots = WriteSlots(max_writers=4, max_writers_per_peer=1, idle_timeout_s=30.0, evict_idle_s=1.0)
        >>> with slots.slot("ipv4:10.0.0.1:5000") as write, slots.slot("ipv4:10.0.0.1:5001"):
        ...     write.touch()
        ...     slots.active
        2
        >>> slots.close()
    """

    def __init__(self, *, max_writers: int, idle_timeout_s: float, max_writers_per_peer: int | None = None,
                 evict_idle_s: float | None = None) -> None:
        self.max_writers = max_writers
        self.max_writers_per_peer = max_writers_per_peer if max_writers_per_peer is not None else max_writers
        self.idle_timeout_s = idle_timeout_s
        self.evict_idle_s = evict_idle_s if evict_idle_s is not None else idle_timeout_s
        self._lock = threading.Lock()
        self._open: set[Write] = set()
        self._per_peer: dict[str, int] = {}  # slots held, by peer (only peers holding one)
        self.given_up = 0
        """Writes given up for idling past ``idle_timeout_s``, since the node started."""
        self.evicted = 0
        """Writes whose slot went to a new writer, since the node started."""
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="knit-write-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def active(self) -> int:
        """Writes holding a slot now."""
        with self._lock:
            return len(self._open)

    @contextlib.contextmanager
    def slot(self, peer: str = "") -> Iterator[Write]:
        """Hold a slot for one DoPut from ``peer`` (refused with :class:`TooManyPeerWritersError` when the peer
        holds its share, with :class:`TooManyWritersError` when no slot is free)."""
        write = Write(peer)
        evicted: Write | None = None
        with self._lock:
            held = self._per_peer.get(peer, 0)
            if held >= self.max_writers_per_peer:
                msg = (f"this connection ({peer}) has {held} writes in progress on the node, the most one peer may "
                       "have (max_writers_per_peer); end one or retry shortly (nothing was stored)")
                raise TooManyPeerWritersError(msg, limit=self.max_writers_per_peer, peer=peer)
            if len(self._open) >= self.max_writers:
                evicted = min(self._open, key=lambda w: w.last)
                if write.last - evicted.last < self.evict_idle_s:
                    msg = (f"the node is receiving {len(self._open)} writes, its limit, and none has been idle for "
                           f"{self.evict_idle_s:g} s; retry shortly (nothing was stored)")
                    raise TooManyWritersError(msg, limit=self.max_writers)
                self._give_up(evicted, f"delivered nothing for {self.evict_idle_s:g} s while the node was full")
                self.evicted += 1
            self._open.add(write)
            self._per_peer[peer] = held + 1
        if evicted is not None:
            _release(evicted)
            log.info("a new writer took the slot of a write idle for more than %.1f s (the node is full)",
                     self.evict_idle_s)
        try:
            yield write
        finally:
            with self._lock:
                self._drop(write)

    def _give_up(self, write: Write, why: str) -> None:
        """Take ``write``'s slot (the caller holds the lock); it is refused when its stream resumes or ends."""
        write.given_up = why
        self._drop(write)

    def _drop(self, write: Write) -> None:
        """Give ``write``'s slot back (the caller holds the lock; a slot given back twice counts once)."""
        if write in self._open:
            self._open.discard(write)
            left = self._per_peer[write.peer] - 1
            if left:
                self._per_peer[write.peer] = left
            else:
                del self._per_peer[write.peer]

    def _watch(self) -> None:
        period = min(0.25, self.idle_timeout_s / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._open if now - w.last > self.idle_timeout_s]
                for w in idle:
                    self._give_up(w, "stalled longer than the node's idle limit")
                    self.given_up += 1
            for w in idle:
                _release(w)
                log.warning("gave up a write idle for more than %.1f s (its slot and reservation are free)",
                            self.idle_timeout_s)

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()
        self._watchdog.join(timeout=5)


def _release(write: Write) -> None:
    """Give back the memory a given-up write reserved (its thread may still be blocked in gRPC)."""
    if write.incoming is not None:
        write.incoming.release()
