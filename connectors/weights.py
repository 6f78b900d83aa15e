"""Weight sync into a running vLLM engine: Arrow weights tables <-> named tensors.

A weights table (what ``StoreClient.put_weights``/``get_weights`` move) has one row per tensor:
``name`` (string, Hugging Face parameter name, e.g. ``model.layers.0.self_attn.q_proj.weight``),
``shape`` (list<int32>), ``dtype`` (string: a torch dtype name without ``torch.``, e.g. "float32",
"bfloat16") and ``data`` (large_binary, C-contiguous bytes).

``load_weights_into_llm`` reloads the engine's weights *in place* through vLLM's own
``reload_weights`` worker method (``collective_rpc``; through ``WeightSyncExtension`` when the engine was
started with ``worker_extension_cls=WORKER_EXTENSION``, so the table can cross to worker processes as
Arrow IPC bytes). That path takes checkpoint-format (Hugging Face)
names, re-fuses q/k/v and gate/up projections, and re-runs the post-load processing; the last step
matters on CPU, where vLLM repacks linear weights for its GEMM kernels and a plain
``model.load_weights`` would leave the packed copies stale. The prefix cache is reset afterwards so
no KV computed with the old weights is reused.

torch is imported inside the functions (``pip install knittrans[vllm]`` or ``[train]``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

logger = logging.getLogger(__name__)

WEIGHTS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),  # HF parameter name
        pa.field("shape", pa.list_(pa.int32()), nullable=False),  # tensor shape
        pa.field("dtype", pa.string(), nullable=False),  # torch dtype name, e.g. "float32", "bfloat16"
        pa.field("data", pa.large_binary(), nullable=False),  # C-contiguous bytes
    ]
)
"""The weights table."""

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int64": np.int64,
                 "int32": np.int32, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        msg = f"weight sync needs torch: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc
    return torch


def weights_to_table(named_tensors: Iterable[tuple[str, Any]]) -> pa.Table:
    """Named torch tensors -> a weights table (bytes copied once, C-contiguous)."""
    torch = _torch()
    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    data: list[bytes] = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        names.append(name)
        shapes.append(list(t.shape))
        dtypes.append(dtype)
        data.append(raw.numpy().tobytes())
    return pa.table({"name": names, "shape": shapes, "dtype": dtypes, "data": data}, schema=WEIGHTS_SCHEMA)


def table_to_tensors(table: pa.Table) -> Iterator[tuple[str, Any]]:
    """A weights table -> ``(name, torch.Tensor)`` pairs (each tensor owns a copy of its bytes).

    Raises:
        ValueError: a missing column, an unknown dtype, or bytes that do not match the shape.
    """
    torch = _torch()
    missing = [c for c in WEIGHTS_SCHEMA.names if c not in table.column_names]
    if missing:
        msg = f"weights table lacks columns {missing} (has {table.column_names})"
        raise ValueError(msg)
    names = table.column("name").to_pylist()
    shapes = table.column("shape").to_pylist()
    dtypes = table.column("dtype").to_pylist()
    data = table.column("data")
    for i, name in enumerate(names):
        dtype, shape = str(dtypes[i]), tuple(int(s) for s in shapes[i])
        buf = data[i].as_buffer()
        if dtype == "bfloat16":
            arr = np.frombuffer(buf, dtype=np.int16)
        elif dtype in _NUMPY_DTYPES:
            arr = np.frombuffer(buf, dtype=_NUMPY_DTYPES[dtype])
        else:
            msg = f"weights table: tensor {name!r} has unsupported dtype {dtype!r}"
            raise ValueError(msg)
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            msg = f"weights table: tensor {name!r} has {arr.size} values for shape {list(shape)}"
            raise ValueError(msg)
        t = torch.from_numpy(arr.copy()).reshape(shape)
        if dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        yield name, t


WORKER_EXTENSION = "connectors.weights.WeightSyncExtension"
"""Pass as ``vllm.LLM(worker_extension_cls=WORKER_EXTENSION)`` so weights can travel to engine workers
in other processes (``VllmEngine`` does)."""


def table_to_ipc(table: pa.Table) -> bytes:
    """A weights table as Arrow IPC stream bytes (what crosses vLLM's RPC to the workers)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): reload weights from Arrow IPC bytes.

    Bytes and a method name serialize with vLLM's own RPC, so this works whether the engine core runs in
    this process or in spawned worker processes (where a list of tensors or a closure does not travel
    without ``VLLM_ALLOW_INSECURE_SERIALIZATION``).
    """

    def knit_reload_weights(self, ipc: bytes) -> int:
        """Reload the weights in ``ipc`` (a weights table) in place; returns the number of tensors."""
        table = pa.ipc.open_stream(pa.py_buffer(ipc)).read_all()
        tensors = list(table_to_tensors(table))
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)


def _has_extension(llm: Any) -> bool:
    try:
        return str(llm.llm_engine.vllm_config.parallel_config.worker_extension_cls) == WORKER_EXTENSION
    except AttributeError:
        return False


def load_weights_into_llm(llm: Any, table: pa.Table) -> int:
    """Load a weights table into a running ``vllm.LLM`` in place; returns the number of tensors.

    Args:
        llm: a ``vllm.LLM``. Started with ``worker_extension_cls=WORKER_EXTENSION``, the table travels as
            Arrow IPC bytes and any executor works; otherwise the engine core must run in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the tensors are handed over directly.
        table: weights with Hugging Face names; a subset of the parameters is allowed.

    Example:
        >>> load_weights_into_llm(llm, client.get_weights())  # doctest: +SKIP
        15
    """
    if table.num_rows == 0:
        msg = "weights table is empty"
        raise ValueError(msg)
    t0 = time.perf_counter()
    if _has_extension(llm):
        counts = llm.collective_rpc("knit_reload_weights", args=(table_to_ipc(table),))
        n = int(counts[0])
    else:
        tensors = list(table_to_tensors(table))
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})
        n = len(tensors)
    llm.reset_prefix_cache()  # no KV computed with the old weights may be reused
    logger.info("reloaded %d tensors into the engine in %.3f s", n, time.perf_counter() - t0)
    return n
