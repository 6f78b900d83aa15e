"""Arrow trajectory slices -> the tensors of one micro-batch, without per-element Python loops.

List columns are read as numpy views over Arrow buffers (list offsets + flat values); rows are
placed with one vectorised scatter. Two layouts:

``padded``
    right-padded ``[rows, max_len]``; the causal mask alone keeps real tokens off the padding.
``thd``
    all rows concatenated into one packed row ``[1, total]`` with ``cu_seqlens`` (int32, rows+1);
    attention must stay within each sequence (TransformerEngine ``PackedSeqParams`` on GPU, a
    block-diagonal causal mask with the local layer spec). RoPE depends only on relative
    positions inside a sequence, so packing does not change the result.

Token alignment: a row is ``prompt ++ response`` of length ``L = P + R``; position ``t`` predicts
``tokens[t + 1]``, so response token ``j`` is scored at position ``P - 1 + j``. ``rollout_logprobs``,
``loss_mask``, ``advantages`` and ``token_versions`` (when fetched) sit at those positions, zero elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from train.config import PackMode

PACK_COLUMNS: tuple[str, ...] = ("group_id", "sample_idx", "prompt_ids", "response_ids", "response_logprobs",
                                 "loss_mask")
"""Trajectory columns :func:`pack_tensors` needs."""
TRAIN_COLUMNS: tuple[str, ...] = (*PACK_COLUMNS, "token_versions")
"""Trajectory columns the text step fetches: :data:`PACK_COLUMNS` and each token's policy version (its staleness
metrics, ``train.offpolicy``)."""


class TokenOutOfVocabularyError(ValueError):
    """A trajectory holds a token id the trainer's model has no embedding for (its vocabulary differs from the
    rollout's); raised when a micro-batch is packed, before any embedding lookup."""

    def __init__(self, message: str, *, token_id: int, vocab_size: int) -> None:
        super().__init__(message)
        self.token_id = token_id
        """The offending id (the largest, or a negative one)."""
        self.vocab_size = vocab_size
        """The trainer model's vocabulary size."""


def check_vocabulary(vocab_size: int, *ids: np.ndarray) -> None:
    """Raise :class:`TokenOutOfVocabularyError` unless every id in the ``ids`` arrays is in ``[0, vocab_size)``."""
    filled = [a for a in ids if a.size]
    if not filled:
        return
    hi, lo = max(int(a.max()) for a in filled), min(int(a.min()) for a in filled)
    if lo < 0:
        msg = f"token id {lo} is negative; the trainer's model has a vocabulary of {vocab_size} tokens"
        raise TokenOutOfVocabularyError(msg, token_id=lo, vocab_size=vocab_size)
    if hi >= vocab_size:
        msg = (f"token id {hi} is outside the trainer model's vocabulary of {vocab_size} tokens, but the rollout's "
               f"tokenizer has at least {hi + 1}: build the trainer from the checkpoint folder the rollout serves "
               "(knit train --hf-checkpoint DIR, i.e. ModelConfig(hf_checkpoint=DIR)) so both share one vocabulary")
        raise TokenOutOfVocabularyError(msg, token_id=hi, vocab_size=vocab_size)


def list_arrays(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, values)`` of a list column as numpy, offsets starting at 0 (zero-copy where Arrow allows)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        msg = f"list column has {arr.null_count} null rows"
        raise ValueError(msg)
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    values = arr.flatten().to_numpy(zero_copy_only=False)  # respects the array's slice offset
    return offsets - offsets[0], values


