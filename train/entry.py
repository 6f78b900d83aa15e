"""Command line of the trainer: ``knit train ...`` and ``torchrun ... -m train ...``.

Under ``torchrun`` (``WORLD_SIZE`` set) every process is one rank. Without it, ``--nproc N``
starts N local ranks itself (torch.multiprocessing, a free loopback port), which is what
``knit train --nproc 2`` does on one machine.

Example:
    knit train --stores grpc://127.0.0.1:8815 --nproc 2 --tp 1 \\
        --planner-option train_batch_groups=8 --planner-option group_size=4 --planner-option mini_batches=2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from train.config import LossConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        msg = f"planner option must be KEY=VALUE (VALUE in JSON where not a plain string), got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def parser() -> argparse.ArgumentParser:
    """The trainer's argument parser."""
    p = argparse.ArgumentParser(prog="knit train", description="Megatron-core GRPO trainer fed by knittrans stores")
    p.add_argument("--stores", required=True, help="comma-separated store locations (grpc://host:port,...)")
    p.add_argument("--token", default=None, help="bearer token of the stores")
    p.add_argument("--model", default="tiny", help="model preset (tiny, smollm2-135m, llama-3.2-1b, ...)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.2)
    p.add_argument("--planner", default="admission:Planner", help="planner factory module:callable")
    p.add_argument("--planner-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="planner config field (repeatable), e.g. train_batch_groups=8")
    p.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (0 = until idle)")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="stop after this many seconds without data")
    p.add_argument("--pack", choices=["padded", "thd"], default="padded")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--initial-version", type=int, default=0)
    p.add_argument("--publish-weights", action="store_true", help="DoPut HF-named weights after every step")
    p.add_argument("--save-dir", default=None, help="write a dist checkpoint here at the end")
    p.add_argument("--load-dir", default=None, help="load a dist checkpoint before the first step")
    p.add_argument("--report", default=None, help="per-rank JSON report path ({rank} is replaced)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--progress", default=None, help="rank 0 appends one JSON line per step to this file")
    p.add_argument("--consumed", default=None, help="rank 0 writes the consumed trajectories here (Parquet)")
    p.add_argument("--nproc", type=int, default=1, help="ranks to start locally when not under torchrun")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build the typed config from parsed arguments."""
    model = ModelConfig.preset(args.model)
    if args.vocab_size is not None:
        model.vocab_size = args.vocab_size
    return TrainConfig(
        stores=[s for s in args.stores.split(",") if s], token=args.token, model=model,
        parallel=ParallelConfig(tensor_parallel=args.tp, backend=args.backend,
                                timeout_s=max(600.0, 2 * args.idle_timeout)),
        optim=OptimConfig(lr=args.lr, clip_grad=args.clip_grad),
        loss=LossConfig(clip_low=args.clip_low, clip_high=args.clip_high),
        planner=args.planner, planner_options=dict(args.planner_option), max_steps=args.max_steps,
        idle_timeout_s=args.idle_timeout, pack=args.pack, prefetch_depth=args.prefetch_depth,
        initial_version=args.initial_version, publish_weights=args.publish_weights, save_dir=args.save_dir,
        load_dir=args.load_dir, report_path=args.report, seed=args.seed, progress_path=args.progress,
        consumed_path=args.consumed,
    )


def _setup_logging(level: str) -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s [rank{rank}] %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)


def _rank_main(local_rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = parser().parse_args(argv)
    _setup_logging(args.log_level)
    from train.trainer import run

    run(config_from_args(args))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    config_from_args(args)  # validate before starting any process
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        _setup_logging(args.log_level)
        from train.trainer import run

        run(config_from_args(args))
        return 0
    if args.nproc < 1:
        msg = f"--nproc must be >= 1, got {args.nproc}"
        raise SystemExit(msg)
    try:
        import torch.multiprocessing as mp
    except ImportError as exc:
        msg = "the trainer needs torch and megatron-core: pip install knittrans[train]"
        raise ImportError(msg) from exc
    mp.spawn(_rank_main, args=(args.nproc, _free_port(), argv), nprocs=args.nproc, join=True)
    return 0
