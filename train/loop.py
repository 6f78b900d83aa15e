"""The trainer loop, written once for every kind of step: connect -> scan -> plan -> fetch -> step.

Every rank runs :func:`run`. Rank 0 also hosts the planner (``train.planning``): it scans metadata,
plans each mini-batch as soon as admission allows, and broadcasts the plans. What differs between
the kinds of trainer is a :class:`Step`: ``train.trainer.TextStep``, ``train.mm_trainer.MultimodalStep``
(``TrainConfig.vision`` set) or ``train.vl_step.VisionLanguageStep`` (a vision-language ``hf_checkpoint``). It
builds its model, submits each plan's fetches of this rank's slices to its prefetch thread, and takes the
optimizer step. After
each step rank 0 publishes the new policy version to every store (and the weights, when asked) and
releases the consumed groups.

Publishing runs beside the next step (:class:`Publisher`): the training thread only encodes the weights
(a copy under HF names, cast to ``publish_dtype``); a thread of rank 0 stores them on every node, then
publishes the version, then releases the step's groups, one version at a time.

Each step taken is one :class:`StepRecord`, built once it is published (logged, and written to
``report_path`` by :class:`RankReport` as a ``schemas.run_records.StepLine``): the step's own metrics (see
``train.backbone.step_metrics`` and each step; the off-policy ones and the token staleness, ``train.offpolicy``)
plus ``version``, ``plan_wait_s``, ``t_end``, ``publish_s`` (what publishing cost the training
thread: encoding, and waiting for the version before) and ``publish_done_s`` (rank 0: the step's end to its
version published on every node; rank 0 records a step then, before releasing its groups).
Rank 0 appends a ``schemas.run_records.ProgressLine`` per step (``progress_path``, :func:`progress_line`) and the
planner's consumed trajectories as they are admitted (``consumed_path``, ``train.planning.ConsumedLog``), and sends
each step's figures to the trackers (``TrainConfig.tracking``, ``train.step_tracking``). Every record goes to disk as
the run goes, through ``schemas.run_folder``: the loop keeps nothing per step or per group in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from schemas.plan import MiniBatchPlan
from schemas.run_folder import LineWriter, append_line, dumps
from schemas.run_records import ConsumedEntry, ProgressLine, RankEnv, SliceEntry, StepLine
from train.config import TrainConfig
from train.offpolicy import with_token_staleness
from train.planning import PlannerLike, PlanSource, StepFigures
from train.step_tracking import StepTracker, start_tracker

if TYPE_CHECKING:
    from train.checkpointing import Checkpointer
    from train.model import Built

if TYPE_CHECKING:
    from flight_store.client import StoreNodes
    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimizer step taken by this rank, as it is recorded (:class:`RankReport`, :class:`ProgressLine`).

    The loop builds it when the step ends; rank 0's :class:`Publisher` completes it with the publishing times
    (:meth:`published`), a new record.
    """

    metrics: Mapping[str, Any]
    """The step's own metrics (``train.backbone.step_metrics`` and the step kind's)."""
    version: int
    """The policy version the step produced."""
    plan_wait_s: float
    """Seconds the loop waited for plans since the step before."""
    t_end: float
    """Unix time the step ended."""
    consumed: tuple[ConsumedEntry, ...] = ()
    """This rank's consumed entries (kept only with a report)."""
    figures: StepFigures | None = None
    """Rank 0: the staleness and reward figures of the step's trajectories."""
    publish_s: float | None = None
    """What publishing cost the training thread (encoding, waiting for the version before)."""
    publish_done_s: float | None = None
    """Rank 0: the step's end to its version published on every node."""

    def published(self, publish_s: float, publish_done_s: float | None = None) -> StepRecord:
        """This record with its publishing times."""
        return dataclasses.replace(self, publish_s=publish_s, publish_done_s=publish_done_s)

    def to_line(self) -> StepLine:
        """The step's line in the rank report: its metrics, the loop's fields, the publishing times."""
        return StepLine.model_validate({**self.metrics, "version": self.version, "plan_wait_s": self.plan_wait_s,
                                        "t_end": self.t_end, "publish_s": self.publish_s,
                                        "publish_done_s": self.publish_done_s})


