"""Every data path side by side: ``python -m bench.peers [--quick] --out F.json``.

knittrans beside the peers as they ship (TransferQueue 0.1.11 and verl 0.9.1's DataProto, the
packages themselves) and a minimal Flight server, on the same groups, plans and compute; see
:mod:`bench.peers.harness` for what runs and what is timed. Writes ``{"metrics", "ratios",
"params"}`` to ``--out`` and a PNG beside it, prints the table, and exits 0 when every target of
the quick run is met.

Keys (peer / knittrans, medians of the same work in this run):

* ``ratios.data_movement_vs_<peer>`` (``verl_trainer``, ``verl_dataproto`` (torch.save), ``verl_numpy``,
  ``transferqueue``, and ``verl_best``: the fastest verl path): train-step time at compute 0, so data
  movement alone; ``metrics.rank_bytes_per_step_<path>`` the payload bytes the ranks received;
* ``ratios.step_vs_verl_best_calibrated``, ``ratios.step_vs_transferqueue_calibrated``: train-step time with
  each rank held the real trainer's time (``metrics.calibrated_compute_ms_per_ktok``: measured by
  :func:`bench.calibrate.compute_ms_per_ktok`, or given with ``--compute-ms-per-ktok``) on groups of
  ``make run``'s geometry;
* ``ratios.fetch_p50_vs_minimal_flight_exchange`` (target >= 0.95): the minimal Flight server's median
  read of one micro-batch over a kept DoExchange per node (knittrans' own mechanism) / knittrans';
  ``ratios.fetch_p50_vs_minimal_flight`` (a DoGet per read) and ``ratios.fetch_p50_vs_transferqueue``
  (``get_data`` of resolved metadata) are diagnostics;
* the multimodal cells (:mod:`bench.peers.mm`): ``ratios.mm_stored_once_c0``,
  ``ratios.mm_replicated_vs_verl_c0``, ``ratios.mm_data_path_c0``, ``ratios.mm_encoder_dedup`` with
  ``metrics.mm_encoder_ms_per_image``;
* the write path (:func:`bench.write_path.run`): ``ratios.put_vs_minimal_flight`` (target >= 0.8),
  ``ratios.put_groups_vs_minimal_flight_bulk``, and its diagnostics against a minimal server that copies into
  pages of its own (``ratios.put_vs_minimal_flight_own_pages``, ``ratios.minimal_own_pages_vs_minimal_flight``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import write_path
from bench._common import pyplot, write_result
from bench.cluster.workload import Workload
from bench.peers.harness import params, run, summarize

PATHS = ("transferqueue", "verl_trainer", "verl_default", "verl_numpy")
TARGETS = {"fetch_p50_vs_minimal_flight_exchange": 0.95, "put_vs_minimal_flight": 0.8}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller train batch and fewer steps")
    parser.add_argument("--out", required=True, help="result JSON (a PNG plot is written beside it)")
    parser.add_argument("--compute", type=float, nargs="+", default=[0.0],
                        help="further compute values for the step-time table, ms per 1k tokens (default: 0)")
    parser.add_argument("--compute-ms-per-ktok", type=float, default=None,
                        help="the calibrated compute (default: measured by bench.calibrate)")
    parser.add_argument("--paths", nargs="*", choices=PATHS, default=list(PATHS),
                        help="peer paths to run beside knittrans (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="measured train steps per compute value")
    parser.add_argument("--no-multimodal", action="store_true", help="skip the multimodal cells")
    parser.add_argument("--no-calibrated", action="store_true", help="skip the calibrated cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    steps = args.steps or (2 if args.quick else 4)
    computes = sorted({0.0, *args.compute})
    w = Workload(steps=steps, groups=16 if args.quick else 32, mini_batches=2 if args.quick else 4, ranks=2,
                 seed=args.seed)
    # the write path first, beside a minimal Flight DoPut (bench.write_path), before Ray and the peers start
    write = write_path.run(groups_n=100 if args.quick else 300, size=w.group_size, tokens=2048, reps=3,
                           seed=args.seed)
    cal = None
    if not args.no_calibrated:
        ms = args.compute_ms_per_ktok
        if ms is None:
            from bench.calibrate import compute_ms_per_ktok

            ms = compute_ms_per_ktok(reps=2 if args.quick else 5)
        cal = (Workload(steps=steps, groups=4, group_size=4, mini_batches=2, ranks=2, prompt_len=48,  # make run's
                        response_mean=32, response_max=64, seed=args.seed), ms)
    mm = enc_w = None
    encoder_ms = 0.0
    if not args.no_multimodal:
        from bench.peers.vision import measure_ms_per_image

        mm = replace(w, multimodal=True, image_shape=(3, 448, 448), image_dtype="uint8")
        enc_w = Workload(steps=steps, groups=2, group_size=4, mini_batches=1, ranks=2, prompt_len=64,
                         response_mean=64, response_max=128, multimodal=True, image_shape=(3, 448, 448),
                         seed=args.seed)
        encoder_ms = measure_ms_per_image(enc_w.image_shape, seed=args.seed)["ms_per_image"]
    raw = run(w, computes, args.paths, fetch_rounds=3 if args.quick else 6, mm=mm, enc_w=enc_w,
              encoder_ms=encoder_ms, cal=cal)
    metrics, ratios = summarize(raw, w, computes)
    metrics.update({f"write_{k}": v for k, v in write["metrics"].items()})
    ratios.update(write["ratios"])
    out = Path(args.out)
    write_result(out, metrics, ratios, {**params(w, computes, args.paths, args.quick),
                                        "calibrated_workload": asdict(cal[0]) if cal else None,
                                        "encoder_workload": asdict(enc_w) if enc_w else None})
    _plot(out.with_suffix(".png"), metrics, computes)
    _print_table(metrics, ratios, computes)
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
    for prefix in ("mm_step_ms_", "mm_encoder_step_ms_", "calibrated_"):
        found = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
        if found:
            print(f"{prefix.rstrip('_')}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in found.items()))
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
