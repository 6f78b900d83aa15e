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

import dataclasses
import re
from collections.abc import Callable
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


_TOP: dict[str, tuple[str, bool]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", True),
    "output_layer.weight": ("lm_head.weight", True),
    "decoder.final_layernorm.weight": ("model.norm.weight", False),
}
"""Megatron parameters outside the layers -> (HF name, split along dim 0 across tensor-parallel ranks)."""
_INPUT_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
"""A layer's input norm under the local spec / the TE spec (fused into the QKV projection)."""
_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
"""A layer's pre-MLP norm under the local spec / the TE spec (fused into the first MLP projection)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Attention:
    """A GPT's attention shape: query heads, key/value groups, channels per head."""

    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, cfg: Any) -> _Attention:
        return cls(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels)

    @property
    def per_group(self) -> int:
        """Query heads per key/value group."""
        return self.heads // self.groups


def _unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (``.module`` followed down)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _layer_to_hf(rest: str, t: Any, att: _Attention, gather: Callable[[Any, int], Any]) -> dict[str, Any] | None:
    """HF tensors (names after ``model.layers.N.``) of one layer's Megatron parameter ``rest`` (``None``: no
    mapping). ``gather(t, dim)`` joins the tensor-parallel shards along ``dim``."""
    if rest in _INPUT_NORM:
        return {"input_layernorm.weight": t}
    if rest in _MLP_NORM:
        return {"post_attention_layernorm.weight": t}
    if rest == "self_attention.linear_qkv.weight":  # [q.., k, v] per query group
        qkv = gather(t, 0).view(att.groups, (att.per_group + 2) * att.head_dim, -1)
        hidden = qkv.shape[-1]
        q_end, k_end = att.per_group * att.head_dim, (att.per_group + 1) * att.head_dim
        return {"self_attn.q_proj.weight": qkv[:, :q_end].reshape(att.heads * att.head_dim, hidden),
                "self_attn.k_proj.weight": qkv[:, q_end:k_end].reshape(att.groups * att.head_dim, hidden),
                "self_attn.v_proj.weight": qkv[:, k_end:].reshape(att.groups * att.head_dim, hidden)}
    if rest == "self_attention.linear_proj.weight":
        return {"self_attn.o_proj.weight": gather(t, 1)}
    if rest == "mlp.linear_fc1.weight":  # [gate; up] per TP rank
        gate, up = t.chunk(2, dim=0)
        return {"mlp.gate_proj.weight": gather(gate, 0), "mlp.up_proj.weight": gather(up, 0)}
    if rest == "mlp.linear_fc2.weight":
        return {"mlp.down_proj.weight": gather(t, 1)}
    return None


def megatron_to_hf_llama(model: Any) -> dict[str, Any]:
    """Full (TP-gathered) weights of a Megatron ``GPTModel`` under HF Llama names, on CPU.

    ``model`` may be wrapped (DDP / Float16Module): ``.module`` is followed down to the GPTModel.
    """
    import torch
    from megatron.core import parallel_state as ps

    gpt = _unwrap(model)
    att = _Attention.of(gpt.config)
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()

    def gather(t: Any, dim: int) -> Any:
        return _gather(t, dim, group, tp)

    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, p in sorted(gpt.state_dict().items()):
            if not torch.is_tensor(p) or name.endswith("_extra_state"):
                continue
            t, m = p.detach(), _LAYER.match(name)
            layer = _layer_to_hf(m.group(2), t, att, gather) if m else None
            if name in _TOP:
                hf_name, split = _TOP[name]
                out[hf_name] = gather(t, 0) if split else t
            elif m and layer is not None:
                out.update({f"model.layers.{m.group(1)}.{k}": v for k, v in layer.items()})
            else:
                msg = f"no HF Llama mapping for Megatron parameter {name!r}"
                raise KeyError(msg)
    return {k: v.contiguous().cpu() for k, v in out.items()}


class CheckpointMismatchError(ValueError):
    """An HF checkpoint whose tensors do not fit the Megatron GPT built for it (names or shapes)."""


