"""The benchmarks' workload: its shape (:class:`Workload`), its data in and out, and its plans.

In: synthetic prompt groups straight from numpy (:func:`make_group`), as the rollout would DoPut
them. Out: verl's DataProto layout of a train batch (:func:`dataproto_shards`, with the GRPO
advantages of :func:`group_advantages`) and DataProto's default serialisation (:func:`serialize`).
Plans: :func:`admit` runs the admission planner over the stores' metadata, as the driver does, with the
driver's client wrapped in :class:`CountingClient` (the payload and metadata bytes the driver received);
:func:`plan_step` plans one train step with a rank assignment ("links" or "tokens") and :func:`link_model`
describes the cluster benchmark's hosts to the planner.
Shared by :mod:`bench.cluster` and :mod:`bench.peers`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa

from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.plan import MiniBatchPlan, PlannedSlice

IMAGE_FORMATS: dict[str, tuple[tuple[int, ...], str]] = {
    "pixels-uint8": ((3, 448, 448), "uint8"),  # a raw 448x448 RGB image
    "patches-fp16": ((1024, 1176), "float16"),  # what a Qwen2-VL-style processor makes of it (14x14x3x2 values)
}


@dataclass(kw_only=True, slots=True)
class Workload:
    """Shape of the benchmark's train steps."""

    steps: int = 4
    """Measured train steps (one train batch each), after one warm-up step."""
    groups: int = 32
    """B: prompt groups per train batch."""
    group_size: int = 8
    """G: responses per prompt group."""
    mini_batches: int = 4
    """K: optimizer steps per train batch."""
    ranks: int = 2
    """Trainer ranks (DP)."""
    prompt_len: int = 512
    """Prompt tokens (shared by a group)."""
    response_mean: int = 1024
    """Mean response tokens (lognormal lengths, long tail)."""
    response_max: int = 4096
    """Longest response."""
    token_budget: int = 16384
    """Tokens per micro-batch."""
    compute_ms_per_ktok: float = 10.0
    """Stand-in accelerator time per 1000 tokens of a micro-batch."""
    prefetch_depth: int = 1
    """Micro-batches fetched ahead on each rank."""
    multimodal: bool = False
    """Image workload: every group references ``images_per_group`` images (``--multimodal``)."""
    image_shape: tuple[int, ...] = (3, 448, 448)
    """Shape of one image: ``(C, H, W)`` pixels, or ``(patches, values)`` as a processor's patch tensor."""
    image_dtype: str = "uint8"
    """Element type of an image: ``uint8`` pixels or ``float16`` patch values."""
    images_per_group: int = 1
    """Distinct images a prompt group's prompt carries (shared by its G responses)."""
    train_steps: int = 2
    """Measured train steps of the transfer-plus-train phase (multimodal), after one warm-up step."""
    encoder_width: int = 32
    """Channels of the tiny vision encoder's patch embedding (multimodal train phase)."""
    encoder_patch: int = 14
    """Patch size of the tiny vision encoder."""
    backbone_width: int = 16
    """Width of the tiny backbone (multimodal train phase)."""
    seed: int = 0
    """RNG seed of the synthetic trajectories."""

    def __post_init__(self) -> None:
        if self.groups % self.mini_batches or self.groups // self.mini_batches < self.ranks:
            msg = f"groups={self.groups} must split into mini_batches={self.mini_batches} of >= ranks={self.ranks}"
            raise ValueError(msg)
        if self.images_per_group < 1 or self.train_steps < 1:
            msg = f"images_per_group={self.images_per_group} and train_steps={self.train_steps} must be >= 1"
            raise ValueError(msg)
        if len(self.image_shape) not in (2, 3) or self.image_dtype not in ("uint8", "float16"):
            msg = (f"image_shape={self.image_shape} must be (C, H, W) or (patches, values) and "
                   f"image_dtype={self.image_dtype!r} uint8 or float16")
            raise ValueError(msg)


