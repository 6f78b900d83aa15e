"""The trainer loop: connect -> scan -> plan -> fetch -> step, one optimizer step per mini-batch.

Every rank runs :func:`run`. Rank 0 also hosts the planner (``train.planning``): it scans metadata,
plans each mini-batch as soon as admission allows, and broadcasts the plans. Each rank fetches
exactly the slices of its own DP rank's micro-batches (one DoGet per node holding them) on the
prefetch thread, packs them into tensors, and runs Megatron-core's ``get_forward_backward_func``
with the GRPO/PPO loss. After the optimizer step rank 0 publishes the new policy version to every
store (and the weights, when asked) and releases the consumed groups.

Per-step metrics (returned, logged, and written to ``report_path``): loss and ratio statistics as
token means over the mini-batch, grad norm, tokens, and, per micro-batch, the exposed wait (time
the step loop blocked on data) and the fetch time hidden behind compute.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from functools import partial
from typing import Any

from schemas.plan import MicroBatch, MiniBatchPlan
from train.config import TrainConfig
from train.packing import PACK_COLUMNS, block_causal_mask, pack

log = logging.getLogger(__name__)


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train until ``max_steps`` mini-batches are consumed or no data arrives for ``idle_timeout_s``."""
    from flight_store.client import StoreClient
    from train import mcore_compat, model
    from train.planning import PlanSource, exchange_plans, load_planner
    from train.prefetch import Prefetcher

    # connect: process group (+ CPU patches), model, optimizer, stores
    env = mcore_compat.init_distributed(cfg.parallel, seed=cfg.seed)
    built = model.build(cfg.model, cfg.optim, tensor_parallel=cfg.parallel.tensor_parallel)
    if cfg.load_dir:
        model.load_checkpoint(built.gpt, cfg.load_dir)
    client = StoreClient(cfg.stores, token=cfg.token)
    source, planner = None, None
    if env["rank"] == 0:
        planner = load_planner(cfg.planner, dict(cfg.planner_options), env["dp_size"])
        source = PlanSource(client, planner)
    fetcher = Prefetcher(partial(fetch_micro_batch, cfg, keep_keys=cfg.report_path is not None),
                         depth=cfg.prefetch_depth)
    queue: deque[MiniBatchPlan] = deque()
    version = cfg.initial_version
    history: list[dict[str, Any]] = []
    consumed: list[list[Any]] = []
    log.info("rank %d ready: %s", env["rank"], env)
    if cfg.publish_weights:  # the rollout starts from the trainer's weights (version initial_version)
        publish_weights(built, client, version, env)
    plan_wait = 0.0

    try:
        while True:
            # scan + plan on rank 0, broadcast (every rank knows the queue, so all skip or all join)
            if not cfg.max_steps or len(history) + len(queue) < cfg.max_steps:
                t_plan = time.perf_counter()
                new = exchange_plans(source, version, block=not queue, idle_timeout_s=cfg.idle_timeout_s,
                                     poll_interval_s=cfg.poll_interval_s)
                plan_wait += time.perf_counter() - t_plan
                for plan in new:
                    queue.append(plan)
                    # one DoGet per node for the rank's micro-batches, read one at a time on the prefetch thread
                    mbs = plan.for_rank(env["dp_rank"]).micro_batches
                    tables = client.stream([mb.slices for mb in mbs], columns=PACK_COLUMNS)
                    fetcher.submit((tables, mb) for mb in mbs)
            if not queue:
                break  # idle for idle_timeout_s, or max_steps reached
            plan = queue.popleft()
            metrics = train_step(built, plan, fetcher, cfg, env, consumed)  # step
            version += 1
            t_pub = time.perf_counter()
            if cfg.publish_weights:
                publish_weights(built, client, version, env)
            if env["rank"] == 0:
                client.publish_version(version)
                client.release(plan.group_ids)
            metrics["version"] = version
            metrics["publish_s"] = time.perf_counter() - t_pub
            metrics["plan_wait_s"], plan_wait = plan_wait, 0.0
            metrics["t_end"] = time.time()
            history.append(metrics)
            if cfg.progress_path and env["rank"] == 0:
                write_progress(cfg.progress_path, metrics, source, planner)
            log.info("step %d loss %.4f ratio %.4f wait %.1f ms (%d micro-batches) %.0f ms", plan.step,
                     metrics["loss"], metrics["ratio"], 1e3 * sum(metrics["exposed_wait_s"]),
                     len(metrics["exposed_wait_s"]), 1e3 * metrics["step_time_s"])
        if queue:
            log.warning("rank %d stops with %d planned mini-batches unconsumed", env["rank"], len(queue))
        if cfg.save_dir:
            model.save_checkpoint(built.gpt, cfg.save_dir)
    finally:
        fetcher.close()
        client.close()
    if cfg.report_path:
        write_report(cfg, env, history, consumed)
    if cfg.consumed_path and planner is not None:
        write_consumed(cfg.consumed_path, planner)
    mcore_compat.shutdown()
    return history