class Step(Protocol):
    """One kind of optimizer step: what it builds (in its constructor), how it fetches, how it steps.

    Built as ``Kind(cfg, env, client)`` on every rank, after the process group exists.
    """

    built: Built
    """The backbone (``train.model.Built``): checkpoints and published weights are its."""

    def submit(self, plan: MiniBatchPlan) -> None:
        """Queue this rank's fetches of ``plan`` on the prefetch thread (ahead of its step)."""
        ...

    def step(self, plan: MiniBatchPlan, consumed: list[ConsumedEntry]) -> dict[str, Any]:
        """One optimizer step over this rank's share of ``plan``; its metrics.

        May append a ``schemas.run_records.RowEntry`` to ``consumed`` for every row received.
        """
        ...

    def close(self) -> None:
        """Stop the prefetch thread."""
        ...


def run(cfg: TrainConfig, *, planner: PlannerLike | None = None) -> int:
    """Train until ``max_steps`` mini-batches are consumed or no data arrives for ``idle_timeout_s``.

    Collective: every rank calls it. Rank 0 plans with ``planner`` when given, else with
    ``admission.Planner(cfg.admission)`` (``dp_ranks`` set from the process group). Returns the number
    of optimizer steps taken (their metrics are in the report and the log).
    """
    from admission.planner import Planner
    from flight_store.reading import StoreReader
    from train import checkpointing, hf_llama, mcore_compat, model
    from train.planning import ConsumedLog, with_dp_ranks
    from train.trained_log import TrainedLog

    env = mcore_compat.init_distributed(cfg.parallel, seed=cfg.seed)
    admission = with_dp_ranks(cfg.admission, env["dp_size"])  # every rank checks: none waits on a failed rank 0
    if env["rank"] == 0 and planner is None:
        planner = Planner(admission, checkpointing.resume_planner_state(cfg))
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(StoreReader.from_config(cfg.stores, cfg.client))
        kind = _build_step(cfg, env, client)
        stack.callback(kind.close)
        if cfg.resume_path and cfg.checkpoint_dir and cfg.initial_version > 0:  # 0: no checkpoint, the seeded init
            checkpointing.load(kind.built, cfg.checkpoint_dir, cfg.initial_version)
        trained = (stack.enter_context(contextlib.closing(TrainedLog(cfg.trained_path,
                                                                     quota_columns=admission.quota_columns)))
                   if cfg.trained_path and env["rank"] == 0 else None)
        report = stack.enter_context(RankReport(cfg.report_path, env)) if cfg.report_path else None
        source = None
        if env["rank"] == 0 and planner is not None:
            source = PlanSource(client, planner, supply_from_stores=cfg.supply_from_stores,
                                consumed_log=stack.enter_context(ConsumedLog(cfg.consumed_path)))
            source.on_settled = trained.settled if trained is not None else None
        tracker = stack.enter_context(start_tracker(cfg, source)) if source is not None else None
        durable = checkpointing.Checkpointer(cfg, kind.built, trained)
        if source is not None:
            source.stop_requested = durable.stop_requested
        log.info("rank %d ready: %s", env["rank"], env)
        if cfg.publish_weights:  # the rollout starts from the trainer's weights (version initial_version)
            publish_weights(kind.built, client, cfg.initial_version, env, dtype=cfg.publish_dtype)
        steps = _train(cfg, env, kind, client, source, report, durable, tracker)
        if cfg.save_dir:
            model.save_checkpoint(kind.built.gpt, cfg.save_dir)
        if cfg.export_hf_dir:
            hf_llama.save_hf_checkpoint(kind.built.gpt, cfg.export_hf_dir, cfg.model, write=env["rank"] == 0)
    mcore_compat.shutdown()
    return steps


def _build_step(cfg: TrainConfig, env: dict[str, int], client: StoreReader) -> Step:
    if cfg.model.vision_language:
        from train.vl_step import VisionLanguageStep

        return VisionLanguageStep(cfg, env, client)
    if cfg.vision is not None:
        from train.mm_trainer import MultimodalStep

        return MultimodalStep(cfg, env, client)
    from train.trainer import TextStep

    return TextStep(cfg, env, client)


def _train(cfg: TrainConfig, env: dict[str, int], kind: Step, client: StoreReader, source: PlanSource | None,
           report: RankReport | None, durable: Checkpointer, tracker: StepTracker | None) -> int:
    """The loop: plan (rank 0, broadcast), submit fetches, step, publish the version, release the groups."""

    def record(step: StepRecord) -> None:
        if report is not None:
            report.add(step)
        if tracker is not None:  # rank 0
            tracker.log(step.to_line().model_dump(exclude_none=True))
        if source is not None and cfg.progress_path:  # rank 0
            append_line(cfg.progress_path, progress_line(step, source.admitted_groups))

    from flight_store.publishing import StorePublisher

    with StorePublisher.sharing(client) as weights:
        publisher = Publisher(client, weights, record)
        try:
            return _steps(cfg, env, kind, source, report is not None, publisher, record, durable)
        finally:
            publisher.close()


