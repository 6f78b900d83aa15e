"""The Megatron-core training side: plan broadcast, per-rank fetch with prefetch, packing, GRPO loss.

Importing ``train`` needs no torch: torch and megatron-core are imported inside the functions that
use them (``pip install knittrans[train]``). The files to read first:

* ``train/__main__.py``, ``train/launch.py``: ``python -m train --config FILE``, every rank started;
* ``train/loop.py``: the loop, connect -> scan -> plan -> fetch -> step, once for every kind of step;
* ``train/trainer.py``, ``train/mm_trainer.py``: the text step and the multimodal step;
* ``train/planning.py``: rank 0's planner and the plan broadcast;
* ``train/prefetch.py``, ``train/packing.py``: background fetch and Arrow -> tensors;
* ``train/backbone.py``, ``train/loss.py``: the GPT's forward-backward, the clipped policy-gradient loss;
* ``train/model.py``, ``train/mcore_compat.py``: the Llama-shaped GPTModel, CPU/GPU setup;
* ``train/hf_llama.py``: Megatron -> HF Llama names, and weights as an Arrow table.
"""

from __future__ import annotations

from train.config import MODEL_PRESETS, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, VisionConfig

__all__ = ["MODEL_PRESETS", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VisionConfig"]
