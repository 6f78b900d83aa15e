"""Vision-encoder dedup gives the same gradients as encoding every reference, with one pass per image."""

from __future__ import annotations

import pytest

from train.multimodal import DedupVisionEncoder, distinct_image_keys

torch = pytest.importorskip("torch")


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=2)
        self.proj = torch.nn.Linear(4 * 7 * 7, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.conv(x)).flatten(1))


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [bytes([i]) * 32 for i in range(5)]
    images = {k: torch.rand(3, 16, 16, generator=g) for k in keys}
    # 3 micro-batches; rows reference images with heavy repetition (as G responses of a group do)
    mbs = [
        [[keys[0]], [keys[0]], [keys[1], keys[2]], [keys[1], keys[2]]],
        [[keys[2]], [keys[3]], [keys[3]], [keys[0]]],
        [[keys[4]], [keys[4]], [keys[4]], [keys[1]]],
    ]
    torch.manual_seed(seed)
    enc = _Encoder()
    head = torch.nn.Linear(16, 1)
    targets = [torch.randn(len(mb), generator=g) for mb in mbs]
    return keys, images, mbs, enc, head, targets


def _loss(feats_per_row: list[torch.Tensor], head: torch.nn.Module, target: torch.Tensor) -> torch.Tensor:
    pooled = torch.stack([f.mean(0) for f in feats_per_row])
    return ((head(pooled).squeeze(-1) - target) ** 2).mean()


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def test_dedup_matches_per_reference_encoding_and_counts_one_pass_per_image() -> None:
    keys, images, mbs, enc, head, targets = _setup()

    # reference: encode every reference separately, micro-batch by micro-batch
    ref_passes = 0
    for mb, target in zip(mbs, targets, strict=True):
        feats = []
        for row in mb:
            feats.append(enc(torch.stack([images[k] for k in row])))
            ref_passes += len(row)
        _loss(feats, head, target).backward()
    ref_enc, ref_head = _grads(enc), _grads(head)
    enc.zero_grad()
    head.zero_grad()

    dedup = DedupVisionEncoder(enc)
    distinct = distinct_image_keys(mbs)
    assert distinct == keys
    dedup.begin({k: images[k] for k in distinct})
    for mb, target in zip(mbs, targets, strict=True):
        feats = [dedup.lookup(row) for row in mb]
        _loss(feats, head, target).backward()
    dedup.finish()

    assert dedup.forward_images == len(distinct) == 5
    assert dedup.encoder_calls == 1
    assert ref_passes == sum(len(r) for mb in mbs for r in mb) > dedup.forward_images
    for name, g in _grads(enc).items():
        torch.testing.assert_close(g, ref_enc[name], rtol=1e-5, atol=1e-7)
    for name, g in _grads(head).items():
        torch.testing.assert_close(g, ref_head[name], rtol=1e-5, atol=1e-7)


def test_misuse_is_reported() -> None:
    _, images, _, enc, _, _ = _setup()
    dedup = DedupVisionEncoder(enc)
    with pytest.raises(RuntimeError, match="before begin"):
        dedup.lookup([b"x" * 32])
    dedup.begin(images)
    with pytest.raises(KeyError, match="not among"):
        dedup.lookup([b"z" * 32])
    with pytest.raises(RuntimeError, match="twice"):
        dedup.begin(images)
    dedup.finish()
    with pytest.raises(RuntimeError, match="without begin"):
        dedup.finish()


def test_per_reference_encoder_is_the_same_computation_with_a_pass_per_reference() -> None:
    from train.multimodal import PerReferenceEncoder

    keys, images, mbs, enc, head, targets = _setup()
    grads = []
    for cls in (PerReferenceEncoder, DedupVisionEncoder):
        enc.zero_grad(set_to_none=True)
        wrapped = cls(enc)
        wrapped.begin({k: images[k] for k in distinct_image_keys(mbs)})
        for mb, target in zip(mbs, targets, strict=True):
            _loss([wrapped.lookup(row) for row in mb], head, target).backward()
        wrapped.finish()
        grads.append((_grads(enc), wrapped.forward_images))
    (ref, ref_passes), (got, passes) = grads
    assert ref_passes == sum(len(r) for mb in mbs for r in mb) == 14 and passes == len(keys) == 5
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7)


def test_pooled_row_features_means_each_rows_images() -> None:
    from train.mm_data import pooled_row_features

    keys, images, _, enc, _, _ = _setup()
    dedup = DedupVisionEncoder(enc)
    leaf = dedup.begin(images)
    rows = [[keys[0], keys[1]], [], [keys[2]], [keys[0], keys[0], keys[3]]]
    feats = pooled_row_features(dedup, rows, 16)
    torch.testing.assert_close(feats[0], (leaf[0] + leaf[1]) / 2)
    torch.testing.assert_close(feats[1], torch.zeros(16))
    torch.testing.assert_close(feats[3], (2 * leaf[0] + leaf[3]) / 3)
    feats.sum().backward()
    assert leaf.grad is not None and leaf.grad[0].sum() != 0 and leaf.grad[4].abs().sum() == 0
    dedup.finish()
    assert pooled_row_features(dedup, [[], []], 16).shape == (2, 16)


def test_vision_config_checks_its_values() -> None:
    from train.config import VisionConfig

    assert VisionConfig(img_h=56, img_w=28).patches == 8
    with pytest.raises(ValueError, match="patch_dim=5"):
        VisionConfig(patch_dim=5)
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        VisionConfig(num_attention_heads=3)
    with pytest.raises(ValueError, match="num_layers"):
        VisionConfig(num_layers=0)
