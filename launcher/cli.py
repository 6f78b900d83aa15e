"""The ``knit`` command: one subcommand per way in, flags derived from the config classes.

=========  ===========================================================================================
command    what it runs
=========  ===========================================================================================
serve      one store node (``flight_store``; flags from :class:`~flight_store.config.ServerConfig`)
run        the main job: stores, a vLLM rollout worker and a Megatron trainer (:mod:`launcher.run`)
train      the Megatron-core trainer, ``--nproc`` local ranks or one rank under torchrun
           (flags from :class:`~train.config.TrainConfig`)
rollout    a vLLM rollout worker streaming prompt groups to the stores (flags from
           :class:`~connectors.config.RolloutConfig`)
report     a run folder's prompt ledger in one line (each prompt trained once?), its resumes, checkpoint cost
meta       polars SQL over the live trajectory metadata of every node
sql        a Flight SQL gateway over that metadata for any client (ADBC, JDBC, DBeaver, Grafana; flags
           from :class:`~flight_store.sql.config.SqlConfig`)
demo       the data flow in miniature on two in-process store nodes
=========  ===========================================================================================

``train``, ``rollout`` and ``serve`` also take ``--config FILE``, a config document
(``schemas.documents``) whose values the flags then override. Heavy parts (torch, vLLM) are imported
only by the command that needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from launcher.flags import Flag, add_flags, build
from schemas import documents

T = TypeVar("T")


def _parse_config(prog: str, description: str, cls: type[T], argv: Sequence[str], *,
                  extra: Callable[[argparse.ArgumentParser], None] | None = None,
                  base: Callable[[argparse.Namespace], dict[str, Any]] | None = None,
                  skip: tuple[str, ...] = ()) -> tuple[T, argparse.Namespace]:
    """Parse ``argv`` into a ``cls`` config: ``--config FILE`` first, then the derived flags on top."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help=f"a {cls.__name__} document (JSON); the flags below override its values")
    if extra is not None:
        extra(parser)
    flags: list[Flag] = add_flags(parser, cls, skip=skip)
    args = parser.parse_args(list(argv))
    try:
        start: Any = documents.read(cls, args.config) if args.config else None
        if base is not None:
            start = _merge(dataclasses.asdict(start) if start is not None else {}, base(args))
        return build(cls, flags, args, base=start), args
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    raise AssertionError  # pragma: no cover - parser.error exits


