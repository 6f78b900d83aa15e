"""The prompt ledger of a run folder: every prompt, every attempt at it, and whether the surviving weights trained it.

Built from the append-only event logs the processes write (``schemas.ledger``): the rollout's
(``events/rollout.jsonl``: each prompt drawn, each group dispatched), the trainer's (``events/trained.jsonl``:
the groups each step trained, the groups dropped, and the launcher's ``resume`` lines) and the stores'
metadata (``metadata.parquet``: which groups came back, with which status).

Which trained steps survive: a ``resume`` line with step ``S`` means the weights were restored from the
checkpoint of step ``S``, so the step lines before it with a step ``>= S`` were taken by weights that are
gone; their groups are *rolled back* (released, never trained again) and their prompts dispatched again.
Every other step line counts. So "each prompt trained once" is checked against the weights that survive.

``ledger.parquet``: one row per prompt and attempt, :data:`LEDGER_SCHEMA`. The check is one polars query
(:func:`exceptions`): each prompt has exactly one attempt with a ``trained_step``.

Example::

    ledger = build(Path("runs/x"))
    ledger.filter(pl.col("trained_step").is_not_null()).group_by("prompt_id").len()
    summary_line(ledger)       # 'ledger: 24 prompts, each trained once'
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from schemas.ledger import read_events

LEDGER_SCHEMA: dict[str, Any] = {
    "prompt_id": pl.String, "attempt": pl.Int64, "group_id": pl.String, "dispatched_version": pl.Int64,
    "completed": pl.Boolean, "trained_step": pl.Int64, "dropped_reason": pl.String, "life": pl.Int64,
    "dispatch_reason": pl.String,
}
"""The ledger's columns: the prompt, its attempt (0 = the first dispatch), the group that attempt wrote, the policy
version it was dispatched under, whether the stores hold it with every sample completed, the surviving step that
trained it (null: none) and, when none did, why (``rolled_back``, a planner drop reason such as ``aborted``,
``interrupted`` for a group the run stopped before it was written, ``node_lost`` for one written to a store node
lost for good); ``life``: the start of the run that
dispatched it (0 = the first); ``dispatch_reason``: why an attempt after the first went out (``aborted``,
``interrupted``, ``rolled_back``, ``node_lost``, ``rollout_lost``, ...)."""

EVENTS = "events"
"""The run folder's sub-folder of event logs."""
ROLLOUT_EVENTS = "rollout.jsonl"
TRAINED_EVENTS = "trained.jsonl"


@dataclass(slots=True)
class History:
    """What the event logs of a run folder say, read in order."""

    draws: dict[str, tuple[int, str]] = field(default_factory=dict)
    """prompt_id -> (its place in the stream, its first group id)."""
    dispatches: list[dict[str, Any]] = field(default_factory=list)
    """Each dispatch event, with the ``life`` that made it."""
    trained: dict[str, int] = field(default_factory=dict)
    """group_id -> the surviving step that trained it."""
    quotas: dict[str, dict[str, str]] = field(default_factory=dict)
    """group_id -> its quota values (trained groups)."""
    rolled_back: set[str] = field(default_factory=set)
    """Groups trained by steps a resume rolled back."""
    dropped: dict[str, str] = field(default_factory=dict)
    """group_id -> why the planner dropped it."""
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
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
    """Read the event logs of the run folder ``out``."""
    h = History()
    life = 0
    for e in read_events(out / EVENTS / ROLLOUT_EVENTS):
        if e["kind"] == "resume":
            life = int(e["life"])
        elif e["kind"] == "draw":
            h.draws.setdefault(e["prompt_id"], (int(e["index"]), e["group_id"]))
        elif e["kind"] == "dispatch":
            h.dispatches.append(e | {"life": life})
        elif e["kind"] == "written":
            h.written[e["group_id"]] = e["node"]
        elif e["kind"] == "node_lost":
            h.lost.add(e["location"])
    for e in read_events(out / EVENTS / TRAINED_EVENTS):
        if e["kind"] == "step":
            h.steps[int(e["step"])] = e
            for gid, quotas in e["groups"].items():
                h.trained[gid] = int(e["step"])
                h.quotas[gid] = quotas
        elif e["kind"] == "dropped":
            h.dropped.update(e["groups"])
        elif e["kind"] == "checkpoint":
            h.checkpoints.append((int(e["step"]), float(e["seconds"])))
        elif e["kind"] == "resume":
            h.lives = int(e["life"]) + 1
            gone = [g for g, s in h.trained.items() if s >= int(e["step"])]
            h.rolled_back.update(gone)
            for g in gone:
                del h.trained[g]
            h.steps = {s: ev for s, ev in h.steps.items() if s < int(e["step"])}
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
        path = out / "metadata.parquet"
        metadata = pl.read_parquet(path) if path.exists() else pl.DataFrame(schema={"group_id": pl.String,
                                                                                      "status": pl.String})
    status = group_status(metadata)
    rows = [{"prompt_id": d["prompt_id"], "attempt": int(d["attempt"]), "group_id": d["group_id"],
             "dispatched_version": int(d["version"]), "completed": status.get(d["group_id"], False),
             "trained_step": h.trained.get(d["group_id"]),
             "dropped_reason": None if d["group_id"] in h.trained else _why_not(d["group_id"], h, status),
             "life": int(d["life"]), "dispatch_reason": d.get("reason")} for d in h.dispatches]
    dispatched = {d["prompt_id"] for d in h.dispatches}
    rows += [{"prompt_id": pid, "attempt": None, "group_id": gid, "dispatched_version": None, "completed": False,
              "trained_step": None, "dropped_reason": "never_dispatched", "life": None,
              "dispatch_reason": None}
             for pid, (_, gid) in h.draws.items() if pid not in dispatched]
    return pl.DataFrame(rows, schema=LEDGER_SCHEMA).sort(["prompt_id", "attempt"], nulls_last=True)


