"""The group table: the prompt groups a store holds, their row index, slicing and release bookkeeping.

Each prompt group is written whole, once (one DoPut stream), and kept as the record batches that
arrived (normalised to ``TRAJECTORY_SCHEMA``), each in one block of its own
(:func:`flight_store.blocks.pack`), plus a row index ``sample_idx -> (batch, offset)``, so a slice
request is served by zero-copy ``RecordBatch.slice`` of the batch viewed in its block (never a
filter or take over one big table; only tiny multi-slice answers may be coalesced into one small
copy, see :func:`project`). A released group drops its blocks and index but keeps a digest of each
column of its content (:func:`content_digests`, ~150 bytes), so a retried write of it is
recognised (and one with other content refused, naming the column).

Not thread-safe by itself: the store calls a :class:`GroupTable` under its lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flight_store.blocks import Block, view
from flight_store.errors import ConflictError, GroupReleasedError, SchemaMismatchError, UnknownGroupError
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.native import row_bytes
from schemas.trajectory_rules import offset_lengths

_TRAJ_COLUMNS = frozenset(TRAJECTORY_SCHEMA.names)
_NO_META: dict[str, str] = {}  # shared by every group without writer metadata; never mutated
_COLUMN_INDEX = {name: i for i, name in enumerate(TRAJECTORY_SCHEMA.names)}
_SAMPLE_IDX, _IMAGE_KEYS = _COLUMN_INDEX["sample_idx"], _COLUMN_INDEX["image_keys"]  # by index: by name costs more


@dataclass(slots=True)
class Group:
    """One prompt group: its stored batches (blocks), row index and what it holds."""

    blocks: list[Block] = field(default_factory=list)
    """One buffer per stored batch: the batch as an encapsulated IPC message (see
    :func:`~flight_store.blocks.pack`)."""
    index: dict[int, tuple[int, int]] = field(default_factory=dict)
    row_bytes: list[np.ndarray] = field(default_factory=list)
    """Per stored batch: payload bytes of each row and column (:func:`row_bytes`), for ``bytes_out``."""
    nbytes: int = 0
    """Payload bytes (``RecordBatch.nbytes``) of the stored rows."""
    held: int = 0
    """Memory counted against the budget (blocks plus object and index overhead, see
    :func:`~flight_store.blocks.pack`)."""
    image_keys: frozenset[bytes] = frozenset()
    """Images the group references (the shared empty frozenset when none)."""
    meta: dict[str, str] = field(default_factory=dict)
    """The writer's ``knittrans.*`` schema metadata (e.g. ``knittrans.logprobs_mode``), served back with slices."""
    rows: int = 0
    """Rows the group holds (or held, once released)."""
    seq: int = 0
    """``seq`` of the group's first metadata row."""
    ordered: bool = False
    """One stored batch holding ``sample_idx`` 0..rows-1 in order (row ``i`` at offset ``i``): how writers send a
    group, and what lets a read skip the row index."""
    released: bool = False
    digests: bytes = b""
    """Of a released group: :func:`content_digests` of what it held (its payload is gone)."""

    def batch(self, i: int) -> pa.RecordBatch:
        """Stored batch ``i``: zero-copy views into its block."""
        return view(self.blocks[i], TRAJECTORY_SCHEMA)

    @property
    def batches(self) -> list[pa.RecordBatch]:
        """All stored batches (views into the blocks), in arrival order."""
        return [self.batch(i) for i in range(len(self.blocks))]


IDENTITY_COLUMNS: tuple[str, ...] = tuple(c for c in TRAJECTORY_SCHEMA.names
                                         if c not in ("bytes", "created_at", "completed_at"))
"""The columns that make a group's content: a rewrite must match them all (timestamps and ``bytes`` are
bookkeeping: a retry may restamp them)."""


_DIGEST = 16


def content_digests(batches: Sequence[pa.RecordBatch]) -> bytes:
    """A 16-byte digest of each :data:`IDENTITY_COLUMNS` column of a group's rows (``sample_idx`` order), joined."""
    table = pa.Table.from_batches(list(batches), schema=TRAJECTORY_SCHEMA).select(list(IDENTITY_COLUMNS))
    if (np.diff(table.column("sample_idx").to_numpy()) < 0).any():  # rows out of order: a copy in order
        table = table.sort_by("sample_idx")
    out = b""
    for name in IDENTITY_COLUMNS:
        column = pa.RecordBatch.from_arrays([table.column(name).combine_chunks()], names=[name])
        out += hashlib.blake2b(column.serialize(), digest_size=_DIGEST).digest()
    return out


