"""The processes of the cluster benchmark that run on the hosts as Ray actors: rollouts, ranks, verl's workers.

* :class:`Rollout`, one per rollout/store host: makes that host's prompt groups (the same bytes from the
  same seed on every path) and hands them to each path as its rollout would: a DoPut into the store node
  on its own host (knittrans), a ``kv_batch_put`` into TransferQueue (which spreads samples over its
  storage units), and per train step one ``DataProto`` of its rows, returned to verl's driver through Ray.
* :class:`ClusterRank`, one per trainer-rank host: the knittrans rank (:class:`bench.peers.knit.KnitRank`:
  DoGets of its own slices, the next micro-batch prefetched) and the TransferQueue rank (``get_data`` of a
  ``BatchMeta`` the driver resolved once per step, one per micro-batch, the next one prefetched).
* :func:`verl_rank_class`: verl's ``Worker`` whose ``update_actor`` is registered ``DP_COMPUTE_PROTO``, as
  verl's actor worker registers it; the driver calls it on a ``RayWorkerGroup``.

Every rank ends a micro-batch with torch tensors and runs :func:`bench.peers.common.run_micro_batches`'
compute on them (every tensor touched, then the rank held ``ms_per_ktok`` per 1k tokens, CPU free).
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from bench.cluster.workload import Workload, dataproto_shards, make_group
from bench.peers.common import Encoder, MicroSpec, run_micro_batches

SERIALIZATION_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"
"""verl's switch between ``torch.save`` (any value but ``numpy``) and numpy DataProto pickling."""
TQ_FIELDS = ("prompt_ids", "response_ids", "response_logprobs", "loss_mask")
"""The trajectory fields a TransferQueue rank reads (jagged nested tensors)."""


def group_images(gid: str, w: Workload) -> list[np.ndarray]:
    """The ``images_per_group`` images of group ``gid`` (uint8 pixels, from the seed and the group id)."""
    rng = np.random.default_rng([w.seed, 1, zlib.crc32(gid.encode())])
    return [rng.integers(0, 256, w.image_shape, dtype=np.uint8) for _ in range(w.images_per_group)]


class Rollout:
    """One rollout host's output, handed to every path as that path's rollout writes it."""

    def __init__(self, index: int, store: str, serialization: str) -> None:
        import transfer_queue as tq

        from flight_store.reading import StoreReader
        from flight_store.writing import StoreWriter

        os.environ[SERIALIZATION_ENV] = serialization  # verl reads it when its DataProto is pickled
        self.index, self.store = index, store
        self.client = StoreWriter([store])
        self.reader = StoreReader.sharing(self.client)  # releases what the trainer consumed
        tq.init()  # attaches to the driver's TransferQueue controller
        self.groups: dict[str, pa.RecordBatch] = {}
        self.images: dict[str, list[np.ndarray]] = {}
        self.outputs: dict[int, Any] = {}

    def generate(self, gids: list[str], w_doc: dict[str, Any], partition: str) -> dict[str, int]:
        """Make the groups ``gids``; DoPut each (images first) to this host's store, ``kv_batch_put`` each to TQ."""
        import torch
        import transfer_queue as tq

        from bench.peers.tq import group_fields
        from schemas.images import images_to_table

        w = Workload(**w_doc)
        knit = tq_bytes = 0
        for gid in gids:
            rng = np.random.default_rng([w.seed, 0, zlib.crc32(gid.encode())])
            imgs = group_images(gid, w) if w.multimodal else []
            table, keys = images_to_table(imgs) if imgs else (None, [])
            g = make_group(gid, w, rng, keys)
            if table is not None:
                self.client.put_images(table, node=self.store)
                knit += table.nbytes
            self.client.put_group(g, node=self.store)
            knit += g.nbytes
            keys_tq, fields, tags, n = group_fields(g)
            if imgs:  # every trajectory carries its prompt's images, as verl's rollout writes each sample
                pixels = torch.from_numpy(np.stack([np.stack(imgs)] * g.num_rows))
                fields["pixel_values"] = pixels
                n += pixels.numel()
            tq.kv_batch_put(keys=keys_tq, partition_id=partition, fields=fields, tags=tags)
            tq_bytes += n
            self.groups[gid], self.images[gid] = g, imgs
        return {"knit_bytes": knit, "tq_bytes": tq_bytes}

    def prepare_verl(self, steps: list[list[str]], response_width: int) -> list[int]:
        """Each step's ``DataProto`` of this host's groups in it (verl's rollout output: padded to
        ``response_width``, images replicated into every row); tensor bytes per step."""
        import torch
        from verl.protocol import DataProto

        self.outputs, sizes = {}, []
        for s, gids in enumerate(steps):
            if not gids:
                sizes.append(0)
                continue
            table = pa.Table.from_batches([self.groups[g] for g in gids])
            batch = dataproto_shards(table, np.zeros(table.num_rows, np.float32), 1, response_width)[0]
            del batch["advantages"]  # the driver computes them (verl's compute_advantage runs on the driver)
            if self.images[gids[0]]:
                batch["pixel_values"] = torch.from_numpy(np.concatenate(
                    [np.stack([np.stack(self.images[g])] * self.groups[g].num_rows) for g in gids]))
            sizes.append(sum(t.numel() * t.element_size() for t in batch.values()))
            self.outputs[s] = DataProto.from_dict(tensors=batch)
        return sizes

    def output(self, s: int) -> Any:
        """Step ``s``'s rollout output (Ray pickles it here and the driver pulls it over this host's link)."""
        return self.outputs[s]

    def clear(self, partition: str) -> None:
        """Drop this host's groups from every path."""
        import transfer_queue as tq

        keys = [f"{g.column('group_id')[i]}:{i}" for g in self.groups.values() for i in range(g.num_rows)]
        if keys:
            tq.kv_clear(keys=keys, partition_id=partition)
        self.reader.release(list(self.groups))
        self.groups, self.images, self.outputs = {}, {}, {}