def group_status(metadata: pl.DataFrame) -> dict[str, bool]:
    """group_id -> whether every stored sample of it completed."""
    if metadata.height == 0:
        return {}
    per = metadata.group_by("group_id").agg((pl.col("status") == "completed").all().alias("ok"))
    return dict(zip(per["group_id"].to_list(), per["ok"].to_list(), strict=True))


def exceptions(ledger: pl.DataFrame) -> pl.DataFrame:
    """The prompts not trained exactly once: ``prompt_id``, ``trained`` (times), ``reasons`` (of the attempts
    not trained). Empty when the ledger is exact."""
    return (ledger.group_by("prompt_id")
            .agg(pl.col("trained_step").is_not_null().sum().alias("trained"),
                 pl.col("dropped_reason").drop_nulls().alias("reasons"))
            .filter(pl.col("trained") != 1).sort("prompt_id"))


def summary_line(ledger: pl.DataFrame) -> str:
    """One line: ``ledger: N prompts, each trained once``, or the exceptions by name."""
    n = ledger["prompt_id"].n_unique()
    bad = exceptions(ledger)
    if bad.height == 0:
        return f"ledger: {n} prompts, each trained once"
    twice = bad.filter(pl.col("trained") > 1)["prompt_id"].to_list()
    never = bad.filter(pl.col("trained") == 0)
    why = Counter(r[-1] if r else "unknown" for r in never["reasons"].to_list())
    parts = [f"ledger: {n} prompts, {n - bad.height} trained once"]
    if never.height:
        parts.append(f"never trained {never.height} ({', '.join(f'{k}: {v}' for k, v in sorted(why.items()))}): "
                     + ", ".join(never["prompt_id"].head(10).to_list()) + (" ..." if never.height > 10 else ""))
    if twice:
        parts.append(f"trained more than once {len(twice)}: " + ", ".join(twice[:10]) + (" ..." if len(twice) > 10
                                                                                         else ""))
    return "; ".join(parts)


def figures(ledger: pl.DataFrame) -> dict[str, Any]:
    """The ledger's counts for the run summary."""
    bad = exceptions(ledger)
    again = ledger.filter(pl.col("attempt") > 0)["dispatch_reason"].fill_null("unknown").to_list()
    return {"prompts": ledger["prompt_id"].n_unique(), "attempts": ledger.height,
            "exact": bad.height == 0, "exceptions": bad["prompt_id"].to_list(),
            "attempts_again_by_reason": dict(Counter(again)), "summary": summary_line(ledger)}
