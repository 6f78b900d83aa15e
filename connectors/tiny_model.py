"""A tiny, randomly initialised Llama and a locally trained tokenizer, built offline for tests and demos.

The architecture is the one the trainer mirrors for weight sync: Llama (RMSNorm, SwiGLU MLP, RoPE,
grouped-query attention, untied input/output embeddings). Nothing is downloaded: the byte-level BPE
tokenizer is trained on a small synthetic corpus (words, digits and arithmetic prompts, so the built-in
tasks of ``connectors.tasks`` tokenize compactly), and the weights come from a seeded random init.

Needs ``torch``, ``transformers`` and ``tokenizers`` (all pulled in by ``pip install knittrans[vllm]``).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_WORDS = (
    "the", "agent", "reward", "policy", "token", "step", "rollout", "batch", "value", "math", "answer", "is",
    "a", "of", "and", "to", "in", "we", "compute", "sum", "product", "what", "plus", "times", "equals",
    "number", "result", "question", "give", "only", "final",
)


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.5:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "*"])
            out.append(f"What is {a} {op} {b}? Give only the final number. Answer: {a + b if op == '+' else a * b}")
        else:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))))
    return out


def build_tiny_llama(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    tie_embeddings: bool = False,
) -> Path:
    """Write a random Llama (safetensors) and its tokenizer to ``out_dir``; returns the directory.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        layers: decoder layers.
        hidden: hidden size; must be divisible by ``heads``.
        heads: attention heads.
        kv_heads: key/value heads (grouped-query attention when < heads); must divide ``heads``.
        intermediate: SwiGLU inner size; defaults to ``4 * hidden``.
        vocab: target BPE vocabulary size (the config uses the size actually trained).
        max_positions: ``max_position_embeddings`` (RoPE).
        dtype: torch dtype name of the saved weights ("float32" keeps logprob comparisons exact).
        seed: seeds the tokenizer corpus and the weight init.
        tie_embeddings: tie the output layer to the input embedding (as SmolLM2 does; no ``lm_head.weight`` saved).

    Example::

        path = build_tiny_llama("/tmp/tiny", layers=2, hidden=64, heads=4, kv_heads=2)
    """
    _check_shape(hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as exc:
        msg = f"build_tiny_llama needs torch, transformers and tokenizers: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = _train_tokenizer(vocab, seed)
    hf_tok.save_pretrained(str(out))
    cfg = llama_config(hf_tok, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate, max_positions=max_positions, tie_embeddings=tie_embeddings)
    model = _random_weights(LlamaForCausalLM, cfg, seed=seed).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "knittrans_tiny.json").write_text(
        json.dumps({"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "seed": seed,
                    "vocab": len(hf_tok), "params": n_params, "dtype": dtype})
    )
    logger.info("built tiny llama at %s: %d params, vocab %d", out, n_params, len(hf_tok))
    return out


def llama_config(tok: Any, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int | None,
                 max_positions: int, tie_embeddings: bool) -> Any:
    """The ``LlamaConfig`` of the tiny Llama (RMSNorm 1e-5, SwiGLU) over the tokenizer ``tok``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=tie_embeddings)


def _random_weights(model_cls: Any, cfg: Any, *, seed: int) -> Any:
    """``model_cls(cfg)`` with seeded random weights: every matrix but the embedding drawn from N(0, 0.08), a
    wider init than the default 0.02 so that samples are not uniform noise over the vocabulary."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    return model


def _check_shape(*, hidden: int, heads: int, kv_heads: int, vocab: int) -> None:
    if hidden % heads:
        msg = f"hidden={hidden} is not divisible by heads={heads}"
        raise ValueError(msg)
    if heads % kv_heads:
        msg = f"kv_heads={kv_heads} does not divide heads={heads}"
        raise ValueError(msg)
    if vocab < 300:
        msg = f"vocab={vocab} is too small for a byte-level BPE (needs >= 300)"
        raise ValueError(msg)


def _train_tokenizer(vocab: int, seed: int) -> Any:
    """A byte-level BPE of about ``vocab`` tokens trained on the synthetic corpus, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
