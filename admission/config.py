"""Admission configuration: batch geometry, quotas, filters, staleness bound, cost model, policy, GRPO.

Everything the planner needs to know about *what* may be admitted is declared here, not coded per
policy (docs/design.md, Admission). Values are checked when the objects are built; errors name the
offending value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Policy = Literal["train_batch", "mini_batch", "colocated", "streaming"]
CostModel = Literal["tokens", "sq_tokens"]
Preference = Literal["scarce", "oldest"]
Assignment = Literal["links", "tokens"]

POLICIES: tuple[str, ...] = ("train_batch", "mini_batch", "colocated", "streaming")
COST_MODELS: tuple[str, ...] = ("tokens", "sq_tokens")
ASSIGNMENTS: tuple[str, ...] = ("links", "tokens")


@dataclass(kw_only=True, slots=True, frozen=True)
class Quota:
    """Exact number of prompt groups per train batch for each value of one metadata column.

    Give either ``counts`` (groups per train batch) or ``shares`` (fractions of the train batch, turned
    into counts by :meth:`AdmissionConfig.quota_counts`; every share times B must be an integer). The
    listed values must cover the whole train batch (counts sum to B, shares to 1): a group whose value
    is not listed can never be admitted and is dropped with reason ``"unmatched"``. Several quotas over
    different columns apply at once (e.g. ``data_source`` and a difficulty bucket).

    Example:
        >>> Quota(column="data_source", shares={"math": 0.5, "chat": 0.5})
        Quota(column='data_source', counts=None, shares={'math': 0.5, 'chat': 0.5})
    """

    column: str
    """Metadata column the quota is over; must be constant within a prompt group."""
    counts: Mapping[str, int] | None = None
    """Groups per train batch for each value."""
    shares: Mapping[str, float] | None = None
    """Fraction of the train batch for each value (alternative to ``counts``)."""

    def __post_init__(self) -> None:
        if not self.column:
            msg = "Quota.column must be a non-empty column name"
            raise ValueError(msg)
        if (self.counts is None) == (self.shares is None):
            msg = f"Quota on {self.column!r}: give exactly one of counts or shares"
            raise ValueError(msg)
        values = self.counts if self.counts is not None else self.shares
        if not values:
            msg = f"Quota on {self.column!r}: no values listed"
            raise ValueError(msg)
        for v, c in values.items():
            if isinstance(c, bool) or not isinstance(c, int | float) or c < 0 or not math.isfinite(c):
                msg = f"Quota on {self.column!r}: value {v!r} has invalid count/share {c!r}"
                raise ValueError(msg)
            if self.counts is not None and not isinstance(c, int):
                msg = f"Quota on {self.column!r}: count for {v!r} must be an int, got {c!r}"
                raise ValueError(msg)
        if self.shares is not None and abs(sum(self.shares.values()) - 1.0) > 1e-9:
            msg = f"Quota on {self.column!r}: shares sum to {sum(self.shares.values())!r}, not 1"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True, frozen=True)
class Filters:
    """Group filters applied before admission; a filtered group is dropped (its quota slot is refilled).

    Example:
        >>> Filters(drop_uniform_reward=True, drop_finish_reasons=frozenset({"length"}))  # DAPO-style
        Filters(drop_uniform_reward=True, reward_tolerance=0.0, drop_finish_reasons=frozenset({'length'}))
    """

    drop_uniform_reward: bool = False
    """DAPO dynamic sampling: drop groups whose rewards all agree (max - min <= reward_tolerance)."""
    reward_tolerance: float = 0.0
    """Tolerance of the uniform-reward test."""
    drop_finish_reasons: frozenset[str] = frozenset()
    """Drop a group when any of its rows finished with one of these reasons (e.g. ``{"length"}``)."""

    def __post_init__(self) -> None:
        if self.reward_tolerance < 0 or not math.isfinite(self.reward_tolerance):
            msg = f"Filters.reward_tolerance must be finite and >= 0, got {self.reward_tolerance!r}"
            raise ValueError(msg)
        if not isinstance(self.drop_finish_reasons, frozenset):
            msg = f"Filters.drop_finish_reasons must be a frozenset, got {type(self.drop_finish_reasons).__name__}"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True, frozen=True)
class GrpoConfig:
    """GRPO settings, in one place: the planner's group-relative advantages and the trainer's clipped loss.

    The advantage of a trajectory is its reward minus its group's mean reward, divided by the group's
    reward std (ddof 1) plus ``eps`` when ``normalize_std``; the trainer clips the importance ratio to
    ``[1 - clip_low, 1 + clip_high]``.

    Example:
        >>> GrpoConfig(clip_high=0.28)  # DAPO's clip-higher
        GrpoConfig(normalize_std=True, eps=1e-06, clip_low=0.2, clip_high=0.28)
    """

    normalize_std: bool = True
    """Divide group-centred rewards by the group's std (GRPO); False = centre only (Dr. GRPO)."""
    eps: float = 1e-6
    """Added to the group's reward std before dividing."""
    clip_low: float = 0.2
    """Lower clip of the importance ratio: it is clipped to ``1 - clip_low`` (in [0, 1))."""
    clip_high: float = 0.2
    """Upper clip of the importance ratio: it is clipped to ``1 + clip_high`` (DAPO uses a larger value)."""

    def __post_init__(self) -> None:
        if not isinstance(self.normalize_std, bool):
            msg = f"GrpoConfig.normalize_std must be a bool, got {self.normalize_std!r}"
            raise ValueError(msg)
        if not math.isfinite(self.eps) or self.eps < 0:
            msg = f"GrpoConfig.eps must be finite and >= 0, got {self.eps!r}"
            raise ValueError(msg)
        if not 0 <= self.clip_low < 1:
            msg = f"GrpoConfig.clip_low must be in [0, 1), got {self.clip_low!r}"
            raise ValueError(msg)
        if not math.isfinite(self.clip_high) or self.clip_high < 0:
            msg = f"GrpoConfig.clip_high must be finite and >= 0, got {self.clip_high!r}"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkModel:
    """Where the store nodes and the trainer ranks sit, and each host's link rate each way.

    A group read by a rank on its store node's host moves over no link; otherwise its bytes leave over the
    store host's uplink and arrive over the rank host's downlink. A node or rank with no host listed is a
    host of its own; a host with no rate listed has ``default_mbit``. With every host's rate equal (the
    default) only the bytes matter.

    Example:
        >>> links = LinkModel(node_host={"grpc://a:1": "h0"}, rank_host=("h0", "h1"), down_mbit={"h1": 100.0})
        >>> links.host_of_rank(1), links.rate_down("h1"), links.rate_up("h0")
        ('h1', 100.0, 1000.0)
    """

    node_host: Mapping[str, str] = field(default_factory=dict)
    """Store node (the metadata frame's ``node``: its location) -> host name."""
    rank_host: tuple[str, ...] = ()
    """Host name of each DP rank, by rank (empty: each rank a host of its own)."""
    up_mbit: Mapping[str, float] = field(default_factory=dict)
    """Host -> rate out of the host, Mbit/s."""
    down_mbit: Mapping[str, float] = field(default_factory=dict)
    """Host -> rate into the host, Mbit/s."""
    default_mbit: float = 1000.0
    """Rate of a host not listed, each way, Mbit/s."""

    def __post_init__(self) -> None:
        rates = {**{f"up_mbit[{k!r}]": v for k, v in self.up_mbit.items()},
                 **{f"down_mbit[{k!r}]": v for k, v in self.down_mbit.items()}, "default_mbit": self.default_mbit}
        for name, v in rates.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                msg = f"LinkModel.{name} must be a positive rate in Mbit/s, got {v!r}"
                raise ValueError(msg)
        if not all(isinstance(h, str) and h for h in (*self.node_host.values(), *self.rank_host)):
            msg = f"LinkModel: host names must be non-empty strings, got {dict(self.node_host)} / {self.rank_host}"
            raise ValueError(msg)

    def placed(self, node_host: Mapping[str, str], rank_host: tuple[str, ...]) -> LinkModel:
        """This model with the hosts a deployment knows, unless this one names hosts already (a user who said where
        things are is taken at their word); the rates stay."""
        if self.node_host or self.rank_host:
            return self
        return replace(self, node_host=dict(node_host), rank_host=tuple(rank_host))

    def host_of_node(self, node: str) -> str:
        """The host of store node ``node`` (the node itself when none is listed)."""
        return self.node_host.get(node, f"node:{node}")

    def host_of_rank(self, rank: int) -> str:
        """The host of DP rank ``rank`` (the rank itself when none is listed)."""
        return self.rank_host[rank] if rank < len(self.rank_host) else f"rank:{rank}"

    def rate_up(self, host: str) -> float:
        """Mbit/s out of ``host``."""
        return float(self.up_mbit.get(host, self.default_mbit))

    def rate_down(self, host: str) -> float:
        """Mbit/s into ``host``."""
        return float(self.down_mbit.get(host, self.default_mbit))


