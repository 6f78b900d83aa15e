"""The publishing role: what a trainer tells the rollout through the stores (see :mod:`flight_store.client`).

:class:`StorePublisher` writes each new version's weights table (``schemas.weights``) to the nodes and then
records that version as the newest published one; the rollout reads both back
(:meth:`~flight_store.writing.StoreWriter.get_weights`, ``get_version``). The trainer holds it beside its
:class:`~flight_store.reading.StoreReader`, over the same connections (:meth:`StoreNodes.sharing`).
"""

from __future__ import annotations

import pyarrow as pa

from flight_store.client import StoreNodes
from schemas.replies import PutWeightsReply, VersionReply
from schemas.wire import PublishVersionBody, PutWeights


class StorePublisher(StoreNodes):
    """Publishes the trainer's weights and policy versions to every node (the trainer's writes).

    Example:
        >>> from flight_store.server import StoreServer
        >>> from flight_store.writing import StoreWriter
        >>> from schemas.weights import WeightTensor, encode
        >>> table = encode([WeightTensor(name="w", shape=(2,), dtype="float32", data=bytes(8))])
        >>> with StoreServer() as server, StorePublisher(server.location) as publisher, \\
        ...         StoreWriter.sharing(publisher) as rollout:
        ...     publisher.put_weights(table, 1)
        ...     publisher.publish_version(1)
        ...     (rollout.get_version(), rollout.get_weights(1).num_rows)
        (1, 1)
    """

    def put_weights(self, table: pa.Table, version: int, *, node: str | None = None) -> None:
        """DoPut a weights table (``schemas.weights``) as ``version`` to ``node`` (default: every node)."""
        desc = PutWeights(version=version).to_bytes()
        self._fan_out([node] if node is not None else self._live(),
                      lambda n: self._calls.put(n, desc, table, PutWeightsReply, routed=node is None))

    def publish_version(self, version: int) -> None:
        """Record the newest policy version on every node."""
        body = PublishVersionBody(version=version).to_bytes()
        self._fan_out(self._live(), lambda n: self._calls.action(n, "publish_version", VersionReply, body, routed=True))
