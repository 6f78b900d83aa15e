r"""verl's path in the peers benchmark: the driver holds each train batch and dispatches it to the ranks.

This is verl 0.9.1's real single-controller data path, run on CPU. The driver builds, outside the clock,
one :class:`verl.protocol.DataProto` per train step (``DataProto.from_dict`` of verl's right-padded
batch layout, :func:`bench.cluster.workload.dataproto_shards`), as verl's driver holds the rollout
output. The ranks are a :class:`verl.single_controller.ray.RayWorkerGroup` of
:class:`verl.single_controller.base.Worker` subclasses (:func:`_rank_worker_class`), placed in a
CPU-only :class:`verl.single_controller.ray.RayResourcePool` (``use_gpu=False``, one ``{"CPU": 1}``
bundle per rank). A step hands the batch to the ranks in one of three ways (:data:`MODES`):

- ``trainer``: what verl 0.9.1's PPO trainer does (``verl/trainer/ppo/ray_trainer.py``,
  ``RayPPOTrainer._update_actor``): ``DataProto.to_tensordict`` then ``left_right_2_no_padding``
  (``verl/workers/utils/padding.py``: ``input_ids``/``position_ids`` become jagged nested tensors) on
  the driver, then the worker group's ``update_actor`` registered as its engine workers register it
  (``verl/workers/engine_workers.py``: ``make_nd_compute_dataproto_dispatch_fn(mesh_name=...)``):
  verl's dispatch (``verl/single_controller/base/decorator.py``, ``dispatch_lazy_compute_data_proto``)
  chunks the TensorDict per data-parallel rank (``BatchData.chunk``: ``chunk_tensordict``, then
  ``contiguous(...).consolidate()``), ``ray.put``\ s the chunks (``parallel_put``) and passes each rank
  its ObjectRef, which Ray resolves before the method runs. The rank splits its chunk into its
  micro-batches with ``verl.utils.tensordict_utils.index_select_tensor_dict`` (as verl's
  ``make_iterator`` does). TensorDicts are pickled by tensordict itself: DataProto's serialization
  switch does not apply to this path.
- ``default``: the DataProto itself through ``Dispatch.DP_COMPUTE_PROTO`` (verl's dispatch
  ``DataProto.chunk``\ s it and passes chunk ``r`` to rank ``r`` in the actor call), pickled by
  ``DataProto.__getstate__`` (``verl/protocol.py``): ``consolidate`` + ``torch.save`` into bytes, and
  ``torch.load`` on the rank.
- ``numpy``: the same with DataProto's other serialization: ``verl/protocol.py`` reads
  ``os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy"`` in ``__getstate__``/``__setstate__``,
  and then pickles each tensor as a uint8 numpy view (``serialize_tensordict``, out of band in Ray) and
  copies it back into a tensor (``deserialize_tensordict``). The variable is read at pickling time, so
  it is set on the driver around each step (verl's ``temp_env_var``) and in the ranks' environment
  (``RayWorkerGroup(worker_env=...)``); the other modes set it to ``torch``.

A rank splits its chunk into its micro-batches (row counts of its specs, in order) and runs
:func:`~bench.peers.common.run_micro_batches` on them with ``depth=0``: the chunk is already all on
the rank, a micro-batch is a slice of it. The ranks' records come back through the worker group.

Layout: a step's rows are rank 0's micro-batches' rows (in order), then rank 1's, ..., every tensor
padded to the step's longest row (verl pads the whole batch). verl's chunking only splits into equal
chunks, so when the ranks have different row counts each rank's rows are followed by copies of its
first row up to the largest (``pad_rows``; verl's ``pad_dataproto_to_divisor`` pads with copies of
rows too); padding rows travel but are never in a micro-batch.
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
from bench.peers.common import Encoder, MicroSpec, run_micro_batches, tensor_bytes

log = logging.getLogger(__name__)

MODES = ("trainer", "default", "numpy")
"""How a step's DataProto reaches the ranks (see the module docstring)."""

MESH = "train"
"""The mesh name the ranks register their data-parallel ranks under (verl's engine workers use ``train``)."""

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
    from verl.single_controller.base.decorator import (
        collect_all_to_all,
        dispatch_lazy_compute_data_proto,
        register,
    )

    dispatch: Any = _Dispatch  # a DynamicEnum: its modes are registered at import time
    # the trainer's dispatch (make_nd_compute_dataproto_dispatch_fn); its records returned as a list
    nd_dispatch = {"dispatch_fn": functools.partial(dispatch_lazy_compute_data_proto, MESH),
                   "collect_fn": collect_all_to_all}

    class VerlRankWorker(Worker):
        """One trainer rank: receives its chunk, splits it into its micro-batches, computes."""

        @register(dispatch_mode=dispatch.ONE_TO_ALL)
        def ready(self) -> int:
            import torch  # noqa: F401  (import cost outside the clock)

            import bench.peers.common  # noqa: F401

            self._register_dispatch_collect_info(MESH, dp_rank=int(self.rank), is_collect=True)
            return int(self.rank)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def update_actor(self, data: Any) -> Any:
            """``default``/``numpy``: ``data`` is this rank's DataProto chunk, unpickled by Ray before this runs."""
            t_in = time.time()
            rec = _train(data.meta_info, len(data), self.rank,
                         lambda a, b: dict(data[a:b].batch.items()))  # DataProto.slice: views of the chunk
            return DataProto.from_dict(meta_info={"metrics": {**rec, "recv_s": t_in - data.meta_info["t_dispatch"]}})

        @register(dispatch_mode=nd_dispatch)
        def update_actor_td(self, data: Any) -> dict[str, Any]:
            """``trainer``: ``data`` is this rank's TensorDict chunk, resolved from its ObjectRef by Ray."""
            import torch
            from verl.utils import tensordict_utils as tu

            t_in = time.time()
            meta = tu.get_non_tensor_data(data, "bench_meta", None)

            def rows(a: int, b: int) -> dict[str, Any]:
                mb = tu.index_select_tensor_dict(data, list(range(a, b)))
                return {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}

            return {**_train(meta, len(data), self.rank, rows), "recv_s": t_in - meta["t_dispatch"]}

    return VerlRankWorker


