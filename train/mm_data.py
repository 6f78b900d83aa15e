"""Fetch one rank's multimodal mini-batch: its trajectory slices, then each distinct image once.

A rank's share of a mini-batch is a list of micro-batches. :func:`fetch_mm_mini_batch` reads all
their slices at once (``StoreReader.fetch``: one read per node, only the packing columns plus
``image_keys``), splits the rows back into micro-batches and packs each, collects the distinct image
keys of ALL the micro-batches (``train.multimodal.distinct_image_keys``), and fetches each distinct image
once, from the node that stores the group referencing it (``StoreReader.fetch_images``: one DoGet per
node). Images are never replicated into trajectories: a row carries 32-byte keys, the encoder sees each image once.

Needs numpy and pyarrow; torch only through ``PackedBatch.to_torch`` when the caller asks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flight_store.reading import StoreReader
from flight_store.streams import keys_by_node
from schemas.images import table_to_images
from schemas.plan import MicroBatch
from train.config import PackMode
from train.multimodal import distinct_image_keys
from train.packing import PACK_COLUMNS, PackedBatch, pack_tensors

MM_COLUMNS: tuple[str, ...] = (*PACK_COLUMNS, "image_keys")
"""Trajectory columns a multimodal trainer rank fetches (images themselves come by key)."""


@dataclass(kw_only=True, slots=True)
class MMMiniBatch:
    """One rank's fetched mini-batch: packed micro-batches, each row's image keys, the distinct images."""

    packed: list[PackedBatch]
    """One packed batch per micro-batch, in plan order."""
    row_keys: list[list[list[bytes]]]
    """Micro-batch -> row -> image keys (repeats across rows are the point: they share one encoding)."""
    images: dict[bytes, np.ndarray]
    """Distinct image key -> pixels (first-seen order), each fetched once."""
    row_ids: list[tuple[str, int]] = field(default_factory=list)
    """``(group_id, sample_idx)`` of every row, in plan order."""
    trajectory_bytes: int = 0
    """Arrow bytes of the fetched trajectory columns."""
    image_bytes: int = 0
    """Arrow bytes of the fetched image rows."""
    read_s: float = 0.0
    """Seconds reading the trajectory rows (one read per node over its read channel)."""
    image_doget_s: float = 0.0
    """Seconds in the image DoGet(s)."""
    pack_s: float = 0.0
    """Seconds packing rows into micro-batch arrays."""
    keys_by_node: dict[str, list[bytes]] = field(default_factory=dict)
    """What was asked of each node."""

    @property
    def references(self) -> int:
        """Image references over all rows (what a per-reference encoder would encode)."""
        return sum(len(r) for mb in self.row_keys for r in mb)


def fetch_mm_mini_batch(client: StoreReader, micro_batches: Sequence[MicroBatch], *, mode: PackMode = "padded",
                        columns: Sequence[str] = MM_COLUMNS) -> MMMiniBatch:
    """Read the slices of ``micro_batches`` (``columns``: at least :data:`MM_COLUMNS`), pack them, and fetch each
    distinct image once."""
    slices = [s for mb in micro_batches for s in mb.slices]
    t0 = time.perf_counter()
    table = client.fetch(slices, columns=list(columns))
    t1 = time.perf_counter()
    expected = sum(mb.rows for mb in micro_batches)
    if table.num_rows != expected:
        msg = f"fetched {table.num_rows} rows for micro-batches of {expected} rows"
        raise RuntimeError(msg)
    packed: list[PackedBatch] = []
    row_keys: list[list[list[bytes]]] = []
    node_of: dict[bytes, str] = {}
    offset = 0
    for mb in micro_batches:
        part = table.slice(offset, mb.rows)
        packed.append(pack_tensors(part, mb.advantages, mode=mode))
        keys = [[bytes(k) for k in row] for row in part.column("image_keys").to_pylist()]
        row_keys.append(keys)
        row = 0
        for s in mb.slices:  # an image is fetched from the (first) node storing a group that references it
            for r in keys[row:row + s.rows]:
                for k in r:
                    node_of.setdefault(k, s.node)
            row += s.rows
        offset += mb.rows
    t2 = time.perf_counter()
    distinct = distinct_image_keys(row_keys)
    images_table = client.fetch_images(distinct, nodes=node_of)
    t3 = time.perf_counter()
    got = table_to_images(images_table)
    missing = [k for k in distinct if k not in got]
    if missing:
        msg = f"image {missing[0].hex()} was not returned by the stores"
        raise RuntimeError(msg)
    return MMMiniBatch(
        packed=packed, row_keys=row_keys, images={k: got[k] for k in distinct},
        row_ids=list(zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist(), strict=True)),
        trajectory_bytes=table.nbytes, image_bytes=images_table.nbytes, read_s=t1 - t0,
        image_doget_s=t3 - t2, pack_s=t2 - t1, keys_by_node=keys_by_node(distinct, node_of),
    )


def pooled_row_features(encoder: Any, row_keys: Sequence[Sequence[bytes]], width: int) -> Any:
    """``[rows, width]``: the mean encoding of each row's images (zeros for a row without images).

    ``encoder`` is a started :class:`train.multimodal.DedupVisionEncoder`; the result indexes its
    shared leaf, so a backward pass through it accumulates into the leaf's gradient.
    """
    import torch

    flat = [k for row in row_keys for k in row]
    if not flat:
        return torch.zeros(len(row_keys), width)
    feats = encoder.lookup(flat)  # [refs, width]
    owner = torch.as_tensor(np.repeat(np.arange(len(row_keys)), [len(r) for r in row_keys]), dtype=torch.long)
    counts = torch.as_tensor([max(len(r), 1) for r in row_keys], dtype=feats.dtype)
    summed = torch.zeros(len(row_keys), feats.shape[-1], dtype=feats.dtype).index_add(0, owner, feats)
    return summed / counts[:, None]

