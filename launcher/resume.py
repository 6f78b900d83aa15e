"""``knit run --resume RUN_DIR``: take a stopped run up again from what it left on disk.

What survives a stop at any point (Ctrl-C, or SIGKILL of every process): the stores' spill logs (every
acknowledged group, release and version), the trainer's checkpoints (``checkpoints/step<N>``, ``latest``),
and the event logs (``events/``, ``launcher.ledger``). A resume, in order:

1. :func:`begin`: the checkpoint to restore (step ``S``; none: step 0, the seeded initial weights) and the
   life number; the earlier lives' per-step files are cut back to the steps ``< S`` the restored weights have
   seen and kept in ``history/`` (:func:`salvage`), ``progress.jsonl`` in place;
2. the stores start on their spill logs (not cleared);
3. :func:`prepare`: ``resume`` lines appended to both event logs; every prompt the run drew is settled from the
   logs and the stores' metadata. A group trained by a surviving step (``< S``) is done. A group trained by a
   step ``>= S`` is *rolled back*: the restored weights never saw it, its payload was released, so it is
   released (again) and its prompt dispatched again. A group the stores hold with every sample completed and
   not trained is kept: the planner admits it in the new life (it is never regenerated). A group stored
   aborted, or never written (in the engine, or queued, when the run stopped), has its prompt dispatched
   again. The new attempts go out under the policy version current at resume, so their
   ``policy_version_min`` and staleness are those of the new generation. A group the planner dropped for
   another reason (a filter) stays dropped. The planner starts from the checkpoint's train batch and position,
   the quota use of the steps of that train batch before ``S``, and every settled group marked admitted or
   dropped;
4. the trainer loads the checkpoint and trains the steps left; the rollout goes on after the prompts drawn;
5. :func:`merge`: at the end, ``history/`` and the new life's files become the run's files again, one
   continuous run with a seam at each resume (``resumes.jsonl``).

``knit run`` does the same within one launcher when a store node is lost for good or its rollout dies
(``launcher.run``, ``cause``): the groups written to a lost node (:func:`note_lost`) and not trained go out again
as ``node_lost``, the prompts a dead rollout held as ``rollout_lost``; an attempt superseded by a later one is
released and never planned.

The rule for steps after the last checkpoint keeps "each prompt trained once in the weights that survive":
their groups are rolled back and their prompts trained again. With ``--checkpoint-every 1`` (``knit run``'s
default) a checkpoint is written before each step's weights are published, so a resume rolls back at most
the step being taken. With ``N > 1`` the stores keep the newest version published by the lost steps (a
version never moves back): until the resumed trainer publishes a newer one, the rollout generates with
those weights, labelled with their version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from admission.config import AdmissionConfig
from admission.state import PlannerState
from connectors.config import RolloutConfig
from flight_store.config import ServerConfig
from flight_store.errors import NodeUnavailableError
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from launcher import ledger
from launcher.ledger import (
    EVENTS,
    ROLLOUT_EVENTS,
    TRAINED_EVENTS,
    Attempt,
    History,
    group_status,
    read_history,
    unstored,
)
from schemas import documents, run_folder
from schemas.ledger import (
    TRAINED_EVENT,
    NodeLost,
    Reissue,
    Resume,
    ResumeRecord,
    RolloutResume,
    TrainedStep,
    TrainerResume,
)
from schemas.run_folder import CONSUMED, PROGRESS, RESUMES, ROLLOUT_REPORT, append_line, read_lines
from schemas.run_frames import CONSUMED_FRAME, LEDGER_FRAME
from schemas.run_records import CONSUMED_ENTRY, ProgressLine, RankEnv, RankReportDocument, RowEntry, StepLine
from schemas.run_summary import CheckpointSeconds
from train.checkpointing import latest_step
from train.config import TrainConfig

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
"""The run folder's checkpoint folder."""
HISTORY = "history"
"""The run folder's per-step files of earlier lives, cut back to the surviving steps."""


@dataclass(frozen=True, slots=True)
class Resumption:
    """A resume about to start."""

    life: int
    """Which start of the run this is (1 = the first resume)."""
    step: int
    """The checkpoint's step (0: none, the seeded initial weights)."""
    launched_at: float
    """Unix time the resume was launched."""


