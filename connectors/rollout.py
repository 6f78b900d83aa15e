"""Rollout worker: prompts -> vLLM (G samples each) -> reward -> one DoPut per prompt group, streamed.

The loop, top to bottom (``RolloutWorker.run``):

1. **dispatch**: keep up to ``prompts_per_wave`` prompt groups in the engine; a finished group frees
   its slot at once (continuous batching, no wave barrier). Dispatch pauses while the lookahead hook
   says too many groups are written but not yet consumed (``max_unreleased_groups`` or a callable
   over the stores' ``stats``).
2. **step**: ``engine.step()``; every prompt whose n samples are all finished comes back as one output.
3. **score**: the reward function of the prompt (``connectors.tasks``), on each decoded response.
4. **write**: images first (each distinct image once, by content key), then the group's record batch
   (``connectors.vllm.group_to_batch``) with one DoPut to the group's node, *the moment the group
   finishes*, so the trainer's planner sees groups while generation is still running.

Nothing is dropped silently: a prompt the engine refuses, or groups still running when the worker
stops (``max_seconds`` or Ctrl-C), are written with status "aborted".

Policy versions: the worker polls ``client.get_version()`` (the version the trainer publishes); with
``weight_sync`` it loads the published weights into the running engine (``connectors.weights``) first.
A group records the engine's version when it was dispatched (``policy_version_min``) and when it
finished (``policy_version``).

CLI: ``python -m connectors.rollout --model DIR --nodes grpc://h:p[,grpc://h2:p2] --groups N
[--report-json FILE]`` (also ``knit rollout``).

Example:
    >>> cfg = RolloutConfig(model="/models/tiny", nodes=["grpc://127.0.0.1:8815"], max_groups=64)
    >>> report = RolloutWorker(cfg).run()  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors.config import LookaheadHook, RolloutConfig, max_unreleased
from connectors.engine import Engine, VllmEngine
from connectors.tasks import Prompt, RewardFn, jsonl_prompts, load_reward_fn, mixed_prompts
from connectors.vllm import aborted_batch, group_to_batch
from schemas.images import images_to_table

logger = logging.getLogger(__name__)

__all__ = ["Engine", "LookaheadHook", "RolloutConfig", "RolloutReport", "RolloutWorker", "VllmEngine", "main",
           "max_unreleased"]

@dataclass(slots=True)
class _Pending:
    group_id: str
    prompt: Prompt
    node: str
    image_keys: list[bytes]
    created_at: datetime
    version_min: int


@dataclass(slots=True)
class RolloutReport:
    """What a run generated and wrote, with throughput (JSON via ``to_dict``)."""

    groups: int = 0
    """Groups written (completed and aborted)."""
    aborted_groups: int = 0
    """Groups with at least one aborted row."""
    rows: int = 0
    """Trajectories written."""
    prompt_tokens: int = 0
    """Prompt tokens over all rows."""
    response_tokens: int = 0
    """Generated tokens over all rows."""
    bytes_written: int = 0
    """Arrow bytes of the written batches and images."""
    images_written: int = 0
    """Distinct images sent (before store-side dedup across groups)."""
    engine_start_s: float = 0.0
    """Seconds to start the engine (0 when given one)."""
    generate_s: float = 0.0
    """Seconds from the first dispatch to the last group written."""
    write_s: float = 0.0
    """Seconds spent in DoPut calls (images and groups)."""
    started_at: float = 0.0
    """Unix time of the first dispatch."""
    first_write_at: float = 0.0
    """Unix time the first group was written."""
    last_write_at: float = 0.0
    """Unix time the last group was written."""
    write_times: list[float] = field(default_factory=list)
    """Unix time of each group write, in write order."""
    reward_mean: dict[str, float] = field(default_factory=dict)
    """Mean reward of completed rows per data source."""
    policy_versions: list[int] = field(default_factory=list)
    """Distinct ``policy_version`` values written."""
    logprobs_mode: str = ""
    """The engine's logprob mode."""

    def to_dict(self) -> dict[str, Any]:
        """The report plus derived rates: tokens/s generated, groups/s and MB/s written."""
        d = asdict(self)
        gen = max(self.generate_s, 1e-9)
        d["tokens_per_s"] = round(self.response_tokens / gen, 1)
        d["groups_per_s"] = round(self.groups / gen, 2)
        d["write_mb_per_s"] = round(self.bytes_written / max(self.write_s, 1e-9) / 1e6, 2)
        d["stream_mb_per_s"] = round(self.bytes_written / gen / 1e6, 3)
        return d


