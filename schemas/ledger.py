"""The prompt ledger's contracts: the resume documents the launcher hands a resumed run's processes, and the
reading of the append-only event logs the processes write.

Event logs are JSON lines, appended and flushed one event at a time, so a kill loses at most the line being
written (:func:`read_events` leaves a line cut short out):

* the rollout's (``events/rollout.jsonl``): ``{"kind": "draw", "index", "prompt_id", "group_id"}`` when a prompt
  is drawn from the stream, ``{"kind": "dispatch", "index", "prompt_id", "attempt", "group_id", "version",
  "reason"}`` when a group of it goes to the engine (each attempt: a re-dispatch after an abort, a lost node,
  or a resume, with its reason), ``{"kind": "written", "group_id", "node"}`` when a store node (its location)
  took the group;
* the trainer's (``events/trained.jsonl``, ``train.trained_log``): the groups each step trained, the groups the
  planner dropped, the checkpoints written.

Both get ``{"kind": "resume", "life": n, "step": S}`` from the launcher when it resumes the run from the
checkpoint of step ``S`` (life 0 is the first start). The rollout's gets ``{"kind": "node_lost", "node",
"location"}`` from the launcher when it gives a store node up for good: the groups written there and not trained
are regenerated (``launcher.resume``).

Example:
    >>> doc = RolloutResume(life=1, drawn=12, reissue=[Reissue(index=3, prompt_id="mini_batch-3", attempt=1,
    ...                                                           reason="interrupted")])
    >>> RolloutResume.model_validate_json(doc.model_dump_json()).reissue[0].reason
    'interrupted'
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Reissue(BaseModel):
    """A prompt a resumed rollout dispatches again, before drawing new ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    """Its place in the prompt stream (0 = the first prompt drawn)."""
    prompt_id: str
    """The prompt's id (its first group id)."""
    attempt: int = Field(ge=0)
    """The attempt this dispatch is (the number of times the prompt went to an engine before)."""
    reason: str
    """Why it goes out again: ``interrupted`` (in flight or queued when the run stopped), ``aborted`` (written
    aborted when the rollout stopped), ``rolled_back`` (trained by a step the restored checkpoint lacks),
    ``node_lost`` (written to a store node lost for good, not trained), ``rollout_lost`` (in the engine of a
    rollout process that died)."""


class RolloutResume(BaseModel):
    """What a resumed rollout worker takes up (``RolloutConfig.resume_path``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    life: int = Field(ge=1)
    """Which start of the run this is (1 = the first resume)."""
    drawn: int = Field(ge=0)
    """Prompts drawn from the stream by the lives before: the stream goes on after them."""
    reissue: list[Reissue] = Field(default_factory=list)
    """Prompts dispatched again first, in stream order."""


class TrainerResume(BaseModel):
    """What a resumed trainer takes up (``TrainConfig.resume_path``) beside its checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    life: int = Field(ge=1)
    """Which start of the run this is."""
    step: int = Field(ge=0)
    """Optimizer steps the checkpoint holds (the version of its weights)."""
    planner: dict[str, Any]
    """The planner's state at that step (``admission.PlannerState.to_dict``)."""


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of a JSON-lines event log, in order; a last line cut short by a kill is left out."""
    p = Path(path)
    if not p.exists():
        return
    with p.open() as f:
        for line in f:
            if not line.endswith("\n"):
                return
            yield json.loads(line)


def append_event(path: str | Path, event: dict[str, Any]) -> None:
    """Append one event line (the launcher's ``resume`` events)."""
    with Path(path).open("a") as f:
        f.write(json.dumps(event) + "\n")
