"""Vision-encoder deduplication: each distinct image is encoded once per mini-batch on a rank.

The backbone's micro-batches reference images by content key (``image_keys``). Instead of running
the vision encoder once per reference (every response of a prompt group carries the same images),
a rank:

1. gathers the distinct keys of all its micro-batches in the mini-batch (``distinct_image_keys``)
   and fetches each image once;
2. runs the encoder ONCE over the distinct images (``DedupVisionEncoder.begin``), keeping the
   autograd graph, and exposes the encodings as one leaf tensor;
3. lets every backbone micro-batch index that leaf (``lookup``); their backward passes accumulate
   into the leaf's gradient;
4. after the last micro-batch, back-propagates the accumulated gradient through the encoder once
   (``finish``), so the encoder's parameter gradients equal those of the non-deduplicated
   computation (every micro-batch still contributes its gradient).

``forward_images`` counts images that went through the encoder, so a test (and the benchmark)
can show one encoder pass per distinct image. ``PerReferenceEncoder`` has the same interface and
encodes every reference separately inside each micro-batch's graph: the non-deduplicated baseline.
Torch is imported lazily; this module needs torch only when an encoder is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def distinct_image_keys(per_micro_batch: Iterable[Iterable[Sequence[bytes]]]) -> list[bytes]:
    """Distinct keys over micro-batches -> rows -> keys, in first-seen order."""
    seen: dict[bytes, None] = {}
    for micro_batch in per_micro_batch:
        for row_keys in micro_batch:
            for k in row_keys:
                seen.setdefault(bytes(k), None)
    return list(seen)


class DedupVisionEncoder:
    """Encode distinct images once per mini-batch; hand every micro-batch a view of the result.

    Example::

        enc = DedupVisionEncoder(vision_model)
        enc.begin({k: pixels[k] for k in distinct_image_keys(mbs)})  # one encoder pass
        for mb in micro_batches:                                     # backbone forward/backward
            feats = enc.lookup(mb.image_keys)                        # indexes the shared leaf
        enc.finish()                                                 # one backward through the encoder
    """

    def __init__(self, encoder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.encoder = encoder
        self.forward_images = 0
        """Images that went through the encoder so far (one per distinct image per mini-batch)."""
        self.encoder_calls = 0
        self._index: dict[bytes, int] = {}
        self._encoded: torch.Tensor | None = None
        self._leaf: torch.Tensor | None = None

    def begin(self, images: Mapping[bytes, torch.Tensor]) -> torch.Tensor:
        """Encode ``images`` (distinct keys -> pixel tensors of one shape) in one pass; returns the leaf."""
        pixels = self._open(images, "the previous mini-batch's encoder gradient is pending")
        self._encoded = self.encoder(pixels)
        self.encoder_calls += 1
        self.forward_images += len(images)
        self._leaf = self._encoded.detach().requires_grad_(self._encoded.requires_grad)
        return self._leaf

    def _open(self, images: Mapping[bytes, torch.Tensor], pending: str) -> torch.Tensor:
        """Index this mini-batch's ``images`` and stack their pixels; refuses a second open or no images."""
        import torch

        if self._leaf is not None:
            msg = f"begin() called twice without finish(): {pending}"
            raise RuntimeError(msg)
        if not images:
            msg = "begin() needs at least one image"
            raise ValueError(msg)
        keys = list(images)
        self._index = {k: i for i, k in enumerate(keys)}
        return torch.stack([images[k] for k in keys])

    @property
    def is_open(self) -> bool:
        """Whether a mini-batch is open: begun, not finished."""
        return self._leaf is not None

    def lookup(self, keys: Sequence[bytes]) -> torch.Tensor:
        """Encodings of ``keys`` (repeats allowed), stacked; gradients flow into the shared leaf."""
        import torch

        return self._leaf_rows()[torch.as_tensor(self._indices(keys), dtype=torch.long)]

    def _leaf_rows(self) -> torch.Tensor:
        if self._leaf is None:
            msg = "lookup() before begin(): nothing is open for this mini-batch"
            raise RuntimeError(msg)
        return self._leaf

    def _indices(self, keys: Sequence[bytes]) -> list[int]:
        """Rows of ``keys`` in this mini-batch's images; a key not among them is a KeyError naming it."""
        try:
            return [self._index[bytes(k)] for k in keys]
        except KeyError as exc:
            msg = f"image key {bytes(exc.args[0]).hex()} was not among this mini-batch's images"
            raise KeyError(msg) from None

    def finish(self) -> None:
        """Back-propagate the accumulated encoding gradient through the encoder, once."""
        encoded, leaf = self._encoded, self._leaf
        self._encoded = self._leaf = None
        self._index = {}
        if encoded is None or leaf is None:
            msg = "finish() without begin()"
            raise RuntimeError(msg)
        if leaf.grad is not None and encoded.requires_grad:
            encoded.backward(leaf.grad)

    def stats(self) -> dict[str, Any]:
        return {"encoder_calls": self.encoder_calls, "forward_images": self.forward_images}


class PerReferenceEncoder(DedupVisionEncoder):
    """The baseline with :class:`DedupVisionEncoder`'s interface: every reference is encoded, in its micro-batch.

    ``lookup`` runs the encoder over the images of ``keys`` (repeats encoded again) inside the caller's
    graph, so each micro-batch's backward reaches the encoder directly; ``finish`` has nothing to do.
    """

    def begin(self, images: Mapping[bytes, torch.Tensor]) -> torch.Tensor:
        """Keep ``images`` for this mini-batch (nothing is encoded yet); returns them stacked."""
        self._leaf = self._open(images, "the previous mini-batch is still open")
        return self._leaf

    def lookup(self, keys: Sequence[bytes]) -> torch.Tensor:
        """Encode the images of ``keys`` (one encoder pass per reference)."""
        import torch

        pixels = self._leaf_rows()
        idx = self._indices(keys)
        self.encoder_calls += 1
        self.forward_images += len(idx)
        return self.encoder(pixels[torch.as_tensor(idx, dtype=torch.long)])

    def finish(self) -> None:
        """Close the mini-batch (gradients already reached the encoder in each micro-batch's backward)."""
        if self._leaf is None:
            msg = "finish() without begin()"
            raise RuntimeError(msg)
        self._leaf = None
        self._index = {}
