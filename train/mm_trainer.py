"""The multimodal step: the GPT backbone plus a vision encoder whose images are encoded once per mini-batch.

:class:`MultimodalStep` is the multimodal implementation of ``train.loop.Step`` (selected by
``TrainConfig.vision``), with the mini-batch as the unit of fetching. Per mini-batch each rank:

1. takes its micro-batches' slices and all their distinct images from the prefetch thread
   (``train.mm_data.fetch_mm_mini_batch``: one read per node for the rows, then one DoGet per
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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from flight_store.reading import StoreReader
from schemas.plan import MicroBatch, MiniBatchPlan
from schemas.run_records import ConsumedEntry
from train.config import PackMode, TrainConfig, VisionConfig

log = logging.getLogger(__name__)


class MultimodalStep:
    """The multimodal trainer's step (``train.loop.Step``): backbone + vision encoder, images encoded once."""

    def __init__(self, cfg: TrainConfig, env: dict[str, int], client: StoreReader) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from train import model
        from train.mm_model import build_vision_encoder
        from train.multimodal import DedupVisionEncoder, PerReferenceEncoder
        from train.prefetch import Prefetcher

        if cfg.vision is None:
            msg = "MultimodalStep needs TrainConfig.vision"
            raise ValueError(msg)
        self.cfg, self.vision, self.env = cfg, cfg.vision, env
        self.built = model.build(cfg.model, cfg.optim, tensor_parallel=cfg.parallel.tensor_parallel)
        self.tower = build_vision_encoder(self.vision, cfg.model.hidden_size,
                                          tensor_parallel=cfg.parallel.tensor_parallel)
        for p in self.tower.parameters():  # same initial encoder on every DP rank
            dist.broadcast(p.data, src=ps.get_data_parallel_src_rank(), group=ps.get_data_parallel_group())
        self.params = [p for p in self.tower.parameters() if p.requires_grad]
        self.enc_opt = torch.optim.Adam(self.tower.parameters(), lr=cfg.optim.lr, betas=(0.9, cfg.optim.adam_beta2),
                                        weight_decay=cfg.optim.weight_decay)
        self.encoder = DedupVisionEncoder(self.tower) if self.vision.dedup else PerReferenceEncoder(self.tower)
        self.fetcher = Prefetcher(partial(fetch_rank_mini_batch, client, cfg.pack), depth=cfg.prefetch_depth)
        log.info("rank %d: vision encoder dedup=%s", env["rank"], self.vision.dedup)

    def submit(self, plan: MiniBatchPlan) -> None:
        """The rank's whole share of ``plan`` (rows and distinct images) as one prefetch item."""
        self.fetcher.submit([plan.for_rank(self.env["dp_rank"]).micro_batches])

    def step(self, plan: MiniBatchPlan, consumed: list[ConsumedEntry]) -> dict[str, Any]:
        """One optimizer step (backbone + encoder) over this rank's micro-batches of ``plan``."""
        from train import backbone
        from train.mcore_compat import device

        t0 = time.perf_counter()
        micro = plan.for_rank(self.env["dp_rank"]).micro_batches
        got = self.fetcher.get(timeout=self.cfg.parallel.timeout_s)
        data, mb = got.value, got.value["mb"]
        check_images(data["images"], self.vision)
        dev = device()
        passes0 = self.encoder.forward_images

        backbone.zero_grads(self.built)
        self.enc_opt.zero_grad(set_to_none=False)
        if data["images"]:
            self.encoder.begin({k: v.to(dev) for k, v in data["images"].items()})  # dedup: ONE pass, distinct images
        local_tokens = sum(float(t["loss_mask"].sum()) for t in data["tensors"])
        batches = ({**backbone.to_device(t, dev), "row_keys": keys}
                   for t, keys in zip(data["tensors"], mb.row_keys, strict=True))
        reports = backbone.schedule(self.built, self._forward_step, batches, len(micro),
                                    self.cfg.model.max_sequence_length)
        if data["images"]:
            self.encoder.finish()  # dedup: ONE backward through the encoder with every micro-batch's gradient
        encoder_grads = self._reduce_encoder_grads(local_tokens, dev)
        update = self.built.optimizer.step()
        self.enc_opt.step()

        metrics = backbone.step_metrics(plan, micro, reports, update)
        metrics.update(
            exposed_wait_s=got.wait_s, fetch_s=got.fetch_s, bytes_fetched=mb.trajectory_bytes,
            image_bytes=mb.image_bytes, encoder_passes=self.encoder.forward_images - passes0,
            distinct_images=len(data["images"]), image_refs=mb.references, **encoder_grads,
            encoder_weight_checksum=float(sum(p.detach().double().abs().sum() for p in self.params)),
            step_time_s=time.perf_counter() - t0)
        log.info("step %d loss %.4f encoder passes %d for %d distinct images (%d refs) wait %.1f ms", plan.step,
                 metrics["loss"], metrics["encoder_passes"], metrics["distinct_images"], metrics["image_refs"],
                 1e3 * metrics["exposed_wait_s"])
        return metrics

    def _forward_step(self, data_iterator: Iterator[dict[str, Any]], gpt: Any) -> tuple[Any, Any]:
        """Backbone forward of one micro-batch, each row's embeddings plus the mean encoding of its images."""
        import torch

        from train import backbone
        from train.loss import policy_loss
        from train.mcore_compat import device
        from train.mm_data import pooled_row_features

        b = next(data_iterator)
        feats = pooled_row_features(self.encoder, b["row_keys"], self.cfg.model.hidden_size).to(device())
        emb = self.built.gpt.embedding(input_ids=b["tokens"], position_ids=b["position_ids"])  # [seq, batch, hidden]
        if b["cu_seqlens"] is not None:  # packed row: each position gets the features of its sequence
            cu = b["cu_seqlens"].to(torch.int64)
            seg = torch.bucketize(torch.arange(b["tokens"].shape[1], device=cu.device), cu[1:], right=True)
            emb = emb + feats[seg.clamp(max=feats.shape[0] - 1)].unsqueeze(1).to(emb.dtype)
        else:
            emb = emb + feats.unsqueeze(0).to(emb.dtype)
        out = backbone.forward(self.built, gpt, b, decoder_input=emb)
        return out, partial(policy_loss, batch=b, cfg=self.cfg.admission.grpo)

    def _reduce_encoder_grads(self, local_tokens: float, dev: Any) -> dict[str, float]:
        """Sum the encoder's gradients over DP ranks, divide by the mini-batch's global tokens, clip them.

        Returns ``encoder_grad_checksum`` (of the reduced gradients) and ``encoder_grad_norm``.
        """
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = self.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads] + [torch.tensor([local_tokens], device=dev)])
        dist.all_reduce(flat, group=ps.get_data_parallel_group())
        total_tokens = max(float(flat[-1]), 1.0)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = (flat[offset:offset + n] / total_tokens).view_as(p).to(p.dtype)
            offset += n
        checksum = float(sum(p.grad.double().abs().sum() for p in params))
        clip = self.cfg.optim.clip_grad
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip) if clip
                     else torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
        return {"encoder_grad_norm": norm, "encoder_grad_checksum": checksum}

    def close(self) -> None:
        """Stop the prefetch thread."""
        self.fetcher.close()


def check_images(images: dict[bytes, Any], vision: VisionConfig) -> None:
    """Every fetched image has the encoder's input shape ``[3, img_h, img_w]``."""
    want = (3, vision.img_h, vision.img_w)
    for k, img in images.items():
        if tuple(img.shape) != want:
            msg = f"image {k.hex()} has shape {tuple(img.shape)}; the vision encoder takes {want}"
            raise ValueError(msg)


def fetch_rank_mini_batch(client: StoreReader, mode: PackMode, micro: Sequence[MicroBatch]) -> dict[str, Any]:
    """Prefetch thread: a rank's micro-batches of one mini-batch, and each distinct image once, as torch."""
    import numpy as np
    import torch

    from train.mm_data import fetch_mm_mini_batch

    mb = fetch_mm_mini_batch(client, micro, mode=mode)
    images = {k: torch.from_numpy(np.array(v)) for k, v in mb.images.items()}  # writable copies
    return {"mb": mb, "tensors": [p.to_torch() for p in mb.packed], "images": images}