def _hf_to_layer(rest: str, pre: str, take: Callable[[str], Any], shard: Callable[[Any, int], Any],
                 att: _Attention) -> Any:
    """This TP rank's tensor of one layer's Megatron parameter ``rest`` from the HF tensors under ``pre``
    (``model.layers.N.``), or ``None`` when there is no mapping; ``shard(t, dim)``: this rank's part."""
    import torch

    if rest in _INPUT_NORM:
        return take(pre + "input_layernorm.weight")
    if rest in _MLP_NORM:
        return take(pre + "post_attention_layernorm.weight")
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (take(pre + f"self_attn.{x}_proj.weight") for x in "qkv")
        hidden = q.shape[-1]
        qkv = torch.cat([q.reshape(att.groups, att.per_group * att.head_dim, hidden),
                         k.reshape(att.groups, att.head_dim, hidden),
                         v.reshape(att.groups, att.head_dim, hidden)], dim=1)  # [q.., k, v] per query group
        return shard(qkv.reshape(-1, hidden), 0)
    if rest == "self_attention.linear_proj.weight":
        return shard(take(pre + "self_attn.o_proj.weight"), 1)
    if rest == "mlp.linear_fc1.weight":
        gate, up = take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")
        return torch.cat([shard(gate, 0), shard(up, 0)])  # [gate; up] per TP rank
    if rest == "mlp.linear_fc2.weight":
        return shard(take(pre + "mlp.down_proj.weight"), 1)
    return None


def tensor_taker(hf: dict[str, Any], used: set[str], model: str) -> Callable[[str], Any]:
    """``take(name)``: ``hf[name]``, the name recorded in ``used``; a name ``hf`` lacks is a
    :class:`CheckpointMismatchError` saying ``model`` needs it."""

    def take(name: str) -> Any:
        if name not in hf:
            msg = f"the HF checkpoint has no tensor {name!r} ({model} needs it)"
            raise CheckpointMismatchError(msg)
        used.add(name)
        return hf[name]

    return take


def hf_llama_to_megatron(hf: dict[str, Any], gpt: Any) -> dict[str, Any]:
    """This tensor-parallel rank's Megatron tensors of the HF Llama weights ``hf`` (the inverse of
    :func:`megatron_to_hf_llama`), keyed by ``gpt``'s state-dict names.

    ``lm_head.weight`` is not needed when the GPT ties its output layer to the embedding (it is the same
    tensor). Raises :class:`CheckpointMismatchError` naming the tensors that are missing, unused, or of another
    shape than the GPT's.
    """
    import torch
    from megatron.core import parallel_state as ps

    gpt = _unwrap(gpt)
    att = _Attention.of(gpt.config)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def shard(t: Any, dim: int) -> Any:
        return t.chunk(tp, dim=dim)[rank] if tp > 1 else t

    used: set[str] = set()
    take = tensor_taker(hf, used, "the GPT")
    out: dict[str, Any] = {}
    for name, param in gpt.state_dict().items():
        if not torch.is_tensor(param) or name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if name in _TOP:
            hf_name, split = _TOP[name]
            t = shard(take(hf_name), 0) if split else take(hf_name)
        else:
            t = _hf_to_layer(m.group(2), f"model.layers.{m.group(1)}.", take, shard, att) if m else None
        if t is None:
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


def save_hf_checkpoint(model: Any, folder: str, cfg: ModelConfig, *, write: bool) -> None:
    """Write ``model``'s weights as an HF Llama checkpoint folder: ``model.safetensors`` (:func:`megatron_to_hf_llama`)
    and the other files of ``cfg.hf_checkpoint`` (config, tokenizer), or a ``config.json`` of ``cfg``'s shape
    (:func:`hf_llama_config`) when the model was not made from one. Collective (the tensor-parallel gather): every
    rank calls it, the one with ``write`` writes."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    named = megatron_to_hf_llama(model)
    if not write:
        return
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.hf_checkpoint is not None:
        for src in Path(cfg.hf_checkpoint).iterdir():
            if src.is_file() and not src.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(src, out / src.name)
    else:
        (out / "config.json").write_text(json.dumps(hf_llama_config(cfg), indent=1))
    save_file({k: v.clone() for k, v in named.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


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
