"""The text step: this rank's micro-batches of a mini-batch through the GPT, one optimizer step.

:class:`TextStep` is the text implementation of ``train.loop.Step``. It builds the Llama-shaped GPT
and its Megatron optimizer (``train.model``, loading ``load_dir`` when set). For every planned
mini-batch it opens one stream of the rank's micro-batch slices (``StoreReader.stream``: one read per node
holding them, over the node's read channel) and hands the micro-batches to the prefetch thread, which reads
and packs them one at a time (:func:`fetch_micro_batch`), so micro-batch i+1 is fetched while micro-batch i
computes. The step runs Megatron-core's schedule with the configured policy loss over them
(``train.backbone``, ``train.objectives``). For ``decoupled_ppo`` it first takes every micro-batch of the
mini-batch and runs one forward pass over each without grad (:func:`proximal_logprobs`), before the optimizer
step; that pass is inside the step time and reported apart (``prox_s``).

Metrics beyond ``train.backbone.step_metrics``: per micro-batch the exposed wait (time the step
blocked on data) and the fetch time hidden behind compute, the bytes fetched, the step time, and the
logprob mode the rollout recorded with its groups (``raw_logprobs`` or ``processed_logprobs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from flight_store.reading import StoreReader
from schemas.plan import MicroBatch, MiniBatchPlan
from schemas.run_records import ConsumedEntry, RowEntry
from train.config import PackMode, TrainConfig
from train.packing import TRAIN_COLUMNS, pack_tensors

log = logging.getLogger(__name__)


class TextStep:
    """The text trainer's step (``train.loop.Step``): GPT + GRPO loss over prefetched micro-batches."""

    def __init__(self, cfg: TrainConfig, env: dict[str, int], client: StoreReader) -> None:
        from train import model
        from train.prefetch import Prefetcher

        self.cfg, self.env, self.client = cfg, env, client
        self.built = model.build(cfg.model, cfg.optim, tensor_parallel=cfg.parallel.tensor_parallel)
        if cfg.load_dir:
            model.load_checkpoint(self.built.gpt, cfg.load_dir)
        self.fetcher = Prefetcher(partial(fetch_micro_batch, cfg.pack, keep_keys=cfg.report_path is not None,
                                          vocab_size=cfg.model.vocab_size), depth=cfg.prefetch_depth)

    def submit(self, plan: MiniBatchPlan) -> None:
        """The rank's micro-batches, each one read per node over its read channel, made one at a time on the prefetch
        thread, the ``i``-th beginning at node ``dp_rank + i`` (ranks reading at once begin on different nodes)."""
        rank = self.env["dp_rank"]
        mbs = plan.for_rank(rank).micro_batches
        tables = self.client.stream([mb.slices for mb in mbs], columns=TRAIN_COLUMNS, start=rank)
        self.fetcher.submit((tables, mb) for mb in mbs)

    def step(self, plan: MiniBatchPlan, consumed: list[ConsumedEntry]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches of ``plan``; records the rows it received."""
        from train import backbone
        from train.loss import policy_loss
        from train.mcore_compat import device
        from train.objectives import needs_proximal

        t0 = time.perf_counter()
        micro = plan.for_rank(self.env["dp_rank"]).micro_batches
        waits: list[float] = []
        fetch_s: list[float] = []
        modes: set[str | None] = set()
        nbytes = 0
        dev = device()

        def batches() -> Iterator[dict[str, Any]]:
            nonlocal nbytes
            for _ in micro:
                got = self.fetcher.get(timeout=self.cfg.parallel.timeout_s)
                waits.append(got.wait_s)
                fetch_s.append(got.fetch_s)
                nbytes += got.value["bytes"]
                modes.add(got.value["logprobs_mode"])
                consumed.extend(RowEntry(step=plan.step, group_id=g, sample_idx=i)
                                for g, i in got.value.get("keys", []))
                yield backbone.to_device(got.value["tensors"], dev)

        def forward_step(data_iterator: Iterator[dict[str, Any]], gpt: Any) -> tuple[Any, Any]:
            b = next(data_iterator)
            return backbone.forward(self.built, gpt, b), partial(policy_loss, batch=b, cfg=self.cfg.admission.grpo,
                                                                 objective=self.cfg.loss)

        data: Iterator[dict[str, Any]] = batches()
        prox_s = 0.0
        if needs_proximal(self.cfg.loss):  # the proximal policy: these weights, before the optimizer step
            taken = list(data)  # every micro-batch fetched (their waits counted as the schedule's would be)
            t_prox = time.perf_counter()
            data = iter(proximal_logprobs(self.built, taken))
            prox_s = time.perf_counter() - t_prox
        backbone.zero_grads(self.built)
        reports = backbone.schedule(self.built, forward_step, data, len(micro), self.cfg.model.max_sequence_length)
        metrics = backbone.step_metrics(plan, micro, reports, self.built.optimizer.step())
        metrics.update(exposed_wait_s=waits, fetch_s=fetch_s, bytes_fetched=nbytes, prox_s=prox_s,
                       step_time_s=time.perf_counter() - t0, logprobs_mode=modes.pop() if len(modes) == 1 else None)
        log.info("step %d loss %.4f ratio %.4f wait %.1f ms (%d micro-batches) %.0f ms", plan.step, metrics["loss"],
                 metrics["ratio"], 1e3 * sum(waits), len(waits), 1e3 * metrics["step_time_s"])
        return metrics

    def close(self) -> None:
        """Stop the prefetch thread."""
        self.fetcher.close()


def proximal_logprobs(built: Any, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each micro-batch of ``batches`` with ``prox_logprobs``: the logprob of every label under the model's current
    weights, one forward pass each without grad (``decoupled_ppo``'s pi_prox, ``train.objectives``)."""
    import torch

    from train import backbone

    with torch.no_grad():
        for b in batches:
            b["prox_logprobs"] = -backbone.forward(built, built.model, b).float()
    return batches


def logprobs_mode(table: Any) -> str | None:
    """Which distribution the rollout logprobs of ``table`` came from (``knittrans.logprobs_mode``, kept by the store
    from the writer's schema metadata); ``None`` when the writer did not say or the groups disagree."""
    raw = (table.schema.metadata or {}).get(b"knittrans.logprobs_mode")
    return raw.decode() if raw is not None else None


def fetch_micro_batch(
    mode: PackMode, item: tuple[Iterator[Any], MicroBatch], *, keep_keys: bool = False, vocab_size: int | None = None
) -> dict[str, Any]:
    """Prefetch thread: read exactly the micro-batch's slices from its mini-batch's stream and pack them.

    ``item`` is the rank's :meth:`~flight_store.reading.StoreReader.stream` of the mini-batch (one read
    per node and micro-batch, in micro-batch order) and the micro-batch; packing is numpy, zero-copy into torch. With
    ``vocab_size`` a token id outside the model's vocabulary raises ``TokenOutOfVocabularyError`` here, on the
    prefetch thread, and again in the step loop that takes the micro-batch: before the embedding sees it.
    """
    tables, mb = item
    table = next(tables, None)
    if table is None:
        msg = "the mini-batch stream ended before this micro-batch (an earlier micro-batch failed)"
        raise RuntimeError(msg)
    if table.num_rows != mb.rows:
        msg = f"fetched {table.num_rows} rows for a micro-batch of {mb.rows}"
        raise RuntimeError(msg)
    packed = pack_tensors(table, mb.advantages, mode=mode, vocab_size=vocab_size)
    out = {"tensors": packed.to_torch(), "bytes": table.nbytes, "rows": packed.rows, "tokens": packed.tokens_total,
           "logprobs_mode": logprobs_mode(table)}
    if keep_keys:
        out["keys"] = list(zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist(),
                               strict=True))
    return out
