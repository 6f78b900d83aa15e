"""The vision encoder's cost per image in the multimodal cells: a ViT-B/16-shaped network, measured.

No pretrained vision tower ships its weights in a package this project installs, so the encoder is a
network of a real one's size with random weights (the cost of a forward does not depend on the
weights): ViT-B/16 (patch 16, width 768, 12 layers of 12 heads, MLP 3072, pre-norm, a class token),
86M parameters, over the benchmark's image shape (448x448 RGB: 784 patches + the class token).
:func:`measure_ms_per_image` times its forward (no gradient, batches of :data:`BATCH`) after one warm-up;
the multimodal cells hold a rank that long per image they encode (:class:`bench.peers.common.Encoder`),
so the figure is stated beside the ratio it sets (``metrics.mm_encoder_ms_per_image``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

BATCH = 2
"""Images per timed forward."""
WIDTH, DEPTH, HEADS, MLP, PATCH = 768, 12, 12, 3072, 16
"""ViT-B/16's shape."""


def vit_b16(image_shape: tuple[int, ...]) -> Any:
    """A ViT-B/16-shaped encoder (random weights) for ``(C, H, W)`` images."""
    import torch
    from torch import nn

    channels, height, width = image_shape
    patches = (height // PATCH) * (width // PATCH)

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Conv2d(channels, WIDTH, kernel_size=PATCH, stride=PATCH)
            self.cls = nn.Parameter(torch.zeros(1, 1, WIDTH))
            self.pos = nn.Parameter(torch.randn(1, patches + 1, WIDTH) * 0.02)
            layer = nn.TransformerEncoderLayer(WIDTH, HEADS, MLP, activation="gelu", batch_first=True,
                                               norm_first=True, dropout=0.0)
            self.blocks = nn.TransformerEncoder(layer, DEPTH, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(WIDTH)

        def forward(self, images: Any) -> Any:
            x = self.embed(images).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.norm(self.blocks(x))[:, 0]

    return ViT().eval()


def measure_ms_per_image(image_shape: tuple[int, ...], reps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Median forward time of :func:`vit_b16` per image over ``reps`` batches of :data:`BATCH` (after a warm-up)."""
    import torch

    torch.manual_seed(seed)
    model = vit_b16(image_shape)
    images = torch.rand(BATCH, *image_shape)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model(images)
            times.append(time.perf_counter() - t0)
    return {"ms_per_image": 1e3 * statistics.median(times[1:]) / BATCH,
            "params": sum(p.numel() for p in model.parameters()), "batch": BATCH, "reps": reps,
            "model": f"ViT-B/16 shape (width {WIDTH}, {DEPTH} layers, {HEADS} heads, MLP {MLP}), random weights"}
