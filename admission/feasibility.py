"""Quota feasibility as a small integer program solved by HiGHS (scipy.optimize.milp).

Groups are aggregated into *quota classes*: one class per distinct tuple of values of the quota
columns (:func:`quota_classes`, with each class's in-flight supply from :func:`inflight_counts`).
Variables are per class, not per group, so the program stays small whatever the frame size.

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

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from admission.config import AdmissionConfig

log = logging.getLogger(__name__)

InflightSupply = pl.DataFrame | Mapping[Any, int] | int | None
"""Groups dispatched but not complete, per quota class (see :mod:`admission.planner`)."""
_MAX_CLASSES = 4096


def _class_key(values: Any, q: int) -> tuple[str, ...]:
    if q == 1 and not isinstance(values, tuple):
        return (str(values),)
    if not isinstance(values, tuple) or len(values) != q:
        msg = f"in-flight key {values!r} is not a tuple of {q} quota values"
        raise ValueError(msg)
    return tuple(str(v) for v in values)


def inflight_counts(inflight: InflightSupply, config: AdmissionConfig) -> dict[tuple[str, ...], int]:
    """Groups expected per quota class (a tuple of quota values; ``()`` without quotas), from any
    form of ``inflight`` (see :mod:`admission.planner`); ``{}`` for None."""
    q = len(config.quotas)
    out: dict[tuple[str, ...], int] = {}
    if inflight is None:
        return out
    if isinstance(inflight, int):
        if q:
            msg = f"inflight given as an int ({inflight}) but quotas on {config.quota_columns} need per-class counts"
            raise ValueError(msg)
        return {(): inflight}
    if isinstance(inflight, pl.DataFrame):
        cols = list(config.quota_columns)
        missing = [c for c in cols if c not in inflight.columns]
        if missing:
            msg = f"inflight frame lacks quota column(s) {missing}"
            raise ValueError(msg)
        cnt = pl.col("count").sum() if "count" in inflight.columns else pl.len()
        if not cols:
            return {(): int(inflight.select(cnt).item())}
        agg = inflight.group_by(cols).agg(cnt.alias("_n"))
        for row in agg.iter_rows():
            out[tuple(str(v) for v in row[:-1])] = int(row[-1])
        return out
    for k, n in inflight.items():
        if n < 0:
            msg = f"in-flight count for {k!r} is negative: {n}"
            raise ValueError(msg)
        key = _class_key(k, q) if q else ()
        out[key] = out.get(key, 0) + int(n)
    return out


@dataclass(slots=True)
class QuotaClasses:
    """The quota classes of one planning call: one per tuple of quota values among candidates or in flight."""

    of: np.ndarray
    """[N] class of each candidate group."""
    values: np.ndarray
    """[C, Q] index of each class's value in quota q's value list."""
    supply: np.ndarray
    """[C] groups per class expected later (in flight); B per class when the supply is unknown."""


def quota_classes(cand_keys: list[tuple[str, ...]], config: AdmissionConfig, inflight: InflightSupply) -> QuotaClasses:
    """Classes of every tuple of quota values seen among candidates (``cand_keys``, one per candidate group)
    or in flight, with their in-flight supply."""
    quota_counts = config.quota_counts()
    value_lists = [list(c) for c in quota_counts]
    q = len(value_lists)
    in_flight = inflight_counts(inflight, config)
    extra_keys: list[tuple[str, ...]] = []
    if inflight is None:  # unknown supply: every quota class may still arrive (if the product is small)
        n_product = int(np.prod([len(v) for v in value_lists])) if value_lists else 1
        extra_keys = list(itertools.product(*value_lists)) if n_product <= _MAX_CLASSES else []
    classes: dict[tuple[str, ...], int] = {}
    for key in [*cand_keys, *in_flight, *extra_keys]:
        if key not in classes and all(key[i] in quota_counts[i] for i in range(q)):
            classes[key] = len(classes)
    if not q:
        classes.setdefault((), 0)
    n_cls = len(classes)
    values = np.array([[value_lists[i].index(key[i]) for i in range(q)] for key in classes],
                      dtype=np.int64).reshape(n_cls, q)
    supply = np.zeros(n_cls, dtype=np.int64)
    for key, n in in_flight.items():
        if key in classes:
            supply[classes[key]] += n
    if inflight is None:
        supply[:] = config.train_batch_groups
    return QuotaClasses(of=np.array([classes[k] for k in cand_keys], dtype=np.int64), values=values, supply=supply)


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
    _check_totals(need, total, size)
    # cheap necessary conditions (the incremental fast path: most calls stop here)
    if c == 0 or int(avail.sum()) < size or int((avail + supply).sum()) < total:
        return None
    if size == 0 and total == 0:
        return np.zeros(c, dtype=np.int64)
    if c == 1 and not need:  # no quotas, one class: the checks above are the whole program
        return np.array([size], dtype=np.int64)
    optimize, sparse = _scipy()
    (rows, cols, vals), lo, hi = _constraints(c, class_values, need, total, size)
    a = sparse.coo_array((vals, (rows, cols)), shape=(len(lo), 2 * c)).tocsr()
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


def _check_totals(need: list[np.ndarray], total: int, size: int) -> None:
    if size > total or size < 0:
        msg = f"solve_composition: size={size} must be in [0, total={total}]"
        raise ValueError(msg)
    for q, nq in enumerate(need):
        if (nq < 0).any() or int(nq.sum()) != total:
            msg = f"solve_composition: need[{q}]={nq.tolist()} is negative or does not sum to total={total}"
            raise ValueError(msg)


def _constraints(c: int, class_values: np.ndarray, need: list[np.ndarray], total: int,
                 size: int) -> tuple[tuple[list[int], list[int], list[float]], list[float], list[float]]:
    """The program's rows over variables ``[x_0..x_{C-1}, z_0..z_{C-1}]``: (COO entries, lower, upper bounds)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        for j, a in entries:
            rows.append(len(lo))
            cols.append(j)
            vals.append(a)
        lo.append(lb)
        hi.append(ub)

    add_row([(j, 1.0) for j in range(c)], size, size)  # sum x = size
    add_row([(c + j, 1.0) for j in range(c)], total, total)  # sum z = total
    for q, nq in enumerate(need):  # z meets every quota value's need
        for v in range(nq.shape[0]):
            members = np.flatnonzero(class_values[:, q] == v)
            add_row([(c + int(j), 1.0) for j in members], float(nq[v]), float(nq[v]))
    for j in range(c):  # z_j - x_j >= 0
        add_row([(c + j, 1.0), (j, -1.0)], 0.0, np.inf)
    return (rows, cols, vals), lo, hi
