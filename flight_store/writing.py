"""The writing role: what a rollout engine does with the stores (see :mod:`flight_store.client`).

:class:`StoreWriter` writes whole prompt groups (one or many per DoPut) to the node routing gives
each, the images they reference to the same nodes, registers groups in flight and resolves those
that leave it without rows, and reads the weights the engine serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from flight_store.client import StoreNodes
from flight_store.errors import KnitError, from_error_info
from schemas.replies import DispatchReply, PutGroupReply, PutGroupsReply, PutImagesReply, ResolveReply
from schemas.wire import (
    LIMITS,
    DispatchBody,
    DispatchedGroup,
    GroupRows,
    PutGroup,
    PutGroups,
    PutImages,
    ResolveBody,
    ResolveReason,
    WeightsTicket,
)

PUT_GROUPS_DESCRIPTOR_BYTES = 60_000
"""A bulk write's descriptor stays under this (the wire allows 64 KiB); more groups go in more DoPuts."""


@dataclass(slots=True)
class PutGroupsResult:
    """What :meth:`StoreWriter.put_groups` did: each group stored (with its node) or refused (with why)."""

    stored: dict[str, str] = field(default_factory=dict)
    """group_id -> the node that holds it (a rewrite of the same content counts as stored)."""
    refused: dict[str, KnitError] = field(default_factory=dict)
    """group_id -> the typed error the node refused it with (``retryable`` says whether to try again)."""


