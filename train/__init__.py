"""The Megatron-core training side: plan broadcast, per-rank fetch with prefetch, packing, GRPO loss.

Importing ``train`` needs no torch: torch and megatron-core are imported inside the functions that
use them (``pip install knittrans[train]``). The files to read first:

* ``train/trainer.py``: the loop, connect -> scan -> plan -> fetch -> step;
* ``train/planning.py``: rank 0's planner and the plan broadcast;
* ``train/prefetch.py``, ``train/packing.py``: background fetch and Arrow -> tensors;
* ``train/loss.py``: the clipped policy-gradient loss;
* ``train/model.py``, ``train/mcore_compat.py``: the Llama-shaped GPTModel, CPU/GPU setup;
* ``train/weights.py``: Megatron -> HF Llama names, and weights as an Arrow table.
"""

from __future__ import annotations

from train.config import MODEL_PRESETS, LossConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

__all__ = ["MODEL_PRESETS", "LossConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig"]
