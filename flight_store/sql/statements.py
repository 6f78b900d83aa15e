"""What the SQL gateway holds between calls: results waiting for their DoGet, and prepared statements.

Flight SQL runs a query in two calls (GetFlightInfo, then DoGet with the ticket it returned) and a prepared
statement in up to four (create, bind parameters by DoPut, execute, close). Both are held here by an opaque
random handle, bounded in number (the oldest is dropped first) and in time (one unused for ``ttl_s`` is
dropped), so a client that never fetches or never closes costs nothing for long.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from flight_store.sql.errors import UnknownStatementError


@dataclass(slots=True)
class Prepared:
    """A prepared statement: its query and the parameter rows bound to it (positional values per row)."""

    query: str
    params: Sequence[Sequence[Any]] | None = None


class Held:
    """Results and prepared statements by handle (thread-safe)."""

    def __init__(self, max_items: int, ttl_s: float) -> None:
        self._max = max_items
        self._ttl_s = ttl_s
        self._items: OrderedDict[bytes, tuple[pa.Table | Prepared, float]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, item: pa.Table | Prepared) -> bytes:
        """Hold ``item``; returns its handle."""
        handle = secrets.token_bytes(16)
        with self._lock:
            self._expire()
            self._items[handle] = (item, time.monotonic())
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        return handle

    def result(self, handle: bytes) -> pa.Table:
        """The result held under ``handle``, let go of (a result is fetched once)."""
        item = self._get(handle, "result", pop=True)
        if not isinstance(item, pa.Table):
            raise UnknownStatementError("the ticket names a prepared statement, not a result")
        return item

    def prepared(self, handle: bytes) -> Prepared:
        """The prepared statement held under ``handle`` (its time to live starts again)."""
        item = self._get(handle, "prepared statement", pop=False)
        if not isinstance(item, Prepared):
            raise UnknownStatementError("the handle names a result, not a prepared statement")
        return item

    def drop(self, handle: bytes) -> bool:
        """Let go of ``handle``'s item; whether one was held."""
        with self._lock:
            return self._items.pop(handle, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _get(self, handle: bytes, what: str, *, pop: bool) -> pa.Table | Prepared:
        with self._lock:
            self._expire()
            held = self._items.pop(handle, None) if pop else self._items.get(handle)
            if held is None:
                msg = (f"no {what} is held under this handle: it was fetched or closed already, or unused for "
                       f"{self._ttl_s:g} s, or dropped as one of more than {self._max} held at once")
                raise UnknownStatementError(msg)
            if not pop:
                self._items[handle] = (held[0], time.monotonic())
                self._items.move_to_end(handle)
            return held[0]

    def _expire(self) -> None:
        """Drop the items unused for longer than the time to live (oldest first; under the lock)."""
        now = time.monotonic()
        while self._items:
            handle, (_, used) = next(iter(self._items.items()))
            if now - used <= self._ttl_s:
                return
            del self._items[handle]