def _merge(doc: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    for k, v in over.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


# ---- store side --------------------------------------------------------------------------------


def serve(argv: Sequence[str]) -> int:
    """``knit serve``: one store node until SIGINT/SIGTERM."""
    from flight_store.config import ServerConfig
    from flight_store.node import serve as run_node

    # a node process always guards its RSS, and names its store itself (ServerConfig.node_name): no flags for those
    config, _ = _parse_config("knit serve", "Run one knittrans store node (an Arrow Flight server).",
                              ServerConfig, argv, skip=("store.rss_guard", "store.node_name"))
    return run_node(config)


def meta(argv: Sequence[str]) -> int:
    """``knit meta``: polars SQL over the live metadata of every node."""
    from flight_store.query import TABLE, query_metadata
    from flight_store.reading import StoreReader

    parser = argparse.ArgumentParser(prog="knit meta", description="Polars SQL over the live trajectory metadata "
                                     f"of every node, registered as the table {TABLE!r}.")
    parser.add_argument("--stores", required=True, help="comma-separated store locations, grpc://host:port,...")
    parser.add_argument("--sql", default=f"SELECT * FROM {TABLE} LIMIT 20", help="a polars SQL query")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--token", default=None, help="bearer token (default: $KNIT_TOKEN)")
    args = parser.parse_args(list(argv))
    with StoreReader([s for s in args.stores.split(",") if s], token=args.token) as client:
        try:
            out = query_metadata(client.metadata(), args.sql)
        except ValueError as exc:
            print(f"knit meta: {exc}", file=sys.stderr)
            return 2
    if args.format == "csv":
        sys.stdout.write(out.write_csv())
    elif args.format == "json":
        sys.stdout.write(out.write_json() + "\n")
    else:
        import polars as pl

        with pl.Config(tbl_rows=100, tbl_cols=30, fmt_str_lengths=60):
            print(out)
    return 0


def sql(argv: Sequence[str]) -> int:
    """``knit sql``: a Flight SQL gateway over the live metadata of every node, until SIGINT/SIGTERM."""
    from flight_store.sql.config import SqlConfig
    from flight_store.sql.gateway import serve as run_gateway

    config, _ = _parse_config("knit sql", "Serve Flight SQL (ADBC, JDBC, DBeaver, Grafana) over the live trajectory "
                              "metadata of the store nodes --stores.", SqlConfig, argv)
    return run_gateway(config)


def demo(argv: Sequence[str]) -> int:
    """``knit demo``: two in-process nodes, a few groups, a query, a fetch."""
    from launcher.demo import run_demo

    parser = argparse.ArgumentParser(prog="knit demo", description="The data flow in miniature on two "
                                     "in-process store nodes.")
    parser.add_argument("--groups", type=int, default=16, help="prompt groups to write (default 16)")
    parser.add_argument("--group-size", type=int, default=4, help="responses per group (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))
    return run_demo(groups=args.groups, group_size=args.group_size, seed=args.seed)


# ---- the parts: trainer, rollout -----------------------------------------------------------------


def train(argv: Sequence[str]) -> int:
    """``knit train``: the Megatron-core trainer (``--nproc`` local ranks, or one rank under torchrun)."""
    from train.config import ModelConfig, TrainConfig
    from train.launch import LOG_FORMAT, launch
    from train.tracking import check_installed

    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nproc", type=int, default=1, help="ranks to start locally when not under torchrun")
        p.add_argument("--preset", default=None, help="start the model shape from a named preset "
                       "(tiny, tiny-vllm, smollm2-135m, ...); the model flags override it")

    def base(args: argparse.Namespace) -> dict[str, Any]:
        return {"model": dataclasses.asdict(ModelConfig.preset(args.preset))} if args.preset else {}

    config, args = _parse_config("knit train", "Megatron-core GRPO trainer fed by knittrans stores.", TrainConfig,
                                 argv, extra=extra, base=base)
    try:
        check_installed(config.tracking)
    except ImportError as exc:
        print(f"knit train: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT.replace("{rank}", os.environ.get("RANK", "0")))
    try:
        launch(config, nproc=args.nproc)  # SIGTERM stops the local ranks too
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


def rollout(argv: Sequence[str]) -> int:
    """``knit rollout``: a vLLM rollout worker streaming prompt groups to the stores."""
    import json

    from connectors.config import RolloutConfig
    from connectors.rollout import run_rollout

    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tiny", action="store_true", help="build a tiny random Llama at --model first if missing")

    config, args = _parse_config("knit rollout", "Generate prompt groups with vLLM and stream them to knittrans "
                                 "store nodes.", RolloutConfig, argv, extra=extra)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.tiny and not (Path(config.model) / "config.json").exists():
        from connectors.tiny_model import build_tiny_llama

        build_tiny_llama(config.model, seed=config.seed)
    report = run_rollout(config).to_dict()
    print(json.dumps({k: v for k, v in report.items() if k != "write_times"}))
    return 0


def report(argv: Sequence[str]) -> int:
    """``knit report RUN_DIR``: the prompt ledger in one line, the resumes, the checkpoints' cost."""
    from launcher import ledger, resume
    from schemas import run_folder
    from schemas.run_frames import LEDGER_FRAME

    parser = argparse.ArgumentParser(prog="knit report", description="Say whether a knit run trained each prompt "
                                     "once (its ledger.parquet, built from the run's event logs), how each resume "
                                     "went and what checkpointing cost. Exit 1 when the ledger has exceptions.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a knit run folder (or a --compare folder)")
    args = parser.parse_args(list(argv))
    folders = [args.run_dir] if (args.run_dir / ledger.EVENTS).is_dir() else sorted(
        p.parent.parent for p in args.run_dir.glob(f"*/{ledger.EVENTS}/{ledger.TRAINED_EVENTS}"))
    if not folders:
        print(f"knit report: {args.run_dir} holds no knit run with event logs", file=sys.stderr)
        return 2
    exact = True
    for out in folders:
        try:
            if (out / run_folder.RUN_CONFIG).exists():
                run_folder.check_run_folder(out)
            table = ledger.build(out)
        except run_folder.RunFolderError as exc:
            print(f"knit report: {exc}", file=sys.stderr)
            return 2
        run_folder.write_frame(table.to_arrow(), out / run_folder.LEDGER, LEDGER_FRAME)
        exact = exact and ledger.exceptions(table).height == 0
        print(f"{out}: {ledger.summary_line(table)}")
        for r in resume.resumes(out):
            start = f"the checkpoint of step {r.step}" if r.step else "the initial weights (no checkpoint)"
            first = (f"first step published {r.first_step_s} s after launch" if r.first_step_s is not None
                     else "stopped before it published a step")
            print(f"  resume {r.life}: from {start}, {first}; re-issued {r.reissued or 'none'}, kept "
                  f"{r.groups_kept} stored groups, rolled back {r.rolled_back} trained groups")
        cost = [s for _, s in ledger.read_history(out).checkpoints]
        if cost:
            print(f"  checkpoints: {len(cost)}, median {sorted(cost)[len(cost) // 2]:.3f} s, max {max(cost):.3f} s")
    return 0 if exact else 1


def run(argv: Sequence[str]) -> int:
    """``knit run``: the main job (see :mod:`launcher.main_job`)."""
    from launcher.main_job import main

    return main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "serve": (serve, "run one store node (Arrow Flight server)"),
    "run": (run, "run the RL loop: store nodes, a vLLM rollout worker, a Megatron trainer"),
    "train": (train, "run the Megatron-core trainer (--nproc N local ranks, or one rank under torchrun)"),
    "rollout": (rollout, "run a vLLM rollout worker that streams prompt groups to the stores"),
    "report": (report, "the prompt ledger of a run folder in one line, its resumes and checkpoint cost"),
    "meta": (meta, "polars SQL over the live trajectory metadata of every node"),
    "sql": (sql, "a Flight SQL gateway over the live trajectory metadata (ADBC, JDBC, DBeaver, Grafana)"),
    "demo": (demo, "the data flow in miniature on two in-process store nodes"),
}
"""Subcommand -> (function taking the arguments after it, one-line help)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``knit``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        usage = "usage: knit COMMAND [ARGS]  (knit COMMAND --help for its flags)\n\ncommands:\n" + "\n".join(lines)
        if args and args[0] not in ("-h", "--help"):
            print(f"knit: unknown command {args[0]!r}\n{usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0 if args else 2
    fn, _ = COMMANDS[args[0]]
    return int(fn(args[1:]) or 0)
