"""The node-local store: prompt groups, metadata log, images, weights (no gRPC inside).

What it keeps:

* **groups**: each prompt group as the record batches that arrived (normalised to
  ``TRAJECTORY_SCHEMA``), each copied into one exactly sized block (an encapsulated IPC message,
  see :func:`_pack`; nothing of the received gRPC message is kept), plus a row index
  ``sample_idx -> (batch, offset)``, so a slice request is served by zero-copy
  ``RecordBatch.slice`` of the batch viewed in its block (never a filter or take over one big
  table; only tiny multi-slice answers may be coalesced into one small copy, see
  :meth:`Store.slices`);
* an **append-only metadata log** (``METADATA_SCHEMA``, ``seq`` = position in the log) kept as a
  list of small record batches holding their own copies of the metadata columns (so releasing a
  group frees its payload); read from a cursor by slicing a lazily built, cached table;
* **images** keyed by content hash, written once, reference-counted by the unreleased groups
  whose ``image_keys`` name them;
* the **latest weights** table and the newest **published policy version**.

Guarantees: writes are validated first and committed atomically (nothing of a refused stream is
stored); idempotent per ``(group_id, sample_idx)``; a full memory budget refuses writes with the
retryable :class:`BudgetExceededError` and never drops data (the budget counts the memory a
stored group really holds, its pages plus object overhead, and what writes in flight hold; see
:attr:`StoreConfig.memory_budget`); one lock makes every method thread-safe.

Durability (optional ``spill_dir``): every committed group, image set, weights table, release and
published version is appended to the node's :class:`~flight_store.spill.SpillLog` and fsynced
BEFORE it is committed in memory (so before DoPut returns). A store opened on an existing spill
directory replays the log: unreleased groups come back with the same ``seq`` for their metadata
rows (numbering continues after them), released groups stay released (their metadata history is
kept), images, weights and the published version are restored. Replay ignores the memory budget
(everything in the log was accepted once).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store.errors import (
    BudgetExceededError,
    GroupReleasedError,
    SchemaMismatchError,
    UnknownGroupError,
    UnknownImageError,
    UnknownWeightsError,
)
from flight_store.spill import SpillLog, decode_batches, encode_batches
from flight_store.validate import normalize_images, normalize_stream
from schemas.arrow import IMAGE_SCHEMA, METADATA_COLUMNS, METADATA_SCHEMA, SCHEMA_VERSION, TRAJECTORY_SCHEMA

log = logging.getLogger(__name__)

_TRAJ_COLUMNS = frozenset(TRAJECTORY_SCHEMA.names)
_META_COLUMNS = frozenset(METADATA_SCHEMA.names)
_COMPACT_AT = 64  # merged metadata chunks kept before all are merged into one
_BLOCK_OVERHEAD = 1024
"""Bytes of Python objects per stored block besides its memory: the mmap (or buffer) object, the ``_Group``
record, its dict entry and key, the index dict and block list (measured: ~0.6 KiB a group)."""
_ROW_OVERHEAD = 64 + 4 * len(TRAJECTORY_SCHEMA)
"""Bytes per stored row of the ``sample_idx -> (block, offset)`` index (dict slot and tuple) and of its
payload sizes (:func:`_row_bytes`)."""
_COLUMN_INDEX = {name: i for i, name in enumerate(TRAJECTORY_SCHEMA.names)}


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Settings of one store node."""

    memory_budget: int | None = None
    """Bytes of memory the node's groups, images and weights may hold; ``None`` = unlimited.

    What counts is resident memory, not ``RecordBatch.nbytes``: each stored batch's block (its
    whole pages, see :func:`_pack`) plus an estimate of its objects and index entries, and the
    memory writes in flight hold (copies of their batches; their server thread, see
    :meth:`Store.write_in_flight`). A write is committed only if the stored groups, the new group
    and the other writes in flight fit together."""
    node_name: str = "local"
    """Name reported by ``health``/``stats`` (the server sets it to its location)."""
    spill_dir: str | None = None
    """Directory of the durable spill log (created if missing); ``None`` = memory only."""
    rss_guard: bool = False
    """Also hold the process's resident memory to the budget (for a store that owns its process, as a
    ``knit serve`` node does): a group or image write is refused, retryably, while the process's RSS is more
    than ``memory_budget`` above what it was when the store opened, unless the store holds nothing (so a
    write is never refused forever). This covers what no count sees (gRPC buffers, thread stacks, allocator
    caches, the metadata history); needs ``/proc/self/statm`` and a budget, else it is off."""

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            msg = f"memory_budget must be positive bytes or None, got {self.memory_budget}"
            raise ValueError(msg)


_Block: TypeAlias = mmap.mmap | pa.Buffer
"""One stored batch as an encapsulated IPC message (see :func:`_pack`)."""


