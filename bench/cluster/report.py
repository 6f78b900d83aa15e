"""The cluster benchmark's numbers: medians per (N, D, workload, path), the link arithmetic's predictions, the plot.

Prediction (written before the measurement, from the bytes each path must move and the link rate R, per
train step): verl moves the whole padded batch into the driver (the rollouts' ``DataProto``) and then out
of it (the ranks' chunks) one after the other, so ``T_verl = (B_gather + B_dispatch) / R``; TransferQueue
and knittrans move each rank's rows straight from the stores, so their busiest link is a rank's
(``max rank bytes``) or a store's (``all ranks' bytes / N``): ``T = max(max_rank, total / N) / R``. A step
is ``T_verl + C`` for verl (its data must all arrive before a rank computes) and ``max(C, T) + min(C, T) / m``
for the prefetching paths (``C`` the busiest rank's compute, ``m`` its micro-batches: only the first one's
transfer is exposed, or the compute hides under the transfer).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from bench._common import pyplot

PATHS = ("verl", "transferqueue", "knittrans")


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def path_numbers(recs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of one path's measured steps: transfer per micro-batch, step, driver-link bytes, busiest link, CPU."""
    out = {
        "transfer_ms_per_micro_batch": _med([1e3 * r["transfer_s"] / r["micro_batches"] for r in recs]),
        "transfer_ms_per_step": _med([1e3 * r["transfer_s"] for r in recs]),
        "step_ms": _med([1e3 * r["step_s"] for r in recs]),
        "driver_link_bytes": _med([r["driver_rx"] + r["driver_tx"] for r in recs]),
        "rank_bytes_max": _med([max(r["rank_bytes"]) for r in recs]),
        "rank_bytes_total": _med([sum(r["rank_bytes"]) for r in recs]),
    }
    hosts = [r["hosts"] for r in recs if r.get("hosts")]
    if hosts:
        out["busiest_link_bytes"] = _med([max(max(h["rx"]), max(h["tx"])) for h in hosts])
        out["cpu_util_max"] = max(_med([h["cpu_cores"][i] for h in hosts]) for i in range(len(hosts[0]["cpu_cores"])))
        out["cpu_util_max"] /= os.cpu_count() or 1
    return out


def predict(kind_raw: dict[str, Any], n: int, link_mbit: float, ms_per_ktok: float, d: int) -> dict[str, float]:
    """The link arithmetic of the module docstring, per path: transfer per step and step (ms)."""
    rate = link_mbit * 1e6 / 8  # bytes/s
    steps = kind_raw["steps"]
    m = max(kind_raw["micro_batches_per_rank"])
    c = ms_per_ktok * _med([float(t) for t in kind_raw["tokens_per_step"]]) / 1e3 / d  # ms, an even split
    verl = steps["verl"]
    gather = _med([float(b) for b in kind_raw["verl_rollout_bytes"][1:]])
    t = {"verl": 1e3 * _med([(gather + r["dispatched_bytes"]) / rate for r in verl])}
    for p in ("transferqueue", "knittrans"):
        t[p] = 1e3 * _med([max(max(r["rank_bytes"]), sum(r["rank_bytes"]) / n) / rate for r in steps[p]])
    out = {f"transfer_ms_{p}": t[p] for p in PATHS}
    out["step_ms_verl"] = t["verl"] + c
    for p in ("transferqueue", "knittrans"):
        out[f"step_ms_{p}"] = max(c, t[p]) + min(c, t[p]) / m
    return out


def summarize(runs: list[dict[str, Any]], link_mbit: float, ms_per_ktok: float) -> tuple[dict, dict, dict]:
    """``metrics``, ``ratios`` and ``predicted`` of the result file from every (N, D) run's raw records."""
    metrics: dict[str, Any] = {"cluster_link_mbit": link_mbit, "compute_ms_per_ktok": ms_per_ktok}
    ratios: dict[str, float] = {}
    predicted: dict[str, float] = {}
    cpu = 0.0
    largest_d = {run["n"]: max(r["d"] for r in runs if r["n"] == run["n"]) for run in runs}
    for run in runs:
        n, d = run["n"], run["d"]
        for kind in ("text", "mm"):
            if kind not in run["raw"]:
                continue
            kr = run["raw"][kind]
            nums = {p: path_numbers(kr["steps"][p]) for p in PATHS}
            for p, vals in nums.items():
                for k, v in vals.items():
                    metrics[f"cluster_{k}_{p}_{kind}_n{n}_d{d}"] = v
                cpu = max(cpu, vals.get("cpu_util_max", 0.0))
            pred = predict(kr, n, link_mbit, ms_per_ktok, d)
            for k, v in pred.items():
                predicted[f"cluster_{k}_{kind}_n{n}_d{d}"] = v
            if d != largest_d[n]:
                continue
            for what, m_key, p_key in (("transfer", "transfer_ms_per_micro_batch", "transfer_ms"),
                                       ("step", "step_ms", "step_ms")):
                for peer, name in (("verl", "verl"), ("transferqueue", "transferqueue")):
                    key = f"cluster_{what}_vs_{name}_{kind}_n{n}"
                    ratios[key] = nums[peer][m_key] / nums["knittrans"][m_key]
                    predicted[key] = pred[f"{p_key}_{peer}"] / pred[f"{p_key}_knittrans"]
    metrics["cluster_cpu_util_max"] = cpu
    return metrics, ratios, predicted


def plot(path: Path, metrics: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Transfer per micro-batch and step time against N (largest D), per path, text and multimodal."""
    plt = pyplot()
    if plt is None:
        return
    kinds = [k for k in ("text", "mm") if any(k in r["raw"] for r in runs)]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(10, 3.6 * len(kinds)), squeeze=False)
    ns = sorted({r["n"] for r in runs})
    d_of = {n: max(r["d"] for r in runs if r["n"] == n) for n in ns}
    for row, kind in zip(axes, kinds, strict=True):
        for ax, (what, label) in zip(row, (("transfer_ms_per_micro_batch", "transfer per micro-batch (ms)"),
                                           ("step_ms", "train step (ms)")), strict=True):
            for p in PATHS:
                ys = [metrics.get(f"cluster_{what}_{p}_{kind}_n{n}_d{d_of[n]}") for n in ns]
                ax.plot(ns, ys, marker="o", label=p)
            ax.set_xlabel("rollout/store hosts N (largest D)")
            ax.set_ylabel(label)
            ax.set_yscale("log")
            ax.set_title(f"{kind}: {label}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
