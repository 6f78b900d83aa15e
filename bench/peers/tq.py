"""TransferQueue's path in the peers benchmark: the real ``transfer_queue`` package (0.1.x) under verl's usage.

:class:`TQPath` starts TransferQueue in the driver (``tq.init``: its controller and two
SimpleStorage units, Ray actors of their own) and one :class:`TQRank` Ray actor per trainer rank,
each with its own TransferQueue client (``tq.init()`` in the actor attaches to the running
controller). Ray must already be up (with ``num_cpus >= 3``: TQ's controller and storage units take
one CPU each) and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` / ``TQ_NUM_THREADS`` set before it started.

Write, as verl's rollout (``AgentLoopWorkerTQ``) does: one ``tq.kv_batch_put`` per prompt group,
a key per trajectory (``f"{group_id}:{sample_idx}"``), the trajectory's fields as a ``TensorDict``
(list columns as jagged nested tensors of their Arrow dtypes, ``group_id`` a ``NonTensorStack``),
length tags per key as verl's are (``status``, ``prompt_len``, ``response_len``, ``seq_len``).

Read, as verl drives TransferQueue in its trainer: the driver resolves the step's keys to metadata
once (``verl/protocol.py``, ``BatchData.chunk``: "early translate KVBatchMeta -> BatchMeta to prevent
frequent controller communication during PUT/GET in each rank", via
``verl/utils/transferqueue_utils.py``'s ``kv_batch_meta2batch_meta``: the client's
``kv_retrieve_meta(keys, partition_id, create=False)`` then ``select_fields``), here every rank's rows
in plan order in one call inside the step's clock, and hands each rank its ``BatchMeta`` chunk
(:meth:`TQPath.step`). The rank reads with its own client's ``get_data`` (``transfer_queue/client.py``;
verl's ``tqbridge`` calls it on the worker), one call per micro-batch on the prefetch thread (the rank's
chunk sliced by ``BatchMeta.__getitem__``), so micro-batch i+1 is read while i computes, as on every
other path. verl uses neither ``StreamingDataLoader`` nor ``get_meta`` with a task name on this path (its
trainer and ``tqbridge`` go through the KV metadata above). The rank packs the ``TensorDict`` it got
into the trainer's tensors directly (:func:`pack_tensordict`: the same vectorised scatter as
:func:`train.packing.pack_tensors`, on the nested tensors' values and offsets, no Arrow in between).

TransferQueue calls used: ``tq.init``, ``tq.kv_batch_put``, ``tq.get_client().kv_retrieve_meta``,
``BatchMeta.select_fields`` / ``__getitem__``, the client's ``get_data``, ``tq.close`` (and Ray's
``ray.get_actor`` / ``ray.kill``).

Fidelity notes:

* KV reads never consume: the controller builds their metadata in ``force_fetch`` mode and leaves
  every task's consumption status alone, so repeated steps and :meth:`TQPath.fetch_latencies` read
  the same rows again without resetting anything.
* Only the trainer's columns are written (the tiny scalar metadata columns are carried as tags).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from bench.cluster.workload import Workload
from bench.peers.common import MicroSpec, run_micro_batches, tensor_bytes

log = logging.getLogger(__name__)

PARTITION = "train"
"""TransferQueue partition the trajectories go to (verl's name for training data)."""
STORAGE_UNITS = 2
"""SimpleStorage units TransferQueue spreads the samples over (``global_index % units``)."""
LIST_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask")
"""Trajectory list columns, stored as jagged nested tensors."""
_CONTROLLER = ("TransferQueueController", "transfer_queue")
"""Name and namespace of TransferQueue's controller actor."""


def row_keys(rows: list[list[Any]]) -> list[str]:
    """TransferQueue keys of ``[group_id, sample_idx]`` rows, in order."""
    return [f"{g}:{int(i)}" for g, i in rows]


def group_fields(group: pa.RecordBatch) -> tuple[list[str], Any, list[dict[str, Any]], int]:
    """One prompt group as a ``kv_batch_put``: ``(keys, TensorDict, tags, payload bytes)``."""
    import numpy as np
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    from train.packing import list_arrays

    gids = group.column("group_id").to_pylist()
    sidx = group.column("sample_idx").to_numpy().astype(np.int32)  # a copy: torch wants writable arrays
    fields: dict[str, Any] = {"group_id": NonTensorStack(*gids), "sample_idx": torch.from_numpy(sidx)}
    nbytes = sidx.nbytes + sum(len(g.encode()) for g in gids)
    lengths: dict[str, np.ndarray] = {}
    for name in LIST_COLUMNS:
        offsets, values = list_arrays(group.column(name))
        vals = torch.from_numpy(values.copy())
        fields[name] = torch.nested.nested_tensor_from_jagged(vals, torch.from_numpy(offsets.astype(np.int64)))
        nbytes += vals.nbytes
        lengths[name] = np.diff(offsets)
    plen, rlen = lengths["prompt_ids"], lengths["response_ids"]
    tags = [{"status": "success", "prompt_len": int(p), "response_len": int(r), "seq_len": int(p + r)}
            for p, r in zip(plen, rlen, strict=True)]
    keys = row_keys([[g, i] for g, i in zip(gids, sidx, strict=True)])
    return keys, TensorDict(fields, batch_size=[len(gids)]), tags, int(nbytes)


def resolve(rows: list[list[Any]]) -> Any:
    """The ``BatchMeta`` of ``rows`` (in order, the trainer's columns), resolved by TransferQueue's controller."""
    import transfer_queue as tq

    from train.packing import PACK_COLUMNS

    meta = tq.get_client().kv_retrieve_meta(keys=row_keys(rows), partition_id=PARTITION, create=False)
    return meta.select_fields(list(PACK_COLUMNS))


def payload_bytes(td: Any) -> int:
    """Payload bytes of a read ``TensorDict``: tensor data (nested tensors' values) plus the ids' UTF-8 (as
    :func:`bench.peers.common.arrow_payload_bytes` counts knittrans' rows)."""
    from train.packing import PACK_COLUMNS

    total = 0
    for name in PACK_COLUMNS:
        v = td[name]
        if name == "group_id":
            total += sum(len(str(g).encode()) for g in v.tolist())
        else:
            total += tensor_bytes(v)
    return int(total)


def pack_tensordict(td: Any, advantages: list[float]) -> dict[str, Any]:
    """A read ``TensorDict`` packed into the trainer's padded tensors: :func:`train.packing.pack_tensors`'s layout and
    vectorised scatter, in torch on the nested tensors' values and offsets."""
    import torch

    def parts(name: str) -> tuple[Any, Any]:
        nt = td[name]
        off = nt.offsets()
        return off - off[0], nt.values()[int(off[0]):int(off[-1])]

    p_off, p_val = parts("prompt_ids")
    r_off, r_val = parts("response_ids")
    _, l_val = parts("response_logprobs")
    _, m_val = parts("loss_mask")
    plen, rlen = p_off.diff(), r_off.diff()
    n = int(plen.numel())
    seqlen = plen + rlen
    width = int(seqlen.max())
    rows = torch.arange(n)
    row_p, row_r = torch.repeat_interleave(rows, plen), torch.repeat_interleave(rows, rlen)
    col_p = torch.arange(p_val.numel()) - torch.repeat_interleave(p_off[:-1], plen)
    col_r = torch.arange(r_val.numel()) - torch.repeat_interleave(r_off[:-1], rlen) + plen[row_r]
    tokens = torch.zeros((n, width), dtype=torch.int64)
    tokens[row_p, col_p] = p_val.long()
    tokens[row_r, col_r] = r_val.long()
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[rows, seqlen - 1] = 0
    out: dict[str, Any] = {"tokens": tokens, "labels": labels,
           "position_ids": torch.arange(width, dtype=torch.int64).expand(n, width).clone()}
    for name, values in (("rollout_logprobs", l_val.float()), ("loss_mask", m_val.float()),
                         ("advantages", torch.tensor(advantages, dtype=torch.float32)[row_r])):
        t = torch.zeros((n, width), dtype=torch.float32)
        t[row_r, col_r - 1] = values
        out[name] = t
    out["cu_seqlens"] = None
    return out


class TQRank:
    """One trainer rank reading through its own TransferQueue client (attached to the driver's controller)."""

    def __init__(self, rank: int) -> None:
        import transfer_queue as tq

        self.rank = rank
        tq.init()  # the controller exists: this only starts this process's client

    def ready(self) -> int:
        import torch  # noqa: F401  (import cost outside the clock)

        import train.prefetch  # noqa: F401

        return self.rank

    def step(self, micros: list[MicroSpec], chunk: Any, ms_per_ktok: float, depth: int,
             checksums: bool = False) -> dict[str, Any]:
        """One train step over ``micros``, whose rows are ``chunk`` (this rank's ``BatchMeta``) in order."""
        import transfer_queue as tq

        client = tq.get_client()
        starts = [0]
        for m in micros:
            starts.append(starts[-1] + len(m["rows"]))
        index = {id(m): i for i, m in enumerate(micros)}

        def get(spec: MicroSpec) -> dict[str, Any]:
            i = index[id(spec)]
            td = client.get_data(chunk[starts[i]:starts[i + 1]])
            return {"tensors": pack_tensordict(td, spec["advantages"]), "bytes": payload_bytes(td)}

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=depth, checksums=checksums)


