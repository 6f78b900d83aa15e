"""The weights table: named tensors as Arrow rows, its codec and its rules (one implementation for all).

A weights table (what ``put_weights`` / ``get_weights`` move) has one row per tensor: ``name``
(string, Hugging Face parameter name, e.g. ``model.layers.0.self_attn.q_proj.weight``), ``shape``
(list<int32>), ``dtype`` (string: a torch dtype name without ``torch.``, e.g. ``"float32"``,
``"bfloat16"``) and ``data`` (large_binary: the tensor's C-contiguous bytes, little-endian).

The codec works on raw bytes, so it is the same for every dtype, bfloat16 included (numpy has no
bfloat16; nothing here needs torch): the trainer writes with :func:`from_tensors`, an engine reads
with :func:`to_tensors` (the caller passes its ``torch`` module in: this module never imports
torch); :func:`encode` and :func:`decode` are the same codec over bytes.

:func:`check` holds the rules a store applies before it accepts a table: the schema, at least one
tensor, names non-empty and unique, a known dtype, non-negative dims, and ``len(data) ==
prod(shape) * itemsize``.

Example:
    >>> import numpy as np
    >>> table = encode([WeightTensor("w", (2, 3), "float32", np.arange(6, dtype=np.float32).tobytes())])
    >>> [(w.name, w.shape, w.dtype, len(w.data)) for w in decode(table)]
    [('w', (2, 3), 'float32', 24)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

WEIGHTS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),  # HF parameter name
        pa.field("shape", pa.list_(pa.int32()), nullable=False),  # tensor shape
        pa.field("dtype", pa.string(), nullable=False),  # torch dtype name without "torch.", e.g. "bfloat16"
        pa.field("data", pa.large_binary(), nullable=False),  # C-contiguous little-endian bytes
    ]
)
"""The weights table ``put_weights`` carries."""

ITEMSIZE: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""Bytes per element of every dtype a weights table may hold."""


CHUNK_BYTES = 64 << 20
"""Default data bytes per record batch of a published weights table (a DoPut streams one batch at a time)."""


class WeightsError(ValueError):
    """A weights table that breaks a rule; ``tensor`` names the offending tensor when there is one."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


@dataclass(frozen=True, slots=True)
class WeightTensor:
    """One row of the weights table."""

    name: str
    """Hugging Face parameter name."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: str
    """Torch dtype name without ``torch.`` (a key of :data:`ITEMSIZE`)."""
    data: Any
    """The C-contiguous bytes (``bytes``, ``memoryview`` or ``pa.Buffer``), ``prod(shape) * itemsize`` long."""