class StoreWriter(StoreNodes):
    """Writes prompt groups and images to the nodes that own them (the rollout's client).

    Example:
        >>> from flight_store.server import StoreServer
        >>> from schemas.records import TrajectoryRecord, records_to_batch
        >>> with StoreServer() as server, StoreWriter([server.location]) as writer:
        ...     batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
        ...         prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -2.0]) for i in range(4)])
        ...     writer.put_group(batch) == server.location
        True
    """

    def put_group(
        self, batch: pa.RecordBatch | pa.Table, *, group_id: str | None = None, node: str | None = None
    ) -> str:
        """DoPut one whole prompt group (all its rows, atomically); returns the node written.

        The node is the group's owner (:meth:`node_for`) unless ``node`` says otherwise. A rewrite of
        the same content is a no-op; retryable errors are retried (see :mod:`flight_store.client`).

        Raises:
            WrongNodeError: ``node`` (or a stale cluster view) is not the group's node.
            ConflictError, SchemaMismatchError, UnknownImageError, CapacityExceededError: as the node refuses.
        """
        if group_id is None:
            if "group_id" not in batch.schema.names or batch.num_rows == 0:
                msg = "put_group needs group_id= or a non-empty batch with a 'group_id' column"
                raise ValueError(msg)
            group_id = str(batch.column("group_id")[0].as_py())
        target = node if node is not None else self.node_for(group_id)
        desc = PutGroup.model_construct(group_id=group_id, rows=batch.num_rows).to_bytes()  # the node validates it
        self._calls.put(target, desc, batch, PutGroupReply)
        return target

    def put_groups(self, batches: Sequence[pa.RecordBatch | pa.Table]) -> PutGroupsResult:
        """DoPut many whole groups (one batch or table each, with its ``group_id`` column): each node's
        groups in one stream (nodes concurrently), each group validated and committed on its own.

        A group the node refuses (bad rows, unknown images, a conflicting rewrite, a full budget, ...)
        is named in :attr:`PutGroupsResult.refused` with its typed error and the others are stored;
        a whole DoPut that fails (node unavailable after its retries) raises. Groups whose schemas
        differ (writer metadata included) go in DoPuts of their own.

        Raises:
            ValueError: a batch is empty, lacks ``group_id``, or two batches carry the same group.
        """
        tables = [pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b for b in batches]
        ids = []
        for t in tables:
            if "group_id" not in t.column_names or t.num_rows == 0:
                msg = "put_groups needs non-empty batches with a 'group_id' column"
                raise ValueError(msg)
            ids.append(str(t.column("group_id")[0].as_py()))
        if len(set(ids)) != len(ids):
            msg = "put_groups got two batches of the same group; a group is written whole, once"
            raise ValueError(msg)
        calls = self._bulk_calls(ids, tables)

        def one(k: int) -> PutGroupsReply:
            node, idx = calls[k]
            desc = PutGroups(groups=[GroupRows(group_id=ids[i], rows=tables[i].num_rows) for i in idx]).to_bytes()
            return self._calls.put(node, desc, pa.concat_tables([tables[i] for i in idx]), PutGroupsReply)

        result = PutGroupsResult()
        for k, answer in self._calls.fan_out(range(len(calls)), one)[0].items():
            result.stored.update(dict.fromkeys(answer.stored, calls[k][0]))
            result.refused.update({g: from_error_info(info.model_dump()) for g, info in answer.refused.items()})
        return result

    def _bulk_calls(self, ids: list[str], tables: list[pa.Table]) -> list[tuple[str, list[int]]]:
        """The DoPuts of a bulk write: (node, indexes of its batches) each, one schema per stream (metadata
        included), each descriptor under :data:`PUT_GROUPS_DESCRIPTOR_BYTES` and ``groups_per_put``."""
        calls: list[tuple[str, list[int]]] = []
        streams_of: dict[tuple[str, pa.Schema], list[int]] = {}
        for i, gid in enumerate(ids):
            streams_of.setdefault((self.node_for(gid), tables[i].schema), []).append(i)
        for (node, _), idx in streams_of.items():
            size = PUT_GROUPS_DESCRIPTOR_BYTES  # start a new DoPut
            for i in idx:
                entry = len(ids[i].encode()) + 40  # {"group_id": ..., "rows": ...}, escaped generously
                if size + entry > PUT_GROUPS_DESCRIPTOR_BYTES or len(calls[-1][1]) >= LIMITS["groups_per_put"]:
                    calls.append((node, []))
                    size = 200
                calls[-1][1].append(i)
                size += entry
        return calls

    def put_images(self, table: pa.Table | pa.RecordBatch, *, group_ids: Iterable[str] = (),
                   node: str | None = None) -> int:
        """DoPut image rows to the nodes of ``group_ids`` (the groups that will reference them), or to ``node``.

        Returns how many (node, image) entries were new (an image a node holds is not stored twice).
        """
        t = pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch) else table
        nodes = {node} if node is not None else {self.node_for(g) for g in group_ids}
        if not nodes:
            msg = "put_images needs group_ids= (the groups that reference the images) or node="
            raise ValueError(msg)
        desc = PutImages().to_bytes()
        answers = self._fan_out(sorted(nodes), lambda n: self._calls.put(n, desc, t, PutImagesReply))
        return sum(a.stored for a in answers.values())

    def dispatch(self, groups: Sequence[DispatchedGroup]) -> list[str]:
        """Register groups in flight with the nodes they belong to (routing); returns the ids that were
        written already (their registration changes nothing)."""
        by_node: dict[str, list[DispatchedGroup]] = {}
        for g in groups:
            by_node.setdefault(self.node_for(g.group_id), []).append(g)
        bodies = {n: DispatchBody(groups=gs).to_bytes() for n, gs in by_node.items()}
        answers = self._fan_out(bodies, lambda n: self._calls.action(n, "dispatch", DispatchReply, bodies[n]),
                                what="dispatch")
        return [g for a in answers.values() for g in a.stored]

    def resolve(self, group_ids: Iterable[str], reason: ResolveReason) -> int:
        """Take groups out of flight without rows (``aborted``, ``filtered``, ``cancelled``); returns how many were."""
        by_node: dict[str, list[str]] = {}
        for g in dict.fromkeys(group_ids):
            by_node.setdefault(self.node_for(g), []).append(g)
        bodies = {n: ResolveBody(group_ids=ids, reason=reason).to_bytes() for n, ids in by_node.items()}
        answers = self._fan_out(bodies, lambda n: self._calls.action(n, "resolve", ResolveReply, bodies[n]),
                                what="resolve")
        return sum(a.resolved for a in answers.values())

    def get_weights(self, version: int | None = None, *, node: str | None = None) -> pa.Table:
        """The latest weights (exactly ``version`` when given) from ``node`` (default: the first node)."""
        return self._calls.get(node or self._nodes[0], WeightsTicket(version=version).to_bytes())

