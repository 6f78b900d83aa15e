"""vLLM adapter: one finished ``RequestOutput`` (n samples of one prompt) -> one trajectory record batch.

This module owns the mapping from vLLM's output objects onto ``schemas.arrow.TRAJECTORY_SCHEMA``:

* ``prompt_ids`` / ``response_ids``: the prompt's token ids (repeated per sample) and each sample's
  generated token ids;
* ``response_logprobs``: the logprob of the *sampled* token at every response position. With
  ``SamplingParams(logprobs=k, flat_logprobs=True)`` vLLM returns a ``FlatLogprobs`` (flat
  ``token_ids``/``logprobs`` lists plus per-position ``start_indices``/``end_indices``; the sampler
  puts the sampled token first at each position), read here with numpy fancy indexing, no per-token
  Python loop. The dict-per-position list form (``flat_logprobs=False``) is accepted too;
* ``finish_reason`` and ``status`` ("completed", or "aborted" for aborted/unfinished samples);
* ``loss_mask``, ``loss_tokens`` and ``num_turns``: ones, the response length and 1 for a single model turn; a
  multi-turn completion (``connectors.agent``) carries its own ``loss_mask`` (0 at tool tokens) and ``num_turns``
  as attributes. An aborted sample's mask is all zeros;
* ``policy_version``/``policy_version_min``: the weights version the engine ran;
* which logprob mode produced the logprobs ("raw_logprobs" = before temperature/top-p/penalties,
  "processed_logprobs" = after): recorded in the batch's schema metadata under
  ``LOGPROBS_MODE_KEY``, never as an extra column.

vLLM is not imported here at all: the adapter reads the output objects by attribute, so it works with
any engine whose outputs have the same shape. ``require_vllm()`` imports vLLM for code that starts an
engine and raises an ``ImportError`` naming the extra when it is missing.

Example::

    batch = group_to_batch(request_output, group_id="w0-17", policy_version=3,
                           data_source="add_small", rewards=[1.0, 0.0, 0.0, 1.0])
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import pyarrow as pa

from schemas import trajectory
from schemas.arrow import IMAGE_KEY_BYTES, TRAJECTORY_SCHEMA

LOGPROBS_MODE_KEY = b"knittrans.logprobs_mode"
"""Schema-metadata key naming the logprob mode that produced ``response_logprobs``."""
ENGINE_KEY = b"knittrans.engine"
"""Schema-metadata key naming the engine that wrote the batch."""
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""vLLM logprob modes whose values are logprobs (the ``*_logits`` modes are refused)."""
COMPLETED_FINISH_REASONS = frozenset({"stop", "length"})
"""Finish reasons of a sample that ran to its natural end; anything else is written as "aborted"."""


class RequestOutputLike(Protocol):
    """What the adapter reads from one prompt's output (vLLM ``RequestOutput``)."""

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def outputs(self) -> Sequence[Any]: ...


class FinishedRequest(RequestOutputLike, Protocol):
    """One prompt's output as the engine hands it back finished: the output and the request id it was given."""

    @property
    def request_id(self) -> str: ...


