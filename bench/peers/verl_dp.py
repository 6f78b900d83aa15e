"""verl's path in the peers benchmark: the driver holds each train batch as one DataProto and dispatches it.

This is verl's real single-controller data path, run on CPU. The driver builds, outside the clock,
one :class:`verl.protocol.DataProto` per train step (``DataProto.from_dict`` of verl's right-padded
batch layout, :func:`bench.cluster.workload.dataproto_shards`), as verl's driver holds the rollout
output. The ranks are a :class:`verl.single_controller.ray.RayWorkerGroup` of
:class:`verl.single_controller.base.Worker` subclasses (:func:`_rank_worker_class`), placed in a
CPU-only :class:`verl.single_controller.ray.RayResourcePool` (``use_gpu=False``, one ``{"CPU": 1}``
bundle per rank). A step calls the worker group's method as verl's trainer calls ``update_actor``:

- ``default``: ``update_actor`` is registered ``Dispatch.DP_COMPUTE_PROTO``: verl's dispatch
  ``DataProto.chunk``\\ s the batch into ``ranks`` equal chunks and passes chunk ``r`` to rank ``r``
  in the actor call, so Ray pickles it (``DataProto.__getstate__``: ``consolidate`` + ``torch.save``
  into bytes) on the driver and the rank unpickles it (``__setstate__``: ``torch.load``). The ranks'
  return values (a DataProto whose ``meta_info["metrics"]`` is the rank's record) are gathered by
  verl's collect (``DataProto.concat``).
- ``numpy``: the same with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``: ``__getstate__`` turns
  each tensor into a uint8 numpy view (``serialize_tensordict``; pickled out of band by Ray) and
  ``__setstate__`` copies it back into a tensor. verl reads the variable at pickling time, so it is
  set on the driver around each step (verl's ``temp_env_var``) and in the ranks' environment
  (``RayWorkerGroup(worker_env=...)``); ``default`` sets it to ``torch`` in both (any other value).
- ``objectref``: the driver ``DataProto.chunk``\\ s the batch and ``ray.put``\\ s the chunks (verl's
  ``parallel_put``, as its n-d dispatch does), and hands rank ``r`` a
  :class:`verl.protocol.DataProtoFuture` of its one ObjectRef through ``update_actor_future``
  (``Dispatch.DP_COMPUTE``: one argument per rank). verl's ``register`` wrapper materializes it on
  the rank (``DataProtoFuture.get``: ``ray.get`` then ``DataProto.concat`` of the one chunk, which
  copies it once more) before the method body runs. Default serialization.

A rank splits its chunk into its micro-batches (row counts of its specs, in order; verl's actor
splits its mini-batch the same way, ``DataProto`` slices) and runs :func:`~bench.peers.common.run_micro_batches`
on them with ``depth=0``: the chunk is already all on the rank, a micro-batch is a slice of it.

Layout: a step's rows are rank 0's micro-batches' rows (in order), then rank 1's, ..., every tensor
padded to the step's longest row (verl pads the whole batch). verl's ``DataProto.chunk`` only splits
into equal chunks, so when the ranks have different row counts each rank's rows are followed by
all-zero padding rows up to the largest (``pad_rows`` in :meth:`VerlPath.load`; verl itself balances
its batch to equal rows per rank); padding rows travel but are never in a micro-batch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from typing import Any, cast

import numpy as np
import pyarrow as pa

from bench.cluster.workload import Workload, dataproto_shards
from bench.peers.common import Encoder, MicroSpec, run_micro_batches

log = logging.getLogger(__name__)

MODES = ("default", "numpy", "objectref")
"""How a step's DataProto reaches the ranks (see the module docstring)."""

SERIALIZATION_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"
"""verl's switch between ``torch.save`` (any value but ``numpy``) and numpy DataProto pickling."""


