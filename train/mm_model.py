"""The multimodal trainer's vision tower: Megatron-core ``CLIPViTModel`` + mean pool + a projection.

``build_vision_encoder`` returns a ``torch.nn.Module`` mapping uint8 (or float) pixels
``[N, 3, H, W]`` to ``[N, out_width]`` features, one per image: ``CLIPViTModel`` (local layer spec,
dropout 0) over the patches, mean-pooled over its sequence, projected to the backbone's width. The
features feed :class:`train.multimodal.DedupVisionEncoder`, which runs the tower once per distinct
image per mini-batch.

Without TransformerEngine the ``vit_norm`` patch (``train.mcore_compat.apply_vit_norm_patch``) is
applied so that ``CLIPViTModel`` can build its norms. Megatron's model-parallel state must be
initialised first (``train.mcore_compat.init_distributed``).

``python -m train.mm_model`` (one process, gloo) is the self-check the tests run in a subprocess:
the tower's parameter gradients through ``DedupVisionEncoder`` equal those of encoding every
reference separately (fp32, rtol 1e-5), with one encoder pass per distinct image. It prints JSON.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from train.config import VisionConfig


def build_vision_encoder(vision: VisionConfig, out_width: int, *, tensor_parallel: int = 1) -> Any:
    """``CLIPViTModel`` -> mean over the sequence -> ``Linear(hidden, out_width)``, fp32."""
    try:
        import torch
        from megatron.core.models.vision.clip_vit_model import CLIPViTModel
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:  # pragma: no cover - depends on the environment
        msg = "the vision encoder needs torch and megatron-core: pip install knittrans[train]"
        raise ImportError(msg) from exc
    from train.mcore_compat import apply_vit_norm_patch, cuda_available

    apply_vit_norm_patch()
    tcfg = TransformerConfig(
        num_layers=vision.num_layers, hidden_size=vision.hidden_size, num_attention_heads=vision.num_attention_heads,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tensor_parallel, use_cpu_initialization=not cuda_available(),
    )
    vit = CLIPViTModel(tcfg, get_vit_layer_with_local_spec(), img_h=vision.img_h, img_w=vision.img_w,
                       patch_dim=vision.patch_dim)

    class VisionTower(torch.nn.Module):
        """Pixels ``[N, 3, H, W]`` (uint8 scaled to [0, 1]) -> ``[N, out_width]``."""

        def __init__(self) -> None:
            super().__init__()
            self.vit = vit
            self.proj = torch.nn.Linear(vision.hidden_size, out_width)

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            x = pixels.float() / 255.0 if pixels.dtype == torch.uint8 else pixels.float()
            return self.proj(self.vit(x).mean(1))

    tower = VisionTower()
    if cuda_available():
        tower.cuda(torch.cuda.current_device())
    return tower


def dedup_gradient_check(seed: int = 0) -> dict[str, Any]:
    """Gradients of the tower via ``DedupVisionEncoder`` vs per-reference encoding (model parallel initialised)."""
    import numpy as np
    import torch

    from train.multimodal import DedupVisionEncoder, PerReferenceEncoder, distinct_image_keys

    vision = VisionConfig()
    torch.manual_seed(seed)
    tower = build_vision_encoder(vision, 8)
    head = torch.nn.Linear(8, 1)
    rng = np.random.default_rng(seed)
    keys = [bytes([i]) * 32 for i in range(5)]
    images = {k: torch.from_numpy(rng.integers(0, 256, (3, vision.img_h, vision.img_w), dtype=np.uint8))
              for k in keys}
    mbs = [  # micro-batch -> row -> keys, heavy repetition as the G responses of a group have
        [[keys[0]], [keys[0]], [keys[1], keys[2]], [keys[1], keys[2]]],
        [[keys[2]], [keys[3]], [keys[3]], [keys[0]]],
        [[keys[4]], [keys[4]], [keys[4]], [keys[1]]],
    ]
    targets = [torch.from_numpy(rng.standard_normal(len(mb)).astype(np.float32)) for mb in mbs]

    def run(enc: DedupVisionEncoder) -> dict[str, torch.Tensor]:
        tower.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        enc.begin({k: images[k] for k in distinct_image_keys(mbs)})
        for mb, target in zip(mbs, targets, strict=True):
            pooled = torch.stack([enc.lookup(row).mean(0) for row in mb])
            ((head(pooled).squeeze(-1) - target) ** 2).mean().backward()
        enc.finish()
        return {n: p.grad.detach().clone() for n, p in tower.named_parameters() if p.grad is not None}

    ref_enc = PerReferenceEncoder(tower)
    ref = run(ref_enc)
    dedup_enc = DedupVisionEncoder(tower)
    got = run(dedup_enc)
    mismatched = []
    max_rel = 0.0
    for name, g in ref.items():
        if not torch.allclose(got[name], g, rtol=1e-5, atol=1e-7):
            mismatched.append(name)
        scale = float(g.abs().max())
        if scale > 0:
            max_rel = max(max_rel, float((got[name] - g).abs().max()) / scale)
    return {
        "params": len(list(tower.parameters())), "params_with_grad": len(ref), "same_param_names": set(ref) == set(got),
        "mismatched": mismatched, "max_rel_diff": max_rel, "nonzero_grads": sum(bool(g.abs().sum() > 0)
                                                                              for g in got.values()),
        "dedup_forward_images": dedup_enc.forward_images, "dedup_encoder_calls": dedup_enc.encoder_calls,
        "distinct_images": len(distinct_image_keys(mbs)), "reference_forward_images": ref_enc.forward_images,
        "references": sum(len(r) for mb in mbs for r in mb),
    }


def main() -> int:
    """Run :func:`dedup_gradient_check` in a one-rank gloo group; print its JSON."""
    from flight_store.net import free_port
    from train import mcore_compat
    from train.config import ParallelConfig

    if "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    mcore_compat.init_distributed(ParallelConfig(backend="gloo", timeout_s=120.0), seed=0)
    try:
        result = dedup_gradient_check()
    finally:
        mcore_compat.shutdown()
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if not result["mismatched"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
