"""The rollout run report: what a worker generated and wrote, with throughput (``RolloutReport``).

The worker counts into a :class:`RolloutTally` while it runs (``connectors.rollout``) and builds the
frozen :class:`RolloutReport` once, when the run ends; ``to_dict`` is its JSON form, with derived rates,
as ``python -m connectors`` prints it and writes it to ``RolloutConfig.report_path``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True, slots=True, kw_only=True)
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
    tool_call_rate: dict[str, float] = field(default_factory=dict)
    """Per data source, the share of its completed rows with a tool call: an observation in the response
    (``loss_tokens < response_len``; 0.0 for a single-turn source)."""
    turns_mean: dict[str, float] = field(default_factory=dict)
    """Per data source, the mean ``num_turns`` of its completed rows."""
    policy_versions: list[int] = field(default_factory=list)
    """Distinct ``policy_version`` values written."""
    logprobs_mode: str = ""
    """The engine's logprob mode."""
    engine: str = ""
    """The engine (``RolloutConfig.engine``)."""
    weight_loads: int = 0
    """Published versions loaded into the engine."""
    weight_load_failures: int = 0
    """Loads of a version that failed (the engine stayed on its weights; each attempt counted)."""
    weight_load_s_mean: float = 0.0
    """Mean seconds one load took, reading the weights included."""
    weight_loaded_at: list[tuple[int, float]] = field(default_factory=list)
    """``(version, unix time)`` of each load: when the engine ran that version from (its generation resumed)."""

    def to_dict(self) -> dict[str, Any]:
        """The report plus derived rates: tokens/s generated, groups/s and MB/s written."""
        d = asdict(self)
        gen = max(self.generate_s, 1e-9)
        d["tokens_per_s"] = round(self.response_tokens / gen, 1)
        d["groups_per_s"] = round(self.groups / gen, 2)
        d["write_mb_per_s"] = round(self.bytes_written / max(self.write_s, 1e-9) / 1e6, 2)
        d["stream_mb_per_s"] = round(self.bytes_written / gen / 1e6, 3)
        return d


@dataclass(slots=True)
class RolloutTally:
    """What the worker counts while it runs; :meth:`report` builds the run's :class:`RolloutReport` from it."""

    engine_start_s: float = 0.0
    logprobs_mode: str = ""
    started_at: float = 0.0
    groups: int = 0
    aborted_groups: int = 0
    demand_dispatches: int = 0
    redispatched: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    bytes_written: int = 0
    images_written: int = 0
    rewards: dict[str, list[float]] = field(default_factory=dict)
    """Per data source, the reward of every completed row."""
    versions: set[int] = field(default_factory=set)
    """Distinct ``policy_version`` values written."""
    turns: dict[str, list[int]] = field(default_factory=dict)
    """Per data source, ``[completed rows, rows with a tool call, model turns]``."""

    def add_group(self, batch: pa.RecordBatch, *, aborted: bool) -> None:
        """Count one group's record batch, written (``aborted``: it has at least one aborted row)."""
        self.groups += 1
        self.aborted_groups += int(aborted)
        self.rows += batch.num_rows
        self.prompt_tokens += int(pc.sum(batch.column("prompt_len")).as_py() or 0)
        self.response_tokens += int(pc.sum(batch.column("response_len")).as_py() or 0)
        self.bytes_written += batch.nbytes
        self.versions.add(int(batch.column("policy_version")[0].as_py()))
        names = batch.schema.names
        if "num_turns" not in names or "loss_tokens" not in names:
            return
        for status, source, turns, trained, length in zip(
                *(batch.column(c).to_pylist() for c in ("status", "data_source", "num_turns", "loss_tokens",
                                                        "response_len")), strict=True):
            if status == "completed":
                counts = self.turns.setdefault(str(source), [0, 0, 0])
                counts[0] += 1
                counts[1] += int(trained < length)
                counts[2] += int(turns)

    def add_images(self, table: pa.Table) -> None:
        """Count an images table, written."""
        self.images_written += table.num_rows
        self.bytes_written += table.nbytes

    def report(self, *, generate_s: float, write_s: float, write_times: list[float], engine: str = "",
               loads: list[tuple[int, float, float]] | None = None, load_failures: int = 0) -> RolloutReport:
        """The run's report: these counts, the run's seconds, the writer's DoPut seconds and times, and the engine's
        weight loads (``loads``: version, unix time it ran from, seconds each, as ``WeightSync.loads``)."""
        loads = list(loads or [])
        return RolloutReport(
            groups=self.groups, aborted_groups=self.aborted_groups, demand_dispatches=self.demand_dispatches,
            redispatched=dict(self.redispatched), rows=self.rows, prompt_tokens=self.prompt_tokens,
            response_tokens=self.response_tokens, bytes_written=self.bytes_written,
            images_written=self.images_written, engine_start_s=self.engine_start_s, started_at=self.started_at,
            logprobs_mode=self.logprobs_mode, generate_s=round(generate_s, 4), write_s=write_s,
            write_times=list(write_times), first_write_at=write_times[0] if write_times else 0.0,
            last_write_at=write_times[-1] if write_times else 0.0,
            reward_mean={k: round(sum(v) / len(v), 4) for k, v in sorted(self.rewards.items()) if v},
            tool_call_rate={k: round(v[1] / v[0], 4) for k, v in sorted(self.turns.items()) if v[0]},
            turns_mean={k: round(v[2] / v[0], 4) for k, v in sorted(self.turns.items()) if v[0]},
            policy_versions=sorted(self.versions), engine=engine, weight_loads=len(loads),
            weight_load_failures=load_failures,
            weight_load_s_mean=round(sum(s for *_, s in loads) / len(loads), 4) if loads else 0.0,
            weight_loaded_at=[(v, at) for v, at, _ in loads])
