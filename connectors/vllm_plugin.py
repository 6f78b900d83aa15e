"""The ``vllm.general_plugins`` entry point of this distribution: registers knittrans' weight-transfer engine.

vLLM calls :func:`register` in every process it starts (and may call it several times); the engine itself
(:mod:`connectors.vllm_transfer`) is imported only when a worker builds it, for
``vllm serve --weight-transfer-config '{"backend": "knittrans"}'``.
"""

from __future__ import annotations

BACKEND = "knittrans"
"""The name the engine registers under (``--weight-transfer-config '{"backend": "knittrans"}'``)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register :data:`BACKEND` with vLLM's weight-transfer factory (once
    per process; vLLM may load plugins several times)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without pluggable weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "connectors.vllm_transfer", "FlightWeightTransferEngine")