@dataclass(slots=True)
class PackedBatch:
    """Numpy arrays of one micro-batch (shapes ``[B, S]``; ``B = 1`` for thd)."""

    tokens: np.ndarray  # int64, input token ids (0 = padding)
    labels: np.ndarray  # int64, next token at each position
    position_ids: np.ndarray  # int64, position inside its own sequence
    rollout_logprobs: np.ndarray  # float32, logprob the rollout engine gave the label token
    loss_mask: np.ndarray  # float32, 1 where the label is a trained response token
    advantages: np.ndarray  # float32, the row's advantage at its response positions
    cu_seqlens: np.ndarray | None  # int32 [rows + 1] for thd, else None
    rows: int
    tokens_total: int  # prompt + response tokens of the rows (no padding)
    token_versions: np.ndarray | None = None  # int64, policy version of the label token (fetched with the rows)

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """The arrays as torch tensors (zero-copy on CPU), plus the attention mask the layout needs."""
        import torch

        out: dict[str, Any] = {
            name: torch.from_numpy(getattr(self, name)).to(device)
            for name in ("tokens", "labels", "position_ids", "rollout_logprobs", "loss_mask", "advantages")
        }
        out["cu_seqlens"] = None if self.cu_seqlens is None else torch.from_numpy(self.cu_seqlens).to(device)
        if self.token_versions is not None:
            out["token_versions"] = torch.from_numpy(self.token_versions).to(device)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Rows:
    """The list columns of ``n`` fetched rows as numpy: offsets (from 0) and flat values, per column."""

    n: int
    adv: np.ndarray  # float32 [n], each row's advantage
    p_off: np.ndarray  # prompt_ids offsets [n + 1]
    p_val: np.ndarray  # prompt token ids, flat
    r_off: np.ndarray  # response_ids offsets [n + 1]
    r_val: np.ndarray  # response token ids, flat
    logprobs: np.ndarray  # response_logprobs, flat (aligned with r_val)
    mask: np.ndarray  # loss_mask, flat (aligned with r_val)
    versions: np.ndarray | None  # token_versions, flat (aligned with r_val), when the table has them


@dataclass(frozen=True, slots=True, kw_only=True)
class _Layout:
    """Where each token goes in the ``shape`` arrays of one pack mode (index tuples for a numpy scatter)."""

    shape: tuple[int, int]
    at_p: tuple[np.ndarray, np.ndarray]  # the prompt tokens' places
    at_r: tuple[np.ndarray, np.ndarray]  # the response tokens' places
    at_r_prev: tuple[np.ndarray, np.ndarray]  # the places that predict each response token
    last: tuple[np.ndarray, np.ndarray]  # each sequence's last token (predicts nothing)
    position_ids: np.ndarray  # int64 ``shape``, position inside its own sequence
    cu_seqlens: np.ndarray | None  # int32 [n + 1] for thd, else None


def _read_rows(table: pa.Table, advantages: np.ndarray | list[float], vocab_size: int | None) -> _Rows:
    """The rows' list columns as numpy, checked: one advantage per row, at least one row, response columns of
    equal lengths, a prompt token in every row, and (with ``vocab_size``) every token id in the vocabulary."""
    n = table.num_rows
    adv = np.asarray(advantages, dtype=np.float32)
    if adv.shape != (n,):
        msg = f"got {adv.shape[0] if adv.ndim else 0} advantages for {n} rows"
        raise ValueError(msg)
    if n == 0:
        msg = "cannot pack an empty micro-batch"
        raise ValueError(msg)
    p_off, p_val = list_arrays(table.column("prompt_ids"))
    r_off, r_val = list_arrays(table.column("response_ids"))
    l_off, l_val = list_arrays(table.column("response_logprobs"))
    m_off, m_val = list_arrays(table.column("loss_mask"))
    v_off, v_val = (list_arrays(table.column("token_versions")) if "token_versions" in table.column_names
                    else (m_off, None))
    if vocab_size is not None:
        check_vocabulary(vocab_size, p_val, r_val)
    rlen = np.diff(r_off)
    if not all(np.array_equal(np.diff(off), rlen) for off in (l_off, m_off, v_off)):
        msg = "response_logprobs / loss_mask / token_versions lengths differ from response_ids lengths"
        raise ValueError(msg)
    if np.any(np.diff(p_off) < 1):
        msg = "every trajectory needs at least one prompt token"
        raise ValueError(msg)
    return _Rows(n=n, adv=adv, p_off=p_off, p_val=p_val, r_off=r_off, r_val=r_val, logprobs=l_val, mask=m_val,
                 versions=v_val)