def fresh(out: Path) -> None:
    """Clear what an earlier run in ``out`` left that a new run must not take for its own."""
    for name in (PROGRESS, CONSUMED, f"{CONSUMED}.arrows", ROLLOUT_REPORT, RESUMES, run_folder.LEDGER):
        (out / name).unlink(missing_ok=True)
    for p in out.glob("trainer_rank*.json*"):
        p.unlink()
    for folder in (EVENTS, CHECKPOINTS, HISTORY, "resume"):
        shutil.rmtree(out / folder, ignore_errors=True)


def begin(out: Path) -> Resumption:
    """The life and checkpoint of a resume of ``out``; salvages the earlier lives' per-step files.

    Raises:
        FileNotFoundError: ``out`` holds no run (no ``run_config.json``).
        schemas.run_folder.RunFolderError: ``out`` holds a run of another contract version, or a damaged record.
    """
    if not (out / run_folder.RUN_CONFIG).is_file():
        msg = f"{out} holds no knit run to resume (no {run_folder.RUN_CONFIG})"
        raise FileNotFoundError(msg)
    run_folder.check_run_folder(out)
    life = sum(1 for e in read_lines(TRAINED_EVENT, out / EVENTS / TRAINED_EVENTS) if isinstance(e, Resume)) + 1
    res = Resumption(life=life, step=latest_step(out / CHECKPOINTS) or 0, launched_at=time.time())
    salvage(out, res.step)
    return res


def prepare(out: Path, res: Resumption, admission: AdmissionConfig, locations: list[str], *,
            cause: str = "stopped") -> tuple[Path, Path]:
    """Settle every prompt drawn (see the module), release what must not be planned, and write the two resume
    documents; returns (trainer's, rollout's) paths. ``cause``: why the run was taken up again (``stopped``, or,
    within one launcher, ``node_lost`` or ``rollout_lost``: then the prompts a dead rollout held go out again as
    ``rollout_lost``)."""
    for name in (TRAINED_EVENTS, ROLLOUT_EVENTS):
        (out / EVENTS).mkdir(parents=True, exist_ok=True)
        append_line(out / EVENTS / name, Resume(life=res.life, step=res.step))
    h = read_history(out)
    with StoreReader(locations, timeout=10.0, retries=3) as client:
        # a node that does not answer now (killed and not started again yet, or cut off) is left out: its groups
        # count as unstored, so their prompts go out again and the groups are dropped for good (stale_groups)
        status = group_status(client.scan_metadata(partial=True))
        reissue, keep = settle(h, status, unwritten="rollout_lost" if cause == "rollout_lost" else "interrupted")
        stale = stale_groups(h, reissue)
        if stale:
            client.release(stale, partial=True)  # never planned again: free their payload and lookahead
        gone = [latest(h)[r.prompt_id] for r in reissue]
        if gone:  # a rollout killed (or a store node still running) may have left them registered in flight
            with StoreWriter.sharing(client) as writer:
                try:
                    writer.resolve(gone, "cancelled")
                except NodeUnavailableError as exc:  # its registrations are stale: their prompts go out again
                    log.warning("resume: in-flight groups not resolved on a node that does not answer: %s", exc)
    planner = planner_state(h, res.step, admission, stale)
    folder = out / "resume"
    folder.mkdir(exist_ok=True)
    trainer = folder / f"trainer.life{res.life}.json"
    run_folder.write_document(TrainerResume(life=res.life, step=res.step, planner=planner.to_dict()), trainer)
    rollout = folder / f"rollout.life{res.life}.json"
    run_folder.write_document(RolloutResume(life=res.life, drawn=h.drawn, reissue=reissue), rollout)
    append_line(out / RESUMES, ResumeRecord(life=res.life, step=res.step, launched_at=res.launched_at, cause=cause,
                                            prompts_drawn=h.drawn, groups_kept=keep, rolled_back=len(h.rolled_back),
                                            reissued=dict(Counter(r.reason for r in reissue))))
    return trainer, rollout


