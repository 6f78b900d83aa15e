"""Shared fixtures; test markers for optional heavy dependencies are chosen automatically."""

from __future__ import annotations

import importlib.util

import pytest


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_cuda() -> bool:
    if not _has("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


_AVAILABLE = {
    "megatron": _has("megatron.core") and _has("torch"),
    "vllm": _has("vllm"),
    "gpu": _has_cuda(),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, ok in _AVAILABLE.items():
            if marker in item.keywords and not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs {marker} (not available here)"))
