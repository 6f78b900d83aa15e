"""The image table of a store: images keyed by content hash, stored once, shared by reference.

Each distinct image row (``IMAGE_SCHEMA``) is kept in a block of its own
(:func:`flight_store.blocks.pack`), whatever the number of groups and responses naming it. An
image is reference-counted by the unreleased groups whose ``image_keys`` name it: releasing the
last of them frees it (an image put before any group names it stays until then).

Not thread-safe by itself: the store calls an :class:`ImageTable` under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from flight_store.blocks import Block, pack, view
from flight_store.errors import UnknownImageError
from flight_store.validate import normalize_images
from schemas.arrow import IMAGE_SCHEMA


@dataclass(slots=True)
class Image:
    """One stored image row."""

    block: Block
    nbytes: int
    """Payload bytes of the row."""
    held: int
    """Memory counted against the budget (see :func:`~flight_store.blocks.pack`)."""

    @property
    def row(self) -> pa.RecordBatch:
        """The image row (zero-copy views into its block)."""
        return view(self.block, IMAGE_SCHEMA)


class ImageTable:
    """Images by content key, with the number of unreleased groups naming each."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._images: dict[bytes, Image] = {}
        self._refs: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._images)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the stored images."""
        return sum(v.nbytes for v in self._images.values())

    def new(self, batches: Iterable[pa.RecordBatch]) -> dict[bytes, Image]:
        """The image rows of ``batches`` whose key is not stored yet, each packed into a block of its own."""
        new: dict[bytes, Image] = {}
        for b in batches:
            for i, k in enumerate(b.column("image_key").to_pylist()):
                if k in self._images or k in new:
                    continue
                row = b.slice(i, 1)
                block, held = pack(row)  # own copy: the received message is not kept alive
                new[k] = Image(block=block, nbytes=row.nbytes, held=held)
        return new

    def add(self, new: dict[bytes, Image]) -> None:
        """Store the images :meth:`new` selected."""
        self._images.update(new)

    def add_refs(self, keys: Iterable[bytes]) -> None:
        """One more unreleased group names each of ``keys``."""
        for k in keys:
            self._refs[k] = self._refs.get(k, 0) + 1

    def drop_refs(self, keys: Iterable[bytes]) -> list[Image]:
        """One group fewer names each of ``keys``; returns the images no group names any more (now freed)."""
        freed: list[Image] = []
        for k in keys:
            left = self._refs.get(k, 0) - 1
            if left > 0:
                self._refs[k] = left
                continue
            self._refs.pop(k, None)
            img = self._images.pop(k, None)
            if img is not None:
                freed.append(img)
        return freed

    def all_rows(self) -> list[pa.RecordBatch]:
        """Every stored image row (views into their blocks)."""
        return [img.row for img in self._images.values()]

    def check_present(self, keys: Iterable[bytes], group_id: str) -> None:
        """Refuse a group naming an image not stored here (:class:`UnknownImageError`: write the images first)."""
        missing = next((k for k in keys if k not in self._images), None)
        if missing is not None:
            msg = (f"group {group_id!r} references image {missing.hex()}, which node {self.node_name} does not hold; "
                   "write the group's images to its node before the group")
            raise UnknownImageError(msg, key=missing.hex())

    def rows(self, keys: Sequence[bytes], *, missing_ok: bool = False) -> list[Image]:
        """The images of ``keys``, in key order; raises :class:`UnknownImageError` naming a missing key."""
        out: list[Image] = []
        for k in keys:
            img = self._images.get(k)
            if img is None and missing_ok:
                continue
            if img is None:
                msg = f"image {k.hex()} is not stored on node {self.node_name}"
                raise UnknownImageError(msg, key=k.hex())
            out.append(img)
        return out


def images_table(rows: Sequence[pa.RecordBatch]) -> pa.Table:
    """Image ``rows`` as one table (an empty, normalised image table when there are none)."""
    return pa.Table.from_batches(rows, schema=rows[0].schema) if rows else normalize_images(IMAGE_SCHEMA.empty_table())
