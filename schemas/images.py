"""Image table helpers: content keys and numpy <-> Arrow rows (numpy only, no torch)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from schemas.arrow import IMAGE_SCHEMA


def image_key(array: np.ndarray) -> bytes:
    """SHA-256 over dtype, shape and the C-contiguous bytes: equal images get equal keys."""
    a = np.ascontiguousarray(array)
    h = hashlib.sha256()
    h.update(f"{a.dtype.str}|{','.join(map(str, a.shape))}|".encode())
    h.update(a.tobytes() if not a.flags.c_contiguous else a.data.cast("B"))
    return h.digest()


def images_to_table(images: Iterable[np.ndarray]) -> tuple[pa.Table, list[bytes]]:
    """Distinct images as an image-table; returns the table and each input's key (in input order)."""
    keys: list[bytes] = []
    seen: dict[bytes, np.ndarray] = {}
    for img in images:
        k = image_key(img)
        keys.append(k)
        seen.setdefault(k, np.ascontiguousarray(img))
    table = pa.table(
        {
            "image_key": list(seen),
            "shape": [list(a.shape) for a in seen.values()],
            "dtype": [a.dtype.name for a in seen.values()],
            "data": [a.tobytes() for a in seen.values()],
        },
        schema=IMAGE_SCHEMA,
    )
    return table, keys


def table_to_images(table: pa.Table) -> dict[bytes, np.ndarray]:
    """Image-table rows -> {key: array} (arrays are views over the Arrow buffers where possible)."""
    out: dict[bytes, np.ndarray] = {}
    keys = table.column("image_key").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data")
    for i, k in enumerate(keys):
        buf = data[i].as_buffer()
        out[k] = np.frombuffer(buf, dtype=np.dtype(dtypes[i])).reshape(shapes[i])
    return out
