"""Rank 0 hosts the planner; plans reach every rank over ``torch.distributed``.

``PlanSource`` (rank 0 only) scans new metadata rows from every store (``StoreClient.scan_new``,
metadata columns only, never payload), keeps the rows of the groups the planner has neither
admitted nor dropped (both read from the planner's state, so the frame stays as small as the
pending work), and asks the planner for every mini-batch admissible now. ``exchange_plans`` is the
one collective: rank 0 broadcasts the new plans (as JSON); the other ranks receive them.

The planner is ``admission.Planner`` built from ``TrainConfig.admission`` with ``dp_ranks`` set
from the process group (:func:`with_dp_ranks`), or any object with the same ``update`` and
``state`` (:class:`PlannerLike`) passed to ``train.loop.run``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import polars as pl

from admission.config import AdmissionConfig
from admission.state import PlannerState
from schemas.plan import MiniBatchPlan

log = logging.getLogger(__name__)


class PlannerLike(Protocol):
    """What the trainer needs from a planner (``admission.Planner`` is one)."""

    @property
    def state(self) -> PlannerState:
        """Groups admitted and dropped so far (their rows are never needed again)."""
        ...

    def update(self, metadata: pl.DataFrame, *, inflight: Any = None,
               current_version: int = 0) -> list[MiniBatchPlan]:
        """The mini-batches admissible now, given every pending metadata row."""
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

    Example::

        planner = Planner(AdmissionConfig(train_batch_groups=8, group_size=4, dp_ranks=2))
        source = PlanSource(StoreClient(locations), planner)
        plans = source.wait(current_version=0, idle_timeout_s=60, poll_interval_s=0.05)
    """

    def __init__(self, client: Any, planner: PlannerLike, *, inflight: Any = None) -> None:
        self._client = client
        self._planner = planner
        self._inflight = inflight
        self._frame: pl.DataFrame | None = None
        self._settled = 0  # admitted + dropped groups when the frame was last pruned

    @property
    def planner(self) -> PlannerLike:
        """The planner this source feeds (its state counts the admitted and dropped groups)."""
        return self._planner

    @property
    def pending_rows(self) -> int:
        """Metadata rows kept: those of groups neither admitted nor dropped (yet)."""
        return 0 if self._frame is None else self._frame.height

    def poll(self, current_version: int) -> list[MiniBatchPlan]:
        """Scan new metadata once and return every mini-batch the planner admits now."""
        new = self._client.scan_new()
        if new.height:
            self._frame = new if self._frame is None else pl.concat([self._frame, new], how="vertical_relaxed")
        if self._frame is None or self._frame.height == 0:
            return []
        plans = self._planner.update(self._frame, inflight=self._inflight, current_version=current_version)
        self._prune()
        return plans

    def _prune(self) -> None:
        """Drop the rows of every group the planner admitted or dropped since the last prune."""
        state = self._planner.state
        settled = len(state.admitted) + len(state.dropped)
        if self._frame is None or settled == self._settled:
            return
        done = pl.Series(list(state.admitted | state.dropped), dtype=pl.String)
        self._frame = self._frame.filter(~pl.col("group_id").is_in(done.implode()))
        self._settled = settled

    def wait(self, current_version: int, *, idle_timeout_s: float, poll_interval_s: float) -> list[MiniBatchPlan]:
        """Poll until at least one mini-batch is admissible, or ``idle_timeout_s`` passes (then ``[]``)."""
        deadline = time.monotonic() + idle_timeout_s
        while True:
            plans = self.poll(current_version)
            if plans or time.monotonic() >= deadline:
                return plans
            time.sleep(poll_interval_s)


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
