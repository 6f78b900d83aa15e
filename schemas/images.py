"""Image table helpers: content keys and numpy <-> Arrow rows (numpy only, no torch).

An image's key is SHA-256 over ``f"{typestr}|{dims}|"`` (UTF-8) followed by its C-contiguous bytes,
where ``typestr`` is the numpy type string of its dtype (:data:`IMAGE_DTYPES`: ``"|u1"`` for uint8,
``"<f2"`` for float16, ...) and ``dims`` its shape joined by commas (``"3,448,448"``). A store
recomputes every key it is sent and refuses a row whose key does not match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.arrow import IMAGE_SCHEMA

IMAGE_DTYPES: dict[str, str] = {
    "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
}
"""The dtypes an image may have (``dtype`` column) and the type string its key hashes."""


def key_of(dtype: str, shape: Sequence[int], data: Any) -> bytes:
    """The content key of an image given as its dtype name, shape and C-contiguous bytes."""
    h = hashlib.sha256()
    h.update(f"{IMAGE_DTYPES[dtype]}|{','.join(map(str, shape))}|".encode())
    h.update(data)
    return h.digest()


def image_key(array: np.ndarray) -> bytes:
    """The content key of ``array`` (its dtype must be one of :data:`IMAGE_DTYPES`): equal images, equal keys."""
    a = np.ascontiguousarray(array)
    if a.dtype.name not in IMAGE_DTYPES:
        msg = f"image dtype {a.dtype.name!r} is not one of {sorted(IMAGE_DTYPES)}"
        raise ValueError(msg)
    return key_of(a.dtype.name, a.shape, a.data.cast("B"))


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


def group_images(images: Sequence[np.ndarray], rows: int, *, per_row: bool = False) -> tuple[pa.Table,
                                                                                             list[list[bytes]]]:
    """The image table a prompt group writes and each of its ``rows``' image keys.

    Stored once (the default), every row references the images. ``per_row`` (``knit run --no-image-dedup``, the
    baseline) gives row ``i`` a copy of its own: the same pixels under ``i`` leading unit axes, so its content key
    differs and a store keeps it apart (row 0's copies are the images themselves); a reader drops the unit axes.
    """
    if not per_row:
        table, keys = images_to_table(images)
        return table, [keys] * rows
    n = len(images)
    table, flat = images_to_table([img.reshape((1,) * i + img.shape) for i in range(rows) for img in images])
    return table, [flat[i:i + n] for i in range(0, rows * n, n)]


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
