"""Trajectory transfer per train step: verl's single-controller DataProto path vs on-demand Flight fetch.

The command line of :mod:`bench.transfer`: ``python -m bench.transfer [--quick] --out F.json`` runs
the text benchmark (:mod:`bench.transfer.text`), ``--multimodal`` the image one
(:mod:`bench.transfer.multimodal`); both write ``{"metrics", "ratios", "params"}`` to ``--out`` and a
PNG plot beside it, and exit 0 when every target is met. ``--hosts`` runs it across a real network
stack: both store nodes in one host, the driver and the ranks in another (network namespaces on a
bridge, see ``bench._hosts``; needs root, else it exits 2 saying why); ``params.network`` records the mode.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench._hosts import run_in_hosts
from bench.transfer.multimodal import main_multimodal
from bench.transfer.text import main_text
from bench.transfer.workload import IMAGE_FORMATS, Workload

ROOT = Path(__file__).resolve().parents[2]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every target of ``--quick`` is met."""
    parser = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under two minutes)")
    parser.add_argument("--out", required=True, help="result JSON (a PNG plot is written beside it)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--compute-ms-per-ktok", type=float, default=10.0)
    parser.add_argument("--prefetch-depth", type=int, default=1)
    parser.add_argument("--hosts", action="store_true",
                        help="stores in one host, driver and ranks in another (network namespaces; needs root)")
    parser.add_argument("--multimodal", action="store_true", help="image workload (images shared by reference)")
    parser.add_argument("--image-format", choices=sorted(IMAGE_FORMATS), default="patches-fp16",
                        help="multimodal: 1024x1176 fp16 patch values (what DataProto carries), or 3x448x448 uint8")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.hosts:
        return run_in_hosts("bench.transfer", list(argv) if argv is not None else sys.argv[1:], Path(args.out))
    w = Workload(steps=args.steps or (3 if args.quick else 8), compute_ms_per_ktok=args.compute_ms_per_ktok,
                 prefetch_depth=args.prefetch_depth, multimodal=args.multimodal,
                 train_steps=2 if args.quick else 4, image_shape=IMAGE_FORMATS[args.image_format][0],
                 image_dtype=IMAGE_FORMATS[args.image_format][1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

    return main_multimodal(args, w) if w.multimodal else main_text(args, w)


if __name__ == "__main__":
    raise SystemExit(main())
