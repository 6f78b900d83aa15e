"""The cluster benchmark's numbers: medians per (N, D, workload, path), link bounds, the cluster model's predictions.

Per measured step and path (the paths take turns, so a step's window holds only its own traffic): the bytes
each host's link carried each way (the veth counters, :class:`bench.cluster.topology.Sampler`), its **link
bound** (the busiest link's bytes / the link rate: no schedule moves them faster) and the whole machine's CPU
busy fraction. Each (N, D, workload, path) point is predicted by :mod:`bench.cluster.model` from those bytes and
the bench's calibration, and set against the measured medians. Transfer medians are per step (each path's
transfer summed over the step's micro-batches on its busiest rank, its controller's share included).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench._common import pyplot
from bench.cluster.model import Costs, Load, rel_error, step_s, transfer_s

PATHS = ("verl", "transferqueue", "knittrans", "knittrans_hash")
PEERS = ("verl", "transferqueue")


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def link_bound_s(hosts: dict[str, Any], link_mbit: float) -> float:
    """The busiest link's bytes over the link rate (s): every host's link each way, from the step's counters."""
    rate = link_mbit * 1e6 / 8
    return max(max(hosts["rx"]), max(hosts["tx"])) / rate


def load_of(path: str, rec: dict[str, Any]) -> Load:
    """One measured step as the model's :class:`~bench.cluster.model.Load` (the sampled bytes, the counts)."""
    hosts = rec["hosts"]
    busiest = max(max(hosts["rx"]), max(hosts["tx"]))
    if path == "verl":
        return Load(busiest_link_bytes=busiest, driver_in_bytes=rec["driver_rx"], driver_out_bytes=rec["driver_tx"],
                    controller_bytes=rec["dispatched_bytes"], micro_batches=rec["micro_batches"])
    if path == "transferqueue":
        return Load(busiest_link_bytes=busiest, micro_batches=rec["micro_batches"], keys=rec["keys"], lookups=1)
    images = max(r.get("images_processed", 0) for r in rec["ranks"])
    return Load(busiest_link_bytes=busiest, micro_batches=rec["micro_batches"], images_processed=images,
                plan_s=rec["plan_s"])


def path_numbers(path: str, recs: list[dict[str, Any]], link_mbit: float, ms_per_ktok: float,
                 costs: Costs) -> dict[str, float]:
    """Medians of one path's measured steps and the model's prediction of them."""
    rate = link_mbit * 1e6 / 8
    out = {
        "transfer_ms_per_micro_batch": _med([1e3 * r["transfer_s"] / r["micro_batches"] for r in recs]),
        "transfer_ms_per_step": _med([1e3 * r["transfer_s"] for r in recs]),
        "step_ms": _med([1e3 * r["step_s"] for r in recs]),
        "driver_link_bytes": _med([r["driver_rx"] + r["driver_tx"] for r in recs]),
        "rank_bytes_max": _med([max(r["rank_bytes"]) for r in recs]),
        "rank_bytes_total": _med([sum(r["rank_bytes"]) for r in recs]),
    }
    hosts = [r for r in recs if r.get("hosts")]
    if not hosts:
        return out
    out["busiest_link_bytes"] = _med([max(max(r["hosts"]["rx"]), max(r["hosts"]["tx"])) for r in hosts])
    out["link_bound_ms"] = _med([1e3 * link_bound_s(r["hosts"], link_mbit) for r in hosts])
    out["transfer_vs_link_bound"] = _med([r["transfer_s"] / max(link_bound_s(r["hosts"], link_mbit), 1e-9)
                                          for r in hosts])
    out["machine_cpu_max"] = max(r["hosts"]["machine_cpu"] for r in hosts)
    pred_t, pred_s = [], []
    for r in hosts:
        t = transfer_s(path, load_of(path, r), rate, costs)
        compute = ms_per_ktok * max(x["tokens"] for x in r["ranks"]) / 1e6
        pred_t.append(1e3 * t)
        pred_s.append(1e3 * step_s(path, t, compute, r["micro_batches"]))
    out["model_transfer_ms_per_step"], out["model_step_ms"] = _med(pred_t), _med(pred_s)
    return out