def require_vllm() -> ModuleType:
    """Import vLLM, or raise an ImportError that names the extra to install."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        msg = f"the vLLM connector needs vLLM: pip install knittrans[vllm] ({exc})"
        raise ImportError(msg) from exc


def trajectory_schema(logprobs_mode: str, engine: str = "vllm") -> pa.Schema:
    """``TRAJECTORY_SCHEMA`` with the logprob mode and engine recorded in its metadata."""
    if logprobs_mode not in LOGPROBS_MODES:
        msg = f"logprobs_mode {logprobs_mode!r} is not one of {LOGPROBS_MODES} (logits are not logprobs)"
        raise ValueError(msg)
    meta = dict(TRAJECTORY_SCHEMA.metadata or {})
    meta[LOGPROBS_MODE_KEY] = logprobs_mode.encode()
    meta[ENGINE_KEY] = engine.encode()
    return TRAJECTORY_SCHEMA.with_metadata(meta)


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> np.ndarray:
    """Logprob of the sampled token at each position, float32 ``[len(token_ids)]``.

    Args:
        logprobs: a vLLM ``FlatLogprobs`` (anything with ``start_indices``, ``end_indices``,
            ``token_ids`` and ``logprobs``), or a list with one ``{token_id: Logprob}`` dict per position.
        token_ids: the sampled token ids.

    Raises:
        ValueError: logprobs were not requested (``None``), the position counts differ, or the sampled
            token is missing from a position's entries.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    if logprobs is None:
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        msg = "the completion has no logprobs: request them with SamplingParams(logprobs=0, flat_logprobs=True)"
        raise ValueError(msg)
    if hasattr(logprobs, "start_indices"):
        starts = np.asarray(logprobs.start_indices, dtype=np.int64)
        if len(starts) != n:
            msg = f"FlatLogprobs has {len(starts)} positions for {n} sampled tokens"
            raise ValueError(msg)
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        ends = np.asarray(logprobs.end_indices, dtype=np.int64)
        flat_ids = np.asarray(logprobs.token_ids, dtype=np.int64)
        flat_lps = np.asarray(logprobs.logprobs, dtype=np.float64)
        if np.any(ends <= starts):
            pos = int(np.flatnonzero(ends <= starts)[0])
            msg = f"FlatLogprobs position {pos} has no entries"
            raise ValueError(msg)
        pick = starts.copy()
        # vLLM's sampler puts the sampled token first at each position; fall back to a search where not
        wrong = flat_ids[pick] != ids
        if wrong.any():
            for pos in np.flatnonzero(wrong):
                seg = flat_ids[starts[pos] : ends[pos]]
                hit = np.flatnonzero(seg == ids[pos])
                if len(hit) == 0:
                    msg = f"sampled token {int(ids[pos])} missing from the logprobs of position {int(pos)}"
                    raise ValueError(msg)
                pick[pos] = starts[pos] + hit[0]
        return flat_lps[pick].astype(np.float32)
    if len(logprobs) != n:
        msg = f"logprobs list has {len(logprobs)} positions for {n} sampled tokens"
        raise ValueError(msg)
    out = np.empty(n, dtype=np.float32)
    for pos, (entry, tid) in enumerate(zip(logprobs, token_ids, strict=True)):
        lp = entry.get(int(tid)) if entry else None
        if lp is None:
            msg = f"sampled token {int(tid)} missing from the logprobs of position {pos}"
            raise ValueError(msg)
        out[pos] = lp.logprob if hasattr(lp, "logprob") else float(lp)
    return out


def _list_array(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))


def _naive_utc(ts: datetime | None) -> datetime:
    if ts is None:
        return datetime.now(UTC).replace(tzinfo=None)
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo is not None else ts


def _samples_by_index(output: RequestOutputLike, group_id: str, group_size: int | None,
                      rewards: Sequence[float] | None, image_keys: Sequence[bytes]) -> tuple[int, dict[int, Any]]:
    """``(G, {sample_idx: completion})`` of one output, checked: distinct indices in ``[0, G)``, one reward
    per sample, image keys of the key size."""
    samples = list(output.outputs)
    g = group_size if group_size is not None else len(samples)
    if g < 1 or len(samples) > g:
        msg = f"group {group_id!r}: group_size {g} but the output has {len(samples)} samples"
        raise ValueError(msg)
    by_idx: dict[int, Any] = {int(c.index): c for c in samples}
    if len(by_idx) != len(samples) or any(i < 0 or i >= g for i in by_idx):
        msg = f"group {group_id!r}: sample indices {sorted(by_idx)} are not distinct values in [0, {g})"
        raise ValueError(msg)
    if rewards is not None and len(rewards) != g:
        msg = f"group {group_id!r}: {len(rewards)} rewards for {g} samples"
        raise ValueError(msg)
    for k in image_keys:
        if len(k) != IMAGE_KEY_BYTES:
            msg = f"group {group_id!r}: image key of {len(k)} bytes (expected {IMAGE_KEY_BYTES})"
            raise ValueError(msg)
    return g, by_idx


class _Response(NamedTuple):
    """One sample's columns as ``group_to_batch`` reads them off its completion."""

    ids: np.ndarray
    logprobs: np.ndarray
    finish: str
    status: str
    mask: np.ndarray
    turns: int


