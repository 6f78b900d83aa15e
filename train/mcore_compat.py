"""Megatron-core 0.16.1 on machines without CUDA, and the process-group setup for both cases.

On a GPU machine nothing here patches anything: ``init_distributed`` picks NCCL, binds the local
device and initialises Megatron's model-parallel state. Without a CUDA device it picks gloo and
applies the few process-wide patches Megatron-core needs on a CPU-only torch build:

``cuda_device``
    ``torch.cuda.current_device()`` -> 0, ``synchronize``/``set_device`` -> no-ops (parallel_state,
    DDP and the schedules call them unconditionally).
``cuda_to_cpu``
    a ``TorchFunctionMode`` that rewrites ``device="cuda"`` (or an int ordinal) to CPU in factory
    calls and makes ``Tensor.cuda()``/``.to("cuda")`` stay on CPU (the schedules allocate
    ``torch.zeros(..., device="cuda")``).
``rng``
    Megatron's CUDA RNG tracker on the CPU generator.
``clip_grads``
    the optimizer's gradient clipping checks for ``torch.cuda.FloatTensor``; a CPU version.
``vit_norm`` (opt-in: :func:`apply_vit_norm_patch`, for vision models)
    without TransformerEngine, ``CLIPViTModel``'s default ``ln_pre``/``ln_post`` is
    ``torch.nn.LayerNorm``, which Megatron's ``build_module`` cannot construct (it passes
    ``config=``); the defaults become Megatron's ``WrappedTorchNorm`` (``CLIPViTModel`` and
    ``LLaVAModel``, which builds one inside). Harmless on GPU machines; applied only when asked.

Known pitfalls (why the trainer is built the way it is): Megatron DDP keeps gradients in
``.main_grad``, so it needs the Megatron optimizer (a plain ``torch.optim.Adam`` silently never
trains); dist checkpointing hangs on save without ``psutil``; the distributed optimizer, bf16 and
sequence parallelism are not supported on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any

from train.config import ParallelConfig

log = logging.getLogger(__name__)

APPLIED: list[str] = []
"""Names of the patches applied in this process, in order."""

_MODE: Any = None


def cuda_available() -> bool:
    """True when torch sees a CUDA device (then nothing is patched)."""
    import torch

    return bool(torch.cuda.is_available())


def _is_cuda(device: object) -> bool:
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _make_mode() -> Any:
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        """Rewrite CUDA device requests to CPU for every torch call made while active."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            name = getattr(func, "__name__", "")
            if args and name in ("cuda", "pin_memory") and _is_tensor(args[0]):
                return args[0]
            if args and name == "to" and _is_tensor(args[0]):
                args = tuple("cpu" if (_is_cuda(a) and not isinstance(a, int)) else a for a in args)
            return func(*args, **kwargs)

    return CudaToCpu()


def _is_tensor(x: object) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def apply_cpu_patches() -> list[str]:
    """Apply the CPU patches (idempotent). Refuses to run where CUDA exists."""
    global _MODE
    import torch

    if cuda_available():
        msg = "apply_cpu_patches() called on a machine with CUDA; the GPU path runs unpatched"
        raise RuntimeError(msg)
    if "cuda_device" not in APPLIED:
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.set_device = lambda *a, **k: None
        APPLIED.append("cuda_device")
    if "cuda_to_cpu" not in APPLIED:
        _MODE = _make_mode()
        _MODE.__enter__()  # active for the life of the process (this thread)
        APPLIED.append("cuda_to_cpu")
    if "rng" not in APPLIED:
        import megatron.core.tensor_parallel.random as mrand

        def _get_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
            return torch.get_rng_state()

        def _set_state(new_state: Any, device: object = -1, graph_safe: bool = False) -> None:
            torch.set_rng_state(new_state)

        mrand._get_cuda_rng_state = _get_state
        mrand._set_cuda_rng_state = _set_state
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment,return-value]
        torch.cuda.set_rng_state = lambda s, device="cuda": torch.set_rng_state(s)  # type: ignore[assignment]
        APPLIED.append("rng")
    if "clip_grads" not in APPLIED:
        import megatron.core.optimizer.optimizer as mopt

        def _clip(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            attr = "decoupled_grad" if use_decoupled_grad else "grad"
            grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
            coeff = max_norm / (total_norm + 1.0e-6)
            if coeff < 1.0 and grads:
                torch._foreach_mul_(grads, coeff)

        mopt.clip_grad_by_total_norm_fp32 = _clip
        APPLIED.append("clip_grads")
    log.info("megatron CPU patches applied: %s", APPLIED)
    return list(APPLIED)


def apply_vit_norm_patch() -> list[str]:
    """Make ``CLIPViTModel``'s default norms buildable without TransformerEngine (idempotent).

    Only the ``torch.nn.LayerNorm`` defaults of ``CLIPViTModel.__init__`` are replaced (by
    ``WrappedTorchNorm``); explicit ``ln_pre_impl``/``ln_post_impl`` arguments are untouched.
    """
    if "vit_norm" not in APPLIED:
        import torch
        from megatron.core.models.vision import clip_vit_model as cvm
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        init = cvm.CLIPViTModel.__init__
        if init.__defaults__ is not None:
            init.__defaults__ = tuple(WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in init.__defaults__)
        APPLIED.append("vit_norm")
    return list(APPLIED)


def device() -> Any:
    """The torch device this rank computes on."""
    import torch

    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(parallel: ParallelConfig, *, seed: int = 1234) -> dict[str, int]:
    """Join the process group (env:// from torchrun), patch on CPU, initialise model parallelism.

    Returns ``{"rank", "world", "dp_rank", "dp_size", "tp_rank", "tp_size"}``.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the environment
        msg = "the trainer needs torch and megatron-core: pip install knittrans[train]"
        raise ImportError(msg) from exc
    gpu = cuda_available()
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if gpu else "gloo")
    if backend == "nccl" and not gpu:
        msg = "backend 'nccl' requested but no CUDA device exists"
        raise ValueError(msg)
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=parallel.timeout_s))
    if not gpu:
        apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (parallel.tensor_parallel * parallel.pipeline_parallel):
        msg = f"world size {world} is not divisible by tp*pp={parallel.tensor_parallel * parallel.pipeline_parallel}"
        raise ValueError(msg)
    ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tensor_parallel,
                                 pipeline_model_parallel_size=parallel.pipeline_parallel)
    model_parallel_cuda_manual_seed(seed)
    return {
        "rank": dist.get_rank(), "world": world,
        "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
    }


def shutdown() -> None:
    """Tear down model parallelism and the process group (safe to call twice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with contextlib.suppress(Exception):
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