def first_difference(a: bytes, b: bytes) -> str | None:
    """The first of :data:`IDENTITY_COLUMNS` whose digests differ (``None`` when the contents are equal)."""
    return next((name for i, name in enumerate(IDENTITY_COLUMNS)
                 if a[i * _DIGEST:(i + 1) * _DIGEST] != b[i * _DIGEST:(i + 1) * _DIGEST]), None)


def writer_meta(schema: pa.Schema) -> dict[str, str]:
    """The ``knittrans.*`` schema metadata a writer attached (the schema's own version and table name excepted)."""
    own = {"knittrans.schema_version", "knittrans.table"}
    return {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()
            if k.startswith(b"knittrans.") and k.decode() not in own}


def common_meta(groups: Iterable[Group]) -> dict[str, str]:
    """The writer metadata all ``groups`` agree on (a key with different values is left out); not to be changed (it
    may be a group's own)."""
    out: dict[str, str] | None = None
    for g in groups:
        if out is None:
            out = g.meta
        elif g.meta is not out and g.meta != out:
            out = {k: v for k, v in out.items() if g.meta.get(k) == v}
    return out or _NO_META


def image_keys_of(batches: Sequence[pa.RecordBatch]) -> frozenset[bytes]:
    """The distinct image keys the rows of ``batches`` reference."""
    keys: set[bytes] = set()
    for b in batches:
        column = b.column(_IMAGE_KEYS)
        # most groups name no image: no values at all (a slice's values may be other rows'), or none in its rows
        if len(column.values) and offset_lengths(column).any():
            keys.update(pc.unique(column.flatten()).to_pylist())
    return frozenset(keys)


def check_columns(columns: Sequence[str] | None) -> None:
    """Refuse a projection naming a column the trajectory schema lacks (:class:`SchemaMismatchError`)."""
    for c in columns or ():
        if c not in _TRAJ_COLUMNS:
            msg = f"unknown column {c!r} requested; the trajectory schema has {TRAJECTORY_SCHEMA.names}"
            raise SchemaMismatchError(msg, column=c)


COALESCE_MIN_SLICES = 4
"""An answer of this many slices or fewer is never copied together: on loopback, for 8-row slices, the copy
costs more than the IPC messages it saves for 2 slices, about the same for 4, and less for 8."""


def coalesce(out: list[pa.RecordBatch], sizes: Sequence[int], coalesce_below: int) -> Iterator[pa.RecordBatch]:
    """The slices of :meth:`GroupTable.slices`, small ones copied together, lazily.

    With ``coalesce_below`` > 0, in an answer of more than :data:`COALESCE_MIN_SLICES` slices, each run of
    consecutive slices under ``coalesce_below // 16`` payload bytes is copied into batches of up to
    ``coalesce_below // 4`` bytes (for a micro-batch of many small slices one small copy is cheaper than
    one IPC message per slice; an answer of thousands of tiny slices streams as a few messages of
    bounded size). Larger slices stay zero-copy views. Each chunk is cut when the caller reaches it:
    an answer streamed to a trainer (a whole step's micro-batches) sends its first micro-batch
    before the rest is copied.
    """
    if coalesce_below <= 0 or len(out) <= COALESCE_MIN_SLICES:
        yield from out
        return
    small, chunk = coalesce_below // 16, coalesce_below // 4
    run: list[pa.RecordBatch] = []
    run_bytes = 0
    for batch, size in zip(out, sizes, strict=True):
        if run and (size >= small or run_bytes + size > chunk):
            yield pa.concat_batches(run) if len(run) > 1 else run[0]
            run, run_bytes = [], 0
        if size >= small:
            yield batch
        else:
            run.append(batch)
            run_bytes += size
    if run:
        yield pa.concat_batches(run) if len(run) > 1 else run[0]


VIEWS_KEPT = 256
"""Projected views of stored batches a store keeps between reads, the least recently read dropped first
(a released group's at once). A view costs ~6 us to make from its block and a projection ~5 us more,
per stored batch and read: most of a micro-batch read's server time, as a group's rows are read by
several micro-batches and ranks. Bounded, as each view is a small allocation in the arena of the
thread that made it (see :func:`~flight_store.blocks.view`)."""