def note_lost(out: Path, node: str, location: str) -> None:
    """Record in the rollout's event log that the store node ``node`` (at ``location``) is lost for good: the groups
    written there and not trained are dispatched again at the next :func:`prepare` (``node_lost``)."""
    (out / EVENTS).mkdir(parents=True, exist_ok=True)
    append_line(out / EVENTS / ROLLOUT_EVENTS, NodeLost(node=node, location=location, at=round(time.time(), 3)))


def note_gone(out: Path, indices: range) -> None:
    """The store nodes ``indices`` of an earlier start of the run, not started again (a resume under ``--ray`` on
    fewer nodes), are lost for good (:func:`note_lost`, each from its ``configs/store{i}.json``)."""
    for i in indices:
        path = out / "configs" / f"store{i}.json"
        if path.is_file():
            node = documents.read(ServerConfig, path)
            note_lost(out, str(node.node_name), node.location)


def settle(h: History, status: dict[str, bool], *, unwritten: str = "interrupted") -> tuple[list[Reissue], int]:
    """The prompts to dispatch again (in stream order) and the number of stored groups kept for the planner;
    ``unwritten``: the reason of a prompt whose latest group no store holds and none was lost with
    (:func:`launcher.ledger.unstored`)."""
    attempts: dict[str, list[Attempt]] = {}
    for d in h.dispatches:
        attempts.setdefault(d.prompt_id, []).append(d)
    reissue: list[Reissue] = []
    kept = 0
    last = latest(h)
    for pid, (index, _) in sorted(h.draws.items(), key=lambda kv: kv[1][0]):
        tries = attempts.get(pid, [])
        if any(d.group_id in h.trained for d in tries):
            continue
        gid = last[pid]
        if gid in h.rolled_back:
            reason = "rolled_back"
        elif h.dropped.get(gid, "aborted") != "aborted":
            continue  # dropped by a filter: the prompt's answer, not a loss
        elif status.get(gid):
            kept += 1
            continue
        else:
            reason = "aborted" if gid in status else unstored(gid, h, unwritten)
        reissue.append(Reissue(index=index, prompt_id=pid, attempt=len(tries), reason=reason))
    return reissue, kept


def latest(h: History) -> dict[str, str]:
    """prompt_id -> the group of its latest attempt (its first group id when it was drawn and never dispatched)."""
    return {pid: first for pid, (_, first) in h.draws.items()} | {d.prompt_id: d.group_id for d in h.dispatches}


def superseded(h: History) -> set[str]:
    """The groups of the attempts at a prompt before its latest, not trained: never planned (a node lost for good
    that a later launcher brings back holds groups whose prompts were regenerated)."""
    return {d.group_id for d in h.dispatches} - set(latest(h).values()) - set(h.trained)


def stale_groups(h: History, reissue: list[Reissue]) -> list[str]:
    """The groups never to be planned again: rolled back, dropped, superseded, and the latest group of each prompt
    dispatched again now. That last one no store answering held it (or it was aborted); a node cut off at the
    resume may still hold it and answer later, and its prompt must not be trained twice."""
    last = latest(h)
    return sorted(h.rolled_back | set(h.dropped) | superseded(h) | {last[r.prompt_id] for r in reissue})


def planner_state(h: History, step: int, admission: AdmissionConfig, dropped: list[str]) -> PlannerState:
    """The planner's state at the checkpoint of ``step``: its train batch and position, the quota use of the
    surviving steps of that train batch, the trained groups admitted, ``dropped`` dropped."""
    k = admission.mini_batches
    t, position = divmod(step, k)
    used: Counter[tuple[str, str]] = Counter()
    for gid, s in h.trained.items():
        if s >= t * k:
            used.update(h.quotas.get(gid, {}).items())
    return PlannerState(train_batch=t, position=position, admitted=frozenset(h.trained), dropped=frozenset(dropped),
                        quota_used=tuple(sorted((c, v, n) for (c, v), n in used.items())))


# ---- the per-step files: cut back at a resume, joined at the end ------------------------------------------