def _response(c: Any, status: str | None) -> _Response:
    """One sample's columns (``c`` None = never produced); the mask is the completion's own ``loss_mask`` when it
    carries one (a multi-turn response), ones otherwise, zeros for a sample that did not complete."""
    if c is None:
        empty = np.zeros(0, dtype=np.int32)
        return _Response(empty, np.zeros(0, dtype=np.float32), "abort", status or "aborted", empty.astype(np.uint8), 1)
    ids = np.asarray(c.token_ids, dtype=np.int32)
    reason = c.finish_reason if c.finish_reason is not None else "abort"
    row_status = status or ("completed" if reason in COMPLETED_FINISH_REASONS else "aborted")
    try:
        lps = sampled_logprobs(c.logprobs, c.token_ids)
    except ValueError:
        if row_status == "completed":
            raise
        lps = np.full(len(ids), np.nan, dtype=np.float32)  # partial, unusable: kept for the record
    own = getattr(c, "loss_mask", None)
    mask = np.ones(len(ids), np.uint8) if own is None else np.asarray(own, dtype=np.uint8)
    if len(mask) != len(ids):
        msg = f"a completion's loss_mask has {len(mask)} values for {len(ids)} token ids"
        raise ValueError(msg)
    if row_status != "completed":
        mask = np.zeros(len(ids), np.uint8)
    return _Response(ids, lps, reason, row_status, mask, int(getattr(c, "num_turns", 1)))


def group_to_batch(
    output: RequestOutputLike,
    *,
    group_id: str,
    policy_version: int,
    data_source: str,
    rewards: Sequence[float] | None = None,
    policy_version_min: int | None = None,
    logprobs_mode: str = "raw_logprobs",
    image_keys: Sequence[bytes] | Sequence[Sequence[bytes]] = (),
    created_at: datetime | None = None,
    completed_at: datetime | None = None,
    status: str | None = None,
    group_size: int | None = None,
    token_versions: Sequence[np.ndarray] | None = None,
) -> pa.RecordBatch:
    """One trajectory record batch (one row per sample, ordered by ``sample_idx``) for one prompt group.

    The batch is built and checked by the same rules the store applies (:mod:`schemas.trajectory`).

    Args:
        output: a finished vLLM ``RequestOutput`` (all n samples; use ``RequestOutputKind.FINAL_ONLY``
            with the engine step loop).
        group_id: the prompt group's id, unique across the store cluster.
        policy_version: weights version the engine ran when the group finished.
        data_source: dataset/task name (the usual quota key).
        rewards: one reward per sample, in ``sample_idx`` order; zeros when ``None``.
        policy_version_min: oldest weights version that produced any token; defaults to
            ``policy_version``.
        logprobs_mode: the engine's ``logprobs_mode`` ("raw_logprobs" or "processed_logprobs").
        image_keys: content keys (``schemas.images.image_key``) of the prompt's images; every row
            references all of them. Or one list per row, each row's own (``schemas.images.group_images``).
        created_at: when the group was dispatched (UTC); now when ``None``.
        completed_at: when it finished (UTC); now when ``None``.
        status: force every row's status (e.g. "aborted"); by default "completed" for samples that
            finished with "stop"/"length" and "aborted" for the rest.
        group_size: the n the group was sampled with; samples missing from ``output`` are written as
            empty "aborted" rows so that nothing is dropped silently. Defaults to ``len(output.outputs)``.
        token_versions: the version that sampled each token of each sample, in ``sample_idx`` order (partial
            rollouts, ``connectors.partial``); ``policy_version`` for every token when ``None``.

    Returns:
        A batch with schema ``trajectory_schema(logprobs_mode)``.

    Raises:
        ValueError: bad arguments, or logprobs missing/inconsistent for a completed sample (a
            :class:`~schemas.trajectory.TrajectoryError` names the column a rule refused).
    """
    schema = trajectory_schema(logprobs_mode)
    per_row = ([list(cast(Sequence[bytes], r)) for r in image_keys]
               if image_keys and not isinstance(image_keys[0], bytes) else None)
    flat = [k for r in per_row for k in r] if per_row is not None else list(cast(Sequence[bytes], image_keys))
    g, by_idx = _samples_by_index(output, group_id, group_size, rewards, flat)
    if per_row is not None and len(per_row) != g:
        msg = f"group {group_id!r}: image keys for {len(per_row)} rows, {g} samples"
        raise ValueError(msg)
    row_keys = per_row if per_row is not None else [flat] * g
    samples = [_response(by_idx.get(i), status) for i in range(g)]
    ids, statuses = [x.ids for x in samples], [x.status for x in samples]
    version = int(policy_version)
    cols = {
        "group_id": pa.array([group_id] * g, pa.string()),
        "sample_idx": pa.array(np.arange(g, dtype=np.int32)),
        "policy_version": pa.array(np.full(g, version, dtype=np.int64)),
        "policy_version_min": pa.array(np.full(g, version if policy_version_min is None else int(policy_version_min),
                                               dtype=np.int64)),
        "data_source": pa.array([data_source] * g, pa.string()),
        "reward": pa.array(np.asarray(rewards if rewards is not None else np.zeros(g), dtype=np.float32)),
        "finish_reason": pa.array([x.finish for x in samples], pa.string()),
        "status": pa.array(statuses, pa.string()),
        "num_turns": pa.array(np.array([x.turns for x in samples], dtype=np.int16)),
        "loss_tokens": pa.array(np.array([int(x.mask.sum()) for x in samples], dtype=np.int32)),
        "created_at": pa.array([_naive_utc(created_at)] * g, pa.timestamp("us")),
        "completed_at": pa.array([_naive_utc(completed_at)] * g, pa.timestamp("us")),
        **_token_columns(output.prompt_token_ids or [], ids, [x.logprobs for x in samples], [x.mask for x in samples]),
        "image_keys": _list_array(np.array([k for row in row_keys for k in row], dtype=object),
                                  np.array([len(row) for row in row_keys]), pa.binary(IMAGE_KEY_BYTES)),
    }
    if token_versions is not None:
        got = list(token_versions) + [np.zeros(0, np.int32)] * (g - len(token_versions))  # missing samples: empty
        cols["token_versions"] = _list_array(np.concatenate(got).astype(np.int32), np.array([len(v) for v in got]),
                                             pa.int32())
    batch = trajectory.build_batch(cols, group_id, fillable=frozenset(_FILLED_BY_RULES))
    return batch.replace_schema_metadata(schema.metadata)


