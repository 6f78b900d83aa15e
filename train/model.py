"""Build the Llama-architecture Megatron ``GPTModel``, wrap it for data parallelism, and checkpoint it.

One path on CPU and GPU: Megatron DDP + the Megatron optimizer (DDP keeps gradients in
``.main_grad``, which only the Megatron optimizer reads), ``finalize_model_grads`` hooked into the
config so ``get_forward_backward_func`` all-reduces and scales gradients by the global token count
(``calculate_per_token_loss``: the loss is a token mean over the whole mini-batch, all DP ranks).
Checkpoints go through Megatron's dist checkpointing (sharded, TP-agnostic layout).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from train.config import ModelConfig, OptimConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Built:
    """The wrapped model, its unwrapped ``GPTModel``, the optimizer and the Megatron config."""

    model: Any
    """Megatron DDP wrapper (what the schedule runs)."""
    gpt: Any
    """The underlying ``GPTModel``."""
    optimizer: Any
    """Megatron optimizer."""
    config: Any
    """``TransformerConfig``."""
    uses_te: bool = False
    """Built with the TransformerEngine layer spec (packed rows then use TE's ``PackedSeqParams``)."""


def _use_te(cfg: ModelConfig) -> bool:
    if cfg.spec == "local":
        return False
    import importlib.util

    has_te = importlib.util.find_spec("transformer_engine") is not None
    if cfg.spec == "te" and not has_te:
        msg = "ModelConfig.spec='te' but transformer_engine is not installed"
        raise ImportError(msg)
    from train.mcore_compat import cuda_available

    return has_te and cuda_available()


def transformer_config(cfg: ModelConfig, *, tensor_parallel: int) -> Any:
    """Megatron ``TransformerConfig`` of a Llama-architecture model (dropout 0: RL needs exact logprobs)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from train.mcore_compat import cuda_available

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if dtype is torch.bfloat16 and not cuda_available():
        msg = "ModelConfig.dtype='bfloat16' needs a GPU; use float32 on CPU"
        raise ValueError(msg)
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype is torch.bfloat16,
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=not cuda_available(),
        calculate_per_token_loss=True,
    )


def build_gpt(cfg: ModelConfig, *, tensor_parallel: int) -> tuple[Any, Any]:
    """The bare ``GPTModel`` (Llama layout) and its ``TransformerConfig``; with ``cfg.hf_checkpoint`` its weights
    are that checkpoint's (this rank's tensor-parallel shards of them), else a seeded random init."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.vocab_size % tensor_parallel:
        msg = f"vocab_size={cfg.vocab_size} must be divisible by tensor_parallel={tensor_parallel}"
        raise ValueError(msg)
    if cfg.num_query_groups % tensor_parallel:
        msg = f"num_query_groups={cfg.num_query_groups} must be divisible by tensor_parallel={tensor_parallel}"
        raise ValueError(msg)
    tcfg = transformer_config(cfg, tensor_parallel=tensor_parallel)
    if _use_te(cfg):
        spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    gpt = GPTModel(
        config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings, position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
    )
    from train.mcore_compat import cuda_available

    if cuda_available():
        import torch

        gpt.cuda(torch.cuda.current_device())
    if cfg.hf_checkpoint is not None:
        from train.hf_llama import load_hf_checkpoint

        load_hf_checkpoint(gpt, cfg.hf_checkpoint)
    return gpt, tcfg


def build(cfg: ModelConfig, optim: OptimConfig, *, tensor_parallel: int) -> Built:
    """GPTModel -> Megatron DDP -> Megatron optimizer (:func:`wrap`)."""
    gpt, tcfg = build_gpt(cfg, tensor_parallel=tensor_parallel)
    return wrap(gpt, tcfg, optim, uses_te=_use_te(cfg))


def wrap(gpt: Any, tcfg: Any, optim: OptimConfig, *, uses_te: bool = False) -> Built:
    """A Megatron module (``GPTModel``, ``LLaVAModel``) of config ``tcfg`` -> Megatron DDP -> Megatron optimizer,
    with gradient finalisation in the schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    inner = gpt
    if tcfg.bf16:  # GPU only: bf16 params, fp32 main params in the optimizer
        from megatron.core.transformer.module import Float16Module

        inner = Float16Module(tcfg, gpt)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    model = DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=inner)
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = model.no_sync
    ocfg = OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
                           adam_beta2=optim.adam_beta2, clip_grad=optim.clip_grad, bf16=tcfg.bf16, fp16=False,
                           use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(ocfg, [model])
    return Built(model=model, gpt=gpt, optimizer=optimizer, config=tcfg, uses_te=uses_te)


def save_checkpoint(gpt: Any, path: str) -> None:
    """Write ``gpt``'s weights as a Megatron dist checkpoint (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(gpt.sharded_state_dict(prefix=""), path)
    log.info("saved dist checkpoint to %s", path)


def load_checkpoint(gpt: Any, path: str) -> None:
    """Load a dist checkpoint written by ``save_checkpoint`` into ``gpt`` (any TP layout; collective)."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        msg = f"checkpoint folder {path!r} does not exist"
        raise FileNotFoundError(msg)
    state = dist_checkpointing.load(gpt.sharded_state_dict(prefix=""), path)
    gpt.load_state_dict(state)
    log.info("loaded dist checkpoint from %s", path)
