"""The prompt ledger of a run folder: every prompt, every attempt at it, and whether the surviving weights trained it.

Built from the append-only event logs the processes write (``schemas.ledger``'s events, read through
``schemas.run_folder``): the rollout's (``events/rollout.jsonl``: each prompt drawn, each group dispatched), the
trainer's (``events/trained.jsonl``: the groups each step trained, the groups dropped, and the launcher's
``resume`` lines) and the stores' metadata (``metadata.parquet``: which groups came back, with which status).

Which trained steps survive: a ``resume`` line with step ``S`` means the weights were restored from the
checkpoint of step ``S``, so the step lines before it with a step ``>= S`` were taken by weights that are
gone; their groups are *rolled back* (released, never trained again) and their prompts dispatched again.
Every other step line counts. So "each prompt trained once" is checked against the weights that survive.

``ledger.parquet``: one row per prompt and attempt, ``schemas.run_frames.LEDGER_FRAME``. The check is one polars
query (:func:`exceptions`): each prompt has exactly one attempt with a ``trained_step``.

Example::

    ledger = build(Path("runs/x"))
    ledger.filter(pl.col("trained_step").is_not_null()).group_by("prompt_id").len()
    summary_line(ledger)       # 'ledger: 24 prompts, each trained once'
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import polars as pl
import pyarrow as pa

from schemas import run_folder
from schemas.ledger import (
    ROLLOUT_EVENT,
    TRAINED_EVENT,
    Checkpoint,
    Dispatch,
    Draw,
    Dropped,
    NodeLost,
    Resume,
    TrainedStep,
    Written,
)
from schemas.run_frames import LEDGER_FRAME, METADATA_FRAME
from schemas.run_summary import LedgerFigures

LEDGER_SCHEMA: pl.Schema = pl.from_arrow(LEDGER_FRAME.empty_table()).schema  # type: ignore[union-attr]
"""The ledger's columns as polars types (``schemas.run_frames.LEDGER_FRAME`` says what each holds)."""

EVENTS = run_folder.EVENTS
ROLLOUT_EVENTS = run_folder.ROLLOUT_EVENTS
TRAINED_EVENTS = run_folder.TRAINED_EVENTS


@dataclass(frozen=True, slots=True)
class Attempt:
    """A dispatch event with the life of the run that made it."""

    dispatch: Dispatch
    life: int
    """The start of the run that dispatched it (0 = the first)."""

    @property
    def prompt_id(self) -> str:
        return self.dispatch.prompt_id

    @property
    def group_id(self) -> str:
        return self.dispatch.group_id