def summarize(runs: list[dict[str, Any]], link_mbit: float, ms_per_ktok: float) -> tuple[dict, dict, dict]:
    """``metrics``, ``ratios`` and ``predicted`` of the result file from every (N, D) run's raw records."""
    metrics: dict[str, Any] = {"cluster_link_mbit": link_mbit, "compute_ms_per_ktok": ms_per_ktok}
    ratios: dict[str, float] = {}
    predicted: dict[str, float] = {}
    cpu, errors = 0.0, []
    largest_d = {run["n"]: max(r["d"] for r in runs if r["n"] == run["n"]) for run in runs}
    for run in runs:
        n, d = run["n"], run["d"]
        costs = Costs(**{k: v for k, v in run["raw"]["calibration"].items() if k in Costs.__dataclass_fields__})
        for kind, kr in run["raw"]["workloads"].items():
            nums = {p: path_numbers(p, kr["steps"][p], link_mbit, ms_per_ktok, costs) for p in PATHS}
            at = f"{kind}_n{n}_d{d}"
            for p, vals in nums.items():
                for k, v in vals.items():
                    if k.startswith("model_"):
                        predicted[f"cluster_{k[6:]}_{p}_{at}"] = v
                    else:
                        metrics[f"cluster_{k}_{p}_{at}"] = v
                cpu = max(cpu, vals.get("machine_cpu_max", 0.0))
                if "model_transfer_ms_per_step" in vals:
                    errors += [rel_error(vals["model_transfer_ms_per_step"], vals["transfer_ms_per_step"]),
                               rel_error(vals["model_step_ms"], vals["step_ms"])]
                if "transfer_vs_link_bound" in vals and p != "knittrans_hash":
                    ratios[f"cluster_{p}_transfer_vs_link_bound_{at}"] = vals["transfer_vs_link_bound"]
            ratios[f"cluster_coordinated_vs_hash_transfer_{at}"] = (
                nums["knittrans_hash"]["transfer_ms_per_step"] / nums["knittrans"]["transfer_ms_per_step"])
            if d != largest_d[n]:
                continue
            for what, key in (("transfer", "transfer_ms_per_step"), ("step", "step_ms")):
                for peer in PEERS:
                    ratios[f"cluster_{what}_vs_{peer}_{kind}_n{n}"] = nums[peer][key] / nums["knittrans"][key]
    metrics["cluster_cpu_util_max"] = cpu
    metrics["cluster_model_max_rel_error"] = max(errors) if errors else float("nan")
    return metrics, ratios, predicted


def plot(path: Path, metrics: dict[str, Any], predicted: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Transfer per step and step time against N (largest D), per path (measured: solid; the model: dotted), text
    and multimodal."""
    plt = pyplot()
    if plt is None:
        return
    kinds = [k for k in ("text", "mm") if any(k in r["raw"]["workloads"] for r in runs)]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(10, 3.6 * len(kinds)), squeeze=False)
    ns = sorted({r["n"] for r in runs})
    d_of = {n: max(r["d"] for r in runs if r["n"] == n) for n in ns}
    for row, kind in zip(axes, kinds, strict=True):
        for ax, (what, label) in zip(row, (("transfer_ms_per_step", "transfer per step (ms)"),
                                           ("step_ms", "train step (ms)")), strict=True):
            for p in PATHS:
                keys = [f"cluster_{what}_{p}_{kind}_n{n}_d{d_of[n]}" for n in ns]
                (line,) = ax.plot(ns, [metrics.get(k) for k in keys], marker="o", label=p)
                ax.plot(ns, [predicted.get(k) for k in keys], linestyle=":", color=line.get_color())
            ax.set_xlabel("rollout/store hosts N (largest D)")
            ax.set_ylabel(label)
            ax.set_yscale("log")
            ax.set_title(f"{kind}: {label} (dotted: model)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
