"""The run's summary: ``policy_summary.json`` (one policy's figures, :class:`PolicySummary`) and ``summary.json``
(every policy's, with the comparisons: :class:`RunSummary`), written by ``launcher.report`` and read by ``knit
report``'s table, ``bench.learning`` and the trackers, by these names.

``summary.json`` carries the run folder's contract version (``schemas.run_folder.CONTRACT_VERSION``):
:func:`read_summary` refuses another.

Example:
    >>> s = RunSummary(policies={})
    >>> RunSummary.model_validate_json(s.model_dump_json()).contract_version == s.contract_version
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.ledger import ResumeRecord
from schemas.run_folder import CONTRACT_VERSION, RunFolderError, check_version, read_document


class _Figures(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Latency(_Figures):
    """Fetch time per micro-batch, in milliseconds."""

    mean: float
    p50: float
    p95: float
    micro_batches: int


class StepSeconds(_Figures):
    """Medians over rank 0's steps: the step, what publishing cost the training thread, the step's end to its
    version published on every node."""

    step: float
    publish_blocking: float
    published_after: float


class Throughput(_Figures):
    """Over the training window."""

    trajectories_per_s: float
    tokens_per_s: float


class RewardWindow(_Figures):
    """Mean reward pooled over a few train batches, with its 95% band."""

    mean: float
    ci95: float
    train_batches: int


class OffPolicyFigures(_Figures):
    """The objective and the run's off-policy figures (``train.offpolicy.summary``): means over the steps, maxima for
    the ``_max`` ones; None where no step had one."""

    objective: str | None = None
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_truncated_frac: float | None = None
    clip_frac: float | None = None
    kl_behaviour_k3: float | None = None
    token_staleness_mean: float | None = None
    token_staleness_max: float | None = None


class StoreOutage(_Figures):
    """A store node that died and was started again, did not answer, or was lost for good (``launcher.stores``)."""

    store: str
    node: str
    location: str
    exit_code: int | None = None
    died_at: float
    back_at: float | None = None
    down_s: float | None = None
    """Seconds it was down (None while it is not back)."""
    restarts: int
    cause: str
    """``exited`` or ``unreachable``."""
    lost_at: float | None = None
    """Unix time it was given up for good (None: it was not)."""


class ImageFigures(_Figures):
    """A run with images (``knit run --model tiny-vl``): what was stored, referenced, read and encoded."""

    images_written: int
    """Images the rollout stored: each group's once (``RolloutRecord.images_written``)."""
    image_refs: int
    """Image references of the rows trained, over all ranks: what storing images per row would hold."""
    distinct_images: int
    """Distinct images each rank read per mini-batch, summed over steps and ranks."""
    encoder_passes: int
    """Images through the vision tower, over all steps and ranks."""
    encoder_passes_per_distinct_image: float
    """``encoder_passes / distinct_images``: 1.0 when each rank encodes each distinct image once per mini-batch."""
    image_bytes_per_rank: dict[str, int]
    """Bytes of image rows each rank read."""


class LedgerFigures(_Figures):
    """The prompt ledger's counts (``launcher.ledger.figures``)."""

    prompts: int
    attempts: int
    exact: bool
    """Each prompt trained exactly once."""
    exceptions: list[str]
    """The prompts that were not."""
    attempts_again_by_reason: dict[str, int]
    summary: str
    """One line: ``ledger: N prompts, each trained once``, or the exceptions by name."""


class CheckpointSeconds(_Figures):
    """Seconds the run's checkpoints took."""

    count: int
    median: float | None = None
    max: float | None = None


class LookaheadTry(_Figures):
    """One try of ``--match-throughput``."""

    lookahead: int
    trainer_busy: float
    trajectories_per_s: float
    arch_staleness_mean: float
    quota_violations: int


class RayFigures(_Figures):
    """Where a ``--ray`` run placed its components, and the bytes the driver received (none of them payload)."""

    nodes: list[dict[str, str]]
    lost: list[str]
    placement: dict[str, str]
    driver_bytes: dict[str, int]


