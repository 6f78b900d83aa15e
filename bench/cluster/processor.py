"""The image processor of the cluster benchmark: transformers' Qwen2-VL image processor, built from its defaults.

What each path carries of an image follows the system: verl's and TransferQueue's rollouts write every row with
its prompt's processed images (``pixel_values``, float32 patches of 14x14x3x2 values, and ``image_grid_thw``),
as a Qwen2-VL rollout hands them to the trainer; knittrans stores the raw image bytes once per group and the
rank runs this processor on them inside its step's clock. Built with no hub access (no pretrained name: the
class's own defaults, which are Qwen2-VL's); transformers ships with the ``vllm`` extra.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

PIXEL_VALUES = "pixel_values"
"""The processor's patch tensor (``[patches, 1176]`` float32 per image, concatenated over images)."""
GRID = "image_grid_thw"
"""The processor's grid per image (``[images, 3]`` int64: temporal, height, width patches)."""


@functools.cache
def processor() -> Any:
    """``Qwen2VLImageProcessor()`` (its defaults); transformers' PIL backend where torchvision is not installed."""
    try:
        import transformers
    except ImportError as exc:
        msg = "the cluster benchmark's image processor needs transformers (install the 'vllm' extra)"
        raise ImportError(msg) from exc
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the note that the PIL backend stands in for torchvision's
    try:
        return transformers.Qwen2VLImageProcessor()
    finally:
        quiet.setLevel(level)


def describe() -> str:
    """What the result JSON names as the processor."""
    p = processor()
    return (f"transformers {type(p).__name__} defaults (patch {p.patch_size}, merge {p.merge_size}, "
            f"temporal patch {p.temporal_patch_size}, float32 pixel_values)")


def process(images: Sequence[np.ndarray]) -> dict[str, Any]:
    """``{pixel_values, image_grid_thw}`` torch tensors of ``images`` (uint8 ``(C, H, W)`` arrays)."""
    out = processor()(images=list(images), return_tensors="pt")
    return {PIXEL_VALUES: out[PIXEL_VALUES], GRID: out[GRID]}


def per_row(images: Sequence[np.ndarray], rows: int) -> dict[str, Any]:
    """A group's processed images as every one of its ``rows`` rows carries them (``[rows, ...]`` tensors)."""
    import torch

    one = process(images)
    return {k: torch.stack([v] * rows) for k, v in one.items()}
