"""The trainer loop, written once for every kind of step: connect -> scan -> plan -> fetch -> step.

Every rank runs :func:`run`. Rank 0 also hosts the planner (``train.planning``): it scans metadata,
plans each mini-batch as soon as admission allows, and broadcasts the plans. What differs between
the text and the multimodal trainer is a :class:`Step` (``TrainConfig.vision`` selects it):
``train.trainer.TextStep`` or ``train.mm_trainer.MultimodalStep``. It builds its model, submits each
plan's fetches of this rank's slices to its prefetch thread, and takes the optimizer step. After
each step rank 0 publishes the new policy version to every store (and the weights, when asked) and
releases the consumed groups.

Publishing runs beside the next step (:class:`Publisher`): the training thread only encodes the weights
(a copy under HF names, cast to ``publish_dtype``); a thread of rank 0 stores them on every node, then
publishes the version, then releases the step's groups, one version at a time.

Per-step metrics (logged, and written to ``report_path`` by :class:`RankReport`): the step's own (see
``train.backbone.step_metrics`` and each step) plus ``version``, ``publish_s`` (what publishing cost the
training thread: encoding, and waiting for the version before), ``publish_done_s`` (rank 0: the step's end
to its version published on every node; rank 0 records a step then, before releasing its groups),
``plan_wait_s`` and ``t_end``.
Rank 0 appends a progress line per step (``progress_path``) and the planner's consumed trajectories as
they are admitted (``consumed_path``, ``train.planning.ConsumedLog``). Every record goes to disk as the
run goes: the loop keeps nothing per step or per group in memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from schemas.plan import MiniBatchPlan
from train.config import TrainConfig
from train.planning import PlannerLike, PlanSource

log = logging.getLogger(__name__)


class Step(Protocol):
    """One kind of optimizer step: what it builds (in its constructor), how it fetches, how it steps.

    Built as ``Kind(cfg, env, client)`` on every rank, after the process group exists.
    """

    built: Any
    """The backbone (``train.model.Built``): checkpoints and published weights are its."""

    def submit(self, plan: MiniBatchPlan) -> None:
        """Queue this rank's fetches of ``plan`` on the prefetch thread (ahead of its step)."""
        ...

    def step(self, plan: MiniBatchPlan, consumed: list[list[Any]]) -> dict[str, Any]:
        """One optimizer step over this rank's share of ``plan``; its metrics.

        May append ``["row", step, group_id, sample_idx]`` to ``consumed`` for every row received.
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
    from flight_store.client import StoreClient
    from train import mcore_compat, model
    from train.planning import ConsumedLog, with_dp_ranks

    env = mcore_compat.init_distributed(cfg.parallel, seed=cfg.seed)
    admission = with_dp_ranks(cfg.admission, env["dp_size"])  # every rank checks: none waits on a failed rank 0
    if env["rank"] == 0 and planner is None:
        planner = Planner(admission)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(StoreClient.from_config(cfg.stores, cfg.client))
        kind = _build_step(cfg, env, client)
        stack.callback(kind.close)
        report = stack.enter_context(RankReport(cfg.report_path, env)) if cfg.report_path else None
        source = None
        if env["rank"] == 0 and planner is not None:
            source = PlanSource(client, planner, supply_from_stores=cfg.supply_from_stores,
                                consumed_log=stack.enter_context(ConsumedLog(cfg.consumed_path)))
        log.info("rank %d ready: %s", env["rank"], env)
        if cfg.publish_weights:  # the rollout starts from the trainer's weights (version initial_version)
            publish_weights(kind.built, client, cfg.initial_version, env, dtype=cfg.publish_dtype)
        steps = _train(cfg, env, kind, client, source, report)
        if cfg.save_dir:
            model.save_checkpoint(kind.built.gpt, cfg.save_dir)
    mcore_compat.shutdown()
    return steps


def _build_step(cfg: TrainConfig, env: dict[str, int], client: Any) -> Step:
    if cfg.vision is not None:
        from train.mm_trainer import MultimodalStep

        return MultimodalStep(cfg, env, client)
    from train.trainer import TextStep

    return TextStep(cfg, env, client)


def _train(cfg: TrainConfig, env: dict[str, int], kind: Step, client: Any, source: PlanSource | None,
           report: RankReport | None) -> int:
    """The loop: plan (rank 0, broadcast), submit fetches, step, publish the version, release the groups."""

    def record(step: Done) -> None:
        metrics, consumed, figures = step
        if report is not None:
            report.add(metrics, consumed)
        if source is not None and figures is not None and cfg.progress_path:
            write_progress(cfg.progress_path, metrics, source.admitted_groups, figures)

    publisher = Publisher(client, record)
    try:
        return _steps(cfg, env, kind, source, report is not None, publisher, record)
    finally:
        publisher.close()


def _steps(cfg: TrainConfig, env: dict[str, int], kind: Step, source: PlanSource | None, reported: bool,
           publisher: Publisher, record: Callable[[Done], None]) -> int:
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
        consumed: list[list[Any]] = []
        if reported:
            consumed.extend(["slice", plan.step, s.node, s.group_id, s.start, s.stop]
                            for m in plan.for_rank(env["dp_rank"]).micro_batches for s in m.slices)
        metrics = kind.step(plan, consumed)
        version += 1
        t_pub = time.perf_counter()
        # the weights are encoded here (a copy the next step cannot change; a collective on every rank), then
        # rank 0's publisher stores them, publishes the version and releases the groups while the next step runs
        table = encode_weights(kind.built, env, dtype=cfg.publish_dtype) if cfg.publish_weights else None
        metrics.update(version=version, plan_wait_s=plan_wait, t_end=time.time())
        plan_wait = 0.0
        steps += 1
        if env["rank"] == 0:
            figures = source.consumed_log.take_step(plan.step) if source is not None else None
            publisher.submit(table, version, plan.group_ids, (metrics, consumed, figures), t_pub)
        else:
            metrics["publish_s"] = time.perf_counter() - t_pub
            record((metrics, consumed, None))
    publisher.drain()
    if queue:
        log.warning("rank %d stops with %d planned mini-batches unconsumed", env["rank"], len(queue))
    if source is not None:
        log.info("rank 0 admitted %d groups and dropped %s (%d admissions on unknown supply while the rollout waited)",
                 source.admitted_groups, dict(source.dropped), source.stall_releases)
    return steps


def publish_weights(built: Any, client: Any, version: int, env: dict[str, int], *, dtype: str = "params") -> None:
    """Gather the weights (all ranks) and DoPut them to every store (rank 0): :func:`encode_weights`, then
    ``put_weights``."""
    table = encode_weights(built, env, dtype=dtype)
    if table is not None:
        client.put_weights(table, version)


def encode_weights(built: Any, env: dict[str, int], *, dtype: str = "params") -> Any:
    """The weights under HF Llama names as a weights table, floating tensors cast to ``dtype`` unless it is
    ``"params"`` (``TrainConfig.publish_dtype``), in record batches of ``schemas.weights.CHUNK_BYTES``: on rank 0;
    ``None`` on the others. Collective (the tensor-parallel gather): every rank calls it."""
    from train.hf_llama import megatron_to_hf_llama, weights_table

    named = megatron_to_hf_llama(built.gpt)
    return weights_table(named, dtype=None if dtype == "params" else dtype) if env["rank"] == 0 else None


Done = tuple[dict[str, Any], list[list[Any]], dict[str, Any] | None]
"""A step taken: its metrics, consumed entries and (rank 0) staleness figures, to record."""


class Publisher:
    """Rank 0's publishing of each new version, off the training thread and in order: the weights to every store,
    then the version, then the step is recorded (``record``), then its groups are released, so whatever a
    store released was recorded as trained, and a rollout that refills the room a release freed finds the new
    version. One version at a time: submitting the next waits for the one before.

    The step's metrics get ``publish_s`` (what publishing cost the training thread) and ``publish_done_s``
    (the step's end to its version published on every node). An error of a publish is raised at the next
    :meth:`submit` or :meth:`drain`.
    """

    def __init__(self, client: Any, record: Callable[[Done], None]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._client = client
        self._record = record
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knit-publish")
        self._pending: Any = None

    def submit(self, table: Any, version: int, group_ids: list[str], step: Done, started: float) -> None:
        """Publish ``version`` (with its weights ``table`` when not None), record ``step``, release ``group_ids``;
        ``started``: the step's end (``time.perf_counter()``)."""
        self.drain()
        step[0]["publish_s"] = time.perf_counter() - started
        self._pending = self._pool.submit(self._publish, table, version, group_ids, step, started)

    def drain(self) -> None:
        """Wait for the publish in flight (raising its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _publish(self, table: Any, version: int, group_ids: list[str], step: Done, started: float) -> None:
        if table is not None:
            self._client.put_weights(table, version)
        self._client.publish_version(version)
        step[0]["publish_done_s"] = time.perf_counter() - started
        self._record(step)
        self._client.release(group_ids)  # frees images no unreleased group references

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RankReport:
    """One JSON document per rank at ``path`` (``{rank}`` replaced): ``{"env", "steps", "consumed"}``.

    ``steps`` holds the per-step metrics; ``consumed`` holds ``["slice", step, node, group_id, start, stop]``
    for every planned slice of this rank and ``["row", step, group_id, sample_idx]`` for every row it
    actually received (text step). Written as the run goes, so a rank holds one step's entries at a time:
    :meth:`add` appends a step to two side files (``<path>.steps.jsonl``, ``<path>.consumed.jsonl``);
    :meth:`close` joins them into the document line by line and removes them.

    Example::

        with RankReport("run/trainer_rank{rank}.json", env) as report:
            report.add(metrics, consumed)
    """

    def __init__(self, path: str, env: dict[str, int]) -> None:
        self.path = path.replace("{rank}", str(env["rank"]))
        self._env = env
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._parts = {name: open(f"{self.path}.{name}.jsonl", "w") for name in ("steps", "consumed")}  # noqa: SIM115

    def add(self, metrics: dict[str, Any], consumed: list[list[Any]]) -> None:
        """Append one step's metrics and consumed entries."""
        self._parts["steps"].write(json.dumps(metrics) + "\n")
        self._parts["consumed"].writelines(json.dumps(c) + "\n" for c in consumed)
        for part in self._parts.values():
            part.flush()

    def close(self) -> None:
        """Write the document (safe to call twice)."""
        if not self._parts:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as out:
            out.write('{"env": ' + json.dumps(self._env))
            for name, part in self._parts.items():
                part.close()
                out.write(f', "{name}": [')
                with open(part.name) as f:
                    for i, line in enumerate(f):
                        out.write(("," if i else "") + line.rstrip("\n"))
                out.write("]")
                os.remove(part.name)
            out.write("}")
        os.replace(tmp, self.path)
        self._parts = {}

    def __enter__(self) -> RankReport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_progress(path: str, metrics: dict[str, Any], admitted_groups: int, figures: dict[str, Any]) -> None:
    """Rank 0: append one JSON line for the step just taken, with the groups admitted so far and the step's
    staleness and reward figures (:meth:`train.planning.ConsumedLog.take_step`)."""
    line = {k: metrics[k] for k in ("step", "train_batch", "position", "version", "loss", "rows", "abs_logp_diff",
                                    "plan_wait_s", "step_time_s", "t_end")}
    line["admitted_groups"] = admitted_groups
    line.update(figures)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
