"""The store's memory: allocator tuning, the budget and the RSS guard (the blocks stored batches live in:
:mod:`flight_store.blocks`).

* **allocators**: :func:`cap_malloc_arenas` and :func:`return_free_memory` keep glibc malloc and the
  Arrow pool from holding freed memory while a node with a memory budget serves dozens of concurrent
  RPCs (a node without one leaves them alone: :meth:`MemoryAccount.free_unused`);
* **accounting**: :class:`MemoryAccount` counts what the stored data holds (``used``), what writes
  in flight hold (``in_flight``) and the payload bytes, refuses what does not fit the budget
  (:meth:`MemoryAccount.reserve`) and, with the RSS guard, what the process's resident memory
  cannot take (:meth:`MemoryAccount.check_rss`).

Not thread-safe by itself: the store calls a :class:`MemoryAccount` under its lock, which the
account shares (:meth:`MemoryAccount.incoming` and :meth:`MemoryAccount.reading` take it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import pyarrow as pa

from flight_store.errors import BudgetExceededError, CapacityExceededError, WriteTimedOutError

log = logging.getLogger(__name__)

# ---- allocators ------------------------------------------------------------------------------------


def _libc_function(name: str) -> Callable[..., int] | None:
    """A glibc malloc tuning function (``None`` elsewhere)."""
    try:
        return cast(Callable[..., int], getattr(ctypes.CDLL(None), name))
    except (AttributeError, OSError):  # not glibc
        return None


_malloc_trim = _libc_function("malloc_trim")
_M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20
_MALLOC_ARENAS = 2
_arenas_capped = False
_TRIM_EVERY_S = 0.05
_trim_lock = threading.Lock()
_trimmed_at = 0.0


def cap_malloc_arenas() -> None:
    """Let glibc malloc use at most :data:`_MALLOC_ARENAS` arenas in this process (once; needs glibc).

    A store with a memory budget is a node process serving dozens of concurrent RPCs, each on a
    gRPC thread; by default glibc gives up to 8 x cores threads arenas of their own, each keeping
    its high-water mark of transient buffers (in the 64-writer load test ~3 MiB more at peak).
    An explicit ``MALLOC_ARENA_MAX`` in the environment wins.

    Also pins glibc's mmap threshold at :data:`_MMAP_THRESHOLD`: by default glibc raises it (up to
    32 MiB) each time a large mapped block is freed, after which large transient buffers (a request of
    several MB, refused or served) come from the heap and stay resident after they are freed. Pinned,
    each is mapped on its own and unmapped when freed. ``MALLOC_MMAP_THRESHOLD_`` in the environment wins.
    """
    global _arenas_capped
    if _arenas_capped:
        return
    _arenas_capped = True
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return
    if "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(_M_ARENA_MAX, _MALLOC_ARENAS)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def return_free_memory(*, force: bool = False) -> None:
    """Give the memory allocators hold but nothing uses back to the OS (after a write or a release).

    Two allocators keep freed memory resident while a node serves dozens of concurrent RPCs, each
    on its own gRPC thread: the Arrow pool (mimalloc) keeps the pages a thread freed until that
    thread allocates again, so validation's temporaries are returned right away on the calling
    thread (``release_unused``, ~1 us); glibc malloc (gRPC's message buffers, numpy, Python) keeps
    freed chunks in up to 8 x cores arenas, so ``malloc_trim`` runs at most every
    :data:`_TRIM_EVERY_S` (~0.2 ms each). In the 64-writer load test these held 10-50 MiB, as much
    as a 64 MiB budget's worth of groups the budget could not see. ``force`` trims now (after a large
    answer was sent: what it borrowed must not stand in the way of the next write). A node without a
    budget does none of this (see :meth:`MemoryAccount.free_unused`).
    """
    global _trimmed_at
    pa.default_memory_pool().release_unused()
    if _malloc_trim is None:
        return
    now = time.monotonic()
    if (now - _trimmed_at < _TRIM_EVERY_S and not force) or not _trim_lock.acquire(blocking=force):
        return
    try:
        _trimmed_at = now
        _malloc_trim(0)
    finally:
        _trim_lock.release()


# ---- accounting ----------------------------------------------------------------------------------

WRITE_OVERHEAD = 256 << 10
"""Bytes a DoPut holds while it is received and processed besides its batches and their copies: its gRPC
server thread's call state, buffers and allocator caches (RSS grew ~110-210 KiB per concurrent writer)."""
COPIES_IN_FLIGHT = 3
"""Copies of a write's batches alive while it is processed: the received message, the serialized
message and the block being filled (the block is counted as stored once committed)."""
HELD_CALL_RSS = 192 << 10
"""Resident memory the RSS guard allows beyond the budget for each DoPut and read channel in progress: a held
call's server thread and gRPC buffers (about 150 KiB, measured by bench.streams), so idle calls never lock writes
out (see :meth:`MemoryAccount.reading`)."""
ANSWER_COPIES = 2
"""Copies of a large answer resident while it is sent, as the RSS guard allows them: the rows copied into the
answer's chunks and their serialized messages; a client that stops reading keeps them (RSS grew ~1.6x the answer
per stalled reader)."""