def _train(meta: dict[str, Any], chunk_rows: int, rank: int, rows: Any) -> dict[str, Any]:
    """A rank's step over its chunk: ``rows(a, b)`` gives rows ``[a, b)`` of the chunk as tensors."""
    micros: list[MicroSpec] = meta["micros"][rank]
    starts = np.concatenate([[0], np.cumsum([m["n_rows"] for m in micros])])
    seen: set[bytes] = set()  # images this mini-batch encoded (dedup: found by hashing the pixels)
    mini = [-1]

    def get(spec: MicroSpec) -> dict[str, Any]:
        i = spec["index"]
        tensors = rows(int(starts[i]), int(starts[i + 1]))
        value = {"tensors": tensors, "bytes": sum(tensor_bytes(t) for t in tensors.values())}
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

    rec = run_micro_batches(micros, get, ms_per_ktok=meta["ms_per_ktok"], depth=0, checksums=meta["checksums"],
                            encoder=Encoder(meta["ms_per_image"]))
    rec.update(rank=int(rank), chunk_rows=chunk_rows)
    return rec


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
        self.name = "verl_trainer" if mode == "trainer" else f"verl_dataproto_{mode}"
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
            if any(len(r) != per for r in idx):  # equal chunks: each rank's rows, then copies of its first row
                at = np.concatenate([[0], np.cumsum([len(r) for r in idx])])
                src = torch.from_numpy(np.concatenate([np.r_[at[r]:at[r + 1], np.full(per - len(x), at[r])]
                                                       for r, x in enumerate(idx)]).astype(np.int64))
                batch = {k: v[src] for k, v in batch.items()}
                self.pad_rows += per * len(idx) - len(flat)
            rows += len(flat)
            self.rank_rows.append([len(r) for r in idx])
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
            self.batches.append(DataProto.from_dict(tensors=batch))
        return {"bytes": nbytes, "rows": rows, "pad_rows": self.pad_rows, "build_s": time.perf_counter() - t0,
                "startup_s": self.startup_s}

    def step(self, s: int, per_rank: list[list[MicroSpec]], ms_per_ktok: float, ms_per_image: float = 0.0,
             dedup: bool = False) -> list[dict[str, Any]]:
        """One train step: hand step ``s``'s batch to the ranks as the mode says; their records.

        Each rank's record is :func:`~bench.peers.common.run_micro_batches`' plus ``rank``,
        ``chunk_rows`` and ``recv_s``: wall time from just before the driver started the dispatch
        (``trainer``: the TensorDict conversion, chunking and ``ray.put`` included) to the rank's method
        starting with its chunk deserialized; driver and ranks share one host's clock.
        """
        from verl.utils.py_functional import temp_env_var

        data = self.batches[s]
        if [sum(len(m["rows"]) for m in ms) for ms in per_rank] != self.rank_rows[s]:
            msg = f"step {s}: the ranks' micro-batches are not the rows loaded for it ({self.rank_rows[s]} per rank)"
            raise ValueError(msg)
        micros = [[{"index": i, "mini": m["mini"], "n_rows": len(m["rows"]), "tokens": int(m["tokens"])}
                   for i, m in enumerate(ms)] for ms in per_rank]
        meta = {"micros": micros, "ms_per_ktok": ms_per_ktok, "checksums": self.checksums,
                "ms_per_image": ms_per_image, "dedup": dedup, "t_dispatch": time.time()}
        with temp_env_var(SERIALIZATION_ENV, self.env_value):
            if self.mode == "trainer":
                recs = list(self.group.update_actor_td(_trainer_batch(data, meta)))
            else:
                data.meta_info = meta
                metrics = self.group.update_actor(data).meta_info["metrics"]  # verl's collect: concat, per key
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


def _trainer_batch(data: Any, meta: dict[str, Any]) -> Any:
    """What ``RayPPOTrainer._update_actor`` hands ``update_actor``: the batch as a TensorDict in verl's
    no-padding layout, the step's settings as non-tensor data."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch_td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(batch_td, bench_meta=meta)
    return batch_td
