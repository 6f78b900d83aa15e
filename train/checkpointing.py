"""The trainer's resumable checkpoints: model and optimizer as one Megatron dist checkpoint, written atomically.

A run's checkpoint folder (``TrainConfig.checkpoint_dir``) holds one sub-folder per checkpoint,
``step<N>`` (N: optimizer steps applied, which is also the policy version of the weights), and a
pointer file ``latest`` naming the newest complete one. A checkpoint is written into
``tmp-step<N>`` first (every rank its shards, Megatron ``dist_checkpointing``), then rank 0 writes
``trainer_state.json`` into it, renames it to ``step<N>`` and replaces ``latest`` (a file written
beside it and renamed over it, fsynced): a kill at any moment leaves ``latest`` naming a whole
checkpoint, the previous one until the rename. The two newest checkpoints are kept.

The state saved is the model's sharded state dict and the Megatron optimizer's (Adam moments, its
step count, the fp32 main parameters of a bf16 model); ``trainer_state.json`` says the step.

Example::

    save(built, "run/checkpoints", step=8)          # collective: every rank calls it
    step = latest_step("run/checkpoints")            # 8
    load(built, "run/checkpoints", step)             # collective
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from admission.state import PlannerState
    from train.config import TrainConfig
    from train.model import Built
    from train.trained_log import TrainedLog

log = logging.getLogger(__name__)

LATEST = "latest"
"""The pointer file naming the newest complete checkpoint (``step<N>``)."""
STATE = "trainer_state.json"
"""The file in a checkpoint that says which step it holds."""
KEEP = 2
"""Checkpoints kept (the newest ones)."""


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be resumed from (names the folder and what is wrong)."""


def step_folder(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint after ``step`` optimizer steps."""
    return Path(root) / f"step{step}"


def latest_step(root: str | Path) -> int | None:
    """The step of the newest complete checkpoint under ``root`` (None when there is none).

    Raises:
        CheckpointError: ``latest`` names a folder that is missing or does not say its step.
    """
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    state = Path(root) / name / STATE
    try:
        return int(json.loads(state.read_text())["step"])
    except (OSError, ValueError, KeyError) as exc:
        msg = f"checkpoint {Path(root) / name} (named by {pointer}) is not readable: {exc}"
        raise CheckpointError(msg) from None


def _state_dict(built: Built, *, loading: bool) -> dict[str, Any]:
    model_sd = built.gpt.sharded_state_dict(prefix="")
    return {"model": model_sd, "optimizer": built.optimizer.sharded_state_dict(model_sd, is_loading=loading)}


def save(built: Built, root: str | Path, step: int) -> float:
    """Write the checkpoint after ``step`` steps and point ``latest`` at it; returns the seconds it took.

    Collective: every rank calls it (each writes its shards; rank 0 completes it).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    rank = dist.get_rank()
    tmp = Path(root) / f"tmp-step{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a write a kill interrupted
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_state_dict(built, loading=False), str(tmp))
    dist.barrier()
    if rank == 0:
        _write_synced(tmp / STATE, json.dumps({"step": step, "saved_at": time.time()}))
        final = step_folder(root, step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_synced(Path(root) / f"{LATEST}.tmp", final.name)
        os.replace(Path(root) / f"{LATEST}.tmp", Path(root) / LATEST)
        _fsync_dir(Path(root))
        _prune(Path(root), keep=final.name)
    dist.barrier()
    took = time.perf_counter() - t0
    log.info("checkpoint of step %d written to %s in %.3f s", step, step_folder(root, step), took)
    return took


def load(built: Built, root: str | Path, step: int) -> None:
    """Load the checkpoint after ``step`` steps into the model and its optimizer (collective).

    Raises:
        CheckpointError: the folder is missing.
    """
    from megatron.core import dist_checkpointing

    folder = step_folder(root, step)
    if not (folder / STATE).is_file():
        msg = f"no complete checkpoint of step {step} at {folder}"
        raise CheckpointError(msg)
    state = dist_checkpointing.load(_state_dict(built, loading=True), str(folder))
    built.gpt.load_state_dict(state["model"])
    built.optimizer.load_state_dict(state["optimizer"])
    log.info("resumed model and optimizer from %s", folder)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, *, keep: str) -> None:
    """Remove all but the :data:`KEEP` newest complete checkpoints (``keep`` is the newest)."""
    done = sorted((p for p in root.glob("step*") if p.is_dir() and p.name[4:].isdigit()),
                  key=lambda p: int(p.name[4:]))
    for old in done[:-KEEP]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


