"""The ``knit`` command: ``knit serve`` runs one store node; other subcommands load lazily.

Subcommands other than ``serve`` are registered in :data:`LAZY_COMMANDS` as ``"module:function"``
strings and resolved with importlib only when run, so this package never imports the trainer or
the connectors. Each lazy function is called as ``function(argv)`` with the arguments after the
subcommand name and returns an exit code (or ``None`` for 0).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import cast

LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("train.run:main", "run the RL loop: 2 store nodes, a vLLM rollout worker, a 2-rank Megatron trainer"),
    "demo": ("flight_store.demo:main", "run the local demo: two store nodes, a few groups, a query, a fetch"),
    "train": ("train.entry:main", "run the Megatron-core trainer (one rank under torchrun, or --nproc N)"),
    "rollout": ("connectors.rollout:main", "run a vLLM rollout worker that streams prompt groups to the stores"),
    "meta": ("flight_store.query:main", "polars SQL over the live trajectory metadata of every node"),
}
"""Subcommand -> "module:function" or ("module:function", one-line help). Add entries; never import them."""


def _target(name: str) -> tuple[str, str]:
    entry = LAZY_COMMANDS[name]
    return (entry, f"see `knit {name} --help`") if isinstance(entry, str) else entry


def _resolve(target: str) -> Callable[[list[str]], int | None]:
    module, _, func = target.partition(":")
    return cast(Callable[[list[str]], "int | None"], getattr(importlib.import_module(module), func))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="knit", description="KnitTrans: a columnar data plane for LLM RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run one store node (Arrow Flight server)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8815, help="port (0 = pick a free one; default 8815)")
    serve.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of memory the node may hold: stored data, writes in flight, and its process's resident "
        "memory above its start; writes beyond it are refused (retryable)",
    )
    serve.add_argument(
        "--coalesce-below",
        type=int,
        default=1 << 20,
        metavar="BYTES",
        help="a slices answer of several batches under this size is sent as one copied batch (0 = never)",
    )
    serve.add_argument("--node-name", default=None, help="name reported by health/stats (default: the location)")
    serve.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate: serve grpc+tls")
    serve.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help="file holding the bearer token every client must send (authorization: Bearer <token>)",
    )
    serve.add_argument(
        "--spill-dir",
        default=None,
        metavar="DIR",
        help="durable spill log: every write is fsynced there before it is acknowledged, replayed on restart",
    )
    serve.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus /metrics here (0 = free port)"
    )
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    for name in LAZY_COMMANDS:
        sub.add_parser(name, help=_target(name)[1], add_help=False)
    return parser


def serve(args: argparse.Namespace) -> int:
    """Run one store node until SIGINT/SIGTERM."""
    from flight_store.server import StoreServer, read_token_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (args.tls_cert is None) != (args.tls_key is None):
        print("knit serve: --tls-cert and --tls-key must be given together", file=sys.stderr)
        return 2
    tls_cert = tls_key = None
    if args.tls_cert is not None:
        with open(args.tls_cert, "rb") as f:
            tls_cert = f.read()
        with open(args.tls_key, "rb") as f:
            tls_key = f.read()
    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    server = StoreServer(
        f"{'grpc+tls' if tls_cert else 'grpc'}://{args.host}:{args.port}",
        memory_budget=args.memory_budget,
        node_name=args.node_name,
        coalesce_below=args.coalesce_below,
        tls_cert=tls_cert,
        tls_key=tls_key,
        auth_token=token,
        spill_dir=args.spill_dir,
        metrics_port=args.metrics_port,
        rss_guard=True,  # the node owns its process: hold its resident memory to the budget too
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # handlers first: whoever reads the "listening" line may signal at once, and must get a clean stop
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"knit serve: listening on {server.location}", flush=True)
    if server.metrics_port is not None:
        print(f"knit serve: metrics on http://{args.host}:{server.metrics_port}/metrics", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    print("knit serve: stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``knit``."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in LAZY_COMMANDS:
        fn = _resolve(_target(args_list[0])[0])
        return int(fn(args_list[1:]) or 0)
    args = _parser().parse_args(args_list)
    if args.command == "serve":
        return serve(args)
    msg = f"unknown command {args.command!r}"  # pragma: no cover - argparse refuses it first
    raise SystemExit(msg)


if __name__ == "__main__":
    raise SystemExit(main())
