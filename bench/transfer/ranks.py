"""The trainer ranks of the transfer benchmark: one Ray actor per rank, both paths.

:class:`RankWorker` loads the baseline's serialised DataProto shards (``ray.get`` + ``torch.load``),
or runs the on-demand path itself: it DoGets exactly its own slices (and, multimodal, each distinct
image once) on a prefetch thread while the previous micro-batch computes. Compute is the
calibrated stand-in, or, in the multimodal train phase, the tiny models of :mod:`bench.transfer.models`.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np

from bench.transfer.models import tiny_models
from bench.transfer.workload import Workload
from schemas.plan import MiniBatchPlan


class RankWorker:
    """One trainer rank: loads baseline shards, or fetches its own slices with prefetch and computes."""

    def __init__(self, rank: int, stores: list[str], w: dict[str, Any]) -> None:
        from flight_store.reading import StoreReader

        self.rank = rank
        self.w = Workload(**w)
        self.client = StoreReader(stores)
        self.encoded = 0
        """Images that went through an encoder's forward on this rank (counted by a forward hook)."""
        self._baseline_models: tuple[Any, Any, Any] | None = None

    def ready(self) -> int:
        import torch  # noqa: F401  (import cost outside the clock)

        import train.packing  # noqa: F401

        return self.rank

    def load_baseline(self, refs: list[Any]) -> dict[str, float]:
        """ray.get the serialised shard and torch.load it (DataProto.__setstate__)."""
        import ray
        import torch

        t0 = time.perf_counter()
        data = ray.get(refs[0])
        shard = torch.load(io.BytesIO(data), weights_only=True)
        rows = int(next(iter(shard.values())).shape[0])
        return {"load_s": time.perf_counter() - t0, "rows": rows, "end": time.time()}

    def _compute(self, tensors: dict[str, Any], tokens: int) -> None:
        t0 = time.perf_counter()
        _ = float((tensors["tokens"] % 7).sum()) + float(tensors["loss_mask"].sum())  # touch every token
        hold = self.w.compute_ms_per_ktok * tokens / 1e6 - (time.perf_counter() - t0)
        if hold > 0:
            time.sleep(hold)  # accelerator busy, CPU free

    def run_ondemand(self, steps: list[list[str]]) -> list[dict[str, Any]]:
        """Every train step's mini-batches (plans as JSON): fetch own slices with prefetch, compute."""
        from train.packing import PACK_COLUMNS, pack_tensors
        from train.prefetch import Prefetcher

        def fetch(item: Any) -> dict[str, Any]:
            tables, mb = item  # as the trainer: one stream (DoGet per node) per mini-batch, read in order
            t0 = time.perf_counter()
            table = next(tables)
            t1 = time.perf_counter()
            p = pack_tensors(table, mb.advantages, mode="padded")
            return {"tensors": p.to_torch(), "tokens": p.tokens_total, "bytes": table.nbytes, "doget_s": t1 - t0,
                    "pack_s": time.perf_counter() - t1}

        plans = [[MiniBatchPlan.model_validate_json(p) for p in step] for step in steps]
        pf = Prefetcher(fetch, depth=self.w.prefetch_depth)
        out = []
        try:
            for step in plans:  # submit everything known; the lookahead stays bounded by depth
                for plan in step:
                    mbs = plan.for_rank(self.rank).micro_batches
                    tables = self.client.stream([mb.slices for mb in mbs], columns=PACK_COLUMNS)
                    pf.submit((tables, mb) for mb in mbs)
            for step in plans:
                t0 = time.perf_counter()
                waits, fetches, nbytes, tokens, doget, packing = [], [], 0, 0, 0.0, 0.0
                for plan in step:
                    for _ in plan.for_rank(self.rank).micro_batches:
                        got = pf.get(timeout=120)
                        waits.append(got.wait_s)
                        fetches.append(got.fetch_s)
                        nbytes += got.value["bytes"]
                        tokens += got.value["tokens"]
                        doget += got.value["doget_s"]
                        packing += got.value["pack_s"]
                        self._compute(got.value["tensors"], got.value["tokens"])
                out.append({"step_s": time.perf_counter() - t0, "wait_s": sum(waits), "fetch_s": sum(fetches),
                            "micro_batches": len(waits), "bytes": nbytes, "tokens": tokens,
                            "max_wait_s": max(waits), "doget_s": doget, "pack_s": packing})
        finally:
            pf.close()
        return out

    # ---- multimodal --------------------------------------------------------------------------

    def _mm_models(self) -> tuple[Any, Any, Any]:
        """The tiny vision encoder, the tiny backbone and one Adam over both (same seed on every path).

        Every image through the encoder's forward adds to :attr:`encoded`.
        """
        import torch

        torch.manual_seed(self.w.seed)
        encoder_cls, backbone_cls = tiny_models()
        enc = encoder_cls(tuple(self.w.image_shape), self.w.encoder_width, self.w.encoder_patch,
                                self.w.backbone_width)

        def count(_module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
            self.encoded += int(inputs[0].shape[0])

        enc.register_forward_hook(count)
        backbone = backbone_cls(32000, self.w.backbone_width)
        opt = torch.optim.Adam([*enc.parameters(), *backbone.parameters()], lr=1e-3)
        return enc, backbone, opt

    def _mm_fetch(self, micro: Any) -> dict[str, Any]:
        import torch

        from train.mm_data import fetch_mm_mini_batch

        t0 = time.perf_counter()
        mb = fetch_mm_mini_batch(self.client, micro, mode="padded")
        t1 = time.perf_counter()
        tensors = [p.to_torch() for p in mb.packed]
        images = {k: torch.from_numpy(np.array(v)) for k, v in mb.images.items()}  # own, writable copies
        return {"mb": mb, "tensors": tensors, "images": images, "convert_s": time.perf_counter() - t1,
                "fetch_mm_s": t1 - t0}

    def run_mm_ondemand(self, steps: list[list[str]], train: bool) -> list[dict[str, Any]]:
        """Multimodal on-demand: per mini-batch, fetch own slices + each distinct image once (prefetched).

        ``train=False``: the calibrated compute stand-in per micro-batch. ``train=True``: the tiny encoder
        runs once per distinct image (``DedupVisionEncoder``), every micro-batch's backbone indexes the
        shared encodings, one backward through the encoder, one optimizer step per mini-batch.
        """
        import torch

        from train.multimodal import DedupVisionEncoder
        from train.prefetch import Prefetcher

        plans = [[MiniBatchPlan.model_validate_json(p) for p in step] for step in steps]
        enc: Any = None
        backbone: Any = None
        opt: Any = None
        if train:
            enc, backbone, opt = self._mm_models()
        dedup = DedupVisionEncoder(enc) if enc is not None else None
        pf = Prefetcher(self._mm_fetch, depth=self.w.prefetch_depth)
        out = []
        try:
            for step in plans:
                pf.submit(plan.for_rank(self.rank).micro_batches for plan in step)
            for step in plans:
                t0 = time.perf_counter()
                rec = {"wait_s": 0.0, "fetch_s": 0.0, "traj_bytes": 0, "image_bytes": 0, "tokens": 0, "rows": 0,
                       "distinct_images": 0, "image_refs": 0, "doget_s": 0.0, "image_doget_s": 0.0,
                       "pack_s": 0.0, "convert_s": 0.0, "compute_s": 0.0, "micro_batches": 0}
                passes0 = self.encoded
                for _ in step:
                    got = pf.get(timeout=120)
                    _add_mm_fetch(rec, got)
                    rec["compute_s"] += self._mm_compute(got.value, dedup, backbone, opt)
                rec["step_s"] = time.perf_counter() - t0
                rec["encoder_passes"] = self.encoded - passes0
                out.append(rec)
        finally:
            pf.close()
        del torch
        return out

    def _mm_compute(self, v: dict[str, Any], dedup: Any, backbone: Any, opt: Any) -> float:
        """One fetched mini-batch's compute; returns its seconds.

        Without ``dedup``: touch every pixel once, then the stand-in per micro-batch. With it: one
        encoder pass per distinct image, the backbone per micro-batch, one backward, one optimizer step.
        """
        from train.mm_data import pooled_row_features

        mb = v["mb"]
        tc = time.perf_counter()
        if dedup is None:
            _ = sum(float(img.sum()) for img in v["images"].values())  # touch every pixel once
            for t, p in zip(v["tensors"], mb.packed, strict=True):
                self._compute(t, p.tokens_total)
        else:
            opt.zero_grad()
            dedup.begin(v["images"])
            for t, keys in zip(v["tensors"], mb.row_keys, strict=True):
                feats = pooled_row_features(dedup, keys, self.w.backbone_width)
                backbone.loss(t["tokens"], feats, t["advantages"], t["loss_mask"]).backward()
            dedup.finish()
            opt.step()
        return time.perf_counter() - tc

    def load_mm_baseline(self, refs: list[Any], train: bool, micro_batches: int) -> dict[str, Any]:
        """ray.get + torch.load the shard (images replicated per row); with ``train``, encode every row's copy."""
        import ray
        import torch

        t0 = time.perf_counter()
        shard = torch.load(io.BytesIO(ray.get(refs[0])), weights_only=True)
        loaded = time.time()
        rows = int(shard["input_ids"].shape[0])
        passes0 = self.encoded
        if train and self._baseline_models is None:
            self._baseline_models = self._mm_models()  # once, in the warm-up step (its time is not counted)
        tc = time.perf_counter()
        if train:
            assert self._baseline_models is not None
            enc, backbone, opt = self._baseline_models
            chunks = np.array_split(np.arange(rows), self.w.mini_batches)
            for mini in chunks:
                opt.zero_grad()
                for idx in np.array_split(mini, micro_batches):
                    ix = torch.as_tensor(idx)
                    width = int(shard["attention_mask"][ix].sum(1).max())
                    tokens = shard["input_ids"][ix, :width]
                    mask = shard["attention_mask"][ix, :width].float()
                    adv = shard["advantages"][ix, :1].expand(-1, width)
                    pix = shard["pixel_values"][ix]  # [rows, images, C, H, W]: one copy per trajectory
                    feats = enc(pix.flatten(0, 1)).view(len(idx), pix.shape[1], -1).mean(1)  # dedup off
                    backbone.loss(tokens, feats, adv, mask).backward()
                opt.step()
        else:
            _ = float(shard["pixel_values"].sum())  # touch every pixel once, as the on-demand path does
        return {"load_s": tc - t0, "rows": rows, "loaded": loaded, "end": time.time(),
                "compute_s": time.perf_counter() - tc, "encoder_passes": self.encoded - passes0}


def _add_mm_fetch(rec: dict[str, Any], got: Any) -> None:
    """Add one prefetched multimodal mini-batch (wait, fetch, bytes, images, tokens) to its step's record."""
    v, mb = got.value, got.value["mb"]
    rec["wait_s"] += got.wait_s
    rec["fetch_s"] += got.fetch_s
    rec["traj_bytes"] += mb.trajectory_bytes
    rec["image_bytes"] += mb.image_bytes
    rec["distinct_images"] += len(mb.images)
    rec["image_refs"] += mb.references
    for k in ("doget_s", "image_doget_s", "pack_s"):
        rec[k] += getattr(mb, k)
    rec["convert_s"] += v["convert_s"]
    rec["micro_batches"] += len(v["tensors"])
    rec["tokens"] += sum(p.tokens_total for p in mb.packed)
    rec["rows"] += sum(p.rows for p in mb.packed)