@dataclass(slots=True)
class _Group:
    blocks: list[_Block] = field(default_factory=list)
    """One buffer per stored batch: the batch as an encapsulated IPC message (see :func:`_pack`)."""
    index: dict[int, tuple[int, int]] = field(default_factory=dict)
    row_bytes: list[np.ndarray] = field(default_factory=list)
    """Per stored batch: payload bytes of each row and column (:func:`_row_bytes`), for ``bytes_out``."""
    nbytes: int = 0
    """Payload bytes (``RecordBatch.nbytes``) of the stored rows."""
    held: int = 0
    """Memory counted against the budget (blocks plus object and index overhead, see :func:`_pack`)."""
    image_keys: set[bytes] | frozenset[bytes] = frozenset()
    """Images the group references (a set once it has any; the shared empty frozenset costs nothing)."""
    released: bool = False
    consumed: Container[int] = frozenset()
    """``sample_idx`` of a released group (its index is dropped), so a retried write stays a no-op."""

    def batch(self, i: int) -> pa.RecordBatch:
        """Stored batch ``i``: zero-copy views into its block."""
        return _view(self.blocks[i], TRAJECTORY_SCHEMA)

    @property
    def batches(self) -> list[pa.RecordBatch]:
        """All stored batches (views into the blocks), in arrival order."""
        return [self.batch(i) for i in range(len(self.blocks))]


@dataclass(slots=True)
class _Image:
    block: _Block
    nbytes: int
    held: int

    @property
    def row(self) -> pa.RecordBatch:
        return _view(self.block, IMAGE_SCHEMA)


_WRITE_OVERHEAD = 256 << 10
"""Bytes a DoPut holds while it is received and processed besides its batches and their copies: its gRPC
server thread's call state, buffers and allocator caches (RSS grew ~110-210 KiB per concurrent writer)."""
_writing = threading.local()  # .overhead: what write_in_flight() counted for this thread's write
_COPIES_IN_FLIGHT = 3
"""Copies of a write's batches alive while it is processed: the received message, the serialized
message and the block being filled (the block is counted as stored once committed)."""
_MMAP_MIN = 16 << 10
"""Blocks of at least this many bytes get pages of their own (see :func:`_pack`); smaller ones come from the
Arrow memory pool."""


def _libc_function(name: str) -> Callable[..., int] | None:
    """A glibc malloc tuning function (``None`` elsewhere)."""
    try:
        return cast(Callable[..., int], getattr(ctypes.CDLL(None), name))
    except (AttributeError, OSError):  # not glibc
        return None


_malloc_trim = _libc_function("malloc_trim")
_M_ARENA_MAX = -8  # glibc's mallopt parameter number
_MALLOC_ARENAS = 2
_arenas_capped = False


def _cap_malloc_arenas() -> None:
    """Let glibc malloc use at most :data:`_MALLOC_ARENAS` arenas in this process (once; needs glibc).

    A store with a memory budget is a node process serving dozens of concurrent RPCs, each on a
    gRPC thread; by default glibc gives up to 8 x cores threads arenas of their own, each keeping
    its high-water mark of transient buffers (in the 64-writer load test ~3 MiB more at peak).
    An explicit ``MALLOC_ARENA_MAX`` in the environment wins.
    """
    global _arenas_capped
    if _arenas_capped or "MALLOC_ARENA_MAX" in os.environ:
        return
    _arenas_capped = True
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, _MALLOC_ARENAS)
_TRIM_EVERY_S = 0.05
_trim_lock = threading.Lock()
_trimmed_at = 0.0


def _return_free_memory() -> None:
    """Give the memory allocators hold but nothing uses back to the OS (after a write or a release).

    Two allocators keep freed memory resident while a node serves dozens of concurrent RPCs, each
    on its own gRPC thread: the Arrow pool (mimalloc) keeps the pages a thread freed until that
    thread allocates again, so validation's temporaries are returned right away on the calling
    thread (``release_unused``, ~1 us); glibc malloc (gRPC's message buffers, numpy, Python) keeps
    freed chunks in up to 8 x cores arenas, so ``malloc_trim`` runs at most every
    :data:`_TRIM_EVERY_S` (~0.2 ms each). In the 64-writer load test these held 10-50 MiB, as much
    as a 64 MiB budget's worth of groups the budget could not see.
    """
    global _trimmed_at
    pa.default_memory_pool().release_unused()
    if _malloc_trim is None:
        return
    now = time.monotonic()
    if now - _trimmed_at < _TRIM_EVERY_S or not _trim_lock.acquire(blocking=False):
        return
    try:
        _trimmed_at = now
        _malloc_trim(0)
    finally:
        _trim_lock.release()


