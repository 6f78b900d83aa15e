"""Running a policy over seeds, the trainer's calibration, and the matched-throughput lookahead search.

:func:`run_policy` averages :func:`~bench.staleness.sim.simulate` over seeds; :func:`calibrate` finds
the fastest trainer that the ``train_batch`` policy still keeps busy; :func:`match_throughput` finds
the smallest ``mini_batch`` (or ``streaming``) lookahead whose throughput is at least ``train_batch``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.staleness.sim import simulate
from bench.staleness.workload import SimParams


def run_policy(p: SimParams, policy: str, lookahead: int, seeds: list[int]) -> dict[str, Any]:
    """Mean of :func:`simulate` over seeds (per train batch: the mean over seeds; per step: the first seed's)."""
    rs = [simulate(p, policy, lookahead, s) for s in seeds]
    out: dict[str, Any] = {key: float(np.mean([r[key] for r in rs]))
                           for key, val in rs[0].items() if not isinstance(val, list)}
    per_tb = [r["per_train_batch_arch_mean"] for r in rs]
    out["per_train_batch_arch_mean"] = [float(np.mean(x)) for x in zip(*per_tb, strict=False)]
    out["arch_max"] = float(max(r["arch_max"] for r in rs))
    out["quota_violations"] = int(sum(r["quota_violations"] for r in rs))
    out["per_step_arch_mean"] = rs[0]["per_step_arch_mean"]
    out["lookahead_groups"] = lookahead
    return out


def calibrate(p: SimParams, seed: int, target_busy: float) -> float:
    """Smallest trainer s/token (fastest trainer) keeping the train_batch trainer >= target busy (bisection)."""
    lo, hi = 1e-7, 1e-3
    for _ in range(14):
        mid = (lo * hi) ** 0.5
        p.train_s_per_token = mid
        idle = simulate(p, "train_batch", 2 * p.groups, seed)["trainer_idle_fraction"]
        if 1.0 - idle >= target_busy:
            hi = mid
        else:
            lo = mid
    return hi


def match_throughput(p: SimParams, seeds: list[int], target: float,
                     policy: str = "mini_batch") -> tuple[dict[str, Any], list[dict[str, float]]]:
    """``policy`` (``mini_batch`` or ``streaming``) at the smallest lookahead L whose throughput is at least
    ``target`` (``train_batch``'s).

    Coarse steps of one mini-batch, then bisection down to one group between the last miss and the
    hit; without a hit, the last lookahead tried (4B). Returns that run and every lookahead tried.
    """
    b, m = p.groups, p.groups // p.mini_batches
    search: list[dict[str, float]] = []

    def try_lookahead(lookahead: int) -> dict[str, Any]:
        r = run_policy(p, policy, lookahead, seeds)
        search.append({"lookahead": lookahead, "throughput": r["throughput"], "arch_mean": r["arch_mean"]})
        print(f"  {policy} L={lookahead}: throughput {r['throughput']:.2f} vs train_batch "
              f"{target:.2f}, arch_mean {r['arch_mean']:.3f}", flush=True)
        return r

    def matched(r: dict[str, Any]) -> bool:
        return bool(r["throughput"] >= target)

    found, low = None, 0
    for lookahead in range(m, 4 * b + 1, m):
        r = try_lookahead(lookahead)
        if matched(r):
            found = r
            break
        low = lookahead
    if found is None:
        found = r
    else:
        high = found["lookahead_groups"]
        while high - low > 1:
            mid = (low + high) // 2
            r = try_lookahead(mid)
            if matched(r):
                found, high = r, mid
            else:
                low = mid
    return found, search
