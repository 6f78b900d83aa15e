"""Architectural-staleness simulator: train-batch vs mini-batch admission at matched throughput.

``python -m bench.staleness [--quick] [--math-sigma 0.9] --out results/staleness.json``

Variant flags (to locate what bounds the reduction): ``--math-sigma`` (tail length), ``--sync
per_train_batch`` (sync granularity), ``--version-at start`` (version semantics: no in-flight weight
updates), ``--trainer-slowdown F`` (optimizer-step time relative to generation latency: F times the
calibrated trainer), ``--loader-order slow_first``. Each run reports the lookahead search it did.

The trainer is calibrated first (:func:`~bench.staleness.search.calibrate`); ``train_batch`` (L = 2B)
and ``colocated`` (L = B) run at fixed lookaheads, ``mini_batch`` at the smallest lookahead that
matches ``train_batch``'s throughput (:func:`~bench.staleness.search.match_throughput`); then the
planner's decision time over 100k trajectories and at cluster scale (1,000 store nodes, 512 ranks, 4,096 groups
in one mini-batch; the rank split by links and by tokens) (:mod:`bench.staleness.plan_time`). The model is in
:mod:`bench.staleness.sim`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._common import pyplot, timer, write_result
from bench.staleness.plan_time import plan_time_metrics
from bench.staleness.search import calibrate, match_throughput, run_policy
from bench.staleness.workload import SimParams


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the result document written to ``--out``."""
    args = _parser().parse_args(argv)
    p = SimParams(train_batches=args.train_batches or (6 if args.quick else 20), math_sigma=args.math_sigma,
                  groups=args.groups, group_size=args.group_size, mini_batches=args.mini_batches, slots=args.slots,
                  sync=args.sync, version_at=args.version_at,
                  loader_order=args.loader_order, loader_mix=args.loader_mix, dispatch=args.dispatch,
                  prefer=args.prefer)
    seeds = list(args.seeds)
    with timer() as wall:
        p.train_s_per_token = args.trainer_slowdown * calibrate(
            SimParams(**{**asdict(p), "train_batches": min(p.train_batches, 6)}), 0, target_busy=0.92)
        p.trainer_slowdown = args.trainer_slowdown
        res, curves = _run_policies(p, seeds)
        plan_ms = plan_time_metrics()
    _plot_curves(Path(args.out).with_name(Path(args.out).stem + "_curves.png"), curves)
    mb = res["mini_batch"]
    metrics: dict[str, Any] = {
        f"{pol}_{key}": val for pol, r in res.items() for key, val in r.items() if not isinstance(val, list)
    }
    metrics.update({
        "mini_batch_lookahead_groups": mb["lookahead_groups"],
        "quota_violations": int(sum(r["quota_violations"] for pol, r in res.items() if pol != "streaming")),
        "streaming_lookahead_groups": res["streaming"]["lookahead_groups"],
        "lookahead_search_streaming": curves["streaming"],
        "curves": curves,
        **plan_ms,
        "wall_s": wall[0],
        "lookahead_search": curves["mini_batch"],
    })
    ratios = _ratios(res)
    params = {**asdict(p), "seeds": seeds, "quick": args.quick,
              "lookahead": {"train_batch": 2 * p.groups, "colocated": p.groups, "mini_batch": mb["lookahead_groups"],
                            "streaming": res["streaming"]["lookahead_groups"]}}
    doc = write_result(args.out, metrics, ratios, params,
                       per_step_arch_mean={k: v["per_step_arch_mean"] for k, v in res.items()},
                       per_train_batch_arch_mean={k: v["per_train_batch_arch_mean"] for k, v in res.items()})
    _plot(Path(args.out).with_suffix(".png"), res)
    _print_summary(res, ratios, metrics)
    return doc


