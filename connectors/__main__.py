"""``python -m connectors --config FILE``: one rollout worker, configured by a ``RolloutConfig`` document.

Reads the document (``schemas.documents.read``; a bad field fails here, named, before anything
starts), runs the worker (``connectors.rollout.run_rollout``: SIGTERM/SIGINT stop it cleanly), prints
the report's JSON summary (without ``write_times``) on stdout, and writes the full report to
``report_path`` when the config sets it. Exit status: 0 on success, 2 for a bad config document, 1
when the run fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from connectors.config import RolloutConfig
from connectors.rollout import run_rollout
from schemas import documents

logger = logging.getLogger("connectors")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rollout the config document describes; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m connectors", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="RolloutConfig document (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = documents.read(RolloutConfig, args.config)
    except (OSError, ValueError) as exc:
        print(f"python -m connectors: {exc}", file=sys.stderr)
        return 2
    report = run_rollout(config).to_dict()
    print(json.dumps({k: v for k, v in report.items() if k != "write_times"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
