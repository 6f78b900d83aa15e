"""The vision-language model in the trainer: Megatron-core's ``LLaVAModel`` built from an Idefics3 folder
(``tiny-vl``, :mod:`connectors.tiny_vl`), with its weights under Hugging Face names both ways.

The pieces and their Megatron counterparts:

=====================================================  ==========================================================
Megatron ``LLaVAModel``                                 HF Idefics3
=====================================================  ==========================================================
``vision_model`` (``CLIPViTModel``, subtype siglip)     ``model.vision_model`` (SigLIP tower)
``vision_model.conv1.{weight,bias}``                    ``...embeddings.patch_embedding.{weight,bias}``
``vision_model.position_embeddings.weight``             ``...embeddings.position_embedding.weight``
``vision_model.decoder.layers.N.input_layernorm.*``     ``...encoder.layers.N.layer_norm1.*``
``...layers.N.self_attention.linear_qkv.*``             ``...self_attn.{q,k,v}_proj.*``, per head ``[q; k; v]``
``...layers.N.self_attention.linear_proj.*``            ``...self_attn.out_proj.*``
``...layers.N.pre_mlp_layernorm.*``                     ``...layer_norm2.*``
``...layers.N.mlp.linear_fc{1,2}.*``                    ``...mlp.fc{1,2}.*``
``vision_model.ln_post.*``                              ``model.vision_model.post_layernorm.*``
``pixel_shuffle`` (2x2 patches -> 1 token)              ``model.connector``'s pixel shuffle (the same permutation)
``vision_projection.encoder.weight`` (affine)           ``model.connector.modality_projection.proj.weight``
``language_model`` (``GPTModel``)                       ``model.text_model.*`` and ``lm_head.weight``, as the Llama
                                                        of :mod:`train.hf_llama` under ``model.text_model.``
=====================================================  ==========================================================

The tower's attention is bidirectional (Megatron's local ViT spec is causal: :func:`vit_layer_spec` changes
the mask), its MLP is tanh-approximated GELU and its norms LayerNorms with biases. ``LLaVAModel`` takes one image
token per image and puts the image's tokens there; HF and vLLM write each image as ``image_seq_len`` image
tokens, which :func:`collapse_image_tokens` turns into one. One tensor-parallel rank (the tower is not split).

The self-check (the weights both ways, logits and gradients against transformers, the tower once per distinct
image) is :mod:`train.vl_check`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from train.hf_llama import (
    CheckpointMismatchError,
    hf_llama_to_megatron,
    megatron_to_hf_llama,
    read_hf_weights,
    tensor_taker,
)

TEXT, TOWER = "model.text_model.", "model.vision_model."
PROJECTOR = "model.connector.modality_projection.proj.weight"
_TOWER_TOP = {
    "conv1.weight": "embeddings.patch_embedding.weight", "conv1.bias": "embeddings.patch_embedding.bias",
    "position_embeddings.weight": "embeddings.position_embedding.weight",
    "ln_post.weight": "post_layernorm.weight", "ln_post.bias": "post_layernorm.bias",
}
"""``vision_model.`` parameters outside the layers -> names under ``model.vision_model.``."""
_TOWER_LAYER = {
    "input_layernorm": "layer_norm1", "pre_mlp_layernorm": "layer_norm2", "self_attention.linear_proj":
    "self_attn.out_proj", "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2",
}
"""A tower layer's modules (Megatron -> HF), ``linear_qkv`` apart."""