def _layout(rows: _Rows, mode: PackMode, pad_to_multiple: int) -> _Layout:
    """Where every prompt and response token of ``rows`` goes under ``mode`` (see the module docstring)."""
    n, p_off, r_off = rows.n, rows.p_off, rows.r_off
    plen, rlen = np.diff(p_off), np.diff(r_off)
    seqlen = plen + rlen
    row_of_p = np.repeat(np.arange(n), plen)
    row_of_r = np.repeat(np.arange(n), rlen)
    col_p = np.arange(rows.p_val.size) - np.repeat(p_off[:-1], plen)  # position inside the row
    col_r = np.arange(rows.r_val.size) - np.repeat(r_off[:-1], rlen) + plen[row_of_r]
    if mode == "padded":
        width = -(-int(seqlen.max()) // pad_to_multiple) * pad_to_multiple
        shape = (n, width)
        return _Layout(shape=shape, at_p=(row_of_p, col_p), at_r=(row_of_r, col_r), at_r_prev=(row_of_r, col_r - 1),
                       last=(np.arange(n), seqlen - 1), cu_seqlens=None,
                       position_ids=np.broadcast_to(np.arange(width, dtype=np.int64), shape).copy())
    if mode == "thd":
        cu = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(seqlen, out=cu[1:])
        total = int(cu[-1])
        shape = (1, -(-total // pad_to_multiple) * pad_to_multiple)
        zeros_r = np.zeros(rows.r_val.size, dtype=np.int64)
        at_r = (zeros_r, cu[:-1][row_of_r] + col_r)
        pos = np.zeros(shape, dtype=np.int64)
        pos[0, :total] = np.arange(total) - cu[:-1][np.repeat(np.arange(n), seqlen)]
        return _Layout(shape=shape, at_p=(np.zeros(rows.p_val.size, dtype=np.int64), cu[:-1][row_of_p] + col_p),
                       at_r=at_r, at_r_prev=(zeros_r, at_r[1] - 1), last=(np.zeros(n, dtype=np.int64), cu[1:] - 1),
                       position_ids=pos, cu_seqlens=cu)
    msg = f"unknown pack mode {mode!r}"
    raise ValueError(msg)


def pack_tensors(table: pa.Table, advantages: np.ndarray | list[float], *, mode: PackMode = "padded",
                 pad_to_multiple: int = 1, vocab_size: int | None = None) -> PackedBatch:
    """Pack fetched trajectory rows (in plan order) and their advantages into one micro-batch's arrays.

    With ``vocab_size`` every prompt and response token id is checked against the model's vocabulary
    (:class:`TokenOutOfVocabularyError` names both sizes and the fix).
    """
    rows = _read_rows(table, advantages, vocab_size)
    at = _layout(rows, mode, pad_to_multiple)
    tokens = np.zeros(at.shape, dtype=np.int64)
    tokens[at.at_p] = rows.p_val
    tokens[at.at_r] = rows.r_val
    labels = np.zeros(at.shape, dtype=np.int64)
    labels[:, :-1] = tokens[:, 1:]
    labels[at.last] = 0  # the last token of a sequence predicts nothing (thd: not the next sequence)
    rollout = np.zeros(at.shape, dtype=np.float32)
    rollout[at.at_r_prev] = rows.logprobs
    mask = np.zeros(at.shape, dtype=np.float32)
    mask[at.at_r_prev] = rows.mask
    advs = np.zeros(at.shape, dtype=np.float32)
    advs[at.at_r_prev] = rows.adv[np.repeat(np.arange(rows.n), np.diff(rows.r_off))]
    versions = None
    if rows.versions is not None:
        versions = np.zeros(at.shape, dtype=np.int64)
        versions[at.at_r_prev] = rows.versions
    return PackedBatch(tokens=tokens, labels=labels, position_ids=at.position_ids, rollout_logprobs=rollout,
                       loss_mask=mask, advantages=advs, cu_seqlens=at.cu_seqlens, rows=rows.n,
                       tokens_total=int(rows.p_val.size + rows.r_val.size), token_versions=versions)


def block_causal_mask(cu_seqlens: Any, width: int) -> Any:
    """``[1, 1, width, width]`` bool mask, True = masked: causal and within each packed sequence."""
    import torch

    cu = cu_seqlens.to(torch.int64)
    seg = torch.bucketize(torch.arange(width), cu[1:], right=True)  # sequence index of each position
    same = seg.unsqueeze(0) == seg.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return ~(same & causal).view(1, 1, width, width)
