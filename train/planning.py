"""Rank 0 hosts the planner; plans reach every rank over ``torch.distributed``.

``PlanSource`` (rank 0 only) scans new metadata rows from every store (``StoreReader.scan_new``,
metadata columns only, never payload), keeps the rows of the groups the planner has neither
admitted nor dropped, and asks the planner for every mini-batch admissible now. After each update
it removes the settled groups' rows from its frame and their ids from the planner's state, releases
the dropped groups on the stores (they are never trained; their metadata stays), and hands the
consumed trajectories to a :class:`ConsumedLog` (a Parquet file, written as the run goes),
so rank 0's memory stays proportional to the pending work, not to the groups processed.
``exchange_plans`` is the one collective: rank 0 broadcasts the new plans (as JSON); the other
ranks receive them.

The planner is ``admission.Planner`` built from ``TrainConfig.admission`` with ``dp_ranks`` set
from the process group (:func:`with_dp_ranks`), or any object with the same ``config``, ``state``,
``update``, ``drain`` and ``forget`` (:class:`PlannerLike`) passed to ``train.loop.run``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import polars as pl
import pyarrow as pa

from admission.config import AdmissionConfig
from admission.planner import CONSUMED_SCHEMA, InflightSupply
from admission.state import PlannerState
from flight_store.reading import StoreReader
from schemas.plan import MiniBatchPlan

log = logging.getLogger(__name__)


class PlannerLike(Protocol):
    """What the trainer needs from a planner (``admission.Planner`` is one)."""

    @property
    def config(self) -> AdmissionConfig:
        """The admission policy it plans by (its quotas decide the demand published to the rollout)."""
        ...

    @property
    def state(self) -> PlannerState:
        """Groups admitted and dropped since they were last forgotten (their rows are never needed again)."""
        ...

    def update(self, metadata: pl.DataFrame, *, inflight: InflightSupply = None,
               current_version: int = 0) -> list[MiniBatchPlan]:
        """The mini-batches admissible now, given every pending metadata row."""
        ...

    def drain(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """The consumed trajectories and dropped groups since the last drain, no longer kept by the planner."""
        ...

    def forget(self, group_ids: Iterable[str]) -> None:
        """Forget settled groups whose rows will never be planned on again."""
        ...


def with_dp_ranks(admission: AdmissionConfig, dp_size: int) -> AdmissionConfig:
    """``admission`` with ``dp_ranks`` set to the process group's data-parallel size.

    Raises:
        ValueError: when the config gave a ``dp_ranks`` other than the default 1 that differs.
    """
    if admission.dp_ranks not in (1, dp_size):
        msg = (f"admission.dp_ranks={admission.dp_ranks} differs from the data-parallel size {dp_size} of the "
               "process group; leave it at 1 (it is set from the process group)")
        raise ValueError(msg)
    return dataclasses.replace(admission, dp_ranks=dp_size)


class PlanSource:
    """Rank 0's view of the stores: metadata in, plans out.

    After each planner update it settles what the planner decided: the consumed trajectories go to
    ``consumed_log`` (a :class:`ConsumedLog`), the settled (admitted or dropped) groups' rows leave
    the frame and their ids leave the planner's state (the store's cursor never returns a row twice),
    so neither grows with the groups processed.

    Example::

        planner = Planner(AdmissionConfig(train_batch_groups=8, group_size=4, dp_ranks=2))
        source = PlanSource(StoreReader(locations), planner)
        plans = source.wait(current_version=0, idle_timeout_s=60, poll_interval_s=0.05)
    """

    def __init__(self, client: StoreReader, planner: PlannerLike, *, inflight: InflightSupply = None,
                 supply_from_stores: bool = False, consumed_log: ConsumedLog | None = None) -> None:
        self._client = client
        self._planner = planner
        self._inflight = inflight
        self._from_stores = supply_from_stores
        self._supply_note = ""  # why the stores' supply is not used (logged once)
        self._demand: dict[str, int] = {}  # the demand last published
        self.demand_changes = 0
        """Times the demand published to the rollout changed."""
        self.exact_updates = 0
        """Planner calls given the stores' in-flight groups (the exact feasibility test)."""
        self.stall_releases = 0
        """Planner calls that fell back to unknown supply because the exact test admitted nothing while no
        group ran (the rollout waits for the trainer to consume: only admission can move the pipeline)."""
        self._frame: pl.DataFrame | None = None
        self.consumed_log = consumed_log if consumed_log is not None else ConsumedLog(None)
        """Where the consumed trajectories go (by default: only their per-step figures)."""
        self.admitted_groups = 0
        """Groups admitted so far."""
        self.planner_s = 0.0
        """Seconds spent in the planner's ``update`` so far."""
        self.dropped: Counter[str] = Counter()
        """Groups dropped so far, per reason."""
        self.on_settled: Callable[[pl.DataFrame, pl.DataFrame], None] | None = None
        """Called with each update's consumed rows and dropped groups, before the dropped ones are released."""
        self.stop_requested: Callable[[], bool] = lambda: False
        """Whether the trainer was asked to stop: :meth:`wait` returns at once then."""

    @property
    def planner(self) -> PlannerLike:
        """The planner this source feeds."""
        return self._planner

    @property
    def pending_rows(self) -> int:
        """Metadata rows kept: those of groups neither admitted nor dropped (yet). Read by no code path; it is
        what a caller checks to see the source's memory stay bounded over a long run (tests/test_train_bounded.py)."""
        return 0 if self._frame is None else self._frame.height

    def poll(self, current_version: int, *, waiting: bool = False) -> list[MiniBatchPlan]:
        """Scan new metadata once and return every mini-batch the planner admits now.

        ``waiting``: the trainer has no plan left to train. Only then, and only when this poll admits nothing,
        is the demand published (:meth:`_publish_demand`); any other poll withdraws it. A trainer with plans
        queued is not short of any class, and a demand left standing while it trains would let the rollout
        dispatch past its lookahead limit, one group after another, for train batches far ahead: the
        queue of admitted plans, and the staleness of what they hold, would grow without bound."""
        new = self._client.scan_new()
        if new.height:
            self._frame = new if self._frame is None else pl.concat([self._frame, new], how="vertical_relaxed")
        if self._frame is None or self._frame.height == 0:
            return []
        inflight, running = self._supply() if self._from_stores else (self._inflight, True)
        self.exact_updates += self._from_stores and inflight is not None
        t0 = time.perf_counter()
        plans = self._planner.update(self._frame, inflight=inflight, current_version=current_version)
        if not plans and inflight is not None and not running:
            plans = self._planner.update(self._frame, inflight=None, current_version=current_version)
            self.stall_releases += bool(plans)
        self.planner_s += time.perf_counter() - t0
        self._settle()
        if isinstance(inflight, pl.DataFrame):
            self._publish_demand(inflight if waiting and not plans else None)
        return plans

    def _publish_demand(self, inflight: pl.DataFrame | None) -> None:
        """Tell the rollout (through the stores) which data sources the current train batch still needs beyond
        the groups stored and running (``inflight``; ``None``: no demand): prompts of them may go out past its
        lookahead limit. Sent on change."""
        config = self._planner.config
        if [q.column for q in config.quotas] != ["data_source"]:
            return
        if inflight is None:
            if self._demand:
                self._client.publish_demand({})
                self._demand = {}
                self.demand_changes += 1
            return
        used = self._planner.state.used()
        have: Counter[str] = Counter()
        if self._frame is not None and self._frame.height:
            have.update(self._frame.unique("group_id")["data_source"].cast(pl.String).to_list())
        have.update(inflight.filter(pl.col("state") == "running")["data_source"].to_list())
        demand = {v: n - used.get(("data_source", v), 0) - have[v] for v, n in config.quota_counts()[0].items()}
        demand = {v: n for v, n in demand.items() if n > 0}
        if demand != self._demand:
            self._client.publish_demand(demand)
            self._demand = demand
            self.demand_changes += 1

    def _supply(self) -> tuple[pl.DataFrame | None, bool]:
        """The groups in flight on the stores, read AFTER the metadata scan (a group written in between is
        then counted in neither, never in both), minus any already in the frame; and whether any runs.

        ``None`` (unknown supply) when no rollout registers its groups, when a quota column is one the
        registrations do not carry, or when a store does not answer.
        """
        quota_cols = set(self._planner.config.quota_columns)
        if not quota_cols <= {"data_source"}:
            return self._unknown(f"quota columns {sorted(quota_cols)} are not all carried by registrations")
        seen = self._client.inflight(partial=True)
        if self._client.last_failed_nodes:
            return self._unknown(f"stores {self._client.last_failed_nodes} did not answer")
        if seen.registered_total == 0:
            return self._unknown("no rollout registered a group with the stores")
        assert self._frame is not None
        groups = seen.groups.filter(~pl.col("group_id").is_in(self._frame["group_id"].implode()))
        self._supply_note = ""
        return groups, bool((groups["state"] == "running").any())

    def _unknown(self, why: str) -> tuple[None, bool]:
        """Unknown supply (the planner assumes every quota class may still arrive); says why once."""
        if why != self._supply_note:
            log.info("in-flight supply unknown (the planner assumes every quota class may still arrive): %s", why)
            self._supply_note = why
        return None, True

    def _settle(self) -> None:
        """Log the planner's consumed rows; drop the settled groups' rows from the frame, their ids from its state.

        Only ids whose rows were in the frame are forgotten: the store commits a group's rows at once and the
        cursor returns each row once, so those rows never come back.
        """
        consumed, dropped = self._planner.drain()
        if self.on_settled is not None:
            self.on_settled(consumed, dropped)
        self.consumed_log.append(consumed)
        self.admitted_groups += consumed["group_id"].n_unique()
        if dropped.height:
            reasons = Counter(dropped["reason"].to_list())
            log.info("dropped %d group(s): %s", dropped.height, dict(reasons))
            self.dropped.update(reasons)
            # never trained: free their payload (their metadata stays), so they hold no memory and no lookahead
            self._client.release(dropped["group_id"].to_list(), partial=True)
        state = self._planner.state
        done = state.admitted | state.dropped
        if not done or self._frame is None:
            return
        settled = pl.col("group_id").is_in(pl.Series(list(done), dtype=pl.String).implode())
        self._planner.forget(self._frame.filter(settled)["group_id"].unique().to_list())
        self._frame = self._frame.filter(~settled)

    def wait(self, current_version: int, *, idle_timeout_s: float, poll_interval_s: float) -> list[MiniBatchPlan]:
        """Poll until at least one mini-batch is admissible, or ``idle_timeout_s`` passes (then ``[]``)."""
        deadline = time.monotonic() + idle_timeout_s
        while True:
            plans = self.poll(current_version, waiting=True)
            if plans or time.monotonic() >= deadline or self.stop_requested():
                return plans
            time.sleep(poll_interval_s)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepFigures:
    """A step's staleness and reward figures, over the trajectories admitted into it (rank 0's progress line)."""

    arch_staleness_mean: float | None
    """Mean architectural staleness (``admission.staleness``), in policy versions."""
    arch_staleness_max: int | None
    """Largest architectural staleness of the step's trajectories."""
    reward_mean: float | None
    """Mean reward of the step's trajectories."""


