"""``python -m flight_store --config FILE``: run one store node from a ``ServerConfig`` document.

The document is a :class:`~flight_store.config.ServerConfig` written with ``schemas.documents``
(``write(ServerConfig(...), path)``); it is validated strictly before anything starts. The node
runs until SIGINT/SIGTERM (:func:`flight_store.node.serve`); exit code 0 after a clean stop, 2 for a
config that cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flight_store.config import ServerConfig
from flight_store.node import serve
from schemas.documents import ConfigDocumentError, read


def main(argv: Sequence[str] | None = None) -> int:
    """Read the config document named by ``--config`` and serve it."""
    parser = argparse.ArgumentParser(prog="python -m flight_store", description="Run one store node.")
    parser.add_argument("--config", required=True, metavar="FILE", help="a ServerConfig JSON document")
    args = parser.parse_args(argv)
    try:
        config = read(ServerConfig, args.config)
    except (OSError, ConfigDocumentError) as exc:
        print(f"python -m flight_store: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
