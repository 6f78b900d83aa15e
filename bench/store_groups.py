"""The trajectory groups and the store node the store benchmarks share (``bench.flight_throughput``,
``bench.write_path``, ``bench.write_parts``, ``bench.sql_load``, ``bench.peers``).

:func:`make_group` builds a valid trajectory batch straight from numpy (no per-row Python objects, so building
the workload costs little beside what is measured); :func:`start_store_process` starts one store node in a
process of its own (in the store host during a ``--hosts`` run).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from bench._hosts import start_node
from flight_store.config import ServerConfig, StoreConfig
from flight_store.node import NodeProcess
from schemas.arrow import TRAJECTORY_SCHEMA

BYTES_PER_TOKEN = 9  # response_ids int32 + response_logprobs float32 + loss_mask uint8


def make_group(group_id: str, size: int, response_tokens: int, rng: np.random.Generator) -> pa.RecordBatch:
    """A trajectory batch built straight from numpy (fast; no per-row Python objects)."""
    n_tok = size * response_tokens
    offsets = pa.array(np.arange(0, n_tok + 1, response_tokens, dtype=np.int32))
    prompt = 16
    p_offsets = pa.array(np.arange(0, size * prompt + 1, prompt, dtype=np.int32))
    now = np.datetime64("2026-01-01T00:00:00", "us")
    cols = {
        "group_id": pa.array([group_id] * size),
        "sample_idx": pa.array(np.arange(size, dtype=np.int32)),
        "policy_version": pa.array(np.zeros(size, dtype=np.int64)),
        "policy_version_min": pa.array(np.zeros(size, dtype=np.int64)),
        "data_source": pa.array(["bench"] * size),
        "prompt_len": pa.array(np.full(size, prompt, dtype=np.int32)),
        "response_len": pa.array(np.full(size, response_tokens, dtype=np.int32)),
        "reward": pa.array(rng.random(size, dtype=np.float32)),
        "finish_reason": pa.array(["stop"] * size),
        "status": pa.array(["completed"] * size),
        "num_images": pa.array(np.zeros(size, dtype=np.int16)),
        "num_turns": pa.array(np.ones(size, dtype=np.int16)),
        "loss_tokens": pa.array(np.full(size, response_tokens, dtype=np.int32)),
        "created_at": pa.array(np.full(size, now)),
        "completed_at": pa.array(np.full(size, now)),
        "bytes": pa.array(np.zeros(size, dtype=np.int64)),
        "prompt_ids": pa.ListArray.from_arrays(p_offsets, pa.array(rng.integers(0, 32000, size * prompt, np.int32))),
        "response_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 32000, n_tok, np.int32))),
        "response_logprobs": pa.ListArray.from_arrays(offsets, pa.array(-rng.random(n_tok, dtype=np.float32))),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(n_tok, dtype=np.uint8))),
        "image_keys": pa.array([[]] * size, type=pa.list_(pa.binary(32))),
        "token_versions": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n_tok, dtype=np.int32))),
    }
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def start_store_process(memory_budget: int | None = None) -> NodeProcess:
    """A store node (port 0) in a subprocess (in the store host during a ``--hosts`` run)."""
    return start_node(ServerConfig(log_level="WARNING", store=StoreConfig(memory_budget=memory_budget or None)))
