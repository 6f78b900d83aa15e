"""The staleness simulator's workload: its parameters, the loader's prompts and their dispatch order.

:class:`SimParams` holds every knob of one simulation; :func:`make_prompts` draws the loader's
chunks (one per train batch, in the quota mix, response lengths drawn up front, so every policy
sees the same prompts per seed); :func:`dispatch_order` is the order the loader hands them to the
rollout; :func:`admission_config` is the planner's configuration for a policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from admission import AdmissionConfig, Quota

SOURCES = ("math", "chat")


@dataclass(kw_only=True, slots=True)
class SimParams:
    """Workload and pipeline parameters of one simulation."""

    groups: int = 64
    """B: prompt groups per train batch."""
    group_size: int = 8
    """G."""
    mini_batches: int = 4
    """K."""
    dp_ranks: int = 2
    """D."""
    train_batches: int = 20
    """Train batches simulated."""
    slots: int = 512
    """Concurrent rollout sequences."""
    math_median: float = 1200.0
    math_sigma: float = 0.9
    chat_median: float = 400.0
    chat_sigma: float = 0.5
    max_len: int = 8192
    gen_s_per_token: float = 1e-3
    """Rollout seconds per generated token of one sequence."""
    train_s_per_token: float = 1e-5
    """Trainer seconds per token of the most loaded rank (calibrated)."""
    token_budget: int = 16384
    sync: str = "per_step"
    """``per_step`` or ``per_train_batch``."""
    version_at: str = "complete"
    """Recorded ``policy_version`` of a group: the rollout version when it ``complete``s (default: what the
    project's rollout worker records, since it loads each new version into the running engine, so the
    newest weights produced the last tokens; ``policy_version_min`` stays the start version), or when it
    ``start``s (variant: a rollout that never updates weights under running requests)."""
    loader_order: str = "shuffled"
    """The loader's order of a chunk's prompts, which ``fifo`` dispatch follows: ``shuffled`` (default),
    ``slow_first`` (math before chat inside a chunk), ``longest_first`` (inside a chunk by the group's longest
    response, descending: an oracle length predictor) or ``math_ahead`` (each chunk's math one chunk early;
    see :func:`dispatch_order`)."""
    loader_mix: str = "exact"
    """Sources of a chunk's prompts: ``exact`` (B/2 math and B/2 chat, the quota mix) or ``iid`` (each prompt's
    source drawn 50/50 on its own: a chunk's mix varies, and the planner alone keeps the quota)."""
    prefer: str = "scarce"
    """The planner's choice among feasible compositions (``AdmissionConfig.prefer``): ``scarce`` (classes least
    covered first, then oldest) or ``oldest`` (lowest policy version first)."""
    dispatch: str = "lead"
    """How the rollout spends the lookahead L (``train_batch`` and ``mini_batch``; ``streaming`` stands for the
    peers, whose rollout dispatches ``fifo``): ``lead`` (default, what ``connectors.rollout`` does with its
    ``slow_ahead`` order: the waiting prompt of the lowest loader position minus its class's lead goes out next,
    the lead being the groups dispatched while the class generates beyond the fastest class's latency, both
    measured online, see ``_Pipeline._leads``: groups complete in about the loader's order), ``fifo`` (the
    loader's order) or ``per_class`` (class s dispatched while its dispatched-untrained groups are below its
    share of L corrected by its latency, see ``_Pipeline._class_limits``)."""
    trainer_slowdown: float = 1.0
    """Multiplier on the calibrated trainer time (> 1: trainer-bound regime)."""


@dataclass(slots=True)
class SimPrompt:
    """One prompt of the loader: its data source, its length, and its G responses' lengths and rewards."""

    source: str
    prompt_len: int
    lengths: np.ndarray
    rewards: np.ndarray


def make_prompts(p: SimParams, seed: int, chunks: int) -> list[list[SimPrompt]]:
    """The loader's chunks (one per train batch) in the quota mix (``iid``: around it), response lengths drawn
    up front."""
    rng = np.random.default_rng(seed)
    out = []
    half = p.groups // 2
    for _ in range(chunks):
        if p.loader_mix == "iid":
            srcs = np.where(rng.random(p.groups) < 0.5, "math", "chat")
        else:
            srcs = np.array(["math"] * half + ["chat"] * (p.groups - half))
            rng.shuffle(srcs)
        if p.loader_order == "slow_first":
            srcs = np.array(sorted(srcs, key=lambda s: s != "math"))
        chunk = []
        for s in srcs:
            med, sig = (p.math_median, p.math_sigma) if s == "math" else (p.chat_median, p.chat_sigma)
            lens = np.minimum(np.rint(med * np.exp(sig * rng.standard_normal(p.group_size))), p.max_len)
            lens = np.maximum(lens, 1).astype(np.int64)
            chunk.append(SimPrompt(str(s), int(rng.integers(64, 513)), lens,
                                 (rng.random(p.group_size) < rng.random()).astype(np.float64)))
        if p.loader_order == "longest_first":  # an oracle length predictor: the longest group of the chunk first
            chunk.sort(key=lambda pr: -int(pr.lengths.max()))
        out.append(chunk)
    return out


def dispatch_order(prompts: list[list[SimPrompt]], p: SimParams) -> list[SimPrompt]:
    """The order the loader hands prompts to rollout; ``math_ahead`` dispatches each chunk's math one chunk
    early (block 0 = math of chunks 0 and 1, block j = chat of chunk j-1 + math of chunk j+1); ``colocated``
    always dispatches chunk by chunk."""
    if p.loader_order != "math_ahead":
        return [pr for ch in prompts for pr in ch]
    maths = [[pr for pr in ch if pr.source == "math"] for ch in prompts]
    chats = [[pr for pr in ch if pr.source != "math"] for ch in prompts]
    out = maths[0] + maths[1]
    for j in range(1, len(prompts) - 1):
        out += [x for pair in zip(chats[j - 1], maths[j + 1], strict=False) for x in pair]
    return out


def admission_config(p: SimParams, policy: str) -> AdmissionConfig:
    """The planner's configuration for ``policy`` on this workload: B, G, K, D and the 50/50 source quota."""
    return AdmissionConfig(train_batch_groups=p.groups, group_size=p.group_size, mini_batches=p.mini_batches,
                           dp_ranks=p.dp_ranks, token_budget=p.token_budget, policy=policy,  # type: ignore[arg-type]
                           prefer=p.prefer,  # type: ignore[arg-type]
                           quotas=(Quota(column="data_source", shares={"math": 0.5, "chat": 0.5}),))
