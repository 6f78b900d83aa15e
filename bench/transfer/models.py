"""The tiny vision encoder and backbone that the multimodal transfer-plus-train phase really trains.

Real compute on CPU, small enough for a benchmark: both paths of ``--multimodal`` train the same
models from the same seed (:meth:`bench.transfer.ranks.RankWorker._mm_models`).
"""

from __future__ import annotations

from typing import Any

_MODELS: tuple[Any, Any] | None = None


def tiny_models() -> tuple[Any, Any]:
    """``(TinyVisionEncoder, TinyBackbone)`` classes (torch imported on first use).

    The encoder is a ViT-style patch embedding (a ``patch x patch`` stride-``patch`` convolution over
    uint8 pixels scaled to [0, 1], 1024 patches for a 448x448 image), a GELU MLP over the patches,
    mean-pooled and projected to the backbone width. The backbone embeds every token, adds its row's
    pooled image features, and regresses a per-token value onto the advantages (masked MSE): small
    but real, so the loss depends on the encodings and the encoder gets gradients.
    """
    global _MODELS
    if _MODELS is not None:
        return _MODELS
    import torch
    import torch.nn.functional as F

    class TinyVisionEncoder(torch.nn.Module):
        def __init__(self, image_shape: tuple[int, ...], width: int, patch: int, out: int) -> None:
            super().__init__()
            self.pixels = len(image_shape) == 3
            self.patch: torch.nn.Module = (torch.nn.Conv2d(image_shape[0], width, patch, stride=patch) if self.pixels
                                           else torch.nn.Linear(image_shape[1], width))
            self.mix = torch.nn.Linear(width, width)
            self.proj = torch.nn.Linear(width, out)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            if self.pixels:  # uint8 [N, C, H, W] -> [N, patches, width]
                h = self.patch(images.float() / 255.0).flatten(2).transpose(1, 2)
            else:  # a processor's patch values [N, patches, values]
                h = self.patch(images.float())
            return self.proj(F.gelu(self.mix(F.gelu(h))).mean(1))

    class TinyBackbone(torch.nn.Module):
        def __init__(self, vocab: int, width: int) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, width)
            self.mix = torch.nn.Linear(width, width)
            self.head = torch.nn.Linear(width, 1)

        def loss(self, tokens: torch.Tensor, feats: torch.Tensor, target: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
            h = self.emb(tokens) + feats[:, None, :]
            pred = self.head(torch.tanh(self.mix(h))).squeeze(-1)
            return (((pred - target) ** 2) * mask).sum() / mask.sum().clamp(min=1.0)

    _MODELS = (TinyVisionEncoder, TinyBackbone)
    return _MODELS
