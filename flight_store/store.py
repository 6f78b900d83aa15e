"""The node-local store: prompt groups, metadata log, images, weights (no gRPC inside).

:class:`Store` is the facade the Flight server calls. What it keeps lives in single-idea modules:
:mod:`~flight_store.groups` (each group's batches, served as zero-copy slices),
:mod:`~flight_store.metadata` (the append-only log, ``seq`` = position), :mod:`~flight_store.images`
(content-keyed, reference-counted), :mod:`~flight_store.weights` (the newest tables and the published
version), :mod:`~flight_store.blocks` and :mod:`~flight_store.memory` (blocks, budget, writes in flight, RSS guard),
:mod:`~flight_store.durability` (the spill log), :mod:`~flight_store.supply` (groups in flight, demand)
and :mod:`~flight_store.contents` (the one commit path that changes them).

A write runs in two steps: validate, deduplicate, reserve memory and append to the spill log
(here), then commit (:class:`~flight_store.contents.StoreContents`); replaying the spill log
commits only, through the same methods.

Guarantees: writes are validated first and committed atomically (nothing of a refused stream is
stored); idempotent per ``(group_id, sample_idx)``; a full memory budget refuses writes with the
retryable :class:`BudgetExceededError` and never drops data (the budget counts what a stored group
really holds and what writes in flight hold; see :attr:`StoreConfig.memory_budget`); one lock (an
``RLock`` the memory account shares) makes every method thread-safe. Durability (optional
``spill_dir``): every accepted change is fsynced to the spill log BEFORE it is committed in memory,
and a store reopened on the directory gets back what it held (see :mod:`flight_store.durability`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store import groups as _groups
from flight_store import metadata as _metadata
from flight_store.blocks import pack
from flight_store.config import StoreConfig
from flight_store.contents import StoreContents
from flight_store.durability import Journal
from flight_store.errors import KnitError, LimitExceededError, SchemaMismatchError
from flight_store.images import images_table
from flight_store.memory import Incoming, MemoryAccount
from flight_store.supply import Supply
from flight_store.validate import normalize_group, normalize_group_sized, normalize_groups, normalize_images
from flight_store.weights import one_batch
from schemas import weights as weights_codec
from schemas.arrow import SCHEMA_VERSION
from schemas.replies import NodeStats

__all__ = ["MAX_VERSION_STEP", "Store", "StoreConfig"]

MAX_VERSION_STEP = 1 << 20
"""The most a published version may move forward at once."""


class Store:
    """Thread-safe node-local store of prompt groups, metadata, images and weights.

    Args:
        config: memory budget, node name, spill directory, RSS guard (default: ``StoreConfig()``,
            memory only and unlimited). With a ``spill_dir`` holding a log, the log is replayed
            first (:attr:`recovered` says what came back).

    Example:
        >>> from schemas.records import TrajectoryRecord, records_to_batch
        >>> store = Store(StoreConfig(memory_budget=1 << 30))
        >>> batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
        ...     prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5]) for i in range(4)])
        >>> store.put_group("g0", [batch])
        4
        >>> store.metadata(since=0, columns=["group_id", "sample_idx"]).num_rows
        4
    """

    def __init__(self, config: StoreConfig | None = None) -> None:
        self.config = config if config is not None else StoreConfig()
        self._lock = threading.RLock()
        self.memory = MemoryAccount(budget=self.config.memory_budget, node_name=self.config.node_name,
                                    rss_guard=self.config.rss_guard, lock=self._lock)
        """The memory account: budget, writes in flight, answers being sent, giving memory back to the OS."""
        cfg = self.config
        history_rows, tombstones = cfg.bookkeeping()
        self._contents = StoreContents(cfg.node_name, self.memory, weights_versions=cfg.weights_versions,
                                       history_rows=history_rows, tombstones=tombstones)
        self._journal = Journal(cfg.spill_dir, recovery=cfg.spill_recovery, compact_bytes=cfg.spill_compact_bytes)
        self.bytes_out = 0
        """Payload bytes served (slices, images, weights)."""
        self.supply = Supply(self._contents, self._lock)
        """The groups in flight here and the trainer's demand (:class:`~flight_store.supply.Supply`)."""
        self.started = time.time()
        self.recovered: dict[str, int] = {}
        """What replaying the spill log restored: records, groups (unreleased), released groups, rows."""
        try:
            with self._lock:
                self.recovered = self._journal.replay(self._contents, self.config.node_name)
        except BaseException:
            self.close()
            raise

    @property
    def bytes_in(self) -> int:
        """Payload bytes committed (groups, images, weights)."""
        return self._contents.bytes_in

    def close(self) -> None:
        """Close the spill log and the RSS guard (a memory-only store has nothing to close)."""
        self._journal.close()
        self.memory.close()

    # ---- groups --------------------------------------------------------------------------------

    def incoming(self, what: str, *, new_group: str | None = None) -> Incoming:
        """A write about to be received (the server counts its bytes as they arrive, see :class:`Incoming`).

        ``new_group``: the write is group ``new_group`` (checked early against the budget only if the
        group is not stored yet: a retry of a stored group adds nothing).
        """
        def admit() -> bool:
            return new_group is None or new_group not in self._contents.groups

        return self.memory.incoming(what, admit=admit)

    def _own_incoming(self, what: str, batches: Sequence[pa.RecordBatch | pa.Table],
                      new_group: str | None = None) -> Incoming:
        """An in-process caller's write: all its bytes arrived at once."""
        incoming = self.incoming(what, new_group=new_group)
        try:
            incoming.add(sum(b.get_total_buffer_size() for b in batches))  # nbytes costs ~40 us a batch
        except BaseException:
            incoming.release()
            raise
        return incoming

    def put_group(self, group_id: str, batches: Sequence[pa.RecordBatch | pa.Table], rows: int | None = None,
                  meta: dict[str, str] | None = None, *, incoming: Incoming | None = None) -> int:
        """Validate and store one whole group ``group_id`` of ``rows`` rows, atomically; returns rows added.

        ``rows``: what the writer declared (``None`` = the rows of ``batches``); ``incoming``: the server's
        reservation for the bytes it received (default: one made here). A group is written once: a rewrite
        with the same content is a no-op (returns 0, also for a released group), one with other content is
        refused. ``meta``: the writer's ``knittrans.*`` schema metadata (served back with its slices).

        Raises:
            SchemaMismatchError: a batch breaks the trajectory schema or a rule, or the stream does not hold
                exactly ``rows`` rows with ``sample_idx`` 0..rows-1 (nothing stored).
            UnknownImageError: a row names an image this node does not hold (write the images first).
            ConflictError: the group was written before with other content (names the column).
            CapacityExceededError: the group is larger than the node's whole budget (never retry).
            BudgetExceededError: the node's memory budget cannot hold it now (retry later).
        """
        what = f"group {group_id!r}"
        with contextlib.ExitStack() as stack:
            if incoming is None:
                incoming = stack.enter_context(self._own_incoming(what, batches, new_group=group_id))
            flat = [x for b in batches for x in (b.to_batches() if isinstance(b, pa.Table) else [b])]
            declared = sum(b.num_rows for b in flat) if rows is None else rows
            normalized, sizes = normalize_group_sized(flat, group_id, declared)
            return self._commit_group(group_id, normalized, meta, incoming, sizes)
        raise AssertionError  # pragma: no cover - the with block returns or raises

    def put_groups(self, groups: Sequence[tuple[str, int]], batches: Sequence[pa.RecordBatch],
                   meta: dict[str, str] | None = None, *, incoming: Incoming,
                   check: Callable[[str], None] | None = None) -> tuple[dict[str, int], dict[str, KnitError]]:
        """Validate and store several whole groups, each on its own (atomically, as :meth:`put_group`): ``groups``
        lists each ``(group_id, rows)`` in the order of the rows of ``batches`` (a bulk write's stream).

        The rules are checked once over the whole stream (:func:`~schemas.trajectory.normalize_groups`); only
        when some row breaks one is each group checked on its own, so the refused ones are named and the
        others stored. ``check(group_id)`` may refuse a group before anything (the node's owner check).
        Returns the rows added per stored group and the error of each refused group.
        """
        table = pa.Table.from_batches(batches) if batches else None
        try:
            whole = None if table is None else normalize_groups(table, groups)
        except SchemaMismatchError:
            whole = None  # some group breaks a rule: each is checked on its own below, to name it
        stored: dict[str, int] = {}
        refused: dict[str, KnitError] = {}
        at = 0
        for group_id, rows in groups:
            try:
                if check is not None:
                    check(group_id)
                if whole is not None:
                    stored[group_id] = self._commit_group(group_id, [whole.slice(at, rows)], meta, incoming)
                else:
                    part = table.slice(at, rows).to_batches() if table is not None else []
                    stored[group_id] = self._commit_group(group_id, normalize_group(part, group_id, rows), meta,
                                                          incoming)
            except KnitError as exc:
                refused[group_id] = exc
            at += rows
        return stored, refused

    def _commit_group(self, group_id: str, normalized: Sequence[pa.RecordBatch], meta: dict[str, str] | None,
                      incoming: Incoming, sizes: Sequence[np.ndarray | None] = ()) -> int:
        """Store the validated batches of one whole group (a rewrite of the same content: 0 rows added); ``sizes``:
        their row sizes where validation read them."""
        what = f"group {group_id!r}"
        with self._lock:
            if self._contents.groups.check_rewrite(group_id, normalized):
                return 0
            keys = _groups.image_keys_of(normalized)
            self._contents.images.check_present(keys, group_id)
            packed = [pack(b) for b in normalized]
            # stored groups + this group + what the OTHER writes in flight hold must fit
            self.memory.reserve(sum(held for _, held in packed), what, incoming.others)
            self.memory.check_rss(0, what)  # the packed blocks' pages are resident already
            self._journal.group(group_id, [block for block, _ in packed], meta or {})
            return self._contents.commit_group(group_id, normalized, packed, meta, image_keys=keys, sizes=sizes)

    def slices(self, refs: Iterable[tuple[str, int, int]], columns: Sequence[str] | None = None, *,
               coalesce_below: int = 0) -> list[pa.RecordBatch]:
        """Zero-copy slices of rows ``sample_idx in [start, stop)`` per ``(group_id, start, stop)``, in order.

        Each run of consecutive rows of one stored batch is one ``RecordBatch.slice`` (a view, no
        copy). When ``coalesce_below`` > 0, runs of small slices are copied into a few batches instead
        (see :func:`flight_store.groups.coalesce`): one small copy is cheaper than one IPC message per slice.

        Raises:
            UnknownGroupError: a group (or one of its rows) is not stored here.
            GroupReleasedError: a group was released.
            SchemaMismatchError: ``columns`` names a column the trajectory schema lacks.
        """
        return list(self.slices_with_meta(refs, columns, coalesce_below=coalesce_below)[0])

    def slices_with_meta(
        self, refs: Iterable[tuple[str, int, int]], columns: Sequence[str] | None = None, *, coalesce_below: int = 0
    ) -> tuple[Iterator[pa.RecordBatch], dict[str, str], int]:
        """:meth:`slices` (as an iterator: coalesced chunks are copied as it reaches them), the writer
        metadata (``knittrans.logprobs_mode``, ...) all their groups share, and the payload bytes served."""
        _groups.check_columns(columns)
        with self._lock:
            out, sizes, meta = self._contents.groups.slices(refs, columns)
            nbytes = sum(sizes)
            self.bytes_out += nbytes
        return _groups.coalesce(out, sizes, coalesce_below), meta, nbytes

    def release(self, group_ids: Iterable[str]) -> int:
        """Free the payload of these groups (unknown ids are ignored); returns how many were freed.

        Metadata history stays; images no longer referenced by any unreleased group are freed.
        """
        freed = 0
        ids = list(dict.fromkeys(group_ids))
        with self._lock:
            live = {g: self._contents.groups.live(g) for g in ids if self._contents.groups.is_live(g)}
        # the tombstones' digests (~1 ms a group) outside the lock: a stored group's blocks never change
        digests = {g: _groups.content_digests(group.batches) for g, group in live.items()}
        with self._lock:
            todo = [g for g in ids if self._contents.groups.is_live(g)]  # released meanwhile: skipped
            # a group written again meanwhile (its tombstone forgotten) is digested anew, under the lock
            same = {g: digests[g] for g in todo if g in live and self._contents.groups.live(g) is live[g]}
            if todo:
                self._journal.release(todo)
                freed = self._contents.commit_release(todo, same)
                self._journal.maybe_compact(self._contents)
        if freed:
            self.memory.free_unused()
        return freed

    def group_info(self, group_id: str) -> tuple[int, int, list[tuple[int, int]]]:
        """``(rows, bytes, contiguous [start, stop) runs of sample_idx)`` of an unreleased group."""
        with self._lock:
            group = self._contents.groups.live(group_id)
            idx = sorted(group.index)
            nbytes = group.nbytes
        return len(idx), nbytes, _groups.runs(idx)

    def group_ids(self, *, after: str | None = None, limit: int | None = None) -> list[str]:
        """Ids of the unreleased groups, in arrival order (those after ``after``; at most ``limit``)."""
        with self._lock:
            ids = self._contents.groups.ids()
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        return ids if limit is None else ids[:limit]

    # ---- metadata ------------------------------------------------------------------------------

    def metadata(self, since: int = 0, columns: Sequence[str] | None = None) -> pa.Table:
        """Metadata rows with ``seq >= since``; ``seq`` first, then ``columns`` (all when ``None``).

        The ``released`` column says, at the time of the scan, whether the row's group was released.
        """
        _metadata.check_columns(columns)
        with self._lock:
            merged = not self._contents.metadata.cached
            table = _metadata.project(self._contents.metadata.table(), since, None)
        ids = pc.unique(table.column("group_id")).to_pylist()
        with self._lock:
            released = self._contents.groups.released_among(ids)
        if merged:  # the merged chunks were freed on this thread
            self.memory.free_unused()
        return _metadata.with_released(table, released, columns)

    # ---- images --------------------------------------------------------------------------------

    def put_images(self, table: pa.Table | pa.RecordBatch, *, incoming: Incoming | None = None) -> int:
        """Store the images whose key is new; returns how many were stored.

        Raises:
            SchemaMismatchError: the table does not fit ``IMAGE_SCHEMA`` or a key does not match its bytes.
            CapacityExceededError, BudgetExceededError: the new images do not fit (none stored).
        """
        with contextlib.ExitStack() as stack:
            if incoming is None:
                incoming = stack.enter_context(self._own_incoming("images", [table]))
            t = normalize_images(table)
            with self._lock:
                new = self._contents.images.new(t.to_batches())
                needed = sum(v.held for v in new.values())
                self.memory.reserve(needed, f"{len(new)} image(s)", incoming.others)
                if new:
                    self.memory.check_rss(0, f"{len(new)} image(s)")
                    self._journal.images([v.row for v in new.values()])
                return self._contents.commit_images(new)
        raise AssertionError  # pragma: no cover - the with block returns or raises

    def images(self, keys: Sequence[bytes], *, missing_ok: bool = False) -> pa.Table:
        """Image rows for ``keys``, in key order. Raises :class:`UnknownImageError` naming a missing key
        (``missing_ok``: leaves it out)."""
        with self._lock:
            found = self._contents.images.rows(keys, missing_ok=missing_ok)
            self.bytes_out += sum(img.nbytes for img in found)
            rows = [img.row for img in found]
        return images_table(rows)

    # ---- weights & version ---------------------------------------------------------------------

    def put_weights(self, table: pa.Table, version: int, *, incoming: Incoming | None = None) -> bool:
        """Keep ``table`` as the newest weights, of ``version``; a version not newer than the latest is ignored.

        The table is checked first (``schemas.weights``: schema, at least one tensor, unique names, known
        dtypes, data sizes matching the shapes), logged (its own file), then counted against the budget and
        the RSS guard like any write before it is kept (a refused version's file is removed). The newest
        :attr:`StoreConfig.weights_versions` are kept.

        Raises:
            SchemaMismatchError: the table breaks a rule of the weights table (names the tensor).
            CapacityExceededError, BudgetExceededError: it does not fit (nothing stored).
        """
        what = f"weights v{version}"
        with contextlib.ExitStack() as stack:
            if incoming is None:
                incoming = stack.enter_context(self._own_incoming(what, [table]))
            try:
                checked = weights_codec.check(table)
            except weights_codec.WeightsError as exc:
                raise SchemaMismatchError(str(exc), column=None) from None
            slot = self._contents.weights
            with self._lock:
                if not slot.accepts(version):
                    return False
            # copied into its block and written to its own file (no order to keep with the log) without the
            # store's lock: hundreds of MB take seconds, and the trainer's reads go on meanwhile
            batch = one_batch(checked)
            packed = pack(batch)
            self._journal.weights(batch.schema, packed[0], version)
            with self._lock:
                try:
                    if not slot.accepts(version):  # a newer version landed meanwhile
                        return False
                    leaving = slot.leaving()
                    freed = slot.held(leaving) if leaving is not None else 0
                    self.memory.reserve(max(0, packed[1] - freed), what, incoming.others)
                    self.memory.check_rss(0, what)
                    self._contents.commit_weights(batch, version, packed)
                finally:
                    self._journal.keep_weights(slot.versions, written=version)  # a version not kept leaves
                return True
        raise AssertionError  # pragma: no cover - the with block returns or raises

    def weights(self, version: int | None = None) -> tuple[pa.Table, int]:
        """The latest weights table and its version (exactly ``version`` when given)."""
        with self._lock:
            table, stored = self._contents.weights.get(version)
            self.bytes_out += table.nbytes
            return table, stored

    def publish_version(self, version: int) -> int:
        """Record the newest policy version (monotonic: an older one is ignored); returns the stored one.

        Raises:
            LimitExceededError: ``version`` jumps more than :data:`MAX_VERSION_STEP` past the stored one (it
                would freeze the version: every real one after it would be ignored).
        """
        with self._lock:
            published = self._contents.weights.published
            if version > published + MAX_VERSION_STEP:
                msg = (f"version {version} jumps more than {MAX_VERSION_STEP} past the published {published}; "
                       "refused (a policy version counts optimizer steps)")
                raise LimitExceededError(msg, limit="version_step", value=version - published)
            if self._contents.weights.newer(int(version)):
                self._journal.version(int(version))
                self._contents.commit_version(int(version))
            return self._contents.weights.published

    def get_version(self) -> int:
        """The newest published policy version (0 before any publish)."""
        with self._lock:
            return self._contents.weights.published

    # ---- stats ---------------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        """Counters for the ``stats`` action."""
        with self._lock:
            c, memory = self._contents, self.memory
            stored, released, rows_stored = c.groups.counts()
            rss = memory.rss()
            return NodeStats.model_validate({
                "node": self.config.node_name,
                "schema_version": SCHEMA_VERSION,
                "rows": c.groups.rows,
                "rows_stored": rows_stored,
                "metadata_rows": c.metadata.seq,
                "metadata_rows_held": c.metadata.rows,
                "tombstones": len(c.groups.tombstones()),
                "spill_bytes": self._journal.size,
                "spill_compactions": self._journal.compactions,
                "groups": {"stored": stored, "released": released, "inflight": len(c.dispatched)},
                "demand": dict(self.supply.demand),
                "bytes": memory.payload,
                "images": len(c.images),
                "image_bytes": c.images.nbytes,
                "weights_version": c.weights.version,
                "policy_version": c.weights.published,
                "memory_budget": self.config.memory_budget,
                "memory_used": memory.used,
                "memory_in_flight": memory.in_flight,
                "memory_rss": rss,
                "memory_rss_limit": None if rss is None else memory.rss_limit,
                "bytes_in": c.bytes_in,
                "bytes_out": self.bytes_out,
                "uptime_s": round(time.time() - self.started, 3),
            })
