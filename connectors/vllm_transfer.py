"""knittrans as a vLLM weight-transfer engine: a served vLLM pulls a published version's weights from the store nodes.

vLLM serves an RL control plane (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``. What moves the bytes is a pluggable
weight-transfer engine (``vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory``), chosen with
``vllm serve --weight-transfer-config '{"backend": "knittrans"}'``. This module is that engine, and
:func:`connectors.vllm_plugin.register` (a ``vllm.general_plugins`` entry point of this distribution, so every
``vllm serve`` in the environment has it) registers it.

The handshake, as :class:`connectors.served.ServedEngine` drives it:

* ``/init_weight_transfer_engine`` with ``{"init_info": {"stores": [...], "token": ...}}``: the worker opens a store
  client (:class:`FlightInit`);
* per version: ``/start_weight_update``, ``/update_weights`` with ``{"update_info": {"version": v}}``
  (:class:`FlightUpdate`), ``/finish_weight_update`` with the version. The worker reads version ``v``'s weights
  table from the stores over Flight first; only then does it reload the model in place with vLLM's layerwise
  reload (Hugging Face names; finalising it runs vLLM's post-load processing, which on CPU repacks the GEMM
  weights) and re-process the tied output layer, which a tied-embedding model's reload would skip.

The weights never pass through the rollout process or the HTTP body: only the version number does. A read that
fails (the version not published, the stores unreachable) raises before the model is touched: vLLM answers the
call with an error and the engine serves on with the weights it had.

vLLM imports this module inside its workers only, when it builds the engine: the module imports vLLM at the top.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

logger = logging.getLogger(__name__)


@dataclass
class FlightInit:
    """``init_info`` of ``/init_weight_transfer_engine``: where the weights are published."""

    stores: list[str]
    """Store node locations (``grpc://host:port``); any node that holds the version serves it."""
    token: str | None = None
    """The cluster's bearer token, when the stores require one."""
    tls_root_certs: str | None = None
    """PEM root certificates of ``grpc+tls://`` stores."""
    timeout_s: float = 60.0
    """Per-call deadline of the weights read."""


@dataclass
class FlightUpdate:
    """``update_info`` of ``/update_weights``: which published version to load."""

    version: int


class FlightWeightTransferEngine(WeightTransferEngine):
    """The worker side: reads a version's weights table from the store nodes and loads it into the model."""

    init_info_cls = FlightInit
    update_info_cls = FlightUpdate
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._client: Any = None
        self.loaded_version: int | None = None

    def init_transfer_engine(self, init_info: FlightInit) -> None:
        from flight_store.writing import StoreWriter

        if not init_info.stores:
            msg = "init_info.stores is empty: the engine needs at least one store node to read weights from"
            raise ValueError(msg)
        if self._client is not None:
            self._client.close()
        certs = init_info.tls_root_certs.encode() if init_info.tls_root_certs else None
        self._client = StoreWriter(init_info.stores, token=init_info.token, tls_root_certs=certs,
                                   timeout=init_info.timeout_s)

    def start_weight_update(self) -> None:
        """Nothing yet: the reload starts once the version's table is read (:meth:`receive_weights`), so a read that
        fails leaves the model as it was."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises the accelerator afterwards; the loads here are synchronous, and on CPU there
        # is no accelerator to synchronise
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FlightUpdate) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from connectors.engine_weights import refresh_tied_output_layer, table_to_tensors

        if self._client is None:
            msg = "update_weights before init_weight_transfer_engine: the engine does not know the store nodes"
            raise RuntimeError(msg)
        t0 = time.perf_counter()
        table = self._client.get_weights(int(update_info.version))
        tensors = table_to_tensors(table)
        initialize_layerwise_reload(self.model)
        model: Any = self.model  # a vLLM model: it has load_weights
        model.load_weights(tensors)
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_output_layer(self.model)
        self.loaded_version = int(update_info.version)
        logger.info("weights of version %d: %d tensors from the stores in %.3f s", update_info.version,
                    len(tensors), time.perf_counter() - t0)

    def finish_weight_update(self) -> None:
        """Nothing left: :meth:`receive_weights` finalised the reload (vLLM records the version it is given)."""

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
