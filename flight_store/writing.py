"""The writing role: what a rollout engine does with the stores (see :mod:`flight_store.client`).

:class:`StoreWriter` writes whole prompt groups (one or many per DoPut) to the node routing gives
each, the images they reference to the same nodes, registers groups in flight and resolves those
that leave it without rows, and reads the weights the engine serves.

Re-routing: a routed call (a node not named by the caller) that finds its node down in the cluster's newest
view (the launcher marked it lost) or is refused as the wrong node (the view changed) asks for the view again
and goes to the group's owner in it, at most :data:`MAX_REROUTES` times.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa

from flight_store.client import StoreNodes
from flight_store.errors import KnitError, NodeUnavailableError, UnknownWeightsError, WrongNodeError, from_error_info
from schemas.replies import DispatchReply, PutGroupReply, PutGroupsReply, PutImagesReply, Reply, ResolveReply
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

MAX_REROUTES = 4
"""Times one routed call goes to another owner after its node was found down or refused the group."""
T = TypeVar("T")
R = TypeVar("R", bound=Reply)
log = logging.getLogger(__name__)
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
        desc = PutGroup.model_construct(group_id=group_id, rows=batch.num_rows).to_bytes()  # the node validates it
        if node is not None:
            self._calls.put(node, desc, batch, PutGroupReply)
            return node
        for attempt in range(MAX_REROUTES + 1):
            target = self.node_for(group_id)
            try:
                self._calls.put(target, desc, batch, PutGroupReply, routed=True)
                return target
            except (NodeUnavailableError, WrongNodeError) as exc:
                if attempt == MAX_REROUTES or not self._rerouted(target, exc):
                    raise
        raise AssertionError  # pragma: no cover - the loop returns or raises

    def _rerouted(self, node: str, exc: KnitError) -> bool:
        """Whether a routed call that failed on ``node`` with ``exc`` may go to another owner: the node is down in
        a view asked now, or it refused the group as another node's (the view changed: ask it again)."""
        if isinstance(exc, WrongNodeError):
            self.cluster_view(refresh=True)
            return True
        if self._found_down(node):
            log.warning("store node %s is down (cluster view v%d): routing its groups to the nodes alive", node,
                        self.cluster_view().version)
            return True
        return False

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
        result = PutGroupsResult()
        todo = list(range(len(ids)))
        for attempt in range(MAX_REROUTES + 1):
            todo = self._put_some(ids, tables, todo, result, last=attempt == MAX_REROUTES)
            if not todo:
                break
        return result

    def _put_some(self, ids: list[str], tables: list[pa.Table], todo: list[int], result: PutGroupsResult, *,
                  last: bool) -> list[int]:
        """One round of :meth:`put_groups` over the batches ``todo``: the answers into ``result``; returns the
        batches to route again (their node was found down, or refused them as another node's)."""
        calls = self._bulk_calls([ids[i] for i in todo], [tables[i] for i in todo])
        calls = [(node, [todo[j] for j in idx]) for node, idx in calls]

        def one(k: int) -> PutGroupsReply:
            node, idx = calls[k]
            desc = PutGroups(groups=[GroupRows(group_id=ids[i], rows=tables[i].num_rows) for i in idx]).to_bytes()
            return self._calls.put(node, desc, pa.concat_tables([tables[i] for i in idx]), PutGroupsReply,
                                   routed=True)

        answers, failed = self._calls.fan_out(range(len(calls)), one, partial=True, what="put_groups")
        again: list[int] = []
        for k in failed:
            node = calls[k][0]
            if last or not self._found_down(node):
                msg = f"store node {node} is unavailable: cannot write {len(calls[k][1])} group(s)"
                raise NodeUnavailableError(msg, node=node)
            again += calls[k][1]
        index = {ids[i]: i for i in todo}
        for k, answer in answers.items():
            result.stored.update(dict.fromkeys(answer.stored, calls[k][0]))
            for g, info in answer.refused.items():
                error = from_error_info(info.model_dump())
                if isinstance(error, WrongNodeError) and not last:
                    again.append(index[g])
                else:
                    result.refused[g] = error
        if again:
            self.cluster_view(refresh=True)
        return again

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
        def call(node: str, gs: list[DispatchedGroup]) -> DispatchReply:
            body = DispatchBody(groups=gs).to_bytes()
            return self._calls.action(node, "dispatch", DispatchReply, body, routed=True)

        answers = self._routed_actions(list(groups), lambda g: g.group_id, call, "dispatch")
        return [g for a in answers for g in a.stored]

    def resolve(self, group_ids: Iterable[str], reason: ResolveReason) -> int:
        """Take groups out of flight without rows (``aborted``, ``filtered``, ``cancelled``); returns how many were."""
        def call(node: str, ids: list[str]) -> ResolveReply:
            body = ResolveBody(group_ids=ids, reason=reason).to_bytes()
            return self._calls.action(node, "resolve", ResolveReply, body, routed=True)

        return sum(a.resolved for a in self._routed_actions(list(dict.fromkeys(group_ids)), str, call, "resolve"))

    def _routed_actions(self, items: list[T], key: Callable[[T], str], call: Callable[[str, list[T]], R],
                        what: str) -> list[R]:
        """``call(node, its items)`` for the owner of each item's group (nodes concurrently); the items of a node
        found down, or refused as another node's, go to their owners in a view asked again."""
        out: list[R] = []
        for attempt in range(MAX_REROUTES + 1):
            by_node: dict[str, list[T]] = {}
            for item in items:
                by_node.setdefault(self.node_for(key(item)), []).append(item)
            answers, failed = self._calls.fan_out(by_node, functools.partial(_call_with, call, by_node), partial=True,
                                                  what=what)
            refused = [n for n, a in answers.items() if a is None]  # the view changed: ask it again
            out += [a for a in answers.values() if a is not None]
            for node in failed:
                if attempt == MAX_REROUTES or not self._found_down(node):
                    msg = f"store node {node} is unavailable: {what} of {len(by_node[node])} group(s) failed"
                    raise NodeUnavailableError(msg, node=node)
            if refused:
                if attempt == MAX_REROUTES:
                    msg = f"{what}: store nodes {refused} refused groups routing gave them after {attempt} re-route(s)"
                    raise NodeUnavailableError(msg, node=refused[0])
                self.cluster_view(refresh=True)
            items = [item for node in [*failed, *refused] for item in by_node[node]]
            if not items:
                break
        return out

    def get_weights(self, version: int | None = None, *, node: str | None = None) -> pa.Table:
        """The latest weights (exactly ``version`` when given) from ``node`` (default: the first node not down that
        holds them)."""
        ticket = WeightsTicket(version=version).to_bytes()
        if node is not None:
            return self._calls.get(node, ticket)
        live = self._live()
        for n in live[:-1]:  # a node that was down when a version was published lacks it: the next one has it
            try:
                return self._calls.get(n, ticket)
            except UnknownWeightsError:
                log.info("store node %s lacks weights v%s; asking the next node", n, version)
        return self._calls.get(live[-1], ticket)


def _call_with(call: Callable[[str, list[T]], R], by_node: dict[str, list[T]], node: str) -> R | None:
    """``call(node, by_node[node])`` (one node's share of a routed action); ``None`` when the node refused a group
    as another node's (the cluster's view changed since the client asked it)."""
    try:
        return call(node, by_node[node])
    except WrongNodeError:
        return None
