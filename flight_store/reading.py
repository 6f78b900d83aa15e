"""The reading role: what a trainer does with the stores (see :mod:`flight_store.client`).

:class:`StoreReader` scans the nodes' metadata (a cursor per node), reads the rows of planned
slices in plan order, fetches the images they reference, releases consumed groups, tells the rollout
the planner's demand, and counts the groups in flight (the planner's supply to come). The trainer's
weights and versions go out through :class:`~flight_store.publishing.StorePublisher`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import polars as pl
import pyarrow as pa

from flight_store import streams
from flight_store.calls import NodeCalls
from flight_store.client import StoreNodes, ViewCache
from flight_store.errors import NodeUnavailableError, UnknownImageError
from schemas.arrow import IMAGE_SCHEMA, METADATA_SCHEMA
from schemas.plan import MicroBatch, MiniBatchPlan, PlannedSlice
from schemas.replies import DemandReply, InflightReply, ReleaseReply
from schemas.wire import DemandBody, ImagesTicket, MetadataTicket, ReleaseBody

INFLIGHT_COLUMNS = {"group_id": pl.String, "data_source": pl.String, "prompt_id": pl.String,
                    "dispatch_version": pl.Int64, "state": pl.String, "dispatched_at": pl.Float64, "node": pl.String}
"""Columns of :attr:`InflightSnapshot.groups`."""


@dataclass(frozen=True, slots=True)
class InflightSnapshot:
    """The groups in flight on every node (:meth:`StoreReader.inflight`)."""

    groups: pl.DataFrame
    """One row per group in flight (:data:`INFLIGHT_COLUMNS`)."""
    registered_total: int
    """Registrations the nodes ever received (0: no rollout registers its groups)."""
    resolved: dict[str, int]
    """Groups taken out of flight, per reason (``written`` when its rows arrived), summed over nodes."""


class StoreReader(StoreNodes):
    """Scans, reads and releases what the rollout wrote (the trainer's client).

    Example:
        >>> from flight_store.server import StoreServer
        >>> from flight_store.writing import StoreWriter
        >>> from schemas.records import TrajectoryRecord, records_to_batch
        >>> with StoreServer() as server, StoreWriter(server.location) as writer, \\
        ...         StoreReader.sharing(writer) as reader:
        ...     node = writer.put_group(records_to_batch([TrajectoryRecord(group_id="g0", sample_idx=i,
        ...         policy_version=0, prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -2.0])
        ...         for i in range(4)]))
        ...     frame = reader.scan_new(columns=["group_id", "sample_idx", "reward"])
        ...     table = reader.fetch([PlannedSlice(node=node, group_id="g0", start=0, stop=2)])
        ...     (frame.height, table.num_rows)
        (4, 2)
    """

    def _setup(self, calls: NodeCalls, views: ViewCache | None = None) -> None:
        super()._setup(calls, views)
        self._cursor: dict[str, int] = dict.fromkeys(calls.nodes, 0)
        self._cursor_lock = threading.Lock()

    # ---- metadata ------------------------------------------------------------------------------

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
            return self._calls.get(n, ticket, routed=True)  # a node the view lists down meanwhile is left out

        tables = self._fan_out(self._live(), scan, partial=partial, what="metadata scan")
        if not partial:
            self.last_failed_nodes = []  # a strict scan that returns reached every node
        frames = [
            cast(pl.DataFrame, pl.from_arrow(table)).with_columns(pl.lit(n, dtype=pl.String).alias("node"))
            for n, table in tables.items()
            if table.num_rows
        ]
        if not frames:
            return _empty_metadata(cols)
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

    def fetch(self, slices: Sequence[PlannedSlice], columns: Sequence[str] | None = None, *,
              start: int = 0) -> pa.Table:
        """The rows of ``slices``, in the order of ``slices``: one request per node, all nodes at once.

        The nodes are asked in the client's node order from its ``start``-th node on (modulo their number), so
        ranks reading at once with different ``start`` (rank ``r``'s ``i``-th micro-batch: ``r + i``) begin on
        different nodes.

        Each node is asked over a read channel (a long-lived DoExchange, kept between fetches: no call
        per read). A node whose channel breaks (the node restarted, the channel's deadline passed) is read
        by one DoGet instead: a channel is one long call that cannot be retried mid-answer, a DoGet is
        retried on retryable errors and, for a node still unavailable, names the groups it held.
        """
        cols = list(columns) if columns is not None else None
        if not slices:
            return streams.empty_table(cols)
        per_node = streams.by_node(slices)
        order = streams.staggered(per_node, self._nodes, start)
        tickets = {n: streams.slices_ticket(per_node[n], cols) for n in order}
        for n in per_node:
            self._calls.client(n)

        def by_doget(n: str) -> pa.Table:
            return self._get_retrying(n, tickets[n], streams.group_ids(per_node[n]))

        return streams.in_order(slices, self._calls.read(tickets, cols, by_doget))

    def stream(
        self, micro_batches: Sequence[Sequence[PlannedSlice]], columns: Sequence[str] | None = None, *,
        start: int = 0,
    ) -> Iterator[pa.Table]:
        """The rows of each micro-batch's slices, one table per micro-batch in order: each micro-batch is one
        :meth:`fetch` (one request per node over its read channel, the ``i``-th from node ``start + i`` on), made
        when the caller asks for its table. A trainer rank passes its DP rank as ``start``."""
        cols = list(columns) if columns is not None else None
        for i, m in enumerate(micro_batches):
            yield self.fetch(m, cols, start=start + i)

    def read(self, plan: MiniBatchPlan, dp_rank: int | None = None,
             columns: Sequence[str] | None = None) -> Iterator[tuple[MicroBatch, pa.Table]]:
        """The micro-batches of an admitted mini-batch, in order, with their rows: what a trainer rank reads.

        ``dp_rank`` selects one rank's micro-batches (default: every rank's, rank by rank). Streams them as
        :meth:`stream` does.
        """
        ranks = plan.ranks if dp_rank is None else [plan.for_rank(dp_rank)]
        for rank in ranks:
            mbs = rank.micro_batches
            yield from zip(mbs, self.stream([mb.slices for mb in mbs], columns, start=rank.dp_rank), strict=True)

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

    # ---- what the trainer tells the nodes ------------------------------------------------------

    def release(self, group_ids: Iterable[str], *, partial: bool = False) -> dict[str, int]:
        """Release groups on every node; returns how many groups each node freed.

        With ``partial=True`` an unreachable node is skipped (listed in :attr:`last_failed_nodes`,
        absent from the answer) instead of raising :class:`NodeUnavailableError`.
        """
        ids = list(dict.fromkeys(group_ids))
        if not ids:
            return dict.fromkeys(self._nodes, 0)
        body = ReleaseBody(group_ids=ids).to_bytes()
        answers = self._fan_out(self._live(), lambda n: self._calls.action(n, "release", ReleaseReply, body),
                                partial=partial, what="release")
        return {n: a.released for n, a in answers.items()}

    def publish_demand(self, classes: Mapping[str, int]) -> None:
        """Tell the rollout, through every reachable node's ``stats``, which classes the trainer needs that
        nothing running brings (groups per data source; ``{}`` clears it)."""
        body = DemandBody(classes=dict(classes)).to_bytes()
        self._fan_out(self._live(), lambda n: self._calls.action(n, "demand", DemandReply, body, retry=False),
                      partial=True, what="demand")

    def inflight(self, *, partial: bool = False) -> InflightSnapshot:
        """The groups in flight on every node (what the planner counts as supply to come).

        With ``partial=True`` an unreachable node is skipped (listed in :attr:`last_failed_nodes`): its groups
        are then not counted, which only makes a planner more careful.
        """
        answers = self._fan_out(self._live(), lambda n: self._calls.action(n, "inflight", InflightReply, retry=False),
                                partial=partial, what="inflight")
        rows = [{**g.model_dump(), "node": n} for n, a in answers.items() for g in a.groups]
        resolved: dict[str, int] = {}
        for a in answers.values():
            for reason, k in a.resolved.items():
                resolved[reason] = resolved.get(reason, 0) + k
        return InflightSnapshot(groups=pl.DataFrame(rows, schema=INFLIGHT_COLUMNS),
                                registered_total=sum(a.registered_total for a in answers.values()),
                                resolved=resolved)


def _empty_metadata(columns: Sequence[str] | None) -> pl.DataFrame:
    names = ["seq", *(c for c in dict.fromkeys(columns) if c != "seq")] if columns else METADATA_SCHEMA.names
    frame = cast(pl.DataFrame, pl.from_arrow(METADATA_SCHEMA.empty_table().select(names)))
    return frame.with_columns(pl.lit(None, dtype=pl.String).alias("node")).clear()