def _steps(cfg: TrainConfig, env: dict[str, int], kind: Step, source: PlanSource | None, reported: bool,
           publisher: Publisher, record: Callable[[StepRecord], None], durable: Checkpointer) -> int:
    from train.planning import exchange_plans

    queue: deque[MiniBatchPlan] = deque()
    version = cfg.initial_version
    steps = 0
    plan_wait = 0.0
    while True:
        # scan + plan on rank 0, broadcast (every rank knows the queue, so all skip or all join)
        if not cfg.max_steps or steps + len(queue) < cfg.max_steps:
            t_plan = time.perf_counter()
            new = exchange_plans(source, version, block=not queue, idle_timeout_s=cfg.idle_timeout_s,
                                 poll_interval_s=cfg.poll_interval_s)
            plan_wait += time.perf_counter() - t_plan
            for plan in new:
                queue.append(plan)
                kind.submit(plan)  # fetch: this rank's slices, on the prefetch thread
        if not queue:
            break  # idle for idle_timeout_s, or max_steps reached
        plan = queue.popleft()
        consumed: list[ConsumedEntry] = []
        if reported:
            consumed.extend(SliceEntry(step=plan.step, node=s.node, group_id=s.group_id, start=s.start, stop=s.stop)
                            for m in plan.for_rank(env["dp_rank"]).micro_batches for s in m.slices)
        metrics = with_token_staleness(kind.step(plan, consumed), version)  # the step trained `version`
        version += 1
        durable.after_step(plan.step, version, plan.group_ids, metrics)  # what it trained, then the checkpoint if due
        stop = durable.stopping()  # SIGTERM: a clean stop after this step (finish() checkpoints it)
        t_pub = time.perf_counter()
        # the weights are encoded here (a copy the next step cannot change; a collective on every rank), then
        # rank 0's publisher stores them, publishes the version and releases the groups while the next step runs
        table = encode_weights(kind.built, env, dtype=cfg.publish_dtype) if cfg.publish_weights else None
        taken = StepRecord(metrics=metrics, version=version, plan_wait_s=plan_wait, t_end=time.time(),
                           consumed=tuple(consumed),
                           figures=source.consumed_log.take_step(plan.step) if source is not None else None)
        plan_wait = 0.0
        steps += 1
        if env["rank"] == 0:
            publisher.submit(table, plan.group_ids, taken, t_pub)
        else:
            record(taken.published(time.perf_counter() - t_pub))
        if stop:
            break
    publisher.drain()
    durable.finish(version)
    if queue:
        log.warning("rank %d stops with %d planned mini-batches unconsumed", env["rank"], len(queue))
    if source is not None:
        log.info("rank 0 admitted %d groups and dropped %s (%d admissions on unknown supply while the rollout waited)",
                 source.admitted_groups, dict(source.dropped), source.stall_releases)
    return steps


def publish_weights(built: Built, client: StoreNodes, version: int, env: dict[str, int], *,
                    dtype: str = "params") -> None:
    """Gather the weights (all ranks) and DoPut them to every store (rank 0): :func:`encode_weights`, then
    ``StorePublisher.put_weights`` over ``client``'s connections."""
    from flight_store.publishing import StorePublisher

    table = encode_weights(built, env, dtype=dtype)
    if table is not None:
        with StorePublisher.sharing(client) as publisher:
            publisher.put_weights(table, version)


def encode_weights(built: Built, env: dict[str, int], *, dtype: str = "params") -> pa.Table | None:
    """The weights under HF names (Llama's; Idefics3's for ``LLaVAModel``) as a weights table, floating tensors cast
    to ``dtype`` unless it is ``"params"`` (``TrainConfig.publish_dtype``), in record batches of
    ``schemas.weights.CHUNK_BYTES``: on rank 0; ``None`` on the others. Collective (the tensor-parallel gather):
    every rank calls it."""
    from train.hf_llama import megatron_to_hf_llama, weights_table

    if hasattr(built.gpt, "vision_model"):  # LLaVAModel: under Idefics3's names
        from train.vl_model import megatron_to_hf_vl

        named = megatron_to_hf_vl(built.gpt)
    else:
        named = megatron_to_hf_llama(built.gpt)
    return weights_table(named, dtype=None if dtype == "params" else dtype) if env["rank"] == 0 else None


