"""Quota feasibility as a small integer program solved by HiGHS (scipy.optimize.milp).

Groups are aggregated into *quota classes*: one class per distinct tuple of values of the quota
columns. Variables are per class, not per group, so the program stays small whatever the frame size.

For a candidate mini-batch of ``size`` groups, with ``avail[c]`` completed unadmitted groups and
``supply[c]`` further groups expected (in flight) in class c, and ``need[q][v]`` groups still owed to
value v of quota q in the current train batch (``total`` groups owed in all):

    x[c] in {0..avail[c]}                   groups of class c admitted now
    z[c] in {x[c]..avail[c] + supply[c]}    groups of class c in the rest of the train batch, now included
    sum_c x[c] = size
    sum_c z[c] = total
    sum_{c: value_q(c) = v} z[c] = need[q][v]   for every quota q and value v

A solution exists iff a mini-batch of ``size`` completed groups can be admitted now AND the train
batch's remaining quotas can still be met afterwards by the groups not admitted (completed or in
flight). The objective (minimise ``sum weight[c] x[c]``) only chooses among feasible compositions.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _scipy() -> Any:
    """scipy's milp pieces, imported on first use (``pip install knittrans[admission]``)."""
    try:
        from scipy import optimize, sparse
    except ImportError as exc:  # pragma: no cover - depends on the environment
        msg = "the admission planner's feasibility test needs scipy: pip install 'knittrans[admission]'"
        raise ImportError(msg) from exc
    return optimize, sparse


def solve_composition(
    *,
    avail: np.ndarray,
    supply: np.ndarray,
    class_values: np.ndarray,
    need: list[np.ndarray],
    total: int,
    size: int,
    weight: np.ndarray | None = None,
) -> np.ndarray | None:
    """Groups to admit per class, or None when no feasible composition exists.

    Args:
        avail: [C] int, completed admissible unadmitted groups per class.
        supply: [C] int, groups per class expected later (in flight); 0 for whole-batch admission.
        class_values: [C, Q] int, index of each class's value in quota q's value list.
        need: Q arrays, ``need[q][v]`` groups still owed to value v of quota q (>= 0).
        total: groups still owed to the train batch (equals ``need[q].sum()`` for every q).
        size: groups to admit now (<= total).
        weight: [C] float, preference (lower first) among feasible compositions; default 0.

    Returns:
        [C] int array ``x`` with ``x.sum() == size``, or None.
    """
    avail = np.asarray(avail, dtype=np.int64)
    supply = np.asarray(supply, dtype=np.int64)
    c = avail.shape[0]
    if size > total or size < 0:
        msg = f"solve_composition: size={size} must be in [0, total={total}]"
        raise ValueError(msg)
    for q, nq in enumerate(need):
        if (nq < 0).any() or int(nq.sum()) != total:
            msg = f"solve_composition: need[{q}]={nq.tolist()} is negative or does not sum to total={total}"
            raise ValueError(msg)
    # cheap necessary conditions (the incremental fast path: most calls stop here)
    if c == 0 or int(avail.sum()) < size or int((avail + supply).sum()) < total:
        return None
    if size == 0 and total == 0:
        return np.zeros(c, dtype=np.int64)
    # variables: [x_0..x_{C-1}, z_0..z_{C-1}]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    r = 0

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        nonlocal r
        for j, a in entries:
            rows.append(r)
            cols.append(j)
            vals.append(a)
        lo.append(lb)
        hi.append(ub)
        r += 1

    add_row([(j, 1.0) for j in range(c)], size, size)
    add_row([(c + j, 1.0) for j in range(c)], total, total)
    for q, nq in enumerate(need):
        for v in range(nq.shape[0]):
            members = np.flatnonzero(class_values[:, q] == v)
            add_row([(c + int(j), 1.0) for j in members], float(nq[v]), float(nq[v]))
    for j in range(c):  # z_j - x_j >= 0
        add_row([(c + j, 1.0), (j, -1.0)], 0.0, np.inf)
    optimize, sparse = _scipy()
    a = sparse.coo_array((vals, (rows, cols)), shape=(r, 2 * c)).tocsr()
    obj = np.zeros(2 * c)
    if weight is not None:
        obj[:c] = np.asarray(weight, dtype=np.float64)
    ub = np.concatenate([avail, avail + supply]).astype(np.float64)
    res = optimize.milp(obj, constraints=optimize.LinearConstraint(a, np.array(lo), np.array(hi)),
               integrality=np.ones(2 * c), bounds=optimize.Bounds(np.zeros(2 * c), ub),
               options={"presolve": True})
    if res.status != 0 or res.x is None:
        if res.status not in (0, 2):  # 2 = infeasible
            log.warning("milp ended with status %s (%s); treating as infeasible", res.status, res.message)
        return None
    x = np.rint(res.x[:c]).astype(np.int64)
    if int(x.sum()) != size:
        msg = f"milp returned a composition of {int(x.sum())} groups, expected {size}"
        raise RuntimeError(msg)
    return x
