"""The rollout loop: prompts -> engine (G samples each) -> reward -> one DoPut per prompt group, streamed.

The loop, top to bottom (``RolloutWorker.run``):

1. **dispatch**: keep up to ``prompts_per_wave`` prompt groups in the engine; a finished group frees
   its slot at once (continuous batching, no wave barrier). Dispatch pauses while the lookahead limit
   says too many groups are written but not yet consumed (``connectors.lookahead``), except, while
   nothing runs, for one prompt at a time of a class the trainer's quota needs (the planner's demand). Which
   committed prompt goes out next is the dispatch order's choice (``connectors.dispatch``). Each group is
   registered with its node as in flight (``queued`` when drawn ``commit_ahead`` prompts early,
   ``running`` once in the engine), so the planner counts it as supply to come.
2. **step**: ``engine.step()``; every prompt whose n samples are all finished comes back as one output.
3. **score**: the reward of the prompt (``connectors.tasks``), on each decoded response; a tool source's samples
   run as multi-turn episodes (``connectors.agent.with_agents`` wraps the engine) and carry their environment's.
4. **write**: images first (each distinct image once, by content key; per row without ``image_dedup``), then the
   group's record batch (``connectors.vllm.group_to_batch``) with one DoPut to the group's store, *the moment the
   group finishes*, so the trainer's planner sees groups while generation runs (``connectors.writer``, off the loop).

Nothing is dropped silently: a prompt the engine refuses, or groups still running when the worker
stops (``max_seconds``, ``stop()`` or Ctrl-C), are written with status "aborted". A group the engine
aborts while the worker runs is written as "aborted" too, and its prompt dispatched again under a new
group id (``max_redispatch`` times; ``RolloutReport.redispatched`` maps the new ids to the first).
Prompts drawn but never dispatched when the worker stops leave flight as "cancelled".

Policy versions (``connectors.weight_sync``): the worker follows the version the trainer publishes;
with ``weight_sync`` it loads the published weights into the running engine first. A group records
the engine's version when it was dispatched (``policy_version_min``) and when it finished
(``policy_version``).

``run_rollout(config)`` runs a worker start to finish as a process does (``python -m connectors``).

Example::

    cfg = RolloutConfig(model="/models/tiny", stores=["grpc://127.0.0.1:8815"], max_groups=64)
    report = run_rollout(cfg)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from connectors.agent import AgentGroupOutput, with_agents
from connectors.config import RolloutConfig
from connectors.dispatch import DispatchQueue, Drawn
from connectors.engine import RolloutEngine, start_engine
from connectors.ledger_events import RolloutEvents, resume_stream
from connectors.lookahead import LookaheadHook, LookaheadLimit, StoreStats
from connectors.partial import ResumedOutput
from connectors.report import RolloutReport, RolloutTally
from connectors.tasks import Prompt, RewardFn, jsonl_prompts, load_reward_fn, mixed_prompts
from connectors.vllm import FinishedRequest, RequestOutputLike, aborted_batch, dump_raw, group_to_batch
from connectors.weight_sync import WeightSync
from connectors.writer import GroupWriter
from schemas import routing
from schemas.images import group_images
from schemas.ledger import Reissue, RolloutResume
from schemas.run_folder import read_document, write_document
from schemas.run_records import RolloutRecord
from schemas.wire import DispatchedGroup

if TYPE_CHECKING:
    from flight_store.writing import StoreWriter

logger = logging.getLogger(__name__)

__all__ = ["RolloutConfig", "RolloutReport", "RolloutWorker", "run_rollout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pending:
    """A group in the engine: its drawn prompt, its images' keys, when and under which version it went out."""

    drawn: Drawn
    image_keys: list[list[bytes]]  # each row's: the same unless ``RolloutConfig.image_dedup`` is off
    created_at: datetime
    version_min: int


