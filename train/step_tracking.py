"""What rank 0 sends the trackers at each optimizer step (``train.tracking``), under the names ``summary.json`` uses.

:class:`StepTracker` takes the planner's consumed rows as they are admitted (:meth:`StepTracker.observe`) and each
step's record once it is published (:meth:`StepTracker.log`, the step's line in the rank report); a thread of its
own reads the stores' counters and logs the step, so neither a slow tracker nor a slow store holds up training.

The figures of a step (``summary.json``'s name where it has one; ``a/b`` is its key ``b`` under ``a``):

* ``reward_mean``, ``reward_std``, and per data source ``reward_mean_by_source/<source>`` and
  ``reward_std_by_source/<source>`` (no name is both a figure and the prefix of others: MLflow's file store
  keeps each figure in a file under its name);
* staleness of the step's trajectories (``admission.staleness``): ``arch_staleness_mean``,
  ``arch_staleness_max``, ``arch_staleness_token_weighted``, ``generation_span_mean``, ``total_staleness_mean``,
  ``signed_staleness_mean``; the token staleness ``offpolicy/token_staleness_mean`` and ``_max``;
* ``throughput/trajectories_per_s`` and ``throughput/tokens_per_s`` of the training window so far,
  ``trajectories_consumed`` so far;
* ``trainer_idle_s`` (the wait for this step's plan; none for this process's first step, which waits for
  start-up) and ``exposed_wait_s/0`` (rank 0's step loop blocked on data);
* the step's time split ``step_s/step``, ``step_s/compute`` (the step less its exposed wait),
  ``step_s/publish_blocking``, ``step_s/published_after``; ``transfer_latency_ms/mean`` (fetch per micro-batch);
* the off-policy figures ``offpolicy/<key>`` (``schemas.run_records.OFFPOLICY_KEYS``);
* ``planner_s``: seconds the planner spent planning since the step before;
* per store node ``store/<node>/memory_used``, ``memory_rss``, ``bytes`` (payload held), and its put and fetch
  rates since the step before, ``bytes_in_per_s``, ``bytes_out_per_s``, ``rows_stored_per_s``;
* the step's own ``loss``, ``grad_norm``, ``abs_logp_diff``, ``rows``, ``version`` and ``admitted_groups``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import polars as pl

from schemas.run_records import OFFPOLICY_KEYS
from train.tracking import Tracking

if TYPE_CHECKING:
    from schemas.replies import NodeStats
    from train.config import TrainConfig
    from train.planning import PlanSource

log = logging.getLogger(__name__)

STEP_KEYS: tuple[str, ...] = ("loss", "grad_norm", "abs_logp_diff", "rows", "version")
"""Figures of the step record logged under their own names."""
STORE_LEVELS: tuple[str, ...] = ("memory_used", "memory_rss", "bytes")
"""``NodeStats`` fields logged per node as they are."""
STORE_RATES: tuple[str, ...] = ("bytes_in", "bytes_out", "rows_stored")
"""``NodeStats`` counters logged per node as their rate since the step before (``<name>_per_s``)."""


def rows_figures(consumed: pl.DataFrame) -> dict[str, float]:
    """Reward (overall and per ``data_source``) and staleness figures of one step's consumed rows."""
    from admission.staleness import summary

    if consumed.height == 0:
        return {}
    stal = summary(consumed)
    out: dict[str, float] = {
        "arch_staleness_mean": stal.arch_mean, "arch_staleness_max": stal.arch_max,
        "arch_staleness_token_weighted": stal.arch_token_weighted, "generation_span_mean": stal.span_mean,
        "total_staleness_mean": stal.total_mean, "signed_staleness_mean": stal.signed_mean,
        **consumed.select(pl.col("reward").mean().alias("reward_mean"),
                          pl.col("reward").std().fill_null(0.0).alias("reward_std")).row(0, named=True)}
    if "data_source" in consumed.columns:
        per = consumed.group_by("data_source").agg(pl.col("reward").mean().alias("mean"),
                                                   pl.col("reward").std().fill_null(0.0).alias("std"))
        for source, mean, std in per.iter_rows():
            out[f"reward_mean_by_source/{source}"] = float(mean)
            out[f"reward_std_by_source/{source}"] = float(std)
    return out


