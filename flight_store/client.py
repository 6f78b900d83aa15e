"""The client of one or many store nodes: write groups, scan metadata, fetch slices, release.

Node name = the location string (``"grpc://host:port"``). Every call that concerns several
nodes fans out concurrently on a thread pool. A group is written to the node routing gives it
(``schemas.routing`` over the ids the nodes report, :mod:`flight_store.cluster`), its images to the
same node. Errors come back as the project's typed errors (:mod:`flight_store.errors`); a node that
cannot be reached raises :class:`NodeUnavailableError` naming it.

Retries follow the error table: a call that fails with a retryable error (``error.retryable``: the
node is unavailable, its budget is full) is retried ``retries`` times with exponential backoff (every
call is idempotent), any other error is raised at once. After the last attempt a fetch raises
:class:`NodeUnavailableError` naming the node and the groups it held.

Node failure: ``scan_metadata(partial=True)`` / ``scan_new(partial=True)`` return the rows of the
nodes that answered and record the others in :attr:`StoreClient.last_failed_nodes` (the default
stays strict: the first unreachable node raises).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import polars as pl
import pyarrow as pa
import pyarrow.flight as flight

from flight_store import streams
from flight_store.calls import NodeCalls
from flight_store.cluster import ClusterView, view_from
from flight_store.config import ClientConfig
from flight_store.errors import KnitError, NodeUnavailableError, UnknownImageError, from_error_info
from flight_store.secrets import read_token_file
from schemas.arrow import IMAGE_SCHEMA, METADATA_SCHEMA
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice
from schemas.wire import (
    LIMITS,
    DemandBody,
    DispatchBody,
    DispatchedGroup,
    EmptyBody,
    GroupRows,
    ImagesTicket,
    MetadataTicket,
    PublishVersionBody,
    PutGroups,
    PutImages,
    PutWeights,
    ReleaseBody,
    ResolveBody,
    ResolveReason,
    WeightsTicket,
    encode_put_group,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

PUT_GROUPS_DESCRIPTOR_BYTES = 60_000
"""A bulk write's descriptor stays under this (the wire allows 64 KiB); more groups go in more DoPuts."""


@dataclass(slots=True)
class PutGroupsResult:
    """What :meth:`StoreClient.put_groups` did: each group stored (with its node) or refused (with why)."""

    stored: dict[str, str] = field(default_factory=dict)
    """group_id -> the node that holds it (a rewrite of the same content counts as stored)."""
    refused: dict[str, KnitError] = field(default_factory=dict)
    """group_id -> the typed error the node refused it with (``retryable`` says whether to try again)."""


INFLIGHT_COLUMNS = {"group_id": pl.String, "data_source": pl.String, "prompt_id": pl.String,
                    "dispatch_version": pl.Int64, "state": pl.String, "dispatched_at": pl.Float64, "node": pl.String}
"""Columns of :attr:`Inflight.groups`."""


@dataclass(slots=True)
class Inflight:
    """The groups in flight on every node (``StoreClient.inflight``)."""

    groups: pl.DataFrame
    """One row per group in flight (:data:`INFLIGHT_COLUMNS`)."""
    registered_total: int
    """Registrations the nodes ever received (0: no rollout registers its groups)."""
    resolved: dict[str, int]
    """Groups taken out of flight, per reason (``written`` when its rows arrived), summed over nodes."""


