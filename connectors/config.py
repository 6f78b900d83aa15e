"""Configuration of the rollout worker (``RolloutConfig``) and its lookahead limit hooks."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.tasks import RewardFn

LookaheadHook = Callable[[Mapping[str, Mapping[str, Any]]], bool]
"""Called with ``StoreClient.stats()`` (node -> stats); returns True to pause dispatch."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """What a rollout worker generates, how, and where it writes.

    Example:
        >>> RolloutConfig(model="m", nodes=["grpc://127.0.0.1:8815"], group_size=8).group_size
        8
    """

    model: str
    """Path of a Hugging Face model directory (weights + tokenizer) that vLLM can load."""
    nodes: list[str]
    """Store locations (``grpc://host:port``); groups go to ``StoreClient.node_for(group_id)``, or to
    ``nodes[0]`` only when ``local_node_only``."""
    group_size: int = 4
    """G: samples per prompt."""
    max_tokens: int = 64
    """Longest response, tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    seed: int = 0
    """Engine seed and prompt-stream seed."""
    prompts_per_wave: int = 16
    """Most prompt groups inside the engine at once; a finished group's slot is refilled at once."""
    max_groups: int = 64
    """Groups to generate, then stop (0 = until stopped)."""
    max_seconds: float | None = None
    """Stop after this many seconds; groups still running are aborted and written as "aborted"."""
    data_sources: dict[str, float] = field(default_factory=lambda: {"add_small": 0.5, "mul_large": 0.5})
    """Mix of built-in data sources (``connectors.tasks.ARITHMETIC_TASKS``) -> sampling weight."""
    prompts_file: str | None = None
    """JSONL prompts (``prompt``, ``data_source``, ground-truth fields) instead of the built-in tasks."""
    reward_fn: RewardFn | str | None = None
    """Reward function or "module:function"; default ``connectors.tasks.exact_match_reward``."""
    max_unreleased_groups: int | None = None
    """Lookahead limit: pause dispatch while the stores hold this many unreleased groups."""
    lookahead: LookaheadHook | None = None
    """Custom lookahead hook over the stores' stats; returns True to pause (checked with the limit above)."""
    lookahead_poll_s: float = 0.5
    """Seconds between two lookahead checks (each is one ``stats`` call per node)."""
    version_poll_s: float = 1.0
    """Seconds between two ``get_version`` calls."""
    weight_sync: bool = False
    """Load newly published weights (``client.get_weights``) into the running engine. Without it, groups
    are tagged with the published version (the weights are assumed to be synced some other way)."""
    initial_version: int = 0
    """Policy version of the weights in ``model``; with ``weight_sync``, any newer published version
    (also one published before the worker started) is loaded."""
    local_node_only: bool = False
    """Write every group to ``nodes[0]`` (the node-local store) instead of hashing over ``nodes``."""
    group_id_prefix: str = ""
    """Prefix of group ids (default: ``r<pid>-``); ids must be unique across the store cluster."""
    logprobs_mode: str = "raw_logprobs"
    """vLLM ``logprobs_mode``: "raw_logprobs" (before temperature/top-p) or "processed_logprobs"."""
    dtype: str = "float32"
    """Engine dtype ("float32" keeps logprobs comparable with a trainer's fp32 forward)."""
    max_model_len: int = 1024
    """Engine context length."""
    max_num_seqs: int = 256
    """Engine batch limit (sequences)."""
    ignore_eos: bool = False
    """Generate ``max_tokens`` whatever the model samples (benchmarks)."""
    enforce_eager: bool = True
    """No graph capture / compilation (fast start; the CPU default)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism; 1 runs the model in this process (the CPU recipe)."""
    async_writes: bool = True
    """DoPut from one background thread (in order: a group's images before the group), so the engine
    steps while a write is in flight; ``False`` writes inline in the step loop."""
    max_queued_writes: int = 64
    """With ``async_writes``: the step loop waits when this many writes are queued."""
    dump_raw: str | None = None
    """Debug: append vLLM's raw token ids and logprobs per group to this JSONL file (exactness tests)."""

    def __post_init__(self) -> None:
        if not self.nodes:
            msg = "RolloutConfig.nodes is empty; give at least one store location"
            raise ValueError(msg)
        for name in ("group_size", "max_tokens", "prompts_per_wave", "max_model_len", "max_num_seqs",
                     "max_queued_writes", "tensor_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                msg = f"RolloutConfig.{name}={value} must be >= 1"
                raise ValueError(msg)
        if self.max_groups < 0:
            msg = f"RolloutConfig.max_groups={self.max_groups} must be >= 0"
            raise ValueError(msg)
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            msg = f"bad sampling settings temperature={self.temperature} top_p={self.top_p}"
            raise ValueError(msg)
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            msg = f"RolloutConfig.logprobs_mode={self.logprobs_mode!r} is not raw_logprobs/processed_logprobs"
            raise ValueError(msg)
        if self.initial_version < 0:
            msg = f"RolloutConfig.initial_version={self.initial_version} must be >= 0"
            raise ValueError(msg)
        if self.max_unreleased_groups is not None and self.max_unreleased_groups < 1:
            msg = f"RolloutConfig.max_unreleased_groups={self.max_unreleased_groups} must be >= 1"
            raise ValueError(msg)
        if self.prompts_file is None and not self.data_sources:
            msg = "RolloutConfig needs data_sources or prompts_file"
            raise ValueError(msg)
        if not self.group_id_prefix:
            self.group_id_prefix = f"r{os.getpid()}-"


def max_unreleased(limit: int) -> LookaheadHook:
    """A lookahead hook: pause while the stores together hold ``limit`` or more unreleased groups."""

    def hook(stats: Mapping[str, Mapping[str, Any]]) -> bool:
        stored = sum(int(s.get("groups", {}).get("stored", 0)) for s in stats.values())
        return stored >= limit

    return hook
