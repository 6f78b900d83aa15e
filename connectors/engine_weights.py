"""Weight sync into a running vLLM engine: Arrow weights tables <-> named tensors.

The weights table (what ``StorePublisher.put_weights``/``StoreWriter.get_weights`` move) and its codec are
``schemas.weights``; this module only loads a decoded table into an engine.

``load_weights_into_llm`` reloads the engine's weights *in place* through vLLM's own
``reload_weights`` worker method (``collective_rpc``; through ``WeightSyncExtension`` when the engine was
started with ``worker_extension_cls=WORKER_EXTENSION``, so the table can cross to worker processes as
Arrow IPC bytes). That path takes checkpoint-format (Hugging Face)
names, re-fuses q/k/v and gate/up projections, and re-runs the post-load processing; the last step
matters on CPU, where vLLM repacks linear weights for its GEMM kernels and a plain
``model.load_weights`` would leave the packed copies stale. A model with tied embeddings (SmolLM2)
gets its output layer re-processed too (:func:`refresh_tied_output_layer`): no ``lm_head.weight``
travels, and vLLM's reload would otherwise keep the old packed copy of the embedding there. The
prefix cache is reset afterwards so no KV computed with the old weights is reused.

torch is imported inside the functions (``pip install knittrans[vllm]`` or ``[train]``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from schemas import weights

logger = logging.getLogger(__name__)


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        msg = f"weight sync needs torch: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc
    return torch


def table_to_tensors(table: pa.Table) -> list[tuple[str, Any]]:
    """A weights table (checked by :func:`schemas.weights.check`) -> ``(name, torch.Tensor)`` pairs."""
    return list(weights.to_tensors(table, _torch()).items())


WORKER_EXTENSION = "connectors.engine_weights.WeightSyncExtension"
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
        tensors = table_to_tensors(table)
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]
        refresh_tied_output_layer(self.model_runner.get_model())  # type: ignore[attr-defined]
        return len(tensors)


def refresh_tied_output_layer(model: Any) -> bool:
    """Re-run the output layer's post-load processing of a model with tied embeddings; True when it did.

    With ``tie_word_embeddings`` no ``lm_head.weight`` is loaded (it is the embedding), so vLLM's
    reload skips the output layer's processing; on CPU that processing packs the weight for the GEMM
    kernel, and the packed copy would keep the *old* embedding. The embedding itself is reloaded in
    place, so processing the output layer again packs the new values.
    """
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if not getattr(config, "tie_word_embeddings", False) or method is None:
        return False
    method.process_weights_after_loading(head)
    return True


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

    Example::

        load_weights_into_llm(llm, client.get_weights())
        # -> 15
    """
    if table.num_rows == 0:
        msg = "weights table is empty"
        raise ValueError(msg)
    t0 = time.perf_counter()
    if _has_extension(llm):
        counts = llm.collective_rpc("knit_reload_weights", args=(table_to_ipc(table),))
        n = int(counts[0])
    else:
        tensors = table_to_tensors(table)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})
        llm.apply_model(refresh_tied_output_layer)
        n = len(tensors)
    llm.reset_prefix_cache()  # no KV computed with the old weights may be reused
    llm.llm_engine.reset_encoder_cache()  # nor image encodings: the scheduler and the runner forget them together
    logger.info("reloaded %d tensors into the engine in %.3f s", n, time.perf_counter() - t0)
    return n