class ConsumedLog:
    """Rank 0's record of the trajectories the planner admitted, kept on disk rather than in memory.

    :meth:`append` takes each update's consumed rows (``admission.PlanResult.consumed``) and appends
    them to an Arrow IPC stream beside ``path`` (``<path>.arrows``; a stream writer keeps nothing per
    batch); each step's figures for its progress line are kept until :meth:`take_step` takes them.
    :meth:`close` turns the stream into the Parquet file ``path`` (row groups of at least
    ``rows_per_group`` rows, read back one batch at a time) holding what
    ``admission.Planner.consumed_frame`` would hold, in the same order (no rows when nothing was
    admitted). ``path=None`` keeps only the figures. Memory: the figures of the steps planned but not
    yet trained.

    Example::

        with ConsumedLog("run/consumed.parquet") as consumed_log:
            source = PlanSource(client, planner, consumed_log=consumed_log)
    """

    def __init__(self, path: str | None, *, rows_per_group: int = 16384) -> None:
        if rows_per_group < 1:
            msg = f"rows_per_group must be >= 1, got {rows_per_group}"
            raise ValueError(msg)
        self.path = path
        self.rows_per_group = rows_per_group
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._steps: dict[int, StepFigures] = {}

    def append(self, consumed: pl.DataFrame) -> None:
        """Record one update's consumed rows (rows of whole steps, in step order)."""
        if consumed.height == 0:
            return
        figures = consumed.group_by("step", maintain_order=True).agg(
            pl.col("arch_staleness").mean().alias("arch_staleness_mean"),
            pl.col("arch_staleness").max().alias("arch_staleness_max"),
            pl.col("reward").mean().alias("reward_mean"))
        for row in figures.iter_rows(named=True):
            step = int(row.pop("step"))
            self._steps[step] = StepFigures(**row)
        if self.path is None:
            return
        table = consumed.to_arrow()
        if self._stream is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._stream = pa.ipc.new_stream(f"{self.path}.arrows", table.schema)
        self._stream.write_table(table)

    def take_step(self, step: int) -> StepFigures | None:
        """The figures of ``step``'s trajectories (``None`` when none were logged); forgotten afterwards."""
        return self._steps.pop(step, None)

    def close(self) -> None:
        """Write the Parquet file and remove the stream (safe to call twice)."""
        if self.path is None:
            return
        path, self.path = self.path, None
        if self._stream is None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            pl.DataFrame(schema=CONSUMED_SCHEMA).write_parquet(path)
            return
        import pyarrow.parquet as pq

        self._stream.close()
        spool = f"{path}.arrows"
        with pa.ipc.open_stream(spool) as reader, pq.ParquetWriter(path, reader.schema) as writer:
            chunk: list[pa.RecordBatch] = []
            rows = 0
            for batch in reader:
                chunk.append(batch)
                rows += batch.num_rows
                if rows >= self.rows_per_group:  # one row group of at least rows_per_group rows
                    writer.write_table(pa.Table.from_batches(chunk), row_group_size=rows)
                    chunk, rows = [], 0
            if chunk:
                writer.write_table(pa.Table.from_batches(chunk), row_group_size=rows)
        os.remove(spool)

    def __enter__(self) -> ConsumedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange_plans(source: PlanSource | None, current_version: int, *, block: bool, idle_timeout_s: float,
                   poll_interval_s: float) -> list[MiniBatchPlan]:
    """Rank 0 plans (waiting up to ``idle_timeout_s`` for data when ``block``) and broadcasts the plans.

    Collective: every rank calls it and returns the same plans (``[]`` = nothing admissible).
    """
    import torch.distributed as dist

    msg: list[Any] = [None]
    if dist.get_rank() == 0:
        if source is None:
            err = "rank 0 needs a PlanSource"
            raise ValueError(err)
        plans = (source.wait(current_version, idle_timeout_s=idle_timeout_s, poll_interval_s=poll_interval_s)
                 if block else source.poll(current_version))
        msg = [[p.model_dump_json() for p in plans]]
    dist.broadcast_object_list(msg, src=0)
    return [MiniBatchPlan.model_validate_json(p) for p in msg[0]]