class PolicySummary(_Figures):
    """One policy's figures (``launcher.report.policy_summary``), ``policy_summary.json``."""

    policy: str | None = None
    arch_staleness_mean: float = 0.0
    arch_staleness_token_weighted: float = 0.0
    arch_staleness_max: int = 0
    signed_staleness_mean: float = 0.0
    generation_span_mean: float = 0.0
    quota_violations: int = 0
    """(train batch, quota value) pairs whose distinct groups differ from the quota's count."""
    total_staleness_mean: float = 0.0
    trajectories_consumed: int = 0
    rows_received: int = 0
    duplicate_rows: int = 0
    """Rows a rank received twice (must be 0)."""
    steps: int = 0
    final_version: int = 0
    bytes_per_rank: dict[str, int] = Field(default_factory=dict)
    driver_payload_bytes: int = 0
    transfer_latency_ms: Latency = Field(default_factory=lambda: Latency(mean=0.0, p50=0.0, p95=0.0, micro_batches=0))
    exposed_wait_s: dict[str, float] = Field(default_factory=dict)
    """Per rank: seconds the step loop blocked on data."""
    trainer_idle_s: float = 0.0
    """Seconds rank 0 waited for an admissible mini-batch, start-up excluded."""
    step_s: StepSeconds = Field(default_factory=lambda: StepSeconds(step=0.0, publish_blocking=0.0,
                                                                    published_after=0.0))
    training_window_s: float = 0.0
    throughput: Throughput = Field(default_factory=lambda: Throughput(trajectories_per_s=0.0, tokens_per_s=0.0))
    reward_per_train_batch: list[float] = Field(default_factory=list)
    reward_ci95_per_train_batch: list[float] = Field(default_factory=list)
    reward_trend: float | None = None
    """Last train batch's mean reward minus the first's."""
    reward_first5: RewardWindow | None = None
    reward_last5: RewardWindow | None = None
    abs_logp_diff_first_step: float | None = None
    offpolicy: OffPolicyFigures = Field(default_factory=OffPolicyFigures)
    rollout: dict[str, Any] = Field(default_factory=dict)
    """The rollout's figures (``schemas.run_records.RolloutRecord.reported``)."""
    wall_s: float = 0.0
    store_outages: list[StoreOutage] = Field(default_factory=list)
    store_restarts: int = 0
    metrics_urls: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    """The run's config (``run_config.json``'s), with ``lookahead_groups``."""
    interrupted: bool | None = None
    ledger: LedgerFigures | None = None
    images: ImageFigures | None = None
    """A run with images: stored vs referenced, read per rank, encoder passes."""
    resumes: list[ResumeRecord] = Field(default_factory=list)
    checkpoint_s: CheckpointSeconds | None = None
    ray: RayFigures | None = None
    lookahead_search: list[LookaheadTry] | None = None
    """``--match-throughput``: every lookahead tried."""
    matched_throughput: bool | None = None


class RunSummary(_Figures):
    """``summary.json``: every policy's figures; with train_batch and mini_batch the staleness reduction and the
    throughput ratio, and mini_batch's staleness over streaming's when it ran too."""

    contract_version: int = CONTRACT_VERSION
    policies: dict[str, PolicySummary]
    arch_staleness_reduction: float | None = None
    throughput_ratio: float | None = None
    mini_vs_streaming_arch: float | None = None


def read_summary(path: str | Path) -> RunSummary:
    """``summary.json`` read back, its contract version checked first.

    Raises:
        RunFolderError: the file is missing, damaged, of another version, or lacks a field.
    """
    p = Path(path)
    try:
        version = json.loads(p.read_bytes()).get("contract_version")
    except FileNotFoundError:
        raise RunFolderError(p, "missing") from None
    except (ValueError, AttributeError) as exc:
        raise RunFolderError(p, f"not a JSON object ({exc})") from None
    check_version(version, p)
    return read_document(RunSummary, p)