@functools.cache
def _rank_worker_class() -> Any:
    """The rank: a verl ``Worker`` whose registered methods the worker group binds (built on first use).

    Defined here so that importing this module does not import verl (Ray ships the class by value).
    """
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch as _Dispatch
    from verl.single_controller.base.decorator import register

    dispatch: Any = _Dispatch  # a DynamicEnum: its modes are registered at import time

    class VerlRankWorker(Worker):
        """One trainer rank: receives its DataProto chunk, splits it into its micro-batches, computes."""

        @register(dispatch_mode=dispatch.ONE_TO_ALL)
        def ready(self) -> int:
            import torch  # noqa: F401  (import cost outside the clock)

            import bench.peers.common  # noqa: F401

            return int(self.rank)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def update_actor(self, data: Any) -> Any:
            """``default``/``numpy``: ``data`` is this rank's chunk, unpickled by Ray before this runs."""
            return self._train(data, time.time())

        @register(dispatch_mode=dispatch.DP_COMPUTE)
        def update_actor_future(self, data: Any) -> Any:
            """``objectref``: ``data`` was a DataProtoFuture, materialized by verl's ``register`` wrapper."""
            return self._train(data, time.time())

        def _train(self, data: Any, t_in: float) -> Any:
            meta = data.meta_info
            micros: list[MicroSpec] = meta["micros"][self.rank]
            starts = np.concatenate([[0], np.cumsum([m["n_rows"] for m in micros])])
            seen: set[bytes] = set()  # images this mini-batch encoded (dedup: found by hashing the pixels)
            mini = [-1]

            def get(spec: MicroSpec) -> dict[str, Any]:
                i = spec["index"]
                mb = data[int(starts[i]):int(starts[i + 1])]  # DataProto.slice: views of the chunk
                tensors = dict(mb.batch.items())
                value = {"tensors": tensors, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
                pixels = tensors.pop("pixel_values", None)
                if pixels is not None:  # every row carries its images: [rows, images per row, ...]
                    flat = pixels.reshape(-1, *pixels.shape[2:])
                    if meta["dedup"]:
                        if spec["mini"] != mini[0]:
                            mini[0] = spec["mini"]
                            seen.clear()
                        new = []
                        for j in range(flat.shape[0]):
                            digest = hashlib.blake2b(flat[j].numpy(), digest_size=16).digest()
                            if digest not in seen:
                                seen.add(digest)
                                new.append(j)
                        flat = flat[new]
                    value["encode"] = flat
                return value

            rec = run_micro_batches(micros, get, ms_per_ktok=meta["ms_per_ktok"], depth=0,
                                    checksums=meta["checksums"], encoder=Encoder(meta["ms_per_image"]))
            rec.update(rank=self.rank, recv_s=t_in - meta["t_dispatch"], chunk_rows=len(data))
            return DataProto.from_dict(meta_info={"metrics": rec})

    return VerlRankWorker


class VerlPath:
    """verl's path: the driver's DataProto dispatched through a ``RayWorkerGroup`` (module docstring)."""

    def __init__(self, w: Workload, mode: str, *, checksums: bool = False) -> None:
        """Start the ``w.ranks`` ranks (a worker group on a CPU-only resource pool) and wait for them.

        ``checksums``: each rank's record also gets every micro-batch's
        :func:`~bench.peers.common.checksum` (for tests).
        """
        t0 = time.perf_counter()
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        if mode not in MODES:
            msg = f"mode={mode!r} is not one of {MODES}"
            raise ValueError(msg)
        free = ray.available_resources().get("CPU", 0)
        if free < w.ranks:  # verl's placement group would wait for them forever
            msg = f"verl's worker group needs {w.ranks} free Ray CPUs, the cluster has {free}"
            raise RuntimeError(msg)
        self.w, self.mode, self.checksums = w, mode, checksums
        self.name = f"verl_dataproto_{mode}"
        self.env_value = "numpy" if mode == "numpy" else "torch"
        self.batches: list[Any] = []
        self.rank_rows: list[list[int]] = []
        self.pad_rows = 0
        # One {"CPU": 1} bundle per rank, no accelerator resource: max_colocate_count is a bundle's CPUs
        # (verl's default 10 per rank would not fit the cluster and the placement group would never be ready).
        self.pool: Any = RayResourcePool(process_on_nodes=[w.ranks], use_gpu=False, max_colocate_count=1)
        self.group: Any = cast(Any, RayWorkerGroup(
            resource_pool=self.pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(_rank_worker_class())),
            worker_env={SERIALIZATION_ENV: self.env_value}))
        ranks = self.group.ready()
        self.startup_s = time.perf_counter() - t0
        if list(ranks) != list(range(w.ranks)):
            msg = f"worker group ranks {ranks} are not 0..{w.ranks - 1}"
            raise RuntimeError(msg)
        log.info("%s: %d ranks up in %.1f s", self.name, w.ranks, self.startup_s)

    def load(self, groups: list[pa.RecordBatch], steps: list[list[list[MicroSpec]]],
             images: dict[bytes, np.ndarray] | None = None) -> dict[str, Any]:
        """Build each step's DataProto on the driver (outside the clock); payload bytes of all their tensors.

        With ``images`` (key -> array), each row also carries its images, replicated from the rows' keys
        into ``pixel_values`` ``[rows, images per row, ...]`` (DataProto rows hold their own pixels).
        Returns ``bytes`` (tensor bytes of all steps, padding included), ``rows`` (real rows),
        ``pad_rows`` (rows added to equalise the ranks' chunks), ``build_s``, ``startup_s``.
        """
        import torch
        from verl.protocol import DataProto

        t0 = time.perf_counter()
        table = pa.Table.from_batches(groups)
        gid = table.column("group_id").to_pylist()
        sidx = table.column("sample_idx").to_pylist()
        where = {(g, int(i)): n for n, (g, i) in enumerate(zip(gid, sidx, strict=True))}
        self.batches, self.rank_rows, self.pad_rows = [], [], 0
        nbytes = rows = 0
        for per_rank in steps:
            if len(per_rank) != self.w.ranks:
                msg = f"a step has {len(per_rank)} ranks' micro-batches, the workload {self.w.ranks} ranks"
                raise ValueError(msg)
            idx = [[where[(g, int(i))] for m in micros for g, i in m["rows"]] for micros in per_rank]
            adv = np.array([a for micros in per_rank for m in micros for a in m["advantages"]], dtype=np.float32)
            flat = [n for r in idx for n in r]
            if len(adv) != len(flat):
                msg = f"{len(adv)} advantages for {len(flat)} rows"
                raise ValueError(msg)
            taken = table.take(pa.array(flat, type=pa.int64()))
            batch = dataproto_shards(taken, adv, 1)[0]
            if images is not None:
                batch["pixel_values"] = torch.from_numpy(np.stack([np.stack([images[k] for k in keys])
                                                                   for keys in taken.column("image_keys").to_pylist()]))
            per = max(len(r) for r in idx)
            if any(len(r) != per for r in idx):  # equal chunks: pad each rank's rows up to the largest
                dest = np.concatenate([r * per + np.arange(len(x)) for r, x in enumerate(idx)])
                padded = {}
                for k, v in batch.items():
                    out = torch.zeros((per * len(idx), *v.shape[1:]), dtype=v.dtype)
                    out[torch.from_numpy(dest)] = v
                    padded[k] = out
                batch = padded
                self.pad_rows += per * len(idx) - len(flat)
            rows += len(flat)
            self.rank_rows.append([len(r) for r in idx])
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
            self.batches.append(DataProto.from_dict(tensors=batch))
        return {"bytes": nbytes, "rows": rows, "pad_rows": self.pad_rows, "build_s": time.perf_counter() - t0,
                "startup_s": self.startup_s}

    def step(self, s: int, per_rank: list[list[MicroSpec]], ms_per_ktok: float, ms_per_image: float = 0.0,
             dedup: bool = False) -> list[dict[str, Any]]:
        """One train step: dispatch step ``s``'s DataProto to the ranks as the mode says; their records.

        Each rank's record is :func:`~bench.peers.common.run_micro_batches`' plus ``rank``,
        ``chunk_rows`` and ``recv_s``: wall time from just before the driver dispatched (chunking,
        pickling, ``ray.put`` and the actor call included) to the rank's method starting with its
        chunk unpickled (``objectref``: materialized from the object store); driver and ranks share one
        host's clock.
        """
        from verl.protocol import DataProto, DataProtoFuture
        from verl.utils.py_functional import temp_env_var
        from verl.utils.ray_utils import parallel_put

        data = self.batches[s]
        if [sum(len(m["rows"]) for m in ms) for ms in per_rank] != self.rank_rows[s]:
            msg = f"step {s}: the ranks' micro-batches are not the rows loaded for it ({self.rank_rows[s]} per rank)"
            raise ValueError(msg)
        micros = [[{"index": i, "mini": m["mini"], "n_rows": len(m["rows"]), "tokens": int(m["tokens"])}
                   for i, m in enumerate(ms)] for ms in per_rank]
        with temp_env_var(SERIALIZATION_ENV, self.env_value):
            data.meta_info = {"micros": micros, "ms_per_ktok": ms_per_ktok, "checksums": self.checksums,
                              "ms_per_image": ms_per_image, "dedup": dedup,
                              "t_dispatch": time.time()}
            if self.mode == "objectref":
                refs = parallel_put(data.chunk(self.w.ranks), max_workers=self.w.ranks)
                futures = [DataProtoFuture(collect_fn=DataProto.concat, futures=[ref]) for ref in refs]
                out = DataProto.concat(self.group.update_actor_future(futures))
            else:
                out = self.group.update_actor(data)
        metrics = out.meta_info["metrics"]
        recs = [{k: v[r] for k, v in metrics.items()} for r in range(self.w.ranks)]
        if [rec["rank"] for rec in recs] != list(range(self.w.ranks)):
            msg = f"records out of rank order: {[rec['rank'] for rec in recs]}"
            raise RuntimeError(msg)
        return recs

    def close(self) -> None:
        """Kill the ranks and remove their placement group (Ray itself stays up)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.group.workers:
            ray.kill(worker)
        for pg in self.pool.pgs or []:
            remove_placement_group(pg)
        self.batches = []