def _pages(n: int) -> int:
    """``n`` rounded up to whole pages."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _size_class(n: int) -> int:
    """``n`` rounded up the way a size-class allocator (mimalloc, jemalloc) does: 4 classes per power of two."""
    if n <= 64:
        return 64
    step = max(16, 1 << ((n - 1).bit_length() - 3))
    return -(-n // step) * step


def _pack(batch: pa.RecordBatch) -> tuple[_Block, int]:
    """``batch`` copied into ONE block of memory of its own; returns the block and the bytes it holds.

    Why: a batch that arrived over gRPC is a set of views into the received message (gRPC's own
    malloc'd memory, larger than the columns kept) plus small buffers validation added, and an
    in-memory ``RecordBatch`` of the 19-column trajectory schema costs ~9 KiB of C++/Python
    objects (``ArrayData``, ``Buffer``, control blocks; measured with ``mallinfo2``), ~27% of a
    32 KiB group. Keeping those pinned memory the budget never saw (peak RSS ~2.2x the budget).

    So the batch is serialized as one encapsulated IPC message (``RecordBatch.serialize``, exact
    size) and :func:`_view` reads it back as zero-copy views whenever it is sliced (~15 us). A block
    of at least :data:`_MMAP_MIN` bytes is copied into an anonymous private ``mmap`` of its own:
    releasing the group unmaps it (once no in-flight answer still views it), so its pages go back
    to the OS at once and the heap never fragments. General-purpose allocators fed ~32 KiB blocks
    freed in arrival-unrelated order kept 1.3-1.5x the live bytes resident (glibc, mimalloc and
    jemalloc alike). Smaller blocks stay in the Arrow pool (where a page of their own would waste
    more than the allocator does); if ``mmap`` fails (e.g. the map-count limit) the pool is used too.

    Bytes held: the whole pages of an mmap block (or the pool block rounded to its size class),
    plus :data:`_BLOCK_OVERHEAD` and :data:`_ROW_OVERHEAD` per row.
    """
    message = batch.serialize()
    block, size = message, _size_class(message.size)
    if message.size >= _MMAP_MIN:
        try:
            region = mmap.mmap(-1, message.size, flags=mmap.MAP_PRIVATE)
        except OSError:
            log.warning("mmap of a %d-byte block failed; keeping it in the Arrow memory pool", message.size)
        else:
            region.write(message)
            block, size = region, _pages(message.size)
    return block, size + _BLOCK_OVERHEAD + _ROW_OVERHEAD * batch.num_rows


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


def _row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """Payload bytes of each row (axis 0) and column (axis 1) of a trajectory batch, as int32.

    A fixed-width value counts its width; a string or list counts its offset (4) and its values.
    For a whole stored batch the sum equals ``RecordBatch.nbytes``; summing rows is exact for any
    split, and cheap (``RecordBatch.nbytes`` of a slice costs ~40 us for this schema).
    """
    out = np.empty((batch.num_rows, batch.num_columns), dtype=np.int32)
    for j, col in enumerate(batch.columns):
        t = col.type
        if pa.types.is_string(t) or pa.types.is_binary(t):
            out[:, j] = pc.binary_length(col).to_numpy() + 4
        elif pa.types.is_list(t):
            value = t.value_type
            width = value.byte_width if pa.types.is_fixed_size_binary(value) else value.bit_width // 8
            out[:, j] = pc.list_value_length(col).to_numpy() * width + 4
        else:
            out[:, j] = t.bit_width // 8
    return out


def _compact_ints(values: Iterable[int]) -> Container[int]:
    """``values`` as a ``range`` when they are consecutive (the usual ``0..G-1``), else a frozenset."""
    ordered = sorted(values)
    if ordered and ordered[-1] - ordered[0] == len(ordered) - 1:
        return range(ordered[0], ordered[-1] + 1)
    return frozenset(ordered)


def _view(block: _Block, schema: pa.Schema) -> pa.RecordBatch:
    """The batch :func:`_pack` stored in ``block``, as zero-copy views into it.

    An mmap block is wrapped in a ``pa.Buffer`` only here, for as long as the views live: a
    wrapper kept per stored block is a small C++ allocation in the arena of whichever gRPC thread
    stored it, and ~2000 of those scattered over glibc's per-thread arenas pinned pages that
    ``malloc_trim`` could not give back. The views keep the mmap alive (buffer export) until they
    are gone, even if the group is released meanwhile.
    """
    return pa.ipc.read_record_batch(pa.py_buffer(block) if isinstance(block, mmap.mmap) else block, schema)


class Store:
    """Thread-safe node-local store of prompt groups, metadata, images and weights.

    Example:
        >>> from schemas.records import TrajectoryRecord, records_to_batch
        >>> store = Store(memory_budget=1 << 30)
        >>> batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
        ...     prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5]) for i in range(4)])
        >>> store.put_group("g0", [batch])
        4
        >>> store.metadata(since=0, columns=["group_id", "sample_idx"]).num_rows
        4
        >>> pa.Table.from_batches(store.slices([("g0", 1, 3)], columns=["sample_idx"])).column(0).to_pylist()
        [1, 2]
    """

    def __init__(
        self,
        *,
        memory_budget: int | None = None,
        node_name: str = "local",
        spill_dir: str | os.PathLike[str] | None = None,
        rss_guard: bool = False,
    ) -> None:
        self.config = StoreConfig(
            memory_budget=memory_budget,
            node_name=node_name,
            spill_dir=None if spill_dir is None else str(spill_dir),
            rss_guard=rss_guard,
        )
        if memory_budget is not None:
            _cap_malloc_arenas()
        self._rss = _ResidentMemory.open() if rss_guard and memory_budget is not None else None
        self._rss_limit = 0 if self._rss is None or memory_budget is None else self._rss.read() + memory_budget
        self._rss_refusals = 0
        self._lock = threading.RLock()
        self._groups: dict[str, _Group] = {}
        self._meta_batches: list[pa.RecordBatch] = []
        self._meta_cache: pa.Table | None = None
        self._meta_merged = 0  # leading entries of _meta_batches already merged
        self._seq = 0
        self._images: dict[bytes, _Image] = {}
        self._image_refs: dict[bytes, int] = {}
        self._weights: pa.Table | None = None
        self._weights_version: int | None = None
        self._version = 0
        self._used = 0
        self._in_flight = 0
        self._payload = 0
        self._rows = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.time()
        self._spill: SpillLog | None = None
        self._replaying = False
        self.recovered: dict[str, int] = {}
        """What replaying the spill log restored: records, groups (unreleased), released groups, rows."""
        if spill_dir is not None:
            self._spill = SpillLog(spill_dir)
            self._replay()

    # ---- durability ----------------------------------------------------------------------------

    def _log(self, header: dict[str, object], body: bytes = b"") -> None:
        """Append one record to the spill log (fsynced) unless there is none or it is being replayed."""
        if self._spill is not None and not self._replaying:
            self._spill.append(header, body)

    def _replay(self) -> None:
        if self._spill is None:  # pragma: no cover - only called with a spill log
            return
        t0 = time.perf_counter()
        records = 0
        self._replaying = True
        try:
            with self._lock:
                for header, body in self._spill.replay():
                    records += 1
                    kind = header.get("kind")
                    if kind == "group":
                        fresh = decode_batches(body)
                        self._commit_group(str(header["group_id"]), fresh, [_pack(b) for b in fresh])
                    elif kind == "release":
                        self.release([str(g) for g in header.get("group_ids", [])])
                    elif kind == "images":
                        self._commit_images(decode_batches(body))
                    elif kind == "weights":
                        self.put_weights(pa.Table.from_batches(decode_batches(body)), int(header["version"]))
                    elif kind == "version":
                        self.publish_version(int(header["version"]))
                    else:
                        log.warning("spill log %s: skipping a record of unknown kind %r", self._spill.path, kind)
        finally:
            self._replaying = False
        released = sum(1 for g in self._groups.values() if g.released)
        self.recovered = {
            "records": records,
            "groups": len(self._groups) - released,
            "released": released,
            "rows": self._seq,
        }
        if records:
            log.info(
                "node %s: replayed %d spill records from %s in %.3fs: %d groups, %d released, %d metadata rows",
                self.config.node_name, records, self._spill.path, time.perf_counter() - t0,
                self.recovered["groups"], released, self._seq,
            )

    def close(self) -> None:
        """Close the spill log (a memory-only store has nothing to close)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        if self._rss is not None:
            os.close(self._rss.fd)
            self._rss = None

    # ---- budget --------------------------------------------------------------------------------

    def _reserve(self, needed: int, what: str, in_flight: int = 0) -> None:
        """Refuse ``needed`` more bytes unless they fit the budget next to the stored ones and ``in_flight``."""
        budget = self.config.memory_budget
        if budget is not None and not self._replaying and self._used + in_flight + needed > budget:
            available = max(0, budget - self._used - in_flight)
            msg = (
                f"memory budget of node {self.config.node_name} is full: {what} needs {needed} bytes, "
                f"{available} of {budget} available ({in_flight} held by writes in flight); "
                "retry after consumed groups are released"
            )
            raise BudgetExceededError(msg, needed=needed, available=available)

    def _check_rss(self, needed: int, what: str) -> None:
        """With :attr:`StoreConfig.rss_guard`: refuse ``needed`` more bytes while the process's RSS is too high.

        The limit is the RSS at opening plus the budget; a store holding nothing is never refused (the
        consumer cannot free anything more, and one write must always get through).
        """
        if self._rss is None or self._replaying or not self._used:
            return
        rss = self._rss.read()
        if rss + needed <= self._rss_limit:
            return
        self._rss_refusals += 1
        budget = cast(int, self.config.memory_budget)
        if self._rss_refusals % 1000 == 1 and self._used + self._in_flight < budget // 2:
            log.warning(
                "node %s: resident memory is %d MiB above its start while stored data counts %d MiB of a %d MiB "
                "budget; memory outside the stored groups (metadata history, allocator caches) limits the node",
                self.config.node_name, (rss - self._rss_limit + budget) >> 20, self._used >> 20, budget >> 20,
            )
        msg = (
            f"memory budget of node {self.config.node_name} is full: {what} needs {needed} bytes, the node's "
            f"resident memory is {max(0, self._rss_limit - rss)} bytes below its limit (start + budget of "
            f"{budget}); retry after consumed groups are released"
        )
        raise BudgetExceededError(msg, needed=needed, available=max(0, self._rss_limit - rss))

    # ---- groups --------------------------------------------------------------------------------

    def put_group(self, group_id: str, batches: Sequence[pa.RecordBatch | pa.Table]) -> int:
        """Validate and store one DoPut stream of group ``group_id``; returns rows added.

        Rows whose ``(group_id, sample_idx)`` is already stored are dropped (idempotent retry);
        new ``sample_idx`` of an existing group are appended. All or nothing.

        Raises:
            SchemaMismatchError: a batch does not fit the trajectory schema (nothing stored).
            BudgetExceededError: the node's memory budget cannot hold the new rows (nothing stored).
            GroupReleasedError: new rows for a group that was already released.
        """
        raw = sum(b.nbytes for b in batches)
        cost = _COPIES_IN_FLIGHT * raw
        mine = cost + getattr(_writing, "overhead", 0)  # this write's share of _in_flight
        with self._lock:
            if self._used and group_id not in self._groups:
                # Refuse before validating and copying what cannot fit anyway (the exact check
                # comes at commit; an empty store always gets there, so nothing that fits alone
                # is refused forever): under backpressure dozens of writes would otherwise each
                # hold their copies at once on top of a full budget.
                self._reserve(2 * raw, f"group {group_id!r}", self._in_flight - (mine - cost))
                self._check_rss(2 * raw, f"group {group_id!r}")
            self._in_flight += cost
        try:
            return self._put_group(group_id, batches, mine)
        finally:
            with self._lock:
                self._in_flight -= cost
            _return_free_memory()

    @contextlib.contextmanager
    def write_in_flight(self) -> Iterator[None]:
        """Count one write being received (its server thread, :data:`_WRITE_OVERHEAD`) against the budget.

        The server wraps each DoPut in it, from before it reads the stream until it answers: a
        commit is refused unless the stored groups, the new group and everything other writes
        in flight hold fit the budget together. With 64 concurrent writers that is ~20 MiB a
        node holds beyond its stored groups (gRPC buffers, copies, thread caches).
        """
        with self._lock:
            self._in_flight += _WRITE_OVERHEAD
        _writing.overhead = _WRITE_OVERHEAD
        try:
            yield
        finally:
            _writing.overhead = 0
            with self._lock:
                self._in_flight -= _WRITE_OVERHEAD

    def _put_group(self, group_id: str, batches: Sequence[pa.RecordBatch | pa.Table], mine: int) -> int:
        """:meth:`put_group` once its copies are counted in flight (``mine``: its share of ``_in_flight``)."""
        flat: list[pa.RecordBatch] = []
        for b in batches:
            flat.extend(b.to_batches() if isinstance(b, pa.Table) else [b])
        normalized = normalize_stream(flat, group_id)
        with self._lock:
            group = self._groups.get(group_id)
            present: Container[int] = (
                {} if group is None else group.consumed if group.released else group.index
            )
            fresh: list[pa.RecordBatch] = []
            for b in normalized:
                idx = b.column("sample_idx").to_numpy()
                keep = np.fromiter((int(i) not in present for i in idx), dtype=bool, count=len(idx))
                if keep.all():
                    fresh.append(b)
                elif keep.any():
                    fresh.append(b.filter(pa.array(keep)))
            if not fresh:
                return 0
            if group is not None and group.released:
                msg = f"group {group_id!r} was already released; refusing {sum(b.num_rows for b in fresh)} new rows"
                raise GroupReleasedError(msg, group_id=group_id)
            packed = [_pack(b) for b in fresh]
            # stored groups + this group + what the OTHER writes in flight hold must fit
            self._reserve(sum(held for _, held in packed), f"group {group_id!r}", self._in_flight - mine)
            self._check_rss(0, f"group {group_id!r}")  # the packed blocks' pages are resident already
            self._log({"kind": "group", "group_id": group_id}, encode_batches(fresh))
            return self._commit_group(group_id, fresh, packed)

    def _commit_group(
        self, group_id: str, fresh: list[pa.RecordBatch], packed: list[tuple[_Block, int]]
    ) -> int:
        """Add validated, deduplicated batches of ``group_id`` and their :func:`_pack` (caller holds the lock)."""
        held = sum(h for _, h in packed)
        payload = sum(b.nbytes for b in fresh)
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Group()
        meta: list[pa.RecordBatch] = []
        for b, (block, _) in zip(fresh, packed, strict=True):
            bno = len(group.blocks)
            group.blocks.append(block)
            group.row_bytes.append(_row_bytes(b))
            for off, s in enumerate(b.column("sample_idx").to_numpy().tolist()):
                group.index[s] = (bno, off)
            meta.append(self._metadata_rows(b))
            new_keys = {k for keys in b.column("image_keys").to_pylist() for k in keys} - group.image_keys
            if new_keys:
                group.image_keys = {*group.image_keys, *new_keys}
                for k in new_keys:
                    self._image_refs[k] = self._image_refs.get(k, 0) + 1
        group.nbytes += payload
        group.held += held
        self._payload += payload
        self._used += held
        self.bytes_in += payload
        rows = sum(b.num_rows for b in fresh)
        self._rows += rows
        self._meta_batches.extend(meta)
        self._meta_cache = None
        if len(self._meta_batches) - self._meta_merged > _COMPACT_AT:
            self._compact_metadata()  # bound the many tiny per-write batches even when nobody scans
        return rows

    def _compact_metadata(self) -> None:
        """Merge the small per-write metadata batches that arrived since the last read into one.

        Only metadata (never payload) is copied; when more than ``_COMPACT_AT`` chunks pile up, all
        are merged, so a scan streams few IPC messages whatever the number of writes.
        """
        merged, tail = self._meta_batches[: self._meta_merged], self._meta_batches[self._meta_merged :]
        if len(tail) > 1:
            tail = _merge(tail)
        merged.extend(tail)
        if len(merged) > _COMPACT_AT:
            merged = _merge(merged)
        self._meta_batches = merged
        self._meta_merged = len(merged)

    def _metadata_rows(self, b: pa.RecordBatch) -> pa.RecordBatch:
        """Own copies of the metadata columns of ``b`` plus ``seq`` (payload buffers are not kept alive)."""
        n = b.num_rows
        seq = pa.array(np.arange(self._seq, self._seq + n, dtype=np.int64))
        self._seq += n
        copy_idx = pa.array(np.arange(n, dtype=np.int64))
        arrays = [seq, *(b.column(c).take(copy_idx) for c in METADATA_COLUMNS)]
        return pa.RecordBatch.from_arrays(arrays, schema=METADATA_SCHEMA)

    def slices(
        self,
        refs: Iterable[tuple[str, int, int]],
        columns: Sequence[str] | None = None,
        *,
        coalesce_below: int = 0,
    ) -> list[pa.RecordBatch]:
        """Zero-copy slices of rows ``sample_idx in [start, stop)`` per ``(group_id, start, stop)``, in order.

        Each run of consecutive rows of one stored batch is one ``RecordBatch.slice`` (a view, no
        copy). When ``coalesce_below`` > 0, more than one slice results and their payload is
        estimated under ``coalesce_below`` bytes, the slices are copied into ONE batch instead:
        for tiny micro-batches one small copy is cheaper than one IPC message per slice.

        Raises:
            UnknownGroupError: a group (or one of its rows) is not stored here.
            GroupReleasedError: a group was released.
            SchemaMismatchError: ``columns`` names a column the trajectory schema lacks.
        """
        if columns is not None:
            for c in columns:
                if c not in _TRAJ_COLUMNS:
                    msg = f"unknown column {c!r} requested; the trajectory schema has {TRAJECTORY_SCHEMA.names}"
                    raise SchemaMismatchError(msg, column=c)
        cols = slice(None) if columns is None else [_COLUMN_INDEX[c] for c in columns]
        out: list[pa.RecordBatch] = []
        served = 0  # payload bytes of the projected rows (see _row_bytes)
        views: dict[tuple[str, int], pa.RecordBatch] = {}

        def add(group_id: str, group: _Group, bno: int, off: int, rows: int) -> None:
            nonlocal served
            got = views.get((group_id, bno))
            if got is None:
                got = views[group_id, bno] = group.batch(bno)
            out.append(got.slice(off, rows))
            served += int(group.row_bytes[bno][off : off + rows, cols].sum())

        with self._lock:
            for group_id, start, stop in refs:
                group = self._groups.get(group_id)
                if group is None:
                    msg = f"group {group_id!r} is not stored on node {self.config.node_name}"
                    raise UnknownGroupError(msg, group_id=group_id)
                if group.released:
                    msg = f"group {group_id!r} was released; its payload is gone"
                    raise GroupReleasedError(msg, group_id=group_id)
                run_b, run_off, run_len = -1, -1, 0
                for s in range(start, stop):
                    loc = group.index.get(s)
                    if loc is None:
                        msg = f"group {group_id!r} has no row sample_idx={s} on node {self.config.node_name}"
                        raise UnknownGroupError(msg, group_id=group_id)
                    if loc[0] == run_b and loc[1] == run_off + run_len:
                        run_len += 1
                        continue
                    if run_len:
                        add(group_id, group, run_b, run_off, run_len)
                    run_b, run_off, run_len = loc[0], loc[1], 1
                if run_len:
                    add(group_id, group, run_b, run_off, run_len)
            self.bytes_out += served
        if columns is not None:
            out = [b.select(list(columns)) for b in out]
        if 0 < served < coalesce_below and len(out) > 1:
            # this thread's earlier coalesced answers were freed once sent; hand their pages back first
            pa.default_memory_pool().release_unused()
            out = [pa.concat_batches(out)]
        return out

    def release(self, group_ids: Iterable[str]) -> int:
        """Free the payload of these groups (unknown ids are ignored); returns how many were freed.

        Metadata history stays; images no longer referenced by any unreleased group are freed.
        """
        freed = 0
        with self._lock:
            todo = [g for g in dict.fromkeys(group_ids) if g in self._groups and not self._groups[g].released]
            if todo:
                self._log({"kind": "release", "group_ids": todo})
            for gid in todo:
                group = self._groups[gid]
                group.released = True
                group.blocks = []
                group.row_bytes = []
                group.consumed = _compact_ints(group.index)  # still dedups retries; ~50 bytes, not ~500
                group.index = {}
                self._used -= group.held
                self._payload -= group.nbytes
                for k in group.image_keys:
                    left = self._image_refs.get(k, 0) - 1
                    if left > 0:
                        self._image_refs[k] = left
                        continue
                    self._image_refs.pop(k, None)
                    img = self._images.pop(k, None)
                    if img is not None:
                        self._used -= img.held
                        self._payload -= img.nbytes
                group.image_keys = frozenset()  # the empty frozenset is a shared singleton
                freed += 1
        if freed:
            _return_free_memory()
        return freed

    def has_group(self, group_id: str) -> bool:
        """Whether ``group_id`` is stored and not released."""
        with self._lock:
            g = self._groups.get(group_id)
            return g is not None and not g.released

    def group_info(self, group_id: str) -> tuple[int, int, list[tuple[int, int]]]:
        """``(rows, bytes, contiguous [start, stop) runs of sample_idx)`` of an unreleased group."""
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                msg = f"group {group_id!r} is not stored on node {self.config.node_name}"
                raise UnknownGroupError(msg, group_id=group_id)
            if group.released:
                msg = f"group {group_id!r} was released; its payload is gone"
                raise GroupReleasedError(msg, group_id=group_id)
            idx = sorted(group.index)
            nbytes = group.nbytes
        runs: list[tuple[int, int]] = []
        for s in idx:
            if runs and runs[-1][1] == s:
                runs[-1] = (runs[-1][0], s + 1)
            else:
                runs.append((s, s + 1))
        return len(idx), nbytes, runs

    def group_ids(self) -> list[str]:
        """Ids of the unreleased groups, in arrival order."""
        with self._lock:
            return [g for g, v in self._groups.items() if not v.released]

    # ---- metadata ------------------------------------------------------------------------------

    def metadata(self, since: int = 0, columns: Sequence[str] | None = None) -> pa.Table:
        """Metadata rows with ``seq >= since``; ``seq`` first, then ``columns`` (all when ``None``)."""
        if columns is not None:
            for c in columns:
                if c not in _META_COLUMNS:
                    msg = f"unknown metadata column {c!r}; metadata columns are {METADATA_SCHEMA.names}"
                    raise SchemaMismatchError(msg, column=c)
        merged = False
        with self._lock:
            if self._meta_cache is None:
                self._compact_metadata()
                self._meta_cache = pa.Table.from_batches(self._meta_batches, schema=METADATA_SCHEMA)
                merged = True
            table = self._meta_cache
        if merged:  # the merged chunks were freed on this thread
            _return_free_memory()
        table = table.slice(min(since, table.num_rows))
        if columns is not None:
            table = table.select(["seq", *(c for c in dict.fromkeys(columns) if c != "seq")])
        return table

    # ---- images --------------------------------------------------------------------------------

    def put_images(self, table: pa.Table | pa.RecordBatch) -> int:
        """Store the images whose key is new; returns how many were stored.

        Raises:
            SchemaMismatchError: the table does not fit ``IMAGE_SCHEMA``.
            BudgetExceededError: the new images do not fit the memory budget (none stored).
        """
        t = normalize_images(table)
        with self._lock:
            new = self._new_images(t.to_batches())
            needed = sum(v.held for v in new.values())
            self._reserve(needed, f"{len(new)} image(s)")
            if new:
                self._check_rss(needed, f"{len(new)} image(s)")
                self._log({"kind": "images"}, encode_batches([v.row for v in new.values()]))
            return self._commit_images([], new)

    def _new_images(self, batches: list[pa.RecordBatch]) -> dict[bytes, _Image]:
        """The image rows of ``batches`` whose key is not stored yet (caller holds the lock)."""
        new: dict[bytes, _Image] = {}
        for b in batches:
            for i, k in enumerate(b.column("image_key").to_pylist()):
                if k in self._images or k in new:
                    continue
                row = b.slice(i, 1)
                block, held = _pack(row)  # own copy: the received message is not kept alive
                new[k] = _Image(block=block, nbytes=row.nbytes, held=held)
        return new

    def _commit_images(self, batches: list[pa.RecordBatch], new: dict[bytes, _Image] | None = None) -> int:
        """Add new image rows (from ``batches``, or the ``new`` already selected); caller holds the lock."""
        if new is None:
            new = self._new_images(batches)
        self._images.update(new)
        payload = sum(v.nbytes for v in new.values())
        self._used += sum(v.held for v in new.values())
        self._payload += payload
        self.bytes_in += payload
        return len(new)

    def images(self, keys: Sequence[bytes]) -> pa.Table:
        """Image rows for ``keys``, in key order. Raises :class:`UnknownImageError` naming a missing key."""
        with self._lock:
            rows = []
            for k in keys:
                img = self._images.get(k)
                if img is None:
                    msg = f"image {k.hex()} is not stored on node {self.config.node_name}"
                    raise UnknownImageError(msg, key=k.hex())
                rows.append(img.row)
                self.bytes_out += img.nbytes
        return pa.Table.from_batches(rows, schema=rows[0].schema) if rows else normalize_images(_empty_images())

    def has_image(self, key: bytes) -> bool:
        """Whether the image ``key`` is stored."""
        with self._lock:
            return key in self._images

    # ---- weights & version ---------------------------------------------------------------------

    def put_weights(self, table: pa.Table, version: int) -> bool:
        """Keep ``table`` as the latest weights if ``version`` is not older than the stored one."""
        with self._lock:
            if self._weights_version is not None and version < self._weights_version:
                log.info("ignoring weights v%d older than stored v%d", version, self._weights_version)
                return False
            old = self._weights.nbytes if self._weights is not None else 0
            self._reserve(max(0, table.nbytes - old), f"weights v{version}")
            self._log({"kind": "weights", "version": int(version)}, encode_batches(table.to_batches(), table.schema))
            self._used += table.nbytes - old
            self._payload += table.nbytes - old
            self._weights, self._weights_version = table, version
            self.bytes_in += table.nbytes
            return True

    def weights(self, version: int | None = None) -> tuple[pa.Table, int]:
        """The latest weights table and its version (exactly ``version`` when given)."""
        with self._lock:
            if self._weights is None or self._weights_version is None:
                msg = f"no weights are stored on node {self.config.node_name}"
                raise UnknownWeightsError(msg, version=version)
            if version is not None and version != self._weights_version:
                latest = self._weights_version
                msg = f"weights v{version} are not stored on node {self.config.node_name} (latest v{latest})"
                raise UnknownWeightsError(msg, version=version)
            self.bytes_out += self._weights.nbytes
            return self._weights, self._weights_version

    def publish_version(self, version: int) -> int:
        """Record the newest policy version (monotonic: an older one is ignored); returns the stored one."""
        with self._lock:
            if int(version) > self._version:
                self._log({"kind": "version", "version": int(version)})
                self._version = int(version)
            return self._version

    def get_version(self) -> int:
        """The newest published policy version (0 before any publish)."""
        with self._lock:
            return self._version

    # ---- stats ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Counters for the ``stats`` action (JSON-serialisable)."""
        with self._lock:
            released = sum(1 for g in self._groups.values() if g.released)
            return {
                "node": self.config.node_name,
                "schema_version": SCHEMA_VERSION,
                "rows": self._rows,
                "rows_stored": sum(len(g.index) for g in self._groups.values() if not g.released),
                "metadata_rows": self._seq,
                "groups": {"stored": len(self._groups) - released, "released": released},
                "bytes": self._payload,
                "images": len(self._images),
                "image_bytes": sum(v.nbytes for v in self._images.values()),
                "weights_version": self._weights_version,
                "policy_version": self._version,
                "memory_budget": self.config.memory_budget,
                "memory_used": self._used,
                "memory_in_flight": self._in_flight,
                "memory_rss": None if self._rss is None else self._rss.read(),
                "memory_rss_limit": None if self._rss is None else self._rss_limit,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "uptime_s": round(time.time() - self.started, 3),
            }


def _merge(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    return pa.Table.from_batches(batches, schema=METADATA_SCHEMA).combine_chunks().to_batches()


def _empty_images() -> pa.Table:
    return IMAGE_SCHEMA.empty_table()