def _token_columns(prompt_ids: Sequence[int], ids: Sequence[np.ndarray], lps: Sequence[np.ndarray],
                   masks: Sequence[np.ndarray]) -> dict[str, pa.Array]:
    """The list columns of a group's samples: the prompt (repeated per sample), each sample's response ids,
    sampled logprobs and loss mask."""
    g = len(ids)
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    resp_len = np.array([len(p) for p in ids], dtype=np.int64)
    mask = np.concatenate(masks)
    return {
        "prompt_ids": _list_array(np.tile(prompt, g), np.full(g, len(prompt)), pa.int32()),
        "response_ids": _list_array(np.concatenate(ids), resp_len, pa.int32()),
        "response_logprobs": _list_array(np.concatenate(lps), resp_len, pa.float32()),
        "loss_mask": _list_array(mask, resp_len, pa.uint8()),
    }


_FILLED_BY_RULES = ("prompt_len", "response_len", "num_images", "token_versions")
"""Columns ``group_to_batch`` may leave to the shared defaults (the length of a list column; ``token_versions``:
``policy_version`` for every token, when the caller gives none)."""


def aborted_batch(
    *,
    group_id: str,
    group_size: int,
    prompt_token_ids: Sequence[int],
    policy_version: int,
    data_source: str,
    logprobs_mode: str = "raw_logprobs",
    image_keys: Sequence[bytes] = (),
    created_at: datetime | None = None,
    finish_reason: str = "abort",
) -> pa.RecordBatch:
    """A group that never produced output (aborted before finishing, or refused by the engine).

    Every one of its ``group_size`` rows has an empty response, status "aborted" and ``finish_reason``.
    """

    class _Out:
        def __init__(self) -> None:
            self.prompt_token_ids = list(prompt_token_ids)
            self.outputs: list[Any] = []

    batch = group_to_batch(
        _Out(),
        group_id=group_id,
        policy_version=policy_version,
        data_source=data_source,
        logprobs_mode=logprobs_mode,
        image_keys=image_keys,
        created_at=created_at,
        status="aborted",
        group_size=group_size,
    )
    if finish_reason != "abort":
        idx = batch.schema.get_field_index("finish_reason")
        batch = batch.set_column(idx, batch.schema.field(idx), pa.array([finish_reason] * group_size, pa.string()))
    return batch


def dump_raw(path: str, group_id: str, output: RequestOutputLike) -> None:
    """Append one JSON line to ``path`` with the engine's raw output of a group (``RolloutConfig.dump_raw``):
    the prompt's token ids and, per sample, its token ids, flat logprob lists, finish reason and text."""
    samples = [
        {
            "index": int(c.index),
            "token_ids": list(c.token_ids),
            "flat_token_ids": list(c.logprobs.token_ids),
            "flat_logprobs": list(c.logprobs.logprobs),
            "start_indices": list(c.logprobs.start_indices),
            "finish_reason": c.finish_reason,
            "text": c.text,
        }
        for c in sorted(output.outputs, key=lambda c: int(c.index))
    ]
    doc = {"group_id": group_id, "prompt_token_ids": list(output.prompt_token_ids or []), "samples": samples}
    with Path(path).open("a") as fh:
        fh.write(json.dumps(doc) + "\n")
