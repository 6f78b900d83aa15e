"""The trainer's and the rollout's records in a run folder: the step metrics, the rank report, the progress line, the
consumed entries, the rollout's report.

* :class:`StepMetrics`: one optimizer step's own metrics (``train.backbone.step_metrics``, the loss's, the step
  kind's), as rank 0 logs them in the trained log (``schemas.ledger.TrainedStep``);
* :class:`StepLine`: a step in a rank report, its metrics with the loop's fields (version, plan wait, end, publish
  times);
* :data:`ConsumedEntry`: what a rank was planned (:class:`SliceEntry`) and received (:class:`RowEntry`), on disk as
  the compact arrays ``["slice", step, node, group_id, start, stop]`` and ``["row", step, group_id, sample_idx]``;
* :class:`RankReportDocument`: ``trainer_rank{r}.json``, ``{"env", "steps", "consumed"}``;
* :class:`ProgressLine`: rank 0's line per step in ``progress.jsonl``;
* :class:`RolloutRecord`: the rollout's report (``rollout.json``).

Example:
    >>> CONSUMED_ENTRY.validate_python(["row", 3, "g1", 0])
    RowEntry(kind='row', step=3, group_id='g1', sample_idx=0)
    >>> CONSUMED_ENTRY.dump_json(RowEntry(step=3, group_id="g1", sample_idx=0))
    b'["row",3,"g1",0]'
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_serializer


class StepMetrics(BaseModel):
    """One optimizer step's own metrics. A step kind adds its own beyond these (the multimodal step's encoder
    figures): they are kept as extra fields."""

    model_config = ConfigDict(extra="allow", frozen=True)

    step: int = Field(ge=0)
    """The optimizer step (0-based over the run)."""
    train_batch: int = Field(ge=0)
    position: int = Field(ge=0)
    """The step's place in its train batch."""
    loss: float
    rows: int = Field(ge=0)
    """Trajectories the step trained on (all ranks)."""
    abs_logp_diff: float
    """Mean absolute difference of the trainer's and the rollout's logprobs of the trained tokens."""
    step_time_s: float
    """Seconds the step took on this rank."""
    ratio: float | None = None
    clip_frac: float | None = None
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_truncated_frac: float | None = None
    kl_behaviour_k3: float | None = None
    token_version_mean: float | None = None
    token_version_min: int | None = None
    token_staleness_mean: float | None = None
    """Versions between the weights that made a token and the weights that trained on it (``train.offpolicy``)."""
    token_staleness_max: float | None = None
    loss_tokens: int | None = None
    grad_norm: float | None = None
    update_ok: bool | None = None
    micro_batches: int | None = None
    exposed_wait_s: list[float] = Field(default_factory=list)
    """Per micro-batch: seconds the step blocked on its data."""
    fetch_s: list[float] = Field(default_factory=list)
    """Per micro-batch: seconds its fetch took (hidden behind compute or not)."""
    bytes_fetched: int = 0
    """Payload bytes this rank fetched from the stores."""
    prox_s: float | None = None
    logprobs_mode: str | None = None
    checkpoint_s: float | None = None
    """Seconds the checkpoint after the step took (when one was due)."""

    @field_validator("exposed_wait_s", "fetch_s", mode="before")
    @classmethod
    def _per_micro_batch(cls, value: Any) -> Any:
        """A step kind that fetches a mini-batch at once reports one figure: a list of one."""
        return [value] if isinstance(value, int | float) else value


OFFPOLICY_KEYS: tuple[str, ...] = ("is_weight_mean", "is_weight_max", "is_truncated_frac", "clip_frac",
                                   "kl_behaviour_k3", "token_staleness_mean", "token_staleness_max")
"""The per-step off-policy metrics of :class:`StepMetrics` (a step without token versions has None for the
staleness)."""


class StepLine(StepMetrics):
    """A step in a rank report: its metrics, the loop's fields, the publishing times."""

    version: int
    """The policy version the step produced."""
    plan_wait_s: float
    """Seconds the loop waited for plans since the step before (the first: start-up included)."""
    t_end: float
    """Unix time the step ended."""
    publish_s: float | None = None
    """What publishing cost the training thread."""
    publish_done_s: float | None = None
    """Rank 0: the step's end to its version published on every node."""


