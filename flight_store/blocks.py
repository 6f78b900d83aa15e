"""The blocks stored batches live in: :func:`pack` copies a record batch into ONE exactly sized block of its own
(an encapsulated IPC message, in pages of its own when large) and :func:`view` reads it back as zero-copy views.

What a block holds against the budget (:mod:`flight_store.memory` counts it) is what :func:`pack` returns: its
whole pages (or its size class in the Arrow pool) plus :data:`BLOCK_OVERHEAD` and :data:`ROW_OVERHEAD` per row.
"""

from __future__ import annotations

import logging
import mmap
from typing import TypeAlias

import numpy as np
import pyarrow as pa

from schemas.arrow import TRAJECTORY_SCHEMA

log = logging.getLogger(__name__)

Block: TypeAlias = mmap.mmap | pa.Buffer
"""One stored batch as an encapsulated IPC message (see :func:`pack`)."""

BLOCK_OVERHEAD = 1024
"""Bytes of Python objects per stored block besides its memory: the mmap (or buffer) object, the group
record, its dict entry and key, the index dict and block list (measured: ~0.6 KiB a group)."""
ROW_OVERHEAD = 64 + 4 * len(TRAJECTORY_SCHEMA)
"""Bytes per stored row of the ``sample_idx -> (block, offset)`` index (dict slot and tuple) and of its
payload sizes (:func:`schemas.native.row_bytes`)."""
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
"""Private pages, faulted in by the one ``mmap`` call (Linux): one call that maps and faults a block's pages in costs
about half of faulting them one by one as the block is filled (figures: docs/benchmarks.md, diagnostic timings)."""
_MMAP_MIN = 16 << 10
"""Blocks of at least this many bytes get pages of their own (see :func:`pack`); smaller ones come from the
Arrow memory pool."""


def _pages(n: int) -> int:
    """``n`` rounded up to whole pages."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _size_class(n: int) -> int:
    """``n`` rounded up the way a size-class allocator (mimalloc, jemalloc) does: 4 classes per power of two."""
    if n <= 64:
        return 64
    step = max(16, 1 << ((n - 1).bit_length() - 3))
    return -(-n // step) * step


_SERIALIZE_POOL = pa.system_memory_pool()
"""Where :func:`pack` serializes a batch it then copies into an mmap block: glibc malloc hands the same warm
chunk to the next write, where the Arrow pool, emptied after every write (:func:`return_free_memory`), faults
fresh pages in, several times the cost for a group of ~150 KiB (docs/benchmarks.md, diagnostic timings)."""


def _pool_copy(buf: pa.Buffer) -> pa.Buffer:
    """``buf`` copied into the Arrow memory pool."""
    out = pa.allocate_buffer(buf.size)
    np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(buf, dtype=np.uint8)
    return out


def pack(batch: pa.RecordBatch) -> tuple[Block, int]:
    """``batch`` copied into ONE block of memory of its own; returns the block and the bytes it holds.

    Why: a batch that arrived over gRPC is a set of views into the received message (gRPC's own
    malloc'd memory, larger than the columns kept) plus small buffers validation added, and an
    in-memory ``RecordBatch`` of the 19-column trajectory schema holds kilobytes of C++/Python
    objects (``ArrayData``, ``Buffer``, control blocks), a large share of a 32 KiB group. Keeping
    those would pin memory the budget never sees, well above the budget at peak (figures:
    docs/benchmarks.md, diagnostic timings).

    So the batch is serialized as one encapsulated IPC message (``RecordBatch.serialize``, exact
    size) and :func:`view` reads it back as zero-copy views whenever it is sliced (~15 us). A block
    of at least :data:`_MMAP_MIN` bytes is copied into an anonymous private ``mmap`` of its own:
    releasing the group unmaps it (once no in-flight answer still views it), so its pages go back
    to the OS at once and the heap never fragments. General-purpose allocators (glibc, mimalloc and
    jemalloc alike) fed ~32 KiB blocks freed in arrival-unrelated order keep well over the live bytes
    resident. Smaller blocks stay in the Arrow pool (where a page of their own would waste
    more than the allocator does); if ``mmap`` fails (e.g. the map-count limit) the block stays in
    malloc's heap, where it was serialized.

    Bytes held: the whole pages of an mmap block (or the pool block rounded to its size class),
    plus :data:`BLOCK_OVERHEAD` and :data:`ROW_OVERHEAD` per row.
    """
    # a block to be copied into pages of its own is serialized where the next write finds warm memory; its
    # buffers' size tells which (a message is at most ~2 KiB of metadata and padding more than an unsliced
    # batch's buffers; a slice's buffers may be larger than its message: checked below)
    warm = batch.get_total_buffer_size() >= _MMAP_MIN // 2  # ~1 us, where the exact size costs ~10
    message = batch.serialize(memory_pool=_SERIALIZE_POOL if warm else None)
    large = message.size >= _MMAP_MIN
    if warm and not large:  # a small slice of a large batch: its block belongs in the Arrow pool
        message = _pool_copy(message)
    block, size = message, _size_class(message.size)
    if large:
        try:
            region = mmap.mmap(-1, message.size, flags=_MAP_FLAGS)
        except OSError:
            log.warning("mmap of a %d-byte block failed; keeping it in the heap", message.size)
        else:
            region.write(message)
            block, size = region, _pages(message.size)
    return block, size + BLOCK_OVERHEAD + ROW_OVERHEAD * batch.num_rows


def view(block: Block, schema: pa.Schema) -> pa.RecordBatch:
    """The batch :func:`pack` stored in ``block``, as zero-copy views into it.

    An mmap block is wrapped in a ``pa.Buffer`` only here, for as long as the views live: a
    wrapper kept per stored block is a small C++ allocation in the arena of whichever gRPC thread
    stored it, and ~2000 of those scattered over glibc's per-thread arenas pinned pages that
    ``malloc_trim`` could not give back. The views keep the mmap alive (buffer export) until they
    are gone, even if the group is released meanwhile.
    """
    return pa.ipc.read_record_batch(pa.py_buffer(block) if isinstance(block, mmap.mmap) else block, schema)