def runs(sample_idx: Iterable[int]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` runs of sorted ``sample_idx``."""
    out: list[tuple[int, int]] = []
    for s in sample_idx:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


class GroupTable:
    """The prompt groups of one store: the live ones in arrival order, and tombstones of released ones.

    A released group leaves a tombstone (its row count and content digests) so a retried write of it is
    recognised; at most ``tombstones`` are kept, the oldest forgotten first (a write of a forgotten group
    would be stored again: keep the window far longer than any writer's retries).
    """

    def __init__(self, node_name: str, *, tombstones: int = 100_000) -> None:
        self.node_name = node_name
        self.max_tombstones = tombstones
        self._live: dict[str, Group] = {}
        self._released: OrderedDict[str, Group] = OrderedDict()
        self._views: OrderedDict[tuple[str, int, tuple[int, ...] | None],
                                 tuple[Group, pa.RecordBatch, list[int]]] = OrderedDict()
        """The most recently read batches, viewed and projected (see :data:`VIEWS_KEPT`)."""
        self.rows = 0
        """Rows ever committed (released ones included)."""
        self.rows_live = 0
        """Rows of the unreleased groups."""
        self.released_total = 0
        """Groups released since the store started (tombstones forgotten included)."""

    def __getitem__(self, group_id: str) -> Group:
        return self._live.get(group_id) or self._released[group_id]

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._live or group_id in self._released

    def get(self, group_id: str) -> Group | None:
        """The group (live, or the tombstone of a released one), or ``None``."""
        return self._live.get(group_id) or self._released.get(group_id)

    def live(self, group_id: str) -> Group:
        """The unreleased group ``group_id``; raises :class:`UnknownGroupError` / :class:`GroupReleasedError`."""
        group = self._live.get(group_id)
        if group is not None:
            return group
        if group_id in self._released:
            msg = f"group {group_id!r} was released; its payload is gone"
            raise GroupReleasedError(msg, group_id=group_id)
        msg = f"group {group_id!r} is not stored on node {self.node_name}"
        raise UnknownGroupError(msg, group_id=group_id)

    def is_live(self, group_id: str) -> bool:
        """Whether ``group_id`` is stored and not released."""
        return group_id in self._live

    def ids(self) -> list[str]:
        """Ids of the unreleased groups, in arrival order."""
        return list(self._live)

    def live_items(self) -> list[tuple[str, Group]]:
        """The unreleased groups, in arrival order."""
        return list(self._live.items())

    def tombstones(self) -> list[tuple[str, Group]]:
        """The released groups remembered, oldest first."""
        return list(self._released.items())

    def counts(self) -> tuple[int, int, int]:
        """``(stored groups, released groups, rows stored)``."""
        return len(self._live), self.released_total, self.rows_live

    # ---- writes ----------------------------------------------------------------------------------

    def check_rewrite(self, group_id: str, batches: Sequence[pa.RecordBatch]) -> bool:
        """Whether ``group_id`` is stored (or was, and is released) with the same content as ``batches``.

        Returns False for a new group. A rewrite with the same content is a no-op (idempotent retry).

        Raises:
            ConflictError: the group was written with other content (names the first differing column).
        """
        group = self.get(group_id)
        if group is None:
            return False
        state = "was consumed" if group.released else "is stored"
        rows = sum(b.num_rows for b in batches)
        if rows != group.rows:
            msg = f"group {group_id!r} {state} with {group.rows} rows; the rewrite has {rows}"
            raise ConflictError(msg, group_id=group_id, column="sample_idx")
        stored = group.digests if group.released else content_digests(group.batches)
        column = first_difference(content_digests(batches), stored)
        if column is not None:
            msg = f"group {group_id!r} {state} with other content: column {column!r} differs"
            raise ConflictError(msg, group_id=group_id, column=column)
        return True

    def add(self, group_id: str, fresh: Sequence[pa.RecordBatch], packed: Sequence[tuple[Block, int]],
            meta: dict[str, str] | None = None, seq: int = 0, image_keys: frozenset[bytes] | None = None,
            sizes: Sequence[np.ndarray | None] = (),
            ) -> frozenset[bytes]:
        """Store the validated batches of a new group (its first metadata row is ``seq``) and their blocks;
        returns the image keys it names (``image_keys``, when the caller read them already). ``sizes``: the
        batches' :func:`row_bytes` where validation read them already."""
        group = self._live[group_id] = Group(meta=meta or _NO_META, seq=seq)
        for bno, (b, (block, held)) in enumerate(zip(fresh, packed, strict=True)):
            group.blocks.append(block)
            known = sizes[bno] if bno < len(sizes) else None
            sizes_b = row_bytes(b) if known is None else known
            group.row_bytes.append(sizes_b)
            idx = b.column(_SAMPLE_IDX).to_numpy().tolist()
            group.index.update(zip(idx, [(bno, off) for off in range(len(idx))], strict=True))
            group.nbytes += int(sizes_b.sum())  # = b.nbytes for a whole batch, without its ~40 us
            group.held += held
            group.rows += b.num_rows
        group.ordered = len(fresh) == 1 and idx == list(range(group.rows))
        self.rows += group.rows
        self.rows_live += group.rows
        keys = image_keys_of(fresh) if image_keys is None else image_keys
        if keys:
            group.image_keys = keys
        return keys

    def release(self, group_id: str, digests: bytes | None = None) -> Group | None:
        """Drop the payload of ``group_id`` (``None`` if unknown or released); returns what it held.

        The returned record keeps the group's ``held``, ``nbytes`` and ``image_keys`` for the caller's
        accounting; the table keeps the group's tombstone (``digests``: its :func:`content_digests`, computed
        here unless the caller did so already, outside the store's lock).
        """
        group = self._live.pop(group_id, None)
        if group is None:
            return None
        for key in [k for k in self._views if k[0] == group_id]:  # its views would keep its blocks mapped
            del self._views[key]
        self.rows_live -= group.rows
        self.released_total += 1
        self.remember(group_id, group.rows, content_digests(group.batches) if digests is None else digests, group.seq)
        return group

    def remember(self, group_id: str, rows: int, digests: bytes, seq: int) -> None:
        """Keep the tombstone of a released group (the oldest one is forgotten beyond ``tombstones``)."""
        self._released[group_id] = Group(rows=rows, released=True, digests=digests, seq=seq)
        while len(self._released) > self.max_tombstones:
            self._released.popitem(last=False)

    def released_among(self, group_ids: Iterable[str]) -> list[str]:
        """The ids among ``group_ids`` of groups that were released here (and are still remembered)."""
        return [g for g in group_ids if g in self._released]

    # ---- reads -----------------------------------------------------------------------------------

    def slices(
        self, refs: Iterable[tuple[str, int, int]], columns: Sequence[str] | None
    ) -> tuple[list[pa.RecordBatch], list[int], dict[str, str]]:
        """Zero-copy slices of rows ``[start, stop)`` per ``(group_id, start, stop)``, projected to ``columns``
        (all when ``None``), the payload bytes of each, and the writer metadata all their groups share.

        Each run of consecutive rows of one stored batch is one ``RecordBatch.slice`` (a view, no
        copy). A stored batch is read (:func:`~flight_store.blocks.view`), projected and its rows' bytes
        summed once, and kept for the next reads (:data:`VIEWS_KEPT`).
        """
        cols = None if columns is None else tuple(map(_COLUMN_INDEX.__getitem__, columns))
        out: list[pa.RecordBatch] = []
        sizes: list[int] = []  # payload bytes of the projected rows of each slice (see row_bytes)
        seen: dict[str, Group] = {}
        for group_id, start, stop in refs:
            group = seen[group_id] = self._live.get(group_id) or self.live(group_id)  # live() names what is wrong
            runs = ([(0, start, stop - start)] if group.ordered and stop <= group.rows  # the row index not needed
                    else self._runs_of(group_id, group, start, stop))
            for bno, off, rows in runs:
                batch, per_row = self._projected(group_id, group, bno, cols)
                out.append(batch.slice(off, rows))
                sizes.append(sum(per_row[off : off + rows]))
        return out, sizes, common_meta(seen.values())

    def _projected(self, group_id: str, group: Group, bno: int,
                   cols: tuple[int, ...] | None) -> tuple[pa.RecordBatch, list[int]]:
        """Stored batch ``bno`` of ``group`` viewed and projected to the column indices ``cols``, and its rows'
        payload bytes; kept for the next reads (a group's batches are read by several micro-batches and ranks)."""
        key = (group_id, bno, cols)
        got = self._views.get(key)
        if got is not None and got[0] is group:
            self._views.move_to_end(key)
            return got[1], got[2]
        batch, per_row = group.batch(bno), group.row_bytes[bno]
        if cols is not None:
            batch, per_row = batch.select(cols), per_row[:, cols]
        sums = per_row.sum(axis=1).tolist()
        self._views[key] = (group, batch, sums)
        if len(self._views) > VIEWS_KEPT:
            self._views.popitem(last=False)
        return batch, sums

    def _runs_of(self, group_id: str, group: Group, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(batch, offset, rows)`` runs of consecutive stored rows holding ``sample_idx`` ``[start, stop)``."""
        found: list[tuple[int, int, int]] = []
        run_b, run_off, run_len = -1, -1, 0
        for s in range(start, stop):
            loc = group.index.get(s)
            if loc is None:
                msg = f"group {group_id!r} has no row sample_idx={s} on node {self.node_name}"
                raise UnknownGroupError(msg, group_id=group_id)
            if loc[0] == run_b and loc[1] == run_off + run_len:
                run_len += 1
                continue
            if run_len:
                found.append((run_b, run_off, run_len))
            run_b, run_off, run_len = loc[0], loc[1], 1
        if run_len:
            found.append((run_b, run_off, run_len))
        return found