def salvage(out: Path, step: int) -> None:
    """Move the earlier lives' per-step records of the steps ``< step`` to ``history/`` (and cut
    ``progress.jsonl`` back to them): consumed trajectories (the Parquet file or the stream a kill left),
    trainer rank reports (whole or the side files a kill left). A surviving step whose publish a kill cut short
    has no progress line and no rank 0 record (both are written once it is published): they are rebuilt from
    the trained log's step event and the consumed trajectories (:func:`_recover`)."""
    hist = out / HISTORY
    hist.mkdir(exist_ok=True)
    frames = [f for f in (_read_consumed(hist / CONSUMED), _read_consumed(out / CONSUMED),
                          _read_stream(out / f"{CONSUMED}.arrows")) if f is not None]
    consumed = pl.concat(frames, how="diagonal_relaxed").filter(pl.col("step") < step) if frames else None
    if consumed is not None:
        consumed.write_parquet(hist / CONSUMED)
    events = {s: e for s, e in read_history(out).steps.items() if s < step}
    kept = [ln for ln in read_lines(ProgressLine, out / PROGRESS) if ln.step < step]
    have = {ln.step for ln in kept}
    kept += [_recover(e, consumed)[0] for s, e in events.items() if s not in have]
    run_folder.write_lines(out / PROGRESS, sorted(kept, key=lambda ln: ln.step))
    for rank_doc in sorted({p.name.split(".json")[0] for p in out.glob("trainer_rank*.json*")}):
        doc = _rank_doc(out, rank_doc, hist)
        doc.steps = [s for s in doc.steps if s.step < step]
        doc.consumed = [c for c in doc.consumed if c.step < step]
        if rank_doc == "trainer_rank0":
            have = {s.step for s in doc.steps}
            for s, e in events.items():
                if s not in have:
                    _, record, rows = _recover(e, consumed)
                    doc.steps.append(record)
                    doc.consumed += rows
            doc.steps.sort(key=lambda s: s.step)
        run_folder.write_document(doc, hist / f"{rank_doc}.json", indent=None)
        for p in out.glob(f"{rank_doc}.json*"):
            p.unlink()
    for p in (out / CONSUMED, out / f"{CONSUMED}.arrows", out / ROLLOUT_REPORT):
        p.unlink(missing_ok=True)


def _recover(event: TrainedStep, consumed: pl.DataFrame | None) -> tuple[ProgressLine, StepLine, list[RowEntry]]:
    """A step's progress line, rank 0's record and rank 0's received rows, from its trained-log event and the
    consumed trajectories (what the planner admitted into it; the step trained exactly those)."""
    m, step = event.metrics, event.step
    rows = consumed.filter(pl.col("step") == step) if consumed is not None else pl.DataFrame()
    record = StepLine.model_validate({**m.model_dump(), "version": event.version, "plan_wait_s": 0.0,
                                      "t_end": event.t_end})
    figures: dict[str, Any] = {}
    received: list[RowEntry] = []
    if rows.height:
        staleness = rows.get_column("arch_staleness")
        figures = {"arch_staleness_mean": staleness.mean(), "arch_staleness_max": staleness.max(),
                   "reward_mean": rows.get_column("reward").mean()}
        rank0 = rows.filter(pl.col("dp_rank") == 0).select("group_id", "sample_idx")
        received = [RowEntry(step=step, group_id=g, sample_idx=i) for g, i in rank0.iter_rows()]
    admitted = (consumed.filter(pl.col("step") <= step).get_column("group_id").n_unique()
                if consumed is not None else 0)
    line = ProgressLine(step=step, train_batch=m.train_batch, position=m.position, version=event.version,
                        loss=m.loss, rows=m.rows, abs_logp_diff=m.abs_logp_diff, plan_wait_s=0.0,
                        step_time_s=m.step_time_s, t_end=event.t_end, admitted_groups=admitted, **figures)
    return line, record, received


def _rank_doc(out: Path, name: str, hist: Path) -> RankReportDocument:
    """A rank's report of the earlier lives: ``history/`` plus the last life's document or side files."""
    doc = RankReportDocument(env=RankEnv(rank=int(name.removeprefix("trainer_rank"))))
    if (hist / f"{name}.json").exists():
        doc = run_folder.read_document(RankReportDocument, hist / f"{name}.json")
    whole = out / f"{name}.json"
    if whole.exists():
        last = run_folder.read_document(RankReportDocument, whole)
        doc.env = last.env
        doc.steps += last.steps
        doc.consumed += last.consumed
    doc.steps += read_lines(StepLine, out / f"{name}.json.steps.jsonl")
    doc.consumed += read_lines(CONSUMED_ENTRY, out / f"{name}.json.consumed.jsonl")
    return doc


