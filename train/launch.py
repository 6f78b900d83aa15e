"""Run a function on every rank of a job: the one rank launcher of the trainer and its tools.

Under ``torchrun`` (``WORLD_SIZE`` set) this process is one rank and the function runs here.
Otherwise :func:`run_ranks` starts ``nproc`` local ranks itself (torch.multiprocessing, spawn),
with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` set and ``MASTER_ADDR``/``MASTER_PORT``
pointing at a free port (``flight_store.net.free_port``); each rank logs at the caller's level with
its rank in every line. If a rank fails, the others are stopped and the failure is raised here; if
this process is interrupted (SIGINT) or terminated (SIGTERM, turned into ``SystemExit`` while the ranks
run), the ranks are stopped.

:func:`launch` is what ``python -m train`` and ``knit train`` call: the trainer on every rank.

Example::

    launch(documents.read(TrainConfig, "train.json"), nproc=2)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from flight_store.net import free_port
from train.config import TrainConfig
from train.planning import PlannerLike

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s [rank{rank}] %(name)s %(levelname)s %(message)s"
"""Log line format of a rank (``{rank}`` is replaced by the global rank)."""


def launch(cfg: TrainConfig, nproc: int = 1, *, planner: PlannerLike | None = None) -> None:
    """Train with ``cfg`` on every rank: this process under torchrun, else ``nproc`` local ranks.

    ``planner`` replaces rank 0's ``admission.Planner`` (it must pickle when ranks are spawned).
    """
    run_ranks(_train, cfg, planner, nproc=nproc)


def _train(cfg: TrainConfig, planner: PlannerLike | None) -> None:
    from train.loop import run

    run(cfg, planner=planner)


def run_ranks(fn: Callable[..., Any], *args: Any, nproc: int = 1, master_addr: str = "127.0.0.1") -> None:
    """Call ``fn(*args)`` on every rank (``fn`` and ``args`` must pickle when ranks are spawned).

    Raises:
        ValueError: ``nproc`` < 1 (when not under torchrun).
        ImportError: torch is not installed.
    """
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        fn(*args)
        return
    if nproc < 1:
        msg = f"nproc must be >= 1, got {nproc}"
        raise ValueError(msg)
    try:
        import torch.multiprocessing as mp
    except ImportError as exc:
        msg = "the trainer needs torch and megatron-core: pip install knittrans[train]"
        raise ImportError(msg) from exc
    port = free_port(master_addr)
    level = logging.getLogger().getEffectiveLevel()
    ctx = mp.start_processes(_rank_entry, args=(nproc, master_addr, port, level, fn, args), nprocs=nproc,
                             join=False, start_method="spawn")
    previous = _exit_on_sigterm()
    try:
        while not ctx.join():
            pass
    finally:  # interrupted, terminated (or a rank failed): stop the ranks still running
        alive = [p for p in ctx.processes if p.is_alive()]
        for p in alive:
            p.terminate()
        for p in alive:
            p.join(timeout=30)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm() -> Any:
    """While ranks run, SIGTERM raises ``SystemExit`` here (so they are stopped); returns the handler it replaced
    (``None`` off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _rank_entry(local_rank: int, world: int, master_addr: str, port: int, level: int, fn: Callable[..., Any],
                args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT.replace("{rank}", str(local_rank)))
    fn(*args)
