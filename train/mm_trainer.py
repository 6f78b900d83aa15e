"""The multimodal trainer: the GPT backbone plus a vision encoder whose images are encoded once per mini-batch.

Same loop as :mod:`train.trainer` (connect -> scan -> plan -> fetch -> step), with the mini-batch as
the unit of fetching. Per mini-batch each rank:

1. takes its micro-batches' slices and all their distinct images from the prefetch thread
   (``train.mm_data.fetch_mm_mini_batch``: one DoGet per node for the rows, then one DoGet per
   node for the images, each distinct image once; the next mini-batch is fetched while this one
   computes);
2. encodes the distinct images once (``DedupVisionEncoder.begin``: one leaf tensor);
3. runs the backbone micro-batches through Megatron's schedule: each row's input embeddings get the
   mean encoding of its images added (``pooled_row_features`` indexes the shared leaf, so the loss
   depends on the encodings and every micro-batch's backward accumulates into the leaf's gradient);
4. back-propagates the accumulated gradient through the encoder once (``finish``);
5. all-reduces the encoder's gradients over the data-parallel group and divides them by the
   mini-batch's global token count, as Megatron does for the backbone (``calculate_per_token_loss``);
6. steps Megatron's optimizer (backbone) and an Adam over the encoder.

The encoder (``train.mm_model``: Megatron-core ``CLIPViTModel``) lives outside Megatron DDP; its
initial weights are broadcast from the first rank of each DP group. ``VisionConfig.dedup=False``
encodes every reference inside its micro-batch instead (``PerReferenceEncoder``), the baseline.

Per-step metrics add ``encoder_passes`` (images through the encoder), ``distinct_images``,
``image_refs``, ``image_bytes`` and checksums of the reduced encoder gradients and the encoder's
weights (equal on every DP rank).

Run: ``torchrun --nproc_per_node 2 -m train.mm_trainer --stores grpc://...`` or ``--nproc 2``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

from schemas.plan import MicroBatch, MiniBatchPlan
from train.config import TrainConfig, VisionConfig

log = logging.getLogger(__name__)


def run_mm(cfg: TrainConfig, vision: VisionConfig) -> list[dict[str, Any]]:
    """Train backbone + vision encoder until ``max_steps`` mini-batches or ``idle_timeout_s`` without data."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from flight_store.client import StoreClient
    from train import mcore_compat, model
    from train.mm_model import build_vision_encoder
    from train.multimodal import DedupVisionEncoder, PerReferenceEncoder
    from train.planning import PlanSource, exchange_plans, load_planner
    from train.prefetch import Prefetcher
    from train.trainer import write_report

    unsupported = [name for name in ("publish_weights", "save_dir", "load_dir", "progress_path", "consumed_path")
                   if getattr(cfg, name, None)]
    if unsupported:
        msg = f"the multimodal trainer does not support {unsupported} yet (use train.trainer for text runs)"
        raise ValueError(msg)
    env = mcore_compat.init_distributed(cfg.parallel, seed=cfg.seed)
    built = model.build(cfg.model, cfg.optim, tensor_parallel=cfg.parallel.tensor_parallel)
    tower = build_vision_encoder(vision, cfg.model.hidden_size, tensor_parallel=cfg.parallel.tensor_parallel)
    for p in tower.parameters():  # same initial encoder on every DP rank
        dist.broadcast(p.data, src=ps.get_data_parallel_src_rank(), group=ps.get_data_parallel_group())
    enc_opt = torch.optim.Adam(tower.parameters(), lr=cfg.optim.lr, betas=(0.9, cfg.optim.adam_beta2),
                               weight_decay=cfg.optim.weight_decay)
    encoder = DedupVisionEncoder(tower) if vision.dedup else PerReferenceEncoder(tower)
    client = StoreClient(cfg.stores, token=cfg.token)
    source = None
    if env["rank"] == 0:
        source = PlanSource(client, load_planner(cfg.planner, dict(cfg.planner_options), env["dp_size"]))
    fetcher = Prefetcher(partial(fetch_rank_mini_batch, client, cfg), depth=cfg.prefetch_depth)
    queue: deque[MiniBatchPlan] = deque()
    version = cfg.initial_version
    history: list[dict[str, Any]] = []
    consumed: list[list[Any]] = []
    log.info("rank %d ready (vision dedup=%s): %s", env["rank"], vision.dedup, env)
    try:
        while True:
            if not cfg.max_steps or len(history) + len(queue) < cfg.max_steps:
                new = exchange_plans(source, version, block=not queue, idle_timeout_s=cfg.idle_timeout_s,
                                     poll_interval_s=cfg.poll_interval_s)
                for plan in new:
                    queue.append(plan)
                    fetcher.submit([plan.for_rank(env["dp_rank"]).micro_batches])  # one item per mini-batch
            if not queue:
                break
            plan = queue.popleft()
            metrics = mm_train_step(built, tower, encoder, enc_opt, plan, fetcher, cfg, vision, env, consumed)
            version += 1
            if env["rank"] == 0:
                client.publish_version(version)
                client.release(plan.group_ids)  # frees images no unreleased group references
            metrics["version"] = version
            history.append(metrics)
            log.info("step %d loss %.4f encoder passes %d for %d distinct images (%d refs) wait %.1f ms",
                     plan.step, metrics["loss"], metrics["encoder_passes"], metrics["distinct_images"],
                     metrics["image_refs"], 1e3 * metrics["exposed_wait_s"])
    finally:
        fetcher.close()
        client.close()
    if cfg.report_path:
        write_report(cfg, env, history, consumed)
    mcore_compat.shutdown()
    return history


