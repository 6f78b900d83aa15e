"""Megatron GPT (Llama layout) -> Hugging Face Llama tensor names; the weights table is ``schemas.weights``.

``megatron_to_hf_llama`` gathers tensor-parallel shards (a collective over the TP group: every TP
rank must call it) and renames:

=====================================================  ==========================================
Megatron (local spec / TE spec)                         HF Llama
=====================================================  ==========================================
embedding.word_embeddings.weight                        model.embed_tokens.weight
decoder.layers.N.input_layernorm.weight /               model.layers.N.input_layernorm.weight
  ...self_attention.linear_qkv.layer_norm_weight
decoder.layers.N.self_attention.linear_qkv.weight       model.layers.N.self_attn.{q,k,v}_proj.weight
decoder.layers.N.self_attention.linear_proj.weight      model.layers.N.self_attn.o_proj.weight
decoder.layers.N.pre_mlp_layernorm.weight /             model.layers.N.post_attention_layernorm.weight
  ...mlp.linear_fc1.layer_norm_weight
decoder.layers.N.mlp.linear_fc1.weight                  model.layers.N.mlp.{gate,up}_proj.weight
decoder.layers.N.mlp.linear_fc2.weight                  model.layers.N.mlp.down_proj.weight
decoder.final_layernorm.weight                          model.norm.weight
output_layer.weight                                     lm_head.weight
=====================================================  ==========================================

Layouts: ``linear_qkv`` rows are interleaved per query group, ``[q_0..q_{h/g-1}, k, v]`` for each
of the ``g`` groups (each TP rank holds ``g/tp`` whole groups); ``linear_fc1`` rows are
``[gate; up]`` *per TP rank*, so shards are split into halves before gathering. Column-parallel
weights gather along dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1.
"""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from schemas import weights
from train.config import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _gather(t: Any, dim: int, group: Any, size: int) -> Any:
    import torch
    import torch.distributed as dist

    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def megatron_to_hf_llama(model: Any) -> dict[str, Any]:
    """Full (TP-gathered) weights of a Megatron ``GPTModel`` under HF Llama names, on CPU.

    ``model`` may be wrapped (DDP / Float16Module): ``.module`` is followed down to the GPTModel.
    """
    import torch
    from megatron.core import parallel_state as ps

    gpt = model
    while hasattr(gpt, "module"):
        gpt = gpt.module
    cfg = gpt.config
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    head_dim = cfg.kv_channels
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, p in sorted(gpt.state_dict().items()):
            if not torch.is_tensor(p) or name.endswith("_extra_state"):
                continue
            t = p.detach()
            m = _LAYER.match(name)
            if name == "embedding.word_embeddings.weight":
                out["model.embed_tokens.weight"] = _gather(t, 0, group, tp)
            elif name == "output_layer.weight":
                out["lm_head.weight"] = _gather(t, 0, group, tp)
            elif name == "decoder.final_layernorm.weight":
                out["model.norm.weight"] = t
            elif m:
                i, rest = m.group(1), m.group(2)
                pre = f"model.layers.{i}."
                if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
                    out[pre + "input_layernorm.weight"] = t
                elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
                    out[pre + "post_attention_layernorm.weight"] = t
                elif rest == "self_attention.linear_qkv.weight":
                    full = _gather(t, 0, group, tp)
                    per = heads // groups
                    qkv = full.view(groups, (per + 2) * head_dim, -1)
                    hidden = qkv.shape[-1]
                    out[pre + "self_attn.q_proj.weight"] = qkv[:, : per * head_dim].reshape(heads * head_dim, hidden)
                    out[pre + "self_attn.k_proj.weight"] = (
                        qkv[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, hidden))
                    out[pre + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * head_dim:].reshape(groups * head_dim,
                                                                                                 hidden)
                elif rest == "self_attention.linear_proj.weight":
                    out[pre + "self_attn.o_proj.weight"] = _gather(t, 1, group, tp)
                elif rest == "mlp.linear_fc1.weight":
                    gate, up = t.chunk(2, dim=0)
                    out[pre + "mlp.gate_proj.weight"] = _gather(gate, 0, group, tp)
                    out[pre + "mlp.up_proj.weight"] = _gather(up, 0, group, tp)
                elif rest == "mlp.linear_fc2.weight":
                    out[pre + "mlp.down_proj.weight"] = _gather(t, 1, group, tp)
                else:
                    msg = f"no HF Llama mapping for Megatron parameter {name!r}"
                    raise KeyError(msg)
            else:
                msg = f"no HF Llama mapping for Megatron parameter {name!r}"
                raise KeyError(msg)
    return {k: v.contiguous().cpu() for k, v in out.items()}


def weights_table(named: dict[str, Any]) -> pa.Table:
    """Named tensors (e.g. :func:`megatron_to_hf_llama`'s) as the weights table (``schemas.weights``)."""
    import torch

    return weights.from_tensors(named.items(), torch)


def read_weights(table: pa.Table) -> dict[str, Any]:
    """A weights table (``schemas.weights``) as ``{name: torch tensor}``."""
    import torch

    return weights.to_tensors(table, torch)


def hf_llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``LlamaConfig`` fields (``config.json``) of a model built from ``cfg``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_epsilon, "rope_theta": float(cfg.rotary_base),
        "max_position_embeddings": cfg.max_sequence_length, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": cfg.dtype,
    }
