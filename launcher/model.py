"""The model both sides of ``knit run`` share: a checkpoint folder vLLM serves and the trainer's shape.

The tiny Llama is built once per folder (``connectors.tiny_model``, in a separate process: the
driver never imports torch) with exactly the trainer's shape (the ``tiny-vllm`` preset: vLLM's CPU
attention needs ``head_dim >= 32``); the trainer's :class:`~train.config.ModelConfig` is then read
back from the folder's ``config.json`` and checked field by field against what vLLM will run, so the
two sides cannot disagree.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

from connectors.tiny_model import build_tiny_llama
from train.config import ModelConfig
from train.weights import hf_llama_config

MODEL_PRESET = "tiny-vllm"
"""The trainer's shape in ``knit run`` (its vocabulary comes from the tokenizer)."""
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings")
"""The ``config.json`` fields that must equal the trainer's."""


def trainer_model(vocab_size: int) -> ModelConfig:
    """The trainer's model: the ``tiny-vllm`` preset with the tokenizer's vocabulary."""
    cfg = ModelConfig.preset(MODEL_PRESET)
    cfg.vocab_size = vocab_size
    return cfg


def check_shapes(hf_config: dict[str, Any], model: ModelConfig) -> None:
    """Raise ValueError naming every field where the HF Llama config (what vLLM runs) differs from ``model``."""
    want = hf_llama_config(model)
    bad = [f"{k}: vLLM {hf_config.get(k)!r} vs trainer {want[k]!r}" for k in SHAPE_KEYS
           if hf_config.get(k, 10000.0 if k == "rope_theta" else None) != want[k]]
    if hf_config.get("architectures") != ["LlamaForCausalLM"]:
        bad.append(f"architectures: {hf_config.get('architectures')!r}")
    if bad:
        msg = "the rollout model and the trainer model differ: " + "; ".join(bad)
        raise ValueError(msg)


def prepare_model(model_dir: Path, *, seed: int = 0) -> ModelConfig:
    """Build the tiny Llama of the trainer's shape at ``model_dir`` (once); returns the trainer's config."""
    tiny = ModelConfig.preset(MODEL_PRESET)
    if not (model_dir / "config.json").exists():
        kwargs = {"layers": tiny.num_layers, "hidden": tiny.hidden_size, "heads": tiny.num_attention_heads,
                  "kv_heads": tiny.num_query_groups, "intermediate": tiny.ffn_hidden_size, "vocab": tiny.vocab_size,
                  "max_positions": tiny.max_sequence_length, "seed": seed}
        builder = multiprocessing.get_context("spawn").Process(target=build_tiny_llama, args=(str(model_dir),),
                                                              kwargs=kwargs, name="knit-build-model")
        builder.start()
        builder.join(timeout=300)
        if builder.exitcode != 0:
            builder.kill()
            msg = f"building the tiny Llama at {model_dir} failed (exit {builder.exitcode})"
            raise RuntimeError(msg)
    hf = json.loads((model_dir / "config.json").read_text())
    model = trainer_model(int(hf["vocab_size"]))
    check_shapes(hf, model)
    return model
