"""What every path of the peers benchmark shares: the per-rank micro-batch specs, the compute, the step loop.

Every path delivers the same rows to the same rank in the same micro-batches (:func:`step_specs`,
from the admission planner's plans), ends each micro-batch with torch tensors, and runs the same
compute on them (:func:`compute`): every tensor is touched (a reduction), then the rank is held for
``ms_per_ktok`` per thousand real tokens with the CPU free, as an accelerator step would.
:func:`run_micro_batches` is the rank's step loop every path uses: it gets micro-batch ``i + 1``
on a prefetch thread while ``i`` computes (``depth=0``: no overlap), within one train step only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from schemas.plan import MiniBatchPlan

MicroSpec = dict[str, Any]
"""One micro-batch of one rank: ``mini`` (its mini-batch in the step), ``rows`` ([group_id, sample_idx] in
order), ``slices`` ([node, group_id, start, stop]), ``advantages`` (one per row), ``tokens`` (prompt +
response, no padding)."""


def step_specs(plans: Sequence[MiniBatchPlan], mini_batches: int, ranks: int) -> list[list[list[MicroSpec]]]:
    """The plans as ``[step][rank] -> micro-batches`` (each rank's mini-batches one after another)."""
    steps: list[list[list[MicroSpec]]] = []
    for s in range(len(plans) // mini_batches):
        per_rank: list[list[MicroSpec]] = [[] for _ in range(ranks)]
        for mini, plan in enumerate(plans[s * mini_batches:(s + 1) * mini_batches]):
            for r in range(ranks):
                for mb in plan.for_rank(r).micro_batches:
                    per_rank[r].append({"mini": mini,
                        "rows": [[sl.group_id, i] for sl in mb.slices for i in range(sl.start, sl.stop)],
                        "slices": [[sl.node, sl.group_id, sl.start, sl.stop] for sl in mb.slices],
                        "advantages": list(mb.advantages), "tokens": int(mb.tokens)})
        steps.append(per_rank)
    return steps


def _flat(t: Any) -> Any:
    """A tensor's elements as one dense tensor (a jagged nested tensor's values)."""
    return t.values() if t.is_nested else t


def tensor_bytes(t: Any) -> int:
    """Payload bytes of a tensor (a nested tensor's values; its offsets are not counted)."""
    v = _flat(t)
    return int(v.numel() * v.element_size())


def arrow_payload_bytes(table: Any) -> int:
    """Payload bytes of fetched Arrow rows, counted as :func:`bench.peers.tq.payload_bytes` counts a
    ``TensorDict``: list columns' values, fixed-width columns' values, strings' UTF-8 (no offsets, no validity)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for col in table.columns:
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if pa.types.is_list(arr.type):
            arr = arr.flatten()
        if pa.types.is_string(arr.type) or pa.types.is_binary(arr.type):
            total += int(pc.sum(pc.binary_length(arr)).as_py() or 0)
        else:
            total += len(arr) * arr.type.bit_width // 8
    return total


def compute(tensors: dict[str, Any], tokens: int, ms_per_ktok: float) -> None:
    """The same compute on every path: touch every tensor, then hold the rank ``ms_per_ktok`` per 1k tokens."""
    t0 = time.perf_counter()
    for t in tensors.values():
        if t is not None:
            _ = float(_flat(t).float().sum())
    hold = ms_per_ktok * tokens / 1e6 - (time.perf_counter() - t0)
    if hold > 0:
        time.sleep(hold)  # accelerator busy, CPU free


def checksum(tensors: dict[str, Any]) -> list[float]:
    """``[sum of token ids, sum of advantages]`` of a micro-batch, whatever its layout (padding is 0 in
    every path's tensors: knittrans' and TransferQueue's ``tokens``, verl's ``input_ids``, padded or nested)."""
    tokens = _flat(tensors["tokens"] if "tokens" in tensors else tensors["input_ids"])
    return [float(tokens.sum()), round(float(tensors["advantages"].double().sum()), 3)]


class Encoder:
    """The vision encoder's stand-in: a forward over a batch of images that touches them, then holds the rank
    ``ms_per_image`` per image (CPU free); :attr:`passes` counts the images that went through it."""

    def __init__(self, ms_per_image: float) -> None:
        self.ms_per_image = ms_per_image
        self.passes = 0

    def forward(self, images: Any) -> None:
        t0 = time.perf_counter()
        n = int(images.shape[0])
        if n:
            _ = float(images.reshape(n, -1)[:, ::64].float().sum())  # touch every image
        self.passes += n
        hold = self.ms_per_image * n / 1e3 - (time.perf_counter() - t0)
        if hold > 0:
            time.sleep(hold)


def run_micro_batches(micros: Sequence[MicroSpec], get: Callable[[MicroSpec], dict[str, Any]], *,
                      ms_per_ktok: float, depth: int = 1, checksums: bool = False,
                      encoder: Encoder | None = None) -> dict[str, Any]:
    """One train step on one rank: ``get`` each micro-batch (prefetched ``depth`` ahead), compute on it.

    ``get(spec)`` returns ``{"tensors": dict of torch tensors, "bytes": payload bytes received}``, and
    with images ``"encode"``: the images the micro-batch must put through ``encoder`` (before its compute).
    Returns the rank's record: ``start`` and ``end`` (``time.time()``, to set against the driver's
    clock: a path whose data arrives with the call has its transfer before ``start``), ``step_s``
    (wall), ``first_wait_s`` (until the first micro-batch was there), ``wait_s`` (all time blocked
    on data), ``fetch_s`` (time spent getting, overlapped or not), ``tokens``, ``bytes``, ``micro_batches``;
    with ``checksums``, also each micro-batch's :func:`checksum` (to check that every path delivered the same);
    with ``encoder``, ``encoder_passes`` (images its forward saw in this step).
    """
    from train.prefetch import Prefetcher

    t0 = time.perf_counter()
    rec: dict[str, Any] = {"start": time.time(), "wait_s": 0.0, "fetch_s": 0.0, "tokens": 0, "bytes": 0,
                           "micro_batches": len(micros)}
    if checksums:
        rec["checksums"] = []
    passes0 = encoder.passes if encoder is not None else 0
    waits = []
    if depth > 0:
        pf = Prefetcher(get, depth=depth)
        try:
            pf.submit(micros)
            for spec in micros:
                got = pf.get(timeout=300)
                waits.append(got.wait_s)
                rec["fetch_s"] += got.fetch_s
                _account(rec, got.value, spec, ms_per_ktok, encoder)
        finally:
            pf.close()
    else:
        for spec in micros:
            t1 = time.perf_counter()
            value = get(spec)
            waits.append(time.perf_counter() - t1)
            rec["fetch_s"] += waits[-1]
            _account(rec, value, spec, ms_per_ktok, encoder)
    if encoder is not None:
        rec["encoder_passes"] = encoder.passes - passes0
    rec.update(wait_s=sum(waits), first_wait_s=waits[0] if waits else 0.0, step_s=time.perf_counter() - t0,
               end=time.time())
    return rec


def _account(rec: dict[str, Any], value: dict[str, Any], spec: MicroSpec, ms_per_ktok: float,
             encoder: Encoder | None) -> None:
    rec["tokens"] += spec["tokens"]
    rec["bytes"] += value["bytes"]
    if "wire_bytes" in value:
        rec["wire_bytes"] = rec.get("wire_bytes", 0) + value["wire_bytes"]
    if "checksums" in rec:
        rec["checksums"].append(checksum(value["tensors"]))
    if encoder is not None and value.get("encode") is not None:
        encoder.forward(value["encode"])
    compute(value["tensors"], spec["tokens"], ms_per_ktok)