class SliceEntry(BaseModel):
    """A slice planned for this rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["slice"] = "slice"
    step: int
    node: str
    group_id: str
    start: int
    stop: int

    @model_serializer
    def _array(self) -> list[Any]:
        return [self.kind, self.step, self.node, self.group_id, self.start, self.stop]


class RowEntry(BaseModel):
    """A row this rank received."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["row"] = "row"
    step: int
    group_id: str
    sample_idx: int

    @model_serializer
    def _array(self) -> list[Any]:
        return [self.kind, self.step, self.group_id, self.sample_idx]


_ENTRY_FIELDS = {"slice": ("step", "node", "group_id", "start", "stop"), "row": ("step", "group_id", "sample_idx")}


def _entry_from_array(value: Any) -> Any:
    """``["row", step, group_id, sample_idx]`` as the fields of a :class:`RowEntry` (a slice's likewise)."""
    if isinstance(value, list | tuple) and value and value[0] in _ENTRY_FIELDS:
        names = _ENTRY_FIELDS[value[0]]
        if len(value) != len(names) + 1:
            msg = f"a {value[0]} entry holds {len(names)} fields ({', '.join(names)}), got {len(value) - 1}"
            raise ValueError(msg)
        return {"kind": value[0], **dict(zip(names, value[1:], strict=True))}
    return value


ConsumedEntry = Annotated[SliceEntry | RowEntry, Field(discriminator="kind"), BeforeValidator(_entry_from_array)]
"""A rank's consumed entry: a slice planned or a row received."""
CONSUMED_ENTRY: TypeAdapter[ConsumedEntry] = TypeAdapter(ConsumedEntry)


class RankEnv(BaseModel):
    """Where a trainer rank sat in the process groups."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    world: int | None = None
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None


class RankReportDocument(BaseModel):
    """``trainer_rank{r}.json``: a rank's steps and what it was planned and received."""

    model_config = ConfigDict(extra="forbid")

    env: RankEnv
    steps: list[StepLine] = Field(default_factory=list)
    consumed: list[ConsumedEntry] = Field(default_factory=list)

    def rows(self) -> list[RowEntry]:
        """The rows the rank received."""
        return [c for c in self.consumed if isinstance(c, RowEntry)]


class ProgressLine(BaseModel):
    """Rank 0's line per step in ``progress.jsonl``: where the run is, and the step's figures (None when no
    trajectory was logged for the step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0)
    train_batch: int = Field(ge=0)
    position: int = Field(ge=0)
    """The step's place in its train batch (0 .. mini_batches - 1)."""
    version: int
    """The policy version the step produced."""
    loss: float
    rows: int
    """Trajectories the step trained on (all ranks)."""
    abs_logp_diff: float
    plan_wait_s: float
    step_time_s: float
    t_end: float
    """Unix time the step ended."""
    admitted_groups: int
    """Groups the planner admitted so far."""
    arch_staleness_mean: float | None = None
    """Mean architectural staleness of the step's trajectories (``admission.staleness``), in policy versions."""
    arch_staleness_max: int | None = None
    reward_mean: float | None = None
    """Mean reward of the step's trajectories."""


class RolloutRecord(BaseModel):
    """``rollout.json``: the rollout's report (``connectors.report.RolloutReport``); the report's figures by name,
    the rest kept as extra fields."""

    model_config = ConfigDict(extra="allow", frozen=True)

    groups: int = 0
    aborted_groups: int = 0
    rows: int = 0
    response_tokens: int = 0
    tokens_per_s: float | None = None
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    policy_versions: list[int] = Field(default_factory=list)
    bytes_written: int = 0
    redispatched: dict[str, str] = Field(default_factory=dict)
    """Group id of each prompt dispatched again after the engine aborted it -> the prompt's first group id."""

    REPORTED: ClassVar[tuple[str, ...]] = ("groups", "aborted_groups", "rows", "response_tokens", "tokens_per_s",
                                           "engine_start_s", "generate_s", "policy_versions", "bytes_written")
    """The fields the run's summary shows (``rollout``)."""

    def reported(self) -> dict[str, Any]:
        """The fields the run's summary shows."""
        return {k: getattr(self, k) for k in self.REPORTED}