def fetch_rank_mini_batch(client: Any, cfg: TrainConfig, micro: Sequence[MicroBatch]) -> dict[str, Any]:
    """Prefetch thread: a rank's micro-batches of one mini-batch, and each distinct image once, as torch."""
    import numpy as np
    import torch

    from train.mm_data import fetch_mm_mini_batch

    mb = fetch_mm_mini_batch(client, micro, mode=cfg.pack)
    images = {k: torch.from_numpy(np.array(v)) for k, v in mb.images.items()}  # writable copies
    return {"mb": mb, "tensors": [p.to_torch() for p in mb.packed], "images": images}


def mm_train_step(built: Any, tower: Any, encoder: Any, enc_opt: Any, plan: MiniBatchPlan, fetcher: Any,
                  cfg: TrainConfig, vision: VisionConfig, env: dict[str, int],
                  consumed: list[list[Any]]) -> dict[str, Any]:
    """One optimizer step (backbone + encoder) over this rank's micro-batches of ``plan``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from train.loss import policy_loss
    from train.mcore_compat import device
    from train.mm_data import pooled_row_features
    from train.trainer import thd_attention

    t0 = time.perf_counter()
    micro = plan.for_rank(env["dp_rank"]).micro_batches
    consumed.extend(["slice", plan.step, s.node, s.group_id, s.start, s.stop] for m in micro for s in m.slices)
    got = fetcher.get(timeout=cfg.parallel.timeout_s)
    data = got.value
    mb = data["mb"]
    dev = device()
    want = (3, vision.img_h, vision.img_w)
    for k, img in data["images"].items():
        if tuple(img.shape) != want:
            msg = f"image {k.hex()} has shape {tuple(img.shape)}; the vision encoder takes {want}"
            raise ValueError(msg)
    width = cfg.model.hidden_size
    passes0 = encoder.forward_images

    built.model.zero_grad_buffer()
    built.optimizer.zero_grad()
    enc_opt.zero_grad(set_to_none=False)
    if data["images"]:
        encoder.begin({k: v.to(dev) for k, v in data["images"].items()})  # dedup: ONE pass over distinct images
    local_tokens = sum(float(t["loss_mask"].sum()) for t in data["tensors"])

    def batches() -> Any:
        for tensors, keys in zip(data["tensors"], mb.row_keys, strict=True):
            yield {**{k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in tensors.items()},
                   "row_keys": keys}

    def forward_step(data_iterator: Any, gpt: Any) -> tuple[Any, Any]:
        b = next(data_iterator)
        mask, packed_seq = None, None
        feats = pooled_row_features(encoder, b["row_keys"], width).to(dev)  # [rows, hidden], indexes the leaf
        emb = built.gpt.embedding(input_ids=b["tokens"], position_ids=b["position_ids"])  # [seq, batch, hidden]
        if b["cu_seqlens"] is not None:
            mask, packed_seq = thd_attention(b["cu_seqlens"], b["tokens"].shape[1], built.gpt)
            cu = b["cu_seqlens"].to(torch.int64)
            seg = torch.bucketize(torch.arange(b["tokens"].shape[1], device=cu.device), cu[1:], right=True)
            emb = emb + feats[seg.clamp(max=feats.shape[0] - 1)].unsqueeze(1).to(emb.dtype)
        else:
            emb = emb + feats.unsqueeze(0).to(emb.dtype)
        out = gpt(b["tokens"], b["position_ids"], mask, decoder_input=emb, labels=b["labels"],
                  packed_seq_params=packed_seq)
        return out, partial(policy_loss, batch=b, cfg=cfg.loss)

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches(), model=built.model, num_microbatches=len(micro),
        seq_length=cfg.model.max_sequence_length, micro_batch_size=1, forward_only=False)
    if data["images"]:
        encoder.finish()  # dedup: ONE backward through the encoder with every micro-batch's gradient

    # encoder gradients: sum over DP ranks, then a token mean over the whole mini-batch (as the backbone's)
    params = [p for p in tower.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads] + [torch.tensor([local_tokens], device=dev)])
    dist.all_reduce(flat, group=ps.get_data_parallel_group())
    total_tokens = max(float(flat[-1]), 1.0)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = (flat[offset:offset + n] / total_tokens).view_as(p).to(p.dtype)
        offset += n
    enc_grad_checksum = float(sum(p.grad.double().abs().sum() for p in params))
    enc_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_grad) if cfg.optim.clip_grad
                          else torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
    ok, grad_norm, _ = built.optimizer.step()
    enc_opt.step()

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
        "micro_batches": len(micro), "exposed_wait_s": got.wait_s, "fetch_s": got.fetch_s,
        "bytes_fetched": mb.trajectory_bytes, "image_bytes": mb.image_bytes,
        "encoder_passes": encoder.forward_images - passes0, "distinct_images": len(data["images"]),
        "image_refs": mb.references, "encoder_grad_norm": enc_grad_norm, "encoder_grad_checksum": enc_grad_checksum,
        "encoder_weight_checksum": float(sum(p.detach().double().abs().sum() for p in params)),
        "step_time_s": time.perf_counter() - t0,
    }


def parser() -> argparse.ArgumentParser:
    """The trainer's arguments (``train.entry``) plus the vision encoder's."""
    from train.entry import parser as base

    p = base()
    p.prog = "python -m train.mm_trainer"
    p.description = "Megatron-core GRPO trainer with a CLIPViT vision encoder (images deduplicated per mini-batch)"
    p.add_argument("--no-dedup", action="store_true", help="encode every image reference (the baseline)")
    p.add_argument("--img-size", type=int, default=28, help="square image side in pixels")
    p.add_argument("--patch-dim", type=int, default=14)
    p.add_argument("--vit-layers", type=int, default=2)
    p.add_argument("--vit-hidden", type=int, default=16)
    p.add_argument("--vit-heads", type=int, default=2)
    return p


def vision_from_args(args: argparse.Namespace) -> VisionConfig:
    """The typed vision config from parsed arguments."""
    return VisionConfig(num_layers=args.vit_layers, hidden_size=args.vit_hidden, num_attention_heads=args.vit_heads,
                        img_h=args.img_size, img_w=args.img_size, patch_dim=args.patch_dim, dedup=not args.no_dedup)


def _rank_main(local_rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_args(argv)


def _run_args(argv: list[str]) -> None:
    from train.entry import config_from_args

    args = parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [rank{rank}] %(name)s %(levelname)s %(message)s")
    run_mm(config_from_args(args), vision_from_args(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the multimodal trainer (one rank under torchrun, else ``--nproc`` local ranks)."""
    from train.entry import _free_port, config_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    config_from_args(args)
    vision_from_args(args)  # validate before starting any process
    if "WORLD_SIZE" in os.environ:
        _run_args(argv)
        return 0
    if args.nproc < 1:
        msg = f"--nproc must be >= 1, got {args.nproc}"
        raise SystemExit(msg)
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(args.nproc, _free_port(), argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
