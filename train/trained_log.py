"""Rank 0's append-only record of what the weights have seen: the groups each step trained, and the groups dropped.

One JSON line per event (``schemas.ledger.TrainedEvent``) in ``TrainConfig.trained_path``
(``events/trained.jsonl`` of a ``knit run``):

* ``TrainedStep``: the groups of an optimizer step (with their quota values) and rank 0's metrics of it, written
  as soon as the step is taken, before its checkpoint and before its groups are released, so every group a
  checkpoint (or a store's release) covers is named here first (and a step whose publish a kill cut short keeps
  its figures: its progress line is written only once published);
* ``Admitted``: the planner admitted the mini-batches of these steps (not yet taken);
* ``Dropped``: groups the planner dropped (never trained), with why, written before they are released;
* ``Checkpoint``: a checkpoint of the weights after ``step`` steps completed.

The launcher appends a ``Resume`` when it resumes the run from the checkpoint of step ``S``: step lines before it
with a step ``>= S`` are steps the restored weights never saw (``launcher.ledger`` reads the file that way).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from schemas.ledger import Admitted, Checkpoint, Dropped, TrainedEvent, TrainedStep
from schemas.run_folder import LineWriter
from schemas.run_records import StepMetrics


class TrainedLog:
    """Appends the trainer's events to ``path`` (rank 0).

    Example::

        log = TrainedLog("run/events/trained.jsonl", quota_columns=("data_source",))
        log.settled(consumed, dropped)      # after each planner update
        log.step(plan.step, version, plan.group_ids)
    """

    def __init__(self, path: str, *, quota_columns: Sequence[str] = ()) -> None:
        self._log = LineWriter(path)
        self._quota_columns = tuple(quota_columns)
        self._pending: dict[str, dict[str, Any]] = {}  # admitted group -> its quota values, until its step is taken

    def settled(self, consumed: pl.DataFrame, dropped: pl.DataFrame) -> None:
        """Take a planner update's admitted groups (their quota values) and log its dropped groups."""
        if consumed.height:
            cols = ["group_id", *[c for c in self._quota_columns if c in consumed.columns]]
            for row in consumed.select(cols).unique("group_id", maintain_order=True).iter_rows(named=True):
                gid = str(row.pop("group_id"))
                self._pending[gid] = {k: str(v) for k, v in row.items()}
            self._write(Admitted(steps=sorted(set(consumed["step"].to_list()))))
        if dropped.height:
            self._write(Dropped(groups=dict(zip(dropped["group_id"].to_list(), dropped["reason"].to_list(),
                                                strict=True))))

    def step(self, step: int, version: int, group_ids: Sequence[str], metrics: Mapping[str, Any]) -> None:
        """Log the groups optimizer step ``step`` trained (producing ``version``), with rank 0's metrics of it."""
        groups = {g: self._pending.pop(g, {}) for g in group_ids}
        self._write(TrainedStep(step=step, version=version, groups=groups,
                                metrics=StepMetrics.model_validate(dict(metrics)), t_end=time.time()))

    def checkpoint(self, step: int, seconds: float) -> None:
        """Log a completed checkpoint of the weights after ``step`` steps."""
        self._write(Checkpoint(step=step, seconds=round(seconds, 4)))

    def sync(self) -> None:
        """Make what was logged durable (before a checkpoint that covers it)."""
        self._log.sync()

    def _write(self, event: TrainedEvent) -> None:
        self._log.write(event)

    def close(self) -> None:
        self._log.close()

