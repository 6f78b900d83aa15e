"""The vision-language step: Megatron-core's ``LLaVAModel`` trained on the rollout's image trajectories, each
distinct image through the vision tower once per mini-batch.

:class:`VisionLanguageStep` is the ``train.loop.Step`` of a ``ModelConfig(hf_checkpoint=DIR)`` whose folder holds a
vision-language model (``tiny-vl``: Idefics3, :mod:`train.vl_model`). It builds ``LLaVAModel`` from the folder, loads
its weights, and wraps the whole model (tower, projector, backbone) in Megatron DDP and the Megatron optimizer
(``train.model.wrap``). Per mini-batch each rank:

1. takes, from its prefetch thread, its micro-batches' rows (with ``image_keys`` and ``token_versions``) and each
   distinct image once (``train.mm_data.fetch_mm_mini_batch``), and the pixel values the model's own image processor
   makes of them (the folder's, the one vLLM runs), fetched and processed while the step before computes;
2. runs the tower, pixel shuffle and projector once over the distinct images (``DedupVisionEncoder.begin``);
3. runs Megatron's schedule over the micro-batches: each row's token embeddings get its images' tokens at its
   prompt's image-token positions (``train.vl_model.merged_embeddings``, as Idefics3 and vLLM merge them) and the
   decoder scores the labels, with the configured policy loss;
4. back-propagates the gradient every micro-batch left on the shared encodings through the encoder once, inside the
   schedule's gradient finalisation, so DDP reduces and scales the tower's gradients with the backbone's;
5. steps the optimizer. The weights publish under Idefics3's names (``train.vl_model.megatron_to_hf_vl``).

Per-step metrics add ``encoder_passes`` (images through the tower), ``distinct_images``, ``image_refs`` (image
references of the rank's rows), ``image_bytes`` (what the images' DoGet moved; ``bytes_fetched`` counts them with
the rows) and ``process_s`` (the image processor, in the prefetch thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from flight_store.reading import StoreReader
from schemas.plan import MicroBatch, MiniBatchPlan
from schemas.run_records import ConsumedEntry, RowEntry
from train.config import PackMode, TrainConfig
from train.mm_data import MM_COLUMNS

log = logging.getLogger(__name__)

VL_COLUMNS: tuple[str, ...] = (*MM_COLUMNS, "token_versions")
"""Trajectory columns a vision-language rank fetches (the images come by key)."""


class VisionLanguageStep:
    """The vision-language trainer's step (``train.loop.Step``): ``LLaVAModel``, images encoded once per
    mini-batch."""

    def __init__(self, cfg: TrainConfig, env: dict[str, int], client: StoreReader) -> None:
        from transformers import AutoImageProcessor

        from train import model
        from train.mcore_compat import cuda_available
        from train.multimodal import DedupVisionEncoder
        from train.prefetch import Prefetcher
        from train.vl_model import build_vl_model, encode_images, load_hf_vl_checkpoint, read_config

        folder = str(cfg.model.hf_checkpoint)
        self.cfg, self.env = cfg, env
        self.hf = read_config(folder)
        gpt = build_vl_model(self.hf)
        load_hf_vl_checkpoint(gpt, folder)
        if cuda_available():
            import torch

            gpt.cuda(torch.cuda.current_device())
        self.built = model.wrap(gpt, gpt.config, cfg.optim)
        self._finalize = self.built.config.finalize_model_grads_func
        self.built.config.finalize_model_grads_func = self._encoder_backward_then_finalize
        self.encoder = DedupVisionEncoder(partial(encode_images, gpt))
        processor = AutoImageProcessor.from_pretrained(folder)
        self.fetcher = Prefetcher(partial(fetch_vl_mini_batch, client, processor, cfg.pack), depth=cfg.prefetch_depth)
        log.info("rank %d: LLaVAModel from %s", env["rank"], folder)

    def submit(self, plan: MiniBatchPlan) -> None:
        """The rank's whole share of ``plan`` (rows, distinct images, their pixel values) as one prefetch item."""
        self.fetcher.submit([plan.for_rank(self.env["dp_rank"]).micro_batches])

    def step(self, plan: MiniBatchPlan, consumed: list[ConsumedEntry]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches of ``plan``; records the rows it received."""
        from train import backbone
        from train.mcore_compat import device

        t0 = time.perf_counter()
        micro = plan.for_rank(self.env["dp_rank"]).micro_batches
        got = self.fetcher.get(timeout=self.cfg.parallel.timeout_s)
        mb, dev = got.value["mb"], device()
        consumed.extend(RowEntry(step=plan.step, group_id=g, sample_idx=i) for g, i in mb.row_ids)
        passes0 = self.encoder.forward_images
        backbone.zero_grads(self.built)
        pixels = got.value["pixels"]
        if pixels:  # ONE pass of the tower over the distinct images
            self.encoder.begin({k: v.to(dev) for k, v in pixels.items()})
        batches = ({**backbone.to_device(t, dev), "row_keys": keys}
                   for t, keys in zip(got.value["tensors"], mb.row_keys, strict=True))
        reports = backbone.schedule(self.built, self._forward_step, batches, len(micro),
                                    self.cfg.model.max_sequence_length)
        metrics = backbone.step_metrics(plan, micro, reports, self.built.optimizer.step())
        metrics.update(exposed_wait_s=got.wait_s, fetch_s=got.fetch_s,
                       bytes_fetched=mb.trajectory_bytes + mb.image_bytes, image_bytes=mb.image_bytes,
                       encoder_passes=self.encoder.forward_images - passes0, distinct_images=len(pixels),
                       image_refs=mb.references, process_s=got.value["process_s"],
                       step_time_s=time.perf_counter() - t0)
        log.info("step %d loss %.4f: %d encoder passes for %d distinct images (%d references), wait %.1f ms",
                 plan.step, metrics["loss"], metrics["encoder_passes"], len(pixels), mb.references,
                 1e3 * got.wait_s)
        return metrics

    def _forward_step(self, data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[Any, Any]:
        """One micro-batch: its rows' embeddings with their images' tokens merged in, through the decoder."""
        from train import backbone
        from train.loss import policy_loss
        from train.vl_model import merged_embeddings

        b = next(data_iterator)
        keys = [k for row in b["row_keys"] for k in row]
        emb = None  # rows without images: the decoder embeds their tokens itself
        if keys:  # views of the shared encodings at each prompt's image tokens
            emb = merged_embeddings(self.built.gpt, b["tokens"], b["position_ids"], self.encoder.lookup(keys),
                                    [len(row) for row in b["row_keys"]], self.hf["image_token_id"], b["cu_seqlens"])
        out = backbone.forward(self.built, self.built.gpt.language_model, b, decoder_input=emb)
        return out, partial(policy_loss, batch=b, cfg=self.cfg.admission.grpo, objective=self.cfg.loss)

    def _encoder_backward_then_finalize(self, model: Sequence[Any], num_tokens: Any, **kwargs: Any) -> None:
        """The schedule's gradient finalisation, after the encoder's one backward: the tower's gradients land in
        DDP's buffers first, then all of them are reduced over DP and divided by the mini-batch's tokens."""
        if self.encoder.is_open:
            self.encoder.finish()
        self._finalize(model, num_tokens, **kwargs)

    def close(self) -> None:
        """Stop the prefetch thread."""
        self.fetcher.close()


def fetch_vl_mini_batch(client: StoreReader, processor: Any, mode: PackMode,
                        micro: Sequence[MicroBatch]) -> dict[str, Any]:
    """Prefetch thread: a rank's micro-batches of one mini-batch, each distinct image once, and the pixel values
    the model's image processor makes of them (``[3, H, W]`` float32 each: one tile an image)."""
    from train.mm_data import fetch_mm_mini_batch

    mb = fetch_mm_mini_batch(client, micro, mode=mode, columns=VL_COLUMNS)
    t0 = time.perf_counter()
    pixels = pixel_values(processor, mb.images)
    return {"mb": mb, "tensors": [p.to_torch() for p in mb.packed], "pixels": pixels,
            "process_s": time.perf_counter() - t0}


def pixel_values(processor: Any, images: dict[bytes, Any]) -> dict[bytes, Any]:
    """Key -> the ``[3, H, W]`` float32 pixel values the model's image processor makes of each image (``[H, W, C]``
    uint8; an image stored per row, ``knit run --no-image-dedup``, has leading unit axes). Each image is a sample
    of its own (a flat list would be one sample's images) of one tile; ValueError if the processor makes more."""
    if not images:
        return {}
    keys = list(images)
    values = processor([[images[k].reshape(images[k].shape[-3:])] for k in keys], return_tensors="pt")["pixel_values"]
    if values.shape[1] != 1:
        msg = f"the image processor made {values.shape[1]} tiles of an image; the trainer takes one"
        raise ValueError(msg)
    return {k: values[i, 0].float() for i, k in enumerate(keys)}