def make_group(group_id: str, w: Workload, rng: np.random.Generator,
               image_keys: Sequence[bytes] = ()) -> pa.RecordBatch:
    """One prompt group straight from numpy (lognormal response lengths; shared prompt and images)."""
    g = w.group_size
    sigma = 0.8
    lens = np.clip(rng.lognormal(np.log(w.response_mean) - sigma**2 / 2, sigma, g), 8, w.response_max).astype(np.int32)
    r_off = np.zeros(g + 1, dtype=np.int32)
    np.cumsum(lens, out=r_off[1:])
    n = int(r_off[-1])
    prompt = rng.integers(0, 32000, w.prompt_len, dtype=np.int32)
    p_off = np.arange(0, g * w.prompt_len + 1, w.prompt_len, dtype=np.int32)
    now = np.datetime64("2026-01-01T00:00:00", "us")
    cols = {
        "group_id": pa.array([group_id] * g), "sample_idx": pa.array(np.arange(g, dtype=np.int32)),
        "policy_version": pa.array(np.zeros(g, dtype=np.int64)),
        "policy_version_min": pa.array(np.zeros(g, dtype=np.int64)),
        "data_source": pa.array(["bench"] * g), "prompt_len": pa.array(np.full(g, w.prompt_len, dtype=np.int32)),
        "response_len": pa.array(lens), "reward": pa.array(rng.random(g, dtype=np.float32)),
        "finish_reason": pa.array(["stop"] * g), "status": pa.array(["completed"] * g),
        "num_images": pa.array(np.full(g, len(image_keys), dtype=np.int16)), "created_at": pa.array(np.full(g, now)),
        "num_turns": pa.array(np.ones(g, dtype=np.int16)), "loss_tokens": pa.array(lens.astype(np.int32)),
        "completed_at": pa.array(np.full(g, now)), "bytes": pa.array(np.zeros(g, dtype=np.int64)),
        "prompt_ids": pa.ListArray.from_arrays(pa.array(p_off), pa.array(np.tile(prompt, g))),
        "response_ids": pa.ListArray.from_arrays(pa.array(r_off), pa.array(rng.integers(0, 32000, n, np.int32))),
        "response_logprobs": pa.ListArray.from_arrays(pa.array(r_off), pa.array(-rng.random(n, dtype=np.float32))),
        "loss_mask": pa.ListArray.from_arrays(pa.array(r_off), pa.array(np.ones(n, dtype=np.uint8))),
        "image_keys": pa.array([list(image_keys)] * g, type=pa.list_(pa.binary(32))),
        "token_versions": pa.ListArray.from_arrays(pa.array(r_off), pa.array(np.zeros(n, dtype=np.int32))),
    }
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def dataproto_shards(table: pa.Table, advantages: np.ndarray, ranks: int,
                     response_width: int | None = None) -> list[dict[str, Any]]:
    """verl's DataProto batch layout (right-padded ``[batch, max_len]``), chunked into one dict per rank.

    ``response_width``: pad every response to this many tokens (verl's rollout pads to its configured
    ``response_length``) and every prompt to the longest prompt; default: the batch's longest row."""
    import torch

    from train.packing import list_arrays

    p_off, p_val = list_arrays(table.column("prompt_ids"))
    r_off, r_val = list_arrays(table.column("response_ids"))
    _, l_val = list_arrays(table.column("response_logprobs"))
    _, m_val = list_arrays(table.column("loss_mask"))
    n = table.num_rows
    plen, rlen = np.diff(p_off), np.diff(r_off)
    width, rwidth = int((plen + rlen).max()), int(rlen.max())
    if response_width is not None:
        if rwidth > response_width:
            msg = f"a response of {rwidth} tokens does not fit response_width={response_width}"
            raise ValueError(msg)
        width, rwidth = int(plen.max()) + response_width, response_width
    row_p, row_r = np.repeat(np.arange(n), plen), np.repeat(np.arange(n), rlen)
    col_p = np.arange(p_val.size) - np.repeat(p_off[:-1], plen)
    col_r = np.arange(r_val.size) - np.repeat(r_off[:-1], rlen)
    input_ids = np.zeros((n, width), dtype=np.int64)
    input_ids[row_p, col_p] = p_val
    input_ids[row_r, col_r + plen[row_r]] = r_val
    attention_mask = (np.arange(width)[None, :] < (plen + rlen)[:, None]).astype(np.int64)
    responses = np.zeros((n, rwidth), dtype=np.int64)
    responses[row_r, col_r] = r_val
    response_mask = np.zeros((n, rwidth), dtype=np.int64)
    response_mask[row_r, col_r] = m_val
    old_log_probs = np.zeros((n, rwidth), dtype=np.float32)
    old_log_probs[row_r, col_r] = l_val
    adv = np.zeros((n, rwidth), dtype=np.float32)
    adv[row_r, col_r] = advantages[row_r]
    batch = {
        "input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
        "position_ids": torch.from_numpy(np.cumsum(attention_mask, axis=1) - 1).clamp_(min=0),
        "responses": torch.from_numpy(responses), "response_mask": torch.from_numpy(response_mask),
        "old_log_probs": torch.from_numpy(old_log_probs), "advantages": torch.from_numpy(adv),
    }
    return [{k: v[idx].contiguous() for k, v in batch.items()} for idx in np.array_split(np.arange(n), ranks)]


