"""The self-check of the vision-language model in the trainer (:mod:`train.vl_model`) on an Idefics3 folder.

``python -m train.vl_check FOLDER`` (one process, gloo; ``python -m train.verify --hf-checkpoint FOLDER`` runs it
too) prints JSON: the folder's weights loaded into Megatron's ``LLaVAModel`` and gathered back are the folder's bit
for bit; Megatron's logits equal a float32 transformers forward on a prompt with an image; the gradient of the patch
convolution agrees; a mini-batch through the trainer's path (the tower once per distinct image, its tokens merged
into the rows: ``train.vl_model.merged_embeddings``) has the gradients of ``LLaVAModel``'s own forward with every
row's images (rtol 1e-5); and the same check with the causal tower mask fails (the check can fail).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from train.hf_llama import read_hf_weights
from train.vl_model import (
    build_vl_model,
    collapse_image_tokens,
    encode_images,
    llava_logits,
    load_hf_vl_checkpoint,
    megatron_to_hf_vl,
    merged_embeddings,
    read_config,
    vl_logits,
)


def dedup_gradients(model: Any, micro_batches: Sequence[Sequence[tuple[list[int], list[bytes]]]],
                    pixels: dict[bytes, Any], image_token_id: int, *, dedup: bool) -> tuple[dict[str, Any], int]:
    """One mini-batch's parameter gradients (a sum of every row's token log-likelihood per micro-batch, backward
    per micro-batch) and the images the tower encoded. ``micro_batches``: rows of (ids as HF writes them, the
    keys of the row's images); ``dedup``: the trainer's path, the tower once per distinct image
    (:class:`DedupVisionEncoder`) and its tokens merged into the rows (:func:`merged_embeddings`), else the plain
    ``LLaVAModel`` forward with every row's images."""
    import torch

    from train.multimodal import DedupVisionEncoder, distinct_image_keys

    model.zero_grad(set_to_none=True)
    enc = DedupVisionEncoder(lambda px: encode_images(model, px))
    if dedup:
        enc.begin({k: pixels[k] for k in distinct_image_keys([[keys for _, keys in mb] for mb in micro_batches])})
    encoded = 0
    for mb in micro_batches:
        full = torch.tensor([row for row, _ in mb])
        keys = [k for _, row_keys in mb for k in row_keys]
        if dedup:  # the trainer's path: token embeddings with the images' tokens merged in, then the decoder
            pos = torch.arange(full.shape[1])[None]
            emb = merged_embeddings(model, full, pos, enc.lookup(keys), [len(k) for _, k in mb], image_token_id)
            logits = model.language_model(full, pos, None, decoder_input=emb)
        else:  # LLaVAModel's own forward, one image token per image
            ids = torch.tensor([collapse_image_tokens(row, image_token_id) for row, _ in mb])
            logits = llava_logits(model, ids, torch.stack([pixels[k] for k in keys]), len(keys))
            encoded += len(keys)
        lp = logits.float().log_softmax(-1)[:, :-1].gather(-1, full[:, 1:, None])
        (-lp.sum()).backward()
    if dedup:
        enc.finish()
        encoded = enc.forward_images
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, encoded


def self_check(folder: str | Path) -> dict[str, Any]:
    """The checks of the module docstring on the folder's model (model parallelism initialised)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    cfg = read_config(folder)
    hf_weights = read_hf_weights(str(folder))
    proc = AutoProcessor.from_pretrained(str(folder))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    enc = proc(text="<image>how many squares?", images=[image], return_tensors="pt")
    ids, pixels = enc["input_ids"][0].tolist(), enc["pixel_values"].float()
    hf = Idefics3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    picks = [(p, ids[p + 1]) for p in range(len(ids) - 1)]

    def loss(logits: Any) -> Any:
        lp = logits.float().log_softmax(-1)[0]
        return sum(lp[p, t] for p, t in picks)

    want = hf(input_ids=enc["input_ids"], pixel_values=pixels, pixel_attention_mask=enc["pixel_attention_mask"]).logits
    loss(want).backward()
    want_grad = hf.model.vision_model.embeddings.patch_embedding.weight.grad
    out: dict[str, Any] = {"tokens": len(ids), "images": int(pixels.shape[1])}
    for causal in (False, True):
        torch.manual_seed(0)
        model = build_vl_model(cfg, causal_tower=causal)
        load_hf_vl_checkpoint(model, folder)
        got = vl_logits(model, ids, pixels.reshape(-1, *pixels.shape[2:]), cfg["image_token_id"])
        loss(got).backward()
        grad = model.vision_model.conv1.weight.grad
        figures = {
            "logprob_max_abs_diff": float((got.log_softmax(-1) - want.log_softmax(-1)).abs().max()),
            "tower_grad_max_rel_diff": float((grad - want_grad).abs().max() / want_grad.abs().max()),
        }
        if causal:
            out["causal_tower"] = figures
            continue
        out.update(figures)
        back = megatron_to_hf_vl(model)
        out["round_trip_names_equal"] = sorted(back) == sorted(hf_weights)
        out["round_trip_mismatched"] = sorted(n for n in back if n in hf_weights and not torch.equal(back[n],
                                                                                                     hf_weights[n]))
        out["tensors"] = len(back)
        out["dedup"] = _dedup_check(model, proc, cfg["image_token_id"])
    return out


def _dedup_check(model: Any, proc: Any, image_token_id: int) -> dict[str, Any]:
    """Gradients of a mini-batch of three micro-batches whose rows share images (as a group's responses do), with
    the tower once per distinct image and with the plain model: equal at fp32 rtol 1e-5."""
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(1)
    keys = [bytes([i]) * 8 for i in range(3)]
    images = {k: Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for k in keys}
    pixels = {k: proc.image_processor([im], return_tensors="pt")["pixel_values"][0, 0].float()
              for k, im in images.items()}
    prompt = proc(text="<image>how many squares?", images=[images[keys[0]]])["input_ids"][0]

    def row(key: bytes) -> tuple[list[int], list[bytes]]:
        return list(prompt) + rng.integers(3, 500, 6).tolist(), [key]

    a, b, c = keys
    micro_batches = [[row(a), row(a)], [row(b), row(a)], [row(c), row(b)]]
    want, plain_passes = dedup_gradients(model, micro_batches, pixels, image_token_id, dedup=False)
    got, dedup_passes = dedup_gradients(model, micro_batches, pixels, image_token_id, dedup=True)
    mismatched = sorted(n for n, g in want.items() if n not in got or not torch.allclose(
        got[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max())))
    return {"references": sum(len(mb) for mb in micro_batches), "distinct_images": len(keys),
            "encoder_images_dedup": dedup_passes, "encoder_images_plain": plain_passes,
            "params_with_grad": len(want), "tower_params_with_grad": sum(n.startswith("vision_model.") for n in want),
            "projector_params_with_grad": sum(n.startswith("vision_projection.") for n in want),
            "same_param_names": set(want) == set(got), "mismatched": mismatched,
            "max_rel_diff": max(float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items()
                                if n in got and float(g.abs().max()) > 0)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`self_check` on the folder ``argv[0]`` in a one-rank gloo group; print its JSON."""
    from flight_store.net import free_port
    from train import mcore_compat
    from train.config import ParallelConfig

    args = list(sys.argv[1:] if argv is None else argv)
    if "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    mcore_compat.init_distributed(ParallelConfig(backend="gloo", timeout_s=120.0), seed=0)
    try:
        result = self_check(args[0])
    finally:
        mcore_compat.shutdown()
    sys.stdout.write(json.dumps(result) + "\n")
    ok = (result["logprob_max_abs_diff"] < 1e-4 and result["round_trip_names_equal"]
          and not result["round_trip_mismatched"] and not result["dedup"]["mismatched"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
