"""A tiny, randomly initialised vision-language model (``tiny-vl``), built offline like the tiny Llama.

The architecture is Idefics3's: a SigLIP vision tower (patch convolution, learned positions, bidirectional
pre-norm layers, a final norm), a connector that merges each 2x2 block of patch features (pixel shuffle)
and projects them with one linear map, and the Llama backbone of :mod:`connectors.tiny_model` with the image
tokens in its sequence. It is the nearest real VLM architecture both sides run here: vLLM's LLaVA, LLaVA-NeXT,
Qwen2-VL, Qwen2.5-VL, Gemma 3 and PaliGemma all import transformers' Pixtral image processor, which needs
torchvision, and no torchvision build sits beside the CPU torch this project pins; vLLM's Idefics3 does not.
Megatron-core's ``LLaVAModel`` runs it with its SigLIP ViT, its pixel shuffle (the same permutation as
Idefics3's) and an affine projector (:mod:`train.vl_model`).

An image of ``image_size`` pixels a side (no splitting) is ``(image_size / patch)^2 / 4`` image tokens,
written ``<fake_token_around_image><global-img><image>...<image><fake_token_around_image>`` by the processor
(vLLM expands a single ``<image>`` in a prompt the same way).

Needs ``torch``, ``transformers`` and ``tokenizers`` (``pip install knittrans[vllm]``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from connectors.tiny_model import _check_shape, _random_weights, _train_tokenizer, llama_config

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
"""The placeholder a prompt carries per image."""
SPECIAL_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>")
"""Idefics3's image markers and turn end, added to the tokenizer."""
SCALE_FACTOR = 2
"""The connector merges ``SCALE_FACTOR x SCALE_FACTOR`` patches into one image token."""


def build_tiny_vl(
    out_dir: str | Path,
    *,
    image_size: int = 56,
    patch: int = 14,
    vision_layers: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random Idefics3 model (safetensors, fp32), its tokenizer and its processor to ``out_dir``.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        image_size: the side of every image, pixels (images are resized to it, never split).
        patch: the tower's patch side; ``image_size / patch`` must be even (2x2 patches make one token).
        vision_layers, vision_hidden, vision_heads: the SigLIP tower.
        layers, hidden, heads, kv_heads: the Llama backbone (as :func:`connectors.tiny_model.build_tiny_llama`).
        vocab: target BPE vocabulary size before the image tokens are added.
        max_positions: the backbone's ``max_position_embeddings``.
        seed: seeds the tokenizer corpus and the weight init.
    """
    _check_shape(hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    grid = image_size // patch
    if image_size % patch or grid % SCALE_FACTOR or vision_hidden % vision_heads:
        msg = (f"tiny-vl: image_size {image_size} must be a multiple of patch {patch} with an even grid, and "
               f"vision_heads {vision_heads} must divide vision_hidden {vision_hidden}")
        raise ValueError(msg)
    try:
        import torch
        from transformers import (
            Idefics3Config,
            Idefics3ForConditionalGeneration,
            Idefics3ImageProcessor,
            Idefics3Processor,
        )
    except ImportError as exc:
        msg = f"build_tiny_vl needs torch, transformers and tokenizers: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab, seed)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    image_seq_len = (grid // SCALE_FACTOR) ** 2
    size = {"longest_edge": image_size}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size=size, max_image_size=size, do_image_splitting=False),
        tokenizer=tok, image_seq_len=image_seq_len)
    processor.save_pretrained(str(out))
    text = llama_config(tok, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=None,
                        max_positions=max_positions, tie_embeddings=False)
    cfg = Idefics3Config(
        vision_config={"hidden_size": vision_hidden, "intermediate_size": 4 * vision_hidden,
                       "num_hidden_layers": vision_layers, "num_attention_heads": vision_heads,
                       "image_size": image_size, "patch_size": patch},
        text_config=text.to_dict(), scale_factor=SCALE_FACTOR,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    model = _random_weights(Idefics3ForConditionalGeneration, cfg, seed=seed).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "knittrans_tiny.json").write_text(json.dumps({
        "architecture": "idefics3", "image_size": image_size, "patch": patch, "image_seq_len": image_seq_len,
        "vision_layers": vision_layers, "vision_hidden": vision_hidden, "layers": layers, "hidden": hidden,
        "heads": heads, "kv_heads": kv_heads, "seed": seed, "vocab": len(tok), "params": n_params, "dtype": "float32"}))
    logger.info("built tiny-vl at %s: %d params, vocab %d", out, n_params, len(tok))
    return out