def serialize(shard: dict[str, Any]) -> bytes:
    """DataProto.__getstate__: ``torch.save`` of the tensor batch into a bytes buffer."""
    import torch

    buf = io.BytesIO()
    torch.save(shard, buf)
    return buf.getvalue()


def group_advantages(table: pa.Table) -> np.ndarray:
    """GRPO advantages per row (rows of whole groups, in group order), as the planner computes them."""
    import polars as pl

    from admission import GrpoConfig, advantage_expr

    df = cast(pl.DataFrame, pl.from_arrow(table.select(["group_id", "reward"])))
    adv = df.select(advantage_expr(GrpoConfig()).alias("a"))
    return adv.get_column("a").to_numpy().astype(np.float32)


class CountingClient:
    """The driver's store client, counting every payload and metadata byte the driver receives."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.payload_bytes = 0
        self.metadata_bytes = 0

    def fetch(self, slices: Sequence[PlannedSlice], columns: Sequence[str] | None = None) -> pa.Table:
        t = self.client.fetch(slices, columns=columns)
        self.payload_bytes += t.nbytes
        return t

    def scan_new(self) -> Any:
        frame = self.client.scan_new()
        self.metadata_bytes += int(frame.estimated_size())
        return frame


def admit(driver: CountingClient, w: Workload, train_steps: int) -> list[MiniBatchPlan]:
    """The ``train_batch`` planner over the stores' metadata; exactly ``train_steps`` train batches' mini-batches."""
    from admission import AdmissionConfig, Planner

    planner = Planner(AdmissionConfig(train_batch_groups=w.groups, group_size=w.group_size,
                                      mini_batches=w.mini_batches, dp_ranks=w.ranks, token_budget=w.token_budget,
                                      policy="train_batch"))
    plans = planner.update(driver.scan_new(), current_version=0)
    if len(plans) != train_steps * w.mini_batches:
        msg = f"planner admitted {len(plans)} mini-batches, expected {train_steps * w.mini_batches}"
        raise RuntimeError(msg)
    return plans


def plan_step(frame: Any, w: Workload, assignment: str, links: Any) -> list[MiniBatchPlan]:
    """One train step's mini-batches: a fresh ``train_batch`` planner over ``frame`` (that step's groups), ranks
    assigned by ``assignment`` ("links" with the link model ``links``, or "tokens": LPT by cost alone)."""
    from admission import AdmissionConfig, Planner

    extra: dict[str, Any] = {"assignment": assignment}
    if links is not None:
        extra["links"] = links
    planner = Planner(AdmissionConfig(train_batch_groups=w.groups, group_size=w.group_size,
                                      mini_batches=w.mini_batches, dp_ranks=w.ranks, token_budget=w.token_budget,
                                      policy="train_batch", **extra))
    plans = planner.update(frame, current_version=0)
    if len(plans) != w.mini_batches:
        msg = f"planner admitted {len(plans)} mini-batches of {frame.height} rows, expected {w.mini_batches}"
        raise RuntimeError(msg)
    return plans


def link_model(stores: Sequence[str], ranks: int, link_mbit: float) -> Any:
    """The cluster benchmark's topology as the planner's link model: store ``i`` (its location, as the metadata
    frame's ``node`` names it) on host ``store<i>``, rank ``j`` on host ``rank<j>``, every link ``link_mbit``."""
    from admission.config import LinkModel

    return LinkModel(node_host={loc: f"store{i}" for i, loc in enumerate(stores)},
                     rank_host=tuple(f"rank{j}" for j in range(ranks)), default_mbit=link_mbit)
