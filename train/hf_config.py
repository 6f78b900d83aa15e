"""The shape of a Hugging Face Llama checkpoint, read from its ``config.json``: what ``ModelConfig(hf_checkpoint=DIR)``
takes, so the trainer builds the model the rollout serves (``train.config.ModelConfig``).

:func:`hf_shape` maps the ``config.json`` fields onto :data:`SHAPE_FIELDS` and refuses, naming the fields, a
checkpoint the trainer's Llama GPT cannot build (another architecture, scaled RoPE, biases, another activation).
Needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHAPE_FIELDS: tuple[str, ...] = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                 "num_query_groups", "vocab_size", "max_sequence_length", "rotary_base", "norm_epsilon",
                                 "tie_embeddings")
"""The ``train.config.ModelConfig`` fields an HF checkpoint's ``config.json`` defines."""


def read_hf_config(folder: str) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint folder; FileNotFoundError naming the folder when there is none."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        msg = f"hf_checkpoint={folder!r} has no config.json (give the HF checkpoint folder the rollout serves)"
        raise FileNotFoundError(msg)
    return dict(json.loads(path.read_text()))


def language_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama ``config.json`` of a checkpoint: its own, or a vision-language checkpoint's text model (Idefics3,
    ``train.vl_model``), whose shape is then the trainer's backbone."""
    if hf.get("model_type") != "idefics3":
        return hf
    return {**hf.get("text_config", {}), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def hf_shape(hf: dict[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The :data:`SHAPE_FIELDS` of an HF Llama ``config.json``; ValueError naming what the trainer cannot build."""
    if hf.get("architectures") != ["LlamaForCausalLM"] or hf.get("model_type", "llama") != "llama":
        msg = (f"{source}: architectures={hf.get('architectures')!r}, model_type={hf.get('model_type')!r}; "
               "the trainer builds LlamaForCausalLM checkpoints only")
        raise ValueError(msg)
    rope = hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    unsupported = {"rope_type": rope_type if rope_type != "default" else None,
                   "rope_theta": theta if theta != int(theta) else None,
                   "hidden_act": hf.get("hidden_act") if hf.get("hidden_act", "silu") != "silu" else None,
                   "attention_bias": True if hf.get("attention_bias") else None,
                   "mlp_bias": True if hf.get("mlp_bias") else None}
    bad = {k: v for k, v in unsupported.items() if v is not None}
    heads = int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, int(hf["hidden_size"]) // heads):
        bad["head_dim"] = hf["head_dim"]
    if bad:
        msg = f"{source}: the trainer's Llama GPT does not support {bad}"
        raise ValueError(msg)
    return {
        "num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
        "ffn_hidden_size": int(hf["intermediate_size"]), "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads), "vocab_size": int(hf["vocab_size"]),
        "max_sequence_length": int(hf["max_position_embeddings"]), "rotary_base": int(theta),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