def fetch_micro_batch(
    cfg: TrainConfig, item: tuple[Iterator[Any], MicroBatch], *, keep_keys: bool = False
) -> dict[str, Any]:
    """Prefetch thread: read exactly the micro-batch's slices from its mini-batch's stream and pack them.

    ``item`` is the rank's :meth:`~flight_store.client.StoreClient.stream` of the mini-batch (one DoGet
    per node, read in micro-batch order) and the micro-batch; packing is numpy, zero-copy into torch.
    """
    tables, mb = item
    table = next(tables, None)
    if table is None:
        msg = "the mini-batch stream ended before this micro-batch (an earlier micro-batch failed)"
        raise RuntimeError(msg)
    if table.num_rows != mb.rows:
        msg = f"fetched {table.num_rows} rows for a micro-batch of {mb.rows}"
        raise RuntimeError(msg)
    packed = pack(table, mb.advantages, mode=cfg.pack)
    out = {"tensors": packed.to_torch(), "bytes": table.nbytes, "rows": packed.rows, "tokens": packed.tokens_total}
    if keep_keys:
        out["keys"] = list(zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist(),
                               strict=True))
    return out


def train_step(built: Any, plan: MiniBatchPlan, fetcher: Any, cfg: TrainConfig, env: dict[str, int],
               consumed: list[list[Any]]) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches of ``plan``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from train.loss import policy_loss
    from train.mcore_compat import device

    t0 = time.perf_counter()
    micro = plan.for_rank(env["dp_rank"]).micro_batches
    if cfg.report_path is not None:
        consumed.extend(["slice", plan.step, s.node, s.group_id, s.start, s.stop] for m in micro for s in m.slices)
    waits: list[float] = []
    fetch_s: list[float] = []
    nbytes = 0
    dev = device()

    def batches() -> Any:
        nonlocal nbytes
        for _ in micro:
            got = fetcher.get(timeout=cfg.parallel.timeout_s)
            waits.append(got.wait_s)
            fetch_s.append(got.fetch_s)
            nbytes += got.value["bytes"]
            consumed.extend(["row", plan.step, g, i] for g, i in got.value.get("keys", []))
            yield {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v)
                   for k, v in got.value["tensors"].items()}

    def forward_step(data_iterator: Any, gpt: Any) -> tuple[Any, Any]:
        b = next(data_iterator)
        mask, packed_seq = None, None
        if b["cu_seqlens"] is not None:
            mask, packed_seq = thd_attention(b["cu_seqlens"], b["tokens"].shape[1], built.gpt)
        out = gpt(b["tokens"], b["position_ids"], mask, labels=b["labels"], packed_seq_params=packed_seq)
        return out, partial(policy_loss, batch=b, cfg=cfg.loss)

    built.model.zero_grad_buffer()
    built.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches(), model=built.model, num_microbatches=len(micro),
        seq_length=cfg.model.max_sequence_length, micro_batch_size=1, forward_only=False)
    ok, grad_norm, _ = built.optimizer.step()
    keys = ("pg_loss", "ratio", "clip_frac", "logp_diff")
    sums = torch.zeros(2 * len(keys) + 1, dtype=torch.float64, device=dev)
    for r in reports:
        for j, k in enumerate(keys):
            sums[2 * j: 2 * j + 2] += r[k].to(sums)
    sums[-1] = sum(m.rows for m in micro)
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    s = sums.tolist()
    tokens = max(s[1], 1.0)
    return {
        "step": plan.step, "train_batch": plan.train_batch, "position": plan.position,
        "loss": s[0] / tokens, "ratio": s[2] / tokens, "clip_frac": s[4] / tokens, "abs_logp_diff": s[6] / tokens,
        "loss_tokens": int(s[1]), "rows": int(s[-1]), "grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok),
        "micro_batches": len(micro), "exposed_wait_s": waits, "fetch_s": fetch_s, "bytes_fetched": nbytes,
        "step_time_s": time.perf_counter() - t0,
    }