def is_vl_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds an Idefics3 model (this module's), not a plain Llama."""
    path = Path(folder) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("model_type") == "idefics3"


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's ``config.json``, checked to be the Idefics3 shape this module maps."""
    cfg: dict[str, Any] = json.loads((Path(folder) / "config.json").read_text())
    vc = cfg.get("vision_config", {})
    problems = [f"{k}={v!r}" for k, v, ok in (
        ("model_type", cfg.get("model_type"), cfg.get("model_type") == "idefics3"),
        ("scale_factor", cfg.get("scale_factor"), cfg.get("scale_factor") == 2),  # Megatron's shuffle is 2x2
        ("vision_config.hidden_act", vc.get("hidden_act"), vc.get("hidden_act") == "gelu_pytorch_tanh"),
    ) if not ok]
    if problems:
        msg = f"{folder}: not an Idefics3 model this trainer maps ({', '.join(problems)})"
        raise CheckpointMismatchError(msg)
    return cfg


def vit_layer_spec(*, causal: bool = False) -> Any:
    """Megatron's local ViT layer spec with bidirectional attention (``causal`` keeps the upstream mask)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = get_vit_layer_with_local_spec()
    if not causal:
        spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    return spec


def build_vl_model(cfg: dict[str, Any], *, causal_tower: bool = False) -> Any:
    """``LLaVAModel`` of the Idefics3 config ``cfg`` (:func:`read_config`), fp32, random weights.

    Megatron's model-parallel state must be initialised (``train.mcore_compat.init_distributed``).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from train.mcore_compat import apply_vit_norm_patch, cuda_available

    apply_vit_norm_patch()
    tc, vc = cfg["text_config"], cfg["vision_config"]
    common: dict[str, Any] = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "params_dtype": torch.float32,
                              "pipeline_dtype": torch.float32, "use_cpu_initialization": not cuda_available()}
    text = TransformerConfig(
        num_layers=tc["num_hidden_layers"], hidden_size=tc["hidden_size"], ffn_hidden_size=tc["intermediate_size"],
        num_attention_heads=tc["num_attention_heads"], num_query_groups=tc["num_key_value_heads"],
        kv_channels=tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"], normalization="RMSNorm",
        layernorm_epsilon=tc["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, add_bias_linear=False, add_qkv_bias=False, calculate_per_token_loss=True,
        **common)
    tower = TransformerConfig(
        num_layers=vc["num_hidden_layers"], hidden_size=vc["hidden_size"], ffn_hidden_size=vc["intermediate_size"],
        num_attention_heads=vc["num_attention_heads"], kv_channels=vc["hidden_size"] // vc["num_attention_heads"],
        normalization="LayerNorm", layernorm_epsilon=vc["layer_norm_eps"],
        activation_func=partial(F.gelu, approximate="tanh"), bias_activation_fusion=False, gated_linear_unit=False,
        add_bias_linear=True, **common)
    tower.vision_model_type = "siglip"  # read by LLaVAModel; not a TransformerConfig field
    projector = TransformerConfig(num_layers=1, hidden_size=tc["hidden_size"], num_attention_heads=1,
                                  add_bias_linear=False, **common)
    rope = tc.get("rope_parameters") or {}
    model = LLaVAModel(
        language_transformer_config=text,
        language_transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        language_vocab_size=tc["vocab_size"], language_max_sequence_length=tc["max_position_embeddings"],
        vision_transformer_config=tower, vision_transformer_layer_spec=vit_layer_spec(causal=causal_tower),
        drop_vision_class_token=False, vision_projection_config=projector,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        vision_projection_type="affine", parallel_output=True,  # one TP rank: the whole vocabulary
        share_embeddings_and_output_weights=bool(tc.get("tie_word_embeddings", False)),
        language_position_embedding_type="rope", language_rotary_base=int(rope.get("rope_theta", 10000)),
        img_h=vc["image_size"], img_w=vc["image_size"], patch_dim=vc["patch_size"],
        image_token_index=cfg["image_token_id"], pixel_shuffle=True)
    model.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask of a model (its get_model sets it)
    return model


def _heads(model: Any) -> tuple[int, int]:
    c = model.vision_model.config
    return c.num_attention_heads, c.kv_channels


def hf_to_megatron_vl(hf: dict[str, Any], model: Any) -> dict[str, Any]:
    """``model``'s state-dict tensors of the HF Idefics3 weights ``hf``; raises :class:`CheckpointMismatchError`
    naming what is missing, left over or of another shape."""
    import torch

    text = {"model." + k[len(TEXT):]: v for k, v in hf.items() if k.startswith(TEXT)}
    if "lm_head.weight" in hf:
        text["lm_head.weight"] = hf["lm_head.weight"]
    out = {"language_model." + k: v for k, v in hf_llama_to_megatron(text, model.language_model).items()}
    used = {k for k in hf if k.startswith(TEXT) or k == "lm_head.weight"}
    take = tensor_taker(hf, used, "the vision-language model")

    heads, head_dim = _heads(model)
    for name in model.state_dict():
        if name.startswith("language_model.") or name.endswith("_extra_state"):
            continue
        rest = name.removeprefix("vision_model.")
        if name == "vision_projection.encoder.weight":
            out[name] = take(PROJECTOR)
        elif rest in _TOWER_TOP:
            out[name] = take(TOWER + _TOWER_TOP[rest])
        elif rest.startswith("decoder.layers.") and ".self_attention.linear_qkv." in rest:
            layer, kind = rest.split(".")[2], rest.rsplit(".", 1)[1]
            q, k, v = (take(f"{TOWER}encoder.layers.{layer}.self_attn.{x}_proj.{kind}") for x in "qkv")
            out[name] = torch.cat([t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(
                3 * heads * head_dim, *q.shape[1:])
        elif rest.startswith("decoder.layers."):
            _, _, layer, *module, kind = rest.split(".")
            out[name] = take(f"{TOWER}encoder.layers.{layer}.{_TOWER_LAYER['.'.join(module)]}.{kind}")
        else:
            msg = f"no HF Idefics3 mapping for Megatron parameter {name!r}"
            raise CheckpointMismatchError(msg)
    state = model.state_dict()
    wrong = [f"{n}: {tuple(t.shape)} vs {tuple(state[n].shape)}" for n, t in out.items()
             if tuple(t.shape) != tuple(state[n].shape)]
    unused = sorted(set(hf) - used)
    if wrong or unused:
        msg = f"the HF checkpoint does not fit the model: shapes {wrong[:3]}, unused tensors {unused[:5]}"
        raise CheckpointMismatchError(msg)
    return out


def megatron_to_hf_vl(model: Any) -> dict[str, Any]:
    """The weights of ``model`` under HF Idefics3 names, on CPU (the inverse of :func:`hf_to_megatron_vl`); those
    stored alike on both sides are views of the parameters, not copies."""
    import torch

    out = {(TEXT + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in megatron_to_hf_llama(model.language_model).items()}
    heads, head_dim = _heads(model)
    state = model.state_dict()
    with torch.no_grad():
        out[PROJECTOR] = state["vision_projection.encoder.weight"].detach()
        for rest, hf_rest in _TOWER_TOP.items():
            out[TOWER + hf_rest] = state["vision_model." + rest].detach()
        for i in range(model.vision_model.config.num_layers):
            src, dst = f"vision_model.decoder.layers.{i}.", f"{TOWER}encoder.layers.{i}."
            for kind in ("weight", "bias"):
                for mod, hf_mod in _TOWER_LAYER.items():
                    out[f"{dst}{hf_mod}.{kind}"] = state[f"{src}{mod}.{kind}"].detach()
                qkv = state[f"{src}self_attention.linear_qkv.{kind}"].detach()
                q, k, v = qkv.reshape(heads, 3 * head_dim, *qkv.shape[1:]).split(head_dim, dim=1)
                for x, t in zip("qkv", (q, k, v), strict=True):
                    out[f"{dst}self_attn.{x}_proj.{kind}"] = t.reshape(heads * head_dim, *qkv.shape[1:])
    return {k: v.contiguous().cpu() for k, v in out.items()}


def load_hf_vl_checkpoint(model: Any, folder: str | Path) -> None:
    """Copy an Idefics3 folder's weights into ``model`` (cast to the parameters' dtype)."""
    load_hf_vl_checkpoint_tensors(model, read_hf_weights(str(folder)))


def load_hf_vl_checkpoint_tensors(model: Any, hf: dict[str, Any]) -> None:
    """Copy Idefics3 tensors under HF names (a folder's, or a published version's) into ``model``."""
    import torch

    tensors = hf_to_megatron_vl(hf, model)
    state = model.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            state[name].copy_(t)


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of image tokens (one image, as HF and vLLM write it) made one, as ``LLaVAModel``
    takes it."""
    return [t for i, t in enumerate(ids) if not (t == image_token_id and i and ids[i - 1] == image_token_id)]


def vl_logits(model: Any, ids: Sequence[int], pixel_values: Any, image_token_id: int) -> Any:
    """``[1, len(ids), vocab]`` logits of one sequence written as HF writes it, with its images' pixels
    ``[images, 3, H, W]`` (the processor's, in order)."""
    import torch

    return llava_logits(model, torch.tensor([collapse_image_tokens(list(ids), image_token_id)]), pixel_values,
                    pixel_values.shape[0])


def llava_logits(model: Any, ids: Any, images: Any, n_images: int) -> Any:
    """``LLaVAModel``'s logits of ``ids`` (``[rows, length]``, one image token per image) with ``images`` (pixels,
    or None on the decoder-only path), one tile an image."""
    import torch

    logits, _ = model(images=images, input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                      attention_mask=None, num_image_tiles=torch.ones(n_images, dtype=torch.int))
    return logits


def encode_images(model: Any, pixels: Any) -> Any:
    """The images' tokens in the backbone's width, ``[images, image_seq_len, hidden]``: the tower, the 2x2 merge
    and the projector of ``model``, as ``LLaVAModel.forward`` runs them. The encoder of
    :class:`train.multimodal.DedupVisionEncoder`, which runs it once per distinct image of a mini-batch."""
    from megatron.core.models.multimodal.llava_model import pixel_shuffle

    x = pixel_shuffle(model.vision_model(pixels)).permute(1, 0, 2).contiguous()
    return model.vision_projection(x).permute(1, 0, 2)


def image_positions(tokens: Any, image_token_id: int, image_tokens: Sequence[int], cu_seqlens: Any = None) -> Any:
    """``[rows, width]`` bool: the positions that take an image's tokens, the first ``image_tokens[i]`` image-token
    ids of each sequence ``i`` (its prompt's: a response that samples the image token's id keeps it as text, as the
    engine does). Sequences are the rows, or the ``cu_seqlens`` segments of one packed row. ValueError naming the
    sequence that holds fewer image tokens than its images fill."""
    import torch

    marks = tokens == image_token_id
    want = torch.as_tensor(list(image_tokens), device=tokens.device)
    if cu_seqlens is None:
        seen = marks.cumsum(dim=1)
        where = marks & (seen <= want[:, None])
        counts = where.sum(dim=1)
    else:
        cu = cu_seqlens.to(torch.int64)
        seq = torch.bucketize(torch.arange(tokens.shape[1], device=cu.device), cu[1:], right=True)
        seq = seq.clamp(max=len(want) - 1)
        seen = marks[0].cumsum(0)
        before = torch.cat([seen.new_zeros(1), seen])[cu[:-1]]  # image tokens of the sequences before each one
        where = (marks[0] & (seen - before[seq] <= want[seq]))[None]
        counts = torch.zeros_like(want).index_add(0, seq[where[0]], torch.ones_like(seq[where[0]]))
    short = (counts != want).nonzero()
    if len(short):
        i = int(short[0])
        msg = f"sequence {i} holds {int(counts[i])} image tokens where its images fill {int(want[i])}"
        raise ValueError(msg)
    return where


def merged_embeddings(model: Any, tokens: Any, position_ids: Any, image_tokens: Any, images_per_seq: Sequence[int],
                      image_token_id: int, cu_seqlens: Any = None) -> Any:
    """The backbone's input ``[width, rows, hidden]`` for ``tokens`` written as HF and vLLM write them (each image
    as ``image_seq_len`` image tokens): the token embeddings, with the images' tokens ``[images, image_seq_len,
    hidden]`` (:func:`encode_images`, in the sequences' order) at :func:`image_positions`. What Idefics3 and vLLM
    do; ``LLaVAModel.forward`` gives the same logits from one image token per image (the self-check compares
    them). The decoder runs on it as ``model.language_model(..., decoder_input=...)``."""
    lm = model.language_model
    emb = lm.embedding(input_ids=tokens, position_ids=position_ids)
    per_seq = [n * image_tokens.shape[1] for n in images_per_seq]
    rows, cols = image_positions(tokens, image_token_id, per_seq, cu_seqlens).nonzero(as_tuple=True)
    return emb.index_put((cols, rows), image_tokens.reshape(-1, emb.shape[-1]).to(emb.dtype))
