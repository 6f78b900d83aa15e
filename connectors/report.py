"""The rollout run report: what a worker generated and wrote, with throughput (``RolloutReport``).

The worker fills it while it runs (``connectors.rollout``); ``to_dict`` is its JSON form, with
derived rates, as ``python -m connectors`` prints it and writes it to ``RolloutConfig.report_path``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RolloutReport:
    """What a run generated and wrote, with throughput (JSON via ``to_dict``)."""

    groups: int = 0
    """Groups written (completed and aborted)."""
    aborted_groups: int = 0
    """Groups with at least one aborted row."""
    demand_dispatches: int = 0
    """Prompts dispatched past the lookahead limit because the trainer's quota needed their class."""
    redispatched: dict[str, str] = field(default_factory=dict)
    """Group id of each prompt dispatched again after the engine aborted it -> the prompt's first group id."""
    rows: int = 0
    """Trajectories written."""
    prompt_tokens: int = 0
    """Prompt tokens over all rows."""
    response_tokens: int = 0
    """Generated tokens over all rows."""
    bytes_written: int = 0
    """Arrow bytes of the written batches and images."""
    images_written: int = 0
    """Distinct images sent (before store-side dedup across groups)."""
    engine_start_s: float = 0.0
    """Seconds to start the engine (0 when given one)."""
    generate_s: float = 0.0
    """Seconds from the first dispatch to the last group written."""
    write_s: float = 0.0
    """Seconds spent in DoPut calls (images and groups)."""
    started_at: float = 0.0
    """Unix time of the first dispatch."""
    first_write_at: float = 0.0
    """Unix time the first group was written."""
    last_write_at: float = 0.0
    """Unix time the last group was written."""
    write_times: list[float] = field(default_factory=list)
    """Unix time of each group write, in write order."""
    reward_mean: dict[str, float] = field(default_factory=dict)
    """Mean reward of completed rows per data source."""
    policy_versions: list[int] = field(default_factory=list)
    """Distinct ``policy_version`` values written."""
    logprobs_mode: str = ""
    """The engine's logprob mode."""

    def to_dict(self) -> dict[str, Any]:
        """The report plus derived rates: tokens/s generated, groups/s and MB/s written."""
        d = asdict(self)
        gen = max(self.generate_s, 1e-9)
        d["tokens_per_s"] = round(self.response_tokens / gen, 1)
        d["groups_per_s"] = round(self.groups / gen, 2)
        d["write_mb_per_s"] = round(self.bytes_written / max(self.write_s, 1e-9) / 1e6, 2)
        d["stream_mb_per_s"] = round(self.bytes_written / gen / 1e6, 3)
        return d