def thd_attention(cu_seqlens: Any, width: int, gpt: Any) -> tuple[Any, Any]:
    """Attention inputs of a packed (THD) row: TE's ``PackedSeqParams`` on GPU, a block mask otherwise."""
    from train.model import uses_te

    if uses_te(gpt):
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return None, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)
    return block_causal_mask(cu_seqlens.cpu(), width).to(cu_seqlens.device), None


def publish_weights(built: Any, client: Any, version: int, env: dict[str, int]) -> None:
    """Gather the weights under HF Llama names (all ranks) and DoPut them to every store (rank 0)."""
    from train.weights import megatron_to_hf_llama, weights_to_arrow

    named = megatron_to_hf_llama(built.gpt)
    if env["rank"] == 0:
        client.put_weights(weights_to_arrow(named), version)


def write_report(cfg: TrainConfig, env: dict[str, int], history: list[dict[str, Any]],
                 consumed: list[list[Any]]) -> None:
    """One JSON per rank: environment, per-step metrics, and what it consumed.

    ``consumed`` holds ``["slice", step, node, group_id, start, stop]`` for every planned slice of this
    rank and ``["row", step, group_id, sample_idx]`` for every row it actually received.
    """
    path = cfg.report_path.replace("{rank}", str(env["rank"])) if cfg.report_path else ""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": env, "steps": history, "consumed": consumed}, f)


def write_progress(path: str, metrics: dict[str, Any], source: Any, planner: Any) -> None:
    """Rank 0: append one JSON line for the step just taken (with its staleness, from the planner)."""
    line = {k: metrics[k] for k in ("step", "train_batch", "position", "version", "loss", "rows", "abs_logp_diff",
                                    "plan_wait_s", "step_time_s", "t_end")}
    line["admitted_groups"] = getattr(source, "admitted_groups", None)
    if planner is not None and hasattr(planner, "consumed_frame"):
        import polars as pl

        frame = planner.consumed_frame().filter(pl.col("step") == metrics["step"])
        if frame.height:
            line["arch_staleness_mean"] = float(frame["arch_staleness"].mean())  # type: ignore[arg-type]
            line["arch_staleness_max"] = int(frame["arch_staleness"].max())  # type: ignore[arg-type]
            line["reward_mean"] = float(frame["reward"].mean())  # type: ignore[arg-type]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def write_consumed(path: str, planner: Any) -> None:
    """Rank 0: the planner's consumed trajectories (keys, step, versions, staleness) as Parquet."""
    if not hasattr(planner, "consumed_frame"):
        log.warning("planner %r keeps no consumed frame; %s not written", planner, path)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    planner.consumed_frame().write_parquet(path)
