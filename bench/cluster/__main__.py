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
from bench.cluster.report import plot, summarize
from bench.cluster.topology import ClusterShape, run_cluster
from bench.cluster.workload import Workload
from launcher.hosts import HostsUnavailableError, check_available

COMPUTE_MS_PER_KTOK = 10.0
"""Default accelerator time per 1k tokens of a micro-batch: the peers benchmark's highest compute point, where its
loopback paths converge (pass a value measured with the repo's trainer to replace it)."""


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
                      image_shape=(3, 448, 448))
    return {"text": asdict(text), "mm": asdict(mm)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2, 4 and D = 2, fewer steps")
    parser.add_argument("--tiny", action="store_true", help="N = 2, D = 2, one tiny step each (the test's size)")
    parser.add_argument("--out", required=True, help="result JSON (a PNG plot is written beside it)")
    parser.add_argument("--link-mbit", type=float, default=200.0, help="every host's link rate, each way")
    parser.add_argument("--compute-ms-per-ktok", type=float, default=COMPUTE_MS_PER_KTOK)
    parser.add_argument("--no-mm", action="store_true", help="text only")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        check_available(probe=True)
    except HostsUnavailableError as exc:
        print(f"python -m bench.cluster: cannot make hosts: {exc}", file=sys.stderr)
        return 2
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
        raw = run_cluster(ClusterShape(n_stores=n, n_ranks=d, link_mbit=args.link_mbit), wl,
                          args.compute_ms_per_ktok, timeout_s=1800)
        runs.append({"n": n, "d": d, "raw": raw, "workloads": wl})
    metrics, ratios, predicted = summarize(runs, args.link_mbit, args.compute_ms_per_ktok)
    out = Path(args.out)
    params = {"shapes": shapes, "quick": args.quick, "tiny": args.tiny, "workloads": runs[0]["workloads"],
              "verl_serialization": "numpy", "compute": "every tensor touched, then the rank held CPU-free"}
    write_result(out, metrics, ratios, params, predicted=predicted,
                 raw=[{"n": r["n"], "d": r["d"], "steps": {k: v["steps"] for k, v in r["raw"].items() if k != "roles"},
                       "roles": r["raw"]["roles"]} for r in runs])
    plot(out.with_suffix(".png"), metrics, runs)
    for k in sorted(ratios):
        print(f"{k}: measured {ratios[k]:.2f}, predicted {predicted.get(k, float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