def _read_consumed(path: Path) -> pl.DataFrame | None:
    """``consumed.parquet`` (its ``step`` column checked), or None when there is none."""
    if not path.exists():
        return None
    return pl.from_arrow(run_folder.read_frame(path, CONSUMED_FRAME, required=("step",)))  # type: ignore[return-value]


def _read_stream(path: Path) -> pl.DataFrame | None:
    """The whole record batches of an Arrow IPC stream a kill cut short."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    batches = []
    with contextlib.suppress(pa.ArrowInvalid, OSError), pa.ipc.open_stream(str(path)) as reader:
        for batch in reader:
            batches.append(batch)
    return pl.from_arrow(pa.Table.from_batches(batches)) if batches else None  # type: ignore[return-value]


def merge(out: Path) -> None:
    """Join ``history/`` and the last life's per-step files into the run's files (a run never resumed: nothing)."""
    hist = out / HISTORY
    if not hist.is_dir():
        return
    for old in hist.glob("trainer_rank*.json"):
        doc = run_folder.read_document(RankReportDocument, old)
        new = out / old.name
        if new.exists():
            last = run_folder.read_document(RankReportDocument, new)
            doc = RankReportDocument(env=last.env, steps=doc.steps + last.steps, consumed=doc.consumed + last.consumed)
        run_folder.write_document(doc, new, indent=None)
        old.unlink()  # the run's file holds it now
    frames = [f for f in (_read_consumed(hist / CONSUMED), _read_consumed(out / CONSUMED)) if f is not None]
    if frames:
        pl.concat(frames, how="diagonal_relaxed").sort("step").write_parquet(out / CONSUMED)
    (hist / CONSUMED).unlink(missing_ok=True)


def configs(train: TrainConfig, rollout: RolloutConfig, res: Resumption, docs: tuple[Path, Path],
            prefix: str) -> tuple[TrainConfig, RolloutConfig]:
    """The resumed life's trainer and rollout configs: from the checkpoint's step, the steps left, the resume
    documents; the rollout's group ids get the life in their prefix (a group id is never written twice)."""
    trainer, rollout_doc = docs
    return (dataclasses.replace(train, initial_version=res.step, max_steps=max(0, train.max_steps - res.step),
                                resume_path=str(trainer)),
            dataclasses.replace(rollout, resume_path=str(rollout_doc), group_id_prefix=f"{prefix}L{res.life}-"))


def finish(out: Path, metadata: pl.DataFrame) -> dict[str, Any]:
    """At the end of a life: the run's files joined (:func:`merge`), ``ledger.parquet`` written; returns the
    summary's ledger, resume and checkpoint figures (``schemas.run_summary.PolicySummary``'s fields)."""
    merge(out)
    table = ledger.build(out, metadata)
    run_folder.write_frame(table.to_arrow(), out / run_folder.LEDGER, LEDGER_FRAME)
    cost = [s for _, s in read_history(out).checkpoints]
    return {"ledger": ledger.figures(table), "resumes": resumes(out),
            "checkpoint_s": CheckpointSeconds(count=len(cost),
                                              median=round(sorted(cost)[len(cost) // 2], 4) if cost else None,
                                              max=round(max(cost), 4) if cost else None)}


def resumes(out: Path) -> list[ResumeRecord]:
    """The resumes of the run folder ``out`` with the seconds each took from launch to its first step."""
    lines = list(read_lines(ResumeRecord, out / RESUMES))
    steps = list(read_lines(ProgressLine, out / PROGRESS))
    for i, r in enumerate(lines):  # a life's first step: before the next resume was launched
        end = lines[i + 1].launched_at if i + 1 < len(lines) else float("inf")
        first = next((s for s in steps if r.launched_at < s.t_end < end), None)
        r.first_step_s = round(first.t_end - r.launched_at, 2) if first else None
    return lines