class ClusterRank:
    """One trainer-rank host's knittrans and TransferQueue ranks (one process; the paths take turns)."""

    def __init__(self, rank: int, stores: list[str]) -> None:
        import transfer_queue as tq

        from bench.peers.knit import KnitRank

        self.rank = rank
        self.knit = KnitRank(rank, stores)
        tq.init()

    def ready(self) -> int:
        return int(self.knit.ready())

    def knit_step(self, micros: list[MicroSpec], ms_per_ktok: float, mm: bool) -> dict[str, Any]:
        """knittrans: this rank's slices by DoGet, the next micro-batch prefetched (images once per mini-batch)."""
        if mm:
            return dict(self.knit.step_mm(micros, ms_per_ktok, 0.0, False, 1))
        return dict(self.knit.step(micros, ms_per_ktok, 1))

    def tq_step(self, metas: list[Any], micros: list[MicroSpec], ms_per_ktok: float) -> dict[str, Any]:
        """TransferQueue: ``get_data`` of each micro-batch's ``BatchMeta`` (resolved by the driver), prefetched."""
        import transfer_queue as tq

        from bench.peers.tq import pack_tensordict

        client = tq.get_client()

        def get(spec: MicroSpec) -> dict[str, Any]:  # packed into the trainer's tensors, as the knittrans rank does
            td = client.get_data(metas[spec["index"]])
            read = {k: (v.values() if v.is_nested else v) for k, v in td.items()}
            value: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in read.values())}
            pixels = read.pop("pixel_values", None)
            if pixels is not None:
                value["encode"] = pixels.reshape(-1, *pixels.shape[2:])
            value["tensors"] = pack_tensordict(td, spec["advantages"])
            return value

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=1, encoder=Encoder(0.0))


@functools.cache
def verl_rank_class() -> Any:
    """verl's rank: a ``Worker`` whose ``update_actor`` is ``DP_COMPUTE_PROTO`` (built on first use: no verl import
    when this module is imported)."""
    from verl.protocol import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch as _Dispatch
    from verl.single_controller.base.decorator import register

    dispatch: Any = _Dispatch

    class VerlRank(Worker):
        """Receives its chunk of the driver's DataProto, splits it into its micro-batches, computes on each."""

        @register(dispatch_mode=dispatch.ONE_TO_ALL)
        def ready(self) -> int:
            import torch  # noqa: F401  (import cost outside the clock)

            return int(self.rank)

        @register(dispatch_mode=dispatch.DP_COMPUTE_PROTO)
        def update_actor(self, data: Any) -> Any:
            t_in = time.time()
            meta = data.meta_info
            micros: list[MicroSpec] = meta["micros"][self.rank]
            starts = np.concatenate([[0], np.cumsum([m["n_rows"] for m in micros])])

            def get(spec: MicroSpec) -> dict[str, Any]:
                i = spec["index"]
                tensors = dict(data[int(starts[i]):int(starts[i + 1])].batch.items())  # DataProto slice: views
                value = {"tensors": tensors, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
                pixels = tensors.pop("pixel_values", None)
                if pixels is not None:
                    value["encode"] = pixels.reshape(-1, *pixels.shape[2:])
                return value

            rec = run_micro_batches(micros, get, ms_per_ktok=meta["ms_per_ktok"], depth=0, encoder=Encoder(0.0))
            rec.update(rank=self.rank, recv_s=t_in - meta["t_gather"], chunk_rows=len(data))
            return DataProto.from_dict(meta_info={"metrics": rec})

    return VerlRank
