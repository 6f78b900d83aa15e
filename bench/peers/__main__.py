"""Every data path side by side: ``python -m bench.peers [--quick] --out F.json``.

knittrans beside the peers as they ship (TransferQueue 0.1.11 and verl 0.9.1's DataProto, the
packages themselves) and a minimal Flight server, on the same groups, plans and compute; see
:mod:`bench.peers.harness` for what runs and what is timed. Writes ``{"metrics", "ratios",
"params"}`` to ``--out`` and a PNG beside it, prints the table, and exits 0 when every target of
the quick run is met.

Keys: ``ratios.step_vs_<peer>_c<C>`` = the peer's median train-step time / knittrans', at compute
``C`` ms per 1k tokens (``c0``: data movement alone); ``ratios.fetch_p50_vs_transferqueue`` and
``ratios.fetch_p50_vs_minimal_flight`` = the other's median read of one micro-batch / knittrans' (the minimal
server's by one DoGet per node; ``ratios.fetch_p50_vs_minimal_flight_exchange``, a diagnostic: over one kept
DoExchange per node, the floor of knittrans' read channels).
``metrics.first_wait_ms_<path>_c<C>``: from the driver handing out the step until the last rank
held its first micro-batch (median over steps). The multimodal 2x2 (``mm_*``): ``ratios.mm_data_path_c<C>``
= images through verl's controller per row / stored once and read by key (encoder per reference on
both), ``ratios.mm_encoder_dedup_c<C>`` = encoder per reference / each distinct image once (both by
key). The write path (``write_*``, :func:`bench.write_path.run`): ``ratios.put_vs_minimal_flight``,
``ratios.put_groups_vs_minimal_flight_bulk``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import write_path
from bench._common import pyplot, write_result
from bench.cluster.workload import Workload
from bench.peers.harness import params, run, summarize

PATHS = ("transferqueue", "verl_default", "verl_numpy", "verl_objectref")
TARGETS = {"step_vs_verl_dataproto_c0": 3.0, "step_vs_transferqueue_c0": 1.5, "fetch_p50_vs_transferqueue": 4.0,
           "fetch_p50_vs_minimal_flight": 0.9, "mm_data_path_c0": 5.0, "put_vs_minimal_flight": 0.5}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller train batch and fewer steps")
    parser.add_argument("--out", required=True, help="result JSON (a PNG plot is written beside it)")
    parser.add_argument("--compute", type=float, nargs="+", default=[0.0, 1.0, 3.0, 10.0],
                        help="compute values, ms per 1k tokens (default: 0 1 3 10)")
    parser.add_argument("--paths", nargs="*", choices=PATHS, default=list(PATHS),
                        help="peer paths to run beside knittrans (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="measured train steps per compute value")
    parser.add_argument("--no-multimodal", action="store_true", help="skip the multimodal 2x2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    w = Workload(steps=args.steps or (2 if args.quick else 4), groups=16 if args.quick else 32,
                 mini_batches=2 if args.quick else 4, ranks=2, seed=args.seed)
    mm = None if args.no_multimodal else replace(w, multimodal=True, image_shape=(3, 448, 448), image_dtype="uint8")
    mm_computes = [0.0, 10.0] if args.quick else args.compute
    # the write path first, beside a minimal Flight DoPut (bench.write_path), before Ray and the peers start
    write = write_path.run(groups_n=100 if args.quick else 300, size=w.group_size, tokens=2048, reps=3,
                           seed=args.seed)
    raw = run(w, args.compute, args.paths, fetch_rounds=3 if args.quick else 6, mm=mm, mm_computes=mm_computes)
    metrics, ratios = summarize(raw, w, args.compute)
    metrics.update({f"write_{k}": v for k, v in write["metrics"].items()})
    ratios.update(write["ratios"])
    out = Path(args.out)
    write_result(out, metrics, ratios, params(w, args.compute, args.paths, args.quick))
    _plot(out.with_suffix(".png"), metrics, args.compute)
    _print_table(metrics, ratios, args.compute)
    missed = [k for k, floor in TARGETS.items() if k in ratios and ratios[k] < floor]
    print("targets met" if not missed else f"TARGETS MISSED: {', '.join(missed)}")
    return 1 if missed else 0


def _paths(metrics: dict[str, Any], c: float) -> list[str]:
    prefix = "step_ms_"
    return [k[len(prefix):-len(f"_c{c:g}")] for k in metrics if k.startswith(prefix) and k.endswith(f"_c{c:g}")]


def _print_table(metrics: dict[str, Any], ratios: dict[str, Any], computes: Sequence[float]) -> None:
    head = "| path | " + " | ".join(f"step ms, c={c:g}" for c in computes) + " | first wait ms, c=0 |"
    print(head)
    print("|---" * (len(computes) + 2) + "|")
    for name in _paths(metrics, computes[0]):
        cells = [f"{metrics.get(f'step_ms_{name}_c{c:g}', float('nan')):.1f}" for c in computes]
        print(f"| {name} | " + " | ".join(cells) + f" | {metrics[f'first_wait_ms_{name}_c{computes[0]:g}']:.1f} |")
    fetch = {k[len('fetch_p50_ms_'):]: v for k, v in metrics.items() if k.startswith("fetch_p50_ms_")}
    print("fetch p50 ms: " + ", ".join(f"{k} {v:.2f}" for k, v in fetch.items()))
    mm = sorted({k.rsplit("_c", 1)[1] for k in metrics if k.startswith("mm_step_ms_")}, key=float)
    if mm:
        print("| multimodal cell | " + " | ".join(f"step ms, c={c}" for c in mm)
              + f" | encoder passes, c={mm[-1]} |")
        print("|---" * (len(mm) + 2) + "|")
        for cell in ("replicated_per_ref", "replicated_dedup", "by_ref_per_ref", "by_ref_dedup"):
            cells = [f"{metrics[f'mm_step_ms_{cell}_c{c}']:.1f}" for c in mm]
            print(f"| {cell} | " + " | ".join(cells) + f" | {metrics[f'mm_encoder_passes_{cell}_c{mm[-1]}']:g} |")
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ratios.items())))


def _plot(path: Path, metrics: dict[str, Any], computes: Sequence[float]) -> None:
    """Step time per path against compute (optional: needs matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in _paths(metrics, computes[0]):
        ax.plot(computes, [metrics.get(f"step_ms_{name}_c{c:g}", float("nan")) for c in computes], marker="o",
                label=name)
    ax.set_xlabel("compute, ms per 1k tokens")
    ax.set_ylabel("train step, ms (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Train step time, same data and compute on every path")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
