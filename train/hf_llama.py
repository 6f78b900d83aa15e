"""Megatron GPT (Llama layout) <-> Hugging Face Llama tensor names; the weights table is ``schemas.weights``.

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

With tied embeddings (``ModelConfig.tie_embeddings``) the GPT has no ``output_layer.weight`` and
no ``lm_head.weight`` is published (HF and vLLM tie it to ``model.embed_tokens.weight``).
:func:`hf_llama_to_megatron` / :func:`load_hf_checkpoint` go the other way: an HF checkpoint folder's
safetensors into this rank's shards of the GPT.

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


class CheckpointMismatchError(ValueError):
    """An HF checkpoint whose tensors do not fit the Megatron GPT built for it (names or shapes)."""


def hf_llama_to_megatron(hf: dict[str, Any], gpt: Any) -> dict[str, Any]:
    """This tensor-parallel rank's Megatron tensors of the HF Llama weights ``hf`` (the inverse of
    :func:`megatron_to_hf_llama`), keyed by ``gpt``'s state-dict names.

    ``lm_head.weight`` is not needed when the GPT ties its output layer to the embedding (it is the same
    tensor). Raises :class:`CheckpointMismatchError` naming the tensors that are missing, unused, or of another
    shape than the GPT's.
    """
    from megatron.core import parallel_state as ps

    while hasattr(gpt, "module"):
        gpt = gpt.module
    cfg = gpt.config
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    head_dim, per = cfg.kv_channels, heads // groups

    def shard(t: Any, dim: int) -> Any:
        return t.chunk(tp, dim=dim)[rank] if tp > 1 else t

    used: set[str] = set()

    def take(name: str) -> Any:
        if name not in hf:
            msg = f"the HF checkpoint has no tensor {name!r} (the GPT needs it)"
            raise CheckpointMismatchError(msg)
        used.add(name)
        return hf[name]

    out: dict[str, Any] = {}
    import torch

    for name, param in gpt.state_dict().items():
        if not torch.is_tensor(param) or name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if name == "embedding.word_embeddings.weight":
            t = shard(take("model.embed_tokens.weight"), 0)
        elif name == "output_layer.weight":
            t = shard(take("lm_head.weight"), 0)
        elif name == "decoder.final_layernorm.weight":
            t = take("model.norm.weight")
        elif m:
            pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
            if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
                t = take(pre + "input_layernorm.weight")
            elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
                t = take(pre + "post_attention_layernorm.weight")
            elif rest == "self_attention.linear_qkv.weight":
                q, k, v = (take(pre + f"self_attn.{x}_proj.weight") for x in "qkv")
                hidden = q.shape[-1]
                qkv = torch.cat([q.reshape(groups, per * head_dim, hidden), k.reshape(groups, head_dim, hidden),
                                 v.reshape(groups, head_dim, hidden)], dim=1)  # [q.., k, v] per query group
                t = shard(qkv.reshape(-1, hidden), 0)
            elif rest == "self_attention.linear_proj.weight":
                t = shard(take(pre + "self_attn.o_proj.weight"), 1)
            elif rest == "mlp.linear_fc1.weight":
                gate, up = take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")
                t = torch.cat([shard(gate, 0), shard(up, 0)])  # [gate; up] per TP rank
            elif rest == "mlp.linear_fc2.weight":
                t = shard(take(pre + "mlp.down_proj.weight"), 1)
            else:
                msg = f"no HF Llama mapping for Megatron parameter {name!r}"
                raise CheckpointMismatchError(msg)
        else:
            msg = f"no HF Llama mapping for Megatron parameter {name!r}"
            raise CheckpointMismatchError(msg)
        if tuple(t.shape) != tuple(param.shape):
            msg = f"Megatron {name!r} has shape {tuple(param.shape)}, the HF checkpoint gives {tuple(t.shape)}"
            raise CheckpointMismatchError(msg)
        out[name] = t
    unused = sorted(set(hf) - used - ({"lm_head.weight"} if "output_layer.weight" not in out else set()))
    if unused:
        msg = f"the HF checkpoint has tensors the GPT does not use: {unused[:5]}{' ...' if len(unused) > 5 else ''}"
        raise CheckpointMismatchError(msg)
    return out


def read_hf_weights(folder: str) -> dict[str, Any]:
    """Every tensor of an HF checkpoint folder's safetensors (one file or an index of shards), on CPU."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(folder)
    index = root / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else [p.name for p in sorted(root.glob("*.safetensors"))])
    if not files:
        msg = f"hf_checkpoint={folder!r} holds no safetensors weights"
        raise FileNotFoundError(msg)
    out: dict[str, Any] = {}
    for name in files:
        out.update(load_file(str(root / name), device="cpu"))
    return out


def load_hf_checkpoint(gpt: Any, folder: str) -> None:
    """Copy an HF Llama checkpoint's weights into ``gpt`` (this rank's shards; cast to the parameters' dtype)."""
    import torch

    tensors = hf_llama_to_megatron(read_hf_weights(folder), gpt)
    while hasattr(gpt, "module"):
        gpt = gpt.module
    state = gpt.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            state[name].copy_(t)


def weights_table(named: dict[str, Any], *, dtype: str | None = None) -> pa.Table:
    """Named tensors (e.g. :func:`megatron_to_hf_llama`'s) as the weights table (``schemas.weights``), floating
    tensors cast to ``dtype`` when given, in record batches of ``schemas.weights.CHUNK_BYTES``."""
    import torch

    return weights.from_tensors(named.items(), torch, dtype=dtype)


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
        "max_position_embeddings": cfg.max_sequence_length, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": cfg.dtype,
    }