class StoreClient:
    """Talks to one or many store nodes.

    Args:
        locations: one location or a list (``"grpc://127.0.0.1:8815"``); each is also the node's name.
        token: bearer token sent as ``authorization: Bearer <token>``; ``None`` reads ``KNIT_TOKEN``.
        tls_root_certs: PEM root certificates for ``grpc+tls://`` locations.
        timeout: seconds per call (``None`` = no limit).
        retries: extra attempts of a call that failed with a retryable error (0 = fail at once).
        backoff: seconds before the first retry; doubled for each further one (capped at 5 s).

    Example:
        >>> from flight_store.server import StoreServer
        >>> from schemas.records import TrajectoryRecord, records_to_batch
        >>> from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice
        >>> with StoreServer() as server, StoreClient([server.location]) as client:
        ...     batch = records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i, policy_version=0,
        ...         prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -2.0]) for i in range(4)])
        ...     node = client.put_group(batch)
        ...     frame = client.scan_new(columns=["group_id", "sample_idx", "reward"])
        ...     table = client.fetch([PlannedSlice(node=node, group_id="g0", start=0, stop=2)])
        ...     (frame.height, table.num_rows)
        (4, 2)
    """

    def __init__(
        self,
        locations: str | Sequence[str],
        *,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
        timeout: float | None = 30.0,
        retries: int = 3,
        backoff: float = 0.1,
    ) -> None:
        locs = [locations] if isinstance(locations, str) else list(locations)
        self._calls = NodeCalls(locs, token=token, tls_root_certs=tls_root_certs, timeout=timeout, retries=retries,
                                backoff=backoff)
        self._nodes = self._calls.nodes
        self.last_failed_nodes: list[str] = []
        """Nodes that did not answer the latest ``scan_metadata(partial=True)`` / ``scan_new(partial=True)``."""
        self._cursor: dict[str, int] = dict.fromkeys(locs, 0)
        self._cursor_lock = threading.Lock()
        self._cluster: ClusterView | None = None
        self._cluster_lock = threading.Lock()

    @property
    def retries(self) -> int:
        """Extra attempts of a call that failed with a retryable error."""
        return self._calls.retries

    @classmethod
    def from_config(cls, locations: str | Sequence[str], config: ClientConfig) -> StoreClient:
        """A client of ``locations`` as ``config`` says (the token and CA are read from its files)."""
        token = read_token_file(config.token_file) if config.token_file else None
        certs = Path(config.tls_root_certs_file).read_bytes() if config.tls_root_certs_file else None
        return cls(locations, token=token, tls_root_certs=certs, timeout=config.timeout_s, retries=config.retries,
                   backoff=config.backoff_s)

    @classmethod
    def from_cluster(cls, location: str, **kwargs: Any) -> StoreClient:
        """A client of every node of the cluster ``location`` belongs to (its ``cluster`` action lists them)."""
        with cls(location, **kwargs) as probe:
            members = probe.cluster()[location].get("nodes") or [{"location": location}]
        return cls([str(m["location"]) for m in members], **kwargs)

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        """The node names (= locations), in the order given."""
        return list(self._nodes)

    def node_for(self, group_id: str) -> str:
        """The node ``group_id`` belongs to: routing (``schemas.routing``) over the ids the nodes report."""
        return self.cluster_view().owner(group_id)

    def cluster_view(self, *, refresh: bool = False) -> ClusterView:
        """The nodes' ids (asked once with the ``cluster`` action, then cached; ``refresh`` asks again)."""
        with self._cluster_lock:
            if self._cluster is None or refresh:
                self._cluster = view_from(self.cluster())
            return self._cluster

    def cluster(self) -> dict[str, dict[str, Any]]:
        """The ``cluster`` answer of every node (its id, and its configured membership)."""
        return self._fan_out(self._nodes, lambda n: self._calls.action(n, "cluster"))

    def _fan_out(
        self, nodes: Iterable[str], fn: Callable[[str], T], *, partial: bool = False, what: str = "call"
    ) -> dict[str, T]:
        """:meth:`NodeCalls.fan_out`; a partial call lists the nodes it left out in :attr:`last_failed_nodes`."""
        out, failed = self._calls.fan_out(nodes, fn, partial=partial, what=what)
        if partial:
            self.last_failed_nodes = failed
        return out

    # ---- writes --------------------------------------------------------------------------------

    def put_group(
        self, batch: pa.RecordBatch | pa.Table, *, group_id: str | None = None, node: str | None = None
    ) -> str:
        """DoPut one whole prompt group (all its rows, atomically); returns the node written.

        The node is the group's owner (:meth:`node_for`) unless ``node`` says otherwise. A rewrite of
        the same content is a no-op; retryable errors are retried (see the module's docstring).

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
        self._calls.put(target, encode_put_group(group_id, batch.num_rows), batch)
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
        calls: list[tuple[str, list[int]]] = []  # (node, batch indexes) per DoPut
        streams_of: dict[tuple[str, pa.Schema], list[int]] = {}  # a stream has one schema (metadata included)
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

        def one(k: int) -> dict[str, Any]:
            node, idx = calls[k]
            desc = PutGroups(groups=[GroupRows(group_id=ids[i], rows=tables[i].num_rows) for i in idx]).to_bytes()
            return self._calls.put(node, desc, pa.concat_tables([tables[i] for i in idx]))

        result = PutGroupsResult()
        for k, answer in self._calls.fan_out(range(len(calls)), one)[0].items():
            node = calls[k][0]
            result.stored.update(dict.fromkeys(answer.get("stored", {}), node))
            result.refused.update({g: from_error_info(info) for g, info in answer.get("refused", {}).items()})
        return result

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
        answers = self._fan_out(sorted(nodes), lambda n: self._calls.put(n, desc, t))
        return sum(int(a.get("stored", 0)) for a in answers.values())

    def put_weights(self, table: pa.Table, version: int, *, node: str | None = None) -> None:
        """DoPut a weights table (``schemas.weights``) as ``version`` to ``node`` (default: every node)."""
        desc = PutWeights(version=version).to_bytes()
        self._fan_out([node] if node is not None else self._nodes,
                      lambda n: self._calls.put(n, desc, table))

    def get_weights(self, version: int | None = None, *, node: str | None = None) -> pa.Table:
        """The latest weights (exactly ``version`` when given) from ``node`` (default: the first node)."""
        target = node or self._nodes[0]
        return self._calls.get(target, WeightsTicket(version=version).to_bytes())

    # ---- metadata ------------------------------------------------------------------------------

    @staticmethod
    def _empty_metadata(columns: Sequence[str] | None) -> pl.DataFrame:
        names = ["seq", *(c for c in dict.fromkeys(columns) if c != "seq")] if columns else METADATA_SCHEMA.names
        frame = cast(pl.DataFrame, pl.from_arrow(METADATA_SCHEMA.empty_table().select(names)))
        return frame.with_columns(pl.lit(None, dtype=pl.String).alias("node")).clear()

    def scan_metadata(
        self,
        since: Mapping[str, int] | None = None,
        columns: Sequence[str] | None = None,
        *,
        partial: bool = False,
    ) -> pl.DataFrame:
        """Metadata rows with ``seq >= since[node]`` from every node, with a ``node`` column (pl.String).

        Raises:
            NodeUnavailableError: a node cannot be reached (only when ``partial`` is False; with
                ``partial=True`` the rows of the reachable nodes are returned and the others are
                listed in :attr:`last_failed_nodes`).
        """
        since = since or {}
        # ``node`` is added here, not stored: asking for it is harmless
        cols = [c for c in columns if c != "node"] if columns is not None else None

        def scan(n: str) -> pa.Table:
            ticket = MetadataTicket(since=int(since.get(n, 0)), columns=cols).to_bytes()
            return self._calls.get(n, ticket)

        tables = self._fan_out(self._nodes, scan, partial=partial, what="metadata scan")
        if not partial:
            self.last_failed_nodes = []  # a strict scan that returns reached every node
        frames = [
            cast(pl.DataFrame, pl.from_arrow(table)).with_columns(pl.lit(n, dtype=pl.String).alias("node"))
            for n, table in tables.items()
            if table.num_rows
        ]
        if not frames:
            return self._empty_metadata(cols)
        return pl.concat(frames, how="vertical")

    def scan_new(self, columns: Sequence[str] | None = None, *, partial: bool = False) -> pl.DataFrame:
        """Metadata rows not returned by an earlier ``scan_new`` of this client (a cursor per node).

        With ``partial=True`` an unreachable node is skipped (see :meth:`scan_metadata`); its cursor
        stays, so its rows arrive once it answers again.
        """
        with self._cursor_lock:
            frame = self.scan_metadata(since=dict(self._cursor), columns=columns, partial=partial)
            if frame.height:
                for n, top in frame.group_by("node").agg(pl.col("seq").max()).iter_rows():
                    self._cursor[str(n)] = max(self._cursor[str(n)], int(top) + 1)
        return frame

    def metadata(self) -> pl.LazyFrame:
        """All current metadata of all nodes (a fresh scan from seq 0), as a LazyFrame."""
        return self.scan_metadata().lazy()

    # ---- payload -------------------------------------------------------------------------------

    def fetch(self, slices: Sequence[PlannedSlice], columns: Sequence[str] | None = None) -> pa.Table:
        """The rows of ``slices``, in the order of ``slices``: one request per node, all nodes at once.

        Each node is asked over a read channel (a long-lived DoExchange, kept between fetches: no call
        per read); a node whose channel fails is read by one DoGet instead, with retries.
        """
        cols = list(columns) if columns is not None else None
        if not slices:
            return streams.empty_table(cols)
        per_node = streams.by_node(slices)
        tickets = {n: streams.slices_ticket(ss, cols) for n, ss in per_node.items()}
        for n in per_node:
            self._calls.client(n)

        def by_doget(n: str) -> pa.Table:
            return self._get_retrying(n, tickets[n], streams.group_ids(per_node[n]))

        return streams.in_order(slices, self._calls.read(tickets, cols, by_doget))

    def stream(
        self, micro_batches: Sequence[Sequence[PlannedSlice]], columns: Sequence[str] | None = None
    ) -> Iterator[pa.Table]:
        """The rows of each micro-batch's slices, one table per micro-batch in order, over ONE DoGet per node.

        A trainer rank's share of a mini-batch costs one call per node instead of one per
        micro-batch and node: each node streams its slices of all the micro-batches in order, so
        micro-batch ``i`` is read while the next ones arrive (prefetch), and the node runs at most
        gRPC's flow-control window (a few MB) ahead of the reader. The calls open at the first
        ``next()``; each has the client's ``timeout`` per micro-batch.

        A node that fails on the way (unavailable, deadline passed) is fetched one micro-batch at a
        time from then on, with :meth:`fetch`'s retries and errors; any other error (unknown or
        released group, bad column) is raised as :meth:`fetch` raises it.
        """
        cols = list(columns) if columns is not None else None
        mbs = [list(m) for m in micro_batches]
        per_node = streams.by_node([s for m in mbs for s in m])
        for n in per_node:
            self._calls.client(n)
        timeout = None if self._calls.timeout is None else self._calls.timeout * max(1, len(mbs))
        options = flight.FlightCallOptions(timeout=timeout, headers=self._calls.headers)
        readers: dict[str, streams.NodeStream | None] = {}

        def take(n: str, node_slices: list[PlannedSlice]) -> pa.Table:
            node_stream, rows = readers[n], sum(s.rows for s in node_slices)
            if node_stream is not None:
                try:
                    return self._calls.call(n, lambda _c: node_stream.take(rows))
                except NodeUnavailableError as exc:
                    log.warning("stream from %s broke (%s); fetching its slices one micro-batch at a time", n, exc)
                    readers[n] = None
                    node_stream.reader.cancel()
            return self._get_retrying(n, streams.slices_ticket(node_slices, cols), streams.group_ids(node_slices))

        def open_stream(n: str, node_slices: list[PlannedSlice]) -> streams.NodeStream:
            ticket = flight.Ticket(streams.slices_ticket(node_slices, cols))

            def run(c: flight.FlightClient) -> streams.NodeStream:
                return streams.NodeStream(c.do_get(ticket, options), n)

            return self._calls.call(n, run)

        def try_open(n: str) -> streams.NodeStream | Exception:
            try:
                return open_stream(n, per_node[n])
            except Exception as exc:  # every node is opened; the first error (in node order) is raised below
                return exc

        try:
            # the nodes' streams open concurrently: an open waits for the node's first message
            opened = self._fan_out(per_node, try_open)
            readers.update({n: None if isinstance(o, Exception) else o for n, o in opened.items()})
            for n, o in opened.items():
                if isinstance(o, NodeUnavailableError):
                    log.warning("cannot open a stream from %s (%s); fetching one micro-batch at a time", n, o)
                elif isinstance(o, Exception):
                    raise o
            for i, m in enumerate(mbs):
                if m:
                    table = streams.in_order(m, {n: take(n, ss) for n, ss in streams.by_node(m).items()})
                else:
                    table = streams.empty_table(cols)
                if i == len(mbs) - 1:  # read each stream's end now: a caller stops after the last table
                    for n, node_stream in readers.items():
                        if node_stream is not None:
                            try:
                                self._calls.call(n, node_stream.finish)
                            except NodeUnavailableError as exc:  # every row arrived; only the end is missing
                                log.info("stream from %s did not end cleanly (%s); all its rows had arrived", n, exc)
                            readers[n] = None
                yield table
        finally:
            for node_stream in readers.values():
                if node_stream is not None:  # left early (error, or the caller stopped reading)
                    node_stream.reader.cancel()

    def _get_retrying(self, node: str, ticket: bytes, group_ids: list[str]) -> pa.Table:
        """:meth:`NodeCalls.get`; a node still unavailable after its retries is named with the groups it held."""
        try:
            return self._calls.get(node, ticket)
        except NodeUnavailableError as exc:
            more = f", ... ({len(group_ids)} in all)" if len(group_ids) > 8 else ""
            shown = ", ".join(group_ids[:8]) + more
            msg = (f"store node {node} is unavailable after {self.retries + 1} attempt(s); "
                   f"cannot fetch group(s) {shown}: {exc}")
            raise NodeUnavailableError(msg, node=node, group_ids=group_ids) from None

    def fetch_images(self, keys: Iterable[bytes], *, nodes: Mapping[bytes, str] | None = None) -> pa.Table:
        """The image rows of ``keys`` (each distinct key once, in first-seen order), from whichever node holds them.

        With ``nodes`` (key -> the node of a group that references it, as a trainer knows from its
        slices) each node is asked for exactly its keys; otherwise every node is asked for all of them
        (``missing_ok``) and answers with those it holds. One DoGet per node either way.

        Raises:
            UnknownImageError: a key is held by none of the nodes asked (names it).
        """
        wanted = list(dict.fromkeys(bytes(k) for k in keys))
        if not wanted:
            return IMAGE_SCHEMA.empty_table()
        asked = {n: wanted for n in self._nodes} if nodes is None else streams.keys_by_node(wanted, nodes)

        def get(n: str) -> pa.Table:
            ticket = ImagesTicket(keys=[k.hex() for k in asked[n]], missing_ok=nodes is None).to_bytes()
            return self._calls.get(n, ticket)

        found = pa.concat_tables([t.cast(IMAGE_SCHEMA) for t in self._fan_out(asked, get).values()])
        first: dict[bytes, int] = {}
        for i, k in enumerate(found.column("image_key").to_pylist()):
            first.setdefault(k, i)
        missing = next((k for k in wanted if k not in first), None)
        if missing is not None:
            msg = f"image {missing.hex()} is stored on none of the nodes {sorted(asked)}"
            raise UnknownImageError(msg, key=missing.hex())
        return found.take(pa.array([first[k] for k in wanted], pa.int64()))

    def read(self, plan: MiniBatchPlan, dp_rank: int | None = None,
             columns: Sequence[str] | None = None) -> Iterator[tuple[MicroBatch, pa.Table]]:
        """The micro-batches of an admitted mini-batch, in order, with their rows: what a trainer rank reads.

        ``dp_rank`` selects one rank's micro-batches (default: every rank's, rank by rank). Streams them as
        :meth:`stream` does (one DoGet per node).
        """
        ranks = plan.ranks if dp_rank is None else [plan.for_rank(dp_rank)]
        mbs = [mb for rank in ranks for mb in rank.micro_batches]
        yield from zip(mbs, self.stream([mb.slices for mb in mbs], columns), strict=True)

    # ---- control -------------------------------------------------------------------------------

    def release(self, group_ids: Iterable[str], *, partial: bool = False) -> dict[str, int]:
        """Release groups on every node; returns how many groups each node freed.

        With ``partial=True`` an unreachable node is skipped (listed in :attr:`last_failed_nodes`,
        absent from the answer) instead of raising :class:`NodeUnavailableError`.
        """
        ids = list(dict.fromkeys(group_ids))
        if not ids:
            return dict.fromkeys(self._nodes, 0)
        body = ReleaseBody(group_ids=ids).to_bytes()
        answers = self._fan_out(self._nodes, lambda n: self._calls.action(n, "release", body), partial=partial,
                                what="release")
        return {n: int(a["released"]) for n, a in answers.items()}

    # ---- groups in flight ----------------------------------------------------------------------

    def dispatch(self, groups: Sequence[DispatchedGroup]) -> list[str]:
        """Register groups in flight with the nodes they belong to (routing); returns the ids that were
        written already (their registration changes nothing)."""
        by_node: dict[str, list[DispatchedGroup]] = {}
        for g in groups:
            by_node.setdefault(self.node_for(g.group_id), []).append(g)
        bodies = {n: DispatchBody(groups=gs).to_bytes() for n, gs in by_node.items()}
        answers = self._fan_out(bodies, lambda n: self._calls.action(n, "dispatch", bodies[n]), what="dispatch")
        return [str(g) for a in answers.values() for g in a["stored"]]

    def resolve(self, group_ids: Iterable[str], reason: ResolveReason) -> int:
        """Take groups out of flight without rows (``aborted``, ``filtered``, ``cancelled``); returns how many were."""
        by_node: dict[str, list[str]] = {}
        for g in dict.fromkeys(group_ids):
            by_node.setdefault(self.node_for(g), []).append(g)
        bodies = {n: ResolveBody(group_ids=ids, reason=reason).to_bytes() for n, ids in by_node.items()}
        answers = self._fan_out(bodies, lambda n: self._calls.action(n, "resolve", bodies[n]), what="resolve")
        return sum(int(a["resolved"]) for a in answers.values())

    def publish_demand(self, classes: Mapping[str, int]) -> None:
        """Tell the rollout, through every reachable node's ``stats``, which classes the trainer needs that
        nothing running brings (groups per data source; ``{}`` clears it)."""
        body = DemandBody(classes=dict(classes)).to_bytes()
        self._fan_out(self._nodes, lambda n: self._calls.action(n, "demand", body, retry=False), partial=True,
                      what="demand")

    def inflight(self, *, partial: bool = False) -> Inflight:
        """The groups in flight on every node (what the planner counts as supply to come).

        With ``partial=True`` an unreachable node is skipped (listed in :attr:`last_failed_nodes`): its groups
        are then not counted, which only makes a planner more careful.
        """
        answers = self._fan_out(self._nodes, lambda n: self._calls.action(n, "inflight", retry=False),
                                partial=partial, what="inflight")
        rows = [{**g, "node": n} for n, a in answers.items() for g in a["groups"]]
        resolved: dict[str, int] = {}
        for a in answers.values():
            for reason, k in a["resolved"].items():
                resolved[reason] = resolved.get(reason, 0) + int(k)
        return Inflight(groups=pl.DataFrame(rows, schema=INFLIGHT_COLUMNS),
                        registered_total=sum(int(a["registered_total"]) for a in answers.values()),
                        resolved=resolved)

    def publish_version(self, version: int) -> None:
        """Record the newest policy version on every node."""
        body = PublishVersionBody(version=version).to_bytes()
        self._fan_out(self._nodes, lambda n: self._calls.action(n, "publish_version", body))

    def get_version(self) -> int:
        """The newest published policy version (max over nodes)."""
        body = EmptyBody().to_bytes()
        answers = self._fan_out(self._nodes, lambda n: self._calls.action(n, "get_version", body, retry=False))
        return max(int(a["version"]) for a in answers.values())

    def stats(self) -> dict[str, dict[str, Any]]:
        """The ``stats`` answer of every node."""
        return self._fan_out(self._nodes, lambda n: self._calls.action(n, "stats", retry=False))

    def health(self) -> dict[str, dict[str, Any]]:
        """The ``health`` answer of every node; an unreachable node answers ``{"ok": False, "error": ...}``."""

        def one(n: str) -> dict[str, Any]:
            try:
                return self._calls.action(n, "health", retry=False)
            except Exception as exc:  # health reports, it does not raise
                return {"ok": False, "node": n, "error": str(exc)}

        return self._fan_out(self._nodes, one)

    def close(self) -> None:
        """Close every connection and the thread pool."""
        self._calls.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