class Checkpointer:
    """The loop's checkpoint cadence and its record of what each step trained (``TrainConfig.checkpoint_dir``,
    ``checkpoint_every``, ``trained_path``).

    After each step (:meth:`after_step`): rank 0 logs the step's groups (``train.trained_log``), then every rank
    writes the checkpoint when one is due, its seconds added to the step's metrics as ``checkpoint_s``. When
    the run ends (:meth:`finish`), the last weights are checkpointed unless they already are. A clean stop:
    SIGTERM to the ranks (``knit run``'s Ctrl-C) ends the loop after the step being taken (:meth:`stopping`,
    agreed by every rank), and :meth:`finish` checkpoints it.
    """

    def __init__(self, cfg: TrainConfig, built: Built, trained: TrainedLog | None) -> None:
        self._root = cfg.checkpoint_dir
        self._every = cfg.checkpoint_every
        self._built = built
        self._trained = trained
        self._saved = cfg.initial_version  # what the trainer started from needs no checkpoint
        self._stop = False
        self._warm: threading.Thread | None = None
        if self._root:  # the writer process the first save would start: started now, beside the start-up
            self._warm = threading.Thread(target=_start_writer, name="knit-ckpt-warm", daemon=True)
            self._warm.start()
        if self._root and threading.current_thread() is threading.main_thread():  # SIGTERM: a clean stop
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        log.warning("SIGTERM: stopping after the step being taken, with a checkpoint")
        self._stop = True

    def stop_requested(self) -> bool:
        """Whether this rank was asked to stop (SIGTERM): the planner's wait for data ends at once."""
        return self._stop

    def stopping(self) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it after each step)."""
        if not self._root:
            return False
        import torch
        import torch.distributed as dist

        from train.mcore_compat import device

        flag = torch.tensor([int(self._stop)], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def after_step(self, step: int, version: int, group_ids: Sequence[str], metrics: dict[str, Any]) -> None:
        """Log step ``step``'s groups (rank 0) and checkpoint the weights of ``version`` when due (collective)."""
        if self._trained is not None:
            self._trained.step(step, version, group_ids, metrics)
        if self._root and self._every and version % self._every == 0:
            metrics["checkpoint_s"] = self._save(version)

    def finish(self, version: int) -> None:
        """Checkpoint the final weights unless the last checkpoint holds them (collective)."""
        if self._root and self._saved != version:
            self._save(version)

    def _save(self, version: int) -> float:
        if self._warm is not None:
            self._warm.join()
            self._warm = None
        if self._trained is not None:
            self._trained.sync()  # the groups a checkpoint covers are on disk before it
        took = save(self._built, self._root or ".", version)
        self._saved = version
        if self._trained is not None:
            self._trained.checkpoint(version, took)
        return took


def _start_writer() -> None:
    """Start the process Megatron's dist checkpointing writes through (once per process; about 5 s on a loaded
    CPU), so the first checkpoint does not wait for it.

    It starts with SIGTERM blocked (a blocked mask is inherited across fork and exec): a clean stop signals the
    trainer's whole process group, and the checkpoint that stop writes goes through this process, so it must
    outlive the SIGTERM (the launcher's SIGKILL of the group's stragglers ends it afterwards)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # pragma: no cover - depends on the megatron-core version
        return
    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this thread only: it ends after the start
        start()


def resume_planner_state(cfg: TrainConfig) -> PlannerState | None:
    """The planner's state at the checkpoint the trainer resumes from (``cfg.resume_path``), or None."""
    if cfg.resume_path is None:
        return None
    from admission.state import PlannerState
    from schemas.ledger import TrainerResume
    from schemas.run_folder import read_document

    doc = read_document(TrainerResume, cfg.resume_path)
    if doc.step != cfg.initial_version:
        msg = f"resume document {cfg.resume_path} is for step {doc.step}, the trainer starts at {cfg.initial_version}"
        raise CheckpointError(msg)
    return PlannerState.from_dict(doc.planner)
