"""What a resumable checkpoint costs: ``train.checkpointing.save`` and ``load`` of a model and its Adam state.

One rank (gloo on CPU, NCCL on a GPU). The model is built, given one optimizer step over random gradients (so
Adam's moments exist, as after any step of a run), then saved ``--repeats`` times and loaded once into a freshly
built model; the weights and the optimizer state loaded are checked equal to those saved. Reported: the first
save (it starts Megatron's writer process once per trainer process), the median of the later saves (the cost
per checkpoint of a run), the load, and the checkpoint's bytes on disk.

``--quick``: the ``tiny-vllm`` shape ``knit run`` trains on CPU. Without it: SmolLM2-135M's shape (float32 on
a CPU, bfloat16 on a GPU).

Example:
    python -m bench.checkpoint --quick --out runs/bench/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _fill_and_step(built: Any) -> None:
    import torch

    torch.manual_seed(0)
    for p in built.model.parameters():
        p.main_grad.copy_(torch.randn_like(p.main_grad) * 1e-3)
    built.optimizer.step()


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)


def measure(preset: str, repeats: int) -> dict[str, Any]:
    """Save ``repeats`` checkpoints of ``preset`` and load the last; the seconds and bytes."""
    from train import checkpointing, mcore_compat, model
    from train.config import ModelConfig, OptimConfig, ParallelConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    gpu = mcore_compat.cuda_available()
    mcore_compat.init_distributed(ParallelConfig(backend="auto"))
    shape = ModelConfig.preset(preset)
    if not gpu:
        shape.dtype = "float32"
    built = model.build(shape, OptimConfig(), tensor_parallel=1)
    _fill_and_step(built)
    params = sum(p.numel() for p in built.gpt.parameters())
    with tempfile.TemporaryDirectory() as root:
        saves = [checkpointing.save(built, root, step) for step in range(1, repeats + 1)]
        folder = checkpointing.step_folder(root, repeats)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        again = model.build(shape, OptimConfig(), tensor_parallel=1)
        t0 = time.perf_counter()
        checkpointing.load(again, root, repeats)
        load_s = time.perf_counter() - t0
    exact = _equal(built.gpt.state_dict(), again.gpt.state_dict()) and _equal(built.optimizer.state_dict(),
                                                                               again.optimizer.state_dict())
    return {"model": preset, "dtype": shape.dtype, "device": "cuda" if gpu else "cpu", "parameters": params,
            "checkpoint_bytes": size, "first_save_s": round(saves[0], 4),
            "save_s_median": round(statistics.median(saves[1:]), 4), "saves": [round(s, 4) for s in saves],
            "load_s": round(load_s, 4), "restored_exactly": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny-vllm shape (else SmolLM2-135M's)")
    parser.add_argument("--repeats", type=int, default=5, help="checkpoints saved (at least 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    result = measure("tiny-vllm" if args.quick else "smollm2-135m", max(2, args.repeats))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