def _total(value: Any) -> float:
    """A per-micro-batch list's sum, or a single number."""
    return float(sum(value)) if isinstance(value, list | tuple) else float(value or 0.0)


class StepTracker:
    """Rank 0's figures of each step, sent to ``tracking`` by a thread of its own (see the module).

    ``stats``: the stores' counters (``StoreReader.stats``, on a client of its own: this thread calls it);
    ``planner_s``: seconds the planner spent so far (``PlanSource.planner_s``); ``admitted``: groups admitted so
    far. :meth:`close` logs the steps still queued, then closes the trackers.
    """

    def __init__(self, tracking: Tracking, *, stats: Callable[[], Mapping[str, NodeStats]] | None = None,
                 planner_s: Callable[[], float] | None = None, admitted: Callable[[], int] | None = None) -> None:
        self.tracking = tracking
        self._stats = stats
        self._planner_s = planner_s
        self._admitted = admitted
        self._lock = threading.Lock()
        self._rows: dict[int, pl.DataFrame] = {}  # consumed rows of the steps planned, not yet logged
        self._queue: queue.Queue[tuple[dict[str, Any], float, int] | None] = queue.Queue()
        self._counters: dict[str, tuple[float, dict[str, float]]] = {}  # node -> (time, counters) at the last step
        self._planned = 0.0
        self._window_start: float | None = None
        self._trajectories = 0
        self._tokens = 0
        self._first = True
        self.on_close: Callable[[], None] | None = None
        """Called once the trackers are closed (to close what feeds ``stats``)."""
        self._thread = threading.Thread(target=self._run, name="knit-tracking", daemon=True)
        self._thread.start()

    def observe(self, consumed: pl.DataFrame) -> None:
        """Keep an update's consumed rows (``admission.PlanResult.consumed``) until their step is logged."""
        if consumed.height == 0 or "step" not in consumed.columns:
            return
        with self._lock:
            for (step,), rows in consumed.partition_by("step", as_dict=True).items():
                step = int(step)  # type: ignore[arg-type]
                self._rows[step] = pl.concat([self._rows[step], rows]) if step in self._rows else rows

    def log(self, record: Mapping[str, Any]) -> None:
        """Queue a published step's record (its line in the rank report: metrics, ``version``, ``plan_wait_s``,
        ``t_end``, the publishing times) for the tracking thread."""
        admitted = self._admitted() if self._admitted is not None else -1
        self._queue.put((dict(record), self._planner_s() if self._planner_s is not None else 0.0, admitted))

    def close(self) -> None:
        """Log what is queued, stop the thread, close the trackers (safe to call twice)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.tracking.close()
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()

    def __enter__(self) -> StepTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        self._store_figures()  # the counters the first step's rates start from
        while (item := self._queue.get()) is not None:
            record, planner_s, admitted = item
            try:
                data = self.figures(record, planner_s, admitted)
            except Exception as exc:  # a figure that cannot be made is left out, never the run
                log.warning("the figures of step %s could not be made: %s", record.get("step"), exc)
                continue
            self.tracking.log(data, int(record["step"]))

    def figures(self, record: Mapping[str, Any], planner_s: float, admitted: int = -1) -> dict[str, float]:
        """Every figure of one step (see the module); the step's consumed rows are forgotten."""
        step = int(record["step"])
        with self._lock:
            rows = self._rows.pop(step, None)
        out: dict[str, float] = {k: record[k] for k in STEP_KEYS if record.get(k) is not None}
        if admitted >= 0:
            out["admitted_groups"] = admitted
        if rows is not None:
            out |= rows_figures(rows)
        out |= self._time_figures(record, rows)
        out |= {f"offpolicy/{k}": record[k] for k in OFFPOLICY_KEYS if record.get(k) is not None}
        out["planner_s"], self._planned = planner_s - self._planned, planner_s
        out |= self._store_figures()
        return out

    def _time_figures(self, record: Mapping[str, Any], rows: pl.DataFrame | None) -> dict[str, float]:
        step_s = float(record.get("step_time_s") or 0.0)
        wait = _total(record.get("exposed_wait_s"))
        fetch = record.get("fetch_s") or []
        fetch = fetch if isinstance(fetch, list | tuple) else [fetch]
        out = {"step_s/step": step_s, "step_s/compute": max(0.0, step_s - wait), "exposed_wait_s/0": wait}
        for name, key in (("publish_blocking", "publish_s"), ("published_after", "publish_done_s")):
            if record.get(key) is not None:
                out[f"step_s/{name}"] = float(record[key])
        if fetch:
            out["transfer_latency_ms/mean"] = 1e3 * sum(fetch) / len(fetch)
        if not self._first:  # the first step's wait is the start-up (summary.json leaves it out too)
            out["trainer_idle_s"] = float(record.get("plan_wait_s") or 0.0)
        self._first = False
        t_end = float(record.get("t_end") or time.time())
        if self._window_start is None:
            self._window_start = t_end - step_s
        if rows is not None:
            self._trajectories += rows.height
            self._tokens += int(rows["response_len"].sum()) if "response_len" in rows.columns else 0
        window = t_end - self._window_start
        out["trajectories_consumed"] = self._trajectories
        if window > 0:
            out["throughput/trajectories_per_s"] = self._trajectories / window
            out["throughput/tokens_per_s"] = self._tokens / window
        return out

    def _store_figures(self) -> dict[str, float]:
        if self._stats is None:
            return {}
        try:
            stats = self._stats()
        except Exception as exc:  # a store restarting: its figures are missing from this step
            log.debug("store stats for tracking failed: %s", exc)
            return {}
        now = time.monotonic()
        out: dict[str, float] = {}
        for key, s in stats.items():
            node = s.node or key
            for key in STORE_LEVELS:
                value = getattr(s, key, None)
                if value is not None:
                    out[f"store/{node}/{key}"] = value
            counters = {key: float(getattr(s, key)) for key in STORE_RATES}
            before = self._counters.get(node)
            if before is not None and now > before[0]:
                for key, value in counters.items():
                    out[f"store/{node}/{key}_per_s"] = max(0.0, value - before[1][key]) / (now - before[0])
            self._counters[node] = (now, counters)
        return out


