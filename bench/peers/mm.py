"""The multimodal cells of the peers benchmark: what storing an image once gains, kept apart from the rest.

Groups of their own carry images (``w.images_per_group`` each, shared by the group's G rows). Data path
cells, text compute 0 and no encoder cost (:data:`DATA_CELLS`):

* ``verl_replicated``: verl's DataProto path (default serialization), every row carrying its images'
  pixels (``pixel_values``), as a driver that holds the batch must;
* ``knit_replicated``: knittrans with every row's images stored per row: row i of a group references
  its own copy of each image (the copy's first byte changed so its content key differs), so every row's
  pixels are stored, fetched and held apart, the same code otherwise;
* ``knit_stored_once``: knittrans as it runs: each image stored once and read by key, once per mini-batch.

Both knittrans cells hand their encoder each distinct image of a mini-batch once (stored per row, every
row's copy is distinct); verl's rows hand it their own pixels, views of the chunk it already holds.

``ratios.mm_stored_once_c0`` = ``knit_replicated`` / ``knit_stored_once`` (storing once, isolated);
``ratios.mm_replicated_vs_verl_c0`` = ``verl_replicated`` / ``knit_replicated`` (both replicated: the
paths' difference alone); ``ratios.mm_data_path_c0`` = ``verl_replicated`` / ``knit_stored_once`` (both).

Encoder cells, on a smaller workload of their own (``enc_w``): ``knit_stored_once`` with the encoder run
on every reference (``encoder_per_ref``) or on each distinct image once per mini-batch (``encoder_dedup``),
the rank held :func:`bench.peers.vision.measure_ms_per_image` per image it encodes (not in the warm-up step)
(``metrics.mm_encoder_ms_per_image``, a ViT-B/16-shaped network measured here), text compute 0:
``ratios.mm_encoder_dedup`` = per reference / deduplicated.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

import numpy as np
import pyarrow as pa

from bench.cluster.workload import Workload, make_group
from bench.peers.common import MicroSpec, step_specs
from bench.peers.turns import StepFn, steps_in_turn

DATA_CELLS = ("verl_replicated", "knit_replicated", "knit_stored_once")
"""The data path cells (module docstring)."""
ENCODER_CELLS = {"encoder_per_ref": False, "encoder_dedup": True}
"""The encoder cells, and whether the encoder deduplicates."""


def mm_groups(w: Workload, rng: np.random.Generator, prefix: str, *,
              replicated: bool) -> tuple[list[pa.RecordBatch], list[pa.Table], dict[bytes, np.ndarray]]:
    """``w.steps + 1`` train batches of image groups: the groups, each group's image table, key -> pixels.

    ``replicated``: row i of a group references its own copy of each image (first byte changed)."""
    from schemas.images import images_to_table

    groups: list[pa.RecordBatch] = []
    tables: list[pa.Table] = []
    images: dict[bytes, np.ndarray] = {}
    for s in range(w.steps + 1):
        for g in range(w.groups):
            imgs = [rng.integers(0, 256, w.image_shape, dtype=np.uint8) for _ in range(w.images_per_group)]
            per_row = [imgs] * w.group_size
            if replicated:
                per_row = [[_copy(img, i) for img in imgs] for i in range(w.group_size)]
            flat = [img for row in per_row for img in row]
            table, keys = images_to_table(flat if replicated else imgs)
            images.update(zip(keys, flat if replicated else imgs, strict=True))
            tables.append(table)
            group = make_group(f"{prefix}-s{s}-g{g}", w, rng, keys[:w.images_per_group])
            if replicated:
                k = w.images_per_group
                rows = pa.array([keys[i * k:(i + 1) * k] for i in range(w.group_size)], type=pa.list_(pa.binary(32)))
                at = group.schema.get_field_index("image_keys")
                group = pa.RecordBatch.from_arrays([rows if j == at else c for j, c in enumerate(group.columns)],
                                                   schema=group.schema)
            groups.append(group)
    return groups, tables, images


def _copy(img: np.ndarray, i: int) -> np.ndarray:
    out = img.copy()
    out.reshape(-1)[0] = (int(out.reshape(-1)[0]) + i) % 256
    return out


def run_mm(knit: Any, w: Workload, enc_w: Workload, encoder_ms: float, stack: contextlib.ExitStack) -> dict[str, Any]:
    """The data path cells on ``w`` and the encoder cells on ``enc_w``; raw records."""
    from bench.cluster.workload import CountingClient, admit
    from bench.peers.verl_dp import VerlPath

    specs: dict[str, list[list[list[MicroSpec]]]] = {}
    loaded: dict[str, tuple[list[pa.RecordBatch], dict[bytes, np.ndarray]]] = {}
    put = {}
    for name, replicated in (("knit_stored_once", False), ("knit_replicated", True)):
        groups, tables, images = mm_groups(w, np.random.default_rng(w.seed + 1), name, replicated=replicated)
        put[name] = knit.load_mm(groups, tables)
        specs[name] = step_specs(admit(CountingClient(knit.client), w, w.steps + 1), w.mini_batches, w.ranks)
        loaded[name] = (groups, images)
    verl = VerlPath(w, "default")
    stack.callback(verl.close)
    verl.load(loaded["knit_replicated"][0], specs["knit_replicated"], images=loaded["knit_replicated"][1])
    out: dict[str, Any] = {"put": put, "image_bytes": int(np.prod(w.image_shape)),
                           "distinct_images_per_step": w.groups * w.images_per_group, "steps": {}}
    # both knittrans cells' groups come from the same seed (the same tokens and pixels); verl runs the replicated
    # ones' plans; compute 0, encoder free
    cells: dict[str, StepFn] = {
        "verl_replicated": lambda s, per_rank, c: verl.step(s, per_rank, c, 0.0, False),
        "knit_replicated": lambda s, per_rank, c: list(knit.step_mm(per_rank, c, 0.0, True, w.prefetch_depth)),
        "knit_stored_once": lambda s, per_rank, c: list(knit.step_mm(per_rank, c, 0.0, True, w.prefetch_depth)),
    }
    for cell, fn in cells.items():
        key = "knit_replicated" if cell == "verl_replicated" else cell
        out["steps"].update(steps_in_turn({cell: fn}, specs[key], [0.0]))
    groups, tables, _ = mm_groups(enc_w, np.random.default_rng(w.seed + 2), "enc", replicated=False)
    out["put"]["encoder"] = knit.load_mm(groups, tables)
    enc_specs = step_specs(admit(CountingClient(knit.client), enc_w, enc_w.steps + 1), enc_w.mini_batches,
                           enc_w.ranks)
    def encoder_cell(dedup: bool) -> StepFn:
        def step(s: int, per_rank: list[list[MicroSpec]], c: float) -> list[dict[str, Any]]:
            return list(knit.step_mm(per_rank, c, encoder_ms if s else 0.0, dedup, enc_w.prefetch_depth))
        return step

    enc_cells = {cell: encoder_cell(dedup) for cell, dedup in ENCODER_CELLS.items()}
    out["encoder_steps"] = steps_in_turn(enc_cells, enc_specs, [0.0])
    out["encoder_ms_per_image"] = encoder_ms
    return out


def summarize_mm(mm: dict[str, Any], metrics: dict[str, Any], ratios: dict[str, Any]) -> None:
    """The cells' medians and the ratios of the module docstring."""
    metrics["mm_image_bytes"] = mm["image_bytes"]
    metrics["mm_distinct_images_per_step"] = mm["distinct_images_per_step"]
    metrics["mm_encoder_ms_per_image"] = mm["encoder_ms_per_image"]
    for prefix, steps in (("mm", mm["steps"]), ("mm_encoder", mm["encoder_steps"])):
        for cell, by_c in steps.items():
            recs = by_c["0"]
            metrics[f"{prefix}_step_ms_{cell}"] = 1e3 * statistics.median(r["step_s"] for r in recs)
            metrics[f"{prefix}_first_wait_ms_{cell}"] = 1e3 * statistics.median(r["first_wait_s"] for r in recs)
            metrics[f"{prefix}_encoder_passes_{cell}"] = statistics.median(r["encoder_passes"] for r in recs)
            metrics[f"{prefix}_rank_bytes_{cell}"] = statistics.median(r["bytes"] for r in recs)
    step = {cell: metrics[f"mm_step_ms_{cell}"] for cell in DATA_CELLS}
    ratios["mm_stored_once_c0"] = step["knit_replicated"] / step["knit_stored_once"]
    ratios["mm_replicated_vs_verl_c0"] = step["verl_replicated"] / step["knit_replicated"]
    ratios["mm_data_path_c0"] = step["verl_replicated"] / step["knit_stored_once"]
    ratios["mm_encoder_dedup"] = (metrics["mm_encoder_step_ms_encoder_per_ref"]
                                  / metrics["mm_encoder_step_ms_encoder_dedup"])
