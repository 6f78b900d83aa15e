"""Rank 0 hosts the planner; plans reach every rank over ``torch.distributed``.

``PlanSource`` (rank 0 only) scans new metadata rows from every store (``StoreClient.scan_new``,
metadata columns only, never payload), keeps the rows of groups not yet admitted, and asks the
planner for every mini-batch admissible now. ``exchange_plans`` is the one collective: rank 0
broadcasts the new plans (as JSON) and a stop flag; the other ranks receive them.

The planner is anything with ``update(frame, *, inflight=..., current_version=...) ->
list[MiniBatchPlan]``; ``load_planner("module:factory", options, dp_ranks)`` builds it
(``admission_planner`` is the default factory: ``admission.Planner(AdmissionConfig(...))``).
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any, Protocol

import polars as pl

from schemas.plan import MiniBatchPlan

log = logging.getLogger(__name__)


class PlannerLike(Protocol):
    """What the trainer needs from a planner."""

    def update(self, metadata: pl.DataFrame, *, inflight: Any = None,
               current_version: int = 0) -> list[MiniBatchPlan]: ...


def admission_planner(options: dict[str, Any], dp_ranks: int) -> PlannerLike:
    """The default planner: ``admission.Planner`` with ``AdmissionConfig(**options, dp_ranks=dp_ranks)``."""
    from admission import AdmissionConfig, Planner, Quota

    opts = dict(options)
    opts.pop("dp_ranks", None)
    if "quotas" in opts:  # from JSON: [{"column": ..., "counts"/"shares": {...}}, ...]
        opts["quotas"] = tuple(q if isinstance(q, Quota) else Quota(**q) for q in opts["quotas"])
    return Planner(AdmissionConfig(**opts, dp_ranks=dp_ranks))


def load_planner(spec: str, options: dict[str, Any], dp_ranks: int) -> PlannerLike:
    """Build a planner from ``"module:factory"``; the factory is called as ``factory(options, dp_ranks)``."""
    module_name, _, attr = spec.partition(":")
    if spec == "admission:Planner":
        return admission_planner(options, dp_ranks)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot load planner factory {spec!r}: {exc}"
        raise ImportError(msg) from exc
    return factory(options, dp_ranks)  # type: ignore[no-any-return]


class PlanSource:
    """Rank 0's view of the stores: metadata in, plans out.

    Example::

        planner = load_planner("admission:Planner", {"train_batch_groups": 8, "group_size": 4}, dp_ranks=2)
        source = PlanSource(StoreClient(locations), planner)
        plans = source.wait(current_version=0, idle_timeout_s=60, poll_interval_s=0.05)
    """

    def __init__(self, client: Any, planner: PlannerLike, *, inflight: Any = None) -> None:
        self._client = client
        self._planner = planner
        self._inflight = inflight
        self._frame: pl.DataFrame | None = None
        self.admitted_groups = 0

    def poll(self, current_version: int) -> list[MiniBatchPlan]:
        """Scan new metadata once and return every mini-batch the planner admits now."""
        new = self._client.scan_new()
        if new.height:
            self._frame = new if self._frame is None else pl.concat([self._frame, new], how="vertical_relaxed")
        if self._frame is None or self._frame.height == 0:
            return []
        plans = self._planner.update(self._frame, inflight=self._inflight, current_version=current_version)
        if plans:
            done = [g for p in plans for g in p.group_ids]
            self.admitted_groups += len(done)
            self._frame = self._frame.filter(~pl.col("group_id").is_in(done))
        return plans

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
