"""The prompt ledger's contracts: the events of the append-only event logs the processes write, and the resume
documents the launcher hands a resumed run's processes.

Event logs are JSON lines (``schemas.run_folder``: appended and flushed one event at a time, so a kill loses at
most the line being written), each event a model with its ``kind``:

* the rollout's (``events/rollout.jsonl``, :data:`RolloutEvent`): :class:`Draw` when a prompt is drawn from the
  stream, :class:`Dispatch` when a group of it goes to the engine (each attempt: a re-dispatch after an abort, a
  lost node, or a resume, with its reason), :class:`Written` when a store node (its location) took the group;
* the trainer's (``events/trained.jsonl``, :data:`TrainedEvent`, ``train.trained_log``): :class:`TrainedStep`
  (the groups each step trained), :class:`Admitted`, :class:`Dropped` (the groups the planner dropped),
  :class:`Checkpoint` (the checkpoints written).

Both get a :class:`Resume` from the launcher when it resumes the run from the checkpoint of step ``S`` (life 0 is
the first start). The rollout's gets :class:`NodeLost` from the launcher when it gives a store node up for good: the
groups written there and not trained are regenerated (``launcher.resume``). ``resumes.jsonl`` holds a
:class:`ResumeRecord` per resume.

Example:
    >>> doc = RolloutResume(life=1, drawn=12, reissue=[Reissue(index=3, prompt_id="mini_batch-3", attempt=1,
    ...                                                           reason="interrupted")])
    >>> RolloutResume.model_validate_json(doc.model_dump_json()).reissue[0].reason
    'interrupted'
    >>> ROLLOUT_EVENT.validate_json('{"kind": "written", "group_id": "g1", "node": "grpc://n0"}').node
    'grpc://n0'
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.run_records import StepMetrics


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


# ---- the event logs ------------------------------------------------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Draw(_Event):
    """A prompt drawn from the stream (rollout)."""

    kind: Literal["draw"] = "draw"
    index: int = Field(ge=0)
    """Its place in the prompt stream."""
    prompt_id: str
    group_id: str
    """Its first group id."""


class Dispatch(_Event):
    """A group of a prompt sent to the engine (rollout), written before the engine gets it."""

    kind: Literal["dispatch"] = "dispatch"
    index: int = Field(ge=0)
    prompt_id: str
    attempt: int = Field(ge=0)
    """0 = the prompt's first dispatch."""
    group_id: str
    version: int
    """The policy version it was dispatched under."""
    reason: str | None = None
    """Why an attempt after the first went out (``Reissue.reason``, or ``aborted``); None for the first."""


class Written(_Event):
    """A store node took a group (rollout)."""

    kind: Literal["written"] = "written"
    group_id: str
    node: str
    """The node's location."""


class NodeLost(_Event):
    """A store node given up for good (launcher)."""

    kind: Literal["node_lost"] = "node_lost"
    node: str
    """The node's name."""
    location: str
    at: float | None = None
    """Unix time it was given up."""


class Resume(_Event):
    """The run taken up again from the checkpoint of ``step`` (launcher, in both logs)."""

    kind: Literal["resume"] = "resume"
    life: int = Field(ge=1)
    step: int = Field(ge=0)


class TrainedStep(_Event):
    """An optimizer step taken (trainer rank 0), written before its checkpoint and before its groups are released."""

    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    version: int
    """The policy version it produced."""
    groups: dict[str, dict[str, str]]
    """group_id -> its quota values."""
    metrics: StepMetrics
    """Rank 0's metrics of the step."""
    t_end: float
    """Unix time it was logged."""


class Admitted(_Event):
    """The planner admitted the mini-batches of these steps (not yet taken)."""

    kind: Literal["admitted"] = "admitted"
    steps: list[int]


class Dropped(_Event):
    """Groups the planner dropped (never trained), written before they are released."""

    kind: Literal["dropped"] = "dropped"
    groups: dict[str, str]
    """group_id -> why."""


class Checkpoint(_Event):
    """A checkpoint of the weights after ``step`` steps, written in ``seconds``."""

    kind: Literal["checkpoint"] = "checkpoint"
    step: int = Field(ge=0)
    seconds: float


RolloutEvent = Annotated[Draw | Dispatch | Written | NodeLost | Resume, Field(discriminator="kind")]
"""A line of ``events/rollout.jsonl``."""
TrainedEvent = Annotated[TrainedStep | Admitted | Dropped | Checkpoint | Resume, Field(discriminator="kind")]
"""A line of ``events/trained.jsonl``."""
ROLLOUT_EVENT: TypeAdapter[RolloutEvent] = TypeAdapter(RolloutEvent)
TRAINED_EVENT: TypeAdapter[TrainedEvent] = TypeAdapter(TrainedEvent)


class ResumeRecord(BaseModel):
    """A line of ``resumes.jsonl`` (launcher): one resume, the report's seam."""

    model_config = ConfigDict(extra="forbid")

    life: int = Field(ge=1)
    step: int = Field(ge=0)
    """The checkpoint's step."""
    launched_at: float
    """Unix time the resume was launched."""
    cause: str
    """Why the run was taken up again: ``stopped``, ``node_lost``, ``rollout_lost``."""
    prompts_drawn: int
    groups_kept: int
    """Stored groups kept for the planner."""
    rolled_back: int
    """Groups trained by steps the restored checkpoint lacks."""
    reissued: dict[str, int]
    """Prompts dispatched again, per reason."""
    first_step_s: float | None = None
    """Seconds from launch to the life's first step (the summary's; not in the log)."""