class Publisher:
    """Rank 0's publishing of each new version, off the training thread and in order: the weights to every store
    and then the version (``publisher``), then the step is recorded (``record``), then its groups are released
    (``client``), so whatever a store released was recorded as trained, and a rollout that refills the room a
    release freed finds the new version. One version at a time: submitting the next waits for the one before.

    The recorded step carries ``publish_s`` (what publishing cost the training thread) and ``publish_done_s``
    (the step's end to its version published on every node). An error of a publish is raised at the next
    :meth:`submit` or :meth:`drain`.
    """

    def __init__(self, client: StoreReader, publisher: StorePublisher, record: Callable[[StepRecord], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._client = client
        self._publisher = publisher
        self._record = record
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knit-publish")
        self._pending: Future[None] | None = None

    def submit(self, table: pa.Table | None, group_ids: list[str], step: StepRecord, started: float) -> None:
        """Publish ``step.version`` (with its weights ``table`` when not None), record ``step``, release
        ``group_ids``; ``started``: the step's end (``time.perf_counter()``)."""
        self.drain()
        publish_s = time.perf_counter() - started
        self._pending = self._pool.submit(self._publish, table, group_ids, step, started, publish_s)

    def drain(self) -> None:
        """Wait for the publish in flight (raising its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _publish(self, table: pa.Table | None, group_ids: list[str], step: StepRecord, started: float,
                 publish_s: float) -> None:
        if table is not None:
            self._publisher.put_weights(table, step.version)
        self._publisher.publish_version(step.version)
        self._record(step.published(publish_s, time.perf_counter() - started))
        self._client.release(group_ids)  # frees images no unreleased group references

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RankReport:
    """One document per rank at ``path`` (``{rank}`` replaced): ``schemas.run_records.RankReportDocument``,
    ``{"env", "steps", "consumed"}``.

    ``steps`` holds the per-step records; ``consumed`` holds a ``SliceEntry`` for every planned slice of this rank
    and a ``RowEntry`` for every row it actually received (text step). Written as the run goes, so a rank holds one
    step's entries at a time: :meth:`add` appends a step to two side files (``<path>.steps.jsonl``,
    ``<path>.consumed.jsonl``); :meth:`close` joins them into the document line by line and removes them.

    Example::

        with RankReport("run/trainer_rank{rank}.json", env) as report:
            report.add(step)
    """

    def __init__(self, path: str, env: dict[str, int]) -> None:
        self.path = path.replace("{rank}", str(env["rank"]))
        self._env = RankEnv.model_validate(env)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._parts = {name: LineWriter(f"{self.path}.{name}.jsonl", mode="w") for name in ("steps", "consumed")}

    def add(self, step: StepRecord) -> None:
        """Append one step's record and consumed entries."""
        self._parts["steps"].write(step.to_line())
        for c in step.consumed:
            self._parts["consumed"].write(c)

    def close(self) -> None:
        """Write the document (safe to call twice)."""
        if not self._parts:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as out:
            out.write('{"env": ' + dumps(self._env))
            for name, part in self._parts.items():
                part.close()
                out.write(f', "{name}": [')
                with open(f"{self.path}.{name}.jsonl") as f:
                    for i, line in enumerate(f):
                        out.write(("," if i else "") + line.rstrip("\n"))
                out.write("]")
                os.remove(f"{self.path}.{name}.jsonl")
            out.write("}")
        os.replace(tmp, self.path)
        self._parts = {}

    def __enter__(self) -> RankReport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_line(step: StepRecord, admitted_groups: int) -> ProgressLine:
    """Rank 0's progress line of ``step`` with the groups admitted so far."""
    m, f = step.metrics, step.figures
    return ProgressLine(step=m["step"], train_batch=m["train_batch"], position=m["position"], version=step.version,
                        loss=m["loss"], rows=m["rows"], abs_logp_diff=m["abs_logp_diff"],
                        plan_wait_s=step.plan_wait_s, step_time_s=m["step_time_s"], t_end=step.t_end,
                        admitted_groups=admitted_groups, arch_staleness_mean=f.arch_staleness_mean if f else None,
                        arch_staleness_max=f.arch_staleness_max if f else None,
                        reward_mean=f.reward_mean if f else None)
