"""Admission: pure planning over a polars metadata frame.

Policies (train-batch baseline, constraint-preserving mini-batch, colocated reference), quota
feasibility (integer program), DP balancing, micro-batch packing and staleness accounting. Imports
only polars, numpy, scipy, pydantic and ``schemas``.

Example:
    >>> from admission import AdmissionConfig, Planner, Quota
    >>> planner = Planner(AdmissionConfig(train_batch_groups=64, group_size=8, mini_batches=4, dp_ranks=2,
    ...                                   quotas=(Quota(column="data_source", shares={"math": .5, "chat": .5}),)))
"""

from __future__ import annotations

from admission.assignment import assign_groups, balance_groups
from admission.config import AdmissionConfig, Filters, GrpoConfig, LinkModel, Quota
from admission.feasibility import solve_composition
from admission.packing import advantage_expr, pack_micro_batches, trajectory_cost
from admission.planner import CONSUMED_SCHEMA, REQUIRED_COLUMNS, InflightSupply, Planner, PlanResult, plan
from admission.staleness import per_step, staleness_exprs, summary
from admission.state import PlannerState

__all__ = [
    "CONSUMED_SCHEMA",
    "REQUIRED_COLUMNS",
    "AdmissionConfig",
    "Filters",
    "GrpoConfig",
    "InflightSupply",
    "LinkModel",
    "PlanResult",
    "Planner",
    "PlannerState",
    "Quota",
    "advantage_expr",
    "assign_groups",
    "balance_groups",
    "pack_micro_batches",
    "per_step",
    "plan",
    "solve_composition",
    "staleness_exprs",
    "summary",
    "trajectory_cost",
]
