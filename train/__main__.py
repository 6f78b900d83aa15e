"""``python -m train --config FILE [--nproc N]``: the trainer on a ``TrainConfig`` document.

The document is read and validated (``schemas.documents.read``) before any rank starts. Under
``torchrun`` (``WORLD_SIZE`` set) this process is one rank; otherwise it starts ``--nproc`` local
ranks (``train.launch``). SIGTERM and SIGINT stop every rank; the exit code is then 128 + the signal.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from schemas import documents
from train.config import TrainConfig
from train.launch import LOG_FORMAT, launch


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; returns the process exit code."""
    p = argparse.ArgumentParser(prog="python -m train",
                                description="Megatron-core GRPO trainer fed by knittrans stores")
    p.add_argument("--config", required=True, help="TrainConfig document (JSON, as schemas.documents writes it)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to start when not under torchrun (default 1)")
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    try:
        cfg = documents.read(TrainConfig, args.config)
    except (OSError, ValueError) as exc:  # ConfigDocumentError and the configs' own checks are ValueErrors
        print(f"python -m train: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=LOG_FORMAT.replace("{rank}", os.environ.get("RANK", "0")))
    signal.signal(signal.SIGTERM, _stop)
    try:
        launch(cfg, args.nproc)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