def tensor_bytes(tensor: Any, torch: Any) -> memoryview:
    """The C-contiguous bytes of a CPU ``torch`` tensor (any dtype, bfloat16 included)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def to_tensor(weight: WeightTensor, torch: Any) -> Any:
    """``weight`` as a ``torch`` tensor of its dtype and shape (owning a copy of the bytes)."""
    dtype = getattr(torch, weight.dtype)
    if not len(weight.data):
        return torch.empty(weight.shape, dtype=dtype)
    return torch.frombuffer(bytearray(weight.data), dtype=dtype).reshape(weight.shape)


def from_tensors(named: Iterable[tuple[str, Any]], torch: Any, *, dtype: str | None = None,
                 chunk_bytes: int | None = CHUNK_BYTES) -> pa.Table:
    """Named ``torch`` tensors -> a checked weights table (what a trainer publishes).

    Args:
        named: ``(name, tensor)`` pairs.
        torch: the caller's ``torch`` module.
        dtype: cast floating-point tensors to this dtype first (e.g. ``"bfloat16"``: half the bytes of float32
            on the wire); ``None`` keeps each tensor's own.
        chunk_bytes: record batches of about this many data bytes (see :func:`encode`).
    """
    target = getattr(torch, dtype) if dtype is not None else None

    def cast(t: Any) -> Any:
        return t.to(target) if target is not None and t.is_floating_point() else t

    return encode((WeightTensor(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."),
                                tensor_bytes(t, torch)) for name, t in ((n, cast(x)) for n, x in named)),
                  chunk_bytes=chunk_bytes)


def to_tensors(table: pa.Table, torch: Any) -> dict[str, Any]:
    """A weights table -> ``{name: torch tensor}`` in row order (what an engine loads)."""
    return {w.name: to_tensor(w, torch) for w in decode(table)}


def encode(tensors: Iterable[WeightTensor], *, chunk_bytes: int | None = None) -> pa.Table:
    """Weight tensors -> a checked weights table (bytes copied once into the table).

    With ``chunk_bytes`` the table is made of record batches of consecutive rows holding at most that many
    data bytes each (a larger tensor is a batch of its own), so a DoPut streams it in pieces of that size
    and the receiver's reads overlap the sender's writes; ``None`` = one batch.
    """
    chunks: list[list[WeightTensor]] = [[]]
    size = 0
    for w in tensors:
        n = len(w.data) if not isinstance(w.data, memoryview) else w.data.nbytes
        if chunk_bytes is not None and chunks[-1] and size + n > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(w)
        size += n
    batches = [pa.record_batch(
        [
            pa.array([w.name for w in rows], pa.string()),
            pa.array([list(w.shape) for w in rows], pa.list_(pa.int32())),
            pa.array([w.dtype for w in rows], pa.string()),
            _binary([w.data for w in rows]),
        ],
        schema=WEIGHTS_SCHEMA,
    ) for rows in chunks]
    table = pa.Table.from_batches(batches, schema=WEIGHTS_SCHEMA)
    check(table)
    return table


def _binary(datas: list[Any]) -> pa.LargeBinaryArray:
    """``datas`` (bytes, buffers, memoryviews) as one large_binary array, their bytes copied once into one Arrow
    buffer. Not ``pa.array(datas)``: over memoryviews of torch tensors it keeps every tensor's bytes resident
    after the array and the tensors are gone (pyarrow 26), one weights version per published step."""
    offsets = np.zeros(len(datas) + 1, dtype=np.int64)
    np.cumsum([memoryview(d).nbytes for d in datas], out=offsets[1:])
    data = pa.allocate_buffer(int(offsets[-1]))
    out = np.frombuffer(data, dtype=np.uint8)
    for d, start, stop in zip(datas, offsets[:-1], offsets[1:], strict=True):
        out[start:stop] = np.frombuffer(d, dtype=np.uint8)
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(datas), [None, pa.py_buffer(offsets), data])


def decode(table: pa.Table) -> list[WeightTensor]:
    """A weights table -> its tensors, in row order (``data`` are zero-copy views of the table's buffers)."""
    table = check(table)
    names = table.column("name").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data")
    return [WeightTensor(names[i], tuple(shapes[i]), dtypes[i], data[i].as_buffer()) for i in range(len(names))]


def check(table: pa.Table) -> pa.Table:
    """The table as ``WEIGHTS_SCHEMA`` if it keeps every rule; raises :class:`WeightsError` naming what does not."""
    repeated = sorted({c for c in table.column_names if table.column_names.count(c) > 1})
    if repeated:
        msg = f"weights table names the columns {repeated} more than once"
        raise WeightsError(msg)
    missing = [c for c in WEIGHTS_SCHEMA.names if c not in table.column_names]
    extra = [c for c in table.column_names if c not in WEIGHTS_SCHEMA.names]
    if missing or extra:
        msg = f"weights table must have exactly the columns {WEIGHTS_SCHEMA.names}; missing {missing}, unknown {extra}"
        raise WeightsError(msg)
    table = table.select(WEIGHTS_SCHEMA.names)
    if table.num_rows == 0:
        msg = "weights table holds no tensor"
        raise WeightsError(msg)
    for name in WEIGHTS_SCHEMA.names:
        col = table.column(name)
        nulls = col.null_count + (pc.list_flatten(col).null_count if pa.types.is_list(col.type) else 0)
        if nulls:
            msg = f"weights table column {name!r} holds {nulls} null value(s)"
            raise WeightsError(msg)
    try:
        table = table.cast(WEIGHTS_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        msg = f"weights table columns do not have the types {WEIGHTS_SCHEMA}: {exc}"
        raise WeightsError(msg) from None
    _check_rows(table)
    return table


def _check_rows(table: pa.Table) -> None:
    seen: set[str] = set()
    sizes = pc.binary_length(table.column("data")).to_pylist()
    for i, (name, shape, dtype) in enumerate(zip(table.column("name").to_pylist(), table.column("shape").to_pylist(),
                                                 table.column("dtype").to_pylist(), strict=True)):
        if not name or name in seen:
            msg = f"weights table row {i}: tensor name {name!r} is empty or repeated"
            raise WeightsError(msg, tensor=name)
        seen.add(name)
        if dtype not in ITEMSIZE:
            msg = f"weights table: tensor {name!r} has unsupported dtype {dtype!r}; known: {sorted(ITEMSIZE)}"
            raise WeightsError(msg, tensor=name)
        if any(d < 0 for d in shape):
            msg = f"weights table: tensor {name!r} has a negative dimension in shape {shape}"
            raise WeightsError(msg, tensor=name)
        want = math.prod(shape) * ITEMSIZE[dtype]
        if sizes[i] != want:
            msg = (f"weights table: tensor {name!r} has {sizes[i]} bytes of data, but shape {shape} of {dtype} "
                   f"needs {want}")
            raise WeightsError(msg, tensor=name)