def _run_policies(p: SimParams, seeds: list[int]) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]]]:
    """``train_batch`` (L = 2B) and ``colocated`` (L = B) at fixed lookaheads; ``mini_batch`` and ``streaming``
    at the smallest lookahead matching ``train_batch``'s throughput; ``train_batch`` at more lookaheads too.
    Returns each policy's figures and each policy's (lookahead, throughput, staleness) curve."""
    b = p.groups
    res: dict[str, dict[str, Any]] = {
        "train_batch": run_policy(p, "train_batch", 2 * b, seeds),
        "colocated": run_policy(p, "colocated", b, seeds),
    }
    res["mini_batch"], search = match_throughput(p, seeds, res["train_batch"]["throughput"])
    res["streaming"], search_streaming = match_throughput(p, seeds, res["train_batch"]["throughput"],
                                                          policy="streaming")
    tb_runs = {la: res["train_batch"] if la == 2 * b else run_policy(p, "train_batch", la, seeds)
               for la in (b + b // p.mini_batches, 3 * b // 2, 2 * b, 3 * b)}  # train_batch's L too
    tb_curve = [{"lookahead": lookahead, "throughput": r["throughput"], "arch_mean": r["arch_mean"]}
                for lookahead, r in tb_runs.items()]
    return res, {"train_batch": tb_curve, "mini_batch": search, "streaming": search_streaming}


def _ratios(res: dict[str, dict[str, Any]]) -> dict[str, float]:
    """mini_batch against train_batch at matched throughput (staleness reductions, throughput ratio), and
    against streaming (the quota-free bound)."""
    tb, mb, st = res["train_batch"], res["mini_batch"], res["streaming"]
    return {
        "arch_staleness_reduction": 1.0 - mb["arch_mean"] / tb["arch_mean"] if tb["arch_mean"] else 0.0,
        "arch_staleness_reduction_token_weighted":
            1.0 - mb["arch_token_weighted"] / tb["arch_token_weighted"] if tb["arch_token_weighted"] else 0.0,
        "throughput_mini_vs_train": mb["throughput"] / tb["throughput"],
        "mini_vs_streaming_arch": mb["arch_mean"] / st["arch_mean"] if st["arch_mean"] else float("inf"),
        "total_staleness_reduction":
            1.0 - mb["total_staleness_mean"] / tb["total_staleness_mean"] if tb["total_staleness_mean"] else 0.0,
    }


def _print_summary(res: dict[str, dict[str, Any]], ratios: dict[str, float], metrics: dict[str, Any]) -> None:
    tb, mb, st = res["train_batch"], res["mini_batch"], res["streaming"]
    print(f"arch staleness mean: train_batch {tb['arch_mean']:.3f}  mini_batch {mb['arch_mean']:.3f}  "
          f"colocated {res['colocated']['arch_mean']:.3f}")
    print(f"streaming (quota-free, L={st['lookahead_groups']}): arch {st['arch_mean']:.3f}, throughput "
          f"{st['throughput']:.2f}, quota violations {st['quota_violations']}; mini_batch / streaming arch "
          f"{ratios['mini_vs_streaming_arch']:.2f}")
    print("arch staleness per train batch (seeds averaged): " + ";  ".join(
        f"{pol} " + " ".join(f"{x:.2f}" for x in res[pol]["per_train_batch_arch_mean"])
        for pol in ("train_batch", "mini_batch", "streaming")))
    print(f"generation span mean (weight updates while a trajectory was generated, beyond admission): "
          f"train_batch {tb['generation_span_mean']:.3f}  mini_batch {mb['generation_span_mean']:.3f}; total "
          f"(arch + span): train_batch {tb['total_staleness_mean']:.3f}  mini_batch {mb['total_staleness_mean']:.3f}")
    print(f"reduction {ratios['arch_staleness_reduction']:.3f}  throughput mini/train "
          f"{ratios['throughput_mini_vs_train']:.3f}  L={mb['lookahead_groups']}  quota violations "
          f"{metrics['quota_violations']}  plan p50 {metrics['plan_ms_p50_100k']:.1f} ms  "
          f"wall {metrics['wall_s']:.0f}s")
    print(f"plan p50 at scale (1,000 nodes, 512 ranks, 4,096 groups a mini-batch): "
          f"{metrics['plan_ms_p50_scale']:.1f} ms by links, {metrics['plan_ms_p50_scale_tokens']:.1f} ms by tokens")


def _parser() -> argparse.ArgumentParser:
    """The command line: ``--quick``, ``--out``, the variant flags, seeds and train batches."""
    ap = argparse.ArgumentParser(prog="python -m bench.staleness", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 train batches instead of 20")
    ap.add_argument("--out", required=True, help="result JSON path (PNG written beside it)")
    ap.add_argument("--math-sigma", type=float, default=0.9, help="lognormal sigma of math response lengths")
    ap.add_argument("--sync", choices=["per_step", "per_train_batch"], default="per_step")
    ap.add_argument("--version-at", choices=["start", "complete"], default="complete",
                    help="policy_version of a group: rollout version at its completion (default, in-flight weight "
                         "updates as the rollout worker does) or at its start")
    ap.add_argument("--trainer-slowdown", type=float, default=1.0,
                    help="multiply the calibrated trainer time (variant: trainer-bound pipeline)")
    ap.add_argument("--loader-order", choices=["shuffled", "slow_first", "longest_first", "math_ahead"],
                    default="shuffled", help="the loader's order: shuffled (default); slow_first = math before chat "
                    "in a chunk; longest_first = by the group's longest response (oracle); math_ahead = math one "
                    "chunk early")
    ap.add_argument("--loader-mix", choices=["exact", "iid"], default="exact",
                    help="iid: each prompt's source drawn 50/50 (a chunk's mix varies; the planner holds the quota)")
    ap.add_argument("--dispatch", choices=["lead", "fifo", "per_class"], default="lead",
                    help="how the rollout spends the lookahead (SimParams.dispatch): lead (default) = a slow class "
                         "ahead of its loader position by the groups dispatched while it generates beyond the fastest "
                         "one; fifo = the loader's order")
    ap.add_argument("--prefer", choices=["scarce", "oldest"], default="scarce",
                    help="the planner's choice among feasible compositions (AdmissionConfig.prefer)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the seeds each figure averages")
    ap.add_argument("--groups", type=int, default=64, help="B: prompt groups per train batch")
    ap.add_argument("--group-size", type=int, default=8, help="G: responses per prompt group")
    ap.add_argument("--mini-batches", type=int, default=4, help="K: optimizer steps per train batch")
    ap.add_argument("--slots", type=int, default=512,
                    help="concurrent rollout sequences (fewer: a rollout-saturated regime)")
    ap.add_argument("--train-batches", type=int, default=None)
    return ap


def _plot(path: Path, res: dict[str, dict[str, Any]]) -> None:
    """Mean architectural staleness per optimizer step, one line per policy (optional: needs matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for pol, r in res.items():
        label = f"{pol} (L={r['lookahead_groups']})"
        ax.plot(range(len(r["per_step_arch_mean"])), r["per_step_arch_mean"], label=label, marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean architectural staleness (versions)")
    ax.set_title("Architectural staleness per optimizer step (seed 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_curves(path: Path, curves: dict[str, list[dict[str, float]]]) -> None:
    """Throughput against mean architectural staleness over the lookahead L, one line per policy."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol, pts in curves.items():
        pts = sorted(pts, key=lambda q: q["lookahead"])
        ax.plot([q["throughput"] for q in pts], [q["arch_mean"] for q in pts], marker="o", label=pol)
        for q in pts:
            ax.annotate(f"L={int(q['lookahead'])}", (q["throughput"], q["arch_mean"]), fontsize=6)
    ax.set_xlabel("throughput (trajectories per simulated second)")
    ax.set_ylabel("mean architectural staleness (versions)")
    ax.set_title("Staleness against throughput over the lookahead L (seeds averaged)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