class RolloutWorker:
    """Generates prompt groups and streams each one to its store node as soon as it finishes.

    Args:
        config: what to generate and where to write.
        client: a ``flight_store.StoreClient`` over ``config.nodes`` (built when ``None``).
        engine: a started engine (``VllmEngine(config)`` is started when ``None``).
        prompts: the prompt stream (default: ``config.prompts_file`` or the built-in task mix).

    Example:
        >>> cfg = RolloutConfig(model="/models/tiny", nodes=["grpc://127.0.0.1:8815"], max_groups=8)
        >>> RolloutWorker(cfg).run().groups  # doctest: +SKIP
        8
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        client: Any = None,
        engine: Engine | None = None,
        prompts: Iterator[Prompt] | None = None,
    ) -> None:
        self.config = config
        self._owns_client = client is None
        if client is None:
            from flight_store.client import StoreClient

            client = StoreClient(config.nodes)
        self.client = client
        self.report = RolloutReport()
        t0 = time.perf_counter()
        self.engine: Engine = engine if engine is not None else VllmEngine(config)
        if engine is None:
            self.report.engine_start_s = round(time.perf_counter() - t0, 3)
        self.report.logprobs_mode = self.engine.logprobs_mode
        if prompts is None:
            prompts = (
                jsonl_prompts(config.prompts_file)
                if config.prompts_file
                else mixed_prompts(config.data_sources, seed=config.seed)
            )
        self._prompts = prompts
        self._reward: RewardFn = load_reward_fn(config.reward_fn)
        hooks: list[LookaheadHook] = []
        if config.max_unreleased_groups is not None:
            hooks.append(max_unreleased(config.max_unreleased_groups))
        if config.lookahead is not None:
            hooks.append(config.lookahead)
        self._hooks = hooks
        self._pending: dict[str, _Pending] = {}
        self._version = config.initial_version
        self._next_version_poll = 0.0
        self._next_lookahead_poll = 0.0
        self._paused = False
        self._stored_at_poll = 0  # unreleased groups in the stores at the last lookahead poll
        self._written_since_poll = 0
        self._dispatched = 0
        self._stop = False
        self._rewards: dict[str, list[float]] = {}
        self._versions: set[int] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knit-rollout-writer") \
            if config.async_writes else None
        self._writes: deque[Future[None]] = deque()
        self._write_lock = threading.Lock()

    # ---- public --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued write; re-raise the first write error."""
        while self._writes:
            self._writes.popleft().result()

    def close(self) -> None:
        """Flush, stop the writer thread, and close the store client if this worker opened it."""
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._owns_client:
            self.client.close()

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
        rep = self.report
        rep.started_at = time.time()
        t_start = time.perf_counter()
        deadline = t_start + cfg.max_seconds if cfg.max_seconds is not None else None
        if cfg.weight_sync and cfg.wait_initial_weights_s is not None:
            self._load_initial_weights(cfg.wait_initial_weights_s)
        self._poll_version(force=True)
        exhausted = False
        while True:
            if deadline is not None and time.perf_counter() >= deadline:
                self._stop = True
            if self._stop:
                self._abort_pending()
                break
            self._poll_version()
            while not exhausted and self._may_dispatch():
                try:
                    prompt = next(self._prompts)
                except StopIteration:
                    exhausted = True
                    break
                self._dispatch(prompt)
            if not self._pending:
                if exhausted or (cfg.max_groups and self._dispatched >= cfg.max_groups):
                    break
                time.sleep(0.05)  # paused by the lookahead limit
                continue
            try:
                for out in self.engine.step():
                    self._complete(out)
            except KeyboardInterrupt:
                logger.warning("interrupted: aborting %d running groups", len(self._pending))
                self._stop = True
        self.flush()
        rep.generate_s = round(time.perf_counter() - t_start, 4)
        rep.reward_mean = {k: round(sum(v) / len(v), 4) for k, v in sorted(self._rewards.items()) if v}
        rep.policy_versions = sorted(self._versions)
        return rep

    # ---- loop parts ----------------------------------------------------------------------------

    def _may_dispatch(self) -> bool:
        cfg = self.config
        if self._stop or len(self._pending) >= cfg.prompts_per_wave:
            return False
        if cfg.max_groups and self._dispatched >= cfg.max_groups:
            return False
        if self._hooks:
            now = time.perf_counter()
            if now >= self._next_lookahead_poll:
                self._next_lookahead_poll = now + cfg.lookahead_poll_s
                self.flush()  # the stores' counts must include this worker's queued writes
                stats = self.client.stats()
                self._stored_at_poll = sum(int(s.get("groups", {}).get("stored", 0)) for s in stats.values())
                self._written_since_poll = 0
                paused = any(h(stats) for h in self._hooks)
                if paused != self._paused:
                    logger.info("rollout dispatch %s by the lookahead limit", "paused" if paused else "resumed")
                self._paused = paused
            if cfg.lookahead_counts_running and cfg.max_unreleased_groups is not None:
                # between polls: what the stores held, plus what this worker wrote since, plus what runs
                outstanding = self._stored_at_poll + self._written_since_poll + len(self._pending)
                if outstanding >= cfg.max_unreleased_groups:
                    return False
            return not self._paused
        return True

    def _load_initial_weights(self, timeout_s: float) -> None:
        """Wait for the weights of ``initial_version`` in the stores and load them into the engine."""
        version = self.config.initial_version
        deadline = time.perf_counter() + timeout_s
        while not self._stop:
            try:
                table = self.client.get_weights(version)
            except Exception as exc:  # not published yet
                if time.perf_counter() >= deadline:
                    msg = f"no weights of version {version} in the stores after {timeout_s} s: {exc}"
                    raise TimeoutError(msg) from None
                time.sleep(0.2)
                continue
            self.engine.load_weights(table)
            logger.info("loaded the initial weights (version %d) into the engine", version)
            return

    def _poll_version(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now < self._next_version_poll:
            return
        self._next_version_poll = now + self.config.version_poll_s
        published = int(self.client.get_version())
        if published <= self._version:
            return
        if self.config.weight_sync:
            try:
                table = self.client.get_weights(published)
            except Exception as exc:  # weights not there yet: keep generating with the old ones
                logger.warning("version %d published but its weights are not readable yet: %s", published, exc)
                return
            self.engine.load_weights(table)
            logger.info("loaded weights of version %d into the engine", published)
        self._version = published

    def _node_for(self, group_id: str) -> str:
        if self.config.local_node_only:
            return self.config.nodes[0]
        return str(self.client.node_for(group_id))

    def _dispatch(self, prompt: Prompt) -> None:
        cfg = self.config
        group_id = f"{cfg.group_id_prefix}{self._dispatched}"
        self._dispatched += 1
        node = self._node_for(group_id)
        keys: list[bytes] = []
        if prompt.images:
            table, keys = images_to_table(prompt.images)
            self._write_images(table, node)
        pending = _Pending(
            group_id=group_id,
            prompt=prompt,
            node=node,
            image_keys=keys,
            created_at=datetime.now(UTC),
            version_min=self._version,
        )
        try:
            self.engine.submit(group_id, prompt, cfg.group_size)
        except (ValueError, TypeError) as exc:  # refused by the engine (too long, bad input): record it
            logger.warning("engine refused group %s: %s", group_id, exc)
            batch = aborted_batch(
                group_id=group_id,
                group_size=cfg.group_size,
                prompt_token_ids=[],
                policy_version=self._version,
                data_source=prompt.data_source,
                logprobs_mode=self.engine.logprobs_mode,
                image_keys=keys,
                created_at=pending.created_at,
                finish_reason="error",
            )
            self._write_group(batch, node, aborted=True)
            return
        self._pending[group_id] = pending

    def _complete(self, out: Any) -> None:
        pending = self._pending.pop(str(out.request_id), None)
        if pending is None:
            logger.warning("engine returned unknown request %r", out.request_id)
            return
        prompt = pending.prompt
        rewards = [0.0] * self.config.group_size
        for c in out.outputs:
            if c.finish_reason in ("stop", "length"):
                r = float(self._reward(prompt.text, c.text, prompt.sample))
                rewards[int(c.index)] = r
                self._rewards.setdefault(prompt.data_source, []).append(r)
        if self.config.dump_raw:
            self._dump_raw(pending.group_id, out)
        batch = group_to_batch(
            out,
            group_id=pending.group_id,
            policy_version=self._version,
            policy_version_min=pending.version_min,
            data_source=prompt.data_source,
            rewards=rewards,
            logprobs_mode=self.engine.logprobs_mode,
            image_keys=pending.image_keys,
            created_at=pending.created_at,
            group_size=self.config.group_size,
        )
        aborted = any(s != "completed" for s in batch.column("status").to_pylist())
        self._write_group(batch, pending.node, aborted=aborted)

    def _abort_pending(self) -> None:
        if not self._pending:
            return
        ids = list(self._pending)
        self.engine.abort(ids)
        for gid in ids:
            p = self._pending.pop(gid)
            batch = aborted_batch(
                group_id=gid,
                group_size=self.config.group_size,
                prompt_token_ids=[],
                policy_version=self._version,
                data_source=p.prompt.data_source,
                logprobs_mode=self.engine.logprobs_mode,
                image_keys=p.image_keys,
                created_at=p.created_at,
            )
            self._write_group(batch, p.node, aborted=True)
        logger.info("aborted %d running groups and wrote them as 'aborted'", len(ids))

    # ---- writes --------------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], None]) -> None:
        if self._writer is None:
            fn()
            return
        while self._writes and self._writes[0].done():
            self._writes.popleft().result()  # surfaces a failed write promptly
        while len(self._writes) >= self.config.max_queued_writes:
            self._writes.popleft().result()
        self._writes.append(self._writer.submit(fn))

    def _write_images(self, table: pa.Table, node: str) -> None:
        self.report.images_written += table.num_rows
        self.report.bytes_written += table.nbytes

        def put() -> None:
            t0 = time.perf_counter()
            self.client.put_images(table, node=node)
            with self._write_lock:
                self.report.write_s += time.perf_counter() - t0

        self._submit(put)

    def _write_group(self, batch: pa.RecordBatch, node: str, *, aborted: bool) -> None:
        rep = self.report
        rep.groups += 1
        self._written_since_poll += 1
        rep.aborted_groups += int(aborted)
        rep.rows += batch.num_rows
        rep.prompt_tokens += int(pc.sum(batch.column("prompt_len")).as_py() or 0)
        rep.response_tokens += int(pc.sum(batch.column("response_len")).as_py() or 0)
        rep.bytes_written += batch.nbytes
        self._versions.add(int(batch.column("policy_version")[0].as_py()))

        def put() -> None:
            t0 = time.perf_counter()
            self.client.put_group(batch, node=node)
            now = time.time()
            with self._write_lock:
                rep.write_s += time.perf_counter() - t0
                rep.write_times.append(now)
                rep.first_write_at = rep.first_write_at or now
                rep.last_write_at = now

        self._submit(put)

    def _dump_raw(self, group_id: str, out: Any) -> None:
        samples = []
        for c in sorted(out.outputs, key=lambda c: int(c.index)):
            lp = c.logprobs
            samples.append(
                {
                    "index": int(c.index),
                    "token_ids": list(c.token_ids),
                    "flat_token_ids": list(lp.token_ids),
                    "flat_logprobs": list(lp.logprobs),
                    "start_indices": list(lp.start_indices),
                    "finish_reason": c.finish_reason,
                    "text": c.text,
                }
            )
        doc = {"group_id": group_id, "prompt_token_ids": list(out.prompt_token_ids), "samples": samples}
        with Path(str(self.config.dump_raw)).open("a") as fh:
            fh.write(json.dumps(doc) + "\n")


# ---- CLI ---------------------------------------------------------------------------------------


def _parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            msg = f"bad data-source weight in {part!r} (expected NAME=WEIGHT)"
            raise argparse.ArgumentTypeError(msg) from None
    return mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knit rollout", description="Generate prompt groups with vLLM and stream them "
                                "to knittrans store nodes.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tiny", action="store_true", help="build a tiny random Llama at --model first if missing")
    p.add_argument("--nodes", required=True, help="comma-separated store locations, grpc://host:port")
    p.add_argument("--groups", type=int, default=64, help="prompt groups to generate (0 = until stopped)")
    p.add_argument("--group-size", type=int, default=4, help="G, samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-per-wave", type=int, default=16, help="most prompt groups in the engine at once")
    p.add_argument("--max-seconds", type=float, default=None, help="stop (abort running groups) after this")
    p.add_argument("--data-sources", type=_parse_mix, default={"add_small": 0.5, "mul_large": 0.5},
                   help="built-in task mix, e.g. add_small=0.7,mul_large=0.3")
    p.add_argument("--prompts-file", default=None, help="JSONL prompts instead of the built-in tasks")
    p.add_argument("--reward-fn", default=None, help="module:function reward (default: exact match)")
    p.add_argument("--max-unreleased-groups", type=int, default=None, help="lookahead limit")
    p.add_argument("--lookahead-counts-running", action="store_true",
                   help="count groups running in the engine toward --max-unreleased-groups")
    p.add_argument("--lookahead-poll-s", type=float, default=0.5, help="seconds between two lookahead checks")
    p.add_argument("--weight-sync", action="store_true", help="load newly published weights into the engine")
    p.add_argument("--wait-initial-weights", type=float, default=None, metavar="SECONDS",
                   help="with --weight-sync: wait this long for the weights of --initial-version, load them, start")
    p.add_argument("--initial-version", type=int, default=0, help="policy version of the weights in --model")
    p.add_argument("--version-poll-s", type=float, default=1.0, help="seconds between two get_version calls")
    p.add_argument("--local-node-only", action="store_true", help="write every group to the first node")
    p.add_argument("--group-id-prefix", default="")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--sync-writes", action="store_true", help="DoPut inline in the step loop (no writer thread)")
    p.add_argument("--dump-raw", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report-json", default=None, help="write the run report (throughput) to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m connectors.rollout ...`` / ``knit rollout ...``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.tiny and not (Path(args.model) / "config.json").exists():
        from connectors.tiny_model import build_tiny_llama

        build_tiny_llama(args.model, seed=args.seed)
    cfg = RolloutConfig(
        model=args.model,
        nodes=[n.strip() for n in args.nodes.split(",") if n.strip()],
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        prompts_per_wave=args.prompts_per_wave,
        max_groups=args.groups,
        max_seconds=args.max_seconds,
        data_sources=args.data_sources,
        prompts_file=args.prompts_file,
        reward_fn=args.reward_fn,
        max_unreleased_groups=args.max_unreleased_groups,
        lookahead_counts_running=args.lookahead_counts_running,
        lookahead_poll_s=args.lookahead_poll_s,
        wait_initial_weights_s=args.wait_initial_weights,
        weight_sync=args.weight_sync,
        version_poll_s=args.version_poll_s,
        initial_version=args.initial_version,
        local_node_only=args.local_node_only,
        group_id_prefix=args.group_id_prefix,
        logprobs_mode=args.logprobs_mode,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        ignore_eos=args.ignore_eos,
        tensor_parallel_size=args.tensor_parallel_size,
        dump_raw=args.dump_raw,
        async_writes=not args.sync_writes,
    )
    worker = RolloutWorker(cfg)
    previous = signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        report = worker.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.close()
    out = report.to_dict()
    summary = {k: v for k, v in out.items() if k != "write_times"}
    print(json.dumps(summary))
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