class TQPath:
    """The TransferQueue path: groups put through the driver's client, ranks read their rows by key."""

    name = "transferqueue"

    def __init__(self, w: Workload) -> None:
        import ray
        import transfer_queue as tq

        self.w = w
        t0 = time.perf_counter()
        tq.init({"backend": {"storage_backend": "SimpleStorage",
                             "SimpleStorage": {"num_data_storage_units": STORAGE_UNITS}}})
        self.tq_init_s = time.perf_counter() - t0
        """Seconds ``tq.init`` took (controller, storage units, the driver's client)."""
        actor = ray.remote(num_cpus=1)(TQRank)
        self.ranks: list[Any] = [actor.remote(r) for r in range(w.ranks)]  # type: ignore[attr-defined]
        ray.get([r.ready.remote() for r in self.ranks])
        self.start_s = time.perf_counter() - t0
        """Seconds TransferQueue and the rank actors took to start."""
        log.info("TransferQueue (%d storage units) up in %.1f s, with %d ranks in %.1f s", STORAGE_UNITS,
                 self.tq_init_s, w.ranks, self.start_s)

    def load(self, groups: list[pa.RecordBatch]) -> dict[str, Any]:
        """One ``kv_batch_put`` per group (as verl's rollout writes); wall time (conversion included), payload bytes."""
        import transfer_queue as tq

        t0 = time.perf_counter()
        nbytes = 0
        for g in groups:
            keys, fields, tags, n = group_fields(g)
            tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=fields, tags=tags)
            nbytes += n
        return {"put_s": time.perf_counter() - t0, "bytes": nbytes}

    def step(self, per_rank: list[list[MicroSpec]], ms_per_ktok: float, depth: int = 1,
             checksums: bool = False) -> list[dict[str, Any]]:
        """The step's metadata resolved once (every rank's rows, one controller call), a chunk to each rank."""
        import ray

        meta = resolve([row for micros in per_rank for m in micros for row in m["rows"]])
        chunks, at = [], 0
        for micros in per_rank:
            n = sum(len(m["rows"]) for m in micros)
            chunks.append(meta[at:at + n])
            at += n
        return list(ray.get([r.step.remote(m, c, ms_per_ktok, depth, checksums)
                             for r, m, c in zip(self.ranks, per_rank, chunks, strict=True)]))

    def fetch_latencies(self, micros: list[MicroSpec]) -> list[float]:
        """One ``get_data`` of each micro-batch's rows in this process (data only: no packing, no compute), its
        metadata resolved beforehand, once for all of ``micros`` (outside the clock, as once per step)."""
        import transfer_queue as tq

        client = tq.get_client()
        meta = resolve([row for m in micros for row in m["rows"]])
        out, at = [], 0
        for m in micros:
            part = meta[at:at + len(m["rows"])]
            at += len(m["rows"])
            t0 = time.perf_counter()
            client.get_data(part)
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Stop the rank actors, then TransferQueue (storage units, client, controller); Ray stays up."""
        import ray
        import transfer_queue as tq

        for r in self.ranks:
            ray.kill(r)
        tq.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill is asynchronous: let the controller's name go
            try:
                ray.get_actor(_CONTROLLER[0], namespace=_CONTROLLER[1])
            except ValueError:
                return
            time.sleep(0.1)
        log.warning("TransferQueue's controller still registered 30 s after close")
