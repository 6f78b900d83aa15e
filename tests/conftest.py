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


# ---- store nodes (flight_store) ------------------------------------------------------------------


@pytest.fixture
def store_nodes():  # type: ignore[no-untyped-def]
    """Factory: ``store_nodes(n, **server_kwargs)`` starts n real StoreServer nodes on port 0 in-process.

    Returns the list of servers (``server.location`` is each node's name); all are shut down after
    the test.
    """
    from flight_store.server import StoreServer

    started: list[StoreServer] = []

    def start(n: int = 1, **kwargs: object) -> list[StoreServer]:
        servers = [StoreServer("grpc://127.0.0.1:0", **kwargs) for _ in range(n)]  # type: ignore[arg-type]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.shutdown()


@pytest.fixture
def make_group():  # type: ignore[no-untyped-def]
    """Factory: ``make_group(group_id, size=4, response_len=8, **fields)`` -> a trajectory RecordBatch."""
    from schemas.records import TrajectoryRecord, records_to_batch

    def make(group_id: str, size: int = 4, response_len: int = 8, start: int = 0, **fields: object):  # type: ignore[no-untyped-def]
        recs = [
            TrajectoryRecord(
                group_id=group_id,
                sample_idx=start + i,
                policy_version=int(fields.get("policy_version", 0)),  # type: ignore[call-overload]
                prompt_ids=list(range(1, 5)),
                response_ids=[(7 * i + j) % 1000 for j in range(response_len)],
                response_logprobs=[-0.5] * response_len,
                reward=float(i % 2),
                **{k: v for k, v in fields.items() if k != "policy_version"},  # type: ignore[arg-type]
            )
            for i in range(size)
        ]
        return records_to_batch(recs)

    return make