def _running_ages(pending: Mapping[str, _Pending]) -> dict[str, list[float]]:
    """Per data source, the seconds each of its groups in the engine has been generating."""
    now = datetime.now(UTC)
    running: dict[str, list[float]] = {}
    for p in pending.values():
        running.setdefault(p.drawn.prompt.data_source, []).append((now - p.created_at).total_seconds())
    return running


class RolloutWorker:
    """Generates prompt groups and streams each one to its store as soon as it finishes.

    Args:
        config: what to generate and where to write.
        client: a :class:`~flight_store.writing.StoreWriter` over ``config.stores`` (built when ``None``).
        engine: a started engine (when ``None``, :func:`start_engine` starts the one ``config.engine`` names).
        prompts: the prompt stream (default: ``config.prompts_file`` or the built-in task mix).
        lookahead: an extra lookahead rule over the stores' stats (True pauses dispatch), checked
            with ``config.max_unreleased_groups`` every ``config.lookahead_poll_s`` seconds.

    Example::

        cfg = RolloutConfig(model="/models/tiny", stores=["grpc://127.0.0.1:8815"], max_groups=8)
        with RolloutWorker(cfg) as worker:
            worker.run().groups  # -> 8
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        client: StoreWriter | None = None,
        engine: RolloutEngine | None = None,
        prompts: Iterator[Prompt] | None = None,
        lookahead: LookaheadHook | None = None,
    ) -> None:
        self.config = config
        self._owns_client = client is None
        if client is None:
            from flight_store.writing import StoreWriter

            client = StoreWriter.from_config(config.stores, config.client)
        self.client = client
        self.tally = RolloutTally()
        """What the run wrote so far (:meth:`run` returns the report built from it)."""
        t0 = time.perf_counter()
        self._started: RolloutEngine | None = None  # the engine this worker started (and closes)
        if engine is None:
            engine = self._started = start_engine(config)
            self.tally.engine_start_s = round(time.perf_counter() - t0, 3)
        self.engine: RolloutEngine = with_agents(engine, config)
        self.tally.logprobs_mode = self.engine.logprobs_mode
        if prompts is None:
            prompts = (
                jsonl_prompts(config.prompts_file)
                if config.prompts_file
                else mixed_prompts(config.data_sources, seed=config.seed, chunk=config.mix_chunk)
            )
        self._events = RolloutEvents(config.events_path)
        resume = (read_document(RolloutResume, config.resume_path) if config.resume_path
                  else None)
        again: list[tuple[Reissue, Prompt]] = []
        if resume is not None:  # the stream goes on after the prompts drawn before; some go out again first
            prompts, again = resume_stream(prompts, resume)
        self._prompts = prompts
        self._reward: RewardFn = load_reward_fn(config.reward)
        self._prefix = config.group_id_prefix or f"r{os.getpid()}-"
        self._writer = GroupWriter(client, background=config.async_writes, max_queued=config.max_queued_writes)
        self._lookahead = LookaheadLimit(self._flushed_stats, limit=config.max_unreleased_groups,
                                         counts_running=config.lookahead_counts_running,
                                         poll_s=config.lookahead_poll_s, hook=lookahead)
        self._sync = WeightSync(client, self.engine, version=config.initial_version,
                                poll_s=config.version_poll_s, load=config.weight_sync)
        self._pending: dict[str, _Pending] = {}
        self._committed = DispatchQueue(config.dispatch_order)  # drawn (and re-dispatched) prompts
        self._drawn = resume.drawn if resume is not None else 0  # prompts drawn from the stream
        self._placed = 0  # group ids handed out
        self._stop = False
        self._held = False  # the last lookahead check paused dispatch
        for r, prompt in again:
            group_id, node = self._place()
            self._committed.append(Drawn(group_id=group_id, node=node, prompt=prompt, prompt_id=r.prompt_id,
                                         index=r.index, attempt=r.attempt, reason=r.reason))

    # ---- public --------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush the queued writes, stop the writer, and close the store client and the engine's client if this
        worker opened them."""
        try:
            self._writer.close()
            self._events.close()
        finally:
            if self._owns_client:
                self.client.close()
            getattr(self._started, "close", lambda: None)()

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop(self) -> None:
        """Ask the loop to stop: no more dispatch; groups still running are aborted and written."""
        self._stop = True

    def run(self) -> RolloutReport:
        """Run until ``max_groups`` groups are written, ``max_seconds`` pass, or ``stop()``."""
        cfg = self.config
        self.tally.started_at = time.time()
        t_start = time.perf_counter()
        deadline = t_start + cfg.max_seconds if cfg.max_seconds is not None else None
        if cfg.weight_sync and cfg.wait_initial_weights_s is not None:
            self._sync.wait_initial(cfg.wait_initial_weights_s, stopped=lambda: self._stop)
        self._sync.poll(force=True)
        exhausted = False
        while True:
            if deadline is not None and time.perf_counter() >= deadline:
                self._stop = True
            if self._stop:
                self._abort_pending()
                break
            self._sync.poll()
            exhausted = self._fill() or exhausted  # always fill: a re-dispatch may wait after the stream ends
            if not self._pending:
                quota_reached = bool(cfg.max_groups) and self._drawn >= cfg.max_groups  # every prompt allowed drawn
                if (exhausted or quota_reached) and not self._committed:
                    break
                time.sleep(0.05)  # paused by the lookahead limit
                continue
            try:
                for out in self.engine.step():
                    self._complete(out)
            except KeyboardInterrupt:
                logger.warning("interrupted: aborting %d running groups", len(self._pending))
                self._stop = True
        self._writer.flush()
        return self.tally.report(generate_s=time.perf_counter() - t_start, write_s=self._writer.write_s,
                                 write_times=list(self._writer.write_times), engine=self.config.engine,
                                 loads=self._sync.loads, load_failures=self._sync.failed_loads)

    # ---- dispatch ------------------------------------------------------------------------------

    def _fill(self) -> bool:
        """Dispatch prompts while there is room; returns True when the prompt stream is exhausted."""
        while not self._stop and len(self._pending) < self.config.prompts_per_wave:
            allowed = self._lookahead.allows(running=len(self._pending))
            if allowed and self._held:
                # the trainer released groups, which it does after publishing the version it trained: load
                # that version before the freed room is filled, so those groups come from the newest weights
                self._sync.poll(force=True)
            self._held = not allowed
            if not allowed and (self._pending or not self._lookahead.demanded):
                return False  # past the limit only for a demanded class, and only while the engine is idle
            exhausted = self._top_up()
            if not self._committed:
                return exhausted
            if allowed:
                ready = self._committed.take_next(self._on_policy, lambda: _running_ages(self._pending))
                if ready is None:
                    return False  # synchronous: the next train batch waits for its weights
                self._dispatch(ready)
                continue
            # paused with nothing running, and the trainer needs a class: the first committed prompt of it
            needed = next((d for d in self._committed if self._on_policy(d)
                           and self._lookahead.take_demand(d.prompt.data_source)), None)
            if needed is None:
                return False
            self.tally.demand_dispatches += 1
            self._dispatch(self._committed.take(needed))
        return False

    def _top_up(self) -> bool:
        """Draw prompts from the stream until ``commit_ahead`` (at least one) wait for dispatch, registering
        them as ``queued``; returns True when the stream is exhausted."""
        cfg = self.config
        while len(self._committed) < max(1, cfg.commit_ahead) and not (cfg.max_groups
                                                                        and self._drawn >= cfg.max_groups):
            prompt = next(self._prompts, None)
            if prompt is None:
                return True
            self._drawn += 1
            group_id, node = self._place()
            drawn = Drawn(group_id=group_id, node=node, prompt=prompt, prompt_id=group_id, index=self._drawn - 1)
            self._committed.append(drawn)
            self._events.drawn(drawn)
            if cfg.commit_ahead:
                self._register(drawn, "queued")
        return False

    def _on_policy(self, drawn: Drawn) -> bool:
        """Whether ``drawn`` may go out now under ``synchronous`` (always without it): the engine holds the
        weights its train batch starts from, or it is an aborted group's prompt going out again."""
        sync = self.config.synchronous
        if sync is None or drawn.attempt:
            return True
        return self._sync.version >= (drawn.index // sync[0]) * sync[1]

    def _register(self, drawn: Drawn, state: str) -> None:
        if self.config.register_inflight:
            self._writer.dispatch([DispatchedGroup(group_id=drawn.group_id, data_source=drawn.prompt.data_source,
                                                   prompt_id=drawn.prompt_id, dispatch_version=self._sync.version,
                                                   state=state)])  # type: ignore[arg-type]

    def _flushed_stats(self) -> StoreStats:
        self._writer.flush()  # the stores' counts must include this worker's queued writes
        stats: StoreStats = self.client.stats()
        return stats

    def _place(self) -> tuple[str, str]:
        """The next group's id and node: with ``local`` placement the id names a home node alive on this host
        (the hash of the plain id choosing among several), else it is plain; routing gives the node."""
        base = f"{self._prefix}{self._placed}"
        self._placed += 1
        group_id = base
        if self.config.placement == "local" and self.config.home_nodes:
            view = self.client.cluster_view()
            homes = [view.ids[n] for n in self.config.home_nodes if n in view.ids and n not in view.down]
            if homes:
                group_id = routing.home_id(routing.owner(base, homes), base)
        return group_id, str(self.client.node_for(group_id))

    def _dispatch(self, drawn: Drawn) -> None:
        prompt = drawn.prompt
        row_keys: list[list[bytes]] = []
        if prompt.images:
            table, row_keys = group_images(prompt.images, self.config.group_size, per_row=not self.config.image_dedup)
            self.tally.add_images(table)
            self._writer.put_images(table, drawn.node)
        pending = _Pending(drawn=drawn, image_keys=row_keys, created_at=datetime.now(UTC),
                           version_min=self._sync.version)
        self._register(drawn, "running")
        self._events.dispatched(drawn, self._sync.version)  # before the engine has it: a stored group has its line
        try:
            self.engine.submit(drawn.group_id, prompt, self.config.group_size)
        except (ValueError, TypeError) as exc:  # refused by the engine (too long, bad input): record it
            logger.warning("engine refused group %s: %s", drawn.group_id, exc)
            self._write_aborted(pending, finish_reason="error")
            return
        self._pending[drawn.group_id] = pending

    def _redispatch(self, drawn: Drawn) -> None:
        """The engine aborted ``drawn`` while the worker runs: its prompt goes out again first, under a new id."""
        if self._stop or drawn.attempt >= self.config.max_redispatch:
            return
        group_id, node = self._place()
        again = Drawn(group_id=group_id, node=node, prompt=drawn.prompt, prompt_id=drawn.prompt_id,
                      index=drawn.index, attempt=drawn.attempt + 1, reason="aborted")
        self.tally.redispatched[group_id] = drawn.prompt_id
        self._register(again, "queued")
        self._committed.put_first(again)
        logger.info("group %s aborted by the engine: its prompt goes out again as %s", drawn.group_id, group_id)

    # ---- step, score, write --------------------------------------------------------------------

    def _complete(self, out: FinishedRequest) -> None:
        """One finished prompt group: score each sample, write the group, re-dispatch it if the engine aborted it."""
        pending = self._pending.pop(str(out.request_id), None)
        if pending is None:
            logger.warning("engine returned unknown request %r", out.request_id)
            return
        drawn, prompt = pending.drawn, pending.drawn.prompt
        took = (datetime.now(UTC) - pending.created_at).total_seconds()  # created when the engine took it
        self._committed.note_completed(prompt.data_source, took, time.perf_counter())
        if self.config.dump_raw:
            dump_raw(str(self.config.dump_raw), drawn.group_id, out)
        batch = group_to_batch(
            out,
            group_id=drawn.group_id,
            policy_version=self._sync.version,
            policy_version_min=pending.version_min,
            data_source=prompt.data_source,
            rewards=self._score(prompt, out),
            logprobs_mode=self.engine.logprobs_mode,
            image_keys=pending.image_keys,
            created_at=pending.created_at,
            group_size=self.config.group_size,
            token_versions=out.token_versions if isinstance(out, ResumedOutput) else None,
        )
        aborted = any(s != "completed" for s in batch.column("status").to_pylist())
        self._write_group(batch, drawn.node, aborted=aborted)
        if aborted:
            self._redispatch(drawn)

    def _score(self, prompt: Prompt, out: RequestOutputLike) -> list[float]:
        """The reward of each sample that ran to its end (0.0 for the others), in ``sample_idx`` order: an agent
        group's are its environment's, the others the reward function's."""
        rewards = [0.0] * self.config.group_size
        given = out.rewards if isinstance(out, AgentGroupOutput) else None
        for c in out.outputs:
            if c.finish_reason in ("stop", "length"):
                r = float(given[int(c.index)] if given is not None
                          else self._reward(prompt.text, c.text, prompt.sample))
                rewards[int(c.index)] = r
                self.tally.rewards.setdefault(prompt.data_source, []).append(r)
        return rewards

    def _abort_pending(self) -> None:
        committed = self._committed.clear()
        if committed and self.config.register_inflight:  # drawn, never dispatched: out of flight
            self._writer.resolve([d.group_id for d in committed], "cancelled")
        if not self._pending:
            return
        ids = list(self._pending)
        self.engine.abort(ids)
        for gid in ids:
            self._write_aborted(self._pending.pop(gid))
        logger.info("aborted %d running groups and wrote them as 'aborted'", len(ids))

    def _write_aborted(self, pending: _Pending, *, finish_reason: str = "abort") -> None:
        batch = aborted_batch(
            group_id=pending.drawn.group_id,
            group_size=self.config.group_size,
            prompt_token_ids=[],
            policy_version=self._sync.version,
            data_source=pending.drawn.prompt.data_source,
            logprobs_mode=self.engine.logprobs_mode,
            image_keys=pending.image_keys[0] if pending.image_keys else [],
            created_at=pending.created_at,
            finish_reason=finish_reason,
        )
        self._write_group(batch, pending.drawn.node, aborted=True)

    def _write_group(self, batch: pa.RecordBatch, node: str, *, aborted: bool) -> None:
        self.tally.add_group(batch, aborted=aborted)
        self._lookahead.note_written()
        text_only = "num_images" not in batch.schema.names or not any(batch.column("num_images").to_pylist())
        group_id = str(batch.column("group_id")[0].as_py())
        self._writer.put_group(batch, None if text_only else node,  # text follows routing when its node is lost
                               on_written=lambda written: self._events.written(group_id, written))


# ---- one run, as a process runs it ---------------------------------------------------------------


@contextmanager
def _stop_on_signals(worker: RolloutWorker) -> Iterator[None]:
    """SIGTERM / SIGINT ask ``worker`` to stop cleanly (only the main thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: worker.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_rollout(config: RolloutConfig, *, engine: RolloutEngine | None = None) -> RolloutReport:
    """Run one rollout worker start to finish: what ``python -m connectors`` and ``knit rollout`` do.

    Starts the engine (unless ``engine`` is given), stops cleanly on SIGTERM/SIGINT (running groups
    are written as "aborted"), and writes the report to ``config.report_path`` when set.
    """
    with RolloutWorker(config, engine=engine) as worker, _stop_on_signals(worker):
        report = worker.run()
    if config.report_path:
        write_document(RolloutRecord.model_validate(report.to_dict()), config.report_path)
    return report