def start_tracker(cfg: TrainConfig, source: PlanSource) -> StepTracker:
    """Rank 0's tracker of a trainer run: the trackers of ``cfg.tracking`` writing in its ``tracking_dir``, else
    the folder of ``progress_path``, else ``tracking``; the stores' counters read on a client of its own (no
    retries, 5 s: a store that does not answer leaves its figures out of that step); ``source``'s consumed rows
    observed (after its ``on_settled`` callback)."""
    from flight_store.reading import StoreReader
    from schemas import documents

    folder = cfg.tracking.tracking_dir or (os.path.dirname(os.path.abspath(cfg.progress_path)) if cfg.progress_path
                                           else "tracking")
    tracking = Tracking(cfg.tracking, folder=folder, params=json.loads(documents.dump(cfg)))
    log.info("tracking each step to %s (run %s in %s)", ", ".join(tracking.active) or "no tracker", tracking.name,
             tracking.folder)
    reader = StoreReader.from_config(cfg.stores, dataclasses.replace(cfg.client, retries=0, timeout_s=5.0))
    tracker = StepTracker(tracking, stats=lambda: reader.stats(partial=True), planner_s=lambda: source.planner_s,
                          admitted=lambda: source.admitted_groups)
    tracker.on_close = reader.close
    settled = source.on_settled

    def observe(consumed: pl.DataFrame, dropped: pl.DataFrame) -> None:
        if settled is not None:
            settled(consumed, dropped)
        tracker.observe(consumed)

    source.on_settled = observe
    return tracker
