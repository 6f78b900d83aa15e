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

Read: a rank reads exactly its micro-batch's rows, in plan order, with
``tq.kv_batch_get(keys, partition_id, select_fields=PACK_COLUMNS)``: TQ's controller resolves the
keys to global indexes (``kv_retrieve_meta``, ``create=False``), then the client gathers the rows
from the storage units (``get_data``) into one ``TensorDict``; the rank turns that into the Arrow
columns of :data:`~train.packing.PACK_COLUMNS` (numpy views of the nested tensors' values and
offsets) and packs them with :func:`~train.packing.pack`, as every other path does.

TransferQueue calls used: ``tq.init``, ``tq.kv_batch_put``, ``tq.kv_batch_get``, ``tq.close``
(and Ray's ``ray.get_actor`` / ``ray.kill``). Not used: ``get_meta`` with ``task_name`` (TQ's
sampler-driven consumption, which cannot address given rows), ``StreamingDataLoader``.

Fidelity notes:

* KV reads never consume: the controller builds their metadata in ``force_fetch`` mode and leaves
  every task's consumption status alone, so repeated steps and :meth:`TQPath.fetch_latencies` read
  the same rows again without resetting anything.
* verl's driver resolves a batch's keys once (``kv_batch_meta2batch_meta``) and dispatches a
  ``BatchMeta`` chunk per rank, whose worker calls ``get_data``; here each rank resolves its own
  micro-batch's keys (one controller round trip per micro-batch, inside the rank's clock) because
  the plan, not the driver, says which rows a rank reads, and micro-batches are read one by one.
* Only the trainer's columns are written (the tiny scalar metadata columns are carried as tags).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from bench.cluster.workload import Workload
from bench.peers.common import MicroSpec, run_micro_batches

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


def read_rows(keys: list[str]) -> Any:
    """The trainer's columns of ``keys``, in order, through this process's TransferQueue client (a ``TensorDict``)."""
    import transfer_queue as tq

    from train.packing import PACK_COLUMNS

    return tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=list(PACK_COLUMNS))


def payload_bytes(td: Any) -> int:
    """Payload bytes of a read ``TensorDict``: tensor data (nested tensors' values) plus the ids' UTF-8."""
    from train.packing import PACK_COLUMNS

    total = 0
    for name in PACK_COLUMNS:
        v = td[name]
        if name == "group_id":
            total += sum(len(str(g).encode()) for g in v.tolist())
        else:
            total += (v.values() if v.is_nested else v).nbytes
    return int(total)


def to_table(td: Any) -> pa.Table:
    """A read ``TensorDict`` as the Arrow table of :data:`~train.packing.PACK_COLUMNS` (views, no copies of values)."""
    import numpy as np

    from train.packing import PACK_COLUMNS

    cols: dict[str, pa.Array] = {
        "group_id": pa.array([str(g) for g in td["group_id"].tolist()], type=pa.string()),
        "sample_idx": pa.array(td["sample_idx"].numpy()),
    }
    for name in LIST_COLUMNS:
        nt = td[name]
        offsets = nt.offsets().numpy().astype(np.int32)
        cols[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(nt.values().numpy()))
    return pa.table({name: cols[name] for name in PACK_COLUMNS})


class TQRank:
    """One trainer rank reading through its own TransferQueue client (attached to the driver's controller)."""

    def __init__(self, rank: int) -> None:
        import transfer_queue as tq

        self.rank = rank
        tq.init()  # the controller exists: this only starts this process's client

    def ready(self) -> int:
        import torch  # noqa: F401  (import cost outside the clock)

        import train.packing
        import train.prefetch  # noqa: F401

        return self.rank

    def step(self, micros: list[MicroSpec], ms_per_ktok: float, depth: int, checksums: bool = False) -> dict[str, Any]:
        return run_micro_batches(micros, self.get, ms_per_ktok=ms_per_ktok, depth=depth, checksums=checksums)

    def get(self, spec: MicroSpec) -> dict[str, Any]:
        """Read one micro-batch's rows from TransferQueue and pack them into the trainer's tensors."""
        from train.packing import pack

        td = read_rows(row_keys(spec["rows"]))
        tensors = pack(to_table(td), spec["advantages"], mode="padded").to_torch()
        return {"tensors": tensors, "bytes": payload_bytes(td)}


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
        import ray

        return list(ray.get([r.step.remote(m, ms_per_ktok, depth, checksums)
                             for r, m in zip(self.ranks, per_rank, strict=True)]))

    def fetch_latencies(self, micros: list[MicroSpec]) -> list[float]:
        """One ``kv_batch_get`` of each micro-batch's rows in this process (data only: no packing, no compute)."""
        out = []
        for m in micros:
            keys = row_keys(m["rows"])
            t0 = time.perf_counter()
            read_rows(keys)
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