@dataclass(slots=True)
class History:
    """What the event logs of a run folder say, read in order."""

    draws: dict[str, tuple[int, str]] = field(default_factory=dict)
    """prompt_id -> (its place in the stream, its first group id)."""
    dispatches: list[Attempt] = field(default_factory=list)
    """Each dispatch event, with the ``life`` that made it."""
    trained: dict[str, int] = field(default_factory=dict)
    """group_id -> the surviving step that trained it."""
    quotas: dict[str, dict[str, str]] = field(default_factory=dict)
    """group_id -> its quota values (trained groups)."""
    rolled_back: set[str] = field(default_factory=set)
    """Groups trained by steps a resume rolled back."""
    dropped: dict[str, str] = field(default_factory=dict)
    """group_id -> why the planner dropped it."""
    steps: dict[int, TrainedStep] = field(default_factory=dict)
    """step -> its surviving step event (rank 0's ``metrics``, ``t_end``, ``version``)."""
    checkpoints: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds) of each checkpoint written."""
    lives: int = 1
    """Starts of the run so far."""
    written: dict[str, str] = field(default_factory=dict)
    """group_id -> the location of the store node that took it."""
    lost: set[str] = field(default_factory=set)
    """Locations of the store nodes lost for good (their groups not trained are regenerated)."""

    @property
    def drawn(self) -> int:
        """Prompts drawn from the stream."""
        return 1 + max((i for i, _ in self.draws.values()), default=-1)


def read_history(out: Path) -> History:
    """Read the event logs of the run folder ``out``.

    Raises:
        schemas.run_folder.RunFolderError: a line of a log is damaged or lacks a field.
    """
    h = History()
    life = 0
    for e in run_folder.read_lines(ROLLOUT_EVENT, out / EVENTS / ROLLOUT_EVENTS):
        if isinstance(e, Resume):
            life = e.life
        elif isinstance(e, Draw):
            h.draws.setdefault(e.prompt_id, (e.index, e.group_id))
        elif isinstance(e, Dispatch):
            h.dispatches.append(Attempt(e, life))
        elif isinstance(e, Written):
            h.written[e.group_id] = e.node
        elif isinstance(e, NodeLost):
            h.lost.add(e.location)
    for t in run_folder.read_lines(TRAINED_EVENT, out / EVENTS / TRAINED_EVENTS):
        if isinstance(t, TrainedStep):
            h.steps[t.step] = t
            for gid, quotas in t.groups.items():
                h.trained[gid] = t.step
                h.quotas[gid] = quotas
        elif isinstance(t, Dropped):
            h.dropped.update(t.groups)
        elif isinstance(t, Checkpoint):
            h.checkpoints.append((t.step, t.seconds))
        elif isinstance(t, Resume):
            h.lives = t.life + 1
            gone = [g for g, s in h.trained.items() if s >= t.step]
            h.rolled_back.update(gone)
            for g in gone:
                del h.trained[g]
            h.steps = {s: ev for s, ev in h.steps.items() if s < t.step}
    return h


def _why_not(gid: str, h: History, status: dict[str, bool]) -> str:
    if gid in h.rolled_back:
        return "rolled_back"
    if gid in h.dropped:
        return h.dropped[gid]
    if gid not in status:
        return unstored(gid, h)
    return "not_trained" if status[gid] else "aborted"


def unstored(gid: str, h: History, unwritten: str = "interrupted") -> str:
    """Why no store holds the group ``gid``: ``node_lost`` (written to a node lost for good), else ``unwritten``
    (never written: in the engine or queued when its rollout stopped)."""
    return "node_lost" if h.written.get(gid) in h.lost else unwritten


def build(out: Path, metadata: pl.DataFrame | None = None) -> pl.DataFrame:
    """The ledger of the run folder ``out`` (``metadata``: the stores' metadata, else ``metadata.parquet``)."""
    h = read_history(out)
    if metadata is None:
        path = out / run_folder.METADATA
        metadata = (_frame(run_folder.read_frame(path, METADATA_FRAME, required=("group_id", "status")))
                    if path.exists() else pl.DataFrame(schema={"group_id": pl.String, "status": pl.String}))
    status = group_status(metadata)
    rows = [{"prompt_id": a.prompt_id, "attempt": a.dispatch.attempt, "group_id": a.group_id,
             "dispatched_version": a.dispatch.version, "completed": status.get(a.group_id, False),
             "trained_step": h.trained.get(a.group_id),
             "dropped_reason": None if a.group_id in h.trained else _why_not(a.group_id, h, status),
             "life": a.life, "dispatch_reason": a.dispatch.reason} for a in h.dispatches]
    dispatched = {a.prompt_id for a in h.dispatches}
    rows += [{"prompt_id": pid, "attempt": None, "group_id": gid, "dispatched_version": None, "completed": False,
              "trained_step": None, "dropped_reason": "never_dispatched", "life": None,
              "dispatch_reason": None}
             for pid, (_, gid) in h.draws.items() if pid not in dispatched]
    return pl.DataFrame(rows, schema=LEDGER_SCHEMA).sort(["prompt_id", "attempt"], nulls_last=True)


def _frame(table: pa.Table) -> pl.DataFrame:
    return cast(pl.DataFrame, pl.from_arrow(table))  # a table makes a frame (a series comes from an array)


def group_status(metadata: pl.DataFrame) -> dict[str, bool]:
    """group_id -> whether every stored sample of it completed."""
    if metadata.height == 0:
        return {}
    per = metadata.group_by("group_id").agg((pl.col("status") == "completed").all().alias("ok"))
    return dict(per.select("group_id", "ok").iter_rows())


def exceptions(ledger: pl.DataFrame) -> pl.DataFrame:
    """The prompts not trained exactly once: ``prompt_id``, ``trained`` (times), ``reasons`` (of the attempts
    not trained). Empty when the ledger is exact."""
    return (ledger.group_by("prompt_id")
            .agg(pl.col("trained_step").is_not_null().sum().alias("trained"),
                 pl.col("dropped_reason").drop_nulls().alias("reasons"))
            .filter(pl.col("trained") != 1).sort("prompt_id"))


def summary_line(ledger: pl.DataFrame) -> str:
    """One line: ``ledger: N prompts, each trained once``, or the exceptions by name."""
    n = ledger.get_column("prompt_id").n_unique()
    bad = exceptions(ledger)
    if bad.height == 0:
        return f"ledger: {n} prompts, each trained once"
    twice = bad.filter(pl.col("trained") > 1).get_column("prompt_id").to_list()
    never = bad.filter(pl.col("trained") == 0)
    why = Counter(r[-1] if r else "unknown" for r in never.get_column("reasons").to_list())
    parts = [f"ledger: {n} prompts, {n - bad.height} trained once"]
    if never.height:
        parts.append(f"never trained {never.height} ({', '.join(f'{k}: {v}' for k, v in sorted(why.items()))}): "
                     + ", ".join(never.get_column("prompt_id").head(10).to_list())
                     + (" ..." if never.height > 10 else ""))
    if twice:
        parts.append(f"trained more than once {len(twice)}: " + ", ".join(twice[:10]) + (" ..." if len(twice) > 10
                                                                                         else ""))
    return "; ".join(parts)


def figures(ledger: pl.DataFrame) -> LedgerFigures:
    """The ledger's counts for the run summary."""
    bad = exceptions(ledger)
    again = ledger.filter(pl.col("attempt") > 0).get_column("dispatch_reason").fill_null("unknown").to_list()
    return LedgerFigures(prompts=ledger.get_column("prompt_id").n_unique(), attempts=ledger.height,
                         exact=bad.height == 0, exceptions=bad.get_column("prompt_id").to_list(),
                         attempts_again_by_reason=dict(Counter(again)), summary=summary_line(ledger))