@dataclass(slots=True)
class _ResidentMemory:
    """The process's resident set size, read from ``/proc/self/statm`` (~2 us a read)."""

    fd: int

    @classmethod
    def open(cls) -> _ResidentMemory | None:
        try:
            return cls(os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:  # not Linux: the guard is off
            log.warning("no /proc/self/statm: the store's resident-memory guard is off")
            return None

    def read(self) -> int:
        return int(os.pread(self.fd, 128, 0).split()[1]) * mmap.PAGESIZE


class MemoryAccount:
    """What a store's data and its writes in flight hold, against the budget (and the process's RSS).

    Args:
        budget: bytes the store may hold (``None`` = unlimited: nothing is refused).
        node_name: named in refusals.
        rss_guard: also refuse while the process's RSS is more than ``budget`` above its value now
            (see :attr:`flight_store.config.StoreConfig.rss_guard`).
        lock: the store's lock (taken by :meth:`incoming` and :meth:`reading`).

    Example:
        >>> import threading
        >>> account = MemoryAccount(budget=100, node_name="n0", rss_guard=False, lock=threading.RLock())
        >>> account.reserve(60, "group 'a'")
        >>> account.hold(60, 50)
        >>> account.reserve(60, "group 'b'")
        Traceback (most recent call last):
        ...
        flight_store.errors.BudgetExceededError: memory budget of node n0 is full: group 'b' needs 60 bytes, \
40 of 100 available (0 held by writes in flight); retry after consumed groups are released
    """

    def __init__(self, *, budget: int | None, node_name: str, rss_guard: bool, lock: threading.RLock) -> None:
        self.budget = budget
        self.node_name = node_name
        self.used = 0
        """Bytes the stored groups, images and weights hold (blocks plus object and index overhead)."""
        self.payload = 0
        """Payload bytes (``nbytes``) of the stored groups, images and weights."""
        self.in_flight = 0
        """Bytes writes being received and processed hold (their copies, their server threads)."""
        self.reads = 0
        """Bytes of the answers being sent (not held against writes by the RSS guard)."""
        self._lock = lock
        if budget is not None:
            cap_malloc_arenas()
        self._rss = _ResidentMemory.open() if rss_guard and budget is not None else None
        self.rss_limit = 0 if self._rss is None or budget is None else self._rss.read() + budget
        """Resident memory above which the RSS guard refuses writes (0 without the guard)."""
        self._rss_refusals = 0

    def free_unused(self, *, force: bool = False) -> None:
        """:func:`return_free_memory`, only under a budget.

        It is for the budget and its RSS guard, which must see freed memory gone; a node without a budget
        leaves the allocators their free memory, which the next writes reuse warm: trimming glibc's heap
        after every write makes each refault its gRPC buffers (~5% of a ``put_group``'s round trip), and
        emptying the Arrow pool costs ~10 us a write.
        """
        if self.budget is not None:
            return_free_memory(force=force)

    def hold(self, held: int, payload: int) -> None:
        """Count stored data: ``held`` bytes of memory, ``payload`` bytes of it payload (negative = freed)."""
        self.used += held
        self.payload += payload

    def check_capacity(self, needed: int, what: str) -> None:
        """Refuse for good what could never fit: more than the whole budget (:class:`CapacityExceededError`)."""
        if self.budget is not None and needed > self.budget:
            msg = (f"{what} needs {needed} bytes, more than the whole memory budget of node {self.node_name} "
                   f"({self.budget} bytes): it can never be stored here, do not retry")
            raise CapacityExceededError(msg, needed=needed, capacity=self.budget)

    def reserve(self, needed: int, what: str, in_flight: int = 0, *, exact: bool = True) -> None:
        """Refuse ``needed`` more bytes unless they fit the budget next to the stored ones and ``in_flight``.

        ``exact``: ``needed`` is what the write will hold (not an estimate), so more than the whole budget
        is refused for good (:class:`CapacityExceededError`)."""
        if exact:
            self.check_capacity(needed, what)
        budget = self.budget
        if budget is not None and self.used + in_flight + needed > budget:
            available = max(0, budget - self.used - in_flight)
            msg = (
                f"memory budget of node {self.node_name} is full: {what} needs {needed} bytes, "
                f"{available} of {budget} available ({in_flight} held by writes in flight); "
                "retry after consumed groups are released"
            )
            raise BudgetExceededError(msg, needed=needed, available=available)

    def check_rss(self, needed: int, what: str) -> None:
        """With the RSS guard: refuse ``needed`` more bytes while the process's RSS is too high.

        The limit is the RSS at opening plus the budget; a store holding nothing is never refused (the
        consumer cannot free anything more, and one write must always get through).
        """
        if self._rss is None or not self.used:
            return
        rss = self._rss.read()
        if rss + needed <= self.rss_limit + self.reads:
            return
        self._rss_refusals += 1
        budget = cast(int, self.budget)
        if self._rss_refusals % 1000 == 1 and self.used + self.in_flight < budget // 2:
            log.warning(
                "node %s: resident memory is %d MiB above its start while stored data counts %d MiB of a %d MiB "
                "budget; memory outside the stored groups (metadata history, allocator caches) limits the node",
                self.node_name, (rss - self.rss_limit + budget) >> 20, self.used >> 20, budget >> 20,
            )
        msg = (
            f"memory budget of node {self.node_name} is full: {what} needs {needed} bytes, the node's "
            f"resident memory is {max(0, self.rss_limit - rss)} bytes below its limit (start + budget of "
            f"{budget}); retry after consumed groups are released"
        )
        raise BudgetExceededError(msg, needed=needed, available=max(0, self.rss_limit - rss))

    def rss(self) -> int | None:
        """The process's resident memory now (``None`` without the guard)."""
        return None if self._rss is None else self._rss.read()

    @contextlib.contextmanager
    def reading(self, nbytes: int) -> Iterator[None]:
        """An answer of ``nbytes`` being sent: the RSS guard allows that much more resident memory meanwhile,
        so reads never lock out writes (a read's memory is transient and given back when it ends)."""
        with self._lock:
            self.reads += nbytes
        try:
            yield
        finally:
            with self._lock:
                self.reads -= nbytes

    def incoming(self, what: str, *, admit: Callable[[], bool]) -> Incoming:
        """A write about to be received: its reservation grows as its bytes arrive (:meth:`Incoming.add`)."""
        return Incoming(self, what, admit)

    def close(self) -> None:
        """Stop the RSS guard (closes ``/proc/self/statm``)."""
        if self._rss is not None:
            os.close(self._rss.fd)
            self._rss = None


class Incoming:
    """One write being received: what it holds in flight, reserved as its bytes arrive, refused as soon as
    it cannot fit.

    :meth:`add` counts each received batch: the write's thread (:data:`WRITE_OVERHEAD`, from the first
    byte on) and :data:`COPIES_IN_FLIGHT` copies of its bytes. It refuses at once a write whose bytes so
    far exceed the whole budget (:class:`CapacityExceededError`, never retry) and, when anything is
    stored and ``admit()`` says the write would add new data, one whose bytes cannot fit next to the stored data
    and the OTHER writes in flight (retryable), and one whose block (the copy still to be made: what it
    received is resident already) would take the process past the RSS guard. The exact check
    comes at commit (:meth:`MemoryAccount.reserve` against :attr:`others`). :meth:`release` (idempotent)
    gives the reservation back: the store calls it when the write ends, the server's idle-writer
    watchdog when a writer stalls. An idle stream reserves nothing.
    """

    def __init__(self, account: MemoryAccount, what: str, admit: Callable[[], bool]) -> None:
        self._account = account
        self.what = what
        self._admit = admit
        self.received = 0
        """Payload bytes received so far."""
        self.mine = 0
        """This write's share of :attr:`MemoryAccount.in_flight`."""
        self.released = False

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more received bytes, refusing the write if it cannot fit (see the class)."""
        account = self._account
        account.check_capacity(self.received + nbytes, self.what)
        with account._lock:
            if self.released:
                msg = f"{self.what}: the write was given up (idle too long) before its stream ended"
                raise WriteTimedOutError(msg)
            more = COPIES_IN_FLIGHT * nbytes + (WRITE_OVERHEAD if not self.mine else 0)
            total = self.received + nbytes
            if account.used and self._admit():
                account.reserve(total, self.what, account.in_flight - self.mine, exact=False)
                account.check_rss(total, self.what)  # what it received is resident already; its block is to come
            account.in_flight += more
            self.mine += more
            self.received = total

    @property
    def others(self) -> int:
        """What the OTHER writes in flight hold (the exact check at commit counts these)."""
        return self._account.in_flight - self.mine

    def release(self) -> bool:
        """Give the reservation back (once); returns whether this call released it."""
        with self._account._lock:
            if self.released:
                return False
            self.released = True
            self._account.in_flight -= self.mine
            self.mine = 0
        self._account.free_unused()
        return True

    def __enter__(self) -> Incoming:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