@dataclass(kw_only=True, slots=True, frozen=True)
class AdmissionConfig:
    """Geometry and constraints of admission.

    A train batch holds ``train_batch_groups`` (B) prompt groups of ``group_size`` (G) trajectories and
    is split into ``mini_batches`` (K) mini-batches of B/K groups, one optimizer step each; each
    mini-batch is split across ``dp_ranks`` (D) ranks, whole groups per rank, and on each rank into
    micro-batches of at most ``token_budget`` tokens, with the same micro-batch count on every rank.

    Example:
        >>> cfg = AdmissionConfig(train_batch_groups=64, group_size=8, mini_batches=4, dp_ranks=2,
        ...                       token_budget=16384, policy="mini_batch",
        ...                       quotas=(Quota(column="data_source", shares={"math": 0.5, "chat": 0.5}),))
        >>> cfg.groups_per_mini_batch, cfg.quota_counts()[0]
        (16, {'math': 32, 'chat': 32})
    """

    train_batch_groups: int
    """B: prompt groups per train batch."""
    group_size: int
    """G: trajectories (responses) per prompt group."""
    mini_batches: int = 1
    """K: mini-batches (optimizer steps) per train batch; must divide B."""
    dp_ranks: int = 1
    """D: data-parallel ranks; B/K must be >= D (whole groups per rank)."""
    token_budget: int = 16384
    """Maximum prompt+response tokens of one micro-batch; a longer trajectory is placed alone, flagged."""
    cost_model: CostModel = "tokens"
    """Cost of a trajectory for DP balancing: ``tokens`` (length) or ``sq_tokens`` (length squared)."""
    quotas: tuple[Quota, ...] = ()
    """Per-train-batch quotas, all kept exactly by every completed train batch."""
    filters: Filters = field(default_factory=Filters)
    """Group filters (DAPO uniform reward, finish reasons)."""
    max_staleness: int | None = None
    """Bound on architectural staleness tK - policy_version_min of every admitted row; None = unbounded."""
    policy: Policy = "mini_batch"
    """``train_batch`` (baseline), ``mini_batch`` (constraint-preserving early admission), ``colocated``,
    ``streaming`` (quota-free, in completion order: the peers' reference)."""
    prefer: Preference = "scarce"
    """Choice among feasible compositions: ``scarce`` (classes least covered by completed groups first, then
    oldest) or ``oldest`` (lowest policy version first)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """GRPO advantages (computed by the planner) and the clip range of the trainer's loss."""
    assignment: Assignment = "links"
    """How a mini-batch's groups are split over the ranks: ``links`` (where moving them is cheapest: the busiest
    link's bytes / rate as low as it goes while no rank's cost exceeds LPT's largest by more than 5%; a rank reads
    the groups of a store on its own host first) or ``tokens`` (LPT on the cost model alone)."""
    links: LinkModel = field(default_factory=LinkModel)
    """Hosts of the store nodes and the ranks, and link rates (``assignment="links"``)."""

    def __post_init__(self) -> None:
        for name in ("train_batch_groups", "group_size", "mini_batches", "dp_ranks", "token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                msg = f"AdmissionConfig.{name} must be a positive int, got {v!r}"
                raise ValueError(msg)
        if self.train_batch_groups % self.mini_batches:
            msg = (f"AdmissionConfig.mini_batches={self.mini_batches} must divide "
                   f"train_batch_groups={self.train_batch_groups}")
            raise ValueError(msg)
        if self.groups_per_mini_batch < self.dp_ranks:
            msg = (f"AdmissionConfig: {self.groups_per_mini_batch} groups per mini-batch cannot cover "
                   f"dp_ranks={self.dp_ranks} with whole groups per rank")
            raise ValueError(msg)
        if self.cost_model not in COST_MODELS:
            msg = f"AdmissionConfig.cost_model must be one of {COST_MODELS}, got {self.cost_model!r}"
            raise ValueError(msg)
        if self.policy not in POLICIES:
            msg = f"AdmissionConfig.policy must be one of {POLICIES}, got {self.policy!r}"
            raise ValueError(msg)
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            msg = f"AdmissionConfig.max_staleness must be None or an int >= 0, got {self.max_staleness!r}"
            raise ValueError(msg)
        if self.assignment not in ASSIGNMENTS:
            msg = f"AdmissionConfig.assignment must be one of {ASSIGNMENTS}, got {self.assignment!r}"
            raise ValueError(msg)
        if self.prefer not in ("scarce", "oldest"):
            msg = f"AdmissionConfig.prefer must be 'scarce' or 'oldest', got {self.prefer!r}"
            raise ValueError(msg)
        if not isinstance(self.quotas, tuple):
            msg = f"AdmissionConfig.quotas must be a tuple of Quota, got {type(self.quotas).__name__}"
            raise ValueError(msg)
        cols = [q.column for q in self.quotas]
        if len(set(cols)) != len(cols):
            msg = f"AdmissionConfig.quotas: more than one quota on a column {cols}"
            raise ValueError(msg)
        self.quota_counts()  # validates sums and integrality

    @property
    def groups_per_mini_batch(self) -> int:
        """B/K."""
        return self.train_batch_groups // self.mini_batches

    @property
    def quota_columns(self) -> tuple[str, ...]:
        """Columns that quotas are over, in declaration order."""
        return tuple(q.column for q in self.quotas)

    def quota_counts(self) -> list[dict[str, int]]:
        """Exact groups per train batch for each value, one dict per quota (shares turned into counts)."""
        b = self.train_batch_groups
        out: list[dict[str, int]] = []
        for q in self.quotas:
            if q.counts is not None:
                counts = {str(k): int(v) for k, v in q.counts.items()}
            else:
                if q.shares is None:  # excluded by Quota.__post_init__
                    msg = f"Quota on {q.column!r} has neither counts nor shares"
                    raise ValueError(msg)
                counts = {}
                for k, s in q.shares.items():
                    c = s * b
                    if abs(c - round(c)) > 1e-6:
                        msg = f"Quota on {q.column!r}: share {s!r} of {k!r} times B={b} is not an integer"
                        raise ValueError(msg)
                    counts[str(k)] = round(c)
            if sum(counts.values()) != b:
                msg = f"Quota on {q.column!r}: counts {counts} sum to {sum(counts.values())}, not B={b}"
                raise ValueError(msg)
            out.append(counts)
        return out
