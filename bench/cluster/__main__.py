"""``python -m bench.cluster [--quick] --out F.json``: the network-bound regime, every process on its own host.

For each (N rollout/store hosts, D trainer-rank hosts) it makes a fresh cluster (:mod:`bench.cluster.topology`),
runs the same train batches through verl's single controller, TransferQueue and knittrans
(:mod:`bench.cluster.driver`), text then multimodal, and writes ``{"metrics", "ratios", "predicted", "params"}``
with a PNG beside the JSON (:mod:`bench.cluster.report`). Needs root (network namespaces); exits 2 saying
why where hosts cannot be made.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._common import write_result
from bench.cluster.deployment import PRESETS, dilate
from bench.cluster.processor import describe
from bench.cluster.report import plot, summarize
from bench.cluster.topology import ClusterShape, run_cluster
from bench.cluster.workload import Workload
from launcher.hosts import HostsUnavailableError, check_available

COMPUTE_MS_PER_KTOK = 10.0
"""Accelerator time per 1k tokens of a rank host without ``--deployment`` (ms)."""
LINK_MBIT = 200.0
"""Every host's link rate, each way, without ``--link-mbit`` (Mbit/s)."""


def workloads(quick: bool, d: int, tiny: bool) -> dict[str, dict[str, Any]]:
    """The text and multimodal train batches (the same on every path)."""
    steps = 2 if quick or tiny else 4
    if tiny:
        text = Workload(steps=1, groups=4, group_size=2, mini_batches=2, ranks=d, token_budget=4096,
                        response_mean=256, response_max=1024, prompt_len=128)
        mm = Workload(steps=1, groups=4, group_size=2, mini_batches=2, ranks=d, token_budget=4096,
                      response_mean=256, response_max=1024, prompt_len=128, multimodal=True, images_per_group=1,
                      image_shape=(3, 64, 64))
    else:
        text = Workload(steps=steps, groups=16, group_size=4, mini_batches=2, ranks=d, token_budget=8192,
                        response_mean=1024, response_max=4096)
        mm = Workload(steps=steps, groups=8, group_size=4, mini_batches=2, ranks=d, token_budget=8192,
                      response_mean=512, response_max=2048, multimodal=True, images_per_group=4,
                      image_shape=(3, 224, 224))
    return {"text": asdict(text), "mm": asdict(mm)}


def rates(args: argparse.Namespace) -> tuple[float, float, dict[str, Any] | None]:
    """``(link Mbit/s, compute ms per 1k tokens, the deployment's record or None)``: a ``--deployment`` preset
    time-dilated to the link rate, unless ``--compute-ms-per-ktok`` overrides its compute."""
    link = args.link_mbit if args.link_mbit is not None else LINK_MBIT
    if args.deployment is None:
        compute = args.compute_ms_per_ktok if args.compute_ms_per_ktok is not None else COMPUTE_MS_PER_KTOK
        return link, compute, None
    dilated = dilate(args.deployment, link)
    record = dilated.record()
    if args.compute_ms_per_ktok is not None:
        record["compute_ms_per_ktok_override"] = args.compute_ms_per_ktok
        return link, args.compute_ms_per_ktok, record
    return link, dilated.compute_ms_per_ktok, record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2, 4 and D = 2, fewer steps")
    parser.add_argument("--tiny", action="store_true", help="N = 2, D = 2, one tiny step each (the test's size)")
    parser.add_argument("--out", required=True, help="result JSON (a PNG plot is written beside it)")
    parser.add_argument("--deployment", choices=sorted(PRESETS),
                        help="the compute of a named deployment, time-dilated so its compute-to-link ratio holds")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help=f"every host's link rate, each way (default {LINK_MBIT:g})")
    parser.add_argument("--compute-ms-per-ktok", type=float, default=None,
                        help=f"a rank host's compute per 1k tokens (overrides the deployment's; default "
                             f"{COMPUTE_MS_PER_KTOK:g} without one)")
    parser.add_argument("--no-mm", action="store_true", help="text only")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        check_available(probe=True)
    except HostsUnavailableError as exc:
        print(f"python -m bench.cluster: cannot make hosts: {exc}", file=sys.stderr)
        return 2
    link_mbit, compute, deployment = rates(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.tiny:
        shapes = [(2, 2)]
    else:
        shapes = [(n, 2) for n in (2, 4)] if args.quick else [(n, d) for n in (2, 4, 8) for d in (2, 4)]
    runs: list[dict[str, Any]] = []
    for n, d in shapes:
        wl = workloads(args.quick, d, args.tiny)
        if args.no_mm:
            del wl["mm"]
        raw = run_cluster(ClusterShape(n_stores=n, n_ranks=d, link_mbit=link_mbit), wl, compute, timeout_s=1800)
        runs.append({"n": n, "d": d, "raw": raw, "workloads": wl})
    metrics, ratios, predicted = summarize(runs, link_mbit, compute)
    out = Path(args.out)
    mm = runs[0]["workloads"].get("mm")
    params = {"shapes": shapes, "quick": args.quick, "tiny": args.tiny, "workloads": runs[0]["workloads"],
              "deployment": deployment, "link_mbit": link_mbit, "compute_ms_per_ktok": compute,
              "burst_kb": ClusterShape(n_stores=1, n_ranks=1, link_mbit=link_mbit).burst_kb,
              "image_side": mm["image_shape"][-1] if mm else None,
              "images_verl_transferqueue": f"per row: pixel_values and image_grid_thw of {describe()}",
              "images_knittrans": "raw uint8 bytes once per group; the rank runs the same processor in its clock",
              "placement": {"knittrans": "local (home id), assignment links",
                            "knittrans_hash": "hash (plain id), assignment tokens"},
              "transfer_medians": "per step", "calibration": [r["raw"]["calibration"] for r in runs],
              "verl_serialization": "numpy", "compute": "every tensor touched, then the rank held CPU-free"}
    write_result(out, metrics, ratios, params, predicted=predicted,
                 raw=[{"n": r["n"], "d": r["d"], "roles": r["raw"]["roles"],
                       "steps": {k: _slim(v["steps"]) for k, v in r["raw"]["workloads"].items()},
                       "step_groups": {k: v["step_groups"] for k, v in r["raw"]["workloads"].items()}}
                      for r in runs])
    plot(out.with_suffix(".png"), metrics, predicted, runs)
    for k in sorted(ratios):
        print(f"{k}: {ratios[k]:.2f}")
    print(f"cluster_model_max_rel_error: {metrics['cluster_model_max_rel_error']:.3f}, "
          f"cluster_cpu_util_max: {metrics['cluster_cpu_util_max']:.2f}")
    return 0


def _slim(steps: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The step records without the plans (their rows are in ``step_groups`` and the plans are large)."""
    return {p: [{k: v for k, v in rec.items() if k != "per_rank"} for rec in recs] for p, recs in steps.items()}


if __name__ == "__main__":
    raise SystemExit(main())
